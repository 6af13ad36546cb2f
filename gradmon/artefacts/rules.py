"""The Prometheus rule file: the recording rules, every alert in the order the file lists
them, and which alerts inhibit which (one fault, one page)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .. import metrics as M
from ..thresholds import PRODUCTION, Thresholds, Timing, dur
from .alert import Alert, past_warmup
from .health import (activation_blowup, attention_growth, guard_alerts, loss_scale_collapse, nonfinite, norm_alerts,
                     rank_divergence)
from .liveness import liveness_alerts
from .names import (LOCAL_GLOBAL_NORM, REC_GLOBAL_BASELINE, REC_GLOBAL_POST_WARMUP, REC_LAYER_BASELINE,
                    REC_LAYER_POST_WARMUP, REC_LOCAL_MEDIAN, REC_LOCAL_MIN, REC_LOCAL_RANKS, REC_STEPS_RATE,
                    TARGET, sample)
from .signals import signal_alerts


def recording_rules(th: Thresholds, t: Timing) -> List[Dict[str, str]]:
    post = past_warmup(th)
    baseline = f"[{dur(t.baseline_window)}] offset {dur(t.baseline_offset)}"
    return [
        {"record": REC_GLOBAL_POST_WARMUP, "expr": f"{M.GRAD_GLOBAL_NORM.name} and {post}"},
        {"record": REC_GLOBAL_BASELINE, "expr": f"quantile_over_time(0.5, {REC_GLOBAL_POST_WARMUP}{baseline})"},
        {"record": REC_LAYER_POST_WARMUP, "expr": f"{M.GRAD_NORM.name} and on({TARGET}) {post}"},
        {"record": REC_LAYER_BASELINE, "expr": f"quantile_over_time(0.5, {REC_LAYER_POST_WARMUP}{baseline})"},
        {"record": REC_LOCAL_MEDIAN, "expr": f"quantile by (job, model) (0.5, {LOCAL_GLOBAL_NORM})"},
        {"record": REC_LOCAL_MIN, "expr": f"min by (job, model) ({LOCAL_GLOBAL_NORM})"},
        {"record": REC_LOCAL_RANKS, "expr": f"count by (job, model) ({LOCAL_GLOBAL_NORM})"},
        {"record": REC_STEPS_RATE, "expr": f"rate({sample(M.STEPS)}[1m])"},
    ]


def alerts(th: Thresholds, t: Timing) -> List[Alert]:
    return [
        nonfinite(t),
        *norm_alerts(th, t),
        activation_blowup(th, t),
        attention_growth(th, t),
        *liveness_alerts(th, t),
        loss_scale_collapse(th, t),
        *guard_alerts(th, t),
        rank_divergence(th, t),
        *signal_alerts(th, t),
    ]


INHIBITIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    # one fault, one page: a NaN explains the explosion, vanishing and divergence that follow it
    ("GradmonNonFiniteGradients", ("GradmonGradientExplosion", "GradmonVanishingGradients",
                                   "GradmonRankDivergence", "GradmonActivationBlowup", "GradmonAttentionGrowth",
                                   "GradmonGradNormSpike", "GradmonGradNormAboveBaseline",
                                   "GradmonUpdateRatioAboveBaseline", "GradmonAdamRmsSpike", "GradmonGradNormJump",
                                   "GradmonLocalGradNormAboveBaseline")),
    # the critical tier of a spike says everything its warning does
    ("GradmonLossSpikeSevere", ("GradmonLossSpike",)),
    # a diverged loss is the page; its spikes are how it got there
    ("GradmonLossDiverging", ("GradmonLossSpike", "GradmonLossSpikeSevere")),
    ("GradmonGradNormSpikeSevere", ("GradmonGradNormSpike",)),
    ("GradmonGuardSkipping", ("GradmonGuardSkippedStep",)),
    ("GradmonGradNormJumpSevere", ("GradmonGradNormJump",)),
    # a dead exporter explains why no step is seen
    ("GradmonExporterDown", ("GradmonTrainingStalled",)),
    # a failed rank explains the others that torchrun then kills, or that hang in a collective
    ("GradmonRunFailed", ("GradmonExporterDown", "GradmonRanksMissing", "GradmonTrainingStalled")),
)


def rule_groups(th: Thresholds = Thresholds(), t: Timing = PRODUCTION, interval: Optional[str] = None,
                annotations: bool = True) -> Dict[str, Any]:
    """The rule file. ``annotations=False`` is for promtool unit tests, which compare
    annotations verbatim (templated values included) and are about when rules fire."""
    rec: Dict[str, Any] = {"name": "gradmon.recording", "rules": recording_rules(th, t)}
    al: Dict[str, Any] = {"name": "gradmon.alerts", "rules": [
        {"alert": a.name, "expr": a.expr, "for": a.for_duration,
         "labels": {"severity": a.severity},
         **({"annotations": {"summary": a.summary, "description": a.description, "runbook_url": a.runbook_url}}
            if annotations else {})}
        for a in alerts(th, t)]}
    if interval:
        rec["interval"] = al["interval"] = interval
    return {"groups": [rec, al]}
