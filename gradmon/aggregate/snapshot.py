"""Per-step packets in, immutable snapshots out: the host side of the data path.

The training thread hands one :class:`StepPacket` per optimizer step to the
:class:`Publisher`'s queue and goes on. The publisher thread waits for the packet's
device-to-host copy, folds it into cumulative state (:class:`Aggregator`: counters that
never reset, the last value of each gauge, the global-norm histogram) and publishes a
fresh immutable :class:`Snapshot`. The exporter only ever reads snapshots.
"""

from __future__ import annotations

import bisect
import logging
import math
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import (Callable, Deque, Dict, FrozenSet, Hashable, Iterator, List, Mapping, Optional, Sequence,
                    Set, Tuple)

from .. import metrics as M
from .history import History
from ..incidents.recorder import BatchIds, BlackBox
from .. import statistics as S
from ..errors import ErrorLog
from .divergence import DivergenceWatch
from .spikes import SpikeTracker
from ..capture.packet import GlobalStepUpdate, StepPacket
from ..statistics import LayerGauge, Section, Statistic

log = logging.getLogger("gradmon")


@dataclass(frozen=True)
class NonFiniteIncident:
    """Where a run of non-finite steps started, as ``on_nonfinite`` receives it."""

    model: str
    rank: int
    step: int
    grad_layer: Optional[str]
    """First layer in backward order whose gradient (flow or parameter) went non-finite."""
    activation_layer: Optional[str]
    """First layer in forward order whose output went non-finite (detail steps only)."""
    block: Optional[str] = None
    """Where the run started, every step: ``input`` when the batch itself carried new
    non-finite values, else the first of the root module's direct children in forward
    order whose output did (``output``: the root's own code after its children)."""
    origin_step: Optional[int] = None
    """The run's first step, whose origin every later step of the run repeats (the
    weights are poisoned after it: everything is non-finite everywhere)."""


@dataclass(frozen=True, eq=False)  # eq=False keeps Mapping's ==, so it still equals a plain dict
class Coverage(Mapping[str, FrozenSet[str]]):
    """What gradmon could observe, as ``Monitor.coverage()`` returns it.

    It reads as ``{layer: families observed so far}`` (``grad``, ``grad_flow``,
    ``activation``, ``optimizer``); the fields say which families apply to a layer and at which moment
    the gradients were measured."""

    observed: Mapping[str, FrozenSet[str]] = field(default_factory=dict)
    """Families observed so far, per layer (what indexing the mapping returns)."""
    expected: Mapping[str, FrozenSet[str]] = field(default_factory=dict)
    """Families that apply to each layer: the enabled ones, less ``grad`` for a layer
    that owns no parameter of its own (see ``tied``)."""
    tied: Mapping[str, str] = field(default_factory=dict)
    """Layers whose every parameter is shared with an earlier module (GPT-2's
    ``lm_head``, whose weight is ``wte.weight``) -> that module. Their weights' gradient
    is reported once, under the owner: not a gap."""
    measured_at_step: int = 0
    """Steps whose gradients reached the optimizer without autograd accumulating them
    into the monitored parameters (``.grad`` assigned by hand after
    ``torch.autograd.grad``): their norms were measured at the optimizer step, after any
    ``clip_grad_norm_``, so they are not pre-clip. 0: every step was measured at the end
    of its backward pass."""
    limits: Tuple[str, ...] = ()
    """Whole-model limits on what is measured, one sentence each (FSDP1 flat parameters
    without ``use_orig_params``, DeepSpeed ZeRO), as logged at attach."""

    def __getitem__(self, layer: str) -> FrozenSet[str]:
        return self.observed[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.observed)

    def __len__(self) -> int:
        return len(self.observed)

    def gaps(self) -> Dict[str, FrozenSet[str]]:
        """Per layer, the families that apply but were not observed. Judge it after a
        detail step (``detail_every``): before one, activations and grad flow are unseen."""
        out = {}
        for layer, families in self.expected.items():
            missing = families - self.observed.get(layer, frozenset())
            if missing:
                out[layer] = missing
        return out


@dataclass(frozen=True)
class Snapshot:
    generation: int = 0
    steps_total: int = 0
    global_step: Optional[int] = None
    last_step_time: Optional[float] = None
    totals: Mapping[M.MetricSpec, float] = field(default_factory=dict)
    """Model-level gauges: of the statistics (e.g. the global norm) and of the step
    scalars (the loss); a gauge not measured yet is absent."""
    layer_gauges: Tuple["LayerSeries", ...] = ()
    layer_counters: Tuple["LayerSeries", ...] = ()
    nonfinite_steps: int = 0
    histogram: Tuple[Tuple[float, int], ...] = ()  # (upper bound, cumulative count), +Inf last
    histogram_sum: float = 0.0
    histogram_count: int = 0
    uncovered: Tuple[Tuple[str, int], ...] = ()  # family, layers it cannot observe
    nonfinite_origin: Tuple[Tuple[str, str, int], ...] = ()  # tensor, layer, global step
    norm_overflow_steps: int = 0
    grouped_layers: int = 0
    amp_skipped_steps: Optional[int] = None  # None: no scaler given
    amp_loss_scale: Optional[float] = None
    coverage: Coverage = field(default_factory=Coverage)
    spike_scores: Tuple[Tuple[str, float], ...] = ()  # signal, score at its last scored step
    spike_steps: Tuple[Tuple[str, int], ...] = ()  # signal, spike steps; every signal that applies
    learning_rates: Tuple[float, ...] = ()  # per param group of the optimizer that closed the last step
    rank_nonfinite: Tuple[Tuple[str, str, int, bool], ...] = ()  # tensor, kind, count over all layers, reduced
    worst: Tuple[Tuple[M.MetricSpec, str, float], ...] = ()  # spec, layer, its largest value over layers
    signal_gauges: Tuple[Tuple[M.MetricSpec, str, float], ...] = ()  # spec, signal, value

    @property
    def global_norm(self) -> Optional[float]:
        return self.totals.get(M.GRAD_GLOBAL_NORM)

    @property
    def loss(self) -> Optional[float]:
        """The last step's mean observed loss; None before ``observe(loss=...)``."""
        return self.totals.get(M.LOSS)


@dataclass(frozen=True)
class LayerSeries:
    """One per-layer family of one statistic, ready to export: ``values`` holds
    (layer, value) for gauges and (layer, kind, count) for counters."""

    spec: M.MetricSpec
    labels: Mapping[str, str]
    reduced: bool  # exported by rank 0 alone when every rank holds the same reduced values
    values: Tuple[Tuple, ...]


_NO_MOMENTS = (0.0,) * len(S.MOMENT_COLUMNS)  # an empty MOMENTS accumulator


class _Folded:
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
        self.cells: Optional[List[List[int]]] = [[0, 0] for _ in range(n)] if stat.counter is not None else None
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

    def value(self, gauge: LayerGauge, layer: int, columns: Mapping[str, float]) -> Optional[float]:
        x = gauge.value(columns)
        if not gauge.baseline:
            return x
        window = self.history[gauge][layer]
        if x is not None and math.isfinite(x):
            window.append(x)  # a NaN step must not poison the baseline for a whole window
        return S.relative(x, window)

    def restart(self) -> None:
        """Forget the baselines declared to restart with the spike windows."""
        for gauge, windows in self.history.items():
            if gauge.restarts:
                for window in windows:
                    window.clear()


def _fused_skip(values: Sequence[float], packet: StepPacket) -> bool:
    """Whether a GradScaler flagged this step's overflow to a fused optimizer, which then
    applied nothing (see ``statistics.SCALAR_AMP_FOUND_INF``)."""
    if S.SCALAR_AMP_FOUND_INF not in packet.scalars:
        return False
    try:
        return S.read_scalars(values, packet.scalars)[S.SCALAR_AMP_FOUND_INF] != 0
    except Exception:  # an unreadable packet is a step: its parts fail where they are counted
        return False


class Aggregator:
    """Cumulative state of one monitor. Used only by the publisher thread."""

    def __init__(self, layer_names: Sequence[str], param_layer: Sequence[int],
                 statistics: Sequence[Statistic], model: str,
                 layer_group: Optional[Sequence[int]] = None, rank: int = 0,
                 on_incident: Optional[Callable[[NonFiniteIncident, bool], None]] = None, amp: bool = False,
                 tied: Optional[Mapping[int, str]] = None, block_names: Sequence[str] = (),
                 spikes: Optional[SpikeTracker] = None, windows: Optional[Mapping[str, int]] = None,
                 history: Optional[History] = None, divergence: Optional[DivergenceWatch] = None) -> None:
        """``layer_names`` are the exported names (groups, when grouping); ``layer_group``
        maps the recorder's layer index to them; ``param_layer`` maps each parameter to
        the recorder's layer index; ``tied`` maps a recorder layer without parameters of
        its own to the module that owns them; ``block_names`` names the BLOCK records'
        keys (``input``, the root's children, ``output``); ``spikes`` scores the loss and
        the statistics' totals (default: every signal, default settings); ``windows`` the
        length of each baseline gauge's window by its Config field (see ``LayerGauge.baseline``)."""
        self.layer_names = tuple(layer_names)
        self.layer_group = tuple(layer_group) if layer_group is not None else tuple(range(len(layer_names)))
        self.param_layer = tuple(self.layer_group[layer] for layer in param_layer)
        # The grad family applies exactly where a measured parameter lives: the same
        # mapping the recorder measures by, so expectation and measurement cannot drift.
        self.grad_layers = frozenset(self.param_layer)
        self.all_layers = frozenset(range(len(self.layer_names)))
        self.tied = {self.layer_names[self.layer_group[layer]]: owner for layer, owner in (tied or {}).items()
                     if self.layer_group[layer] not in self.grad_layers}
        self.rank = rank
        self.amp = amp
        self.limits: Tuple[str, ...] = ()  # see Coverage.limits; added by Publisher.add_limit
        self.on_incident = on_incident
        self.block_names = tuple(block_names)
        self.origin: Dict[str, Tuple[str, int]] = {}  # tensor -> (layer or block, global step)
        self._in_incident = False
        self._in_grad_run = False
        # (tensor, key) -> non-finite kinds its forward values held on the last step whose
        # gradients were finite: a -Inf a float mask always carries is no step's origin.
        self._baseline: Dict[Tuple[str, int], int] = {}
        self.norm_overflow_steps = 0
        self.statistics = tuple(statistics)
        self.families = tuple(st.coverage for st in self.statistics if st.coverage)  # enabled families
        self._model = model
        n = len(self.layer_names)
        windows = {**{g.baseline: S.MIN_BASELINE for st in self.statistics for g in st.gauges if g.baseline},
                   **(windows or {})}
        self.folded: Dict[str, _Folded] = {
            st.name: _Folded(st, n, windows, None if st.at == S.BLOCK else
                             self.param_layer if st.by_parameter else self.layer_group) for st in self.statistics}
        self.steps_total = 0
        self.global_step: Optional[int] = None
        self.last_step_time: Optional[float] = None
        self.nonfinite_steps = 0
        self.bounds = M.GLOBAL_NORM_BUCKETS
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # last one is +Inf
        self.hist_sum = 0.0
        self.hist_count = 0
        self.seen: Dict[str, set] = {f: set() for f in M.FAMILIES}
        self.amp_skipped_steps = 0
        self.amp_loss_scale: Optional[float] = None
        self.learning_rates: Tuple[float, ...] = ()
        self.detail_backward_steps = 0
        self.measured_at_step = 0
        self._gaps_logged = False
        self.generation = 0
        self.loss: Optional[float] = None
        self.loss_running_min: Optional[float] = None
        self.history = history  # the live page's ring buffers, filled step by step here
        self.black_box: Optional[BlackBox] = None  # the incident bundles' steps, kept here; set by attach
        self._named: Dict[LayerGauge, int] = {}  # the layer each worst-layer gauge names now
        self._step_loss: Optional[float] = None
        self.spikes = spikes if spikes is not None else SpikeTracker(
            S.spike_signals(self.statistics, reduced_here=True), raw_below_zero=(M.SIGNAL_LOSS,))
        self.divergence = divergence if divergence is not None else DivergenceWatch()

    # -- counters that outlive a monitor ------------------------------------------

    def counters(self) -> Dict[str, object]:
        """Every counter, keyed by layer name rather than index, for :meth:`resume`."""
        names = self.layer_names
        return {
            "steps_total": self.steps_total, "nonfinite_steps": self.nonfinite_steps,
            "amp_skipped_steps": self.amp_skipped_steps, "norm_overflow_steps": self.norm_overflow_steps,
            "histogram": (tuple(self.bucket_counts), self.hist_sum, self.hist_count),
            "nonfinite": {(stat, names[i], k): cell[k] for stat, f in self.folded.items() if f.cells
                          for i, cell in enumerate(f.cells) for k in range(2) if cell[k]},
            "spike_steps": dict(self.spikes.spikes),
            "divergence": self.divergence.counters(),
        }

    def resume(self, saved: Mapping[str, object]) -> None:
        """Continue the counters of an earlier monitor with the same model name and
        labels: a counter that went back to 0 and climbed past its old value between two
        scrapes would hide increments from rate() and increase()."""
        self.steps_total += saved["steps_total"]  # type: ignore[operator]
        self.nonfinite_steps += saved["nonfinite_steps"]  # type: ignore[operator]
        self.amp_skipped_steps += saved["amp_skipped_steps"]  # type: ignore[operator]
        self.norm_overflow_steps += saved.get("norm_overflow_steps", 0)  # type: ignore[operator]
        buckets, hist_sum, hist_count = saved["histogram"]  # type: ignore[misc]
        self.bucket_counts = [a + b for a, b in zip(self.bucket_counts, buckets)]
        self.hist_sum += hist_sum
        self.hist_count += hist_count
        self.spikes.resume(saved.get("spike_steps", {}))  # type: ignore[arg-type]
        self.divergence.resume(saved.get("divergence", {}))  # type: ignore[arg-type]
        index = {name: i for i, name in enumerate(self.layer_names)}
        for (stat, name, k), count in saved["nonfinite"].items():  # type: ignore[union-attr]
            cells = self.folded[stat].cells if stat in self.folded else None
            if cells is not None and name in index:
                cells[index[name]][k] += count

    # -- folding -------------------------------------------------------------------

    def relabel(self, global_step: int, skipped: bool = False) -> None:
        """``monitor.step(n)`` renumbered the last step (not a resume), or numbered a step
        the scaler skipped, which scored nothing to renumber."""
        self.global_step = global_step
        if not skipped:
            self.spikes.relabel(global_step)

    def fold(self, packet: StepPacket) -> None:
        values: List[float] = packet.data.tolist() if packet.data is not None else []
        if self.black_box is not None:
            self.black_box.keep(packet)  # never raises: a bundle's trouble must not cost a step's count
        skipped = packet.skipped or _fused_skip(values, packet)
        # Count the step before parsing anything else: a packet that fails to parse must
        # still be a step, or rate(gradmon_steps_total) would lie.
        if skipped:
            self.amp_skipped_steps += 1
            self.amp = True  # a fused optimizer's skip shows it even without scaler=
        else:
            self.steps_total += 1
            self.global_step = packet.global_step
            self.last_step_time = packet.time
            if packet.measured_at_step:
                self._count_measured_at_step()
        self._fold_scalars(values, packet)
        if skipped and self.history is not None:
            self._remember(packet.global_step, skipped=True)
        if skipped:
            return
        if packet.data is None:
            self.divergence.step(self._step_loss, self.spikes.this_step)
            return
        self._step_origin: Dict[str, int] = {}
        self._flags: Dict[Tuple[str, int], int] = {}
        self._grads_bad = False
        any_bad = False
        for stat, section, rows in S.read(values, packet.sections):
            any_bad |= self._fold(self.folded[stat.name], section, rows, packet.sampled)
        if any_bad:
            self.nonfinite_steps += 1
        self._incident(any_bad, packet.global_step)
        if self.history is not None:
            self._remember(packet.global_step, any_bad)
        if packet.detail and any(sec.statistic is S.GRAD for sec in packet.sections):
            self.detail_backward_steps += 1
            self._log_gaps_once()
        self.divergence.step(self._step_loss, self.spikes.this_step)

    def _remember(self, step: int, nonfinite: bool = False, skipped: bool = False) -> None:
        """One row of the live page's history: the global norm and each layer's gradient
        norm of this step (the statistic that declares the global norm; none for a step
        the scaler skipped), loss, first lr."""
        grad = None if skipped else next((f for f in self.folded.values() if f.stat.histogram is not None), None)
        norms: Dict[int, float] = {}
        if grad is not None and grad.last:
            j = grad.norms[0]
            norms = {layer: math.sqrt(a[j]) for layer, a in grad.last.items()}
            grad.last = {}  # a later step without gradient records gets an empty row, not these
        self.history.record(step, grad.total if grad is not None else None, self._step_loss,  # type: ignore[union-attr]
                            self.learning_rates[0] if self.learning_rates else None, nonfinite, norms, skipped)

    def _fold_scalars(self, values: Sequence[float], packet: StepPacket) -> None:
        """The step scalars; first the learning rates, which restart the spike windows
        when they jump, then what is scored."""
        scalars = S.read_scalars(values, packet.scalars)
        if S.SCALAR_AMP_SCALE in scalars:
            self.amp_loss_scale = scalars[S.SCALAR_AMP_SCALE]
        lrs = tuple(scalars.get(S.learning_rate_scalar(group), math.nan) if lr is None else lr
                    for group, lr in enumerate(packet.learning_rates))
        self.learning_rates = lrs or self.learning_rates
        restarts = self.spikes.restarts
        self.spikes.new_step(packet.global_step, tuple(lr if math.isfinite(lr) else None for lr in lrs))
        if self.spikes.restarts != restarts:
            for folded in self.folded.values():
                folded.restart()
        if self.spikes.resumed:
            self.divergence.restart()
        loss = self._step_loss = scalars.get(S.SCALAR_LOSS)
        if loss is not None:
            self.loss = loss
            if math.isfinite(loss) and (self.loss_running_min is None or loss < self.loss_running_min):
                self.loss_running_min = loss
            self.spikes.observe(M.SIGNAL_LOSS, loss)

    def _incident(self, bad: bool, step: int) -> None:
        # The origin is decided on the first step of a run of steps with non-finite
        # gradients and kept until a finite step ends the run: after it the weights are
        # poisoned and every later step is non-finite everywhere.
        if not self._grads_bad:
            self._baseline.update(self._flags)
        elif not self._in_grad_run:
            self.origin = {tensor: (name, step) for tensor, name in self._step_origins().items()}
        self._in_grad_run = self._grads_bad
        starts = bad and not self._in_incident
        self._in_incident = bad
        if bad and self.on_incident is not None:
            origin = self.origin if self._grads_bad else {}
            name = lambda t: origin[t][0] if t in origin else None  # noqa: E731
            first = min((s for _, s in origin.values()), default=None)
            self.on_incident(NonFiniteIncident(self._model, self.rank, step, name(M.TENSOR_GRAD),
                                               name(M.TENSOR_ACTIVATION), name(M.TENSOR_BLOCK), first), starts)

    def _step_origins(self) -> Dict[str, str]:
        """This step's origin per ``tensor``: gradients first in backward order; forward
        values first in forward order among those holding a kind of non-finite value they
        did not hold on the last finite step."""
        out = {tensor: self.layer_names[layer] for tensor, layer in self._step_origin.items()}
        new: Dict[str, int] = {}
        for (tensor, key), flags in self._flags.items():
            if flags & ~self._baseline.get((tensor, key), 0) and (tensor not in new or key < new[tensor]):
                new[tensor] = key
        for tensor, key in new.items():
            out[tensor] = self.block_names[key] if tensor == M.TENSOR_BLOCK else self.layer_names[key]
        return out

    def _mark_origin(self, tensor: str, layer: int) -> None:
        """Keep the first layer in backward order."""
        known = self._step_origin.get(tensor)
        if known is None or layer > known:
            self._step_origin[tensor] = layer

    def _count(self, cells: List[List[int]], layer: int, nan: float, inf: float, origin: Optional[str],
               forward: bool) -> bool:
        if not (nan or inf):
            return False
        if origin is not None and not forward:
            self._grads_bad = True
            self._mark_origin(origin, layer)
        cells[layer][0] += int(nan)
        cells[layer][1] += int(inf)
        return True

    def _fold(self, f: _Folded, section: Section, rows: Sequence[Sequence[float]], sampled: bool) -> bool:
        """One statistic's records of one step, folded per (grouped) layer by its columns'
        declared rules; counts its NaN/Inf into the counters. True if any was non-finite."""
        stat = f.stat
        acc: Dict[int, List[float]] = {}
        bad = False
        slots, lo, hi, cells, nan, inf = f.slots, f.lo, f.hi, f.cells, f.nan, f.inf
        for key, numel, row in zip(section.keys, section.numels, rows):
            layer = key if slots is None else slots[key]
            acc[layer] = f.combine(acc.get(layer), row, numel)
            if lo >= 0:
                flags = S.nonfinite_flags(row[lo], row[hi])
                if flags:
                    self._flags[(stat.origin, layer)] = self._flags.get((stat.origin, layer), 0) | flags
                else:
                    self._flags.setdefault((stat.origin, layer), 0)
            if cells is not None and (row[nan] or row[inf]):  # counts: a call only for a non-finite record
                bad |= self._count(cells, layer, row[nan], row[inf], stat.origin, stat.forward)
        f.last = acc
        if stat.coverage:
            self.seen[stat.coverage].update(acc)
        if stat.total is not None:
            j = f.norms[0]
            f.total = math.sqrt(sum(a[j] for a in acc.values()))
            # every element finite and yet an infinite norm: float32's range, not a NaN incident
            overflow = f.total == math.inf and not bad
            self.norm_overflow_steps += overflow and stat.histogram is not None
            if stat.histogram is not None:
                self._observe(f.total, overflow)
            if stat.spike is not None:
                self.spikes.observe(stat.spike, f.total)
        if sampled or not stat.sampled:
            stores = [(gauge, f.gauges[gauge]) for gauge in stat.gauges]
            for layer, a in acc.items():
                columns = f.columns(a)
                for gauge, store in stores:
                    store[layer] = gauge.value(columns) if gauge.baseline is None else f.value(gauge, layer, columns)
            for gauge in stat.gauges:
                if gauge.jump is not None:
                    self.spikes.observe_layers(gauge.jump, {layer: gauge.value(f.columns(a)) for layer, a in acc.items()})
        return bad

    def _observe(self, norm: float, overflow: bool) -> None:
        # A norm of non-finite elements is already counted by the non-finite counters; an
        # overflow is counted in +Inf and _count. Adding either to _sum would turn it
        # into Inf/NaN for the rest of the process.
        if overflow:
            self.bucket_counts[-1] += 1
            self.hist_count += 1
        if not math.isfinite(norm):
            return
        self.bucket_counts[bisect.bisect_left(self.bounds, norm)] += 1
        self.hist_sum += norm
        self.hist_count += 1

    # -- coverage ------------------------------------------------------------------

    def coverage(self) -> Coverage:
        # read-only views: the snapshot's coverage is shared with every reader
        return Coverage(
            observed=MappingProxyType({name: frozenset(f for f in M.FAMILIES if i in self.seen[f])
                                       for i, name in enumerate(self.layer_names)}),
            expected=MappingProxyType({name: frozenset(st.coverage for st in self.statistics
                                                       if st.coverage and i in self._expected_layers(st))
                                       for i, name in enumerate(self.layer_names)}),
            tied=MappingProxyType(dict(self.tied)), measured_at_step=self.measured_at_step, limits=self.limits)

    def _expected_layers(self, st: Statistic) -> FrozenSet[int]:
        """Layers ``st`` can observe: a statistic of parameters only those where a measured
        parameter lives (not a tied head whose weight another layer owns)."""
        return self.grad_layers if st.by_parameter else self.all_layers

    def _count_measured_at_step(self) -> None:
        self.measured_at_step += 1
        if self.measured_at_step == 1:
            log.warning("gradmon[%s]: gradients reached the optimizer without autograd accumulating them into "
                        "the monitored parameters (e.g. .grad assigned by hand after torch.autograd.grad); they "
                        "are measured at the optimizer step, after any clipping (Monitor.coverage()"
                        ".measured_at_step counts such steps)", self._model)

    def uncovered(self) -> Dict[str, int]:
        """Layers each enabled family applies to but has not observed, once there is
        evidence to judge: the grad family after one step with gradients, the others after
        one detail step."""
        n = len(self.layer_names)
        out = {}
        for st in self.statistics:
            if not st.coverage:
                continue
            if not (self.detail_backward_steps if st.detail else self.steps_total):
                if st.detail:
                    out[st.coverage] = 0  # no evidence yet, and nothing to report
                continue
            out[st.coverage] = len(self._expected_layers(st) - self.seen[st.coverage])
        return out

    def _log_gaps_once(self) -> None:
        if self._gaps_logged:
            return
        self._gaps_logged = True
        gaps = [f"{name} ({', '.join(f for f in self.families if f in missing)})"
                for name, missing in self.coverage().gaps().items()]
        if gaps:
            hint = ""
            if not self.seen[M.FAMILY_ACTIVATION] and not self.seen[M.FAMILY_GRAD_FLOW]:
                hint = (" No forward hook ran in a training forward: under torch.compile gradmon's per-layer "
                        "hooks are no-ops (gradient norms and non-finite counts still cover every step; a NaN's "
                        "origin is told only as the model's input or output, not a block).")
            log.warning("gradmon[%s]: %d layer(s) not fully observable, reported in "
                        "gradmon_uncovered_layers and Monitor.coverage(): %s.%s", self._model,
                        len(gaps), "; ".join(gaps[:20]) + (" ..." if len(gaps) > 20 else ""), hint)

    # -- snapshot ------------------------------------------------------------------

    def _worst_layer(self, gauge: LayerGauge, values: Sequence[Optional[float]]
                     ) -> Optional[Tuple[Optional[int], float]]:
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

    def snapshot(self) -> Snapshot:
        self.generation += 1
        names = self.layer_names

        gauges, counters, rank_counts, worst = [], [], [], []
        for f in self.folded.values():
            st = f.stat
            for gauge in st.gauges:
                values = f.gauges[gauge]
                if gauge.per_layer:
                    gauges.append(LayerSeries(gauge.spec, gauge.labels, st.reduced,
                                              tuple((names[i], x) for i, x in enumerate(values) if x is not None)))
                if gauge.worst is not None:
                    top = self._worst_layer(gauge, values)
                    if top is not None:
                        worst.append((gauge.worst, names[top[0]] if top[0] is not None else "", top[1]))
            if st.counter is not None and f.cells is not None:
                counters.append(LayerSeries(st.counter, st.counter_labels, st.reduced, tuple(
                    (names[i], kind, cell[k]) for i, cell in enumerate(f.cells)
                    for k, kind in enumerate(M.NONFINITE_KINDS))))
                if st.rank_tensor is not None:
                    rank_counts += [(st.rank_tensor, kind, sum(cell[k] for cell in f.cells), st.reduced)
                                    for k, kind in enumerate(M.NONFINITE_KINDS)]
        totals = {f.stat.total: f.total for f in self.folded.values()
                  if f.stat.total is not None and f.total is not None}
        d = self.divergence
        totals.update((spec, v) for spec, v in (
            (M.LOSS, self.loss), (M.LOSS_RUNNING_MIN, self.loss_running_min), (M.LOSS_TREND, d.trend.value),
            (M.LOSS_TREND_BEST, d.trend.best), (M.LOSS_RISING_STEPS, d.rising_steps),
            (M.LOSS_DIVERGING_STEPS, d.diverging_steps), (M.LOSS_DIVERGENCES, d.divergences)) if v is not None)
        signal_gauges = tuple((M.STEPS_SINCE_SPIKE, signal, float(n)) for signal, n in self.spikes.steps_since().items())
        signal_gauges += tuple((M.DIVERGENCE_EVIDENCE, signal, 1.0) for signal in sorted(d.evidence))
        cumulative, running = [], 0
        for bound, count in zip(list(self.bounds) + [math.inf], self.bucket_counts):
            running += count
            cumulative.append((bound, running))
        return Snapshot(
            generation=self.generation, steps_total=self.steps_total,
            global_step=self.global_step, last_step_time=self.last_step_time,
            totals=totals, layer_gauges=tuple(gauges), layer_counters=tuple(counters),
            nonfinite_steps=self.nonfinite_steps, histogram=tuple(cumulative),
            histogram_sum=self.hist_sum, histogram_count=self.hist_count,
            uncovered=tuple(sorted(self.uncovered().items())), coverage=self.coverage(),
            nonfinite_origin=tuple((tensor, name, step) for tensor, (name, step) in sorted(self.origin.items())),
            norm_overflow_steps=self.norm_overflow_steps,
            grouped_layers=len(self.layer_group) - len(self.layer_names),
            amp_skipped_steps=self.amp_skipped_steps if self.amp else None, amp_loss_scale=self.amp_loss_scale,
            spike_scores=tuple(self.spikes.scores.items()), spike_steps=tuple(self.spikes.spikes.items()),
            learning_rates=self.learning_rates, rank_nonfinite=tuple(rank_counts), worst=tuple(worst),
            signal_gauges=signal_gauges)


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


class CarriedCounters:
    """Counters of detached monitors by (model name, labels), for a monitor attached again
    under the same name and labels to continue: a counter back at 0 under the same labels
    reads to rate() as a reset, and what it counted before is lost from increase().

    At most ``most`` are kept, the least recently stored dropped first, so that a process
    attaching thousands of differently labelled models (a sweep) does not keep every
    one's per-layer counters. A dropped key's series end: it is remembered (its hash, a
    few dozen bytes) as ended, and ``attach()`` gives a later monitor another name rather
    than start those series again from 0."""

    def __init__(self, most: int = 64) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._kept: Dict[Hashable, object] = {}  # insertion order: the oldest first
        self._ended: Set[int] = set()

    def __setitem__(self, key: Hashable, counters: object) -> None:
        with self._lock:
            self._kept.pop(key, None)
            while len(self._kept) >= self.most:
                oldest = next(iter(self._kept))
                del self._kept[oldest]
                self._ended.add(hash(oldest))
            self._kept[key] = counters

    def get(self, key: Hashable) -> Optional[object]:
        with self._lock:
            return self._kept.get(key)

    def pop(self, key: Hashable, default: Optional[object] = None) -> Optional[object]:
        with self._lock:
            return self._kept.pop(key, default)

    def ended(self, key: Hashable) -> bool:
        """Whether ``key``'s counters were dropped: its series must not start again."""
        with self._lock:
            return key not in self._kept and hash(key) in self._ended

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._ended.clear()

    def __len__(self) -> int:
        return len(self._kept)


_STOP = object()


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


class Publisher:
    """The thread between the training thread and the exporter."""

    def __init__(self, aggregator: Aggregator, errors: ErrorLog, name: str) -> None:
        self._agg = aggregator
        self._errors = errors
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"gradmon-publisher-{name}", daemon=True)
        # Folding and building a snapshot both read the aggregator; reentrant, because an
        # on_nonfinite callback runs inside a fold and may ask for a snapshot.
        self._lock = threading.RLock()
        self._stale = False
        # Built before the thread starts: every counter exists at 0 from attach().
        self._latest: Snapshot = aggregator.snapshot()
        self._thread.start()

    @property
    def latest(self) -> Snapshot:
        """The newest snapshot: immutable, so any thread may keep it. Built when read
        after new steps were folded, not at every step: a scrape every 15 s builds one
        where a step every 100 ms would build 150, each taking the training thread's
        interpreter lock and CPU."""
        with self._lock:
            if self._stale:
                try:
                    self._latest = self._agg.snapshot()
                except Exception as exc:  # pragma: no cover - snapshot building is plain Python
                    self._errors.record("publish", exc)
                self._stale = False
            return self._latest

    def put(self, item: object) -> None:
        self._queue.put(item)

    def add_limit(self, text: str) -> None:
        """State a limit of coverage found after attach (see ``Coverage.limits``)."""
        with self._lock:
            self._agg.limits += (text,)
            self._stale = True

    def flush(self, timeout: float) -> bool:
        if not self._thread.is_alive():
            return False
        token = _Flush()
        self._queue.put(token)
        return token.done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued items. From the publisher thread itself (a detach() in
        an on_nonfinite callback) it cannot wait for itself: the thread stops after the
        item it is folding."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)

    def counters(self) -> Dict[str, object]:
        """The aggregator's counters; call after close() (or from the publisher thread)."""
        return self._agg.counters()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            try:
                while True:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            stop = False
            flushes = []
            with self._lock:
                for item in batch:
                    if item is _STOP:
                        stop = True
                    elif isinstance(item, _Flush):
                        flushes.append(item)
                    else:
                        self._fold(item)
                        self._stale = True
            for token in flushes:
                token.done.set()
            if stop:
                return

    def _fold(self, item: object) -> None:
        try:
            if isinstance(item, GlobalStepUpdate):
                self._agg.relabel(item.global_step, item.skipped)
                return
            if isinstance(item, BatchIds):
                if self._agg.black_box is not None:
                    self._agg.black_box.batch(item.ids)
                return
            event = getattr(item, "event", None)
            if event is not None:
                event.synchronize()
            self._agg.fold(item)  # type: ignore[arg-type]
        except Exception as exc:
            self._errors.record("publish", exc)
