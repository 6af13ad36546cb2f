"""Issue 23: the page is decided in the process, per step, and needs the loss to confirm it.

The pair of cases the issue asks for: the same gradient trace (one layer's norm at 10-11x its
baseline for 9 steps) under two loss traces. While the loss drops (a learning phase) the jump is
a warning and nothing pages; when the loss climbs after it, the divergence pages. The detector
is gradmon's own (``SpikeTracker`` scoring the layer, ``DivergenceWatch`` deciding), fed one
step at a time as the publisher feeds it."""

from __future__ import annotations

import math
import random
from typing import List, Optional, Tuple

import pytest

from gradmon import metrics as M
from gradmon.aggregate.divergence import (SIGNAL_LOSS_CREEP, SIGNAL_LOSS_SUSTAINED, SIGNAL_LOSS_UNRECOVERED,
                                          SIGNAL_LR_ABOVE_PEAK, SIGNAL_NONFINITE_LOSS, DivergenceSettings,
                                          DivergenceWatch)
from gradmon.aggregate.spikes import SpikeTracker

LAYER = M.SIGNAL_LAYER_GRAD_NORM
JUMP_AT, JUMP_STEPS = 300, 9


def gradient_trace(steps: int, seed: int = 0) -> List[float]:
    """One layer's norm: noise around 1, then 10-11x for 9 steps from JUMP_AT."""
    rng = random.Random(seed)
    out = [math.exp(rng.gauss(0.0, 0.15)) for _ in range(steps)]
    for i in range(JUMP_AT, JUMP_AT + JUMP_STEPS):
        out[i] = 10.0 + rng.random()
    return out


def noisy(level: float, rng: random.Random) -> float:
    return level * math.exp(rng.gauss(0.0, 0.1))


def learning_loss(steps: int) -> List[float]:
    """3.0 falling to 1.0, then a sudden drop to 0.3 while the layer jumps (a learning phase)."""
    rng = random.Random(1)
    return [noisy(1.0 + 2.0 * math.exp(-i / 60) if i < JUMP_AT else 0.3 + 0.7 * math.exp(-(i - JUMP_AT) / 5), rng)
            for i in range(steps)]


def diverging_loss(steps: int) -> List[float]:
    """The same descent to 1.0, then a climb to 3.0 over the 60 steps after the jump."""
    rng = random.Random(1)
    base = [1.0 + 2.0 * math.exp(-i / 60) for i in range(JUMP_AT + JUMP_STEPS)]
    climb = [min(3.0, 1.0 + 2.0 * (i + 1) / 60) for i in range(steps - len(base))]
    return [noisy(x, rng) for x in base + climb]


def run(losses: List[float], norms: List[Optional[float]], settings: DivergenceSettings = DivergenceSettings(),
        rates: Optional[List[Optional[float]]] = None) -> Tuple[List[int], List[int], DivergenceWatch]:
    """Per step: the steps since the layer's last spike (-1: none yet) and the divergence state.
    ``rates``: each step's learning rate over its settled peak (default: none settled)."""
    spikes = SpikeTracker((M.SIGNAL_LOSS, LAYER), layers={LAYER: 3.0})
    watch = DivergenceWatch(settings)
    since, diverging = [], []
    for step, (loss, norm, rate) in enumerate(zip(losses, norms, rates or [None] * len(losses)), start=1):
        spikes.new_step(step)
        spikes.observe(M.SIGNAL_LOSS, loss)
        if norm is not None:
            spikes.observe_layers(LAYER, [0], [norm])
        watch.step(loss, spikes.this_step, rate)
        since.append(spikes.steps_since().get(LAYER, -1))
        diverging.append(watch.diverging_steps)
    return since, diverging, watch


def test_a_layer_at_10x_for_9_steps_while_the_loss_drops_warns_and_never_pages():
    steps = 600
    since, diverging, watch = run(learning_loss(steps), gradient_trace(steps))
    assert 0 in since[JUMP_AT:JUMP_AT + JUMP_STEPS]  # the jump is seen: a warning
    assert max(since[:JUMP_AT]) == -1  # and nothing before it
    assert not any(diverging) and watch.divergences == 0


def test_the_same_gradient_trace_followed_by_a_climbing_loss_pages_with_the_jump_as_evidence():
    steps = 600
    since, diverging, watch = run(diverging_loss(steps), gradient_trace(steps))
    first = next(i for i, d in enumerate(diverging) if d)
    assert JUMP_AT + JUMP_STEPS < first < JUMP_AT + 60  # when the loss confirms it, not at the jump
    assert LAYER in watch.evidence and watch.divergences == 1
    assert all(diverging[first:])  # held while the loss stays up


def test_a_bad_batch_jumping_with_its_gradient_warns_and_does_not_page():
    """A healthy trend, then 8 steps whose loss and gradient jump together, then back."""
    rng = random.Random(2)
    losses = [noisy(0.4, rng) for _ in range(400)]
    norms: List[Optional[float]] = [math.exp(rng.gauss(0.0, 0.15)) for _ in range(400)]
    for i in range(300, 308):
        losses[i], norms[i] = 20.0, 15.0
    since, diverging, watch = run(losses, norms)
    assert since[300] == 0
    assert not any(diverging) and watch.divergences == 0


def test_a_bad_batch_on_a_trend_that_sits_above_its_luckiest_mean_does_not_page():
    """The best is the luckiest 20-step mean of the run; a noisy loss's trend sits well above
    it for long stretches. The climb is dated from the trend's own recent level, so the batch's
    jump is not read as a slow climb that began when the trend last wandered up."""
    rng = random.Random(4)
    losses = [0.5] * 60 + [noisy(0.65, rng) for _ in range(400)]  # the trend ~1.3x its best
    norms: List[Optional[float]] = [None] * len(losses)
    for i in range(400, 408):
        losses[i] = 20.0
    _, diverging, watch = run(losses, norms)
    assert not any(diverging) and watch.divergences == 0


def test_a_loss_that_jumps_like_a_bad_batch_and_stays_up_pages_once_sustained():
    """A 20-fold jump in one step (a bad batch's chance-level loss) that never comes back."""
    rng = random.Random(3)
    losses = [noisy(0.4, rng) for _ in range(300)] + [noisy(8.0, rng) for _ in range(200)]
    settings = DivergenceSettings()
    _, diverging, watch = run(losses, [None] * len(losses), settings)
    first = next(i for i, d in enumerate(diverging) if d)
    # the trend is at 2x at the jump or the step after; then sustain steps of it
    assert 300 + settings.sustain - 1 <= first <= 300 + settings.sustain
    assert watch.evidence == {SIGNAL_LOSS_SUSTAINED}


def test_a_loss_that_triples_at_once_is_a_jump_and_pages_only_once_sustained():
    """A 3-fold step from one loss to the next has no ramp: a bad batch's signature until it lasts."""
    losses = [1.0] * 100 + [3.0] * 150
    settings = DivergenceSettings()
    _, diverging, watch = run(losses, [None] * len(losses), settings)
    first = next(i for i, d in enumerate(diverging) if d)
    assert first == 100 + 10 - 1 + settings.sustain - 1  # the trend reaches 2x at 10 losses of 3 among 20
    assert watch.evidence == {SIGNAL_LOSS_SUSTAINED}


def test_a_loss_that_ramps_up_over_a_few_steps_pages_as_a_climb_when_the_trend_doubles():
    """The same rise to 3x over 8 steps (x1.15 a step): intermediate values, the model's way."""
    losses = [1.0] * 100 + [3.0 ** min(1.0, (i + 1) / 8) for i in range(50)]
    _, diverging, watch = run(losses, [None] * len(losses))
    first = next(i for i, d in enumerate(diverging) if d)
    trend = [sum(losses[max(0, i - 19):i + 1]) / 20 for i in range(len(losses))]
    assert first == next(i for i in range(100, len(losses)) if trend[i] >= 2.0)
    assert watch.evidence == {SIGNAL_LOSS_CREEP}


def test_a_jump_after_gradient_spikes_is_still_a_bad_batch():
    """Spikes in the 300 steps before a jump (a learning phase, say) do not make it a divergence."""
    rng = random.Random(5)
    losses = [noisy(0.5, rng) for _ in range(500)]
    norms: List[Optional[float]] = [math.exp(rng.gauss(0.0, 0.15)) for _ in range(500)]
    for i in range(250, 255):
        norms[i] = 20.0  # a gradient spike 150 steps before the batch
    for i in range(400, 408):
        losses[i] = 4.0  # 8x the level: chance for a model that learned
    since, diverging, watch = run(losses, norms)
    assert since[250] == 0
    assert not any(diverging) and watch.divergences == 0


def collapse(gradient_at: int, rates: Optional[List[Optional[float]]] = None) -> Tuple[List[int], DivergenceWatch]:
    """A model that learned (3.0 -> 0.5) and loses it in one step at step 401 (index 400): the
    loss back at its starting level for good, one layer's gradient at 20x on step ``gradient_at``
    (an index)."""
    rng = random.Random(6)
    losses = [3.0] * 20 + [noisy(0.5, rng) for _ in range(380)] + [noisy(3.0, rng) for _ in range(150)]
    norms: List[Optional[float]] = [math.exp(rng.gauss(0.0, 0.15)) for _ in losses]
    norms[gradient_at] = 20.0
    _, diverging, watch = run(losses, norms, rates=rates)
    return diverging, watch


def restart(at: int, factor: float, steps: int = 550) -> List[Optional[float]]:
    """A learning rate over its settled peak: 1 (settled) from index 150, rising linearly from
    index ``at`` to ``factor`` over 20 steps and held there."""
    return [None if i < 150 else 1.0 + (factor - 1.0) * min(1.0, max(0, i - at) / 20) for i in range(steps)]


def test_a_jump_to_the_starting_level_the_step_after_the_gradient_spiked_pages_on_the_jump():
    """An update that breaks the model: its gradient spikes while the loss is still ordinary and
    the next step's loss jumps. The gradients led, which a bad batch's cannot (its own loss is
    what pushes them): the jump's own step pages, with the gradient's signal as evidence."""
    diverging, watch = collapse(gradient_at=399)
    assert next(i for i, d in enumerate(diverging) if d) == 400
    assert LAYER in watch.evidence and watch.divergences == 1


@pytest.mark.parametrize("gradient_at", [400, 398])
def test_the_same_jump_with_the_gradient_on_its_own_step_or_two_before_it_pages_only_once_sustained(gradient_at):
    """The gradient spiking with the loss is a bad batch's signature; two steps before it, the
    loss in between did not follow: neither is evidence, and the jump pages once it lasts."""
    diverging, watch = collapse(gradient_at)
    assert next(i for i, d in enumerate(diverging) if d) > 400 + 50
    assert watch.evidence == {SIGNAL_LOSS_SUSTAINED}


def test_a_jump_while_the_learning_rate_is_above_its_settled_peak_pages_on_the_jump():
    """A schedule restarted past its peak, and the loss jumps back to its start 15 steps into
    the rise with its gradient on its own step (a bad batch's signature, were the rate flat):
    the rate is a cause in the schedule, not in the data, so the jump's own step pages."""
    diverging, watch = collapse(gradient_at=400, rates=restart(at=385, factor=10.0))
    assert next(i for i, d in enumerate(diverging) if d) == 400
    assert watch.evidence == {SIGNAL_LR_ABOVE_PEAK} and watch.divergences == 1


@pytest.mark.parametrize("rates", [restart(at=385, factor=1.4), [None] * 40 + [1.0] * 20 + [10.0] * 20 + [1.0] * 470],
                         ids=["below-the-bar", "too-long-before"])
def test_the_same_jump_after_a_rate_below_the_bar_or_long_before_pages_only_once_sustained(rates):
    """A rate 1.4x its peak is under ``lr_above_peak``; one above it that ended (settled: back
    to 1) more than ``evidence`` steps before the climb is no cause of it."""
    diverging, watch = collapse(gradient_at=400, rates=rates)
    assert next(i for i, d in enumerate(diverging) if d) > 400 + 50
    assert watch.evidence == {SIGNAL_LOSS_SUSTAINED}


def test_a_page_confirmed_by_one_loss_holds_while_the_trend_catches_up_one_divergence_not_two():
    """A loss back at the starting level confirms at once, while the trend (a 20-step mean)
    still reads settled: the page holds for the trend's window instead of clearing on the next
    step and paging again when the trend doubles."""
    rng = random.Random(7)
    losses = [2.0] * 20 + [noisy(0.5, rng) for _ in range(300)] + [2.0] + [0.6 * 1.1 ** i for i in range(40)]
    norms: List[Optional[float]] = [math.exp(rng.gauss(0.0, 0.15)) for _ in losses]
    norms[319] = 20.0  # the gradient led the loss: evidence
    _, diverging, watch = run(losses, norms)
    first = next(i for i, d in enumerate(diverging) if d)
    assert first == 320 and LAYER in watch.evidence
    assert all(diverging[first:]) and watch.divergences == 1


def test_a_loss_back_at_its_starting_level_after_a_ramp_pages_before_the_trend_doubles():
    """The model lost what it learned: a loss at the run's first mean after a ramp of many steps."""
    losses = [2.0] * 20 + [0.5] * 200 + [0.5 * 1.15 ** (i + 1) for i in range(10)] + [2.0] * 30
    _, diverging, watch = run(losses, [None] * len(losses))
    first = next(i for i, d in enumerate(diverging) if d)
    trend = [sum(losses[max(0, i - 19):i + 1]) / 20 for i in range(len(losses))]
    assert losses[first] >= 2.0 and trend[first] < 2 * 0.5
    assert watch.evidence == {SIGNAL_LOSS_CREEP}


def unrecovered(back_at: Optional[int]) -> Tuple[int, List[int], DivergenceWatch]:
    """A model that learned (3.0 -> 0.5), then a batch-like jump at index 400 to 2.2x its best,
    held 30 steps (the trend reaches 2x: diverged, with no evidence), then 1.6x its best: neither
    back below ``settled`` nor at ``diverged`` again; from index ``back_at`` (None: never) the
    loss is back at its best. Returns the first diverged step's index, the divergence state by
    step, and the watch."""
    rng = random.Random(7)
    losses = [3.0] * 20 + [noisy(0.5, rng) for _ in range(380)]
    losses += [noisy(1.1, rng) for _ in range(30)] + [noisy(0.8, rng) for _ in range(370)]
    if back_at is not None:
        losses[back_at:] = [noisy(0.5, rng) for _ in losses[back_at:]]
    _, diverging, watch = run(losses, [None] * len(losses))
    means = [sum(losses[i - 19:i + 1]) / 20 for i in range(19, len(losses))]
    best = [min(means[:k + 1]) for k in range(len(means))]
    first = next(k + 19 for k, (m, b) in enumerate(zip(means, best)) if m >= 2 * b and m - b >= 0.1)
    return first, diverging, watch


def test_a_trend_that_neither_recovers_nor_stays_diverged_pages_once_unrecovered():
    """A jump with no cause gradmon sees pages only once it lasts, and a trend that falls back
    between ``settled`` and ``diverged`` times its best never lasts at 2x: the run has not
    recovered ``unrecovered`` steps after it first diverged, and pages then."""
    first, diverging, watch = unrecovered(back_at=None)
    assert next(i for i, d in enumerate(diverging) if d) == first + DivergenceSettings().unrecovered - 1
    assert watch.evidence == {SIGNAL_LOSS_UNRECOVERED} and watch.divergences == 1


def test_the_same_trend_back_at_its_best_within_the_bound_never_pages():
    """The same jump and the same 1.6x, back at the best more than ``sustain`` steps after it
    first diverged, and soon enough for the trend to settle within ``unrecovered``: a spike that
    recovered, however slowly."""
    first, diverging, watch = unrecovered(back_at=560)
    assert DivergenceSettings().sustain < 560 - first < DivergenceSettings().unrecovered - 20
    assert not any(diverging) and watch.divergences == 0


def test_a_loss_creeping_up_over_many_steps_pages_without_any_spike():
    losses = [1.0] * 100 + [1.0 + i / 50 for i in range(100)] + [3.0] * 50
    _, diverging, watch = run(losses, [None] * len(losses))
    assert any(diverging) and SIGNAL_LOSS_CREEP in watch.evidence


def test_a_doubling_on_the_noise_floor_is_no_divergence():
    """0.002 against a best of 0.001: twice, but not loss_floor above it."""
    losses = [0.001] * 100 + [0.0025] * 200
    _, diverging, watch = run(losses, [None] * len(losses))
    assert not any(diverging)
    assert watch.rising_steps == 0  # nor a rising warning: half the floor is not reached either


def test_a_nonfinite_loss_pages_at_its_step():
    losses = [1.0] * 50 + [math.nan]
    _, diverging, watch = run(losses, [None] * len(losses))
    assert diverging[50] == 1 and watch.evidence == {SIGNAL_NONFINITE_LOSS}


def test_the_page_holds_until_the_trend_settles_and_counts_one_divergence():
    losses = [1.0] * 100 + [1.0 + i / 20 for i in range(40)] + [3.0] * 30 + [1.0] * 60
    _, diverging, watch = run(losses, [None] * len(losses))
    on = [i for i, d in enumerate(diverging) if d]
    assert on and on == list(range(on[0], on[-1] + 1))  # one unbroken stretch
    assert diverging[-1] == 0 and watch.divergences == 1


def test_a_rising_trend_warns_with_hysteresis():
    losses = [1.0] * 100 + [1.6] * 40 + [1.4] * 40 + [1.1] * 40
    watch = DivergenceWatch()
    rising = []
    for loss in losses:
        watch.step(loss)
        rising.append(watch.rising_steps)
    assert rising[99] == 0
    assert rising[139] > 0 and rising[179] > rising[139]  # 1.4x: below 1.5, still above 1.3
    assert rising[-1] == 0


def test_a_resumed_run_forgets_the_old_best():
    watch = DivergenceWatch()
    for _ in range(50):
        watch.step(0.1)
    watch.restart()
    for _ in range(50):
        watch.step(1.0)  # a new run's loss: no divergence from the old one's best
    assert watch.trend.best == pytest.approx(1.0) and watch.diverging_steps == 0


def test_settings_that_contradict_each_other_are_refused():
    with pytest.raises(ValueError):
        DivergenceSettings(rising=2.5)
    with pytest.raises(ValueError):
        DivergenceSettings(window=0)
