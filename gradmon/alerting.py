"""One definition of every alert, recording rule and dashboard (build time).

The Prometheus rule file, the Kubernetes PrometheusRule, the Grafana-managed alert
rules and the dashboards' threshold lines are all generated from this module and the
numbers in ``thresholds``, so they cannot drift apart. ``python -m gradmon.alerting write``
regenerates the committed files; ``python -m gradmon.alerting check`` fails if they differ
from what this module generates (the tests run it). Nothing at runtime imports this module.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import metrics as M
from .thresholds import PRODUCTION, TEST_SCALE, Thresholds, Timing, dur  # noqa: F401  (public here too)

RUNBOOK = "https://github.com/gradmon/gradmon/blob/main/docs/runbook.md"
TARGET = "job, instance, model, rank"  # the labels that identify one monitored model on one rank


def _s(spec: M.MetricSpec) -> str:
    """A metric's sample name as PromQL reads it (a counter's ends in _total). Every name a
    rule or panel uses comes from the metric contract, so a rename cannot leave one behind."""
    return M.exposed_names(spec)[0]


# -- recording rules -------------------------------------------------------------------------------

REC_GLOBAL_POST_WARMUP = f"model_rank:{M.GRAD_GLOBAL_NORM.name}:post_warmup"
REC_GLOBAL_BASELINE = f"model_rank:{M.GRAD_GLOBAL_NORM.name}:median_baseline"
REC_LAYER_POST_WARMUP = f"model_rank_layer:{M.GRAD_NORM.name}:post_warmup"
REC_LAYER_BASELINE = f"model_rank_layer:{M.GRAD_NORM.name}:median_baseline"
REC_LOCAL_MEDIAN = f"job_model:{M.LOCAL_GRAD_GLOBAL_NORM.name}:median"
REC_LOCAL_MIN = f"job_model:{M.LOCAL_GRAD_GLOBAL_NORM.name}:min"
REC_LOCAL_RANKS = f"job_model:{M.LOCAL_GRAD_GLOBAL_NORM.name}:count"
REC_STEPS_RATE = f"model_rank:{M.STEPS.name}:rate1m"
LOCAL_GLOBAL_NORM = M.LOCAL_GRAD_GLOBAL_NORM.name  # issue 4's pre-all-reduce view


WHERE = "job {{ $labels.job }}, rank {{ $labels.rank }}, model {{ $labels.model }}"  # in every description
NEVER_SINGLE_RANK = "Never fires in a single-rank job."
NEVER_FP32 = "Never fires in an fp32 job (without float16 tensors or a GradScaler)."


def _past_warmup(th: Thresholds) -> str:
    """True for a target past the warm-up steps after attach (labels: TARGET)."""
    return f"({_s(M.STEPS)} > {th.warmup_steps})"


def recording_rules(th: Thresholds, t: Timing) -> List[Dict[str, str]]:
    post = _past_warmup(th)
    return [
        {"record": REC_GLOBAL_POST_WARMUP, "expr": f"{M.GRAD_GLOBAL_NORM.name} and {post}"},
        {"record": REC_GLOBAL_BASELINE,
         "expr": f"quantile_over_time(0.5, {REC_GLOBAL_POST_WARMUP}[{dur(t.baseline_window)}] offset {dur(t.baseline_offset)})"},
        {"record": REC_LAYER_POST_WARMUP,
         "expr": f"{M.GRAD_NORM.name} and on({TARGET}) {post}"},
        {"record": REC_LAYER_BASELINE,
         "expr": f"quantile_over_time(0.5, {REC_LAYER_POST_WARMUP}[{dur(t.baseline_window)}] offset {dur(t.baseline_offset)})"},
        {"record": REC_LOCAL_MEDIAN, "expr": f"quantile by (job, model) (0.5, {LOCAL_GLOBAL_NORM})"},
        {"record": REC_LOCAL_MIN, "expr": f"min by (job, model) ({LOCAL_GLOBAL_NORM})"},
        {"record": REC_LOCAL_RANKS, "expr": f"count by (job, model) ({LOCAL_GLOBAL_NORM})"},
        {"record": REC_STEPS_RATE, "expr": f"rate({_s(M.STEPS)}[1m])"},
    ]


# -- alerts ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    summary: str
    description: str
    expr: str
    for_seconds: float

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK}#{self.name.lower()}"


def _last_state(states: Sequence[str], by: str, t: Timing) -> str:
    """True (1) where the last run state a target reported, within the history window, is one
    of ``states``. last_over_time, not max_over_time: one scrape just before the process exits
    is enough, and a target that reports ``training`` again (an elastic restart) clears it at
    once, where a max over the window would fire again when the restarted run ends."""
    selector = f"{M.RUN_STATE.name}{{state=~\"{'|'.join(states)}\"}}"
    return f"max by ({by}) (last_over_time({selector}[{dur(t.history_window)}])) == 1"


def alerts(th: Thresholds, t: Timing) -> List[Alert]:
    ended = _last_state(M.END_STATES, TARGET, t)  # a target gone after any end is not "down"
    where = WHERE
    return [
        Alert("GradmonNonFiniteGradients", "critical", "NaN/Inf gradients",
              "{{ $value | humanize }} NaN/Inf elements in the {{ $labels.tensor }} of layer {{ $labels.layer }} "
              f"({where}) in the last {dur(t.nonfinite_window)}.",
              f"sum by ({TARGET}, layer, tensor) (increase({_s(M.NONFINITE)}{{tensor=~\"grad|grad_flow\"}}[{dur(t.nonfinite_window)}])) > 0\n"
              f"or\n"
              f"label_replace(sum by ({TARGET}, layer) (increase({_s(M.LOCAL_NONFINITE)}[{dur(t.nonfinite_window)}])), "
              f"\"tensor\", \"{M.TENSOR_LOCAL_GRAD}\", \"\", \"\") > 0\n"
              f"or\n"
              f"{_rank_nonfinite(t)}",
              0),
        Alert("GradmonGradientExplosion", "critical", "Gradient norm exploding",
              f"Pre-clip global gradient norm {{{{ $value | humanize }}}} ({where}): above {th.explode_abs:g}, "
              f"or {th.explode_jump:g}x its own median of the previous {dur(t.baseline_window)}.",
              f"max by ({TARGET}) (\n"
              f"  ({REC_GLOBAL_POST_WARMUP} > {th.explode_abs:g})\n"
              f"  or\n"
              f"  ({REC_GLOBAL_POST_WARMUP} > {th.explode_floor:g} and {REC_GLOBAL_POST_WARMUP} > {th.explode_jump:g} * {REC_GLOBAL_BASELINE})\n"
              f")",
              t.explode_for),
        Alert("GradmonVanishingGradients", "warning", "Gradients vanishing",
              f"Gradient norm of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}} ({where}): below "
              f"{th.vanish_abs:g} or below {th.vanish_rel:g}x its own median, for {dur(t.vanish_for)}.",
              f"max by ({TARGET}, layer) (\n"
              f"  ({REC_LAYER_POST_WARMUP} < {th.vanish_abs:g})\n"
              f"  or\n"
              f"  ({REC_LAYER_POST_WARMUP} < {th.vanish_rel:g} * {REC_LAYER_BASELINE})\n"
              f")",
              t.vanish_for),
        Alert("GradmonActivationBlowup", "warning", "Activations growing toward overflow",
              f"max|x| of layer {{{{ $labels.layer }}}}'s output is {{{{ $value | humanize }}}} ({where}), "
              f"above {th.activation_abs_max:g} (fp16 overflows at 65504).",
              f"max by ({TARGET}, layer) ({M.ACTIVATION_ABS_MAX.name} or {M.ACTIVATION_ABS_MAX_WORST.name}) "
              f"> {th.activation_abs_max:g}",
              t.activation_for),
        Alert("GradmonTrainingStalled", "warning", "Training stalled",
              f"No optimizer step for {{{{ $value | humanizeDuration }}}} ({where}) while the run state is "
              f"\"training\" and the exporter is up.",
              f"max by ({TARGET}) (time() - {M.LAST_STEP_TIMESTAMP.name})\n"
              f"  > {th.stall_seconds:g}\n"
              f"and on({TARGET}) max by ({TARGET}) ({M.RUN_STATE.name}{{state=\"training\"}}) == 1",
              t.stall_for),
        Alert("GradmonExporterDown", "critical", "A rank stopped reporting",
              f"Rank {{{{ $labels.rank }}}} of job {{{{ $labels.job }}}} (instance {{{{ $labels.instance }}}}) reported "
              f"in the last {dur(t.history_window)} and reports no more, without having finished: "
              "the process died, hung hard, or its pod is gone.",
              f"(\n  max by ({TARGET}) (max_over_time({_s(M.STEPS)}[{dur(t.history_window)}]))\n"
              f"  unless max by ({TARGET}) ({_s(M.STEPS)})\n)\nunless on({TARGET}) ({ended})",
              t.down_for),
        Alert("GradmonRanksMissing", "critical", "Fewer ranks report than the world size",
              "Only {{ $value }} ranks of job {{ $labels.job }} (model {{ $labels.model }}) report, fewer than "
              "its world size: some ranks never came up or their targets are missing. "
              f"{NEVER_SINGLE_RANK}",
              f"(\n  count by (job, model) ({_s(M.STEPS)})\n"
              f"  < max by (job, model) (max_over_time({M.WORLD_SIZE.name}[{dur(t.history_window)}]))\n)\n"
              f"unless on(job, model) ({_last_state(M.END_STATES, 'job, model', t)})",
              t.down_for),
        Alert("GradmonRunFailed", "critical", "A training run failed",
              f"The run ended with an exception ({{{{ $labels.exception }}}}) on {where}. Its last traceback is in "
              "the job's log; other ranks' missing, down or stalled alerts of this job are inhibited.",
              f"({_last_state((M.STATE_FAILED,), TARGET, t)})\n"
              f"* on({TARGET}) group_left(exception)\n"
              f"max by ({TARGET}, exception) (last_over_time({M.RUN_FAILURE_INFO.name}[{dur(t.history_window)}]))",
              0),
        Alert("GradmonLossScaleCollapse", "warning", "AMP loss scale collapsing",
              f"The GradScaler skipped most steps or its loss scale fell below {th.amp_min_loss_scale:g} ({where}): "
              "persistent overflow, the run is not learning. Value: {{ $value | humanize }}. "
              f"{NEVER_FP32}",
              f"(\n  sum by ({TARGET}) (increase({_s(M.AMP_SKIPPED_STEPS)}[{dur(t.amp_window)}]))\n"
              f"  > {th.amp_skip_fraction:g} * (\n"
              f"    sum by ({TARGET}) (increase({_s(M.AMP_SKIPPED_STEPS)}[{dur(t.amp_window)}]))\n"
              f"    + sum by ({TARGET}) (increase({_s(M.STEPS)}[{dur(t.amp_window)}]))\n  )\n)\n"
              f"or\nmin by ({TARGET}) ({M.AMP_LOSS_SCALE.name}) < {th.amp_min_loss_scale:g}",
              t.amp_for),
        Alert("GradmonRankDivergence", "warning", "One rank's local gradient diverges",
              f"Rank {{{{ $labels.rank }}}}'s local (pre-all-reduce) gradient norm is {{{{ $value | humanize }}}}, "
              f"over {th.divergence_factor:g}x the other ranks' ({where}): a bad data shard or a faulty device. "
              f"{NEVER_SINGLE_RANK}",
              f"max by ({TARGET}) (\n"
              f"  ({LOCAL_GLOBAL_NORM} > on(job, model) group_left() ({th.divergence_factor:g} * {REC_LOCAL_MEDIAN}))\n"
              f"  or\n"
              f"  ({LOCAL_GLOBAL_NORM} > on(job, model) group_left() ({th.divergence_factor:g} * {REC_LOCAL_MIN})\n"
              f"   and on(job, model) ({REC_LOCAL_RANKS} == 2))\n"
              f")",
              t.divergence_for),
        *_signal_alerts(th, t),
    ]


def _recent_spike(th: Thresholds, t: Timing, signals: Sequence[str], by: str) -> str:
    """A spike of ``signals`` within the last ``spike_hold_steps`` steps, or since the previous
    scrape: decided in the process and counted in steps, so a hold means the same at any step
    rate, and a job that runs more than ``spike_hold_steps`` steps between two scrapes still
    warns once for a spike no scrape saw (the steps between the last two scrapes, ``idelta``)."""
    since = f"{M.STEPS_SINCE_SPIKE.name}{{signal=~\"{'|'.join(signals)}\"}}"
    return (f"min by ({by}) (\n  {since} < {th.spike_hold_steps}\n  or\n"
            f"  {since} < on({TARGET}) group_left() idelta({_s(M.STEPS)}[{dur(t.event_window)}])\n)\n"
            f"and on({TARGET}) {_past_warmup(th)}")


def _diverging(t: Timing) -> str:
    """The confirmed divergence, decided in the process at every step (``divergence.py``):
    its state, or one entered and left since the previous scrape (the counter moved between
    the last two scrapes)."""
    return (f"max by ({TARGET}) ({M.LOSS_DIVERGING_STEPS.name}) > 0\n"
            f"or\nmax by ({TARGET}) (idelta({_s(M.LOSS_DIVERGENCES)}[{dur(t.event_window)}])) > 0")


_SPIKE_MEANING = "a value above twice its window's median and far outside its noise"


def _spike_alerts(th: Thresholds, t: Timing, name: str, what: str, signals: Sequence[str],
                  meaning: str = _SPIKE_MEANING) -> List[Alert]:
    """A warning while a spike of ``signals`` is recent (counted in steps, in the process:
    a spike no scrape saw still warns), and a critical alert while a confirmed divergence
    has such a spike among its evidence: a spike before the loss climbed."""
    where = WHERE
    evidence = f"{{signal=~\"{'|'.join(signals)}\"}}"
    return [
        Alert(f"Gradmon{name}", "warning", f"{what} spike",
              f"A {{{{ $labels.signal }}}} spike ({where}) in the last {th.spike_hold_steps} steps: {meaning}. "
              "Gradient or loss evidence alone: a warning until the loss confirms a divergence.",
              _recent_spike(th, t, signals, f"{TARGET}, signal"), 0),
        Alert(f"Gradmon{name}Severe", "critical", f"The loss diverges after a {what.lower()} spike",
              f"The loss is diverging ({where}), and a {{{{ $labels.signal }}}} spike came before it climbed: "
              "the instability started before the loss showed it (see GradmonLossDiverging).",
              f"max by ({TARGET}, signal) ({M.DIVERGENCE_EVIDENCE.name}{evidence}) == 1", 0),
    ]


def _signal_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    """What moves before a loss diverges: spikes, per-layer norms and updates far above
    their own baselines (counted in steps, in the process), Adam's RMS, fp16 headroom and
    the learning rate."""
    where = WHERE
    post = f"on({TARGET}) {_past_warmup(th)}"
    lr = M.LEARNING_RATE.name
    return [
        Alert("GradmonLossDiverging", "critical", "The loss is diverging, confirmed",
              f"The loss trend (mean of the last 20 losses) is at least 2x its best and loss_floor above it "
              f"({where}), with evidence from before it climbed: a loss or gradient spike, a climb over many "
              "steps, 100 steps diverged, or a non-finite loss (gradmon_loss_divergence_evidence says which). "
              "Decided in the process at every step. Value: {{ $value }}.",
              _diverging(t), 0),
        Alert("GradmonLossRising", "warning", "The loss is rising above its best",
              f"The loss trend (mean of the last 20 losses) has been at least 1.5x its best for "
              f"{{{{ $value }}}} steps ({where}) and is not back below 1.3x: the run is losing what it "
              "learned. Not a page until the loss confirms a divergence.",
              f"max by ({TARGET}) ({M.LOSS_RISING_STEPS.name}) > 0", 0),
        *_spike_alerts(th, t, "LossSpike", "Loss", (M.SIGNAL_LOSS,)),
        *_spike_alerts(th, t, "GradNormSpike", "Gradient norm", (M.SIGNAL_GRAD_NORM, M.SIGNAL_LOCAL_GRAD_NORM)),
        # a layer's norm far outside its own adaptive baseline: in unstable runs the
        # embeddings and first blocks jump like this before the loss does
        *_spike_alerts(th, t, "GradNormJump", "Layer gradient-norm", (M.SIGNAL_LAYER_GRAD_NORM,),
                       "a layer's gradient norm far outside its own recent spread and at least norm_jump_ratio "
                       f"times its baseline; {M.GRAD_NORM_BASELINE_RATIO.name} shows which layer"),
        Alert("GradmonGradNormAboveBaseline", "warning", "A layer's gradient norm far above its own baseline",
              f"Gradient norm of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}}x the median of its own "
              f"recent sampled steps ({where}), above {th.norm_baseline_ratio:g}x for {dur(t.norm_ratio_for)}: "
              "in unstable runs the embeddings and first blocks move first, steps before the loss spikes.",
              f"max by ({TARGET}, layer) ({M.GRAD_NORM_BASELINE_RATIO.name}) > {th.norm_baseline_ratio:g}\nand {post}",
              t.norm_ratio_for),
        Alert("GradmonLocalGradNormAboveBaseline", "warning",
              "One rank's own gradient of a layer far above that layer's baseline",
              f"Rank {{{{ $labels.rank }}}}'s own gradient norm of layer {{{{ $labels.layer }}}} (before the all-reduce) "
              f"is {{{{ $value | humanize }}}}x that layer's median on this rank ({where}), above "
              f"{th.norm_baseline_ratio:g}x for {dur(t.norm_ratio_for)}: a blow-up in this rank's data that the "
              f"average over ranks hides. {NEVER_SINGLE_RANK}",
              f"max by ({TARGET}, layer) ({M.LOCAL_GRAD_NORM_RATIO_WORST.name}) > {th.norm_baseline_ratio:g}\nand {post}",
              t.norm_ratio_for),
        Alert("GradmonUpdateRatioAboveBaseline", "warning", "A layer's updates far above their own baseline",
              f"Update-to-weight ratio of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}}x the median of "
              f"its own recent readings ({where}), above {th.update_baseline_ratio:g}x for {dur(t.update_ratio_for)}.",
              f"max by ({TARGET}, layer) ({M.UPDATE_RATIO_BASELINE_RATIO.name}) > {th.update_baseline_ratio:g}\n"
              f"and {post}",
              t.update_ratio_for),
        Alert("GradmonAdamRmsSpike", "warning", "Adam's second moment lags a gradient spike",
              f"Adam's RMS(g/sqrt(v)) of layer {{{{ $labels.layer }}}} is {{{{ $value | humanize }}}} at its last "
              f"reading ({where}), above {th.adam_rms_spike:g} (about 1 when healthy).",
              # the gauge holds each reading until the next, optimizer_every steps later: a
              # reading between two scrapes is seen, and it warns for steps, not minutes
              f"max by ({TARGET}, layer) ({M.ADAM_RMS.name}) > {th.adam_rms_spike:g}\nand {post}",
              0),
        Alert("GradmonFp16HeadroomLow", "warning", "A float16 tensor is near overflow",
              f"max |x| of the float16 {{{{ $labels.tensor }}}} of layer {{{{ $labels.layer }}}} is "
              f"{{{{ $value | humanizePercentage }}}} of 65504 ({where}): less than {th.fp16_min_headroom:g}x headroom. "
              f"{NEVER_FP32}",
              f"max by ({TARGET}, layer, tensor) ({M.FP16_RANGE_USED.name}{{tensor=\"{M.TENSOR_ACTIVATION}\"}}) "
              f"> {1 / th.fp16_min_headroom:g}\n"
              f"or\n"
              f"(\n  max by ({TARGET}, layer, tensor) ({M.FP16_RANGE_USED.name}{{tensor=\"{M.TENSOR_GRAD}\"}}) "
              f"> {1 / th.fp16_min_headroom:g}\n"
              f"  unless on({TARGET}) {M.AMP_LOSS_SCALE.name}\n)",
              t.fp16_for),
        Alert("GradmonLearningRateNonFinite", "critical", "Learning rate is NaN or infinite",
              f"Learning rate of parameter group {{{{ $labels.group }}}} is {{{{ $value }}}} ({where}): "
              "every update from now on poisons the weights.",
              f"max by ({TARGET}, group) ({lr} != {lr} or abs({lr}) == Inf)", 0),
        Alert("GradmonLearningRateZero", "warning", "Learning rate stuck at 0",
              f"Learning rate of parameter group {{{{ $labels.group }}}} is 0 ({where}) for {dur(t.lr_zero_for)} "
              f"after having been above 0 in the last {dur(t.history_window)}: the run is not learning. "
              "Value: {{ $value }}.",
              f"max by ({TARGET}, group) ({lr}) == 0\n"
              f"and on({TARGET}, group) max by ({TARGET}, group) (max_over_time({lr}[{dur(t.history_window)}])) > 0",
              t.lr_zero_for),
    ]


INHIBITIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    # one fault, one page: a NaN explains the explosion, vanishing and divergence that follow it
    ("GradmonNonFiniteGradients", ("GradmonGradientExplosion", "GradmonVanishingGradients",
                                   "GradmonRankDivergence", "GradmonActivationBlowup",
                                   "GradmonGradNormSpike", "GradmonGradNormAboveBaseline",
                                   "GradmonUpdateRatioAboveBaseline", "GradmonAdamRmsSpike", "GradmonGradNormJump",
                                   "GradmonLocalGradNormAboveBaseline")),
    # the critical tier of a spike says everything its warning does
    ("GradmonLossSpikeSevere", ("GradmonLossSpike",)),
    # a diverged loss is the page; its spikes are how it got there
    ("GradmonLossDiverging", ("GradmonLossSpike", "GradmonLossSpikeSevere")),
    ("GradmonGradNormSpikeSevere", ("GradmonGradNormSpike",)),
    ("GradmonGradNormJumpSevere", ("GradmonGradNormJump",)),
    # a dead exporter explains why no step is seen
    ("GradmonExporterDown", ("GradmonTrainingStalled",)),
    # a failed rank explains the others that torchrun then kills, or that hang in a collective
    ("GradmonRunFailed", ("GradmonExporterDown", "GradmonRanksMissing", "GradmonTrainingStalled")),
)


def _rank_nonfinite(t: Timing) -> str:
    """The ranks that export no per-layer counters (the replicas other than data-parallel
    rank 0): their always-present rank-level counters say that a rank's own gradient went
    non-finite, and the incident's origin gauge (a gauge: it may first appear mid-run)
    adds the layer it started in; without an origin yet, the alert fires without a layer."""
    counts = (f"(sum by ({TARGET}, tensor) (increase({_s(M.RANK_NONFINITE)}"
              f"{{tensor=~\"{M.TENSOR_GRAD_FLOW}|{M.TENSOR_LOCAL_GRAD}\"}}[{dur(t.nonfinite_window)}])) > 0\n"
              f"  unless on({TARGET}) ({_s(M.NONFINITE)} or {_s(M.LOCAL_NONFINITE)}))")
    origin = f"max by ({TARGET}, layer) ({M.NONFINITE_ORIGIN.name}{{tensor=\"{M.TENSOR_GRAD}\"}})"
    return (f"{counts}\n  * on({TARGET}) group_left(layer) ({origin} * 0 + 1)\n"
            f"or on({TARGET}, tensor)\n{counts}")


def rule_groups(th: Thresholds = Thresholds(), t: Timing = PRODUCTION, interval: Optional[str] = None,
                annotations: bool = True) -> Dict[str, Any]:
    """The rule file. ``annotations=False`` is for promtool unit tests, which compare
    annotations verbatim (templated values included) and are about when rules fire."""
    rec: Dict[str, Any] = {"name": "gradmon.recording", "rules": recording_rules(th, t)}
    al: Dict[str, Any] = {"name": "gradmon.alerts", "rules": [
        {"alert": a.name, "expr": a.expr, "for": dur(a.for_seconds) if a.for_seconds else "0s",
         "labels": {"severity": a.severity},
         **({"annotations": {"summary": a.summary, "description": a.description, "runbook_url": a.runbook_url}}
            if annotations else {})}
        for a in alerts(th, t)]}
    if interval:
        rec["interval"] = al["interval"] = interval
    return {"groups": [rec, al]}


# -- Grafana-managed alerts -------------------------------------------------------------------------

def grafana_template(text: str) -> str:
    """A Prometheus annotation as Grafana-managed alerting reads it: there ``$value`` is a
    text describing every query, and the alert query's number is ``$values.A.Value``."""
    return re.sub(r"\$value\b(?!s)", "$values.A.Value", text)


def grafana_alerting(th: Thresholds = Thresholds(), t: Timing = PRODUCTION) -> Dict[str, Any]:
    """The same alerts for teams that alert from Grafana: each rule queries the same PromQL.

    Recording rules are inlined (Grafana evaluates plain PromQL against the datasource,
    which may not have gradmon's recording rules loaded); one read over a range becomes a
    subquery, since ``(expr)[30m]`` is no valid PromQL."""
    inline = {r["record"]: f"({r['expr']})" for r in recording_rules(th, t)}
    rules = []
    for a in alerts(th, t):
        expr = a.expr
        for name in sorted(inline, key=len, reverse=True):
            expr = re.sub(re.escape(name) + r"\[([^\]:]+)\]", lambda m: f"{inline[name]}[{m.group(1)}:]", expr)
            expr = expr.replace(name, inline[name])
        rules.append({
            "uid": "gradmon-" + a.name[len("Gradmon"):].lower(),
            "title": a.name,
            "condition": "B",
            "data": [
                {"refId": "A", "datasourceUid": "${DS_PROMETHEUS}",
                 "relativeTimeRange": {"from": int(t.history_window), "to": 0},
                 "model": {"refId": "A", "expr": expr, "instant": True}},
                {"refId": "B", "datasourceUid": "__expr__",
                 "model": {"refId": "B", "type": "threshold", "expression": "A",
                           "conditions": [{"evaluator": {"type": "gt", "params": [0]}}]}},
            ],
            "for": dur(a.for_seconds) if a.for_seconds else "0s",
            "noDataState": "OK",
            "execErrState": "Error",
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": grafana_template(a.description),
                            "runbook_url": a.runbook_url},
        })
    return {"apiVersion": 1, "groups": [
        {"orgId": 1, "name": "gradmon", "folder": "gradmon", "interval": "1m", "rules": rules}]}


# -- Alertmanager ---------------------------------------------------------------------------------

def alertmanager_config(webhook_url: str = "http://alert-receiver.example:5001/gradmon",
                        group_wait: str = "30s", group_interval: str = "5m",
                        repeat_interval: str = "4h") -> Dict[str, Any]:
    return {
        "route": {
            "receiver": "oncall",
            "group_by": ["job", "alertname"],
            "group_wait": group_wait, "group_interval": group_interval, "repeat_interval": repeat_interval,
        },
        "receivers": [{"name": "oncall", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
        "inhibit_rules": [
            {"source_matchers": [f"alertname = {src}"],
             "target_matchers": [f"alertname =~ \"{'|'.join(targets)}\""],
             "equal": ["job"]}
            for src, targets in INHIBITIONS],
    }


# -- dashboards -----------------------------------------------------------------------------------

SEL = 'job=~"$job", model=~"$model", rank=~"$rank"'
PSEL = 'job=~"$job", rank=~"$rank"'  # process metrics describe the process, not one model: no model label
LSEL = SEL + ', layer=~"$layer"'


def _target(expr: str, legend: str, ref: str, instant: bool = False, fmt: Optional[str] = None) -> Dict[str, Any]:
    t: Dict[str, Any] = {"refId": ref, "datasource": {"type": "prometheus", "uid": "${datasource}"},
                         "expr": expr, "legendFormat": legend}
    if instant:
        t["instant"] = True
        t["range"] = False
    if fmt:
        t["format"] = fmt
    return t


def _panel(pid: int, title: str, kind: str, grid: Tuple[int, int, int, int], targets: Sequence[Tuple[str, str]],
           unit: str = "short", thresholds: Sequence[Tuple[str, Optional[float]]] = (), log: bool = False,
           instant: bool = False, description: str = "", fmt: Optional[str] = None) -> Dict[str, Any]:
    x, y, w, h = grid
    steps = [{"color": color, "value": value} for color, value in (thresholds or [("green", None)])]
    defaults: Dict[str, Any] = {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}
    if kind == "timeseries":
        defaults["custom"] = {"scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
                              "thresholdsStyle": {"mode": "line" if thresholds else "off"}}
    return {
        "id": pid, "type": kind, "title": title, "description": description,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {},
        "targets": [_target(e, legend, chr(ord("A") + i), instant, fmt) for i, (e, legend) in enumerate(targets)],
    }


def _row(pid: int, title: str, y: int) -> Dict[str, Any]:
    """A row header; ``targets`` empty so that whatever walks every panel's queries walks it too."""
    return {"id": pid, "type": "row", "title": title, "collapsed": False,
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": [], "targets": []}


def _var(name: str, query: str, label: str, multi: bool = True) -> Dict[str, Any]:
    return {"name": name, "label": label, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "multi": multi, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 3}


def _dashboard(uid: str, title: str, panels: List[Dict[str, Any]], with_layer: bool) -> Dict[str, Any]:
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        _var("job", f"label_values({M.INFO.name}, job)", "job"),
        _var("model", f'label_values({M.INFO.name}{{job=~"$job"}}, model)', "model"),
        _var("rank", f'label_values({M.INFO.name}{{job=~"$job", model=~"$model"}}, rank)', "rank"),
    ]
    if with_layer:
        variables.append(_var("layer", f'label_values({M.GRAD_NORM.name}{{job=~"$job", model=~"$model"}}, layer)', "layer"))
    return {
        "uid": uid, "title": title, "tags": ["gradmon"], "timezone": "browser", "schemaVersion": 39,
        "editable": True, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables},
        "links": [{"title": "gradmon dashboards", "type": "dashboards", "tags": ["gradmon"], "asDropdown": True}],
        "annotations": {"list": []},
        "panels": panels,
    }


def dashboards(th: Thresholds = Thresholds()) -> Dict[str, Dict[str, Any]]:
    red, orange = "red", "orange"
    overview = _dashboard("gradmon-overview", "gradmon / Overview", [
        _panel(1, "Global gradient norm (pre-clip)", "timeseries", (0, 0, 12, 8),
               [(f"{M.GRAD_GLOBAL_NORM.name}{{{SEL}}}", "{{job}} rank {{rank}}")], log=True,
               thresholds=[("green", None), (red, th.explode_abs)],
               description="Per rank; the red line is the explosion threshold of GradmonGradientExplosion."),
        _panel(2, "Non-finite elements / s", "timeseries", (12, 0, 12, 8),
               [(f"sum by (job, rank, tensor) (rate({_s(M.NONFINITE)}{{{SEL}}}[$__rate_interval]))",
                 "{{job}} rank {{rank}} {{tensor}}")], thresholds=[("green", None), (red, 0)]),
        _panel(3, "Steps / s", "timeseries", (0, 8, 8, 6),
               [(f"sum by (job, rank) (rate({_s(M.STEPS)}{{{SEL}}}[$__rate_interval]))", "{{job}} rank {{rank}}")]),
        _panel(4, "Time since last step", "stat", (8, 8, 8, 6),
               [(f"max by (job) (time() - {M.LAST_STEP_TIMESTAMP.name}{{{SEL}}})", "{{job}}")], unit="s",
               thresholds=[("green", None), (orange, th.stall_seconds / 2), (red, th.stall_seconds)]),
        _panel(5, "Firing gradmon alerts", "table", (16, 8, 8, 6),
               [('sum by (alertname, job, rank, layer) (ALERTS{alertstate="firing", alertname=~"Gradmon.*", job=~"$job"})',
                 "{{alertname}}")], instant=True, fmt="table",
               description="Empty when healthy (Prometheus' ALERTS series)."),
        _panel(6, "Per-rank health", "table", (0, 14, 24, 8),
               [(f"max by (job, rank) ({M.GRAD_GLOBAL_NORM.name}{{{SEL}}})", "norm"),
                (f"sum by (job, rank) (increase({_s(M.NONFINITE)}{{{SEL}}}[1h]))", "nonfinite 1h"),
                (f"max by (job, rank) (time() - {M.LAST_STEP_TIMESTAMP.name}{{{SEL}}})", "since step"),
                (f"max by (job, rank) ({M.STEP.name}{{{SEL}}})", "step")], instant=True, fmt="table"),
        _panel(7, "Global norm distribution (every step)", "heatmap", (0, 22, 24, 8),
               [(f"sum by (le) (increase({M.GRAD_GLOBAL_NORM_DISTRIBUTION.name}_bucket{{{SEL}}}[$__rate_interval]))", "{{le}}")],
               fmt="heatmap", description="From the cumulative histogram: catches a one-step spike between scrapes."),
        _row(8, "Stability", 30),
        _panel(9, "Loss, its trend and the trend's best", "timeseries", (0, 31, 12, 8),
               [(f"{M.LOSS.name}{{{SEL}}}", "loss {{job}} rank {{rank}}"),
                (f"{M.LOSS_TREND.name}{{{SEL}}}", "trend {{job}} rank {{rank}}"),
                (f"{M.LOSS_TREND_BEST.name}{{{SEL}}}", "trend's best {{job}} rank {{rank}}"),
                (f"2 * {M.LOSS_TREND_BEST.name}{{{SEL}}}", "2x best {{job}} rank {{rank}}")], log=True,
               description="The trend (mean of 20 losses) at 2x its best, with evidence from before it climbed, "
                           "is a confirmed divergence (GradmonLossDiverging), decided in the process every step."),
        _panel(10, "Spike scores", "timeseries", (12, 31, 12, 8),
               [(f"{M.SPIKE_SCORE.name}{{{SEL}}}", "{{signal}} {{job}} rank {{rank}}")],
               description="Robust score of the last scored step, in robust standard deviations above the window's "
                           "trend; a spike also needs the value above twice the window's median."),
        _panel(11, "Spike steps", "timeseries", (0, 39, 8, 8),
               [(f"sum by (job, rank, signal) (increase({_s(M.SPIKE_STEPS)}{{{SEL}}}[$__rate_interval]))",
                 "{{signal}} {{job}} rank {{rank}}")],
               thresholds=[("green", None), (orange, 1)],
               description="Counted in the process: a one-step spike between two scrapes is here."),
        _panel(12, "Learning rate", "timeseries", (8, 39, 8, 8),
               [(f"{M.LEARNING_RATE.name}{{{SEL}}}", "group {{group}} {{job}} rank {{rank}}")], log=True),
        _panel(13, "Update-to-weight ratio (largest layer)", "timeseries", (16, 39, 8, 8),
               [(f"max by (job, rank) ({M.UPDATE_TO_WEIGHT_RATIO.name}{{{SEL}}})", "{{job}} rank {{rank}}")], log=True,
               description="Around 1e-3 per step is usual for Adam; per layer on the Layers dashboard."),
        _panel(14, "Loss rising and diverging (steps)", "timeseries", (0, 47, 24, 6),
               [(f"{M.LOSS_RISING_STEPS.name}{{{SEL}}}", "rising {{job}} rank {{rank}}"),
                (f"{M.LOSS_DIVERGING_STEPS.name}{{{SEL}}}", "diverging {{job}} rank {{rank}}")],
               description="Steps the loss trend has been rising (GradmonLossRising) and steps of a confirmed "
                           "divergence (GradmonLossDiverging); 0 when healthy."),
    ], with_layer=False)
    layers = _dashboard("gradmon-layers", "gradmon / Layers", [
        _panel(1, "Gradient norm by layer", "timeseries", (0, 0, 24, 9),
               [(f"{M.GRAD_NORM.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True,
               thresholds=[("green", None), (red, th.explode_abs)]),
        _panel(2, "Gradient norm across layers (now)", "bargauge", (0, 9, 12, 10),
               [(f"max by (layer) ({M.GRAD_NORM.name}{{{LSEL}}})", "{{layer}}")], instant=True),
        _panel(3, "Top 5 largest layer gradients", "table", (12, 9, 6, 10),
               [(f"topk(5, max by (layer) ({M.GRAD_NORM.name}{{{LSEL}}}))", "{{layer}}")], instant=True, fmt="table"),
        _panel(4, "Top 5 smallest layer gradients", "table", (18, 9, 6, 10),
               [(f"bottomk(5, min by (layer) ({M.GRAD_NORM.name}{{{LSEL}}}))", "{{layer}}")], instant=True, fmt="table",
               description=f"Vanishing below {th.vanish_abs:g} (or {th.vanish_rel:g}x baseline) pages."),
        _panel(5, "Gradient flow by depth (norm of d loss / d output)", "timeseries", (0, 19, 24, 8),
               [(f"{M.GRAD_FLOW_NORM.name}{{{LSEL}}}", "{{layer}}")], log=True),
        _panel(6, "Activation RMS by layer", "timeseries", (0, 27, 12, 8),
               [(f"{M.ACTIVATION_RMS.name}{{{LSEL}}}", "{{layer}}")], log=True),
        _panel(7, "Activation max |x| by layer", "timeseries", (12, 27, 12, 8),
               [(f"{M.ACTIVATION_ABS_MAX.name}{{{LSEL}}}", "{{layer}}")], log=True,
               thresholds=[("green", None), (red, th.activation_abs_max)]),
        _panel(8, "Non-finite elements by layer (1h)", "table", (0, 35, 24, 8),
               [(f"sum by (layer, tensor, kind) (increase({_s(M.NONFINITE)}{{{LSEL}}}[1h]))", "{{layer}}")],
               instant=True, fmt="table"),
        _panel(9, "Gradient norm over its own baseline", "timeseries", (0, 43, 12, 8),
               [(f"{M.GRAD_NORM_BASELINE_RATIO.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True,
               thresholds=[("green", None), (orange, th.norm_baseline_ratio)],
               description="Each layer's norm over the median of its own last norm_baseline sampled steps; "
                           "GradmonGradNormAboveBaseline warns above the line. The first layers move first."),
        _panel(10, "Update-to-weight ratio by layer", "timeseries", (12, 43, 12, 8),
               [(f"{M.UPDATE_TO_WEIGHT_RATIO.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True),
        _panel(11, "Update ratio over its own baseline", "timeseries", (0, 51, 12, 8),
               [(f"{M.UPDATE_RATIO_BASELINE_RATIO.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True,
               thresholds=[("green", None), (orange, th.update_baseline_ratio)]),
        _panel(12, "Adam RMS(g / sqrt(v)) by layer", "timeseries", (12, 51, 12, 8),
               [(f"{M.ADAM_RMS.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")],
               thresholds=[("green", None), (orange, th.adam_rms_spike)],
               description="About 1 when healthy; far above, the second moment lags a gradient spike."),
        _panel(13, "Activation max |x| over its own baseline", "timeseries", (0, 59, 12, 8),
               [(f"{M.ACTIVATION_ABS_MAX_RATIO.name}{{{LSEL}}}", "{{layer}}")], log=True),
        _panel(14, "Activation kurtosis by layer", "timeseries", (12, 59, 12, 8),
               [(f"{M.ACTIVATION_KURTOSIS.name}{{{LSEL}}}", "{{layer}}")], log=True,
               description="A Gaussian is 3; outlier features push it far up long before max |x| overflows."),
        _panel(15, "fp16 range used", "timeseries", (0, 67, 12, 8),
               [(f"{M.FP16_RANGE_USED.name}{{{LSEL}}}", "{{layer}} {{tensor}}")], unit="percentunit",
               thresholds=[("green", None), (red, 1 / th.fp16_min_headroom)],
               description="max |x| / 65504 of float16 outputs and their gradients (float16 layers only)."),
        _panel(16, "fp16 gradient underflow fraction", "timeseries", (12, 67, 12, 8),
               [(f"{M.GRAD_FP16_UNDERFLOW_FRACTION.name}{{{LSEL}}}", "{{layer}}")], unit="percentunit",
               description="Exact zeros, true zeros included: watch its rise, not its level."),
    ], with_layer=True)
    ranks = _dashboard("gradmon-ranks", "gradmon / Ranks", [
        _panel(1, "Global gradient norm by rank", "timeseries", (0, 0, 12, 8),
               [(f"{M.GRAD_GLOBAL_NORM.name}{{{SEL}}}", "rank {{rank}}")], log=True),
        _panel(2, "Local (pre-all-reduce) norm by rank", "timeseries", (12, 0, 12, 8),
               [(f"{LOCAL_GLOBAL_NORM}{{{SEL}}}", "rank {{rank}}")], log=True,
               description="Each rank's own gradient before DDP's all-reduce; a bad rank stands out here."),
        _panel(3, "Spread across ranks (max / median of local norms)", "timeseries", (0, 8, 12, 8),
               [(f"max by (job, model) ({LOCAL_GLOBAL_NORM}{{{SEL}}}) / on(job, model) {REC_LOCAL_MEDIAN}{{job=~\"$job\", model=~\"$model\"}}",
                 "{{job}}")], thresholds=[("green", None), (red, th.divergence_factor)]),
        _panel(4, "NaN/Inf by rank", "timeseries", (12, 8, 12, 8),
               [(f"sum by (rank, tensor) (rate({_s(M.RANK_NONFINITE)}{{{SEL}}}[$__rate_interval]))",
                 "rank {{rank}} {{tensor}}")],
               description="Non-finite elements per second on each rank, by tensor (grad, grad_flow, activation, "
                           "local_grad): every rank exports these counters, per-layer series or not."),
        _panel(5, "Resident memory by rank", "timeseries", (0, 16, 12, 8),
               [(f"{M.PROCESS_RESIDENT_MEMORY.name}{{{PSEL}}}", "rank {{rank}}")], unit="bytes"),
        _panel(6, "CPU by rank", "timeseries", (12, 16, 12, 8),
               [(f"rate({_s(M.PROCESS_CPU_SECONDS)}{{{PSEL}}}[$__rate_interval])", "rank {{rank}}")], unit="percentunit"),
        _panel(7, "gradmon overhead share of wall time", "timeseries", (0, 24, 24, 6),
               [(f"rate({_s(M.OVERHEAD_SECONDS)}{{{SEL}}}[$__rate_interval])", "rank {{rank}}")], unit="percentunit"),
        _panel(8, "Worst layer's activation max |x| by rank", "timeseries", (0, 30, 12, 8),
               [(f"{M.ACTIVATION_ABS_MAX_WORST.name}{{{SEL}}}", "rank {{rank}} {{layer}}")], log=True,
               thresholds=[("green", None), (red, th.activation_abs_max)],
               description="Each rank's largest layer-output max |x| at its last detail step, labelled with the "
                           "layer: a blow-up in one rank's data shows here, not on rank 0."),
        _panel(9, "Worst layer's local norm over its baseline by rank", "timeseries", (12, 30, 12, 8),
               [(f"{M.LOCAL_GRAD_NORM_RATIO_WORST.name}{{{SEL}}}", "rank {{rank}} {{layer}}")], log=True,
               thresholds=[("green", None), (red, th.norm_baseline_ratio)],
               description="Each rank's largest ratio of a layer's own (pre-all-reduce) gradient norm to that "
                           "layer's median on the rank, labelled with the layer."),
    ], with_layer=False)
    return {"overview": overview, "layers": layers, "ranks": ranks}


# -- files ----------------------------------------------------------------------------------------

HEADER = "# Generated by `python -m gradmon.alerting write` from gradmon/alerting.py. Do not edit.\n"


def _yaml(obj: Any) -> str:
    import yaml  # a dev/test dependency: only generating the files needs it

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: Any, data: str) -> Any:  # multi-line PromQL as readable block scalars
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    return HEADER + yaml.dump(obj, Dumper=Dumper, sort_keys=False, width=120, allow_unicode=True)


def generated_files(root: Path) -> Dict[Path, str]:
    boards = dashboards()
    files = {
        root / "deploy/prometheus/rules/gradmon.rules.yml": _yaml(rule_groups()),
        root / "deploy/alertmanager/alertmanager.yml": _yaml(alertmanager_config()),
        root / "deploy/grafana/provisioning/alerting/gradmon.yml": _yaml(grafana_alerting()),
        root / "deploy/kubernetes/prometheusrule.yaml": _yaml({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "gradmon", "labels": {"release": "prometheus"}},
            "spec": rule_groups()}),
        root / "deploy/kubernetes/dashboards-configmap.yaml": _yaml({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "gradmon-dashboards", "labels": {"grafana_dashboard": "1"}},
            "data": {f"gradmon-{name}.json": json.dumps(board, indent=2) + "\n" for name, board in boards.items()}}),
    }
    for name, board in boards.items():
        files[root / f"dashboards/{name}.json"] = json.dumps(board, indent=2) + "\n"
    return files


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    root = Path(args[1]) if len(args) > 1 else Path(__file__).resolve().parents[1]
    mode = args[0] if args else "check"
    stale = []
    for path, text in generated_files(root).items():
        if mode == "write":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(root)))
    if stale:
        print("out of date (run `python -m gradmon.alerting write`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
