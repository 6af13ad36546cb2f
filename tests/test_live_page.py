"""The live page (issue 11, part 1): in a real headless Chromium against a real demo, and its
data, limits and security headers against a real endpoint."""

from __future__ import annotations

import http.client
import json
import math
import re
import time
import types
from pathlib import Path

import pytest
import torch

from browser import Browser, png_colors
from conftest import scrape, sgd_steps, tiny, value
from gradmon.aggregate import history as H
from gradmon.serve import ui
from gradmon.serve.server import UI_BURST, UI_RATE
from gradmon.aggregate import Snapshot
from servers import free_port, running_demo

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "gradmon" / "serve" / "static"
REFRESH_S = 2.0


def get(port: int, path: str, host: str = "127.0.0.1", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Host": host, **(headers or {})})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), body


@pytest.mark.slow
def test_the_page_in_a_real_browser_draws_every_layer_and_shows_a_nan_within_two_refreshes(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_demo(port, "--steps", "0", "--step-delay", "0.03", "--fault", "nan@600"):
        deadline = time.monotonic() + 60
        while True:
            try:
                s = scrape(url + "/metrics")
                if value(s, "gradmon_steps_total") >= 20:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the demo did not start"
            time.sleep(0.3)
        assert value(s, "gradmon_nonfinite_steps_total") == 0, "the page must be open before the NaN"
        layers = {dict(k[1])["layer"] for k in s if k[0] == "gradmon_grad_norm"}
        browser = Browser()
        try:
            browser.open(url + "/")
            browser.until("document.body.dataset.step && document.getElementById('rows').children.length > 0")
            names = browser.evaluate("[...document.querySelectorAll('#rows li')].map(li => li.textContent)")
            assert len(names) == len(layers) and set(names) == layers  # one heatmap row per layer
            assert int(browser.evaluate("document.getElementById('heatmap').dataset.columns")) > 0
            assert "started in" not in browser.evaluate("document.getElementById('nonfinite').textContent")
            # the same page, left open: the NaN the demo injects at step 600 shows within two refreshes
            deadline = time.monotonic() + 90
            while value(scrape(url + "/metrics"), "gradmon_nonfinite_steps_total") == 0:
                assert time.monotonic() < deadline, "the demo's NaN never came"
                time.sleep(0.1)
            seen_at = time.monotonic()
            browser.until("document.getElementById('nonfinite').textContent.includes('started in')",
                          timeout=2 * REFRESH_S + 1.5)
            shown = browser.evaluate("document.getElementById('nonfinite').textContent")
            assert "blocks.1.fc2 at step 600" in shown, shown
            assert time.monotonic() - seen_at <= 2 * REFRESH_S + 1.5
            assert png_colors(browser.screenshot(scale=0.25)) > 50  # drawn, not a blank page
            assert browser.errors == [], browser.errors  # no console error, no uncaught exception
        finally:
            browser.close()


def test_the_page_is_small_self_contained_and_writes_names_as_text():
    total = sum(p.stat().st_size for p in STATIC.iterdir())
    assert total < 300_000
    html = (STATIC / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", html) and "style=" not in html  # nothing inline (CSP)
    assert not re.search(r"(src|href)=\"(https?:)?//", html)  # no CDN, no external font
    js = (STATIC / "app.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", js)
    assert "textContent" in js


def test_the_endpoint_serves_the_page_with_its_headers_and_answers_only_its_own_host_names(attach):
    m = tiny()
    mon = attach(m, port=0, addr="127.0.0.1", ui_hosts=("trainer.internal",))
    sgd_steps(m, 12)
    mon.flush()
    status, headers, body = get(mon.port, "/")
    assert status == 200 and b"app.js" in body and headers["Content-Type"].startswith("text/html")
    assert headers["Content-Security-Policy"] == "default-src 'self'; frame-ancestors 'none'"
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, headers, body = get(mon.port, "/api/history?since=5", host=f"localhost:{mon.port}")
    doc = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert doc["model"] == "sequential" and doc["history"]["steps"] == list(range(6, 13))
    assert doc["history"]["heatmap"]["rows"] == ["0", "2"]
    assert len(doc["history"]["global_norm"]) == 7 and all(v > 0 for v in doc["history"]["global_norm"])
    assert get(mon.port, "/", host="trainer.internal")[0] == 200
    for host in ("evil.example", f"evil.example:{mon.port}", ""):  # a rebinding name: no answer
        status, _, body = get(mon.port, "/api/history", host=host)
        assert status == 421 and b"sequential" not in body, host
    assert get(mon.port, "/metrics", host="evil.example")[0] == 200  # Prometheus' scrapes are unaffected


def test_the_page_is_behind_basic_auth_rate_limited_and_can_be_turned_off(attach):
    import base64
    m = tiny()
    mon = attach(m, port=0, addr="127.0.0.1", basic_auth_user="u", basic_auth_password="p")
    assert get(mon.port, "/")[0] == 401 and get(mon.port, "/api/history")[0] == 401
    auth = {"Authorization": "Basic " + base64.b64encode(b"u:p").decode()}
    codes = [get(mon.port, "/api/history", headers=auth)[0] for _ in range(12)]
    assert codes[0] == 200 and 429 in codes  # a burst of a page load, then 2 requests a second
    status, headers, _ = get(mon.port, "/api/history", headers=auth)
    assert status == 429 and headers["Retry-After"] == "1"
    assert get(mon.port, "/metrics", headers=auth)[0] == 200  # never at the scrapes' expense
    off = tiny()
    mon2 = attach(off, port=free_port(), addr="127.0.0.1", ui=False, name="off")
    assert get(mon2.port, "/api/history")[0] == 404 and get(mon2.port, "/app.js")[0] == 404
    status, _, body = get(mon2.port, "/")
    assert status == 200 and body == b"gradmon: metrics at /metrics\n"
    assert mon2._history is None


def test_history_is_bounded_decimated_and_fits_one_megabyte():
    layers = [f"blocks.{i}.mlp" for i in range(1000)]
    hist = H.History(layers, 2000)
    assert hist.capacity == 2000 and len(hist.rows) == H.MAX_ROWS
    big = H.History([f"l{i}" for i in range(10_000)], 2000)
    assert big.capacity * 4 * (10_000 + 6) <= H.MAX_BYTES  # many layers keep fewer steps
    for step in range(1, 2001):
        hist.record(step, 1.0 + step, 2.0, 1e-3, step == 777, {i: float(i + 1) for i in range(1000)})
    doc = hist.document()
    assert doc["steps"] == list(range(1, 2001)) and doc["nonfinite"][776] == 1.0
    heat = doc["heatmap"]
    assert heat["every"] == 4 and len(heat["steps"]) == 500 and all(len(col) == H.MAX_ROWS for col in heat["log10"])
    # a band of layers shows its largest norm: the last band holds layers 997..1000 (norms up to 1000)
    assert heat["log10"][0][-1] == 3.0
    view = types.SimpleNamespace(labels={"model": "big", "rank": "0"}, snapshot=Snapshot(), info={"world_size": "1"},
                                 run_state="training", failure=None, history=hist)
    body = ui.history_json([view], "")
    assert len(body) <= ui.MAX_RESPONSE
    assert json.loads(body)["history"]["steps"][-1] == 2000
    later = json.loads(ui.history_json([view], "since=1990"))["history"]
    assert later["steps"] == list(range(1991, 2001)) and later["heatmap"]["steps"] == [1993, 1997]  # every 4th kept


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
def test_steps_the_gradscaler_skipped_are_marked_in_the_history(attach, fused):
    """A skipped step gets its own row, flagged and without a norm, numbered after the step
    before it; the next applied step follows (steps only increase, so ``since`` still cuts)."""
    import math

    import torch

    m = tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    mon = attach(m, port=0, addr="127.0.0.1", scaler=scaler)
    for step in range(1, 6):
        loss = m(torch.randn(3, 4)).pow(2).mean()
        scaler.scale(loss * (math.inf if step == 3 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.flush()
    h = json.loads(get(mon.port, "/api/history")[2])["history"]
    assert h["skipped"] == [0, 0, 1, 0, 0] and h["nonfinite"] == [0, 0, 0, 0, 0]
    assert h["global_norm"][2] is None and all(v > 0 for i, v in enumerate(h["global_norm"]) if i != 2)
    assert all(b > a for a, b in zip(h["steps"], h["steps"][1:])) and h["steps"][:2] == [1, 2]
    later = json.loads(get(mon.port, f"/api/history?since={h['steps'][2]}")[2])["history"]
    assert later["steps"] == h["steps"][3:] and later["skipped"] == [0, 0]
    assert value(scrape(mon.url), "gradmon_amp_skipped_steps_total") == 1


def test_ranks_without_per_layer_series_keep_no_history(monkeypatch, attach):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    m = tiny()
    mon = attach(m, port=0, addr="127.0.0.1", local_view=True)
    sgd_steps(m, 3)
    mon.flush()
    doc = json.loads(get(mon.port, "/api/history")[2])
    assert mon._history is None and doc["history"] is None and doc["rank"] == "1"


def test_the_window_is_built_once_per_step_whatever_the_number_of_requests(monkeypatch):
    hist = H.History(["a", "b"], 100)
    builds = []
    real = hist._window
    monkeypatch.setattr(hist, "_window", lambda: builds.append(1) or real())
    for step in range(1, 11):
        hist.record(step, 1.0, 1.0, 0.1, False, {0: 1.0, 1: 2.0})
    docs = [hist.document(since) for since in (None, 3, 7, 9, None)]
    assert len(builds) == 1
    assert [d["steps"] for d in docs[1:4]] == [list(range(4, 11)), [8, 9, 10], [10]]
    hist.record(11, 1.0, 1.0, 0.1, False, {0: 1.0})
    assert hist.document(10)["steps"] == [11] and len(builds) == 2


def test_several_models_on_one_endpoint_are_listed_and_chosen_by_name(attach):
    gen, disc = tiny(), tiny()
    mon = attach(gen, port=0, addr="127.0.0.1", name="generator")
    other = attach(disc, port=0, addr="127.0.0.1", name="discriminator")  # port=0 twice: one endpoint
    sgd_steps(gen, 4)
    sgd_steps(disc, 2)
    mon.flush()
    other.flush()
    doc = json.loads(get(mon.port, "/api/history?model=discriminator")[2])
    assert {m["model"] for m in doc["models"]} == {"generator", "discriminator"}  # the page's selector
    assert doc["model"] == "discriminator" and doc["history"]["steps"] == [1, 2]
    assert json.loads(get(mon.port, "/api/history?model=generator", headers={})[2])["history"]["steps"] == [1, 2, 3, 4]


def test_the_pages_files_are_cacheable_and_outside_the_rate_limit(attach):
    mon = attach(tiny())
    status, headers, _ = get(mon.port, "/app.js")
    assert status == 200 and headers["Cache-Control"] == "no-cache" and headers["ETag"].startswith('"')
    assert headers["Content-Security-Policy"] == "default-src 'self'; frame-ancestors 'none'"
    status, again, body = get(mon.port, "/app.js", headers={"If-None-Match": headers["ETag"]})
    assert status == 304 and body == b"" and again["ETag"] == headers["ETag"]  # the cached copy is current
    files = [get(mon.port, path)[0] for _ in range(10) for path in ("/", "/app.js", "/app.css", "/favicon.svg")]
    assert set(files) == {200}
    # forty file requests took nothing from the data's own allowance: a page load's burst is left
    assert [get(mon.port, "/api/history")[0] for _ in range(UI_BURST)] == [200] * UI_BURST
    assert get(mon.port, "/api/history")[1]["Cache-Control"] == "no-store"  # the data is never cached


# Every text the status line shows that is a failure (red) or names a 429, kept across reloads.
RECORD_BANNERS = """
document.addEventListener("DOMContentLoaded", () => {
  const status = document.getElementById("status");
  new MutationObserver(() => {
    if (status.classList.contains("bad") || status.textContent.includes("429")) {
      sessionStorage.setItem("banners", (sessionStorage.getItem("banners") || "") + status.textContent + "\\n");
    }
  }).observe(status, {childList: true, characterData: true, subtree: true, attributes: true});
});
"""


@pytest.mark.slow
def test_reloading_the_page_again_and_again_never_shows_a_rate_limit_banner(attach):
    m = tiny()
    mon = attach(m)
    sgd_steps(m, 5)
    mon.flush()
    browser = Browser()
    try:
        browser.on_every_document(RECORD_BANNERS)
        browser.open(f"http://127.0.0.1:{mon.port}/")
        browser.until("document.body.dataset.step")
        started = time.monotonic()
        for _ in range(3 * UI_BURST):  # faster than the data's rate: some data requests meet its limit
            browser.evaluate("window.before = true")
            browser.reload()
            browser.until("!window.before && document.body && document.body.dataset.step === '5'")
        assert time.monotonic() - started < 3 * UI_BURST / UI_RATE, "the reloads were not quick"
        assert browser.evaluate("sessionStorage.getItem('banners')") is None
        assert "read at" in browser.evaluate("document.getElementById('status').textContent")
    finally:
        browser.close()


class Branchy(torch.nn.Module):
    """Three layers; ``b`` runs on odd steps only, so on even steps it has no gradient norm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) if use_b else h)


@pytest.mark.slow
def test_nonfinite_heatmap_cells_are_drawn_apart_from_cells_without_a_value(attach):
    torch.manual_seed(0)
    model = Branchy()
    mon = attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = [0]
    model.a.weight.register_hook(lambda g: g * math.nan if step[0] == 4 else g)
    for step[0] in range(1, 7):
        model(torch.randn(3, 4), use_b=step[0] % 2 == 1).pow(2).mean().backward()
        for p in model.parameters():  # the job's own guard: the weights stay finite
            if p.grad is not None:
                torch.nan_to_num_(p.grad, nan=0.0)
        opt.step()
        opt.zero_grad()
    mon.flush()
    heat = json.loads(get(mon.port, "/api/history")[2])["history"]["heatmap"]
    rows, column = heat["rows"], heat["steps"].index(4)
    assert heat["log10"][column][rows.index("a")] == H.NONFINITE
    assert heat["log10"][column][rows.index("b")] is None
    browser = Browser()
    try:
        browser.open(f"http://127.0.0.1:{mon.port}/")
        browser.until("document.getElementById('heatmap').dataset.columns === '6'")

        def cell(layer: str) -> list:
            return browser.evaluate(f"""(() => {{
                const c = document.getElementById('heatmap');
                const x = Math.floor(({column} + 0.5) * c.width / 6), y = Math.floor(({rows.index(layer)} + 0.5) * c.height / 3);
                return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }})()""")

        def legend(swatch: str) -> "tuple[list, str]":
            color = browser.evaluate(f"getComputedStyle(document.getElementById('{swatch}')).backgroundColor")
            label = browser.evaluate(f"document.getElementById('{swatch}').nextElementSibling.textContent")
            return [int(v) for v in re.findall(r"\d+", color)[:3]], label

        nonfinite, no_value = legend("nonfinitecell"), legend("novalue")
        assert nonfinite[1] == "NaN/Inf" and no_value[1] == "no value"
        assert nonfinite[0] != no_value[0]
        assert cell("a") == nonfinite[0]  # a's NaN norm at step 4
        assert cell("b") == no_value[0]  # b did not run at step 4
        assert cell("c") not in (nonfinite[0], no_value[0])  # a finite norm: a colour of the ramp
        assert browser.errors == [], browser.errors
    finally:
        browser.close()


@pytest.mark.parametrize("layers", [3, 600], ids=["a-row-a-layer", "bands-of-layers"])
def test_a_nonfinite_norm_is_kept_apart_from_a_layer_without_a_value(layers):
    hist = H.History([f"l{i}" for i in range(layers)], 10)
    hist.record(1, math.nan, 1.0, 0.1, True, {0: math.nan, 1: 100.0})  # the last layer: no value
    hist.record(2, math.inf, 1.0, 0.1, True, {0: math.inf, 1: 100.0})
    for column in hist.document()["heatmap"]["log10"]:
        assert column[0] == H.NONFINITE and column[-1] is None
        assert layers > H.MAX_ROWS or column[1] == 2.0


@pytest.mark.slow
def test_a_page_left_open_while_the_heatmap_columns_are_spaced_anew_keeps_each_step_once(attach):
    m = tiny()
    mon = attach(m)
    sgd_steps(m, H.MAX_COLUMNS - 50)
    mon.flush()
    browser = Browser()
    try:
        browser.open(f"http://127.0.0.1:{mon.port}/")
        browser.until(f"document.body.dataset.step === '{H.MAX_COLUMNS - 50}'")
        sgd_steps(m, 100)  # past MAX_COLUMNS: every second step is a column from now on
        mon.flush()
        browser.until(f"document.body.dataset.step === '{H.MAX_COLUMNS + 50}'", timeout=3 * REFRESH_S + 2)
        browser.until(f"document.getElementById('heatmap').dataset.columns === '{(H.MAX_COLUMNS + 50) // 2}'",
                      timeout=3 * REFRESH_S + 2)
        assert browser.evaluate("document.body.dataset.kept") == str(H.MAX_COLUMNS + 50)
    finally:
        browser.close()


def test_a_nonfinite_norm_on_a_step_between_decimated_columns_still_shows_in_its_column():
    hist = H.History(["a", "b"], 2000)
    for step in range(1, 1201):  # 1,200 steps: every third step is a column
        hist.record(step, 1.0, 1.0, 0.1, step == 701, {0: math.nan if step == 701 else 1.0, 1: 1.0})
    heat = hist.document()["heatmap"]
    assert heat["every"] == 3 and 701 not in heat["steps"]
    column = max(i for i, s in enumerate(heat["steps"]) if s < 701)  # the column whose stride holds step 701
    assert heat["log10"][column] == [H.NONFINITE, 0.0]
    assert sum(col[0] == H.NONFINITE for col in heat["log10"]) == 1 and all(col[1] == 0.0 for col in heat["log10"])


def guard_steps(model: torch.nn.Module, steps: int, bad_steps) -> None:
    """``steps`` SGD steps of ``tiny()`` (numbered from 1), a NaN in the batch of each of ``bad_steps``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        x = torch.randn(3, 4)
        if step in bad_steps:
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


HOSTILE = '<img src=x onerror="window.pwned=1">'


@pytest.mark.slow
def test_the_guards_skips_show_by_reason_with_the_latest_step_written_as_text(attach):
    m = tiny()
    mon = attach(m, guard="nonfinite", incident_dir="", name=HOSTILE)
    guard_steps(m, 9, bad_steps=(4, 7))
    mon.flush()
    doc = json.loads(get(mon.port, "/api/history")[2])
    assert doc["guard"] == {"skipped": {"nonfinite": 2},
                            "last_step": 7, "last_reason": "nonfinite"}
    browser = Browser()
    try:
        browser.open(f"http://127.0.0.1:{mon.port}/")
        browser.until("document.getElementById('guard') !== null")
        shown = browser.evaluate("document.getElementById('guard').textContent")
        assert shown == "steps skipped by the guard 2 (nonfinite 2), latest at step 7: nonfinite", shown
        assert browser.evaluate("document.querySelector('#guard b').className") == "bad"
        facts = browser.evaluate("document.getElementById('facts').textContent")
        assert "model " + HOSTILE in facts  # the name as text, not markup
        assert browser.evaluate("document.querySelectorAll('img').length") == 0
        assert browser.evaluate("window.pwned === undefined")
        assert browser.errors == [], browser.errors
    finally:
        browser.close()


def test_without_a_guard_the_page_shows_no_skips(attach):
    m = tiny()
    mon = attach(m)
    sgd_steps(m, 2)
    mon.flush()
    assert json.loads(get(mon.port, "/api/history")[2])["guard"] is None
