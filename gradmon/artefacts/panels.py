"""The pieces of a Grafana dashboard: the template variables' selectors, a query, a panel,
a row header, a variable and the board around them."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import metrics as M

SEL = 'job=~"$job", model=~"$model", rank=~"$rank"'
PSEL = 'job=~"$job", rank=~"$rank"'  # process metrics describe the process, not one model: no model label
LSEL = SEL + ', layer=~"$layer"'

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def target(expr: str, legend: str, ref: str, instant: bool = False, fmt: Optional[str] = None) -> Dict[str, Any]:
    t: Dict[str, Any] = {"refId": ref, "datasource": dict(DATASOURCE), "expr": expr, "legendFormat": legend}
    if instant:
        t["instant"] = True
        t["range"] = False
    if fmt:
        t["format"] = fmt
    return t


def panel(pid: int, title: str, kind: str, grid: Tuple[int, int, int, int], targets: Sequence[Tuple[str, str]],
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
        "datasource": dict(DATASOURCE),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {},
        "targets": [target(e, legend, chr(ord("A") + i), instant, fmt) for i, (e, legend) in enumerate(targets)],
    }


def row(pid: int, title: str, y: int) -> Dict[str, Any]:
    """A row header; ``targets`` empty so that whatever walks every panel's queries walks it too."""
    return {"id": pid, "type": "row", "title": title, "collapsed": False,
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": [], "targets": []}


def variable(name: str, query: str, label: str, multi: bool = True) -> Dict[str, Any]:
    return {"name": name, "label": label, "type": "query",
            "datasource": dict(DATASOURCE),
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "multi": multi, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 3}


def dashboard(uid: str, title: str, panels: List[Dict[str, Any]], with_layer: bool) -> Dict[str, Any]:
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        variable("job", f"label_values({M.INFO.name}, job)", "job"),
        variable("model", f'label_values({M.INFO.name}{{job=~"$job"}}, model)', "model"),
        variable("rank", f'label_values({M.INFO.name}{{job=~"$job", model=~"$model"}}, rank)', "rank"),
    ]
    if with_layer:
        variables.append(variable("layer", f'label_values({M.GRAD_NORM.name}{{job=~"$job", model=~"$model"}}, layer)',
                                  "layer"))
    return {
        "uid": uid, "title": title, "tags": ["gradmon"], "timezone": "browser", "schemaVersion": 39,
        "editable": True, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables},
        "links": [{"title": "gradmon dashboards", "type": "dashboards", "tags": ["gradmon"], "asDropdown": True}],
        "annotations": {"list": []},
        "panels": panels,
    }
