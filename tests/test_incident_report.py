"""``gradmon incident``: the summary, the HTML report in a real headless Chromium, and
bundles that are malformed or hostile (a bundle is a file from an untrusted run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gradmon.incidents import bundle as B
from gradmon.incidents import npz

import incident_worker as W
from browser import Browser, png_colors

GRADMON = [sys.executable, "-m", "gradmon"]


@pytest.fixture(scope="module")
def real_bundle(tmp_path_factory) -> Path:
    """A real run's bundle: NaN from torch.log in block 2 at step 40."""
    out = tmp_path_factory.mktemp("incidents")
    env = {**os.environ, "GRADMON_INCIDENT_DIR": str(out)}
    done = subprocess.run([sys.executable, str(Path(W.__file__)), "log", str(W.STEP + 2)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("*.npz")
    return path


def incident(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(GRADMON + ["incident", *args], capture_output=True, text=True, timeout=120, cwd=str(cwd),
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def rewritten(src: Path, dst: Path, change) -> Path:
    """``src`` with its JSON changed by ``change(meta)``, arrays kept."""
    b = B.load(str(src))
    change(b.meta)
    with open(dst, "wb") as f:
        npz.write(f, b.arrays, {B.JSON_MEMBER: json.dumps(b.meta).encode()})
    return dst


def test_the_summary_names_the_step_the_origin_block_and_the_history(real_bundle, tmp_path):
    out = incident(str(real_bundle), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"non-finite at step {W.STEP}" in out.stdout and "origin: block block2 on this rank" in out.stdout
    assert f"history: {W.STEP} steps (1..{W.STEP})" in out.stdout and "8 given" in out.stdout


def test_a_directory_stands_for_its_newest_bundle(real_bundle, tmp_path):
    out = incident(str(real_bundle.parent), cwd=tmp_path)
    assert out.returncode == 0 and str(real_bundle) in out.stdout


def test_the_report_is_one_file_that_asks_the_network_for_nothing(real_bundle, tmp_path):
    out = incident(str(real_bundle), "--html", "r.html", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    assert "default-src 'none'" in page
    for external in ("src=", "href=", "http://", "https://", "@import", "url("):
        assert external not in page


def test_the_report_draws_the_norm_loss_and_heatmap_with_the_incident_marked_in_chromium(real_bundle, tmp_path):
    assert incident(str(real_bundle), "--html", "r.html", cwd=tmp_path).returncode == 0
    browser = Browser()
    try:
        browser.open((tmp_path / "r.html").as_uri())
        browser.until("document.body && document.body.dataset.ready === '1'")
        assert browser.evaluate("document.getElementById('norm').dataset.marked") == str(W.STEP - 1)
        assert int(browser.evaluate("document.getElementById('heatmap').dataset.columns")) == W.STEP
        summary = browser.evaluate("document.getElementById('summary').textContent")
        assert f"non-finite at step {W.STEP}" in summary and "block2" in summary
        assert f"rows: {W.ROW} (id r0-s{W.STEP}-n{W.ROW}) at block2" in summary
        # the incident's column is NaN in every layer whose gradient it reached: magenta pixels at the right edge
        magenta = browser.evaluate(
            "(() => { const c = document.getElementById('heatmap'); const x = c.width - 2;"
            " const p = c.getContext('2d').getImageData(x, 0, 1, c.height).data; let n = 0;"
            " for (let i = 0; i < p.length; i += 4) if (p[i] === 255 && p[i+1] === 0 && p[i+2] === 255) n++;"
            " return n; })()")
        assert magenta > 0
        assert png_colors(browser.screenshot(scale=0.25)) > 20
        assert browser.errors == [], browser.errors
    finally:
        browser.close()


def test_names_from_a_hostile_bundle_are_text_on_the_page_and_escaped_on_the_terminal(real_bundle, tmp_path):
    evil = '</script><script>window.pwned=1</script><img src=x onerror="window.pwned=2">\x1b[2J\u202e'

    def change(meta):
        meta["run"]["model"] = evil
        meta["incident"]["block"] = evil
        meta["history"]["layers"][0] = evil
    path = rewritten(real_bundle, tmp_path / "evil.npz", change)
    out = incident(str(path), "--html", "evil.html", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\\x1b[2J" in out.stdout and "\\u202e" in out.stdout
    browser = Browser()
    try:
        browser.open((tmp_path / "evil.html").as_uri())
        browser.until("document.body && document.body.dataset.ready === '1'")
        assert browser.evaluate("window.pwned === undefined")
        assert browser.evaluate("document.querySelectorAll('img').length") == 0
        assert "<img src=x" in browser.evaluate("document.getElementById('layers').textContent")
        assert "<img src=x" in browser.evaluate("document.title")
    finally:
        browser.close()


def _zip(path: Path, members: dict) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _npy(descr: str, shape: tuple, body: bytes, fortran: bool = False) -> bytes:
    header = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode()
    header += b" " * (118 - len(header)) + b"\n"
    return npz.MAGIC + len(header).to_bytes(2, "little") + header + body


MALFORMED = {
    "not a zip": lambda d, real: (d / "x.npz").write_bytes(b"hello") or d / "x.npz",
    "truncated": lambda d, real: (d / "x.npz").write_bytes(real.read_bytes()[:3000]) or d / "x.npz",
    "no json": lambda d, real: _zip(d / "x.npz", {"history.step.npy": _npy("<i8", (1,), bytes(8))}),
    "json not json": lambda d, real: _zip(d / "x.npz", {B.JSON_MEMBER: b"{nope"}),
    "another schema": lambda d, real: _zip(d / "x.npz", {B.JSON_MEMBER: b'{"schema": "other"}'}),
    "a later version": lambda d, real: rewritten(real, d / "x.npz", lambda m: m.update(schema_version=99)),
    "step not a number": lambda d, real: rewritten(real, d / "x.npz", lambda m: m["incident"].update(step="40")),
    "fields missing": lambda d, real: rewritten(real, d / "x.npz", lambda m: m.pop("history")),
    "a pickled array": lambda d, real: _zip(d / "x.npz", {B.JSON_MEMBER: B.dumps({"schema": B.SCHEMA}),
                                                        "a.npy": _npy("|O", (1,), b"\x80\x04N.")}),
    "fortran order": lambda d, real: _zip(d / "x.npz", {"a.npy": _npy("<f4", (1,), bytes(4), fortran=True)}),
    "shape past its bytes": lambda d, real: _zip(d / "x.npz", {"a.npy": _npy("<f4", (10 ** 6,), bytes(4))}),
    "header is code": lambda d, real: _zip(d / "x.npz", {"a.npy": npz.MAGIC + b"\x20\x00" + b"__import__('os')" + b" " * 15 + b"\n"}),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_bundle_is_refused_cleanly_with_a_nonzero_status(real_bundle, tmp_path, kind):
    path = MALFORMED[kind](tmp_path, real_bundle)
    out = incident(str(path), cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("gradmon incident: ") and "Traceback" not in out.stderr
    assert not list(tmp_path.glob("*.html"))


def test_a_missing_file_is_refused_cleanly(tmp_path):
    out = incident(str(tmp_path / "nothing.npz"), cwd=tmp_path)
    assert out.returncode == 2 and "cannot read it" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("world, says", [(1, "origin: no block: the forward stayed finite"),
                                         (2, "origin: not on this rank")])
def test_a_finite_forward_is_blamed_on_the_backward_alone_in_a_one_rank_job(real_bundle, tmp_path, world, says):
    def finite_forward(meta: dict) -> None:
        meta["incident"]["origin_here"] = False
        meta["run"]["world_size"] = world

    out = incident(str(rewritten(real_bundle, tmp_path / "b.npz", finite_forward)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert says in out.stdout
