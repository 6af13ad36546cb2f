"""The step guard's skips (``guard=``), counted from each step's packet on the publisher
thread: by reason, the run of them, the exclude list of skipped batches, and the moment the
guard gives up (a run longer than ``guard_max_skips``).

The training thread decided on the device and packed its verdict (``statistics.guard_verdict``);
nothing here can change what the optimizer did, only say it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import statistics as S
from ..errors import ErrorLog

log = logging.getLogger("gradmon")

EXCLUDE_FILE = "exclude.jsonl"
"""The file in ``incident_dir`` where each skipped step's batch is listed, one JSON object a line."""

KIND_GUARD = "guard"
"""The ``kind`` of the incident bundle written at the guard's first skip (``gradmon incident`` reads it)."""

OnPersist = Callable[[str, int, int], None]
"""Called with (the last reason, the run of bad steps, the global step) when the guard gives up."""


class ExcludeList:
    """``incident_dir/exclude.jsonl``: one line per skipped step and rank, with the sample
    ids ``observe(batch=...)`` gave for it, so that a resumed job can leave them out.
    Appended, never rewritten: a job resumed from a checkpoint adds to it."""

    def __init__(self, directory: str, model: str, rank: int, errors: ErrorLog) -> None:
        self.path = os.path.join(directory, EXCLUDE_FILE)
        self._directory, self._model, self._rank, self._errors = directory, model, rank, errors

    def append(self, step: int, reason: str, ids: Optional[List[Any]]) -> None:
        line = {"step": step, "rank": self._rank, "model": self._model, "reason": reason,
                "ids": ids if ids is not None else [], "ids_known": ids is not None, "time": round(time.time(), 3)}
        try:
            os.makedirs(self._directory, exist_ok=True)
            # one write of one line on an O_APPEND file: the ranks sharing the directory do not interleave lines
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, default=str) + "\n")
        except (OSError, TypeError, ValueError) as exc:
            self._errors.record("publish", exc)


class GuardSkips:
    """The skips of one monitor's guard and its run of bad steps."""

    def __init__(self, reasons: Sequence[str], max_skips: int, on_persist: Optional[OnPersist] = None,
                 exclude: Optional[ExcludeList] = None, ids: Optional[Callable[[int], Optional[List[Any]]]] = None,
                 bundle: Optional[Callable[[int, str], None]] = None) -> None:
        """``bundle(step, reason)`` writes the incident bundle of the first skip (a non-finite
        step's own bundle, written first in the same fold, stands for it)."""
        self.skipped: Dict[str, int] = {reason: 0 for reason in reasons}
        self.max_skips = max_skips
        self.persisted = 0  # runs of bad steps the guard gave up on
        self.first_skip: Optional[int] = None  # the global step of the first skip since attach
        self.last: Optional[Tuple[str, int]] = None  # (reason, global step) of the latest skip since attach
        self._on_persist = on_persist
        self._exclude = exclude
        self._ids = ids
        self._bundle = bundle
        self._reason: Optional[str] = None  # the reason of the last skip of the current run
        self._gave_up = False  # the current run is past max_skips (said once)

    def fold(self, scalars: Mapping[str, float], global_step: int) -> Optional[str]:
        """One step's verdict: the reason it was skipped, or None."""
        reason, run = S.guard_verdict(scalars)
        if reason is not None:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
            self._reason = reason
            self.last = (reason, global_step)
            if self.first_skip is None:
                self.first_skip = global_step
                if self._bundle is not None:
                    self._bundle(global_step, reason)
            if self._exclude is not None:
                self._exclude.append(global_step, reason, self._ids(global_step) if self._ids is not None else None)
        if run == 0:
            self._gave_up = False
        elif run > self.max_skips and not self._gave_up:
            self._gave_up = True
            self.persisted += 1
            if self._on_persist is not None:
                self._on_persist(self._reason or "nonfinite", run, global_step)
        return reason

    def series(self) -> Tuple[Tuple[str, int], ...]:
        return tuple(self.skipped.items())

    def saved(self) -> Tuple[Dict[str, int], Optional[Tuple[str, int]]]:
        """The counts by reason, and the latest skip: a later monitor of the same model
        exports it until a skip of its own (its counters say a skip happened, the gauge
        says which step)."""
        return dict(self.skipped), self.last

    def resume(self, counts: Mapping[str, int], last: Optional[Tuple[str, int]] = None) -> None:
        for reason, n in counts.items():
            if reason in self.skipped:
                self.skipped[reason] += n
        if self.last is None and last is not None and last[0] in self.skipped:
            self.last = last
