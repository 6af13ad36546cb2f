"""Build time: the files generated from one definition of gradmon's alerts and dashboards.

The Prometheus rules (``rules``: recording rules and the alert families, ``health``,
``liveness``, ``spikes``, ``signals``), the Grafana-managed alert rules (``grafana``), the
Alertmanager config (``alertmanager``) and the Grafana dashboards (``dashboards``, built
from ``panels`` and the panels the statistics declare) are written into ``deploy/`` and
``dashboards/``, and the reference's tables of options and metrics (``reference``) into
``docs/``, by ``files`` (``python -m gradmon.alerting write``; ``check`` fails when a
committed file differs).

No thread of a training process runs this package: it runs at build time and in tests.
May import: the shared declarations at the top of the package (``metrics``, ``thresholds``,
``statistics``, ``config``) and its own modules. Nothing at runtime imports it (``gradmon top`` and the
demo read the numbers from ``thresholds``): tests/test_layout.py checks it.
"""
