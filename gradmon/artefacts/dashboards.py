"""The Grafana dashboards: Overview (the run's health and stability), Layers (each layer's
gradients, activations and baselines) and Ranks (one rank against the others). Every
threshold line is a number from ``thresholds``, the one the alerts use."""

from __future__ import annotations

from typing import Any, Dict, List

from .. import metrics as M
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
              [(f"{M.LEARNING_RATE.name}{{{SEL}}}", "group {{group}} {{job}} rank {{rank}}")], log=True),
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


def _layer_gradients(th: Thresholds) -> Panels:
    """Each layer's gradient norm, gradient flow, activations and non-finite counts."""
    return [
        panel(1, "Gradient norm by layer", "timeseries", (0, 0, 24, 9),
              [(f"{M.GRAD_NORM.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True,
              thresholds=[("green", None), ("red", th.explode_abs)]),
        panel(2, "Gradient norm across layers (now)", "bargauge", (0, 9, 12, 10),
              [(f"max by (layer) ({M.GRAD_NORM.name}{{{LSEL}}})", "{{layer}}")], instant=True),
        panel(3, "Top 5 largest layer gradients", "table", (12, 9, 6, 10),
              [(f"topk(5, max by (layer) ({M.GRAD_NORM.name}{{{LSEL}}}))", "{{layer}}")], instant=True, fmt="table"),
        panel(4, "Top 5 smallest layer gradients", "table", (18, 9, 6, 10),
              [(f"bottomk(5, min by (layer) ({M.GRAD_NORM.name}{{{LSEL}}}))", "{{layer}}")], instant=True, fmt="table",
              description=f"Vanishing below {th.vanish_abs:g} (or {th.vanish_rel:g}x baseline) pages."),
        panel(5, "Gradient flow by depth (norm of d loss / d output)", "timeseries", (0, 19, 24, 8),
              [(f"{M.GRAD_FLOW_NORM.name}{{{LSEL}}}", "{{layer}}")], log=True),
        panel(6, "Activation RMS by layer", "timeseries", (0, 27, 12, 8),
              [(f"{M.ACTIVATION_RMS.name}{{{LSEL}}}", "{{layer}}")], log=True),
        panel(7, "Activation max |x| by layer", "timeseries", (12, 27, 12, 8),
              [(f"{M.ACTIVATION_ABS_MAX.name}{{{LSEL}}}", "{{layer}}")], log=True,
              thresholds=[("green", None), ("red", th.activation_abs_max)]),
        panel(8, "Non-finite elements by layer (1h)", "table", (0, 35, 24, 8),
              [(f"sum by (layer, tensor, kind) (increase({sample(M.NONFINITE)}{{{LSEL}}}[1h]))", "{{layer}}")],
              instant=True, fmt="table"),
    ]


def _layer_baselines(th: Thresholds) -> Panels:
    """Each layer against its own baseline, Adam's RMS and float16 range."""
    return [
        panel(9, "Gradient norm over its own baseline", "timeseries", (0, 43, 12, 8),
              [(f"{M.GRAD_NORM_BASELINE_RATIO.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True,
              thresholds=[("green", None), ("orange", th.norm_baseline_ratio)],
              description="Each layer's norm over the median of its own last norm_baseline sampled steps; "
                          "GradmonGradNormAboveBaseline warns above the line. The first layers move first."),
        panel(10, "Update-to-weight ratio by layer", "timeseries", (12, 43, 12, 8),
              [(f"{M.UPDATE_TO_WEIGHT_RATIO.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True),
        panel(11, "Update ratio over its own baseline", "timeseries", (0, 51, 12, 8),
              [(f"{M.UPDATE_RATIO_BASELINE_RATIO.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")], log=True,
              thresholds=[("green", None), ("orange", th.update_baseline_ratio)]),
        panel(12, "Adam RMS(g / sqrt(v)) by layer", "timeseries", (12, 51, 12, 8),
              [(f"{M.ADAM_RMS.name}{{{LSEL}}}", "{{layer}} (rank {{rank}})")],
              thresholds=[("green", None), ("orange", th.adam_rms_spike)],
              description="About 1 when healthy; far above, the second moment lags a gradient spike."),
        panel(13, "Activation max |x| over its own baseline", "timeseries", (0, 59, 12, 8),
              [(f"{M.ACTIVATION_ABS_MAX_RATIO.name}{{{LSEL}}}", "{{layer}}")], log=True),
        panel(14, "Activation kurtosis by layer", "timeseries", (12, 59, 12, 8),
              [(f"{M.ACTIVATION_KURTOSIS.name}{{{LSEL}}}", "{{layer}}")], log=True,
              description="A Gaussian is 3; outlier features push it far up long before max |x| overflows."),
        panel(15, "fp16 range used", "timeseries", (0, 67, 12, 8),
              [(f"{M.FP16_RANGE_USED.name}{{{LSEL}}}", "{{layer}} {{tensor}}")], unit="percentunit",
              thresholds=[("green", None), ("red", 1 / th.fp16_min_headroom)],
              description="max |x| / 65504 of float16 outputs and their gradients (float16 layers only)."),
        panel(16, "fp16 gradient underflow fraction", "timeseries", (12, 67, 12, 8),
              [(f"{M.GRAD_FP16_UNDERFLOW_FRACTION.name}{{{LSEL}}}", "{{layer}}")], unit="percentunit",
              description="Exact zeros, true zeros included: watch its rise, not its level."),
    ]


def layers(th: Thresholds) -> Dict[str, Any]:
    return dashboard("gradmon-layers", "gradmon / Layers", _layer_gradients(th) + _layer_baselines(th),
                    with_layer=True)


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
