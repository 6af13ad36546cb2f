"""The spike detector on synthetic series: what a healthy run never trips, what a one-step
spike always does, and when the window starts over."""

from __future__ import annotations

import math
import random

import pytest

from gradmon.aggregate.spikes import SpikeDetector, SpikeTracker, lr_jumped


def _warmup_cosine(t: int, steps: int = 2000, warmup: int = 100) -> float:
    if t < warmup:
        return t / warmup
    return 0.5 * (1 + math.cos(math.pi * (t - warmup) / (steps - warmup)))


def healthy_loss(steps: int = 2000, noise: float = 0.1, seed: int = 0):
    """A pretraining-like loss: flat while the learning rate warms up from 0, a fast fall,
    then a slow one, with 10 % multiplicative noise per step (heavier than most runs)."""
    rng = random.Random(seed)
    progress = 0.0
    for t in range(steps):
        progress += _warmup_cosine(t, steps)
        yield (2.0 + 8.0 * math.exp(-progress / 150)) * math.exp(rng.gauss(0, noise))


def run(detector: SpikeDetector, series):
    """Every step's verdict (None where not scored)."""
    return [detector.update(v) for v in series]


def spikes(verdicts):
    return [i for i, v in enumerate(verdicts) if v is not None and v.spike]


def test_a_healthy_noisy_decreasing_loss_with_warmup_has_no_spike():
    verdicts = run(SpikeDetector(), healthy_loss())
    assert spikes(verdicts) == []
    assert sum(v is not None for v in verdicts) == 2000 - 32  # scored from the 33rd step on


def test_a_one_step_3x_spike_is_counted_once_and_scores_above_the_threshold():
    series = list(healthy_loss())
    series[1000] *= 3
    verdicts = run(SpikeDetector(), series)
    assert spikes(verdicts) == [1000]
    assert verdicts[1000].score > 6.0


def test_the_score_is_the_distance_from_the_median_in_robust_standard_deviations():
    # no trend; residuals +-0.1 around 0 in ln units: MAD 0.1, scale 1.4826 * 0.1
    d = SpikeDetector(min_steps=32)
    run(d, [math.exp(0.1 if i % 2 else -0.1) for i in range(32)])
    verdict = d.update(3.0)
    assert verdict.score == pytest.approx(math.log(3.0) / (1.4826 * 0.1), rel=1e-9)
    assert verdict.spike


def test_the_score_is_measured_from_the_trend_extrapolated_to_this_step():
    # exactly exponential growth, 2 % a step: residuals all equal, so the scale is the floor;
    # this step lies 0.2 (ln units) above the line continued to it
    d = SpikeDetector()
    run(d, [math.exp(0.02 * i) for i in range(40)])
    assert d.update(math.exp(0.02 * 40 + 0.2)).score == pytest.approx(0.2 / 0.05, rel=1e-9)
    d = SpikeDetector()
    run(d, [math.exp(-0.02 * i) for i in range(40)])  # falling: the same, mirrored
    assert d.update(math.exp(-0.02 * 40 + 0.2)).score == pytest.approx(0.2 / 0.05, rel=1e-9)


def test_a_quiet_series_is_scored_against_the_floor_not_its_tiny_spread():
    d = SpikeDetector()
    run(d, [1.0 + 1e-6 * (i % 2) for i in range(40)])
    assert d.update(1.1).score == pytest.approx(math.log(1.1) / 0.05, rel=1e-3)  # 1.9: not a spike


def test_a_high_score_below_twice_the_median_is_not_a_spike():
    d = SpikeDetector()
    run(d, [1.0] * 40)
    verdict = d.update(1.9)  # score ln(1.9)/0.05 = 12.8 > 6, but not 2x the median
    assert verdict.score > 6 and not verdict.spike
    assert d.update(2.1).spike


def test_a_spike_in_the_first_31_steps_is_not_scored():
    series = [1.0 + 0.01 * (i % 3) for i in range(40)]
    series[30] = 100.0
    verdicts = run(SpikeDetector(), series)
    assert verdicts[:32] == [None] * 32 and spikes(verdicts) == []
    assert verdicts[32] is not None  # the 33rd step has 32 earlier ones in its window


def test_a_steady_upward_trend_is_not_a_spike():
    # a norm that grows 2.5 % a step: 25x over one window, 3.6x its median at the window's end
    rng = random.Random(1)
    series = [math.exp(t / 40 + rng.gauss(0, 0.02)) for t in range(400)]
    verdicts = run(SpikeDetector(), series)
    assert spikes(verdicts) == []
    assert max(v.score for v in verdicts if v is not None) < 6
    # a spike on top of the trend still is one
    series[300] *= 3
    assert spikes(run(SpikeDetector(), series)) == [300]


def test_non_finite_values_never_enter_the_window_nor_crash():
    d = SpikeDetector()
    run(d, [1.0] * 20)
    assert run(d, [math.nan, math.inf, -math.inf]) == [None] * 3
    assert len(d) == 20  # none of them entered
    run(d, [1.0] * 12)
    assert d.update(math.nan) is None
    assert not d.update(1.0).spike


def test_zero_and_negative_values_are_skipped_on_a_norm_and_scored_raw_on_a_loss():
    norm = SpikeDetector()
    assert run(norm, [0.0, -1.0]) == [None, None] and len(norm) == 0
    loss = SpikeDetector(raw_below_zero=True)
    run(loss, [1.0] * 10 + [-0.5 + 0.01 * (i % 2) for i in range(40)])
    assert not loss.log_scale and len(loss) == 40  # the positive start was dropped with the switch
    verdict = loss.update(2.0)
    # raw units: residuals +-0.005 around -0.495, scale floored at 0.05 loss units
    assert verdict.score == pytest.approx((2.0 + 0.495) / 0.05, rel=1e-6) and verdict.spike


def test_the_detector_refuses_a_window_too_short_to_score():
    with pytest.raises(ValueError):
        SpikeDetector(min_steps=3)
    with pytest.raises(ValueError):
        SpikeDetector(window=16, min_steps=32)


# -- restarts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prev, cur, jumped", [
    (0.0, 1e-6, True),  # warm-up starts from 0
    (1e-6, 2e-6, False),  # 2x exactly: a linear warm-up's second step
    (3e-4, 3.1e-4, False),
    (3e-4, 3e-5, True),  # a step decay by 10x
    (3e-4, 7e-4, True),
    (3e-4, 0.0, True),
    (0.0, 0.0, False),
])
def test_lr_jumped(prev, cur, jumped):
    assert lr_jumped(prev, cur) is jumped


def _tracker_with_window(values: int = 40) -> SpikeTracker:
    tracker = SpikeTracker(("loss",))
    for step in range(1, values + 1):
        tracker.new_step(step, (1e-3,))
        tracker.observe("loss", 1.0 + 0.01 * (step % 2))
    return tracker


def test_the_window_restarts_on_a_learning_rate_jump():
    tracker = _tracker_with_window()
    tracker.new_step(41, (1e-2,))
    tracker.observe("loss", 5.0)  # the first value at the new rate: no baseline to be a spike against
    assert tracker.restarts == 1 and len(tracker.detectors["loss"]) == 1 and tracker.spikes["loss"] == 0
    # a rate that changes smoothly, or one kept as a device tensor (None), does not restart it
    tracker = _tracker_with_window()
    tracker.new_step(41, (1.1e-3,))
    tracker.new_step(42, (None,))
    tracker.new_step(43, (1e-2,))
    assert tracker.restarts == 0


@pytest.mark.parametrize("step", [10, 40 + 129], ids=["backwards", "jump_past_the_window"])
def test_the_window_restarts_on_resume(step):
    tracker = _tracker_with_window()
    tracker.new_step(step, (1e-3,))
    assert tracker.restarts == 1 and len(tracker.detectors["loss"]) == 0
    tracker = _tracker_with_window()
    tracker.new_step(40 + 128, (1e-3,))  # steps not seen, within one window: the same run
    tracker.new_step(40 + 128, (1e-3,))  # a step the GradScaler skipped repeats its number
    assert tracker.restarts == 0


def test_the_tracker_counts_spike_steps_per_signal():
    tracker = SpikeTracker(("loss", "grad_norm"))
    for step, value in enumerate(list(healthy_loss(200))):
        tracker.new_step(step)
        tracker.observe("loss", value * (3 if step == 150 else 1))
        tracker.observe("grad_norm", 1.0)
        tracker.observe("not_a_signal", 1.0)
    assert tracker.spikes == {"loss": 1, "grad_norm": 0}
    assert set(tracker.scores) == {"loss", "grad_norm"}


@pytest.mark.parametrize("spiked, bursts", [
    ((150,), ()),  # a lone spike: counted, no burst
    ((150, 165), ()),  # two within the window
    ((150, 160, 169), (169,)),  # the third within 20 steps (150..169) makes one
    ((150, 160, 170), ()),  # the first has left the window when the third comes
    ((150, 151, 152, 153, 180), (152, 153)),  # each spike step with two more in the window
])
def test_a_burst_is_a_spike_step_with_two_more_of_its_signal_in_the_last_20_steps(spiked, bursts):
    tracker = SpikeTracker(("grad_norm", "loss"))
    seen = []
    for step in range(200):
        tracker.new_step(step)
        tracker.observe("grad_norm", 10.0 if step in spiked else 1.0 + 0.01 * (step % 7))
        tracker.observe("loss", 3.0 if step == 151 else 1.0 + 0.01 * (step % 5))  # another signal's spike
        if tracker.steps_since_burst().get("grad_norm") == 0:
            seen.append(step)
    assert tracker.spikes["grad_norm"] == len(spiked)
    assert tuple(seen) == bursts
    assert "loss" not in tracker.steps_since_burst()  # one spike of its own: no burst
    if bursts:
        assert tracker.steps_since_burst()["grad_norm"] == 199 - bursts[-1]


def _eager(window, y, log_scale):
    """The verdict as robust.score gives it on tensors, every step (the definition)."""
    import torch
    from gradmon import robust
    score, above = robust.score(torch.tensor(window, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                robust.LOG_FLOOR, log_scale)
    return score.item(), score.item() > 6.0 and bool(above)


@pytest.mark.parametrize("raw", [False, True])
def test_a_judged_step_decides_as_the_tensor_score_does_and_scores_only_when_read(raw, monkeypatch):
    """The publisher's spike decision skips the tensor score for a value not above the
    window's median; the decision, and the score when read, equal the definition's, also
    for values on the median + ln 2 edge and one rounding above it; a healthy step never
    computes it before it is read."""
    import copy
    from gradmon import robust
    rng = random.Random(1)
    calls = []
    score = robust.score
    monkeypatch.setattr(robust, "score", lambda *a: calls.append(1) or score(*a))
    d = SpikeDetector(raw_below_zero=raw)
    if raw:
        d.update(-1.0)  # from now on a raw-scale series
    series = [rng.uniform(1.0, 1.5) for _ in range(200)]
    series[120] *= 4.0  # a spike
    edges = 0
    for i, v in enumerate(series):
        window, log_scale = tuple(d._values), d.log_scale
        probes = [v]
        if len(window) >= d.min_steps:
            s = sorted(window)
            mid = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
            edge = mid + (math.log(2.0) if log_scale else abs(mid))
            probes += [math.exp(y) if log_scale else y for y in (edge, math.nextafter(edge, math.inf))]
        for k, probe in reversed(list(enumerate(probes))):  # the real value last: it enters the window
            before = len(calls)
            judged = (d if k == 0 else copy.deepcopy(d)).judge(probe)
            scored = len(calls) > before
            if judged is None:
                continue
            expected_score, expected_spike = _eager(window, math.log(probe) if log_scale else probe, log_scale)
            assert judged.spike == expected_spike
            if k == 0 and i != 120:
                assert not scored  # a healthy value: no tensor score until read
            edges += k > 0 and scored
            assert judged.score == expected_score
    assert edges > 0 and len(calls) > 0


def test_the_tracker_scores_a_signal_when_its_score_is_read():
    from gradmon import robust
    t = SpikeTracker(["norm"])
    for step, v in enumerate(healthy_loss(100)):
        t.new_step(step)
        t.observe("norm", v)
    judged = t._scores["norm"]
    assert not isinstance(judged, float)
    assert t.scores["norm"] == judged.score and isinstance(t._scores["norm"], float)


def _baseline_reference(values, window, min_steps, threshold, min_ratio):
    """The per-layer baseline's recurrence as its docstring states it, one value at a time."""
    alpha, state, out = 2.0 / (window + 1), None, []
    for v in values:
        if not (math.isfinite(v) and v > 0):
            out.append(None)
            continue
        y = math.log(v)
        if state is None:
            state = [1.0, y, 0.0]
            out.append(None)
            continue
        n, mean, dev = state
        scale = max(1.4826 * dev, 0.05)
        verdict, clipped = None, y
        if n >= min_steps:
            score = max(0.0, (y - mean) / scale)
            verdict = (score, score > threshold and y - mean >= math.log(min_ratio))
            clipped = min(max(y, mean - 3.0 * scale), mean + 3.0 * scale)
        rate = max(alpha, 1.0 / (n + 1))
        state = [n + 1, mean + rate * (clipped - mean), dev + rate * (abs(clipped - mean) - dev)]
        out.append(verdict)
    return out


def test_every_layer_of_a_step_updated_at_once_matches_the_recurrence_one_layer_at_a_time():
    from gradmon.aggregate.spikes import LayerBaselines

    rng = random.Random(3)
    layers, steps = 7, 400
    series = [[rng.choice([math.nan, math.inf, -1.0, 0.0]) if rng.random() < 0.03 else
               math.exp(rng.gauss(0, 0.3)) * (40.0 if rng.random() < 0.02 else 1.0) for _ in range(steps)]
              for _ in range(layers)]
    given = [[t for t in range(steps) if (k + t) % 5] for k in range(layers)]  # no value at some steps
    expected = [dict(zip(given[k], _baseline_reference([series[k][t] for t in given[k]], 32, 8, 6.0, 3.0)))
                for k in range(layers)]
    baselines = LayerBaselines(window=32, min_steps=8, threshold=6.0, min_ratio=3.0)
    spikes = 0
    for t in range(steps):
        present = [k for k in range(layers) if (k + t) % 5]
        got = baselines.update_many(present, [series[k][t] for k in present])
        scored = [expected[k][t] for k in present if expected[k][t] is not None]
        assert (got.score, got.spike) == (max(s for s, _ in scored), any(p for _, p in scored)) if scored \
            else got is None, t
        spikes += bool(got and got.spike)
    assert spikes > 0  # the sequence does reach the spike branch


def test_a_burst_counts_steps_not_calls():
    """Two attention layers reaching a doubling on one step are one event step of the signal."""
    tracker = SpikeTracker(("attention_growth",))
    for step in range(10):
        tracker.new_step(step)
        if step == 2:
            tracker.event("attention_growth")
            tracker.event("attention_growth")
        if step == 5:
            tracker.event("attention_growth")
    assert tracker.steps_since() == {"attention_growth": 4}
    assert tracker.steps_since_burst() == {}
