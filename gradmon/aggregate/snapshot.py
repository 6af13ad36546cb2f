"""The immutable snapshot the scrape thread reads, and how its parts are assembled.

A :class:`Snapshot` is built on the publisher thread when one is read after new steps (see
``Publisher.latest``), from the aggregator's units; any thread may keep it. Each of its
series is a tuple of named fields (``Bucket``, ``Origin``, ``Worst``, ...), read by the
exporter and the live page by unpacking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .. import metrics as M
from ..statistics import LayerGauge
from .coverage import Coverage, Uncovered
from .divergence import DivergenceWatch
from .fold import Folded
from .histogram import Bucket
from .origin import Origin
from .scalars import LastStep
from .spikes import SpikeTracker


class RankNonFinite(NamedTuple):
    """Non-finite elements of one tensor and kind, over all layers of this rank."""

    tensor: str
    kind: str
    count: int
    reduced: bool  # exported by rank 0 alone when every rank holds the same reduced values


class Worst(NamedTuple):
    """A worst-layer gauge: the layer it names ("" below its floor) and the largest value."""

    spec: M.MetricSpec
    layer: str
    value: float


class SignalGauge(NamedTuple):
    spec: M.MetricSpec
    signal: str
    value: float


class SpikeScore(NamedTuple):
    signal: str
    score: float  # at the signal's last scored step


class SpikeSteps(NamedTuple):
    signal: str
    steps: int  # spike steps so far; every signal that applies has one


@dataclass(frozen=True)
class LayerSeries:
    """One per-layer family of one statistic, ready to export: ``values`` holds
    (layer, value) for gauges and (layer, kind, count) for counters (plain tuples: a model
    has thousands of layers, and a snapshot is built at every scrape)."""

    spec: M.MetricSpec
    labels: Mapping[str, str]
    reduced: bool  # exported by rank 0 alone when every rank holds the same reduced values
    values: Tuple[Tuple, ...]


@dataclass(frozen=True)
class Snapshot:
    generation: int = 0
    steps_total: int = 0
    global_step: Optional[int] = None
    last_step_time: Optional[float] = None
    totals: Mapping[M.MetricSpec, float] = field(default_factory=dict)
    """Model-level gauges: of the statistics (e.g. the global norm) and of the step
    scalars (the loss); a gauge not measured yet is absent."""
    layer_gauges: Tuple[LayerSeries, ...] = ()
    layer_counters: Tuple[LayerSeries, ...] = ()
    nonfinite_steps: int = 0
    histogram: Tuple[Bucket, ...] = ()  # +Inf last
    histogram_sum: float = 0.0
    histogram_count: int = 0
    uncovered: Tuple[Uncovered, ...] = ()
    nonfinite_origin: Tuple[Origin, ...] = ()
    norm_overflow_steps: int = 0
    grouped_layers: int = 0
    amp_skipped_steps: Optional[int] = None  # None: no scaler given
    amp_loss_scale: Optional[float] = None
    coverage: Coverage = field(default_factory=Coverage)
    spike_scores: Tuple[SpikeScore, ...] = ()
    spike_steps: Tuple[SpikeSteps, ...] = ()
    learning_rates: Tuple[float, ...] = ()  # per param group of the optimizer that closed the last step
    learning_rate_over_peak: Tuple[Tuple[int, float], ...] = ()  # (group, rate over its settled peak)
    rank_nonfinite: Tuple[RankNonFinite, ...] = ()
    worst: Tuple[Worst, ...] = ()
    signal_gauges: Tuple[SignalGauge, ...] = ()
    guard_skipped_steps: Tuple[Tuple[str, int], ...] = ()  # (reason, steps); empty without a guard
    guard_last_skip: Optional[Tuple[str, int]] = None  # (reason, global step) of the latest skip; None before one

    @property
    def global_norm(self) -> Optional[float]:
        return self.totals.get(M.GRAD_GLOBAL_NORM)

    @property
    def loss(self) -> Optional[float]:
        """The last step's mean observed loss; None before ``observe(loss=...)``."""
        return self.totals.get(M.LOSS)


WORST_TIE = 1.25
"""A layer keeps the name of a worst-layer gauge while the largest value is at most this
factor above its own: near ties between layers would otherwise make a new series (a new
``layer`` label) at every scrape."""


def _largest(values: Sequence[Optional[float]]) -> Optional[int]:
    """Index of the largest value that is a number (NaN and None are not), or None."""
    best: Optional[int] = None
    for i, x in enumerate(values):
        if x is not None and x == x and (best is None or x > values[best]):  # type: ignore[operator]
            best = i
    return best


class WorstNames:
    """Which layer each worst-layer gauge names, held through near ties between snapshots."""

    def __init__(self) -> None:
        self._named: Dict[LayerGauge, int] = {}

    def pick(self, gauge: LayerGauge, values: Sequence[Optional[float]]) -> Optional[Tuple[Optional[int], float]]:
        """(the layer a worst-layer gauge names, or None below its floor; the largest value)."""
        top = _largest(values)
        if top is None:
            return None
        largest = values[top]
        if gauge.worst_floor is not None and not largest >= gauge.worst_floor:  # type: ignore[operator]
            self._named.pop(gauge, None)
            return None, largest  # type: ignore[return-value]
        held = self._named.get(gauge)
        kept = values[held] if held is not None else None
        if kept is not None and kept == kept and largest <= kept * WORST_TIE:  # type: ignore[operator]
            top = held
        self._named[gauge] = top
        return top, largest  # type: ignore[return-value]


class PerLayer(NamedTuple):
    gauges: Tuple[LayerSeries, ...]
    counters: Tuple[LayerSeries, ...]
    rank_nonfinite: Tuple[RankNonFinite, ...]
    worst: Tuple[Worst, ...]


def per_layer(folded: Iterable[Folded], cells: Mapping[str, List[List[int]]], names: Sequence[str],
              worst_names: WorstNames) -> PerLayer:
    """The per-layer series of every statistic: its gauges from the folds, its non-finite
    counters from ``cells`` (statistic -> per layer [NaN, Inf]), and the worst layers."""
    gauges, counters, rank_counts, worst = [], [], [], []
    for f in folded:
        f.settle()
        st = f.stat
        for gauge in st.gauges:
            values = f.gauges[gauge]
            if gauge.per_layer:
                gauges.append(LayerSeries(gauge.spec, gauge.labels, st.reduced,
                                          tuple((names[i], x) for i, x in enumerate(values) if x is not None)))
            if gauge.worst is not None:
                top = worst_names.pick(gauge, values)
                if top is not None:
                    worst.append(Worst(gauge.worst, names[top[0]] if top[0] is not None else "", top[1]))
        stat_cells = cells.get(st.name) if st.counter is not None else None
        if stat_cells is not None:
            counters.append(LayerSeries(st.counter, st.counter_labels, st.reduced, tuple(  # type: ignore[arg-type]
                (names[i], kind, cell[k]) for i, cell in enumerate(stat_cells)
                for k, kind in enumerate(M.NONFINITE_KINDS))))
            if st.rank_tensor is not None:
                rank_counts += [RankNonFinite(st.rank_tensor, kind, sum(cell[k] for cell in stat_cells), st.reduced)
                                for k, kind in enumerate(M.NONFINITE_KINDS)]
    return PerLayer(tuple(gauges), tuple(counters), tuple(rank_counts), tuple(worst))


def totals(folded: Iterable[Folded], last: LastStep, divergence: DivergenceWatch) -> Dict[M.MetricSpec, float]:
    """The model-level gauges measured so far: the statistics' totals, the runs of steps
    above a baseline, the loss and the divergence watch's state."""
    folded = tuple(folded)
    out = {f.stat.total: f.total for f in folded if f.stat.total is not None and f.total is not None}
    for f in folded:
        out.update(f.longest_streaks())
    d = divergence
    out.update((spec, v) for spec, v in (
        (M.LOSS, last.loss), (M.LOSS_RUNNING_MIN, last.loss_running_min), (M.LOSS_TREND, d.trend.value),
        (M.LOSS_TREND_BEST, d.trend.best), (M.LOSS_RISING_STEPS, d.rising_steps),
        (M.LOSS_DIVERGING_STEPS, d.diverging_steps), (M.LOSS_DIVERGENCES, d.divergences)) if v is not None)
    return out  # type: ignore[return-value]


def signal_gauges(spikes: SpikeTracker, divergence: DivergenceWatch) -> Tuple[SignalGauge, ...]:
    """Steps since each signal's last spike and last burst of spikes, and the signals that are
    evidence of a divergence now."""
    out = tuple(SignalGauge(spec, signal, float(n)) for spec, since in (
        (M.STEPS_SINCE_SPIKE, spikes.steps_since()), (M.STEPS_SINCE_SPIKE_BURST, spikes.steps_since_burst()))
        for signal, n in since.items())
    return out + tuple(SignalGauge(M.DIVERGENCE_EVIDENCE, signal, 1.0) for signal in sorted(divergence.evidence))


def spike_series(spikes: SpikeTracker) -> Tuple[Tuple[SpikeScore, ...], Tuple[SpikeSteps, ...]]:
    return (tuple(SpikeScore(*pair) for pair in spikes.scores.items()),
            tuple(SpikeSteps(*pair) for pair in spikes.spikes.items()))
