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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import metrics as M
from .errors import ErrorLog

log = logging.getLogger("gradmon")


@dataclass(frozen=True)
class StepPacket:
    """What one optimizer step measured, still in the packed device layout.

    ``data`` holds, in order: 3*P values (sums of squares, then NaN and Inf counts, per
    parameter gradient listed in ``grad_params``), 3*R activation floats (L2 norm, min,
    max) and 2*R activation counts (one record per entry of ``act_meta``), Q grad-flow
    norms and 2*Q counts (one per entry of ``flow_meta``), L local norms and 2*L local
    counts (one per entry of ``local_params``), and the loss scale if ``amp_scale``.
    """

    index: int
    global_step: int
    time: float
    data: object = None  # a host tensor, valid once ``event`` has completed
    event: object = None
    grad_params: Tuple[int, ...] = ()
    act_meta: Tuple[Tuple[int, int], ...] = ()  # (layer index, numel) per forward call
    flow_meta: Tuple[int, ...] = ()  # layer index per grad-flow hook call
    local_params: Tuple[int, ...] = ()  # parameters with a local (pre-all-reduce) record
    amp_scale: bool = False  # the last value is the GradScaler's loss scale
    skipped: bool = False  # an overflow step the GradScaler skipped: data holds only the scale
    sampled: bool = True
    detail: bool = False
    measured_at_step: bool = False  # gradients measured at the optimizer step, not at the end of backward


@dataclass(frozen=True)
class GlobalStepUpdate:
    """``monitor.step(n)`` after the optimizer already published the step: relabel it."""

    global_step: int


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


@dataclass(frozen=True, eq=False)  # eq=False keeps Mapping's ==, so it still equals a plain dict
class Coverage(Mapping[str, FrozenSet[str]]):
    """What gradmon could observe, as ``Monitor.coverage()`` returns it.

    It reads as ``{layer: families observed so far}`` (``grad``, ``grad_flow``,
    ``activation``); the fields say which families apply to a layer and at which moment
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
    global_norm: Optional[float] = None
    grad_norm: Tuple[Tuple[str, float], ...] = ()
    grad_flow_norm: Tuple[Tuple[str, float], ...] = ()
    activation_rms: Tuple[Tuple[str, float], ...] = ()
    activation_abs_max: Tuple[Tuple[str, float], ...] = ()
    nonfinite: Tuple[Tuple[str, str, str, int], ...] = ()  # layer, tensor, kind, count
    nonfinite_steps: int = 0
    histogram: Tuple[Tuple[float, int], ...] = ()  # (upper bound, cumulative count), +Inf last
    histogram_sum: float = 0.0
    histogram_count: int = 0
    uncovered: Tuple[Tuple[str, int], ...] = ()  # family, layers it cannot observe
    local_view: bool = False
    local_global_norm: Optional[float] = None
    local_grad_norm: Tuple[Tuple[str, float], ...] = ()
    local_nonfinite: Tuple[Tuple[str, str, int], ...] = ()  # layer, kind, count
    nonfinite_origin: Tuple[Tuple[str, str, int], ...] = ()  # tensor, layer, global step
    grouped_layers: int = 0
    amp_skipped_steps: Optional[int] = None  # None: no scaler given
    amp_loss_scale: Optional[float] = None
    coverage: Coverage = field(default_factory=Coverage)


def _merge_max(a: float, b: float) -> float:
    # max() drops NaN depending on argument order; a NaN activation must stay visible.
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a >= b else b


class Aggregator:
    """Cumulative state of one monitor. Used only by the publisher thread."""

    def __init__(self, layer_names: Sequence[str], param_layer: Sequence[int],
                 families: Sequence[str], model: str, local_view: bool = False,
                 layer_group: Optional[Sequence[int]] = None, rank: int = 0,
                 on_incident: Optional[Callable[[NonFiniteIncident, bool], None]] = None, amp: bool = False,
                 tied: Optional[Mapping[int, str]] = None) -> None:
        """``layer_names`` are the exported names (groups, when grouping); ``layer_group``
        maps the recorder's layer index to them; ``param_layer`` maps each parameter to
        the recorder's layer index; ``tied`` maps a recorder layer without parameters of
        its own to the module that owns them."""
        self.layer_names = tuple(layer_names)
        self.layer_group = tuple(layer_group) if layer_group is not None else tuple(range(len(layer_names)))
        self.param_layer = tuple(self.layer_group[layer] for layer in param_layer)
        # The grad family applies exactly where a measured parameter lives: the same
        # mapping the recorder measures by, so expectation and measurement cannot drift.
        self.grad_layers = frozenset(self.param_layer)
        self.tied = {self.layer_names[self.layer_group[layer]]: owner for layer, owner in (tied or {}).items()
                     if self.layer_group[layer] not in self.grad_layers}
        self.rank = rank
        self.amp = amp
        self.on_incident = on_incident
        self.origin: Dict[str, Tuple[int, int]] = {}  # tensor -> (layer, global step)
        self._in_incident = False
        self.families = tuple(families)  # enabled families
        self._model = model
        n = len(self.layer_names)
        tensors = [M.TENSOR_GRAD] + [f for f in (M.TENSOR_GRAD_FLOW, M.TENSOR_ACTIVATION) if f in families]
        self.nonfinite: Dict[str, List[List[int]]] = {t: [[0, 0] for _ in range(n)] for t in tensors}
        self.steps_total = 0
        self.global_step: Optional[int] = None
        self.last_step_time: Optional[float] = None
        self.global_norm: Optional[float] = None
        self.nonfinite_steps = 0
        self.grad_norm: List[Optional[float]] = [None] * n
        self.grad_flow_norm: List[Optional[float]] = [None] * n
        self.activation_rms: List[Optional[float]] = [None] * n
        self.activation_abs_max: List[Optional[float]] = [None] * n
        self.bounds = M.GLOBAL_NORM_BUCKETS
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # last one is +Inf
        self.hist_sum = 0.0
        self.hist_count = 0
        self.seen: Dict[str, set] = {f: set() for f in M.FAMILIES}
        self.local_view = local_view
        self.amp_skipped_steps = 0
        self.amp_loss_scale: Optional[float] = None
        self.local_nonfinite: List[List[int]] = [[0, 0] for _ in range(n)]
        self.local_grad_norm: List[Optional[float]] = [None] * n
        self.local_global_norm: Optional[float] = None
        self.detail_backward_steps = 0
        self.measured_at_step = 0
        self._gaps_logged = False
        self.generation = 0

    # -- counters that outlive a monitor ------------------------------------------

    def counters(self) -> Dict[str, object]:
        """Every counter, keyed by layer name rather than index, for :meth:`resume`."""
        names = self.layer_names
        return {
            "steps_total": self.steps_total, "nonfinite_steps": self.nonfinite_steps,
            "amp_skipped_steps": self.amp_skipped_steps,
            "histogram": (tuple(self.bucket_counts), self.hist_sum, self.hist_count),
            "nonfinite": {(tensor, names[i], k): cell[k] for tensor, cells in self.nonfinite.items()
                          for i, cell in enumerate(cells) for k in range(2) if cell[k]},
            "local_nonfinite": {(names[i], k): cell[k] for i, cell in enumerate(self.local_nonfinite)
                                for k in range(2) if cell[k]},
        }

    def resume(self, saved: Mapping[str, object]) -> None:
        """Continue the counters of an earlier monitor with the same model name and
        labels: a counter that went back to 0 and climbed past its old value between two
        scrapes would hide increments from rate() and increase()."""
        self.steps_total += saved["steps_total"]  # type: ignore[operator]
        self.nonfinite_steps += saved["nonfinite_steps"]  # type: ignore[operator]
        self.amp_skipped_steps += saved["amp_skipped_steps"]  # type: ignore[operator]
        buckets, hist_sum, hist_count = saved["histogram"]  # type: ignore[misc]
        self.bucket_counts = [a + b for a, b in zip(self.bucket_counts, buckets)]
        self.hist_sum += hist_sum
        self.hist_count += hist_count
        index = {name: i for i, name in enumerate(self.layer_names)}
        for (tensor, name, k), count in saved["nonfinite"].items():  # type: ignore[union-attr]
            if tensor in self.nonfinite and name in index:
                self.nonfinite[tensor][index[name]][k] += count
        for (name, k), count in saved["local_nonfinite"].items():  # type: ignore[union-attr]
            if name in index:
                self.local_nonfinite[index[name]][k] += count

    # -- folding -------------------------------------------------------------------

    def fold(self, packet: StepPacket) -> None:
        if packet.skipped:
            self.amp_skipped_steps += 1
            if packet.data is not None:
                self.amp_loss_scale = packet.data.tolist()[-1]
            return
        # Count the step before parsing anything: a packet that fails to parse must
        # still be a step, or rate(gradmon_steps_total) would lie.
        self.steps_total += 1
        self.global_step = packet.global_step
        self.last_step_time = packet.time
        if packet.measured_at_step:
            self._count_measured_at_step()
        if packet.data is None:
            return
        values: List[float] = packet.data.tolist()
        if packet.amp_scale:
            self.amp_loss_scale = values[-1]
        self._step_origin: Dict[str, int] = {}
        any_bad = self._fold_grads(packet, values)
        offset = 3 * len(packet.grad_params)
        any_bad |= self._fold_activations(packet.act_meta, values, offset)
        offset += 5 * len(packet.act_meta)
        any_bad |= self._fold_grad_flow(packet.flow_meta, values, offset)
        offset += 3 * len(packet.flow_meta)
        any_bad |= self._fold_local(packet.local_params, values, offset)
        if any_bad:
            self.nonfinite_steps += 1
        self._incident(any_bad, packet.global_step)
        if packet.detail and packet.grad_params:
            self.detail_backward_steps += 1
            self._log_gaps_once()

    def _incident(self, bad: bool, step: int) -> None:
        origin = self._step_origin
        for tensor, layer in origin.items():
            self.origin[tensor] = (layer, step)
        starts = bad and not self._in_incident
        self._in_incident = bad
        if bad and self.on_incident is not None:
            name = lambda t: self.layer_names[origin[t]] if t in origin else None  # noqa: E731
            self.on_incident(NonFiniteIncident(self._model, self.rank, step, name(M.TENSOR_GRAD),
                                               name(M.TENSOR_ACTIVATION)), starts)

    def _mark_origin(self, tensor: str, layer: int, backward: bool) -> None:
        """Keep the first layer in forward order (activations) or backward order (gradients)."""
        known = self._step_origin.get(tensor)
        if known is None or (layer > known if backward else layer < known):
            self._step_origin[tensor] = layer

    def _count(self, cells: List[List[int]], layer: int, nan: float, inf: float, origin: str) -> bool:
        if not (nan or inf):
            return False
        self._mark_origin(origin, layer, backward=origin != M.TENSOR_ACTIVATION)
        cells[layer][0] += int(nan)
        cells[layer][1] += int(inf)
        return True

    def _per_layer(self, layers: Sequence[int], squares: Sequence[float], nans: Sequence[float],
                   infs: Sequence[float], cells: List[List[int]], origin: str) -> Tuple[Dict[int, float], bool]:
        """Sum of squares per layer of records (one per element of ``layers``), counting
        their NaN/Inf into ``cells``. A group's norm is the root of its summed squares."""
        acc: Dict[int, float] = {}
        bad = False
        for k, layer in enumerate(layers):
            acc[layer] = acc.get(layer, 0.0) + squares[k]
            bad |= self._count(cells, layer, nans[k], infs[k], origin)
        return acc, bad

    def _fold_grads(self, packet: StepPacket, v: List[float]) -> bool:
        p = len(packet.grad_params)
        if not p:
            return False
        layers = [self.param_layer[param] for param in packet.grad_params]
        layer_sq, bad = self._per_layer(layers, v[:p], v[p:2 * p], v[2 * p:3 * p],
                                        self.nonfinite[M.TENSOR_GRAD], M.TENSOR_GRAD)
        self.seen[M.FAMILY_GRAD].update(layer_sq)
        norm = math.sqrt(sum(layer_sq.values()))
        self.global_norm = norm
        self._observe(norm)
        if packet.sampled:
            for layer, sq in layer_sq.items():
                self.grad_norm[layer] = math.sqrt(sq)
        return bad

    def _fold_activations(self, meta: Sequence[Tuple[int, int]], v: List[float], o: int) -> bool:
        if not meta:
            return False
        r = len(meta)
        acc: Dict[int, List[float]] = {}
        bad = False
        for k, (layer, numel) in enumerate(meta):
            layer = self.layer_group[layer]
            norm, lo, hi = v[o + 3 * k], v[o + 3 * k + 1], v[o + 3 * k + 2]
            a = acc.setdefault(layer, [0.0, 0, 0.0])
            a[0] += norm * norm
            a[1] += numel
            a[2] = _merge_max(a[2], _merge_max(abs(lo), abs(hi)))
            bad |= self._count(self.nonfinite[M.TENSOR_ACTIVATION], layer, v[o + 3 * r + 2 * k],
                               v[o + 3 * r + 2 * k + 1], M.TENSOR_ACTIVATION)
        for layer, (sq, numel, amax) in acc.items():
            self.activation_rms[layer] = math.sqrt(sq / numel) if numel else 0.0
            self.activation_abs_max[layer] = amax
        self.seen[M.FAMILY_ACTIVATION].update(acc)
        return bad

    def _fold_grad_flow(self, meta: Sequence[int], v: List[float], o: int) -> bool:
        if not meta:
            return False
        q = len(meta)
        acc, bad = self._per_layer([self.layer_group[layer] for layer in meta], [x * x for x in v[o:o + q]],
                                   v[o + q:o + 3 * q:2], v[o + q + 1:o + 3 * q:2],
                                   self.nonfinite[M.TENSOR_GRAD_FLOW], M.TENSOR_GRAD)
        for layer, sq in acc.items():
            self.grad_flow_norm[layer] = math.sqrt(sq)
        self.seen[M.FAMILY_GRAD_FLOW].update(acc)
        return bad

    def _fold_local(self, params: Sequence[int], v: List[float], o: int) -> bool:
        if not params:
            return False
        n = len(params)
        layer_sq, bad = self._per_layer([self.param_layer[param] for param in params], [x * x for x in v[o:o + n]],
                                        v[o + n:o + 3 * n:2], v[o + n + 1:o + 3 * n:2],
                                        self.local_nonfinite, M.TENSOR_GRAD)
        for layer, sq in layer_sq.items():
            self.local_grad_norm[layer] = math.sqrt(sq)
        self.local_global_norm = math.sqrt(sum(layer_sq.values()))
        return bad

    def _observe(self, norm: float) -> None:
        # A non-finite norm is already counted by the non-finite counters; observing it
        # would turn _sum into Inf/NaN for the rest of the process.
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
            expected=MappingProxyType({name: frozenset(f for f in self.families
                                                       if f != M.FAMILY_GRAD or i in self.grad_layers)
                                       for i, name in enumerate(self.layer_names)}),
            tied=MappingProxyType(dict(self.tied)), measured_at_step=self.measured_at_step)

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
        if self.steps_total:
            out[M.FAMILY_GRAD] = len(self.grad_layers - self.seen[M.FAMILY_GRAD])
        for f in (M.FAMILY_GRAD_FLOW, M.FAMILY_ACTIVATION):
            if f in self.families:
                out[f] = n - len(self.seen[f]) if self.detail_backward_steps else 0
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
                        "hooks are no-ops (gradient norms and non-finite counts still cover every step).")
            log.warning("gradmon[%s]: %d layer(s) not fully observable, reported in "
                        "gradmon_uncovered_layers and Monitor.coverage(): %s.%s", self._model,
                        len(gaps), "; ".join(gaps[:20]) + (" ..." if len(gaps) > 20 else ""), hint)

    # -- snapshot ------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        self.generation += 1
        names = self.layer_names

        def pairs(values: Sequence[Optional[float]]) -> Tuple[Tuple[str, float], ...]:
            return tuple((names[i], x) for i, x in enumerate(values) if x is not None)

        nonfinite = tuple((names[i], tensor, kind, cell[k])
                          for tensor, cells in self.nonfinite.items()
                          for i, cell in enumerate(cells)
                          for k, kind in enumerate(M.NONFINITE_KINDS))
        cumulative, running = [], 0
        for bound, count in zip(list(self.bounds) + [math.inf], self.bucket_counts):
            running += count
            cumulative.append((bound, running))
        return Snapshot(
            generation=self.generation, steps_total=self.steps_total,
            global_step=self.global_step, last_step_time=self.last_step_time,
            global_norm=self.global_norm, grad_norm=pairs(self.grad_norm),
            grad_flow_norm=pairs(self.grad_flow_norm), activation_rms=pairs(self.activation_rms),
            activation_abs_max=pairs(self.activation_abs_max), nonfinite=nonfinite,
            nonfinite_steps=self.nonfinite_steps, histogram=tuple(cumulative),
            histogram_sum=self.hist_sum, histogram_count=self.hist_count,
            uncovered=tuple(sorted(self.uncovered().items())), coverage=self.coverage(),
            local_view=self.local_view, local_global_norm=self.local_global_norm,
            local_grad_norm=pairs(self.local_grad_norm),
            local_nonfinite=tuple((names[i], kind, cell[k]) for i, cell in enumerate(self.local_nonfinite)
                                  for k, kind in enumerate(M.NONFINITE_KINDS)) if self.local_view else (),
            nonfinite_origin=tuple((tensor, names[layer], step) for tensor, (layer, step) in sorted(self.origin.items())),
            grouped_layers=len(self.layer_group) - len(self.layer_names),
            amp_skipped_steps=self.amp_skipped_steps if self.amp else None, amp_loss_scale=self.amp_loss_scale)


_STOP = object()


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


class Publisher:
    """The thread between the training thread and the exporter."""

    def __init__(self, aggregator: Aggregator, errors: ErrorLog,
                 on_snapshot: Callable[[Snapshot], None], name: str) -> None:
        self._agg = aggregator
        self._errors = errors
        self._on_snapshot = on_snapshot
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"gradmon-publisher-{name}", daemon=True)
        on_snapshot(aggregator.snapshot())  # every counter exists at 0 from attach() on
        self._thread.start()

    def put(self, item: object) -> None:
        self._queue.put(item)

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
            for item in batch:
                if item is _STOP:
                    stop = True
                elif isinstance(item, _Flush):
                    flushes.append(item)
                else:
                    self._fold(item)
            try:
                self._on_snapshot(self._agg.snapshot())
            except Exception as exc:  # pragma: no cover - snapshot building is plain Python
                self._errors.record("publish", exc)
            for token in flushes:
                token.done.set()
            if stop:
                return

    def _fold(self, item: object) -> None:
        try:
            if isinstance(item, GlobalStepUpdate):
                self._agg.global_step = item.global_step
                return
            event = getattr(item, "event", None)
            if event is not None:
                event.synchronize()
            self._agg.fold(item)  # type: ignore[arg-type]
        except Exception as exc:
            self._errors.record("publish", exc)
