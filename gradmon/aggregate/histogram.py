"""The global gradient norm's histogram (``gradmon_grad_global_norm``): one observation per step."""

from __future__ import annotations

import bisect
import math
from typing import List, NamedTuple, Sequence, Tuple

from .. import metrics as M


class Bucket(NamedTuple):
    """One bucket as Prometheus exposes it: its upper bound and the count at or below it."""

    bound: float
    cumulative: int


class NormHistogram:
    """Counts per bucket (the last one +Inf), the sum and the count of the observed norms."""

    def __init__(self, bounds: Sequence[float] = M.GLOBAL_NORM_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts: List[int] = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; +Inf last
        self.sum = 0.0
        self.count = 0

    def observe(self, norm: float, overflow: bool) -> None:
        # A norm of non-finite elements is already counted by the non-finite counters; an
        # overflow is counted in +Inf and as an overflow step. Adding either to the sum would
        # turn it into Inf/NaN for the rest of the process.
        if overflow:
            self.counts[-1] += 1
            self.count += 1
        if not math.isfinite(norm):
            return
        self.counts[bisect.bisect_left(self.bounds, norm)] += 1
        self.sum += norm
        self.count += 1

    def buckets(self) -> Tuple[Bucket, ...]:
        """Cumulative counts by upper bound, +Inf last."""
        out, running = [], 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts):
            running += count
            out.append(Bucket(bound, running))
        return tuple(out)

    def saved(self) -> Tuple[Tuple[int, ...], float, int]:
        """What a later monitor of the same name continues from (see :meth:`resume`)."""
        return tuple(self.counts), self.sum, self.count

    def resume(self, saved: Tuple[Sequence[int], float, int]) -> None:
        counts, total, count = saved
        self.counts = [a + b for a, b in zip(self.counts, counts)]
        self.sum += total
        self.count += count
