"""The live page: ``/`` on gradmon's endpoint, its script and style, and ``/api/history``.

Everything is served from the process: the page is three small files in
``gradmon/serve/static`` (no CDN, no font, works offline), the data is each monitored model's
:class:`gradmon.history.History` plus its latest snapshot, cut to what the page asks for
(``since`` a step) and at most :data:`MAX_RESPONSE` bytes. The files are cacheable (an
ETag, revalidated) and outside the rate limit, which only the data counts. GET only; no
action can be taken from the page. Names reach the page as JSON strings and are written with
``textContent``, never as markup.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import socket
import time
import urllib.parse
from importlib import resources
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from .. import metrics as M
from ..config import Config
from .server import Page

MAX_RESPONSE = 2 ** 20
_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/app.css": ("app.css", "text/css; charset=utf-8"), "/favicon.svg": ("favicon.svg", "image/svg+xml"),
          "/favicon.ico": ("favicon.svg", "image/svg+xml")}


def pages(views: Callable[[], Iterable[Any]]) -> Dict[str, Page]:
    """The live page's paths, for the models whose export views ``views()`` returns."""
    out = {path: _static(name, ctype) for path, (name, ctype) in _FILES.items()}
    out["/api/history"] = Page(lambda query: history_json(list(views()), query), auth=True,
                               ctype="application/json", ui=True)
    return out


def _static(name: str, ctype: str) -> Page:
    """One of the page's files, read once: cacheable, its validator the hash of its bytes."""
    body = resources.files(__package__).joinpath("static", name).read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    return Page(lambda query: body, auth=True, ctype=ctype, ui=True, etag=etag)


def host_check(cfg: Config) -> Callable[[str], bool]:
    """Whether a request's Host header names this endpoint: an IP address, ``localhost``,
    this machine's names, the bound address or one of ``ui_hosts``. A page that a
    rebinding DNS name points at this port gets no answer, because its Host is that name."""
    names = {"localhost", socket.gethostname().lower(), socket.getfqdn().lower(), cfg.addr.lower(),
             *(h.lower() for h in cfg.ui_hosts)}

    def ok(header: str) -> bool:
        host = header.strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[1:host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        if not host:
            return False
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            return host.rstrip(".") in names
    return ok


def history_json(views: Sequence[Any], query: str) -> bytes:
    """The data of one model (``model=``; the first one otherwise) for steps after ``since=``."""
    params = urllib.parse.parse_qs(query)
    wanted = params.get("model", [None])[0]
    since: Optional[int] = None
    try:
        since = int(params["since"][0]) if "since" in params else None
    except ValueError:
        since = None
    models = [{"model": v.labels.get("model", ""), "rank": v.labels.get("rank", "0"),
               "history": v.history is not None} for v in views]
    view = next((v for v in views if v.labels.get("model") == wanted), views[0] if views else None)
    doc: Dict[str, Any] = {"models": models, "time": time.time()}
    if view is not None:
        doc.update(_model(view, since))
    return _fit(doc)


def _model(view: Any, since: Optional[int]) -> Dict[str, Any]:
    s = view.snapshot
    gauges = {(g.spec.name, tuple(sorted(g.labels.items()))): dict(g.values) for g in s.layer_gauges}
    abs_max = gauges.get((M.ACTIVATION_ABS_MAX.name, ()), {})
    fp16 = gauges.get((M.FP16_RANGE_USED.name, (("tensor", M.TENSOR_ACTIVATION),)), {})
    worst = sorted(abs_max.items(), key=lambda kv: -_sortable(kv[1]))[:20]
    counts: Dict[str, float] = {}
    for tensor, _kind, count, _reduced in s.rank_nonfinite:
        counts[tensor] = counts.get(tensor, 0) + count
    return {
        "model": view.labels.get("model", ""), "rank": view.labels.get("rank", "0"),
        "world_size": view.info.get("world_size"), "state": view.run_state, "failure": view.failure,
        "step": s.global_step, "steps_total": s.steps_total, "global_norm": _finite(s.global_norm),
        "loss": _finite(s.loss), "learning_rates": [_finite(lr) for lr in s.learning_rates],
        "nonfinite_steps": s.nonfinite_steps, "nonfinite": counts,
        "origin": [{"tensor": t, "layer": layer, "step": step} for t, layer, step in s.nonfinite_origin],
        "guard": _guard(s),
        "activations": [{"layer": layer, "abs_max": _finite(v), "fp16_range_used": _finite(fp16.get(layer))}
                        for layer, v in worst],
        "history": view.history.document(since) if view.history is not None else None,
    }


def _guard(s: Any) -> Optional[Dict[str, Any]]:
    """The step guard's skips by reason and its latest skip; None without a guard."""
    if not s.guard_skipped_steps:
        return None
    last = s.guard_last_skip
    return {"skipped": dict(s.guard_skipped_steps), "last_step": last[1] if last else None,
            "last_reason": last[0] if last else None}


def _fit(doc: Dict[str, Any]) -> bytes:
    """JSON of at most MAX_RESPONSE bytes: the oldest heatmap columns go first."""
    body = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    heat = (doc.get("history") or {}).get("heatmap")
    while len(body) > MAX_RESPONSE and heat and heat["steps"]:
        keep = len(heat["steps"]) // 2
        heat["steps"], heat["log10"] = heat["steps"][-keep:] if keep else [], heat["log10"][-keep:] if keep else []
        body = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    return body


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and x == x and abs(x) != float("inf") else None


def _sortable(x: Optional[float]) -> float:
    return x if x is not None and x == x else -1.0
