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
from typing import (Callable, Deque, Dict, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple)

import torch

from .. import metrics as M
from .. import statistics as S
from ..capture.packet import StepPacket
from ..statistics import LayerGauge, Statistic
from ..thresholds import Thresholds

_NO_MOMENTS = (0.0,) * len(S.MOMENT_COLUMNS)  # an empty MOMENTS accumulator
_PLANS = 8  # record layouts kept per statistic: a step's layout is nearly always the last one's

AT_ONCE_MIN = 256
"""Fewest records of a section folded all at once (:meth:`Folded.accumulate`): its dozen
tensor operations cost a fixed time each, which a few hundred records folded one by one
in Python cost less than (docs/benchmark.md)."""


class Plan(NamedTuple):
    """Which (grouped) layer each record of a section stands for, worked out once per
    layout of keys (the same keys come back every step)."""

    layers: List[int]
    """Each layer with records, in the order of its first record (the accumulators' order)."""
    of_record: List[int]
    """Each record's layer."""
    inverse: Optional[torch.Tensor]
    """Each record's position in ``layers``; None where every layer has one record, in order."""
    first: Optional[torch.Tensor]
    """Each layer's first record (None with ``inverse``)."""


ARRIVED_MAX = 64
"""Values of an ``above`` gauge that wait at most for the next snapshot's median: a monitor
nobody scrapes judges them every this many, so that they never pile up."""


class Folded:
    """One statistic's cumulative state in the aggregator."""

    def __init__(self, stat: Statistic, n: int, windows: Mapping[str, int], slots: Optional[Sequence[int]],
                 roles: Optional[Mapping[str, FrozenSet[int]]] = None) -> None:
        """``roles``: the (grouped) layers of each role a gauge may be declared for
        (``LayerGauge.role``); a role not given has no layers."""
        self.stat = stat
        self.slots = slots
        """The (grouped) layer each record key stands for; None: the key is the slot (a block)."""
        self.last: Dict[int, List[float]] = {}  # the last step's accumulators per (grouped) layer
        self.gauges: Dict[LayerGauge, List[Optional[float]]] = {g: [None] * n for g in stat.gauges}
        # each baseline gauge's last values per layer, for its rolling median
        self.history: Dict[LayerGauge, List[Deque[float]]] = {
            g: [deque(maxlen=windows[g.baseline]) for _ in range(n)] for g in stat.gauges if g.baseline}
        # each baseline gauge's values whose ratio waits for settle(), by layer
        self._unsettled: Dict[LayerGauge, Dict[int, Optional[float]]] = {g: {} for g in self.history}
        # each ``above`` gauge's run of steps above its threshold per layer, and the values
        # given since the last settle() (each is judged against the median settle() reads)
        self.streaks: Dict[LayerGauge, List[int]] = {g: [0] * n for g in stat.gauges if g.above is not None}
        self._arrived: Dict[LayerGauge, Dict[int, List[Optional[float]]]] = {g: {} for g in self.streaks}
        self._above = {g: g.above[0](Thresholds()) for g in self.streaks}  # type: ignore[index]
        self._growths = {g: Growth(g, n, (roles or {}).get(g.role, frozenset()) if g.role is not None else None)
                         for g in stat.gauges if g.role is not None or g.since_first}
        self.events: List[str] = []
        """The signals of the doublings reached since the aggregator last took them."""
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
        # gauges that read one column as it is: read without a mapping per layer
        self._column_of = {g: self.names.index(g.value.column) for g in stat.gauges
                           if isinstance(g.value, S.ColumnValue)}
        # MOMENTS merge pairwise, record by record: such a statistic folds row by row
        self.at_once = self.moments is None
        # whether anything reads the accumulators (BLOCK_FINITE's records only flag an origin)
        self.keeps = bool(stat.gauges or stat.total is not None or stat.coverage)
        self._rules = [(cols, rule) for cols, rule in ((self.peaks + self.highs, "amax"), (self.lows, "amin")) if cols]
        self._plans: Dict[Tuple[int, ...], Plan] = {}
        self._numels: Optional[Tuple[Plan, Tuple[int, ...], List[int]]] = None

    def folds_at_once(self, records: int) -> bool:
        """Whether a section of ``records`` records is folded all at once."""
        return self.at_once and records >= AT_ONCE_MIN

    def plan(self, keys: Tuple[int, ...]) -> Plan:
        plan = self._plans.get(keys)
        if plan is None:
            of_record = list(keys) if self.slots is None else [self.slots[k] for k in keys]
            layers = list(dict.fromkeys(of_record))
            inverse = first = None
            if len(layers) != len(of_record):
                where: Dict[int, int] = {}
                for k, layer in enumerate(of_record):
                    where.setdefault(layer, k)
                position = {layer: i for i, layer in enumerate(layers)}
                inverse = torch.tensor([position[layer] for layer in of_record])
                first = torch.tensor([where[layer] for layer in layers])
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            plan = self._plans[keys] = Plan(layers, of_record, inverse, first)
        return plan

    def accumulate(self, plan: Plan, numels: Sequence[int], table: torch.Tensor) -> Dict[int, List[float]]:
        """Every record of a step folded per layer at once, as :meth:`combine` would fold
        them one by one (the same sums in the same order, bit for bit): ``table`` is the
        (n, width) float64 table of the records laid out by ``plan``. Not for MOMENTS
        (:attr:`at_once` is False)."""
        src = table.clone() if self.norms or self.peaks else table
        for j in self.norms:  # column views, squared in place: no gather and scatter of columns
            col = src[:, j]
            col.mul_(col)
        for j in self.peaks:
            src[:, j].abs_()
        if plan.inverse is None:
            out, counts = src, list(numels)
        else:
            out, counts = self._reduce(src, plan, numels)
        rows = out.tolist()
        for row, n in zip(rows, counts):
            row.append(n)
        return dict(zip(plan.layers, rows))

    def _reduce(self, src: torch.Tensor, plan: Plan, numels: Sequence[int]) -> Tuple[torch.Tensor, List[int]]:
        """Each layer's records of ``src`` reduced by their columns' rules: sums in record
        order (``index_add_`` adds one record after another), extremes with NaN kept."""
        inverse, m = plan.inverse, len(plan.layers)
        added = self.norms + self.sums
        if len(added) == src.shape[1]:  # every column sums (a gradient's): one pass, no gather
            out = src.new_zeros(m, src.shape[1]).index_add_(0, inverse, src)
        else:
            out = src[plan.first]  # a column without a rule keeps the first record's value, as combine does
            if added:
                out[:, added] = src.new_zeros(m, len(added)).index_add_(0, inverse, src[:, added])
        for cols, rule in self._rules:
            part = src[:, cols]
            where = inverse.unsqueeze(1).expand(-1, len(cols))
            best = src.new_zeros(m, len(cols)).scatter_reduce_(0, where, part, rule, include_self=False)
            nan = src.new_zeros(m, len(cols)).index_add_(0, inverse, part.isnan().to(src.dtype))
            out[:, cols] = best.masked_fill_(nan > 0, math.nan)
        return out, self._layer_numels(plan, numels)

    def _layer_numels(self, plan: Plan, numels: Sequence[int]) -> List[int]:
        """Each layer's elements, summed over its records: the same every step while the
        parameters are (the last layout's sums are kept)."""
        kept = self._numels
        if kept is not None and kept[0] is plan and kept[1] == numels:
            return kept[2]
        counts = [0] * len(plan.layers)
        for at, n in zip(plan.inverse.tolist(), numels):  # type: ignore[union-attr]
            counts[at] += n
        self._numels = (plan, tuple(numels), counts)
        return counts

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

    def _column(self, acc: Mapping[int, List[float]], j: int) -> List[Optional[float]]:
        """Column ``j`` of every layer's accumulator, as :meth:`columns` gives it."""
        if j in self.norms:
            return [math.sqrt(a[j]) for a in acc.values()]
        return [a[j] for a in acc.values()]

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

    def _baselines(self, gauge: LayerGauge, layers: Iterable[int], values: Sequence[Optional[float]],
                   enters: bool) -> None:
        """One step's values of a baseline gauge, by layer: each waits for :meth:`settle` and,
        with ``enters``, joins its layer's window."""
        windows = self.history[gauge]
        unsettled = self._unsettled[gauge]
        for layer, x in zip(layers, values):
            if enters and x is not None and math.isfinite(x):
                windows[layer].append(x)  # a NaN step must not poison the baseline for a whole window
            unsettled[layer] = x
        arrived = self._arrived.get(gauge)
        if arrived is None:
            return
        for layer, x in zip(layers, values):
            waiting = arrived.get(layer)
            if waiting is None:
                arrived[layer] = [x]
                continue
            waiting.append(x)
            if len(waiting) >= ARRIVED_MAX:  # no snapshot for a while (nothing scrapes): judge them now
                self.streaks[gauge][layer] = _streak(self.streaks[gauge][layer], waiting,
                                                     S.baseline_median(windows[layer]), self._above[gauge])
                waiting.clear()

    def settle(self) -> None:
        """The ratios to their baselines of the values given since the last call, into the
        gauges: a median per layer when a snapshot reads them, not every step. Each is the
        ratio its own step would have had: a layer's window changes only with the layer's
        next value, which replaces the one waiting, and at a restart, which settles first."""
        for gauge, unsettled in self._unsettled.items():
            windows, store, arrived = self.history[gauge], self.gauges[gauge], self._arrived.get(gauge)
            for layer, x in unsettled.items():
                base = S.baseline_median(windows[layer])  # once for the ratio and the run
                store[layer] = S.relative(x, base)
                values = arrived.pop(layer, None) if arrived is not None else None
                if values is not None:
                    self.streaks[gauge][layer] = _streak(self.streaks[gauge][layer], values, base, self._above[gauge])
            unsettled.clear()

    def longest_streaks(self) -> Dict[M.MetricSpec, int]:
        """Each ``above`` gauge's longest current run among layers (settled first)."""
        self.settle()
        return {gauge.above[1]: max(runs, default=0) for gauge, runs in self.streaks.items()}  # type: ignore[index]

    def update_gauges(self, acc: Mapping[int, List[float]], baseline: bool = True
                      ) -> Dict[LayerGauge, List[Optional[float]]]:
        """Every gauge of every layer this step has records of (a baseline ratio waits for
        :meth:`settle`; ``baseline``: whether this step's values enter the baselines); each
        gauge's values, in ``acc``'s order of layers. Gauges read alike (a norm and its
        ratio) read it once."""
        if not self.stat.gauges:
            return {}
        columns: Optional[List[Dict[str, float]]] = None
        read: Dict[Callable[[Mapping[str, float]], Optional[float]], List[Optional[float]]] = {}
        out = {}
        for gauge in self.stat.gauges:
            values = read.get(gauge.value)
            if values is None:
                j = self._column_of.get(gauge)
                if j is not None:
                    values = self._column(acc, j)
                else:
                    if columns is None:
                        columns = list(map(self.columns, acc.values()))
                    values = list(map(gauge.value, columns))
                read[gauge.value] = values
            growth = self._growths.get(gauge)
            if growth is not None:
                if growth.update(self.gauges[gauge], acc, values):
                    self.events.append(gauge.doublings[1])  # type: ignore[index]
            elif gauge.baseline is None:
                store = self.gauges[gauge]
                for layer, x in zip(acc, values):
                    store[layer] = x
            else:
                self._baselines(gauge, acc, values, baseline)
            out[gauge] = values
        return out

    def restart(self) -> None:
        """Forget the baselines declared to restart with the spike windows."""
        self.settle()
        for gauge, windows in self.history.items():
            if gauge.restarts:
                for window in windows:
                    window.clear()
                if gauge in self.streaks:
                    self.streaks[gauge] = [0] * len(windows)


class Growth:
    """A gauge kept for its role's layers only (``layers``; None: every layer) and, with
    ``since_first``, each value over the layer's first finite, positive one (until there
    is one: none); with ``doublings``, whether a step took a layer to a new doubling of
    the bar (bar x 2^k, k = 0, 1, ...)."""

    def __init__(self, gauge: LayerGauge, n: int, layers: Optional[FrozenSet[int]]) -> None:
        self.layers = layers
        self.first: Optional[List[Optional[float]]] = [None] * n if gauge.since_first else None
        self.bar = gauge.doublings[0](Thresholds()) if gauge.doublings is not None else None
        self.reached = [-1] * n  # the highest doubling each layer reached (-1: none)

    def update(self, store: List[Optional[float]], layers: Iterable[int], values: Sequence[Optional[float]]) -> bool:
        """One step's values into ``store`` (the gauge's, by layer); True if a layer reached
        a new doubling."""
        first, wanted, bar, reached = self.first, self.layers, self.bar, self.reached
        doubled = False
        for layer, x in zip(layers, values):
            if wanted is not None and layer not in wanted:
                continue
            if first is not None:
                if first[layer] is None:
                    first[layer] = x if x is not None and 0.0 < x < math.inf else None
                x = S.relative(x, first[layer]) if first[layer] is not None else None
            store[layer] = x
            if bar is not None and x is not None and bar <= x < math.inf:
                level = int(math.log2(x / bar))
                if level > reached[layer]:
                    reached[layer] = level
                    doubled = True
        return doubled


def _streak(run: int, values: Sequence[Optional[float]], base: Optional[float], above: float) -> int:
    """``run`` carried on through ``values`` (oldest first): one more for each value above
    ``above`` times the baseline's median ``base``, back to 0 at any other (a missing or
    non-finite value, or any while there is no baseline yet: ``base`` None)."""
    if base is None:
        return 0
    bar = above * base
    for x in values:
        run = run + 1 if x is not None and x > bar else 0
    return run


def fused_skip(values: Sequence[float], packet: StepPacket) -> bool:
    """Whether a GradScaler flagged this step's overflow to a fused optimizer, which then
    applied nothing (see ``statistics.SCALAR_AMP_FOUND_INF``)."""
    if S.SCALAR_AMP_FOUND_INF not in packet.scalars:
        return False
    try:
        return S.read_scalars(values, packet.scalars)[S.SCALAR_AMP_FOUND_INF] != 0
    except Exception:  # an unreadable packet is a step: its parts fail where they are counted
        return False
