"""The Grafana dashboards: Overview (the run's health and stability), Layers (each layer's
gradients, activations and baselines: one panel per family that a statistic declares a
``Panel`` for, in ``statistics``) and Ranks (one rank against the others). Every
threshold line is a number from ``thresholds``, the one the alerts use."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .. import metrics as M
from .. import statistics as S
from ..thresholds import Thresholds
from .names import LOCAL_GLOBAL_NORM, REC_LOCAL_MEDIAN, sample
from .panels import LSEL, PSEL, SEL, dashboard, panel, row

Panels = List[Dict[str, Any]]


def _overview_health(th: Thresholds) -> Panels:
    """Norms, non-finite values, step rate and firing alerts: is the run healthy now."""
    return [
        panel(1, "Global gradient norm (pre-clip)", "timeseries", (0, 0, 12, 8),
              [(f"{M.GRAD_GLOBAL_NORM.name}{{{SEL}}}", "{{job}} rank {{rank}}")], log=True,
              thresholds=[("green", None), ("red", th.explode_abs)],
              description="Per rank; the red line is the explosion threshold of GradmonGradientExplosion."),
        panel(2, "Non-finite elements / s", "timeseries", (12, 0, 12, 8),
              [(f"sum by (job, rank, tensor) (rate({sample(M.NONFINITE)}{{{SEL}}}[$__rate_interval]))",
                "{{job}} rank {{rank}} {{tensor}}")], thresholds=[("green", None), ("red", 0)]),
        panel(3, "Steps / s", "timeseries", (0, 8, 8, 6),
              [(f"sum by (job, rank) (rate({sample(M.STEPS)}{{{SEL}}}[$__rate_interval]))", "{{job}} rank {{rank}}")]),
        panel(4, "Time since last step", "stat", (8, 8, 8, 6),
              [(f"max by (job) (time() - {M.LAST_STEP_TIMESTAMP.name}{{{SEL}}})", "{{job}}")], unit="s",
              thresholds=[("green", None), ("orange", th.stall_seconds / 2), ("red", th.stall_seconds)]),
        panel(5, "Firing gradmon alerts", "table", (16, 8, 8, 6),
              [('sum by (alertname, job, rank, layer) (ALERTS{alertstate="firing", alertname=~"Gradmon.*", job=~"$job"})',
                "{{alertname}}")], instant=True, fmt="table",
              description="Empty when healthy (Prometheus' ALERTS series)."),
        panel(6, "Per-rank health", "table", (0, 14, 24, 8),
              [(f"max by (job, rank) ({M.GRAD_GLOBAL_NORM.name}{{{SEL}}})", "norm"),
               (f"sum by (job, rank) (increase({sample(M.NONFINITE)}{{{SEL}}}[1h]))", "nonfinite 1h"),
               (f"max by (job, rank) (time() - {M.LAST_STEP_TIMESTAMP.name}{{{SEL}}})", "since step"),
               (f"max by (job, rank) ({M.STEP.name}{{{SEL}}})", "step")], instant=True, fmt="table"),
        panel(7, "Global norm distribution (every step)", "heatmap", (0, 22, 24, 8),
              [(f"sum by (le) (increase({M.GRAD_GLOBAL_NORM_DISTRIBUTION.name}_bucket{{{SEL}}}[$__rate_interval]))", "{{le}}")],
              fmt="heatmap", description="From the cumulative histogram: catches a one-step spike between scrapes."),
    ]


def _overview_stability(th: Thresholds) -> Panels:
    """The loss, its trend and the signals that move before it diverges."""
    return [
        row(8, "Stability", 30),
        panel(9, "Loss, its trend and the trend's best", "timeseries", (0, 31, 12, 8),
              [(f"{M.LOSS.name}{{{SEL}}}", "loss {{job}} rank {{rank}}"),
               (f"{M.LOSS_TREND.name}{{{SEL}}}", "trend {{job}} rank {{rank}}"),
               (f"{M.LOSS_TREND_BEST.name}{{{SEL}}}", "trend's best {{job}} rank {{rank}}"),
               (f"2 * {M.LOSS_TREND_BEST.name}{{{SEL}}}", "2x best {{job}} rank {{rank}}")], log=True,
              description="The trend (mean of 20 losses) at 2x its best, with evidence from before it climbed, "
                          "is a confirmed divergence (GradmonLossDiverging), decided in the process every step."),
        panel(10, "Spike scores", "timeseries", (12, 31, 12, 8),
              [(f"{M.SPIKE_SCORE.name}{{{SEL}}}", "{{signal}} {{job}} rank {{rank}}")],
              description="Robust score of the last scored step, in robust standard deviations above the window's "
                          "trend; a spike also needs the value above twice the window's median."),
        panel(11, "Spike steps", "timeseries", (0, 39, 8, 8),
              [(f"sum by (job, rank, signal) (increase({sample(M.SPIKE_STEPS)}{{{SEL}}}[$__rate_interval]))",
                "{{signal}} {{job}} rank {{rank}}")],
              thresholds=[("green", None), ("orange", 1)],
              description="Counted in the process: a one-step spike between two scrapes is here."),
        panel(12, "Learning rate", "timeseries", (8, 39, 8, 8),
              [(f"{M.LEARNING_RATE.name}{{{SEL}}}", "group {{group}} {{job}} rank {{rank}}"),
               (f"{M.LEARNING_RATE_OVER_PEAK.name}{{{SEL}}}", "over its peak, group {{group}} {{job}} rank {{rank}}")],
              log=True,
              description=f"The rate, and the rate over its settled peak (GradmonLearningRateAbovePeak at "
                          f"{th.lr_over_peak:g}x): a schedule that rises past its peak after settling."),
        panel(13, "Update-to-weight ratio (largest layer)", "timeseries", (16, 39, 8, 8),
              [(f"max by (job, rank) ({M.UPDATE_TO_WEIGHT_RATIO.name}{{{SEL}}})", "{{job}} rank {{rank}}")], log=True,
              description="Around 1e-3 per step is usual for Adam; per layer on the Layers dashboard."),
        panel(14, "Loss rising and diverging (steps)", "timeseries", (0, 47, 24, 6),
              [(f"{M.LOSS_RISING_STEPS.name}{{{SEL}}}", "rising {{job}} rank {{rank}}"),
               (f"{M.LOSS_DIVERGING_STEPS.name}{{{SEL}}}", "diverging {{job}} rank {{rank}}")],
              description="Steps the loss trend has been rising (GradmonLossRising) and steps of a confirmed "
                          "divergence (GradmonLossDiverging); 0 when healthy."),
    ]


def overview(th: Thresholds) -> Dict[str, Any]:
    return dashboard("gradmon-overview", "gradmon / Overview", _overview_health(th) + _overview_stability(th),
                    with_layer=False)


def _layer_summary(th: Thresholds) -> Panels:
    """Across layers, now: which layers' gradients are largest and smallest, and where
    non-finite values were. Drawn above the per-layer series, with ids and places left
    for them by :func:`layers`."""
    return [
        panel(0, "Gradient norm across layers (now)", "bargauge", (0, 0, 12, 10),
              [(f"max by (layer) ({M.GRAD_NORM.name}{{{LSEL}}})", "{{layer}}")], instant=True),
        panel(0, "Top 5 largest layer gradients", "table", (12, 0, 6, 10),
              [(f"topk(5, max by (layer) ({M.GRAD_NORM.name}{{{LSEL}}}))", "{{layer}}")], instant=True, fmt="table"),
        panel(0, "Top 5 smallest layer gradients", "table", (18, 0, 6, 10),
              [(f"bottomk(5, min by (layer) ({M.GRAD_NORM.name}{{{LSEL}}}))", "{{layer}}")], instant=True, fmt="table",
              description=f"Vanishing below {th.vanish_abs:g} (or {th.vanish_rel:g}x baseline) pages."),
        panel(0, "Non-finite elements by layer (1h)", "table", (0, 10, 24, 8),
              [(f"sum by (layer, tensor, kind) (increase({sample(M.NONFINITE)}{{{LSEL}}}[1h]))", "{{layer}}")],
              instant=True, fmt="table"),
    ]


def _declared_panels() -> List[Tuple[S.Statistic, S.LayerGauge]]:
    """Each per-layer family with a declared panel, once, in declaration order."""
    drawn: Dict[str, Tuple[S.Statistic, S.LayerGauge]] = {}
    for st in S.STATISTICS:
        for gauge in st.gauges:
            if gauge.panel is not None and gauge.per_layer:
                drawn.setdefault(gauge.spec.name, (st, gauge))
    return list(drawn.values())


def _layer_series(th: Thresholds, top: int) -> Panels:
    """One time series per layer for each family a statistic declares a panel for
    (``statistics.Panel``), from ``top`` down: two to a row, a wide one a row of its own.
    The legend names each label the family adds, and the rank where the values are the
    reduced ones that rank 0 alone exports."""
    out: Panels = []
    x, y = 0, top
    for st, gauge in _declared_panels():
        p, spec = gauge.panel, gauge.spec
        w = 24 if p.wide else 12
        if x + w > 24:
            x, y = 0, y + HEIGHT
        legend = "{{layer}}" + "".join(f" {{{{{label}}}}}" for label in spec.labels if label != "layer")
        legend += " (rank {{rank}})" if st.reduced else ""
        out.append(panel(0, p.title, "timeseries", (x, y, w, HEIGHT), [(f"{spec.name}{{{LSEL}}}", legend)],
                         unit=p.unit, log=p.log, description=p.description,
                         thresholds=[("green", None), (p.line[0], p.line[1](th))] if p.line else ()))
        x += w
    return out


HEIGHT = 8  # of a per-layer time series panel


def layers(th: Thresholds) -> Dict[str, Any]:
    summary = _layer_summary(th)
    top = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in summary)
    panels = summary + _layer_series(th, top)
    for pid, p in enumerate(panels, 1):
        p["id"] = pid
    return dashboard("gradmon-layers", "gradmon / Layers", panels, with_layer=True)


def _rank_panels(th: Thresholds) -> Panels:
    return [
        panel(1, "Global gradient norm by rank", "timeseries", (0, 0, 12, 8),
              [(f"{M.GRAD_GLOBAL_NORM.name}{{{SEL}}}", "rank {{rank}}")], log=True),
        panel(2, "Local (pre-all-reduce) norm by rank", "timeseries", (12, 0, 12, 8),
              [(f"{LOCAL_GLOBAL_NORM}{{{SEL}}}", "rank {{rank}}")], log=True,
              description="Each rank's own gradient before DDP's all-reduce; a bad rank stands out here."),
        panel(3, "Spread across ranks (max / median of local norms)", "timeseries", (0, 8, 12, 8),
              [(f"max by (job, model) ({LOCAL_GLOBAL_NORM}{{{SEL}}}) / on(job, model) {REC_LOCAL_MEDIAN}{{job=~\"$job\", model=~\"$model\"}}",
                "{{job}}")], thresholds=[("green", None), ("red", th.divergence_factor)]),
        panel(4, "NaN/Inf by rank", "timeseries", (12, 8, 12, 8),
              [(f"sum by (rank, tensor) (rate({sample(M.RANK_NONFINITE)}{{{SEL}}}[$__rate_interval]))",
                "rank {{rank}} {{tensor}}")],
              description="Non-finite elements per second on each rank, by tensor (grad, grad_flow, activation, "
                          "local_grad): every rank exports these counters, per-layer series or not."),
        panel(5, "Resident memory by rank", "timeseries", (0, 16, 12, 8),
              [(f"{M.PROCESS_RESIDENT_MEMORY.name}{{{PSEL}}}", "rank {{rank}}")], unit="bytes"),
        panel(6, "CPU by rank", "timeseries", (12, 16, 12, 8),
              [(f"rate({sample(M.PROCESS_CPU_SECONDS)}{{{PSEL}}}[$__rate_interval])", "rank {{rank}}")], unit="percentunit"),
        panel(7, "gradmon overhead share of wall time", "timeseries", (0, 24, 24, 6),
              [(f"rate({sample(M.OVERHEAD_SECONDS)}{{{SEL}}}[$__rate_interval])", "rank {{rank}}")], unit="percentunit"),
        panel(8, "Worst layer's activation max |x| by rank", "timeseries", (0, 30, 12, 8),
              [(f"{M.ACTIVATION_ABS_MAX_WORST.name}{{{SEL}}}", "rank {{rank}} {{layer}}")], log=True,
              thresholds=[("green", None), ("red", th.activation_abs_max)],
              description="Each rank's largest layer-output max |x| at its last detail step, labelled with the "
                          "layer: a blow-up in one rank's data shows here, not on rank 0."),
        panel(9, "Worst layer's local norm over its baseline by rank", "timeseries", (12, 30, 12, 8),
              [(f"{M.LOCAL_GRAD_NORM_RATIO_WORST.name}{{{SEL}}}", "rank {{rank}} {{layer}}")], log=True,
              thresholds=[("green", None), ("red", th.norm_baseline_ratio)],
              description="Each rank's largest ratio of a layer's own (pre-all-reduce) gradient norm to that "
                          "layer's median on the rank, labelled with the layer."),
    ]


def ranks(th: Thresholds) -> Dict[str, Any]:
    return dashboard("gradmon-ranks", "gradmon / Ranks", _rank_panels(th), with_layer=False)


def dashboards(th: Thresholds = Thresholds()) -> Dict[str, Dict[str, Any]]:
    return {"overview": overview(th), "layers": layers(th), "ranks": ranks(th)}
