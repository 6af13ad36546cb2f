"""Snapshots to Prometheus: the collector (``collector``) and the endpoints it is served on
(``endpoint``), under the one name their users import.
"""

from .collector import ExportSource, ExportView, GradmonCollector, add_view
from .endpoint import Endpoint, acquire, await_final_scrapes, release

__all__ = ["ExportSource", "ExportView", "GradmonCollector", "add_view",
           "Endpoint", "acquire", "await_final_scrapes", "release"]
