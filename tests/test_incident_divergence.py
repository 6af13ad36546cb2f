"""A bundle at a confirmed loss divergence (the in-process page, ``gradmon_loss_divergences_total``):
a real model whose learning rate climbs past what it bears, on the CPU."""

from __future__ import annotations

from typing import Dict, List

import pytest

import gradmon
from gradmon.incidents import bundle as B

import incident_worker as W
from conftest import fresh, value

STEPS = 80


@pytest.fixture(scope="module")
def diverged(tmp_path_factory) -> Dict[str, object]:
    """One run: the divergence counter and the bundles on disk, seen after every step."""
    out = tmp_path_factory.mktemp("divergence")
    model = W.TinyTransformer()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, announce=False,
                         incident_dir=str(out))
    seen: List[tuple] = []

    def after(step: int) -> None:
        if step > W.DIVERGE_FROM:  # scraped once it can diverge: the healthy steps are the files' check
            seen.append((step, value(fresh(mon), "gradmon_loss_divergences_total"), sorted(out.glob("*.npz"))))
        else:
            assert mon.flush()
            seen.append((step, None, sorted(out.glob("*.npz"))))

    try:
        W.train_diverging(mon, model, STEPS, after)
    finally:
        mon.detach()
    return {"seen": seen, "files": sorted(out.glob("*.npz")), "dir": out}


def test_a_confirmed_divergence_writes_one_bundle_on_the_step_it_is_counted(diverged):
    seen = diverged["seen"]
    paged = next(step for step, count, _ in seen if count)
    assert paged > W.DIVERGE_FROM + 5  # the loss climbed for some steps first: no page at the LR's first jump
    (path,) = diverged["files"]
    b = B.load(str(path))
    assert b.meta["kind"] == "divergence" and b.meta["incident"]["step"] == paged
    # on disk once /metrics counts it, never before: the healthy steps wrote nothing
    assert all(files == [path] for step, count, files in seen if count)
    assert all(files == [] for step, count, files in seen if not count)


def test_the_divergence_bundle_says_why_it_was_written(diverged):
    meta = B.load(str(diverged["files"][0])).meta
    reason = meta["reason"]
    assert reason["kind"] == "divergence" and reason["evidence"]
    # the loss had left its best: the trend, a mean of the last losses, stands above it
    assert reason["trend"] > reason["best"] > 0 and reason["ratio"] == pytest.approx(reason["trend"] / reason["best"])
    assert meta["history"]["present"] and meta["rows"]["known"] is False


def test_gradmon_incident_prints_the_divergence_and_its_evidence(diverged, tmp_path):
    path = diverged["files"][0]
    meta = B.load(str(path)).meta
    text = W.summary(str(path), tmp_path)
    assert f"loss divergence confirmed at step {meta['incident']['step']}" in text
    assert "evidence: " + ", ".join(meta["reason"]["evidence"]) in text


def test_the_html_report_of_a_divergence_says_so_in_its_title(diverged):
    from gradmon.incidents import report
    b = B.load(str(diverged["files"][0]))
    assert f"<title>gradmon incident (divergence): tinytransformer rank 0 step {b.meta['incident']['step']}" in report.page(b)
