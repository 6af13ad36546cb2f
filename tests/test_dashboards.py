"""Dashboards by structure: fixed uids, a datasource variable, the job/rank/layer variables,
units, and queries that use only metrics gradmon exports or rules record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gradmon import alerting
from gradmon import metrics as M

ROOT = Path(__file__).resolve().parents[1]
BOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}
KNOWN = {n for spec in M.ALL_SPECS for n in M.exposed_names(spec)} | {
    r["record"] for r in alerting.recording_rules(alerting.Thresholds(), alerting.PRODUCTION)} | {
    alerting.LOCAL_GLOBAL_NORM, "ALERTS"}
PROMQL_WORDS = {"sum", "max", "min", "by", "rate", "increase", "time", "topk", "bottomk", "on", "le", "count",
                "quantile", "label_values", "group_left", "and", "or", "unless"}


def test_three_dashboards_with_fixed_uids():
    assert {b["uid"] for b in BOARDS.values()} == {"gradmon-overview", "gradmon-layers", "gradmon-ranks"}


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_datasource_variable_and_filters(name):
    board = BOARDS[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "rank", "model"} <= set(variables)
    if name == "layers":
        assert variables["layer"]["multi"] and variables["layer"]["includeAll"]
    for panel in board["panels"]:
        if panel["type"] == "row":
            assert not panel["targets"]
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            if "ALERTS" not in target["expr"]:
                assert '$job' in target["expr"] and '$rank' in target["expr"], (panel["title"], target["expr"])


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_queries_use_only_known_metrics(name):
    for panel in BOARDS[name]["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r'"[^"]*"', "", target["expr"])  # drop label values
            expr = re.sub(r"\[[^\]]*\]", "", expr)
            names = {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
                     if (w.startswith("gradmon") or ":" in w or w == "ALERTS")}
            assert names <= KNOWN, (panel["title"], names - KNOWN)


def test_threshold_lines_come_from_the_alert_thresholds():
    th = alerting.Thresholds()
    panel = next(p for p in BOARDS["overview"]["panels"] if p["title"].startswith("Global gradient norm"))
    assert th.explode_abs in [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    panel = next(p for p in BOARDS["layers"]["panels"] if p["title"] == "Activation max |x| by layer")
    assert th.activation_abs_max in [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def _exprs(panels) -> str:
    return "\n".join(t["expr"] for p in panels for t in p["targets"])


# Per-layer families with no panel on the Layers dashboard, and why
NOT_ON_LAYERS = {M.LOCAL_GRAD_NORM.name: "each rank's own view: the Ranks dashboard shows its global norm"}


def test_every_per_layer_family_of_the_statistics_table_has_a_layers_panel():
    from gradmon import statistics as S
    families = {g.spec.name for st in S.STATISTICS for g in st.gauges if g.per_layer}
    shown = set(re.findall(r"gradmon_\w+", _exprs(BOARDS["layers"]["panels"])))
    assert families - set(NOT_ON_LAYERS) <= shown, families - set(NOT_ON_LAYERS) - shown


def test_every_per_layer_family_declares_its_layers_panel_once():
    from gradmon import statistics as S
    drawn = [g.spec.name for st in S.STATISTICS for g in st.gauges if g.panel is not None]
    assert len(drawn) == len(set(drawn)), drawn
    families = {g.spec.name for st in S.STATISTICS for g in st.gauges if g.per_layer}
    assert families - set(NOT_ON_LAYERS) == set(drawn)
    titles = [p["title"] for p in BOARDS["layers"]["panels"]]
    assert len(titles) == len(set(titles)) and [p["id"] for p in BOARDS["layers"]["panels"]] == list(
        range(1, len(titles) + 1))


def test_a_statistic_declared_with_a_panel_is_drawn_on_the_layers_dashboard(monkeypatch):
    """The panel comes from the declaration alone: title, unit, scale, the threshold line
    from the alerts' numbers, the labels the family adds and the rank of reduced values."""
    from gradmon import statistics as S
    from gradmon.artefacts.dashboards import layers
    spec = M.MetricSpec("gradmon_test_peak", "gauge", ("layer", "part"), "Peak (test).")
    st = S.Statistic("test_peak", None, S.PARAM_GRAD, ((S.Column("peak", S.ABSMAX),),), lambda grads, home: None,
                     reduced=True, gauges=(S.LayerGauge(spec, lambda c: c["peak"], panel=S.Panel(
                         "Peak by layer", log=True, unit="percentunit",
                         line=("red", lambda th: 2 * th.explode_abs), description="Why it matters.")),))
    before = layers(alerting.Thresholds())["panels"]
    monkeypatch.setattr(S, "STATISTICS", S.STATISTICS + (st,))
    th = alerting.Thresholds()
    after = layers(th)["panels"]
    assert len(after) == len(before) + 1
    new = after[-1]
    assert (new["title"], new["description"], new["fieldConfig"]["defaults"]["unit"]) == (
        "Peak by layer", "Why it matters.", "percentunit")
    assert new["fieldConfig"]["defaults"]["custom"]["scaleDistribution"] == {"type": "log", "log": 10}
    assert {"color": "red", "value": 2 * th.explode_abs} in new["fieldConfig"]["defaults"]["thresholds"]["steps"]
    (target,) = new["targets"]
    assert target["expr"].startswith("gradmon_test_peak{") and '$layer' in target["expr"]
    assert target["legendFormat"] == "{{layer}} {{part}} (rank {{rank}})"
    # below every panel that was there, which keep their places
    assert new["gridPos"]["y"] >= max(p["gridPos"]["y"] for p in before)
    assert [p["gridPos"] for p in after[:-1]] == [p["gridPos"] for p in before]


def test_overview_has_a_stability_row_with_loss_spikes_learning_rate_and_update_ratio():
    panels = BOARDS["overview"]["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Stability")
    below = panels[row + 1:]
    assert all(p["gridPos"]["y"] > panels[row]["gridPos"]["y"] for p in below)
    exprs = _exprs(below)
    for spec in (M.LOSS, M.LOSS_TREND, M.LOSS_TREND_BEST, M.LOSS_RISING_STEPS, M.LOSS_DIVERGING_STEPS,
                 M.SPIKE_SCORE, M.LEARNING_RATE, M.UPDATE_TO_WEIGHT_RATIO):
        assert spec.name + "{" in exprs, spec.name
    # a counter is drawn as its increase, never as its raw cumulative value
    assert f"increase({M.SPIKE_STEPS.name}_total{{" in exprs


def test_stability_threshold_lines_come_from_the_alert_thresholds():
    th = alerting.Thresholds()
    for title, value in (("Gradient norm over its own baseline", th.norm_baseline_ratio),
                         ("Update ratio over its own baseline", th.update_baseline_ratio),
                         ("Adam RMS(g / sqrt(v)) by layer", th.adam_rms_spike),
                         ("fp16 range used", 1 / th.fp16_min_headroom)):
        panel = next(p for p in BOARDS["layers"]["panels"] if p["title"] == title)
        assert value in [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]], title
