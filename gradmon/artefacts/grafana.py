"""The same alerts as Grafana-managed alert rules, for teams that alert from Grafana."""

from __future__ import annotations

import re
from typing import Any, Dict

from ..thresholds import PRODUCTION, Thresholds, Timing
from .alert import Alert
from .rules import alerts, recording_rules


def grafana_template(text: str) -> str:
    """A Prometheus annotation as Grafana-managed alerting reads it: there ``$value`` is a
    text describing every query, and the alert query's number is ``$values.A.Value``."""
    return re.sub(r"\$value\b(?!s)", "$values.A.Value", text)


def inline_recording_rules(expr: str, inline: Dict[str, str]) -> str:
    """``expr`` with every recording rule replaced by its own expression (Grafana evaluates
    plain PromQL against the datasource, which may not have gradmon's recording rules
    loaded); one read over a range becomes a subquery, since ``(expr)[30m]`` is no valid
    PromQL. Longest names first: a baseline's expression reads its post-warm-up rule, whose
    shorter name is then replaced in turn."""
    for name in sorted(inline, key=len, reverse=True):
        expr = re.sub(re.escape(name) + r"\[([^\]:]+)\]", lambda m: f"{inline[name]}[{m.group(1)}:]", expr)
        expr = expr.replace(name, inline[name])
    return expr


def grafana_rule(a: Alert, expr: str, t: Timing) -> Dict[str, Any]:
    return {
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
        "for": a.for_duration,
        "noDataState": "OK",
        "execErrState": "Error",
        "labels": {"severity": a.severity},
        "annotations": {"summary": a.summary, "description": grafana_template(a.description),
                        "runbook_url": a.runbook_url},
    }


def grafana_alerting(th: Thresholds = Thresholds(), t: Timing = PRODUCTION) -> Dict[str, Any]:
    """The same alerts for teams that alert from Grafana: each rule queries the same PromQL,
    with the recording rules inlined."""
    inline = {r["record"]: f"({r['expr']})" for r in recording_rules(th, t)}
    rules = [grafana_rule(a, inline_recording_rules(a.expr, inline), t) for a in alerts(th, t)]
    return {"apiVersion": 1, "groups": [
        {"orgId": 1, "name": "gradmon", "folder": "gradmon", "interval": "1m", "rules": rules}]}
