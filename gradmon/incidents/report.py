"""What ``gradmon incident`` shows: a text summary and a self-contained HTML report.

A bundle comes from an untrusted run: every string from it reaches the terminal through
``sanitize.clean`` and the page only as text (``html.escape`` in the markup, ``textContent``
in the script, its JSON escaped so that no ``</script>`` or U+2028 can end it early).
"""

from __future__ import annotations

import glob
import html
import json
import math
import os
from typing import Any, Dict, List, Optional

import torch

from ..sanitize import clean
from . import bundle as B

HEAT_STEPS = 200  # heatmap columns around the incident: the steps that lead to it


def _s(value: Any) -> str:
    return clean(str(value))


def siblings(b: B.Bundle) -> List[B.Bundle]:
    """The other ranks' bundles of the same incident in the same directory (same model,
    step and world size), readable ones only."""
    run, step = b.meta["run"], b.meta["incident"]["step"]
    out = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(b.path)), "*.npz"))):
        if os.path.abspath(path) == os.path.abspath(b.path):
            continue
        try:
            other = B.load(path)
        except B.Refused:
            continue
        o = other.meta
        if (o["run"].get("model") == run.get("model") and o["incident"].get("step") == step
                and o["run"].get("world_size") == run.get("world_size") and o["run"].get("rank") != run.get("rank")):
            out.append(other)
    return out


def origin_text(b: B.Bundle, others: List[B.Bundle]) -> str:
    inc = b.meta["incident"]
    if inc.get("origin_here"):
        return f"block {_s(inc.get('block'))} on this rank"
    origins = [o for o in others if o.meta["incident"].get("origin_here")]
    if origins:
        return "; ".join(f"rank {_s(o.meta['run'].get('rank'))}, block {_s(o.meta['incident'].get('block'))} "
                         f"(its bundle: {_s(o.path)})" for o in origins)
    if (b.meta["run"].get("world_size") or 1) <= 1:
        # One rank and a finite forward: the first non-finite value was made in the backward.
        return "no block: the forward stayed finite, the gradients went non-finite in the backward"
    return ("not on this rank: its forward stayed finite (the gradients went non-finite in the reduction); "
            "the origin rank's bundle says origin_here")


def rows_text(meta: Dict[str, Any]) -> str:
    rows, batch = meta["rows"], meta["batch"]
    if not rows.get("known"):
        return f"unknown ({_s(rows.get('reason'))})"
    ids = batch.get("ids") if batch.get("known") else None
    hashes = batch.get("hashes") if isinstance(batch.get("hashes"), dict) else {}

    def name(r: Any) -> str:
        if not isinstance(r, int):
            return ""
        if isinstance(ids, list):
            return f" (id {_s(ids[r])})" if 0 <= r < len(ids) else ""
        shown = [f"{_s(k)} {_s(v[r])}" for k, v in hashes.items() if isinstance(v, list) and 0 <= r < len(v)]
        return f" (hash {', '.join(shown)})" if shown else ""
    return ", ".join(f"{_s(r)}{name(r)}" for r in rows.get("rows", [])) + f" at {_s(rows.get('block'))}"


def batch_text(meta: Dict[str, Any]) -> str:
    batch = meta["batch"]
    if batch.get("known"):
        return f"{len(batch.get('ids') or [])} given"
    hashes = batch.get("hashes") if isinstance(batch.get("hashes"), dict) else {}
    return f"unknown ({_s(batch.get('reason'))})" + (
        f"; rows named by the hashes of the inputs {', '.join(_s(k) for k in hashes)} ({_s(batch.get('hash'))}: "
        "docs/incidents.md says how to hash your data alike)" if hashes else "")


def what_text(b: B.Bundle) -> List[str]:
    """What happened: a non-finite run and its origin, or why another kind was written."""
    m = b.meta
    inc, reason = m["incident"], m.get("reason") if isinstance(m.get("reason"), dict) else {}
    if m.get("kind", "nonfinite") == "nonfinite":
        return [f"  non-finite at step {_s(inc.get('step'))} (the run of non-finite steps started at step "
                f"{_s(inc.get('origin_step'))})",
                f"  origin: {origin_text(b, siblings(b))}",
                f"  gradient first non-finite in layer {_s(inc.get('grad_layer') or '-')}, activation in layer "
                f"{_s(inc.get('activation_layer') or '-')}"]
    if m.get("kind") == "divergence":
        evidence = reason.get("evidence") if isinstance(reason.get("evidence"), list) else []
        return [f"  loss divergence confirmed at step {_s(inc.get('step'))}: the mean of the last "
                f"{_s(reason.get('window'))} losses is {_num(reason.get('trend'))}, {_num(reason.get('ratio'))} "
                f"times its best {_num(reason.get('best'))} (the run's first such mean: {_num(reason.get('start'))})",
                "  evidence: " + (", ".join(_s(e) for e in evidence) or "none")]
    return [f"  {_s(m.get('kind'))} at step {_s(inc.get('step'))}"] + [
        f"  {_s(k)}: {_s(v)}" for k, v in reason.items() if k != "kind"]


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else _s(x)


def summary(b: B.Bundle) -> str:
    m = b.meta
    run, inc, hist, versions = m["run"], m["incident"], m["history"], m["versions"]
    steps = b.arrays.get("history.step")
    lines = [
        f"gradmon incident bundle {_s(b.path)}",
        f"  model {_s(run.get('model'))}, rank {_s(run.get('rank'))} of {_s(run.get('world_size'))}, "
        f"host {_s(run.get('host'))}, device {_s(run.get('device'))}, pid {_s(run.get('pid'))}",
        *what_text(b),
        f"  rows: {rows_text(m)}",
        f"  batch ids: {batch_text(m)}",
    ]
    if hist.get("present") and steps is not None and len(steps):
        lines.append(f"  history: {len(steps)} steps ({int(steps[0])}..{int(steps[-1])}), "
                     f"{len(hist.get('layers', []))} layers" +
                     (f", {_s(hist.get('dropped_steps'))} older steps left out (incident_max_bytes)"
                      if hist.get("dropped_steps") else ""))
    else:
        lines.append("  history: none in this record (kept on the origin rank and rank 0)")
    for layer, params in (m.get("blamed") or {}).items():
        for name, values in (params if isinstance(params, dict) else {}).items():
            shown = ", ".join(f"{_s(k)}={_s(v)}" for k, v in (values if isinstance(values, dict) else {}).items())
            lines.append(f"  optimizer statistics of layer {_s(layer)}, {_s(name)}: {shown}")
    lines.append(f"  versions: gradmon {_s(versions.get('gradmon'))}, torch {_s(versions.get('torch'))}, "
                 f"CUDA {_s(versions.get('cuda') or 'none')}, Python {_s(versions.get('python'))}")
    return "\n".join(lines) + "\n"


def _numbers(t: Optional[torch.Tensor]) -> List[Optional[float]]:
    if t is None:
        return []
    return [float(f"{v:.6g}") if math.isfinite(v) else None for v in t.double().tolist()]


def page_data(b: B.Bundle) -> Dict[str, Any]:
    """What the page's script draws: series, the heatmap around the incident, names."""
    a, m = b.arrays, b.meta
    steps = a.get("history.step")
    data: Dict[str, Any] = {"steps": [], "norm": [], "loss": [], "bad": [], "heat": [], "heat_steps": [],
                            "layers": [str(x) for x in m["history"].get("layers", [])]}
    if not m["history"].get("present") or steps is None:
        return data
    norm = a["history.global_norm"]
    data.update(steps=[int(s) for s in steps.tolist()], norm=_numbers(norm), loss=_numbers(a["history.loss"]),
                bad=[not math.isfinite(v) for v in norm.tolist()])
    heat = a["history.layer_grad_norm"][-HEAT_STEPS:]
    data["heat_steps"] = data["steps"][-HEAT_STEPS:]
    data["heat"] = [["nonfinite" if not math.isfinite(v) else (round(math.log10(v), 3) if v > 0 else None)
                     for v in col] for col in heat.double().tolist()]
    return data


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: nothing in it can close the element or start markup."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#223}h1{font-size:1.3em}
pre{background:#f4f5f7;padding:.8em;white-space:pre-wrap;word-break:break-all}
canvas{border:1px solid #ccd;display:block;margin:.4em 0 1em}#layers{font:11px monospace;color:#556}
.bad{color:#c62828;font-weight:bold}
"""

_JS = """
(function () {
  const d = JSON.parse(document.getElementById("data").textContent);
  const $ = (id) => document.getElementById(id);
  const at = d.steps.indexOf(d.step);
  function line(canvas, values, log) {
    const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height, pad = 4;
    const ys = values.map((v) => v === null || (log && v <= 0) ? null : (log ? Math.log10(v) : v));
    const good = ys.filter((v) => v !== null);
    const n = Math.max(values.length, 2), x = (i) => pad + (w - 2 * pad) * i / (n - 1);
    ctx.fillStyle = "#c62828";
    d.bad.forEach((bad, i) => { if (bad) ctx.fillRect(x(i) - 1, 0, 3, h); });
    canvas.dataset.marked = String(at);
    if (!good.length) return;
    let lo = Math.min(...good), hi = Math.max(...good);
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    const y = (v) => h - 6 - (h - 12) * (v - lo) / (hi - lo);
    ctx.strokeStyle = "#1565c0"; ctx.lineWidth = 1.5; ctx.beginPath();
    let open = false;
    ys.forEach((v, i) => { if (v === null) { open = false; return; }
      if (open) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v)); open = true; });
    ctx.stroke();
  }
  function heatmap(canvas) {
    const ctx = canvas.getContext("2d"), cols = d.heat, rows = d.layers.length;
    canvas.dataset.columns = String(cols.length);
    if (!cols.length || !rows) return;
    let lo = Infinity, hi = -Infinity;
    for (const c of cols) for (const v of c) if (typeof v === "number") { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (lo === Infinity) { lo = 0; hi = 1; }
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    const cw = canvas.width / cols.length, rh = canvas.height / rows;
    cols.forEach((c, j) => c.forEach((v, r) => {
      const t = typeof v === "number" ? (v - lo) / (hi - lo) : 0;
      ctx.fillStyle = v === "nonfinite" ? "#ff00ff" : v === null ? "#dddddd"
        : "rgb(" + Math.round(40 + 200 * t) + "," + Math.round(60 + 120 * (1 - Math.abs(2 * t - 1))) + "," + Math.round(220 * (1 - t)) + ")";
      ctx.fillRect(j * cw, r * rh, Math.ceil(cw), Math.ceil(rh));
    }));
  }
  line($("norm"), d.norm, true);
  line($("loss"), d.loss, false);
  heatmap($("heatmap"));
  $("layers").textContent = d.layers.join("  ");
  document.body.dataset.ready = "1";
})();
"""


def page(b: B.Bundle) -> str:
    """The HTML report: one file, no network (inline CSS and script), names as text."""
    data = page_data(b)
    data["step"] = b.meta["incident"]["step"]
    m = b.meta
    kind = "" if m.get("kind", "nonfinite") == "nonfinite" else f" ({m.get('kind')})"
    title = (f"gradmon incident{kind}: {m['run'].get('model')} rank {m['run'].get('rank')} "
             f"step {m['incident'].get('step')}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{html.escape(clean(title))}</title><style>{_CSS}</style></head>
<body>
<h1>{html.escape(clean(title))}</h1>
<pre id="summary">{html.escape(summary(b))}</pre>
<h2>Global gradient norm (log scale); non-finite steps in red</h2><canvas id="norm" width="900" height="160"></canvas>
<h2>Loss</h2><canvas id="loss" width="900" height="160"></canvas>
<h2>Each layer's gradient norm, the last {HEAT_STEPS} steps to the incident (magenta: NaN/Inf)</h2>
<canvas id="heatmap" width="900" height="300"></canvas><div id="layers"></div>
<script type="application/json" id="data">{_script_json(data)}</script>
<script>{_JS}</script>
</body></html>
"""
