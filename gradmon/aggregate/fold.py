"""One statistic's records of a step, folded per layer by its columns' declared rules.

A layer's parameter norms combine as the root of their summed squares (``NORM``), counts add
(``SUM``), extremes keep the largest or smallest, moments merge (``MOMENTS``): each column
says which in ``statistics.py``. What is folded here is one statistic's own state, the last
step's accumulators and its gauges; the counters, the origin of a non-finite run and the
spike scores that the same records feed are units of their own.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, List, Mapping, Optional, Sequence

from .. import statistics as S
from ..capture.packet import StepPacket
from ..statistics import LayerGauge, Statistic

_NO_MOMENTS = (0.0,) * len(S.MOMENT_COLUMNS)  # an empty MOMENTS accumulator


class Folded:
    """One statistic's cumulative state in the aggregator."""

    def __init__(self, stat: Statistic, n: int, windows: Mapping[str, int], slots: Optional[Sequence[int]]) -> None:
        self.stat = stat
        self.slots = slots
        """The (grouped) layer each record key stands for; None: the key is the slot (a block)."""
        self.last: Dict[int, List[float]] = {}  # the last step's accumulators per (grouped) layer
        self.gauges: Dict[LayerGauge, List[Optional[float]]] = {g: [None] * n for g in stat.gauges}
        # each baseline gauge's last values per layer, for its rolling median
        self.history: Dict[LayerGauge, List[Deque[float]]] = {
            g: [deque(maxlen=windows[g.baseline]) for _ in range(n)] for g in stat.gauges if g.baseline}
        self.total: Optional[float] = None
        columns = stat.columns
        self.nan = stat.index("nan") if stat.counter is not None else -1
        self.inf = stat.index("inf") if stat.counter is not None else -1
        self.norms = [j for j, c in enumerate(columns) if c.fold == S.NORM]
        self.sums = [j for j, c in enumerate(columns) if c.fold == S.SUM]
        self.peaks = [j for j, c in enumerate(columns) if c.fold == S.ABSMAX]
        self.lows = [j for j, c in enumerate(columns) if c.fold == S.MIN]
        self.highs = [j for j, c in enumerate(columns) if c.fold == S.MAX]
        moments = [j for j, c in enumerate(columns) if c.fold == S.MOMENTS]
        self.moments = slice(moments[0], moments[-1] + 1) if moments else None
        self.lo = stat.index("lo") if stat.forward and stat.origin else -1
        self.hi = stat.index("hi") if stat.forward and stat.origin else -1
        self.names = [c.name for c in columns]

    def combine(self, acc: Optional[List[float]], row: Sequence[float], numel: int) -> List[float]:
        """Fold one record into a layer's accumulator (NORM columns as squares, numel last)."""
        if acc is None:
            # a layer's first record (most layers have one): the fold of one value, directly
            acc = [*row, numel]
            for j in self.norms:
                acc[j] = row[j] * row[j]
            for j in self.peaks:
                acc[j] = abs(row[j])
            if self.moments is not None:
                acc[self.moments] = S.merge_moments(_NO_MOMENTS, 0, row[self.moments], numel)
            return acc
        for j in self.norms:
            acc[j] += row[j] * row[j]
        for j in self.sums:
            acc[j] += row[j]
        for j in self.peaks:
            acc[j] = S.merge_max(acc[j], abs(row[j]))
        for j in self.lows:
            acc[j] = S.merge_min(acc[j], row[j])
        for j in self.highs:
            acc[j] = S.merge_max(acc[j], row[j])
        if self.moments is not None:
            acc[self.moments] = S.merge_moments(acc[self.moments], acc[-1], row[self.moments], numel)
        acc[-1] += numel
        return acc

    def columns(self, acc: List[float]) -> Dict[str, float]:
        values = dict(zip(self.names, acc))
        for j in self.norms:
            values[self.names[j]] = math.sqrt(acc[j])
        values["numel"] = acc[-1]
        return values

    def norm_total(self, acc: Mapping[int, List[float]]) -> float:
        """The norm over every layer of this step: the root of the layers' summed squares."""
        j = self.norms[0]
        return math.sqrt(sum(a[j] for a in acc.values()))

    def layer_norms(self) -> Dict[int, float]:
        """Each layer's norm of the last step, once: a later step without records reads none."""
        j = self.norms[0]
        norms = {layer: math.sqrt(a[j]) for layer, a in self.last.items()}
        self.last = {}
        return norms

    def value(self, gauge: LayerGauge, layer: int, columns: Mapping[str, float]) -> Optional[float]:
        x = gauge.value(columns)
        if not gauge.baseline:
            return x
        window = self.history[gauge][layer]
        if x is not None and math.isfinite(x):
            window.append(x)  # a NaN step must not poison the baseline for a whole window
        return S.relative(x, window)

    def update_gauges(self, acc: Mapping[int, List[float]]) -> None:
        """Every gauge of every layer this step has records of."""
        stores = [(gauge, self.gauges[gauge]) for gauge in self.stat.gauges]
        for layer, a in acc.items():
            columns = self.columns(a)
            for gauge, store in stores:
                store[layer] = gauge.value(columns) if gauge.baseline is None else self.value(gauge, layer, columns)

    def restart(self) -> None:
        """Forget the baselines declared to restart with the spike windows."""
        for gauge, windows in self.history.items():
            if gauge.restarts:
                for window in windows:
                    window.clear()


def fused_skip(values: Sequence[float], packet: StepPacket) -> bool:
    """Whether a GradScaler flagged this step's overflow to a fused optimizer, which then
    applied nothing (see ``statistics.SCALAR_AMP_FOUND_INF``)."""
    if S.SCALAR_AMP_FOUND_INF not in packet.scalars:
        return False
    try:
        return S.read_scalars(values, packet.scalars)[S.SCALAR_AMP_FOUND_INF] != 0
    except Exception:  # an unreadable packet is a step: its parts fail where they are counted
        return False
