"""Alert and recording rules: generated from one definition, valid, and unit-tested with promtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gradmon import alerting
from servers import binary

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/rules/gradmon.rules.yml"
T = 'job="train", instance="n1:9400", model="gpt"'


def series(name: str, values: str, **labels: str) -> dict:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{T}{extra}}}", "values": values}


def alert(name: str, at: str, *expected: dict) -> dict:
    return {"eval_time": at, "alertname": name,
            "exp_alerts": [{"exp_labels": {"severity": sev, **labels}} for sev, labels in expected]}


def target(**extra: str) -> dict:
    return {"job": "train", "instance": "n1:9400", "model": "gpt", **extra}


def steps(rank: str = "0") -> dict:  # 100 steps a minute: past warm-up after the first minute
    return series("gradmon_steps_total", "0+100x120", rank=rank)


def run_state(state: str, values: str, rank: str = "0") -> dict:
    return series("gradmon_run_state", values, rank=rank, state=state)


CASES = {
    "nonfinite_fires_naming_the_layer": (
        [series("gradmon_nonfinite_total", "0 0 0 3 3 3 3", rank="0", layer="blocks.3.fc", tensor="grad", kind="nan"),
         series("gradmon_nonfinite_total", "0x6", rank="0", layer="head", tensor="grad", kind="nan")],
        [alert("GradmonNonFiniteGradients", "4m", ("critical", target(rank="0", layer="blocks.3.fc", tensor="grad")))]),
    "nonfinite_names_the_rank_whose_own_gradient_went_nan": (
        [series("gradmon_local_nonfinite_total", "0 0 5 5 5", rank="3", layer="embed", kind="nan"),
         series("gradmon_local_nonfinite_total", "0x4", rank="0", layer="embed", kind="nan")],
        [alert("GradmonNonFiniteGradients", "3m", ("critical", target(rank="3", layer="embed", tensor="local_grad")))]),
    "nonfinite_on_a_rank_without_per_layer_series_names_the_layer_it_started_in": (
        # rank 5 exports only its rank-level counters; the origin gauge appears with the incident
        [series("gradmon_rank_nonfinite_total", "0 0 4 4 4", rank="5", tensor="local_grad", kind="nan"),
         series("gradmon_nonfinite_origin_step", "_ _ 120 120 120", rank="5", tensor="grad", layer="blocks.1.fc"),
         series("gradmon_rank_nonfinite_total", "0x4", rank="6", tensor="local_grad", kind="nan")],
        [alert("GradmonNonFiniteGradients", "3m",
               ("critical", target(rank="5", layer="blocks.1.fc", tensor="local_grad")))]),
    "nonfinite_on_a_rank_without_per_layer_series_fires_without_a_known_origin": (
        [series("gradmon_rank_nonfinite_total", "0 0 2 2 2", rank="5", tensor="grad_flow", kind="inf")],
        [alert("GradmonNonFiniteGradients", "3m", ("critical", target(rank="5", tensor="grad_flow")))]),
    "nonfinite_fires_once_per_layer_on_a_rank_with_per_layer_series": (
        # rank 0 counts the same NaN per layer and per rank: the per-layer alert alone fires
        [series("gradmon_local_nonfinite_total", "0 0 5 5 5", rank="0", layer="embed", kind="nan"),
         series("gradmon_rank_nonfinite_total", "0 0 5 5 5", rank="0", tensor="local_grad", kind="nan"),
         series("gradmon_nonfinite_origin_step", "_ _ 120 120 120", rank="0", tensor="grad", layer="embed")],
        [alert("GradmonNonFiniteGradients", "3m", ("critical", target(rank="0", layer="embed", tensor="local_grad")))]),
    "nonfinite_silent_when_counters_stay_at_zero": (
        [series("gradmon_nonfinite_total", "0x10", rank="0", layer="head", tensor="grad", kind="nan")],
        [alert("GradmonNonFiniteGradients", "8m")]),
    "explosion_above_the_absolute_threshold": (
        [steps(), series("gradmon_grad_global_norm", "1x40 5000x10", rank="0")],
        [alert("GradmonGradientExplosion", "43m", ("critical", target(rank="0")))]),
    "explosion_as_a_jump_over_the_own_baseline_below_the_threshold": (
        [steps(), series("gradmon_grad_global_norm", "0.5x50 60x10", rank="0")],
        [alert("GradmonGradientExplosion", "53m", ("critical", target(rank="0")))]),
    "no_explosion_for_a_model_whose_normal_norm_is_50_with_noise": (
        [steps(), series("gradmon_grad_global_norm", "50 70 40 65 45 80 35 60 55 75 " * 6, rank="0")],
        [alert("GradmonGradientExplosion", "55m")]),
    "no_explosion_for_a_warmup_spike": (
        [series("gradmon_steps_total", "0 40 80 120+100x60", rank="0"),
         series("gradmon_grad_global_norm", "5000 3000 500 1x60", rank="0")],
        [alert("GradmonGradientExplosion", "2m"), alert("GradmonGradientExplosion", "30m")]),
    "vanishing_layer_relative_to_its_baseline": (
        [steps(), series("gradmon_grad_norm", "0.1x50 0.000001x30", rank="0", layer="blocks.0.fc")],
        [alert("GradmonVanishingGradients", "63m", ("warning", target(rank="0", layer="blocks.0.fc")))]),
    "vanishing_layer_below_the_absolute_floor": (
        [steps(), series("gradmon_grad_norm", "1e-9x30", rank="0", layer="blocks.0.fc")],
        [alert("GradmonVanishingGradients", "20m", ("warning", target(rank="0", layer="blocks.0.fc")))]),
    "no_vanishing_for_a_small_but_steady_layer": (
        [steps(), series("gradmon_grad_norm", "0.001 0.0012 0.0009 0.0011 " * 20, rank="0", layer="blocks.0.fc")],
        [alert("GradmonVanishingGradients", "70m")]),
    "activation_blowup": (
        [series("gradmon_activation_abs_max", "100x5 40000x5", rank="0", layer="blocks.2.fc")],
        [alert("GradmonActivationBlowup", "9m", ("warning", target(rank="0", layer="blocks.2.fc")))]),
    "activation_blowup_on_a_rank_without_per_layer_series_names_its_worst_layer": (
        [series("gradmon_activation_abs_max_worst", "100x5 40000x5", rank="9", layer="blocks.5.attn")],
        [alert("GradmonActivationBlowup", "9m", ("warning", target(rank="9", layer="blocks.5.attn")))]),
    "no_activation_blowup_for_large_but_normal_activations": (
        [series("gradmon_activation_abs_max", "1000x10", rank="0", layer="blocks.2.fc")],
        [alert("GradmonActivationBlowup", "9m")]),
    "stall_while_training": (
        [series("gradmon_last_step_timestamp_seconds", "0x30", rank="0"), run_state("training", "1x30")],
        [alert("GradmonTrainingStalled", "20m", ("warning", target(rank="0")))]),
    "no_stall_while_stepping": (
        [series("gradmon_last_step_timestamp_seconds", "0+60x30", rank="0"), run_state("training", "1x30")],
        [alert("GradmonTrainingStalled", "20m")]),
    "no_stall_while_paused_on_purpose": (
        [series("gradmon_last_step_timestamp_seconds", "0x30", rank="0"), run_state("training", "0x30"),
         run_state("paused", "1x30")],
        [alert("GradmonTrainingStalled", "20m")]),
    "exporter_down_names_the_rank_that_vanished": (
        [series("gradmon_steps_total", "1+1x10 _x20", rank="1"), run_state("finished", "0x10 _x20", rank="1"),
         series("gradmon_steps_total", "1+1x30", rank="0")],
        [alert("GradmonExporterDown", "20m", ("critical", target(rank="1")))]),
    "no_exporter_down_after_a_normal_finish": (
        [series("gradmon_steps_total", "1+1x10 _x20", rank="0"), run_state("finished", "0x9 1 _x20", rank="0")],
        [alert("GradmonExporterDown", "20m"), alert("GradmonRanksMissing", "20m")]),
    "run_failed_fires_naming_the_exception_after_one_scrape_of_the_failed_state": (
        [series("gradmon_steps_total", "1+1x5 _x20", rank="0"), run_state("training", "1x4 0 _x20"),
         run_state("failed", "0x4 1 _x20"), series("gradmon_run_failure_info", "_x4 1 _x20", rank="0", exception="ValueError")],
        [alert("GradmonRunFailed", "12m", ("critical", target(rank="0", exception="ValueError"))),
         alert("GradmonExporterDown", "12m")]),
    "run_failed_silent_after_a_finish": (
        [series("gradmon_steps_total", "1+1x5 _x20", rank="0"), run_state("failed", "0x5 _x20"),
         run_state("finished", "0x4 1 _x20")],
        [alert("GradmonRunFailed", "12m")]),
    "run_failed_silent_after_ctrl_c_and_no_exporter_down_either": (
        [series("gradmon_steps_total", "1+1x5 _x20", rank="0"), run_state("failed", "0x5 _x20"),
         run_state("interrupted", "0x4 1 _x20")],
        [alert("GradmonRunFailed", "12m"), alert("GradmonExporterDown", "12m")]),
    "no_exporter_down_after_a_sigterm_published_terminated": (
        [series("gradmon_steps_total", "1+1x5 _x20", rank="0"), run_state("terminated", "0x4 1 _x20")],
        [alert("GradmonExporterDown", "12m"), alert("GradmonRanksMissing", "12m")]),
    "run_failed_clears_when_the_target_trains_again_and_stays_clear_when_that_run_finishes": (
        [run_state("failed", "0x4 1x3 0x20", rank="0"), run_state("training", "1x4 0x3 1x10 0x10", rank="0"),
         run_state("finished", "0x17 1x10", rank="0"),
         series("gradmon_run_failure_info", "_x4 1x3 _x20", rank="0", exception="ValueError")],
        [alert("GradmonRunFailed", "6m", ("critical", target(rank="0", exception="ValueError"))),
         alert("GradmonRunFailed", "10m"), alert("GradmonRunFailed", "20m")]),
    "ranks_missing_when_fewer_report_than_the_world_size": (
        [series("gradmon_world_size", "4x20", rank="0"), series("gradmon_world_size", "4x20", rank="1"),
         series("gradmon_steps_total", "1+1x20", rank="0"), series("gradmon_steps_total", "1+1x20", rank="1")],
        [alert("GradmonRanksMissing", "10m", ("critical", {"job": "train", "model": "gpt"}))]),
    "no_ranks_missing_when_all_report": (
        [series("gradmon_world_size", "2x20", rank="0"), series("gradmon_world_size", "2x20", rank="1"),
         series("gradmon_steps_total", "1+1x20", rank="0"), series("gradmon_steps_total", "1+1x20", rank="1")],
        [alert("GradmonRanksMissing", "10m")]),
    "loss_scale_collapse_when_most_steps_are_skipped": (
        [series("gradmon_amp_skipped_steps_total", "0+9x40", rank="0"), series("gradmon_steps_total", "0+1x40", rank="0"),
         series("gradmon_amp_loss_scale", "65536x40", rank="0")],
        [alert("GradmonLossScaleCollapse", "30m", ("warning", target(rank="0")))]),
    "no_loss_scale_alert_for_occasional_amp_skips": (
        [series("gradmon_amp_skipped_steps_total", "0+1x40", rank="0"), series("gradmon_steps_total", "0+100x40", rank="0"),
         series("gradmon_amp_loss_scale", "65536 32768 65536 32768x37", rank="0")],
        [alert("GradmonLossScaleCollapse", "30m")]),
    "a_guard_skip_warns": (
        [series("gradmon_guard_skipped_steps_total", "0 0 0 1x20", rank="0", reason="nonfinite")],
        [alert("GradmonGuardSkippedStep", "5m", ("warning", target(rank="0", reason="nonfinite"))),
         alert("GradmonGuardSkipping", "5m")]),
    "a_run_of_guard_skips_pages": (
        [series("gradmon_guard_skipped_steps_total", "0 0 1 2 3 4x20", rank="0", reason="spike")],
        [alert("GradmonGuardSkipping", "5m", ("critical", target(rank="0", reason="spike")))]),
    "no_guard_alert_without_a_skip": (
        [series("gradmon_guard_skipped_steps_total", "0x20", rank="0", reason="nonfinite")],
        [alert("GradmonGuardSkippedStep", "15m"), alert("GradmonGuardSkipping", "15m")]),
    "rank_divergence_with_two_ranks": (
        [series("gradmon_local_grad_global_norm", "1x20", rank="0"),
         series("gradmon_local_grad_global_norm", "50x20", rank="1")],
        [alert("GradmonRankDivergence", "15m", ("warning", target(rank="1")))]),
    "rank_divergence_against_the_median_of_four": (
        [series("gradmon_local_grad_global_norm", v, rank=str(r)) for r, v in enumerate(["1x20", "1.2x20", "0.9x20", "30x20"])],
        [alert("GradmonRankDivergence", "15m", ("warning", target(rank="3")))]),
    "no_rank_divergence_for_ordinary_spread": (
        [series("gradmon_local_grad_global_norm", v, rank=str(r)) for r, v in enumerate(["1x20", "1.5x20", "0.8x20"])],
        [alert("GradmonRankDivergence", "15m")]),
}


def spikes(values: str, signal: str = "loss", rank: str = "0") -> dict:
    return series("gradmon_spike_steps_total", values, rank=rank, signal=signal)


def loss(values: str, running_min: str) -> list:
    return [series("gradmon_loss", values, rank="0"), series("gradmon_loss_running_min", running_min, rank="0")]


def layer(name: str, values: str, layer_name: str = "embed", **labels: str) -> dict:
    return series(name, values, rank="0", layer=layer_name, **labels)


def since(values: str, signal: str = "loss", rank: str = "0") -> dict:
    return series("gradmon_steps_since_spike", values, rank=rank, signal=signal)


def burst(values: str, signal: str = "loss", rank: str = "0") -> dict:
    return series("gradmon_steps_since_spike_burst", values, rank=rank, signal=signal)


def evidence(values: str, signal: str) -> dict:
    return series("gradmon_loss_divergence_evidence", values, rank="0", signal=signal)


def lr(values: str, group: str = "0") -> dict:
    return series("gradmon_learning_rate", values, rank="0", group=group)


NOISE = "1 1.4 0.8 1.1 0.9 1.3 0.7 1.2 "  # a healthy ratio to its own median, scraped once a minute
# An LR warm-up over 2,000 steps at 100 steps a minute: 0 to 1e-3 in 20 minutes, then flat
LR_WARMUP = "0+0.00005x20 0.001x40"
# A cosine schedule reaching 0 and restarting (SGDR): 0 for two minutes, not ten
LR_RESTART = "0.001 0.0009 0.0007 0.0005 0.0003 0.0001 0 0 0.001 0.0009 0.0007 0.0005 0.0003 0.0001 0 0.001x15"

CASES.update({
    # -- spikes, decided in the process: a burst warns while recent (in steps), one no scrape saw still counts
    "a_loss_spike_burst_warns_while_it_is_recent_in_steps": (
        # 100 steps a minute, a scrape a minute: 0 steps since the burst, then 100, 200
        [steps(), since("_x10 0 100 200x20"), burst("_x10 0 100 200x20")],
        [alert("GradmonLossSpike", "10m", ("warning", target(rank="0", signal="loss"))),
         alert("GradmonLossSpike", "11m"), alert("GradmonLossSpikeSevere", "10m")]),
    "a_loss_spike_burst_between_two_scrapes_warns_once_though_past_its_hold": (
        # 100 steps a minute: the burst 80 steps before the scrape at 11m came after the one at 10m
        [steps(), burst("200x10 80 180 280x10")],
        [alert("GradmonLossSpike", "10m"),
         alert("GradmonLossSpike", "11m", ("warning", target(rank="0", signal="loss"))),
         alert("GradmonLossSpike", "12m")]),
    "a_spike_burst_warns_for_spike_hold_steps_then_clears": (
        # 10 steps a minute: 0, 10, 20 steps since the burst at 12m, 13m, 14m; the hold is 20 steps
        [series("gradmon_steps_total", "0+10x60", rank="0"), burst("_x12 0 10 20 30 40x10")],
        [alert("GradmonLossSpike", "12m", ("warning", target(rank="0", signal="loss"))),
         alert("GradmonLossSpike", "13m", ("warning", target(rank="0", signal="loss"))),
         alert("GradmonLossSpike", "14m"), alert("GradmonLossSpike", "16m")]),
    "no_spike_warning_in_the_warm_up": (
        # 10 steps a minute: past the 100-step warm-up at 10m
        [series("gradmon_steps_total", "0+10x60", rank="0"), burst("_x3 0+10x60")],
        [alert("GradmonLossSpike", "4m"), alert("GradmonLossSpike", "8m"), alert("GradmonLossSpike", "12m")]),
    "a_lone_spike_without_a_burst_is_no_warning": (
        # a spike at 10m and one at 11m (100 steps a minute): counted, never three in 20 steps
        [steps(), since("_x10 0 0 100 200x20"), since("_x10 0 0 100 200x20", "grad_norm"),
         since("_x10 0 0 100 200x20", "layer_grad_norm")],
        [alert("GradmonLossSpike", "10m"), alert("GradmonLossSpike", "11m"), alert("GradmonGradNormSpike", "10m"),
         alert("GradmonGradNormJump", "10m"), alert("GradmonGradNormJump", "11m")]),
    "a_grad_norm_spike_burst_is_a_warning_naming_the_signal": (
        [steps(), burst("_x10 0 20 200x20", "grad_norm")],
        [alert("GradmonGradNormSpike", "11m", ("warning", target(rank="0", signal="grad_norm"))),
         alert("GradmonGradNormSpike", "14m"), alert("GradmonGradNormSpikeSevere", "11m")]),
    "one_ranks_own_gradient_spike_warns_naming_that_rank": (
        [steps("0"), steps("1"), burst("200x20", "local_grad_norm", "0"), burst("_x10 0 200x10", "local_grad_norm", "1")],
        [alert("GradmonGradNormSpike", "10m", ("warning", target(rank="1", signal="local_grad_norm")))]),
    "a_layer_norm_spike_burst_is_a_warning": (
        [steps(), burst("_x10 0 20 200x20", "layer_grad_norm")],
        [alert("GradmonGradNormJump", "11m", ("warning", target(rank="0", signal="layer_grad_norm"))),
         alert("GradmonGradNormJump", "14m"), alert("GradmonGradNormJumpSevere", "11m")]),
    "attention_growth_warns_as_it_reaches_its_bar_and_each_doubling": (
        # 100 steps a minute: the projection reaches 9x at 10m (an event), 12x at 11-12m (none:
        # the warning clears), 17x at 13m (the next doubling: warns again)
        [steps(), layer("gradmon_activation_growth", "2x9 9 12 12 17x5", "blocks.0.qkv", role="attention"),
         since("_x10 0 100 200 0 100x5", "attention_growth")],
        [alert("GradmonAttentionGrowth", "10m", ("warning", target(rank="0", layer="blocks.0.qkv"))),
         alert("GradmonAttentionGrowth", "11m"),
         alert("GradmonAttentionGrowth", "13m", ("warning", target(rank="0", layer="blocks.0.qkv")))]),
    "attention_growth_on_a_rank_without_per_layer_series_names_its_worst_projection": (
        [steps("3"), series("gradmon_activation_growth_worst", "2x9 9x5", rank="3", layer="blocks.4.q_proj"),
         since("_x10 0 100x5", "attention_growth", "3")],
        [alert("GradmonAttentionGrowth", "10m", ("warning", target(rank="3", layer="blocks.4.q_proj")))]),
    "no_attention_growth_warning_for_the_logits_or_a_modest_growth": (
        # the logits' growth has no event; a projection at 3x had none either
        [steps(), layer("gradmon_activation_growth", "2x9 9x5", "head", role="output"),
         layer("gradmon_activation_growth", "3x15", "blocks.0.qkv", role="attention")],
        [alert("GradmonAttentionGrowth", "10m"), alert("GradmonAttentionGrowth", "12m")]),
    # -- the page: a divergence confirmed in the process, named by its evidence
    "a_confirmed_divergence_pages_while_it_lasts": (
        [steps(), series("gradmon_loss_diverging_steps", "0x10 1+1x10 0x10", rank="0")],
        [alert("GradmonLossDiverging", "9m"),
         alert("GradmonLossDiverging", "12m", ("critical", target(rank="0"))),
         alert("GradmonLossDiverging", "25m")]),
    "a_divergence_entered_and_left_between_two_scrapes_pages": (
        [steps(), series("gradmon_loss_diverging_steps", "0x30", rank="0"),
         series("gradmon_loss_divergences_total", "0x10 1x20", rank="0")],
        [alert("GradmonLossDiverging", "10m"),
         alert("GradmonLossDiverging", "11m", ("critical", target(rank="0"))),
         alert("GradmonLossDiverging", "12m")]),
    "a_divergence_after_a_loss_spike_is_loss_spike_severe": (
        [steps(), evidence("_x10 1x10", "loss"), evidence("_x10 1x10", "loss_creep")],
        [alert("GradmonLossSpikeSevere", "12m", ("critical", target(rank="0", signal="loss"))),
         alert("GradmonGradNormSpikeSevere", "12m"), alert("GradmonGradNormJumpSevere", "12m")]),
    "a_divergence_after_a_gradient_spike_is_grad_norm_spike_severe": (
        [steps(), evidence("_x10 1x10", "grad_norm")],
        [alert("GradmonGradNormSpikeSevere", "12m", ("critical", target(rank="0", signal="grad_norm"))),
         alert("GradmonLossSpikeSevere", "12m"), alert("GradmonGradNormSpikeSevere", "5m")]),
    "a_divergence_after_a_layer_norm_spike_is_grad_norm_jump_severe": (
        [steps(), evidence("_x10 1x10", "layer_grad_norm")],
        [alert("GradmonGradNormJumpSevere", "12m", ("critical", target(rank="0", signal="layer_grad_norm"))),
         alert("GradmonGradNormJumpSevere", "5m")]),
    "a_rising_loss_warns_with_its_steps": (
        [steps(), series("gradmon_loss_rising_steps", "0x10 5+5x10 0x10", rank="0")],
        [alert("GradmonLossRising", "9m"),
         alert("GradmonLossRising", "12m", ("warning", target(rank="0"))),
         alert("GradmonLossRising", "25m")]),
    # -- per-layer baselines, counted in steps in the process
    # the run of steps above 4x is counted in the process (gradmon_grad_norm_above_baseline_steps):
    # the alert fires at the first scrape that sees 6 or more, whatever the step rate
    "a_layer_norm_above_4x_its_own_median_for_6_steps_warns_naming_the_layer": (
        [steps(), layer("gradmon_grad_norm_baseline_ratio", "1x15 5x10"),
         series("gradmon_grad_norm_above_baseline_steps", "0x15 3 8 13x8", rank="0")],
        [alert("GradmonGradNormAboveBaseline", "16m"),
         alert("GradmonGradNormAboveBaseline", "17m", ("warning", target(rank="0", layer="embed"))),
         alert("GradmonGradNormAboveBaseline", "24m", ("warning", target(rank="0", layer="embed")))]),
    "no_layer_norm_alert_for_short_runs_above_4x_a_ratio_back_under_it_or_in_the_warm_up": (
        # 5 steps in a row is not 6; a long run whose ratio is back under 4 at the scrape has
        # ended; 8x for 9 steps in the warm-up is normal
        [series("gradmon_steps_total", "0+10x60", rank="0"),
         layer("gradmon_grad_norm_baseline_ratio", "8x9 1x5 5 5 5 5 1x5 3x5"),
         series("gradmon_grad_norm_above_baseline_steps", "0 1 2 3 4 5 6 7 8 0x5 2 5 5 1 0x5 9x5", rank="0")],
        [alert("GradmonGradNormAboveBaseline", "8m"), alert("GradmonGradNormAboveBaseline", "16m"),
         alert("GradmonGradNormAboveBaseline", "17m"), alert("GradmonGradNormAboveBaseline", "24m"),
         alert("GradmonGradNormAboveBaseline", "28m")]),
    "one_ranks_own_layer_norm_above_4x_its_baseline_for_6_steps_warns_naming_rank_and_layer": (
        # rank 0 has a long run above 4x too, but its ratio is under 4 at the scrape: only rank 7 warns
        [steps("7"), series("gradmon_local_grad_norm_baseline_ratio_worst", "1x10 1.2x5 6x10", rank="7", layer="blocks.4.mlp"),
         series("gradmon_local_grad_norm_above_baseline_steps", "0x15 2 7x9", rank="7"),
         steps("0"), series("gradmon_local_grad_norm_baseline_ratio_worst", "1.1x25", rank="0", layer="embed"),
         series("gradmon_local_grad_norm_above_baseline_steps", "9x25", rank="0")],
        [alert("GradmonLocalGradNormAboveBaseline", "16m"),
         alert("GradmonLocalGradNormAboveBaseline", "17m", ("warning", target(rank="7", layer="blocks.4.mlp")))]),
    "no_local_norm_alert_for_a_noisy_rank_a_short_run_or_in_the_warm_up": (
        [series("gradmon_steps_total", "0+10x60", rank="3"),
         series("gradmon_local_grad_norm_baseline_ratio_worst", "8x9 " + NOISE * 2 + "5x10", rank="3", layer="embed"),
         series("gradmon_local_grad_norm_above_baseline_steps", "8x9 0x15 5x10", rank="3")],
        [alert("GradmonLocalGradNormAboveBaseline", "9m"), alert("GradmonLocalGradNormAboveBaseline", "30m")]),
    "an_update_reading_at_15x_its_own_baseline_warns_until_the_next_reading": (
        [steps(), layer("gradmon_update_ratio_baseline_ratio", "1x20 15 15 1x5", "blocks.0.attn")],
        [alert("GradmonUpdateRatioAboveBaseline", "20m"),
         alert("GradmonUpdateRatioAboveBaseline", "21m", ("warning", target(rank="0", layer="blocks.0.attn"))),
         alert("GradmonUpdateRatioAboveBaseline", "23m")]),
    "no_update_alert_through_an_lr_warm_up_and_restart": (
        # a linear warm-up keeps the ratio near 2 (each reading over the median of its
        # smaller predecessors); the restart's jump empties the baseline: absent, then ~1
        [steps(), layer("gradmon_update_ratio_baseline_ratio", "2.2 2 1.8 1.6 1.5 1.4 1.3 1.2 1.1x10 _x3 1.2 1 1.1x20")],
        [alert("GradmonUpdateRatioAboveBaseline", "20m"), alert("GradmonUpdateRatioAboveBaseline", "35m")]),
    "an_adam_rms_reading_above_the_bar_warns_until_the_next_reading": (
        [steps(), layer("gradmon_adam_rms", "1x10 4.2 4.2 1x10", "blocks.0.mlp")],
        [alert("GradmonAdamRmsSpike", "12m", ("warning", target(rank="0", layer="blocks.0.mlp"))),
         alert("GradmonAdamRmsSpike", "13m")]),
    "no_adam_rms_warning_in_the_warm_up": (
        # 10 steps a minute: the warm-up (100 steps) ends at 10m
        [series("gradmon_steps_total", "0+10x30", rank="0"), layer("gradmon_adam_rms", "1x7 4.2 1x22", "blocks.0.mlp")],
        [alert("GradmonAdamRmsSpike", f"{m}m") for m in (7, 11)]),
    "no_adam_rms_warning_at_the_top_of_healthy_runs": (
        # healthy runs of the alert corpus's tune split reach 3.1-3.6 now and then
        [steps(), layer("gradmon_adam_rms", "1x10 3.4 3.4 1x10", "blocks.0.mlp")],
        [alert("GradmonAdamRmsSpike", "12m"), alert("GradmonAdamRmsSpike", "13m")]),
    "no_adam_rms_alert_for_ordinary_values": (
        [steps(), layer("gradmon_adam_rms", "0.9 1.1 1.4 0.7 2.2 1 " * 5, "blocks.0.mlp")],
        [alert("GradmonAdamRmsSpike", "25m")]),
    # -- fp16 headroom
    "fp16_activation_with_less_than_2x_headroom_warns": (
        [layer("gradmon_fp16_range_used", "0.2x5 0.6x5", "blocks.3.mlp", tensor="activation")],
        [alert("GradmonFp16HeadroomLow", "9m", ("warning", target(rank="0", layer="blocks.3.mlp", tensor="activation")))]),
    "fp16_gradient_near_overflow_without_a_scaler_warns": (
        [layer("gradmon_fp16_range_used", "0.7x10", "head", tensor="grad")],
        [alert("GradmonFp16HeadroomLow", "9m", ("warning", target(rank="0", layer="head", tensor="grad")))]),
    "no_fp16_alert_while_a_grad_scaler_pushes_the_gradient_up_on_purpose": (
        [layer("gradmon_fp16_range_used", "0.6 0.9 0.7 0.95 0.8 0.6 " * 2, "head", tensor="grad"),
         layer("gradmon_fp16_range_used", "0.1 0.3 0.2 0.45 " * 3, "head", tensor="activation"),
         series("gradmon_amp_loss_scale", "65536 131072 262144 131072 262144 524288 " * 2, rank="0")],
        [alert("GradmonFp16HeadroomLow", "10m")]),
    # -- learning rate
    "a_nan_learning_rate_is_critical_at_once": (
        [lr("0.001x5 NaN NaN NaN NaN NaN")],
        [alert("GradmonLearningRateNonFinite", "6m", ("critical", target(rank="0", group="0")))]),
    "no_nonfinite_lr_alert_through_an_lr_warm_up_from_0": (
        [lr(LR_WARMUP)], [alert("GradmonLearningRateNonFinite", "10m")]),
    "a_learning_rate_at_0_for_10m_after_having_been_positive_warns": (
        [lr("0.001x10 0x20"), lr("0x30", group="1")],
        [alert("GradmonLearningRateZero", "19m"),
         alert("GradmonLearningRateZero", "22m", ("warning", target(rank="0", group="0")))]),
    "no_lr_zero_alert_for_a_group_at_0_from_the_start_a_warm_up_or_a_restart": (
        [lr("0x40", group="frozen"), lr(LR_WARMUP, group="warmup"), lr(LR_RESTART, group="sgdr")],
        [alert("GradmonLearningRateZero", "15m"), alert("GradmonLearningRateZero", "30m")]),
    # the ratio to the settled peak is decided in the process (aggregate/scalars.py); absent until a peak settles
    "a_learning_rate_half_again_above_its_settled_peak_warns_at_once_until_it_settles": (
        [series("gradmon_learning_rate_over_peak", "1x5 1.3 1.5 2.5 4 _x3", rank="0", group="0")],
        [alert("GradmonLearningRateAbovePeak", "5m"), alert("GradmonLearningRateAbovePeak", "6m"),
         alert("GradmonLearningRateAbovePeak", "7m", ("warning", target(rank="0", group="0"))),
         alert("GradmonLearningRateAbovePeak", "9m", ("warning", target(rank="0", group="0"))),
         alert("GradmonLearningRateAbovePeak", "20m")]),
    "no_lr_above_peak_alert_through_a_decay_a_restart_to_the_same_peak_or_just_under_the_bar": (
        [series("gradmon_learning_rate_over_peak", "1 0.8 0.5 0.2 1 0.9 1.49 1.2", rank="0", group="0")],
        [alert("GradmonLearningRateAbovePeak", f"{m}m") for m in range(8)]),
})


def test_generated_files_match_the_definitions():
    assert alerting.main(["check", str(ROOT)]) == 0, "run `python -m gradmon.alerting write` and commit"


def test_every_per_layer_counter_a_monitor_exports_has_its_nan_series_which_the_rules_read_for_it():
    """GradmonNonFiniteGradients tells a target that exports per-layer counters by their
    kind="nan" series alone (half the series to read, twice an evaluation): a monitor's
    exposition must hold one for every layer and tensor it counts, an Inf count included."""
    import torch
    from prometheus_client import CollectorRegistry

    import gradmon

    expr = next(r["expr"] for g in alerting.rule_groups()["groups"]
                for r in g["rules"] if r.get("alert") == "GradmonNonFiniteGradients")
    assert 'unless on(job, instance, model, rank) (gradmon_nonfinite_total{kind="nan"} or ' \
           'gradmon_local_nonfinite_total{kind="nan"})' in expr
    registry = CollectorRegistry()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradmon.attach(model, registry=registry, ui=False, announce=False, final_scrape_timeout=0)
    try:
        for poison in (False, True):
            x = torch.ones(2, 4)
            if poison:
                x[0, 0] = float("inf")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.flush(30)
        samples = [s for f in registry.collect() for s in f.samples
                   if s.name in ("gradmon_nonfinite_total", "gradmon_local_nonfinite_total")]
    finally:
        mon.detach()
    assert any(s.value > 0 for s in samples), "the poisoned step counted nothing"
    counted = [s.labels for s in samples]
    key = lambda labels: tuple(sorted((k, v) for k, v in labels.items() if k != "kind"))  # noqa: E731
    nan = {key(labels) for labels in counted if labels["kind"] == "nan"}
    assert nan and {key(labels) for labels in counted} == nan


def test_promtool_accepts_the_rule_files():
    promtool = binary("promtool")
    for path in (RULES,):
        r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    spec = yaml.safe_load((ROOT / "deploy/kubernetes/prometheusrule.yaml").read_text())["spec"]
    assert spec == yaml.safe_load(RULES.read_text())


def test_promtool_parses_every_grafana_managed_alert_query(tmp_path):
    """Grafana sends each rule's query to Prometheus as it is: promtool must parse it (an
    inlined recording rule read over a range has to be a subquery)."""
    graf = yaml.safe_load((ROOT / "deploy/grafana/provisioning/alerting/gradmon.yml").read_text())
    rules = [{"alert": r["title"], "expr": r["data"][0]["model"]["expr"]} for r in graf["groups"][0]["rules"]]
    path = tmp_path / "grafana-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    r = subprocess.run([binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    names = {a.name for a in alerting.alerts(alerting.Thresholds(), alerting.PRODUCTION)}
    firing = {t["alertname"] for _, tests in CASES.values() for t in tests if t["exp_alerts"]}
    silent = {t["alertname"] for _, tests in CASES.values() for t in tests if not t["exp_alerts"]}
    assert firing == names and silent == names


@pytest.mark.parametrize("case", sorted(CASES))
def test_promtool_unit(case, tmp_path):
    run_promtool_unit(tmp_path, *CASES[case])


def run_promtool_unit(tmp_path, inputs: list, tests: list, annotations: bool = False) -> None:
    promtool = binary("promtool")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(alerting.rule_groups(annotations=annotations)))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": [str(rules)], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": tests}]}))
    r = subprocess.run([promtool, "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


WHERE = "job train, rank 0, model gpt"
READABLE = {
    # increase() extrapolates over the window: 7 counted NaNs are 8.166666666666668 here
    "nonfinite_count": (
        [series("gradmon_nonfinite_total", "0 _ _ 5 5 12 12", rank="0", layer="blocks.3.fc", tensor="grad", kind="nan")],
        "GradmonNonFiniteGradients", "6m", target(rank="0", layer="blocks.3.fc", tensor="grad"),
        f"8.167 NaN/Inf elements in the grad of layer blocks.3.fc ({WHERE}) in the last 5m."),
    "explosion_norm": (
        [steps(), series("gradmon_grad_global_norm", "1x40 5234.5678x10", rank="0")],
        "GradmonGradientExplosion", "43m", target(rank="0"),
        f"Pre-clip global gradient norm 5.235k ({WHERE}): above 1000, or 100x its own median of the previous 30m."),
    "vanishing_norm": (
        [steps(), series("gradmon_grad_norm", "1.234567e-9x30", rank="0", layer="blocks.0.fc")],
        "GradmonVanishingGradients", "20m", target(rank="0", layer="blocks.0.fc"),
        f"Gradient norm of layer blocks.0.fc is 1.235n ({WHERE}): below 1e-08 or below 0.0001x its own median, "
        "for 10m."),
    "rising_steps": (
        [steps(), series("gradmon_loss_rising_steps", "0x10 40+40x10", rank="0")],
        "GradmonLossRising", "12m", target(rank="0"),
        f"The loss trend (mean of the last 20 losses) has been at least 1.5x its best for 80 steps ({WHERE}) "
        "and is not back below 1.3x: the run is losing what it learned. Not a page until the loss confirms a "
        "divergence."),
}


@pytest.mark.parametrize("case", sorted(READABLE))
def test_alert_descriptions_print_numbers_readably(case, tmp_path):
    inputs, name, at, labels, description = READABLE[case]
    rule = next(a for a in alerting.alerts(alerting.Thresholds(), alerting.PRODUCTION) if a.name == name)
    run_promtool_unit(tmp_path, inputs, [{
        "eval_time": at, "alertname": name,
        "exp_alerts": [{"exp_labels": {"severity": rule.severity, **labels},
                        "exp_annotations": {"summary": rule.summary, "description": description,
                                            "runbook_url": rule.runbook_url}}]}], annotations=True)


def test_every_alert_carries_severity_summary_description_and_runbook():
    runbook = (ROOT / "docs/runbook.md").read_text()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                assert rule["record"].count(":") == 2, "recording rules are named level:metric:operations"
                continue
            assert rule["labels"]["severity"] in ("critical", "warning")
            ann = rule["annotations"]
            assert ann["summary"] and "{{" not in ann["summary"]
            assert "$labels.job" in ann["description"]
            assert "$value" in ann["description"] or "$labels.rank" in ann["description"]
            anchor = ann["runbook_url"].split("#")[1]
            assert f"## {rule['alert']}" in runbook and anchor == rule["alert"].lower()


def test_alertmanager_config_is_valid_and_inhibits_the_consequences_of_one_fault():
    amtool = binary("amtool")
    path = ROOT / "deploy/alertmanager/alertmanager.yml"
    r = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = yaml.safe_load(path.read_text())
    assert cfg["route"]["group_by"] == ["job", "alertname"]
    inhibit = {r["source_matchers"][0]: r["target_matchers"][0] for r in cfg["inhibit_rules"]}
    assert "GradmonGradientExplosion" in inhibit["alertname = GradmonNonFiniteGradients"]
    assert "GradmonTrainingStalled" in inhibit["alertname = GradmonExporterDown"]
    # a spike's critical tier silences its warning, and a NaN the norm warnings it causes
    assert inhibit["alertname = GradmonLossSpikeSevere"] == 'alertname =~ "GradmonLossSpike"'
    assert inhibit["alertname = GradmonGradNormSpikeSevere"] == 'alertname =~ "GradmonGradNormSpike"'
    assert "GradmonGradNormAboveBaseline" in inhibit["alertname = GradmonNonFiniteGradients"]
    failed = [r for r in cfg["inhibit_rules"] if r["source_matchers"] == ["alertname = GradmonRunFailed"]]
    assert failed and failed[0]["equal"] == ["job"]  # job-wide: the other ranks of the failed job
    for consequence in ("GradmonExporterDown", "GradmonRanksMissing", "GradmonTrainingStalled"):
        assert consequence in failed[0]["target_matchers"][0]


def test_grafana_managed_alerts_match_the_prometheus_rules():
    graf = yaml.safe_load((ROOT / "deploy/grafana/provisioning/alerting/gradmon.yml").read_text())
    prom = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    rules = graf["groups"][0]["rules"]
    assert {r["title"] for r in rules} == set(prom)
    for r in rules:
        p = prom[r["title"]]
        assert r["for"] == p["for"] and r["labels"] == p["labels"]
        # the same text, but Grafana's $value is a description of every query: the number is $values.A.Value
        assert r["annotations"] == {**p["annotations"], "description": alerting.grafana_template(p["annotations"]["description"])}
        assert not re.search(r"\$value\b(?!s)", r["annotations"]["description"]), r["title"]
        assert ("$value" in p["annotations"]["description"]) == ("$values.A.Value" in r["annotations"]["description"])
        # recording rules are inlined: Grafana's datasource may not have them loaded
        assert not re.search(r"\b\w+:\w+:\w+\b", r["data"][0]["model"]["expr"]), r["title"]
