"""The metric contract: every name, type, label set and help string gradmon exports.

This is the one place that decides metric names. The exporter builds its families
from these specs and the reference's table (docs/metrics.md) is generated from them
(``python -m gradmon.alerting write``); the alert rules and the dashboards are checked
against them by the tests, so a rename here fails loudly everywhere else.
Every series additionally carries the constant labels ``model`` and ``rank`` plus
any user-supplied ``labels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

PREFIX = "gradmon"

#: Labels every gradmon series carries, before the user's constant labels.
BASE_LABELS: Tuple[str, ...] = ("model", "rank")

#: Values of the ``tensor`` label of the non-finite counters.
TENSOR_GRAD = "grad"
TENSOR_GRAD_FLOW = "grad_flow"
TENSOR_ACTIVATION = "activation"
TENSOR_KINDS: Tuple[str, ...] = (TENSOR_GRAD, TENSOR_GRAD_FLOW, TENSOR_ACTIVATION)
#: ``tensor`` label of this rank's own gradient before DDP's all-reduce (gradmon_rank_nonfinite_total).
TENSOR_LOCAL_GRAD = "local_grad"
#: ``tensor`` label of the origin series that names a top-level block (or ``input``).
TENSOR_BLOCK = "block"
#: ``layer`` label values of that series besides the root module's children.
BLOCK_INPUT = "input"
BLOCK_OUTPUT = "output"
NONFINITE_KINDS: Tuple[str, ...] = ("nan", "inf")

#: Values of the ``signal`` label of the spike families: the observed loss, the reduced
#: global gradient norm (rank 0 alone under DDP/FSDP), each rank's own pre-all-reduce norm,
#: and a jump of any layer's gradient norm to norm_jump_ratio times its own baseline.
SIGNAL_LOSS = "loss"
SIGNAL_GRAD_NORM = "grad_norm"
SIGNAL_LOCAL_GRAD_NORM = "local_grad_norm"
SIGNAL_LAYER_GRAD_NORM = "layer_grad_norm"
SIGNAL_ATTENTION_GROWTH = "attention_growth"  # an event, not a scored spike: an attention layer's growth doubled
SPIKE_SIGNALS: Tuple[str, ...] = (SIGNAL_LOSS, SIGNAL_GRAD_NORM, SIGNAL_LOCAL_GRAD_NORM, SIGNAL_LAYER_GRAD_NORM,
                                  SIGNAL_ATTENTION_GROWTH)
EVENT_SIGNALS: Tuple[str, ...] = (SIGNAL_ATTENTION_GROWTH,)
"""Signals no spike detector scores: their steps are decided elsewhere (``SpikeTracker.event``)."""

#: Values of the ``reason`` label of gradmon_guard_skipped_steps_total: why the step guard
#: (``guard=``) skipped an optimizer step.
GUARD_NONFINITE = "nonfinite"
GUARD_SPIKE = "spike"
GUARD_REASONS: Tuple[str, ...] = (GUARD_NONFINITE, GUARD_SPIKE)

#: Families (the ``family`` label of coverage metrics, and config switches).
FAMILY_GRAD = "grad"
FAMILY_GRAD_FLOW = "grad_flow"
FAMILY_ACTIVATION = "activation"
FAMILY_OPTIMIZER = "optimizer"
FAMILIES: Tuple[str, ...] = (FAMILY_GRAD, FAMILY_GRAD_FLOW, FAMILY_ACTIVATION, FAMILY_OPTIMIZER)

#: Run states exported by ``gradmon_run_state``. The ends of a run: ``finished`` (detach,
#: the end of a ``with`` block or of the script), ``failed`` (an exception or a non-zero
#: ``sys.exit``; pages), ``interrupted`` (Ctrl-C), ``terminated`` (SIGTERM, with
#: ``handle_sigterm``). A target that vanishes after any of them is not "down".
STATE_TRAINING = "training"
STATE_PAUSED = "paused"
STATE_FINISHED = "finished"
STATE_FAILED = "failed"
STATE_INTERRUPTED = "interrupted"
STATE_TERMINATED = "terminated"
END_STATES: Tuple[str, ...] = (STATE_FINISHED, STATE_FAILED, STATE_INTERRUPTED, STATE_TERMINATED)
RUN_STATES: Tuple[str, ...] = (STATE_TRAINING, STATE_PAUSED) + END_STATES

#: Log-spaced buckets for the global-norm histogram: four per decade from 1e-8 to 1e8.
#: A gauge holding the last value misses a one-step spike between two scrapes; this
#: cumulative histogram does not.
GLOBAL_NORM_BUCKETS: Tuple[float, ...] = tuple(
    float(f"{10 ** (e / 4):.6g}") for e in range(-32, 33)
)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str  # "gauge" | "counter" | "histogram" | "info-gauge"
    labels: Tuple[str, ...]
    help: str
    """The exposition's HELP line: one sentence."""
    doc: str = ""
    """The reference's text (docs/metrics.md, generated; Markdown, links relative to docs/)
    where it says more than ``help``."""
    values: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    """The values a label takes, where they are a fixed set: listed in the reference."""


def _spec(name: str, type_: str, labels: Tuple[str, ...], help_: str, doc: str = "",
          values: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()) -> MetricSpec:
    return MetricSpec(f"{PREFIX}_{name}", type_, labels, help_, doc, values)


GRAD_NORM = _spec("grad_norm", "gauge", ("layer",),
                  "L2 norm of the layer's parameter gradients at the last sampled step (pre-clip, accumulated, all-reduced).",
                  doc="L2 norm of the layer's parameter gradients at the last sampled step: pre-clip, accumulated"
                      " over micro-batches, after DDP's all-reduce")
GRAD_GLOBAL_NORM = _spec("grad_global_norm", "gauge", (),
                         "L2 norm over all monitored parameter gradients at the last step (pre-clip).",
                         doc="L2 norm over all monitored parameter gradients at the last step (what "
                             "`clip_grad_norm_` returns)")
GRAD_GLOBAL_NORM_DISTRIBUTION = _spec("grad_global_norm_distribution", "histogram", (),
                                      "Global gradient norm of every optimizer step, log-bucketed; never reset.",
                                      doc="Global norm of every step, 4 log buckets per decade from 1e-8 to 1e8; "
                                          "catches a one-step spike between two scrapes. Non-finite norms are "
                                          "left out (they are counted below). Under DDP/FSDP, where every rank "
                                          "holds the same reduced norm, rank 0 alone exports it")
LOCAL_GRAD_NORM = _spec("local_grad_norm", "gauge", ("layer",),
                        "L2 norm of this rank's own gradient of the layer before DDP's all-reduce (multi-rank jobs).",
                        doc="This rank's own gradient of the layer before DDP's all-reduce (`local_view`, on "
                            "under DDP; on ranks other than data-parallel rank 0 only with `all_ranks_per_layer`)")
LOCAL_GRAD_GLOBAL_NORM = _spec("local_grad_global_norm", "gauge", (),
                               "L2 norm of this rank's own gradient before DDP's all-reduce: the per-rank signal of a bad rank.",
                               doc="This rank's own global gradient norm before the all-reduce: locates a bad "
                                   "rank or shard")
LOCAL_NONFINITE = _spec("local_nonfinite", "counter", ("layer", "kind"),
                        "Non-finite elements in this rank's own gradient before DDP's all-reduce.",
                        doc="Non-finite elements in this rank's own gradient before the all-reduce; exists at 0",
                        values=(("kind", NONFINITE_KINDS),))
GRAD_FLOW_NORM = _spec("grad_flow_norm", "gauge", ("layer",),
                       "L2 norm of the gradient with respect to the layer's output at the last detail step.",
                       doc="L2 norm of the gradient w.r.t. the layer's output (detail steps)")
ACTIVATION_RMS = _spec("activation_rms", "gauge", ("layer",),
                       "RMS of the layer's output at the last detail step (training forward passes only).",
                       doc="RMS of the layer's output over all its calls in the step (detail steps, training "
                           "forwards only)")
ACTIVATION_ABS_MAX = _spec("activation_abs_max", "gauge", ("layer",),
                           "Max |x| of the layer's output at the last detail step.",
                           doc="max |x| of the layer's output (detail steps)")
UPDATE_TO_WEIGHT_RATIO = _spec("update_to_weight_ratio", "gauge", ("layer",),
                                "‖Δw‖/‖w_{t-1}‖ of the update the optimizer applied to the layer's parameters at the "
                                "last optimizer_every step (SGD, Adam, AdamW; rebuilt from the optimizer's state).",
                               doc="‖Δw‖/‖w_{t-1}‖ over the layer's parameters: the update SGD, Adam or AdamW "
                                   "applied at the last `optimizer_every` step, rebuilt from its state (see "
                                   "[Optimizer statistics](how-it-works.md#optimizer-statistics))")
ADAM_RMS = _spec("adam_rms", "gauge", ("layer",),
                 "sqrt(mean(g²/max(v̂, ε²))) of the layer's parameters at the last optimizer_every step (Adam, "
                 "AdamW): bounded by about (1-β2)^(-1/2); near the bound, v̂ lags a gradient spike.",
                 doc="`sqrt(mean(g²/max(v̂, ε²)))` over the layer's parameters at the last `optimizer_every` step"
                     " (Adam, AdamW); bounded by about `(1-β2)^(-1/2)`")
ADAM_GRAD_RMS_OVER_EPS = _spec(
    "adam_grad_rms_over_eps", "gauge", ("layer",),
    "sqrt(mean(v̂))/ε of the layer's parameters at the last optimizer_every step (Adam, AdamW): the gradients' "
    "scale as Adam sees it, in units of its ε; near 1 or below, ε dominates the update's denominator.",
    doc="`sqrt(mean(v̂))/ε` over the layer's parameters at the last `optimizer_every` step (Adam, AdamW): "
        "the gradients' RMS as Adam's second moment holds it, in units of the parameter group's `eps`. Near 1 "
        "or below, ε dominates `√v̂ + ε`: the layer's updates shrink toward SGD with `lr/ε`, the regime "
        "Molybog et al. (2023) tie to loss spikes in large runs")
PARAM_NORM = _spec("param_norm", "gauge", ("layer",),
                   "L2 norm of the layer's parameters after the last optimizer_every step.",
                   doc="L2 norm of the layer's parameters right after the optimizer's step, read at the last "
                       "`optimizer_every` step with any optimizer; under FSDP the shards' sums of squares are "
                       "added over the shard group, as the gradient norms' are. On by default with "
                       "`optimizer_every` (`0` turns it off): one series per layer, counted in `series_budget`; "
                       "under DDP/FSDP rank 0 alone exports it (every rank holds the same weights)")
GRAD_NORM_BASELINE_RATIO = _spec("grad_norm_baseline_ratio", "gauge", ("layer",),
                                 "The layer's gradient norm over its own baseline: the median of its last norm_baseline "
                                 "sampled measurements (absent until 8 exist; restarted by a learning-rate jump).",
                                 doc="`gradmon_grad_norm` over its own baseline, the median of the layer's last "
                                     "`norm_baseline` sampled measurements (this one included; non-finite ones "
                                     "left out); absent until 8 exist and again for 8 measurements after a "
                                     "learning-rate jump or a resume. ~1 when healthy; the per-layer early "
                                     "warning of a loss spike (see [Alerts](alerts.md))")
GRAD_NORM_ABOVE_BASELINE_STEPS = _spec(
    "grad_norm_above_baseline_steps", "gauge", (),
    "Sampled steps in a row, up to the last, in which a layer's gradient norm was above norm_baseline_ratio (4) times "
    "its own baseline (gradmon_grad_norm_baseline_ratio): the longest such run among the layers; 0 when none is.",
    doc="Sampled steps in a row, up to the last, in which a layer's `gradmon_grad_norm_baseline_ratio` was above "
        "`norm_baseline_ratio` (4): the longest such run among layers, counted in the process at every sampled "
        "step, so that `GradmonGradNormAboveBaseline` holds for steps, not minutes; 0 when none is")
UPDATE_RATIO_BASELINE_RATIO = _spec("update_ratio_baseline_ratio", "gauge", ("layer",),
                                    "The layer's update-to-weight ratio over its own baseline: the median of its last "
                                    "update_baseline optimizer_every measurements (absent until 8 exist; restarted by "
                                    "a learning-rate jump).",
                                    doc="`gradmon_update_to_weight_ratio` over its own baseline, the median of "
                                        "the layer's last `update_baseline` measurements; absent until 8 exist "
                                        "and again after a learning-rate jump or a resume")
LEARNING_RATE = _spec("learning_rate", "gauge", ("group",),
                      "Learning rate of each parameter group (index) of the optimizer at the last step.",
                      doc="Learning rate of each param group (`\"0\"`, `\"1\"`...) of the optimizer that closed the "
                          "last step; every rank exports it")
LEARNING_RATE_OVER_PEAK = _spec("learning_rate_over_peak", "gauge", ("group",),
                                "Learning rate of each parameter group over its settled peak, the highest rate it "
                                "held before 100 steps without a new high (absent until one).",
                                doc="Each param group's learning rate over its settled peak: the highest rate it "
                                    "held before 100 steps went by without a new high. Absent until a peak has "
                                    "settled (never during a warm-up that rises at every step); at most 1 through "
                                    "a decay or a restart back to the same peak; above 1 after a rise past it, "
                                    "until the new rate has held for 100 steps. Counted in the process, per "
                                    "process: a resumed job settles its peak again")
ROLE_ATTENTION, ROLE_OUTPUT = "attention", "output"
ACTIVATION_GROWTH = _spec("activation_growth", "gauge", ("layer", "role"),
                          "Max |x| of an attention query/key projection's output (role=attention) or of the "
                          "model's last linear layer, its logits (role=output), over its first detail "
                          "measurement since attach.",
                          doc="max |x| of the layer's output at the last detail step over its first one since "
                              "attach (the first finite, positive one): how far it grew. `role=\"attention\"`: the "
                              "layers `attention_layers` names (query and key projections); `role=\"output\"`: "
                              "the model's last `nn.Linear` (its logits). Only those layers have the series",
                          values=(("role", (ROLE_ATTENTION, ROLE_OUTPUT)),))
ACTIVATION_ABS_MAX_RATIO = _spec("activation_abs_max_ratio", "gauge", ("layer",),
                                 "The layer's output max |x| over its own baseline: the median of its last "
                                 "activation_baseline detail measurements (absent until 8 exist).",
                                 doc="max |x| of the layer's output over its own baseline, the median of its last"
                                     " `activation_baseline` detail measurements (this one included; non-finite "
                                     "ones left out); absent until 8 exist. ~1 when healthy, whatever the "
                                     "precision; an all-zero baseline gives 1 for 0 and `+Inf` otherwise")
ACTIVATION_KURTOSIS = _spec("activation_kurtosis", "gauge", ("layer",),
                            "Pearson kurtosis (a Gaussian is 3) of the layer's flattened output at the last detail step.",
                            doc="Pearson kurtosis n·Σ(x−x̄)⁴ / (Σ(x−x̄)²)² of the layer's flattened output over "
                                "all its calls in the step (a Gaussian is 3, not 0; outlier features push it far "
                                "up); detail steps with `activation_kurtosis`; absent for a constant output")
FP16_RANGE_USED = _spec("fp16_range_used", "gauge", ("layer", "tensor"),
                        "max |x| / 65504 of the layer's float16 output (tensor=activation) or of the float16 gradient "
                        "w.r.t. it, loss scale included (tensor=grad), at the last detail step; float16 layers only.",
                        doc="max |x| / 65504 of the layer's float16 output (`activation`) and of the float16 "
                            "gradient w.r.t. that output as backward carries it, loss scale included (`grad`); 1 "
                            "is overflow, above 0.5 leaves less than 2x headroom. Only for layers whose tensors "
                            "are float16 (no series for fp32/bf16 layers); detail steps, `fp16_headroom`",
                        values=(("tensor", (TENSOR_ACTIVATION, TENSOR_GRAD)),))
GRAD_FP16_UNDERFLOW_FRACTION = _spec("grad_fp16_underflow_fraction", "gauge", ("layer",),
                                     "Fraction of exact zeros among the float16 gradient w.r.t. the layer's output at "
                                     "the last detail step (underflows and true zeros alike); float16 layers only.",
                                     doc="Fraction of the elements of the float16 gradient w.r.t. the layer's "
                                         "output that are exactly 0, loss scale included. From the fp16 tensor "
                                         "alone an underflow cannot be told from a true zero, so true zeros (dead"
                                         " ReLUs, masked positions) count too: watch its rise, not its level. "
                                         "fp16 layers only; detail steps, `fp16_headroom`")
NONFINITE = _spec("nonfinite", "counter", ("layer", "tensor", "kind"),
                  "Non-finite (NaN or Inf) elements seen, by layer, tensor and kind.",
                  doc="Non-finite elements seen; exists at 0 from `attach()`",
                  values=(("tensor", TENSOR_KINDS), ("kind", NONFINITE_KINDS)))
RANK_NONFINITE = _spec("rank_nonfinite", "counter", ("tensor", "kind"),
                       "Non-finite elements this rank saw, all layers together, by tensor (grad, grad_flow, "
                       "activation, local_grad) and kind: on every rank, at 0 from attach, also where per-layer "
                       "series are off (ranks other than data-parallel rank 0).",
                       doc="Non-finite elements this rank saw, all layers together (`tensor`: grad, grad_flow, "
                           "activation, local_grad); on every rank, at 0 from attach",
                       values=(("tensor", TENSOR_KINDS + (TENSOR_LOCAL_GRAD,)), ("kind", NONFINITE_KINDS)))
LOCAL_GRAD_NORM_ABOVE_BASELINE_STEPS = _spec(
    "local_grad_norm_above_baseline_steps", "gauge", (),
    "Steps in a row, up to the last, in which this rank's own gradient norm of a layer (before the all-reduce) was "
    "above norm_baseline_ratio (4) times that layer's baseline on this rank: the longest such run among layers; "
    "0 when none is.",
    doc="Steps in a row, up to the last, in which this rank's own gradient norm of a layer (before the "
        "all-reduce) was above `norm_baseline_ratio` (4) times its baseline on the rank: the longest such run "
        "among layers, counted in the process, so that `GradmonLocalGradNormAboveBaseline` holds for steps, not "
        "minutes; on every rank with `local_view`; 0 when none is")
ACTIVATION_GROWTH_WORST = _spec("activation_growth_worst", "gauge", ("layer",),
                                "The largest growth of an attention projection's max |x| over its first "
                                "measurement on this rank, labelled with that layer: on every rank.",
                                doc="This rank's largest `gradmon_activation_growth{role=\"attention\"}`, labelled "
                                    "with its layer (held through near ties as the other worst-layer gauges are); on "
                                    "every rank, so that a rank without per-layer series still warns")
ACTIVATION_ABS_MAX_WORST = _spec("activation_abs_max_worst", "gauge", ("layer",),
                                 "The largest max |x| of any layer's output on this rank at its last detail step, "
                                 "labelled with that layer (or with the layer that held the label while it is within "
                                 "25% of the largest: no new series for near ties): on every rank.",
                                 doc="This rank's largest layer-output max |x| at its last detail step, labelled "
                                     "with that layer; on every rank. A layer keeps the label while the largest "
                                     "is within 25% of its own value, so near ties do not make a new series every"
                                     " scrape")
LOCAL_GRAD_NORM_RATIO_WORST = _spec("local_grad_norm_baseline_ratio_worst", "gauge", ("layer",),
                                    "The largest ratio of a layer's own gradient norm on this rank (before DDP's "
                                    "all-reduce) to that layer's baseline (the median of its last norm_baseline "
                                    "steps), at the last step, labelled with that layer from a ratio of 2 up (below, "
                                    "no layer stands out and none is named), as the activation one keeps it through "
                                    "near ties (local_view; absent until 8 steps exist; restarted by an lr jump).",
                                    doc="This rank's largest ratio of a layer's own (pre-all-reduce) gradient "
                                        "norm to that layer's median of its last `norm_baseline` steps "
                                        "(`local_view`); labelled with the layer from 2 up (below, no label: none"
                                        " stands out), with the same 25% rule")
NONFINITE_ORIGIN = _spec("nonfinite_origin_step", "gauge", ("tensor", "layer"),
                         "First step of the latest run of steps with non-finite gradients, on where it started: the "
                         "first top-level block (or input) in forward order whose output carried new non-finite "
                         "values for tensor=block, the first layer in forward order for tensor=activation (detail "
                         "steps), the first in backward order for tensor=grad.",
                         doc="First step of the latest run of steps with non-finite gradients, on where it "
                             "started: `block`: `input` (the batch), the first of the model's top-level blocks in"
                             " forward order, or `output` (every step); `activation`: the first layer in forward "
                             "order (detail steps, or every step with `origin_per_layer`); `grad`: the first "
                             "layer in backward order. Kept until a finite step ends the run",
                         values=(("tensor", (TENSOR_BLOCK, TENSOR_ACTIVATION, TENSOR_GRAD)),))
GRAD_NORM_OVERFLOW_STEPS = _spec("grad_norm_overflow_steps", "counter", (),
                                 "Steps whose global gradient norm overflowed to +Inf while every gradient element "
                                 "was finite (counted in the histogram's +Inf bucket, never in its _sum).",
                                 doc="Steps whose global norm overflowed float32 to `+Inf` while every gradient "
                                     "element was finite; counted in the histogram's `+Inf` bucket and `_count`, "
                                     "never in `_sum`")
GROUPED_LAYERS = _spec("grouped_layers", "gauge", (),
                       "Layers merged into module-name-prefix groups to stay within series_budget (0: none).",
                       doc="Layers merged into module-name-prefix groups to stay within `series_budget` (0: none)")
AMP_SKIPPED_STEPS = _spec("amp_skipped_steps", "counter", (),
                          "Steps the GradScaler skipped on overflow (given attach(scaler=...)); not non-finite incidents.",
                          doc="Steps the GradScaler skipped on overflow (with `scaler=`); not non-finite "
                              "incidents")
GUARD_SKIPPED_STEPS = _spec("guard_skipped_steps", "counter", ("reason",),
                            "Optimizer steps the step guard (guard=) skipped, by reason (nonfinite, spike): parameters "
                            "and optimizer state left as they were, on every rank alike; at 0 for each reason the "
                            "guard watches, absent without a guard. Not counted here: the GradScaler's own skips.",
                            doc="Optimizer steps the step guard (`guard=`) skipped, parameters and optimizer state "
                                "left as they were, on every rank alike; at 0 for each reason the guard watches, "
                                "absent without a guard; the GradScaler's own skips are not counted here (see "
                                "[the step guard](guard.md))",
                            values=(("reason", GUARD_REASONS),))
GUARD_LAST_SKIP_STEP = _spec("guard_last_skip_step", "gauge", ("reason",),
                             "Global step of the latest optimizer step the step guard (guard=) skipped, with its "
                             "reason; absent until the first skip (a model attached again in the same process "
                             "goes on from the earlier monitor's, as its counters do).",
                             doc="Global step of the latest step the step guard (`guard=`) skipped (the step "
                                 "`exclude.jsonl` lists it under), labelled with its reason; absent until the first "
                                 "skip; a model attached again in the same process goes on from the earlier "
                                 "monitor's, as its counters do",
                             values=(("reason", GUARD_REASONS),))
AMP_LOSS_SCALE = _spec("amp_loss_scale", "gauge", (), "The GradScaler's loss scale at the last step.",
                       doc="The GradScaler's loss scale at the last step (with `scaler=`)")
LOSS = _spec("loss", "gauge", (),
             "Mean of the losses given to monitor.observe(loss=...) in the last step that observed one, on this rank.",
             doc="Mean of the losses given to `monitor.observe(loss=...)` in the last step that observed one, on "
                 "this rank; absent until then (see [Loss and spikes](how-it-works.md#loss-and-spikes))")
LOSS_RUNNING_MIN = _spec("loss_running_min", "gauge", (),
                         "Smallest finite gradmon_loss since attach, on this rank.",
                         doc="Smallest finite `gradmon_loss` since `attach()`, on this rank (for \"loss above 2x "
                             "its running minimum\")")
SPIKE_SCORE = _spec("spike_score", "gauge", ("signal",),
                    "Robust one-sided score of the signal at its last scored step: its distance above the detrended "
                    "median of the last spike_window steps, in robust standard deviations (ln units); for "
                    "layer_grad_norm, the largest gradmon_grad_norm_baseline_ratio of the last sampled step.",
                    doc="Robust one-sided score of the signal at its last scored step (absent before one); for "
                        "`layer_grad_norm`, the largest layer's score against its own adaptive baseline",
                    values=(("signal", SPIKE_SIGNALS),))
SPIKE_STEPS = _spec("spike_steps", "counter", ("signal",),
                    "Steps whose signal scored above spike_threshold and was above twice its window's median "
                    "(layer_grad_norm: a layer's norm at norm_jump_ratio times its own baseline or more); "
                    "counted in the process, so a one-step spike between two scrapes is never missed.",
                    doc="Steps counted as spikes in the process (never missed between scrapes); exists at 0 from "
                        "`attach()` for the signals this rank scores",
                    values=(("signal", SPIKE_SIGNALS),))
STEPS_SINCE_SPIKE = _spec("steps_since_spike", "gauge", ("signal",),
                          "Optimizer steps since the signal's last spike step (0: the last step was one); absent "
                          "until the signal's first spike. Counted in steps, so a rule's hold means the same thing at "
                          "any step rate.",
                          doc="Optimizer steps since the signal's last spike step (0: the last step); absent "
                              "until its first spike")
STEPS_SINCE_SPIKE_BURST = _spec(
    "steps_since_spike_burst", "gauge", ("signal",),
    "Optimizer steps since the signal's last burst of spikes: a spike step with at least spike_burst (3) spike steps "
    "of the signal within the last spike_hold_steps (20) steps; absent until the first. What the spike warnings read: "
    "a lone spike is counted (gradmon_spike_steps_total) but does not warn.",
    doc="Optimizer steps since the signal's last burst of spikes (3 spike steps within 20 steps; 0: the last step); "
        "absent until the first burst")
LOSS_TREND = _spec("loss_trend", "gauge", (),
                   "Mean of the last 20 finite losses given to monitor.observe(loss=...) (absent until 20 exist).",
                   doc="Mean of the last 20 finite losses given to `observe(loss=...)`; absent until 20 exist")
LOSS_TREND_BEST = _spec("loss_trend_best", "gauge", (),
                        "Lowest gradmon_loss_trend since attach (or since a resumed run's first step).",
                        doc="Lowest `gradmon_loss_trend` since `attach()` (or a resumed run's first step)")
LOSS_RISING_STEPS = _spec("loss_rising_steps", "gauge", (),
                          "Steps the loss trend has been rising: at 1.5x its best or more (and half loss_floor above it), "
                          "until it falls below 1.3x; 0 when it is not.",
                          doc="Steps the loss trend has been at 1.5x its best or more (until back below 1.3x); 0 "
                              "when not")
LOSS_DIVERGING_STEPS = _spec("loss_diverging_steps", "gauge", (),
                             "Steps of the current confirmed divergence, decided in the process at every step: the "
                             "loss trend at 2x its best and loss_floor above it (or a loss back at the run's starting "
                             "level), with evidence that the model climbed there (a climb through intermediate values, "
                             "a spike before the climb, a learning rate above its settled peak, 100 diverged steps, 200 "
                             "steps without settling back, or a non-finite loss); 0 when none.",
                             doc="Steps of the current confirmed divergence (see `GradmonLossDiverging`); 0 when "
                                 "none")
LOSS_DIVERGENCES = _spec("loss_divergences", "counter", (),
                         "Confirmed divergences entered (see gradmon_loss_diverging_steps): a divergence shorter "
                         "than a scrape interval still counts.",
                         doc="Confirmed divergences entered: one shorter than a scrape interval still counts")
DIVERGENCE_EVIDENCE = _spec("loss_divergence_evidence", "gauge", ("signal",),
                            "1 for each signal whose evidence confirmed the current divergence: a spike signal that "
                            "spiked before the loss climbed, loss_creep (a climb through intermediate values), "
                            "learning_rate_above_peak (a learning rate above its settled peak before or during the "
                            "climb), loss_sustained, loss_unrecovered or nonfinite_loss; absent while no divergence is "
                            "confirmed.",
                            doc="1 for each kind of evidence that confirmed the current divergence (`signal`: a spike "
                                "signal, `loss_creep` (a climb), `learning_rate_above_peak`, `loss_sustained`, "
                                "`loss_unrecovered` or `nonfinite_loss`); absent while none")
NONFINITE_STEPS = _spec("nonfinite_steps", "counter", (),
                        "Optimizer steps in which any monitored tensor held a non-finite element.",
                        doc="Steps in which any monitored tensor was non-finite")
STEPS = _spec("steps", "counter", (), "Optimizer steps seen since the first attach of this model name and labels in this process.",
              doc="Optimizer steps seen since the first `attach()` of this model name and labels in the process")
STEP = _spec("step", "gauge", (),
             "The training's own global step at the last optimizer step (from the optimizer state or monitor.step(n)).",
             doc="The training's own global step (a value, never a label)")
LAST_STEP_TIMESTAMP = _spec("last_step_timestamp_seconds", "gauge", (),
                            "Unix time at which the last optimizer step finished.",
                            doc="Unix time the last step finished")
HOOK_ERRORS = _spec("hook_errors", "counter", ("stage",),
                    "Exceptions caught inside gradmon, by stage; training carried on.",
                    doc="Exceptions caught inside gradmon (training carried on)")
OVERHEAD_SECONDS = _spec("overhead_seconds", "counter", (),
                         "Wall time gradmon spent on the training thread.",
                         doc="Time gradmon spent on the training thread")
INFO = _spec("info", "info-gauge", ("version", "torch_version", "world_size"),
             "Build and job facts; the value is always 1.",
             doc="Build and job facts")
WORLD_SIZE = _spec("world_size", "gauge", (),
                   "Number of ranks in the job (torch.distributed or WORLD_SIZE), as a value so rules can compare against it.",
                   doc="Ranks in the job, as a value (alerts compare reporting ranks against it)")
RUN_STATE = _spec("run_state", "gauge", ("state",),
                  "1 for the current run state (training, paused, finished, failed, interrupted, terminated), "
                  "0 for the others.",
                  doc="1 for the current state (see [How a run ends](alerts.md#how-a-run-ends))",
                  values=(("state", RUN_STATES),))
RUN_FAILURE_INFO = _spec("run_failure_info", "info-gauge", ("exception",),
                         "Present (value 1) once the run state is failed: the exception's type name, never its message.",
                         doc="Present once the run state is `failed`: the exception's type name, never its "
                             "message")
UNCOVERED_LAYERS = _spec("uncovered_layers", "gauge", ("family",),
                         "Monitored layers a family could not observe (e.g. a forward that never runs).",
                         doc="Monitored layers a family cannot observe (see [Coverage](how-it-works.md#coverage))")
PROCESS_RESIDENT_MEMORY = _spec("process_resident_memory_bytes", "gauge", (),
                                "Resident memory of the training process.",
                                doc="Resident memory of the process")
PROCESS_CPU_SECONDS = _spec("process_cpu_seconds", "counter", (),
                            "User and system CPU time of the training process.",
                            doc="CPU time of the process")
PROCESS_THREADS = _spec("process_threads", "gauge", (), "Threads of the training process.",
                        doc="Threads of the process")
CUDA_MEMORY_ALLOCATED = _spec("cuda_memory_allocated_bytes", "gauge", ("device",),
                              "Memory held by tensors on the CUDA device (torch.cuda.memory_allocated).",
                              doc="`torch.cuda.memory_allocated` (CUDA only)")
CUDA_MEMORY_RESERVED = _spec("cuda_memory_reserved_bytes", "gauge", ("device",),
                             "Memory reserved by PyTorch's caching allocator on the CUDA device.",
                             doc="`torch.cuda.memory_reserved` (CUDA only)")

ALL_SPECS: Tuple[MetricSpec, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, MetricSpec)
)


def exposed_names(spec: MetricSpec) -> Tuple[str, ...]:
    """The sample names a family produces in the text exposition."""
    if spec.type == "counter":
        return (spec.name + "_total",)
    if spec.type == "histogram":
        return (spec.name + "_bucket", spec.name + "_sum", spec.name + "_count")
    return (spec.name,)
