"""gradmon: per-layer gradient health of a PyTorch training job, on a Prometheus endpoint.

    import gradmon
    monitor = gradmon.attach(model)   # hooks + exporter thread
    ...                               # the training loop, unchanged
    monitor.detach()                  # or: with gradmon.attach(model): ...
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config
from .monitor import Monitor, attach
from .snapshot import Coverage, NonFiniteIncident

__all__ = ["attach", "Monitor", "Config", "Coverage", "NonFiniteIncident", "__version__"]
