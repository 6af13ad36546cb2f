"""Issue 10 part 3: real unstable and healthy training runs, recorded scrape by scrape
(bench/instability/record.py), and the replay of expositions through the rules with promtool at a
stated mapping (bench/instability/replay.py: 6 steps a minute, a 15 s scrape and rule interval).

These recordings hold what was scraped in 2026-11, before the divergence was decided in the
process (issue 23): they carry none of its series, so the rules are no longer judged on them.
The rules are scored on the alert corpus instead (tests/test_alert_corpus.py, bench/instability/score.py),
which holds the packets and replays them through gradmon's current code."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest

from gradmon import alerting
from servers import binary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "instability"))
import replay  # noqa: E402
import scenario  # noqa: E402

RECORDINGS = sorted(replay.DATA.glob("*.json.gz"))


def synthetic(steps: int, series: dict) -> dict:
    """A recording in the recorder's layout: per series, one value per recorded index (0 is the
    scrape right after attach, n the one after step n)."""
    target = 'model="copy", rank="0"'
    return {"run": {"name": "synthetic", "warmup": 100}, "losses": [1.0] * steps,
            "series": {f"{name}{{{labels + ', ' if labels else ''}{target}}}": values
                       for (name, labels), values in series.items()}}


def test_the_replay_reads_back_when_each_alert_fired_at_the_mapped_time(tmp_path):
    """An independent computation of when promtool must fire: the first scrape that sees the
    step (scrapes every 15 s, step n done at n x 10 s), plus the rule's ``for``. An off-by-one
    step in the mapping moves a time by 15 s and fails."""
    promtool = binary("promtool")
    steps, explode_at, vanish_at, nan_at = 400, 151, 181, 301

    def switch(at: int, before: float, after: float) -> list:
        return [None] + [after if i >= at else before for i in range(1, steps + 1)]

    rec = synthetic(steps, {
        ("gradmon_steps_total", ""): [float(i) for i in range(steps + 1)],
        ("gradmon_grad_global_norm", ""): switch(explode_at, 1.0, 5000.0),
        ("gradmon_grad_norm", 'layer="head"'): switch(vanish_at, 0.1, 1e-9),
        ("gradmon_grad_norm", 'layer="embed"'): switch(steps + 1, 0.1, 0.1),
        ("gradmon_nonfinite_total", 'kind="nan", layer="embed", tensor="grad"'): [0.0] + switch(nan_at, 0.0, 1.0)[1:],
    })
    path = tmp_path / "synthetic.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(rec, f)
    fired = {f.alertname: f for f in replay.evaluate(path, promtool).fired}
    timing = alerting.PRODUCTION

    def seen(step: int) -> float:
        return math.ceil(step * 10 / 15) * 15

    assert set(fired) == {"GradmonGradientExplosion", "GradmonVanishingGradients", "GradmonNonFiniteGradients"}
    assert fired["GradmonGradientExplosion"].first_s == seen(explode_at) + timing.explode_for
    assert fired["GradmonVanishingGradients"].first_s == seen(vanish_at) + timing.vanish_for
    assert fired["GradmonNonFiniteGradients"].first_s == seen(nan_at)
    assert fired["GradmonVanishingGradients"].severity == "warning"
    assert all(f.onsets == 1 for f in fired.values())


def test_divergence_point_is_the_first_step_of_20_above_twice_the_running_minimum():
    rising = [3.0, 2.0, 1.0] + [1.5] * 30 + [2.5] * 25
    assert scenario.divergence_point(rising) == 34  # 1.5 is not above 2 x 1.0; 2.5 is, from step 34
    assert scenario.divergence_point([3.0, 2.0, 1.0] + [2.5] * 19 + [1.0]) is None  # 19 steps recover
    assert scenario.divergence_point([3.0, 1.0, 1.0, float("nan")]) == 4


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name.split(".")[0])
def test_a_recording_is_what_gradmon_exported_after_every_step(path):
    """The loss gradmon exported after step n is the loss the loop computed at step n (4 digits),
    and the unstable setup really diverges while the healthy one does not."""
    rec = replay.load(path)
    losses = rec["losses"]
    exported = next(v for k, v in rec["series"].items() if k.startswith("gradmon_loss{"))
    steps = next(v for k, v in rec["series"].items() if k.startswith("gradmon_steps_total{"))
    assert len(exported) == len(steps) == len(losses) + 1 == rec["setup"]["steps"] + 1
    assert steps == [float(i) for i in range(len(losses) + 1)]
    for mine, theirs in zip(losses, exported[1:]):
        assert theirs == pytest.approx(mine, rel=1e-3) or (math.isnan(mine) and math.isnan(theirs))
    diverged = scenario.divergence_point(losses) is not None
    assert diverged == (rec["run"]["warmup"] == 0), "the scenario no longer does what it claims"
