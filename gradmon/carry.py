"""What a monitor continues from an earlier one of the same model name and labels in this
process, and leaves for a later one: its counters, its error counts and the seconds its
hooks spent. A counter back at 0 under the same labels reads to ``rate()`` as a reset, so a
model attached again (a notebook cell run twice, a sweep's trial) continues where it ended.
"""

from __future__ import annotations

from typing import Hashable, Optional

from .aggregate import Aggregator, CarriedCounters
from .errors import ErrorLog


class CarryOver:
    def __init__(self, store: CarriedCounters) -> None:
        self._store = store
        self.overhead_before = 0.0  # seconds carried from an earlier monitor (exported only)
        self.overhead_at_detach = 0.0

    def resume(self, key: Hashable, aggregator: Aggregator, errors: ErrorLog) -> None:
        """Continue what an earlier monitor under ``key`` left, if any."""
        carried = self._store.get(key)
        if carried is not None:
            counters, counts, overhead = carried
            aggregator.resume(counters)
            errors.resume(counts)
            self.overhead_before = overhead

    def taken(self, key: Hashable) -> None:
        """This monitor runs: what it continued is in its own counters now."""
        self._store.pop(key, None)

    def stopped(self, overhead: float) -> None:
        """The hooks are gone, having spent ``overhead`` seconds."""
        self.overhead_at_detach = self.overhead_before + overhead

    def overhead(self, live: Optional[float]) -> float:
        """The seconds to export: with the hooks' ``live`` seconds while they run."""
        if live is not None:
            return self.overhead_before + live
        return max(self.overhead_at_detach, self.overhead_before)

    def leave(self, key: Hashable, counters: object, errors: ErrorLog) -> None:
        """For a later monitor under ``key`` to continue."""
        self._store[key] = (counters, errors.counts(), self.overhead_at_detach)
