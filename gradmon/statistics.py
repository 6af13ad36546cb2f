"""The per-layer statistics, each declared once.

A :class:`Statistic` says everything gradmon needs to know about one thing it measures
per layer: the option that switches it on, the moment the hooks record it, the
on-device function that records it, the columns of one record and how each column
folds (over a layer's several calls, over layers grouped under the series budget, and
over FSDP shards), the Prometheus families it feeds, how each is drawn on the Layers
dashboard and what it costs in series.

Everything downstream loops over :data:`STATISTICS`: the hooks record each enabled
statistic at its moment, the step packet is laid out section by section from the
declared columns (:func:`read` is the only reader of that layout), the aggregator folds
by the declared rules, the exporter emits the declared families, the series budget
adds up the declared costs, and at build time the Layers dashboard draws each declared
:class:`Panel` and the metric reference (docs/metrics.md) lists each family. Adding a
statistic is one entry here, its record function in ``capture/kernels.py`` and its
metric spec in ``metrics.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import (Any, Callable, Collection, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import torch

from . import metrics as M
from . import stats

# -- moments: where the hooks record a statistic ----------------------------------------------

PARAM_GRAD = "param_grad"
"""Every monitored parameter's gradient at the end of backward: accumulated, reduced by
DDP/FSDP, before any clipping. ``record(grads, home)`` gets them all at once (one
multi-tensor kernel) and returns ``(rows, order)``: an (n, width) tensor on ``home``
whose row j describes ``grads[order[j]]``."""

LOCAL_GRAD = "local_grad"
"""One parameter's own gradient in its post-accumulate-grad hook, before DDP's
all-reduce. ``record(grad)`` returns one tensor per part. The last record of a parameter
in a step wins: it holds every micro-batch accumulated so far."""

OUTPUT = "output"
"""A layer's output in its forward hook (training forwards, detail steps).
``record(output)`` returns one tensor per part; each call is a record."""

OUTPUT_GRAD = "output_grad"
"""The gradient with respect to a layer's output, from a tensor hook put on the output
in the forward hook (detail steps). ``record(grad)``; each call is a record."""

BLOCK = "block"
"""Every training forward, detail step or not: the root module's floating-point inputs
(key 0), each of its direct children's outputs (keys 1..k, in registration order) and
its own output (key k+1). ``record(tensor)`` returns one tensor per part; each call is
a record. Cheap enough for every step, so that a NaN's origin is known on the step it
happens; under torch.compile recorded in the graph alike (``capture/traced.py``)."""

LAYER = "layer"
"""Every training forward, detail step or not: a layer's output. ``record(output)``; each
call is a record. For what must be known per layer on any step (a NaN's origin)."""

OPTIMIZER = "optimizer"
"""After an optimizer step that closes a step, on sampled steps (``optimizer_every``):
``record(reading)`` gets what ``optimizer.read`` read from that optimizer's state
(weights, gradients, moments) and returns ``(rows, order)`` as at PARAM_GRAD, or None
when the optimizer read nothing for it."""

WEIGHT = "weight"
"""Every monitored parameter itself, after an optimizer step that closes a step, on the
steps the optimizer is read (``optimizer_every``), whatever the optimizer: ``record(weights,
home)`` gets them all at once (detached; a shard's own elements where a parameter is
sharded) and returns ``(rows, order)`` as at PARAM_GRAD. A sharded parameter's rows are
combined over its shard groups as its gradient's are, on every rank at that step."""

FORWARD = (OUTPUT, BLOCK, LAYER)  # records of forward values: their origin is first in forward order
BY_PARAMETER = (PARAM_GRAD, LOCAL_GRAD, OPTIMIZER, WEIGHT)  # records keyed by parameter index, not layer index
BATCHED = (PARAM_GRAD, OPTIMIZER, WEIGHT)  # every parameter's record at once, as (rows, order)

# -- folds: how the values of one column combine --------------------------------------------

SUM = "sum"
"""Added: element counts."""
NORM = "norm"
"""An L2 norm: combined as the root of the summed squares (a layer's several calls, the
layers of a group, the shards of a parameter)."""
ABSMAX = "absmax"
"""The largest absolute value; a NaN stays NaN."""
MIN = "min"
"""The smallest value, sign kept (a -Inf is not a +Inf); a NaN stays NaN."""
MAX = "max"
"""The largest value, sign kept; a NaN stays NaN."""
MOMENTS = "moments"
"""Six consecutive columns ``mean, scale, m1, m2, m3, m4`` describing one record's
elements x by ``m_k = sum(((x - mean) / scale) ** k)``: the record's shift and scale
are whatever the device found cheap and safe (float32 powers of raw values overflow and
cancel). The host re-centres each record on its exact mean and combines records by the
parallel rule for central moments (:func:`merge_moments`), which is exact for a layer's
several calls and for grouped layers alike; folded values hold scale 1 and m1 0, so
``m2..m4`` are then the central sums themselves."""

MOMENT_COLUMNS = ("mean", "scale", "m1", "m2", "m3", "m4")


@dataclass(frozen=True)
class Column:
    name: str
    fold: str
    scale_power: int = 0
    """A GradScaler's loss scale multiplies this column by scale**power (a gradient's norm:
    1); gradmon divides it out on the device. Counts are unaffected (0)."""


MIN_BASELINE = 8
"""Values a gauge's own baseline needs before the gauge relative to it is exported."""


@dataclass(frozen=True)
class Panel:
    """How a per-layer gauge is drawn on the Layers dashboard: one time series per layer
    (``gradmon/artefacts/dashboards.py`` builds it; nothing at runtime reads it)."""

    title: str
    log: bool = False
    """A log-scale y axis: for values that span decades (norms, ratios)."""
    unit: str = "short"
    """Grafana's unit of the values (``percentunit`` for a fraction of 1)."""
    line: Optional[Tuple[str, Callable[[Any], float]]] = None
    """(colour, number): a threshold line drawn from the alerts' own numbers, the function
    taking ``gradmon.thresholds.Thresholds``."""
    description: str = ""
    wide: bool = False
    """The panel takes the dashboard's whole width instead of half of it."""


@dataclass(frozen=True, eq=False)  # by identity: the aggregator keys its state by gauge
class LayerGauge:
    spec: M.MetricSpec
    value: Callable[[Mapping[str, float]], Optional[float]]
    """From one layer's folded columns (NORM columns already rooted) and ``numel``, the
    elements its records covered. None: no sample (e.g. a kurtosis without variance)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Constant labels of this gauge's series (several statistics may share a family)."""
    baseline: Optional[str] = None
    """A Config field N: export ``value`` divided by the median of the layer's last N
    values (this one included), on the publisher thread from host values; absent until
    :data:`MIN_BASELINE` finite values exist (see :func:`relative`)."""
    jump: Optional[str] = None
    """A spike signal: each layer's value of this gauge (before its baseline ratio) is scored
    against that layer's own adaptive baseline, and a step where any layer is a spike counts
    one spike step of it (see ``SpikeTracker.observe_layers``)."""
    worst: Optional[M.MetricSpec] = None
    """A rank-level gauge of the largest value over layers, labelled with the layer that
    holds it: exported on every rank, so that a rank without per-layer series still
    names its worst layer."""
    worst_floor: Optional[float] = None
    """Below this largest value no layer is named (the ``layer`` label is left out): among
    layers that are all calm, the largest is noise and would change every scrape."""
    per_layer: bool = True
    """False: the per-layer values only feed ``worst`` and are never exported."""
    above: Optional[Tuple[Callable[[Any], float], M.MetricSpec]] = None
    """With ``baseline``: a threshold on the ratio (from ``gradmon.thresholds.Thresholds``),
    and a model-level gauge of the steps in a row, up to the last, in which a layer's ratio
    was above it (the longest run among layers), counted in the process from every value
    the gauge is given."""
    restarts: bool = False
    """The baseline is forgotten where the spike windows restart (a learning-rate jump, a
    resumed run): for values that move with the learning rate, whose old median would
    make a warm restart look like a blow-up (and a drop to a low rate like a recovery)."""
    since_first: bool = False
    """Export ``value`` divided by the layer's first finite, positive value since attach:
    how far it grew (a slow growth that a rolling ``baseline`` would follow)."""
    doublings: Optional[Tuple[Callable[[Any], float], str]] = None
    """With ``since_first``: (a threshold from ``gradmon.thresholds.Thresholds``, a spike
    signal): a layer's value first reaching the threshold times 2^k (k = 0, 1, ...) counts
    one step of the signal (``SpikeTracker.event``), so that a growth warns as it
    escalates rather than for as long as it lasts."""
    role: Optional[str] = None
    """Exported only for the layers attach() found in this role (``metrics.ROLE_*``: the
    attention's query and key projections, the model's output layer), not for every layer."""
    panel: Optional[Panel] = None
    """Its panel on the Layers dashboard; None: none (a family several gauges share is
    drawn once, from the first that declares a panel)."""


@dataclass(frozen=True)
class Statistic:
    name: str
    switch: Union[None, str, Tuple[str, ...]]
    """The Config field(s) that turn it on, all of them; None: always on."""
    at: str
    """The moment it is recorded (PARAM_GRAD, LOCAL_GRAD, OUTPUT, OUTPUT_GRAD, BLOCK, LAYER, OPTIMIZER, WEIGHT)."""
    parts: Tuple[Tuple[Column, ...], ...]
    """The columns of one record, grouped as the tensors ``record`` returns them."""
    record: Callable[..., Any]
    gauges: Tuple[LayerGauge, ...] = ()
    combine: Optional[Callable[[Sequence[torch.Tensor], Sequence[int], torch.device, "stats.Scratch"],
                               torch.Tensor]] = None
    """For a one-part statistic whose per-record work is cheaper done for many records at
    once: ``record`` returns raw material (e.g. a sample of the output) and ``combine(raw,
    numels, home, scratch)`` turns a list of records' raw material into their (n, width)
    rows, when the forward (or backward) that made them completes; ``scratch`` holds their
    temporaries: for the step, or from step to step where detail steps come often
    (``hooks.KEEP_SCRATCH_EVERY``)."""
    counter: Optional[M.MetricSpec] = None
    """Family counting the records' "nan" and "inf" columns, per layer and ``kind``."""
    counter_labels: Mapping[str, str] = field(default_factory=dict)
    rank_tensor: Optional[str] = None
    """``tensor`` label of the records' nan/inf sums over all layers in
    gradmon_rank_nonfinite_total (exported on every rank, per-layer series or not)."""
    origin: Optional[str] = None
    """``tensor`` label under which a non-finite record marks the incident's origin:
    the first layer (or block) in forward order for forward values, whose records must
    carry ``lo`` and ``hi`` columns (see :func:`nonfinite_flags`), in backward order for
    gradients."""
    coverage: Optional[str] = None
    """The ``family`` of gradmon_uncovered_layers and Monitor.coverage(), if any."""
    reduced: bool = False
    """Identical on every rank (the gradient after DDP's all-reduce or FSDP's reduction):
    its per-layer series are exported by rank 0 alone."""
    sampled: bool = False
    """Per-layer gauges follow ``every`` (the step's other uses of it do not)."""
    detail: bool = False
    """Recorded on detail steps only (``detail_every``)."""
    total: Optional[M.MetricSpec] = None
    """Model-level gauge: the root of the summed squares of its first NORM column over
    all layers, on every step it is recorded."""
    histogram: Optional[M.MetricSpec] = None
    """Histogram observing ``total`` on every step."""
    spike: Optional[str] = None
    """``signal`` under which ``total`` is scored for spikes on every step (gradmon/spikes.py)."""
    derive: Optional[Tuple[str, Callable[[Sequence[torch.Tensor]], Tuple[torch.Tensor, ...]]]] = None
    """(statistic, pick): where that statistic already recorded the same tensor, unchanged,
    in the same pass, this one's record is ``pick(that record's parts)``, and the tensor is
    not read again. A layer that is also one of the root's direct children (an LLM's
    embedding, final norm and head, whose output, the logits, is its largest tensor) has
    its block extremes in the activation record of a detail step."""
    record_many: Optional[Callable[[Sequence[torch.Tensor], torch.device, Any], Tuple[torch.Tensor, ...]]] = None
    """For a statistic of many small tensors recorded at once at the end of a pass (the
    blocks' outputs every step; on a detail step the layers' outputs, and their gradients at
    the end of the backward): ``record_many(tensors, home, stacked)`` returns one (n, width)
    block per part and, last, the row order (row j describes ``tensors[order[j]]``): a few
    kernels for all of a pass's records where ``record`` would launch its own per tensor. ``stacked``: the tensors stacked
    (``kernels.stack_alike``, or ``kernels.Stacks`` by shape), or False where they do not
    stack. Its records must equal ``record``'s (a tensor may take either path)."""
    dtypes: Optional[Tuple[torch.dtype, ...]] = None
    """Record only tensors of these dtypes (None: every floating dtype). A layer none of
    whose tensors qualifies has no record, hence no series: the dtype is host metadata,
    so the check costs no sync."""

    @property
    def switches(self) -> Tuple[str, ...]:
        return () if self.switch is None else (self.switch,) if isinstance(self.switch, str) else self.switch

    @property
    def columns(self) -> Tuple[Column, ...]:
        return tuple(c for part in self.parts for c in part)

    @property
    def by_parameter(self) -> bool:
        return self.at in BY_PARAMETER

    @property
    def forward(self) -> bool:
        return self.at in FORWARD

    @property
    def series_per_layer(self) -> int:
        """Series one layer costs: a gauge each, and the nan/inf pair of its counter."""
        return (sum(g.per_layer and g.role is None for g in self.gauges)
                + (len(M.NONFINITE_KINDS) if self.counter is not None else 0))

    def index(self, column: str) -> int:
        return [c.name for c in self.columns].index(column)


class ColumnValue:
    """A gauge's value that is one folded column as it is (a NORM column rooted): the fold
    reads it from each layer's accumulator directly, with no mapping built per layer."""

    def __init__(self, column: str) -> None:
        self.column = column

    def __call__(self, c: Mapping[str, float]) -> float:
        return c[self.column]

    def __repr__(self) -> str:
        return f"ColumnValue({self.column!r})"


_norm = ColumnValue("norm")


def _rms(c: Mapping[str, float]) -> float:
    return c["norm"] / math.sqrt(c["numel"]) if c["numel"] else 0.0


def _abs_max(c: Mapping[str, float]) -> float:
    return merge_max(c["lo"], c["hi"])


def _ratio(c: Mapping[str, float]) -> float:
    # a layer whose weights were all zero before the step (fresh zero init) moved infinitely far
    if c["weight"]:
        return c["update"] / c["weight"]
    return math.inf if c["update"] else 0.0


def _kurtosis(c: Mapping[str, float]) -> Optional[float]:
    # Pearson's (a Gaussian is 3): n * M4 / M2^2 over the folded central sums.
    if math.isnan(c["m2"]):
        return math.nan
    if c["m2"] <= 0.0:
        return None  # a constant output has no kurtosis
    return c["numel"] * c["m4"] / (c["m2"] * c["m2"])


FP16_MAX = float(torch.finfo(torch.float16).max)


def _fp16_range_used(c: Mapping[str, float]) -> float:
    return _abs_max(c) / FP16_MAX


def _zero_fraction(c: Mapping[str, float]) -> float:
    return (c["numel"] - c["nonzero"]) / c["numel"] if c["numel"] else 0.0


_COUNTS = (Column("nan", SUM), Column("inf", SUM))
_GRAD_NORM = Column("norm", NORM, scale_power=1)

# Record functions are looked up in ``stats`` at call time, so that a test (or a
# debugging session) can swap one and see the hooks use it.
GRAD = Statistic(
    "grad", None, PARAM_GRAD, ((_GRAD_NORM,) + _COUNTS,),
    lambda grads, home: stats.param_grad_stats(grads, home),
    gauges=(LayerGauge(M.GRAD_NORM, _norm, panel=Panel("Gradient norm by layer", log=True, wide=True,
                                                       line=("red", lambda th: th.explode_abs))),
            LayerGauge(M.GRAD_NORM_BASELINE_RATIO, _norm, baseline="norm_baseline", restarts=True,
                       jump=M.SIGNAL_LAYER_GRAD_NORM,
                       above=(lambda th: th.norm_baseline_ratio, M.GRAD_NORM_ABOVE_BASELINE_STEPS),
                       panel=Panel("Gradient norm over its own baseline", log=True,
                                   line=("orange", lambda th: th.norm_baseline_ratio),
                                   description="Each layer's norm over the median of its own last norm_baseline "
                                               "sampled steps; GradmonGradNormAboveBaseline warns above the line. "
                                               "The first layers move first."))),
    counter=M.NONFINITE, counter_labels={"tensor": M.TENSOR_GRAD}, rank_tensor=M.TENSOR_GRAD, origin=M.TENSOR_GRAD,
    coverage=M.FAMILY_GRAD, reduced=True, sampled=True,
    total=M.GRAD_GLOBAL_NORM, histogram=M.GRAD_GLOBAL_NORM_DISTRIBUTION, spike=M.SIGNAL_GRAD_NORM)

GRAD_FLOW = Statistic(
    "grad_flow", "grad_flow", OUTPUT_GRAD, ((_GRAD_NORM,), _COUNTS),
    lambda grad: stats.gradient_record(grad),
    record_many=lambda grads, home, stacked: stats.gradient_many(grads, home, stacked),
    gauges=(LayerGauge(M.GRAD_FLOW_NORM, _norm,
                       panel=Panel("Gradient flow by depth (norm of d loss / d output)", log=True, wide=True)),),
    counter=M.NONFINITE, counter_labels={"tensor": M.TENSOR_GRAD_FLOW}, rank_tensor=M.TENSOR_GRAD_FLOW,
    origin=M.TENSOR_GRAD,
    coverage=M.FAMILY_GRAD_FLOW, detail=True)

_EXTREMES = (Column("lo", ABSMAX), Column("hi", ABSMAX))

ACTIVATION = Statistic(
    "activation", "activations", OUTPUT,
    ((Column("norm", NORM),) + _EXTREMES, _COUNTS),
    lambda output: stats.activation_record(output),
    record_many=lambda outputs, home, stacked: stats.activation_many(outputs, home, stacked),
    gauges=(LayerGauge(M.ACTIVATION_RMS, _rms, panel=Panel("Activation RMS by layer", log=True)),
            LayerGauge(M.ACTIVATION_ABS_MAX, _abs_max, worst=M.ACTIVATION_ABS_MAX_WORST,
                       panel=Panel("Activation max |x| by layer", log=True,
                                   line=("red", lambda th: th.activation_abs_max))),
            LayerGauge(M.ACTIVATION_ABS_MAX_RATIO, _abs_max, baseline="activation_baseline",
                       panel=Panel("Activation max |x| over its own baseline", log=True)),
            LayerGauge(M.ACTIVATION_GROWTH, _abs_max, labels={"role": M.ROLE_ATTENTION}, since_first=True,
                       role=M.ROLE_ATTENTION, worst=M.ACTIVATION_GROWTH_WORST,
                       doublings=(lambda th: th.attention_growth, M.SIGNAL_ATTENTION_GROWTH), panel=Panel(
                           "Attention projections' and logits' max |x| since attach", log=True,
                           line=("orange", lambda th: th.attention_growth),
                           description="Growth of the query/key projections' outputs (role=attention) and of "
                                       "the logits (role=output) over their first measurement; "
                                       "GradmonAttentionGrowth warns above the line.")),
            LayerGauge(M.ACTIVATION_GROWTH, _abs_max, labels={"role": M.ROLE_OUTPUT}, since_first=True,
                       role=M.ROLE_OUTPUT)),
    counter=M.NONFINITE, counter_labels={"tensor": M.TENSOR_ACTIVATION}, rank_tensor=M.TENSOR_ACTIVATION,
    origin=M.TENSOR_ACTIVATION,
    coverage=M.FAMILY_ACTIVATION, detail=True)

ACTIVATION_KURTOSIS = Statistic(
    "activation_kurtosis", ("activations", "activation_kurtosis"), OUTPUT,
    (tuple(Column(name, MOMENTS) for name in MOMENT_COLUMNS),),
    lambda output: stats.moments_record(output),
    record_many=lambda outputs, home, stacked: stats.moments_many(outputs, home, stacked),
    gauges=(LayerGauge(M.ACTIVATION_KURTOSIS, _kurtosis, panel=Panel(
        "Activation kurtosis by layer", log=True,
        description="A Gaussian is 3; outlier features push it far up long before max |x| overflows.")),), detail=True,
    combine=lambda samples, numels, home, scratch: stats.moments_block(samples, numels, home, scratch))

# fp16 only: a bf16 or fp32 tensor has no such ceiling worth watching. The gradient is
# the one w.r.t. the layer's output, as backward carries it: fp16 under autocast too
# (where parameter gradients are fp32), and still multiplied by the loss scale, which is
# exactly what overflows or underflows (scale_power 0: never unscaled).
FP16_ACTIVATION = Statistic(
    "fp16_activation", "fp16_headroom", OUTPUT, ((_EXTREMES[0],), (_EXTREMES[1],)),
    lambda output: stats.extremes(output),
    gauges=(LayerGauge(M.FP16_RANGE_USED, _fp16_range_used, labels={"tensor": M.TENSOR_ACTIVATION}, panel=Panel(
        "fp16 range used", unit="percentunit", line=("red", lambda th: 1 / th.fp16_min_headroom),
        description="max |x| / 65504 of float16 outputs and their gradients (float16 layers only).")),),
    detail=True, dtypes=(torch.float16,))

FP16_GRAD = Statistic(
    "fp16_grad", "fp16_headroom", OUTPUT_GRAD, (_EXTREMES, (Column("nonzero", SUM),)),
    lambda grad: stats.extremes_and_nonzero(grad),
    gauges=(LayerGauge(M.FP16_RANGE_USED, _fp16_range_used, labels={"tensor": M.TENSOR_GRAD}),
            LayerGauge(M.GRAD_FP16_UNDERFLOW_FRACTION, _zero_fraction, panel=Panel(
                "fp16 gradient underflow fraction", unit="percentunit",
                description="Exact zeros, true zeros included: watch its rise, not its level."))),
    detail=True, dtypes=(torch.float16,))

LOCAL = Statistic(
    "local", "local_view", LOCAL_GRAD, ((_GRAD_NORM,), _COUNTS),
    lambda grad: stats.gradient_record(grad),
    # the ratio to each layer's own baseline feeds only the worst layer's gauge: a blow-up in
    # one rank's data that the all-reduce averages away, named on that rank in one series
    gauges=(LayerGauge(M.LOCAL_GRAD_NORM, _norm),
            LayerGauge(M.LOCAL_GRAD_NORM_RATIO_WORST, _norm, baseline="norm_baseline", restarts=True,
                       above=(lambda th: th.norm_baseline_ratio, M.LOCAL_GRAD_NORM_ABOVE_BASELINE_STEPS),
                       worst=M.LOCAL_GRAD_NORM_RATIO_WORST, worst_floor=2.0, per_layer=False)),
    counter=M.LOCAL_NONFINITE, rank_tensor=M.TENSOR_LOCAL_GRAD, origin=M.TENSOR_GRAD, total=M.LOCAL_GRAD_GLOBAL_NORM,
    spike=M.SIGNAL_LOCAL_GRAD_NORM)

# Only the extremes: aminmax is one pass with no temporary, cannot overflow (a float32
# sum of large finite values can), and keeps the sign of an Inf, so that a -Inf a float
# attention mask always carries is told apart from a new +Inf or NaN. Never counted in
# gradmon_nonfinite_total: it only says where a non-finite step started, so a finite
# output checked on the CPU may carry bounds instead (stats.finite_check).
BLOCK_FINITE = Statistic(
    "block_finite", None, BLOCK, ((Column("lo", MIN),), (Column("hi", MAX),)),
    lambda output: stats.finite_check(output), origin=M.TENSOR_BLOCK,
    derive=("activation", lambda parts: (parts[0][1], parts[0][2])),
    record_many=lambda outputs, home, stacked: stats.extremes_many(outputs, home, stacked=stacked))

# The same, per layer and on every step when asked for (origin_per_layer): the layer a
# NaN started in is then named on any step, not only on detail steps.
LAYER_FINITE = Statistic(
    "layer_finite", "origin_per_layer", LAYER, ((Column("lo", MIN),), (Column("hi", MAX),)),
    lambda output: stats.finite_check(output), origin=M.TENSOR_ACTIVATION)

# ‖Δw‖ and ‖w_{t-1}‖ fold as norms and are divided only in the gauge, so that a group
# of layers (or a parameter's shards) gets the ratio of its sums, not a sum of ratios.
# Weights and optimizer state are the same on every rank under DDP: rank 0 exports them.
UPDATE_RATIO = Statistic(
    "update_ratio", "optimizer_every", OPTIMIZER, ((Column("update", NORM), Column("weight", NORM)),),
    lambda reading: reading.update,
    gauges=(LayerGauge(M.UPDATE_TO_WEIGHT_RATIO, _ratio, panel=Panel("Update-to-weight ratio by layer", log=True)),
            LayerGauge(M.UPDATE_RATIO_BASELINE_RATIO, _ratio, baseline="update_baseline", restarts=True,
                       panel=Panel("Update ratio over its own baseline", log=True,
                                   line=("orange", lambda th: th.update_baseline_ratio)))),
    coverage=M.FAMILY_OPTIMIZER, reduced=True)

# RMS of g'/sqrt(max(v̂, ε²)) over the layer's elements: the root of a norm over numel.
ADAM_RMS = Statistic(
    "adam_rms", "optimizer_every", OPTIMIZER, ((Column("norm", NORM),),),
    lambda reading: reading.adam, reduced=True,
    gauges=(LayerGauge(M.ADAM_RMS, _rms, panel=Panel(
        "Adam RMS(g / sqrt(v)) by layer", line=("orange", lambda th: th.adam_rms_spike),
        description="About 1 when healthy; far above, the second moment lags a gradient spike.")),))

# sqrt(Σ v̂/ε²) rooted over numel: the gradients' RMS as Adam's second moment sees it, in ε.
ADAM_EPS = Statistic(
    "adam_eps", "optimizer_every", OPTIMIZER, ((Column("norm", NORM),),),
    lambda reading: reading.eps, reduced=True,
    gauges=(LayerGauge(M.ADAM_GRAD_RMS_OVER_EPS, _rms, panel=Panel(
        "Adam sqrt(v) / eps by layer", log=True,
        description="The gradients' scale as Adam sees it, in units of its epsilon: near 1 or below, eps "
                    "dominates the update's denominator and the layer's updates shrink.")),))

# The weights after the step, every element read: shards combine as the gradients' do.
PARAM_NORM = Statistic(
    "param_norm", "optimizer_every", WEIGHT, ((Column("norm", NORM),),),
    lambda weights, home: stats.param_norms(weights, home), reduced=True,
    gauges=(LayerGauge(M.PARAM_NORM, _norm, panel=Panel("Parameter norm by layer", log=True)),))

#: Every statistic, in packet order.
STATISTICS: Tuple[Statistic, ...] = (GRAD, ACTIVATION, GRAD_FLOW, LOCAL, BLOCK_FINITE, LAYER_FINITE,
                                     UPDATE_RATIO, ADAM_RMS, ACTIVATION_KURTOSIS, FP16_ACTIVATION, FP16_GRAD,
                                     PARAM_NORM, ADAM_EPS)


def enabled(cfg: Any, **resolved: object) -> Tuple[Statistic, ...]:
    """The statistics ``cfg`` turns on; ``resolved`` overrides switches decided at attach
    (``local_view=None`` means "when the model is wrapped in DDP", ``fp16_headroom=None``
    "when the model can hold float16 tensors"); an unresolved None is off."""
    def on(switch: str) -> bool:
        return bool(resolved[switch] if switch in resolved else getattr(cfg, switch))
    return tuple(s for s in STATISTICS if all(on(switch) for switch in s.switches))


def series_per_layer(statistics: Sequence[Statistic]) -> int:
    return sum(s.series_per_layer for s in statistics)


def spike_signals(statistics: Sequence[Statistic], reduced_here: bool,
                  roles: Optional[Mapping[str, Collection[int]]] = None) -> Tuple[str, ...]:
    """The spike signals a rank scores: the loss, the total of each enabled statistic that
    declares one, the jumps its gauges declare, and their doublings where the gauge's role
    has layers in ``roles``; a reduced statistic's (identical on every rank) only where this
    rank exports the reduced series (rank 0 under DDP/FSDP), so a job counts one spike once."""
    here = [s for s in statistics if reduced_here or not s.reduced]
    return ((M.SIGNAL_LOSS,) + tuple(s.spike for s in here if s.spike)
            + tuple(g.jump for s in here for g in s.gauges if g.jump)
            + tuple(g.doublings[1] for s in here for g in s.gauges
                    if g.doublings and (g.role is None or (roles or {}).get(g.role))))


def _check(table: Sequence[Statistic]) -> None:
    names = [s.name for s in table]
    assert len(set(names)) == len(names), names
    for s in table:
        if s.at in BATCHED or s.combine is not None:
            # the FSDP collective and the unscaling take the rows as one block
            assert len(s.parts) == 1, s.name
        if s.counter is not None:
            s.index("nan"), s.index("inf")
        if s.total is not None or s.spike is not None:
            assert s.total is not None and any(c.fold == NORM for c in s.columns), s.name
        if s.origin is not None and s.forward:
            s.index("lo"), s.index("hi")
        for g in s.gauges:
            if isinstance(g.value, ColumnValue):
                s.index(g.value.column)
        if s.derive is not None:
            # a source recorded earlier in the same pass, at the same kind of moment
            source = next(t for t in table if t.name == s.derive[0])
            assert source.forward == s.forward and source.combine is None, s.name
        moments = [c.name for c in s.columns if c.fold == MOMENTS]
        if moments:
            # folded on the host only: the FSDP collective knows no parallel rule
            assert not s.by_parameter and tuple(moments) == MOMENT_COLUMNS, s.name
            start = s.index("mean")
            assert [c.name for c in s.columns[start:start + len(MOMENT_COLUMNS)]] == list(MOMENT_COLUMNS), s.name


_check(STATISTICS)


# -- the step packet's layout -----------------------------------------------------------------

@dataclass(frozen=True)
class Section:
    """The records of one statistic in a step packet: ``keys`` are layer indices, or
    parameter indices for statistics recorded by parameter; ``numels`` the elements each
    record covered. In the packet the section holds, for each part of the statistic, an
    (n, part width) block in row order."""

    statistic: Statistic
    keys: Tuple[int, ...]
    numels: Tuple[int, ...]


class Block(NamedTuple):
    """Where one part of a section lies in a packet: ``rows`` records of ``width`` columns,
    row by row, from ``start``."""

    start: int
    rows: int
    width: int

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.width

    def column(self, j: int) -> range:
        """The positions of column ``j`` of the part, one per row."""
        return range(self.start + j, self.stop, self.width)


class PacketLayout(NamedTuple):
    """Where everything lies in a step packet (:func:`layout`)."""

    sections: Tuple[Tuple[Section, Tuple[Block, ...]], ...]
    """Each section with its parts' blocks, in ``Statistic.parts`` order."""
    scalars: Dict[str, int]
    """The position of each step scalar."""
    size: int


def layout(sections: Sequence[Section], scalars: Sequence[str] = (), offset: int = 0) -> PacketLayout:
    """A packet's layout, the one declaration its writer (``capture.writer``) and its
    readers (:func:`read`, :func:`read_tables`, :func:`read_scalars`, ``incidents.steps``) take offsets from:
    from ``offset``, the sections in order, each part an (n, part width) block row by row,
    then one value per step scalar."""
    placed: List[Tuple[Section, Tuple[Block, ...]]] = []
    for section in sections:
        blocks = []
        for part in section.statistic.parts:
            blocks.append(Block(offset, len(section.keys), len(part)))
            offset = blocks[-1].stop
        placed.append((section, tuple(blocks)))
    return PacketLayout(tuple(placed), {name: offset + i for i, name in enumerate(scalars)}, offset + len(scalars))


# Step scalars: one value per step each, after the sections, in the order the packet's
# ``scalars`` names them. A name may be any string (one per value: a learning rate per
# parameter group would be "lr/0", "lr/1"...); these are the ones gradmon writes.
SCALAR_AMP_SCALE = "amp_scale"
"""The GradScaler's loss scale during the step's backward (with ``scaler=``)."""
SCALAR_AMP_FOUND_INF = "amp_found_inf"
"""Non-zero when a GradScaler handed an optimizer that unscales itself (fused Adam/AdamW/
SGD) the step's overflow flag: the optimizer ran, but applied nothing (a skipped step)."""
SCALAR_LOSS = "loss"
"""The mean of the losses ``Monitor.observe(loss=...)`` was given since the last step."""
SCALAR_GUARD_SKIP = "guard_skip"
"""The step guard's code (:data:`GUARD_CODES`) of a step it skipped; 0 for a step applied."""
SCALAR_GUARD_RUN = "guard_run"
"""Consecutive bad steps up to this one, as the step guard counts them (0: a good step)."""
GUARD_CODES: Dict[str, float] = {M.GUARD_SPIKE: 1.0, M.GUARD_NONFINITE: 2.0}
"""A guard verdict as a number, so that one MAX over the ranks agrees on the most serious reason."""


def guard_verdict(scalars: Mapping[str, float]) -> Tuple[Optional[str], int]:
    """(why the guard skipped the step, or None; the run of bad steps) from its scalars."""
    code, run = scalars.get(SCALAR_GUARD_SKIP, 0.0), scalars.get(SCALAR_GUARD_RUN, 0.0)
    reason = next((r for r, c in GUARD_CODES.items() if c == code), None)
    return reason, int(run) if math.isfinite(run) else 0


SCALAR_LEARNING_RATE = "lr/"
"""Prefix of a parameter group's learning rate held as a tensor (capturable optimizers, a
tensor ``lr``): ``lr/<group>``. A Python-float learning rate needs no packet."""


def learning_rate_scalar(group: int) -> str:
    return f"{SCALAR_LEARNING_RATE}{group}"


def host_learning_rates(lrs: Sequence[Any]) -> Tuple[Optional[float], ...]:
    """Each parameter group's learning rate where it is a Python number, free to read;
    None where it is a tensor (reading it would wait for the device: it is packed)."""
    return tuple(float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None for lr in lrs)


def read_scalars(values: Sequence[float], names: Sequence[str]) -> Dict[str, float]:
    """The step scalars, the packet's last values (after its sections, whatever they are):
    the one reader of what the hooks wrote after the sections."""
    if not names:
        return {}
    placed = layout((), names, offset=len(values) - len(names))
    return {name: values[i] for name, i in placed.scalars.items()}


def read(values: Sequence[float], sections: Sequence[Section], offset: int = 0
         ) -> Iterator[Tuple[Statistic, Section, List[List[float]]]]:
    """Each section's statistic, and its records as rows of column values (in
    ``Statistic.columns`` order): the one reader of what the hooks wrote."""
    for section, blocks in layout(sections, offset=offset).sections:
        rows: List[List[float]] = [[] for _ in section.keys]
        for block in blocks:
            part = values[block.start:block.stop]
            w = block.width
            for k in range(block.rows):
                rows[k].extend(part[k * w:(k + 1) * w])
        yield section.statistic, section, rows


def read_tables(data: torch.Tensor, sections: Sequence[Section], offset: int = 0
                ) -> Iterator[Tuple[Statistic, Section, torch.Tensor]]:
    """As :func:`read`, each section's records as one (n, width) float64 tensor, row k the
    record of ``keys[k]`` in ``Statistic.columns`` order: for folding a step's records
    all at once rather than row by row."""
    for section, blocks in layout(sections, offset=offset).sections:
        parts = [data[b.start:b.stop].view(b.rows, b.width) for b in blocks]
        yield section.statistic, section, (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).double()


def merge_max(a: float, b: float) -> float:
    # max() drops NaN depending on argument order; a NaN activation must stay visible.
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a >= b else b


def merge_min(a: float, b: float) -> float:
    return -merge_max(-a, -b)


def _recentred(row: Sequence[float], n: float) -> Tuple[float, float, float, float]:
    """A record's (mean, M2, M3, M4), central sums about its exact mean: the device's
    shift is off by rounding (a float32 mean of values near 1e4), so its first moment
    m1 is small but not zero; correcting by it involves no cancellation."""
    mean, scale, m1, m2, m3, m4 = row
    a = m1 / n
    return (mean + scale * a,
            scale ** 2 * (m2 - a * m1),
            scale ** 3 * (m3 - 3 * a * m2 + 2 * a * a * m1),
            scale ** 4 * (m4 - 4 * a * m3 + 6 * a * a * m2 - 3 * a ** 3 * m1))


def merge_moments(acc: Sequence[float], n_acc: float, row: Sequence[float], n_row: float) -> List[float]:
    """Fold one record's MOMENTS columns into an accumulator of ``n_acc`` elements (all
    zeros when empty) by the pairwise rule for central moments (Chan et al. 1979, Pébay
    2008): exact in any order, so a layer's several calls and grouped layers give the
    moments of all their elements together."""
    mean_a, _, _, m2a, m3a, m4a = acc
    mean_b, m2b, m3b, m4b = _recentred(row, n_row)
    n = n_acc + n_row
    d = mean_b - mean_a
    na, nb = n_acc, n_row
    m2 = m2a + m2b + d * d * na * nb / n
    m3 = m3a + m3b + d ** 3 * na * nb * (na - nb) / n ** 2 + 3 * d * (na * m2b - nb * m2a) / n
    m4 = (m4a + m4b + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
          + 6 * d * d * (na * na * m2b + nb * nb * m2a) / n ** 2 + 4 * d * (na * m3b - nb * m3a) / n)
    return [mean_a + d * nb / n, 1.0, 0.0, m2, m3, m4]


def baseline_median(baseline: Sequence[float]) -> Optional[float]:
    """The median of ``baseline``; None until it holds MIN_BASELINE values."""
    return median(baseline) if len(baseline) >= MIN_BASELINE else None


def relative(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """``value`` over a baseline's median ``base`` (:func:`baseline_median`; None: no
    baseline yet). An all-zero baseline makes 0 relative 1 (unchanged) and anything larger +Inf."""
    if value is None or base is None:
        return None
    if base == 0.0:
        return 1.0 if value == 0.0 else math.nan if math.isnan(value) else math.inf
    return value / base


NAN_FLAG, POS_INF_FLAG, NEG_INF_FLAG = 1, 2, 4


def nonfinite_flags(lo: float, hi: float) -> int:
    """Which kinds of non-finite value a record of min ``lo`` and max ``hi`` holds, as
    bits: aminmax returns NaN for both when any element is NaN, and an Inf is an extreme."""
    if math.isnan(lo) or math.isnan(hi):
        return NAN_FLAG
    return (POS_INF_FLAG if hi == math.inf else 0) | (NEG_INF_FLAG if lo == -math.inf else 0)
