"""Clients: programs a user runs beside, or instead of, a training job.

The ``gradmon`` command (``cli``), the terminal view of an endpoint (``top``) and the HTTP
client it reads through (``fetch``), the demo training run (``demo``), and the cleaning of
text from a possibly hostile peer before it reaches a terminal or a page (``sanitize``).

They run in their own process: ``demo`` trains with ``gradmon.attach`` like any user script.
May import: gradmon's public surface, the shared declarations (``config``, ``metrics``,
``statistics``, ``errors``), ``incidents`` (to read a bundle) and each other. ``demo`` and ``top``
check the alert thresholds, still from ``alerting`` until issue 23 moves them to a shared module.
"""
