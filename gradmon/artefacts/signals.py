"""What moves before a loss diverges: the loss trend itself (decided in the process,
``gradmon/divergence.py``), spikes, per-layer norms and updates far above their own
baselines (counted in steps, in the process), Adam's RMS, fp16 headroom and the learning
rate."""

from __future__ import annotations

from typing import List

from .. import metrics as M
from ..thresholds import Thresholds, Timing, dur
from .alert import NEVER_FP32, NEVER_SINGLE_RANK, WHERE, Alert, past_warmup
from .names import TARGET, sample
from .spikes import spike_alerts


def diverging(t: Timing) -> str:
    """The confirmed divergence, decided in the process at every step (``divergence.py``):
    its state, or one entered and left since the previous scrape (the counter moved between
    the last two scrapes)."""
    return (f"max by ({TARGET}) ({M.LOSS_DIVERGING_STEPS.name}) > 0\n"
            f"or\nmax by ({TARGET}) (idelta({sample(M.LOSS_DIVERGENCES)}[{dur(t.event_window)}])) > 0")


def loss_alerts(t: Timing) -> List[Alert]:
    return [
        Alert("GradmonLossDiverging", "critical", "The loss is diverging, confirmed",
              f"The loss trend (mean of the last 20 losses) is at least 2x its best and loss_floor above it, "
              f"or a loss is back at the run's starting level ({WHERE}), with evidence that the model climbed "
              "there rather than a batch jumping: a climb through intermediate values, a loss or gradient spike "
              "before the climb, a learning rate above its settled peak, 100 steps diverged, 200 steps without "
              "settling back under 1.3x, or a non-finite loss "
              "(gradmon_loss_divergence_evidence "
              "says which). Decided in the process at every step. Value: {{ $value }}.",
              diverging(t), 0),
        Alert("GradmonLossRising", "warning", "The loss is rising above its best",
              f"The loss trend (mean of the last 20 losses) has been at least 1.5x its best for "
              f"{{{{ $value }}}} steps ({WHERE}) and is not back below 1.3x: the run is losing what it "
              "learned. Not a page until the loss confirms a divergence.",
              f"max by ({TARGET}) ({M.LOSS_RISING_STEPS.name}) > 0", 0),
    ]


def above_for_steps(ratio: M.MetricSpec, steps: M.MetricSpec, th: Thresholds) -> str:
    """A layer's norm over its baseline above ``norm_baseline_ratio`` at the scrape, a layer
    of the target above it for ``norm_ratio_steps`` steps in a row (``steps``, counted in the
    process), past warm-up."""
    return (f"max by ({TARGET}, layer) ({ratio.name}) > {th.norm_baseline_ratio:g}\n"
            f"and on({TARGET}) max by ({TARGET}) ({steps.name}) >= {th.norm_ratio_steps}\n"
            f"and on({TARGET}) {past_warmup(th)}")


def baseline_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    """A layer's norm, one rank's own norm of a layer, or a layer's updates, sustained far
    above the layer's own baseline."""
    post = f"on({TARGET}) {past_warmup(th)}"
    return [
        Alert("GradmonGradNormAboveBaseline", "warning", "A layer's gradient norm far above its own baseline",
              f"Gradient norm of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}}x the median of its own "
              f"recent sampled steps ({WHERE}), and a layer has been above {th.norm_baseline_ratio:g}x for "
              f"{th.norm_ratio_steps} sampled steps in a row or more (counted in the process: the same at any step "
              "rate): in unstable runs the embeddings and first blocks move first, steps before the loss spikes.",
              above_for_steps(M.GRAD_NORM_BASELINE_RATIO, M.GRAD_NORM_ABOVE_BASELINE_STEPS, th), 0),
        Alert("GradmonLocalGradNormAboveBaseline", "warning",
              "One rank's own gradient of a layer far above that layer's baseline",
              f"Rank {{{{ $labels.rank }}}}'s own gradient norm of layer {{{{ $labels.layer }}}} (before the all-reduce) "
              f"is {{{{ $value | humanize }}}}x that layer's median on this rank ({WHERE}), and a layer of this rank "
              f"has been above {th.norm_baseline_ratio:g}x for {th.norm_ratio_steps} steps in a row or more (counted "
              f"in the process: the same at any step rate): a blow-up in this rank's data that the average over ranks "
              f"hides. {NEVER_SINGLE_RANK}",
              above_for_steps(M.LOCAL_GRAD_NORM_RATIO_WORST, M.LOCAL_GRAD_NORM_ABOVE_BASELINE_STEPS, th), 0),
        Alert("GradmonUpdateRatioAboveBaseline", "warning", "A layer's updates far above their own baseline",
              f"Update-to-weight ratio of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}}x the median of "
              f"its own recent readings ({WHERE}) at its last reading, above {th.update_baseline_ratio:g}x (a reading "
              "every optimizer_every steps, held until the next: it warns for steps, not minutes).",
              # the gauge holds each reading optimizer_every steps, as Adam's RMS does: a
              # reading between two scrapes is seen, and a `for:` in minutes would be a
              # different number of readings at every step rate
              f"max by ({TARGET}, layer) ({M.UPDATE_RATIO_BASELINE_RATIO.name}) > {th.update_baseline_ratio:g}\n"
              f"and {post}",
              0),
    ]


def optimizer_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    """Adam's second moment lagging a spike, a float16 tensor near overflow, and a learning
    rate that is non-finite or stuck at 0."""
    post = f"on({TARGET}) {past_warmup(th)}"
    lr = M.LEARNING_RATE.name
    fp16 = f"max by ({TARGET}, layer, tensor) ({M.FP16_RANGE_USED.name}"
    return [
        Alert("GradmonAdamRmsSpike", "warning", "Adam's second moment lags a gradient spike",
              f"Adam's RMS(g/sqrt(v)) of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}} at its last "
              f"reading ({WHERE}), above {th.adam_rms_spike:g} (about 1 when healthy).",
              # the gauge holds each reading until the next, optimizer_every steps later: a
              # reading between two scrapes is seen, and it warns for steps, not minutes
              f"max by ({TARGET}, layer) ({M.ADAM_RMS.name}) > {th.adam_rms_spike:g}\nand {post}",
              0),
        Alert("GradmonFp16HeadroomLow", "warning", "A float16 tensor is near overflow",
              f"max |x| of the float16 {{{{ $labels.tensor }}}} of layer {{{{ $labels.layer }}}} is "
              f"{{{{ $value | humanizePercentage }}}} of 65504 ({WHERE}): less than {th.fp16_min_headroom:g}x headroom. "
              f"{NEVER_FP32}",
              f"{fp16}{{tensor=\"{M.TENSOR_ACTIVATION}\"}}) > {1 / th.fp16_min_headroom:g}\n"
              f"or\n"
              f"(\n  {fp16}{{tensor=\"{M.TENSOR_GRAD}\"}}) > {1 / th.fp16_min_headroom:g}\n"
              f"  unless on({TARGET}) {M.AMP_LOSS_SCALE.name}\n)",
              t.fp16_for),
        Alert("GradmonLearningRateNonFinite", "critical", "Learning rate is NaN or infinite",
              f"Learning rate of parameter group {{{{ $labels.group }}}} is {{{{ $value }}}} ({WHERE}): "
              "every update from now on poisons the weights.",
              f"max by ({TARGET}, group) ({lr} != {lr} or abs({lr}) == Inf)", 0),
        Alert("GradmonLearningRateAbovePeak", "warning", "Learning rate above its earlier peak",
              f"Learning rate of parameter group {{{{ $labels.group }}}} is {{{{ $value | humanize }}}}x the highest "
              f"rate it had settled at ({WHERE}): a schedule restarted above its peak, a resume with the wrong "
              "schedule, or a rate scaled by mistake. A model converged at its rate often collapses within tens "
              "of steps of such a rise.",
              # counted in the process per step: the rise is seen at any step rate, and the
              # gauge holds above the bar until the new rate has held lr_settle_steps steps
              f"max by ({TARGET}, group) ({M.LEARNING_RATE_OVER_PEAK.name}) >= {th.lr_over_peak:g}", 0),
        Alert("GradmonLearningRateZero", "warning", "Learning rate stuck at 0",
              f"Learning rate of parameter group {{{{ $labels.group }}}} is 0 ({WHERE}) for {dur(t.lr_zero_for)} "
              f"after having been above 0 in the last {dur(t.history_window)}: the run is not learning. "
              "Value: {{ $value }}.",
              f"max by ({TARGET}, group) ({lr}) == 0\n"
              f"and on({TARGET}, group) max by ({TARGET}, group) (max_over_time({lr}[{dur(t.history_window)}])) > 0",
              t.lr_zero_for),
    ]


def signal_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    return [*loss_alerts(t), *spike_alerts(th, t), *baseline_alerts(th, t), *optimizer_alerts(th, t)]
