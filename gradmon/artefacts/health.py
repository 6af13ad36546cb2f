"""The alerts on the gradients and activations themselves: non-finite values, a global norm
exploding, a layer's norm vanishing, activations near fp16's overflow, the GradScaler giving
up and one rank's local gradient diverging from the others'."""

from __future__ import annotations

from typing import List

from .. import metrics as M
from ..thresholds import Thresholds, Timing, dur
from .alert import NEVER_FP32, NEVER_SINGLE_RANK, WHERE, Alert
from .spikes import recent_spike
from .names import (LOCAL_GLOBAL_NORM, REC_GLOBAL_BASELINE, REC_GLOBAL_POST_WARMUP, REC_LAYER_BASELINE,
                    REC_LAYER_POST_WARMUP, REC_LOCAL_MEDIAN, REC_LOCAL_MIN, REC_LOCAL_RANKS, TARGET, sample)


def rank_nonfinite(t: Timing) -> str:
    """The ranks that export no per-layer counters (the replicas other than data-parallel
    rank 0): their always-present rank-level counters say that a rank's own gradient went
    non-finite, and the incident's origin gauge (a gauge: it may first appear mid-run)
    adds the layer it started in; without an origin yet, the alert fires without a layer.
    Whether a target exports per-layer counters is read from their ``kind="nan"`` half
    alone: every layer's counters come in NaN/Inf pairs, and this check is read twice an
    evaluation over every layer's series, the largest share of the rule's cost."""
    half = f"{{kind=\"{M.NONFINITE_KINDS[0]}\"}}"
    per_layer = f"{sample(M.NONFINITE)}{half} or {sample(M.LOCAL_NONFINITE)}{half}"
    counts = (f"(sum by ({TARGET}, tensor) (increase({sample(M.RANK_NONFINITE)}"
              f"{{tensor=~\"{M.TENSOR_GRAD_FLOW}|{M.TENSOR_LOCAL_GRAD}\"}}[{dur(t.nonfinite_window)}])) > 0\n"
              f"  unless on({TARGET}) ({per_layer}))")
    origin = f"max by ({TARGET}, layer) ({M.NONFINITE_ORIGIN.name}{{tensor=\"{M.TENSOR_GRAD}\"}})"
    return (f"{counts}\n  * on({TARGET}) group_left(layer) ({origin} * 0 + 1)\n"
            f"or on({TARGET}, tensor)\n{counts}")


def nonfinite(t: Timing) -> Alert:
    window = dur(t.nonfinite_window)
    return Alert(
        "GradmonNonFiniteGradients", "critical", "NaN/Inf gradients",
        "{{ $value | humanize }} NaN/Inf elements in the {{ $labels.tensor }} of layer {{ $labels.layer }} "
        f"({WHERE}) in the last {window}.",
        f"sum by ({TARGET}, layer, tensor) (increase({sample(M.NONFINITE)}{{tensor=~\"grad|grad_flow\"}}[{window}])) > 0\n"
        f"or\n"
        f"label_replace(sum by ({TARGET}, layer) (increase({sample(M.LOCAL_NONFINITE)}[{window}])), "
        f"\"tensor\", \"{M.TENSOR_LOCAL_GRAD}\", \"\", \"\") > 0\n"
        f"or\n"
        f"{rank_nonfinite(t)}",
        0)


def norm_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    """The global norm far above an absolute bound or its own median; a layer's norm far below."""
    return [
        Alert("GradmonGradientExplosion", "critical", "Gradient norm exploding",
              f"Pre-clip global gradient norm {{{{ $value | humanize }}}} ({WHERE}): above {th.explode_abs:g}, "
              f"or {th.explode_jump:g}x its own median of the previous {dur(t.baseline_window)}.",
              f"max by ({TARGET}) (\n"
              f"  ({REC_GLOBAL_POST_WARMUP} > {th.explode_abs:g})\n"
              f"  or\n"
              f"  ({REC_GLOBAL_POST_WARMUP} > {th.explode_floor:g} and {REC_GLOBAL_POST_WARMUP} > {th.explode_jump:g} * {REC_GLOBAL_BASELINE})\n"
              f")",
              t.explode_for),
        Alert("GradmonVanishingGradients", "warning", "Gradients vanishing",
              f"Gradient norm of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}} ({WHERE}): below "
              f"{th.vanish_abs:g} or below {th.vanish_rel:g}x its own median, for {dur(t.vanish_for)}.",
              f"max by ({TARGET}, layer) (\n"
              f"  ({REC_LAYER_POST_WARMUP} < {th.vanish_abs:g})\n"
              f"  or\n"
              f"  ({REC_LAYER_POST_WARMUP} < {th.vanish_rel:g} * {REC_LAYER_BASELINE})\n"
              f")",
              t.vanish_for),
    ]


def activation_blowup(th: Thresholds, t: Timing) -> Alert:
    return Alert(
        "GradmonActivationBlowup", "warning", "Activations growing toward overflow",
        f"max|x| of layer {{{{ $labels.layer }}}}'s output is {{{{ $value | humanize }}}} ({WHERE}), "
        f"above {th.activation_abs_max:g} (fp16 overflows at 65504).",
        f"max by ({TARGET}, layer) ({M.ACTIVATION_ABS_MAX.name} or {M.ACTIVATION_ABS_MAX_WORST.name}) "
        f"> {th.activation_abs_max:g}",
        t.activation_for)


def attention_growth(th: Thresholds, t: Timing) -> Alert:
    return Alert(
        "GradmonAttentionGrowth", "warning", "Attention projections growing",
        f"max|x| of attention projection {{{{ $labels.layer }}}}'s output is {{{{ $value | humanize }}}}x its "
        f"first measurement ({WHERE}), and an attention layer reached {th.attention_growth:g}x or a doubling of it "
        f"in the last {th.spike_hold_steps} steps: the attention logits are growing, which precedes many "
        "transformer divergences (QK-layernorm or a lower learning rate are the usual fixes).",
        f"max by ({TARGET}, layer) ({M.ACTIVATION_GROWTH.name}{{role=\"{M.ROLE_ATTENTION}\"}} "
        f"or {M.ACTIVATION_GROWTH_WORST.name}) >= {th.attention_growth:g}\n"
        f"and on({TARGET}) {recent_spike(th, t, (M.SIGNAL_ATTENTION_GROWTH,), TARGET)}",
        0)


def loss_scale_collapse(th: Thresholds, t: Timing) -> Alert:
    skipped = f"sum by ({TARGET}) (increase({sample(M.AMP_SKIPPED_STEPS)}[{dur(t.amp_window)}]))"
    return Alert(
        "GradmonLossScaleCollapse", "warning", "AMP loss scale collapsing",
        f"The GradScaler skipped most steps or its loss scale fell below {th.amp_min_loss_scale:g} ({WHERE}): "
        "persistent overflow, the run is not learning. Value: {{ $value | humanize }}. "
        f"{NEVER_FP32}",
        f"(\n  {skipped}\n"
        f"  > {th.amp_skip_fraction:g} * (\n"
        f"    {skipped}\n"
        f"    + sum by ({TARGET}) (increase({sample(M.STEPS)}[{dur(t.amp_window)}]))\n  )\n)\n"
        f"or\nmin by ({TARGET}) ({M.AMP_LOSS_SCALE.name}) < {th.amp_min_loss_scale:g}",
        t.amp_for)


def guard_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    """The step guard (``guard=``) skipped steps: one is a warning, a run of them pages."""
    window = dur(t.guard_window)
    skipped = f"sum by ({TARGET}, reason) (increase({sample(M.GUARD_SKIPPED_STEPS)}[{window}]))"
    return [
        Alert("GradmonGuardSkippedStep", "warning", "Optimizer step skipped by the guard",
              f"The step guard skipped {{{{ $value | humanize }}}} optimizer step(s) for {{{{ $labels.reason }}}} "
              f"in the last {window} ({WHERE}): the update was not applied; the batch is in exclude.jsonl.",
              f"{skipped} > 0", 0),
        Alert("GradmonGuardSkipping", "critical", "The guard keeps skipping steps",
              f"The step guard skipped {{{{ $value | humanize }}}} optimizer steps for {{{{ $labels.reason }}}} in "
              f"the last {window} ({WHERE}): more than bad batches; past guard_max_skips in a row the run fails.",
              f"{skipped} >= {th.guard_skip_run:d}", 0),
    ]


def rank_divergence(th: Thresholds, t: Timing) -> Alert:
    return Alert(
        "GradmonRankDivergence", "warning", "One rank's local gradient diverges",
        f"Rank {{{{ $labels.rank }}}}'s local (pre-all-reduce) gradient norm is {{{{ $value | humanize }}}}, "
        f"over {th.divergence_factor:g}x the other ranks' ({WHERE}): a bad data shard or a faulty device. "
        f"{NEVER_SINGLE_RANK}",
        f"max by ({TARGET}) (\n"
        f"  ({LOCAL_GLOBAL_NORM} > on(job, model) group_left() ({th.divergence_factor:g} * {REC_LOCAL_MEDIAN}))\n"
        f"  or\n"
        f"  ({LOCAL_GLOBAL_NORM} > on(job, model) group_left() ({th.divergence_factor:g} * {REC_LOCAL_MIN})\n"
        f"   and on(job, model) ({REC_LOCAL_RANKS} == 2))\n"
        f")",
        t.divergence_for)
