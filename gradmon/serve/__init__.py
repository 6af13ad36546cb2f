"""The scrape thread: from the publisher's latest immutable snapshot to bytes on a socket.

The Prometheus collector (``collector``) and the endpoints shared between monitors of one
process (``endpoint``; ``exporter`` names both), process and device-memory gauges read at
scrape time (``process``), the HTTP server and its limits (``server``), TLS (``tls``), the
live page and its static files (``ui``, ``static/``), and the final scrape at the end of a
run (``run_end``).

May import: the shared declarations (``config``, ``metrics``, ``statistics``, ``errors``) and
the snapshot it reads (``snapshot``, ``history``). Never the training side (``capture``): a
scrape reads a published snapshot, never the training thread's live objects. Never the
build-time generators (``alerting``).
"""
