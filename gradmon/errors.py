"""Exceptions inside gradmon are caught, counted by stage and logged once per stage.

gradmon runs inside someone else's forward, backward and optimizer step. An error in
gradmon must cost the user a log line and a counter increment, never a training step.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict

log = logging.getLogger("gradmon")

#: The ``stage`` label values of ``gradmon_hook_errors_total``; all exist at 0 from attach.
STAGES = ("forward", "grad_flow", "backward", "step", "observe", "publish", "collect", "server")


class ErrorLog:
    """Counts caught exceptions per stage; the first one of each stage is logged with its traceback."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {s: 0 for s in STAGES}

    def record(self, stage: str, exc: BaseException, log_first: bool = True) -> None:
        """``log_first=False`` where the caller says what happened in its own line (a
        taken port is an expected condition, not a bug to show a traceback for)."""
        with self._lock:
            first = self._counts.get(stage, 0) == 0
            self._counts[stage] = self._counts.get(stage, 0) + 1
        if first and log_first:
            log.error("gradmon[%s]: error in %s stage, training continues; further %s errors "
                      "are only counted in gradmon_hook_errors_total", self._model, stage, stage,
                      exc_info=(type(exc), exc, exc.__traceback__))

    def resume(self, counts: Dict[str, int]) -> None:
        """Continue an earlier monitor's counts (same model name and labels)."""
        with self._lock:
            for stage, n in counts.items():
                self._counts[stage] = self._counts.get(stage, 0) + n

    def total(self) -> int:
        return sum(self._counts.values())  # read without the lock: a stale sum only delays a render

    def counts(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._counts)
