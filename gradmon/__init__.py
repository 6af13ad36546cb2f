"""gradmon: per-layer gradient health of a PyTorch training job, on a Prometheus endpoint.

    import gradmon
    monitor = gradmon.attach(model)   # hooks + exporter thread
    ...                               # the training loop, unchanged
    monitor.detach()                  # or: with gradmon.attach(model): ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["attach", "Monitor", "Config", "Coverage", "NonFiniteIncident", "GuardPersisted", "__version__"]

# The public names are imported on first use: the ``gradmon`` command imports this
# package, and ``gradmon --help`` must answer at once, without importing torch (seconds,
# and torch's own warnings about the environment).
_LAZY = {"attach": "monitor", "Monitor": "monitor", "Config": "config",
         "Coverage": "snapshot", "NonFiniteIncident": "snapshot", "GuardPersisted": "capture.stepguard"}

if TYPE_CHECKING:  # pragma: no cover
    from .config import Config
    from .monitor import Monitor, attach
    from .capture.stepguard import GuardPersisted
    from .snapshot import Coverage, NonFiniteIncident


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gradmon' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(__all__))
