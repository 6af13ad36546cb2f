"""Issue 10 part 3: each layer's gradient norm and update-to-weight ratio over the median of
its own last N measurements, counted in steps in the process. Checked against the test's own
measurements of the same model (plain torch), not against numbers written down."""

from __future__ import annotations

import math
import statistics
from typing import List, Optional

import pytest
import torch
from torch import nn

from conftest import fresh, value
from gradmon import metrics as M
from gradmon import statistics as S

LAYER = "0"


def ratio(mon, spec: M.MetricSpec) -> Optional[float]:
    hits = [v for (n, ls), v in fresh(mon).items() if n == spec.name and ("layer", LAYER) in ls]
    return hits[0] if hits else None


def layer_norm(tensors) -> float:
    return math.sqrt(sum(t.double().square().sum().item() for t in tensors))


class Run:
    """A two-layer model under SGD; records, per step, layer 0's gradient norm and its
    ‖Δw‖/‖w_{t-1}‖ computed here from the weights before and after the step."""

    def __init__(self, lr: float = 0.05) -> None:
        torch.manual_seed(5)
        self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.norms: List[float] = []
        self.updates: List[float] = []

    def step(self, scale: float = 1.0, loss_scale: float = 1.0) -> None:
        params = list(self.model[0].parameters())
        (self.model(torch.randn(16, 8) * scale).square().mean() * loss_scale).backward()
        self.norms.append(layer_norm(p.grad for p in params))
        before = [p.detach().clone() for p in params]
        self.opt.step()
        self.updates.append(layer_norm(p.detach() - b for p, b in zip(params, before)) / layer_norm(before))
        self.opt.zero_grad(set_to_none=True)


def expected(values: List[float], window: int) -> float:
    return values[-1] / statistics.median(values[-window:])


def test_grad_norm_baseline_ratio_is_the_norm_over_the_median_of_its_own_last_steps(attach):
    run, window = Run(), 10
    mon = attach(run.model, norm_baseline=window, baseline_warmup=0)
    for i in range(S.MIN_BASELINE - 1):
        run.step()
        assert ratio(mon, M.GRAD_NORM_BASELINE_RATIO) is None, f"a ratio after {i + 1} measurements"
    for _ in range(window + 4):  # past the window: the oldest values roll out of the median
        run.step()
        got = ratio(mon, M.GRAD_NORM_BASELINE_RATIO)
        assert got == pytest.approx(expected(run.norms, window), rel=1e-5)
        assert 0.3 < got < 3.0  # healthy steps: near 1
    run.step(scale=40.0)  # the layer's gradient jumps: the ratio says by how much
    got = ratio(mon, M.GRAD_NORM_BASELINE_RATIO)
    assert got == pytest.approx(expected(run.norms, window), rel=1e-5) and got > 4


def steps_above(mon) -> Optional[float]:
    hits = [v for (n, ls), v in fresh(mon).items() if n == M.GRAD_NORM_ABOVE_BASELINE_STEPS.name]
    return hits[0] if hits else None


def expected_run(values: List[float], window: int, above: float = 4.0) -> int:
    """The steps in a row, up to the last, whose value was above ``above`` times the median
    of the last ``window`` values then (that one included; none before MIN_BASELINE)."""
    run = 0
    for j in range(len(values)):
        seen = values[max(0, j + 1 - window):j + 1]
        run = run + 1 if len(seen) >= S.MIN_BASELINE and values[j] > above * statistics.median(seen) else 0
    return run


def test_the_steps_a_layer_norm_stays_above_4x_its_baseline_are_counted_in_the_process(attach):
    """gradmon_grad_norm_above_baseline_steps counts sampled steps in a row with a layer's
    ratio above norm_baseline_ratio, from every step (here a scrape every step): the run
    grows with each step above, and a step back under ends it."""
    run, window = Run(lr=0.0), 10  # lr 0: the weights stay, so a loss scale scales the norm exactly
    mon = attach(run.model, norm_baseline=window, baseline_warmup=0)
    seen = []
    for scale in [1.0] * 12 + [20.0] * 4 + [1.0] * 2:
        run.step(loss_scale=scale)
        seen.append(steps_above(mon))
        assert seen[-1] == expected_run(run.norms, window), (len(seen), seen)
    # 4 of a window of 10 leave its median calm: each of them is 20x it, then a calm step ends the run
    assert seen[11:] == [0, 1, 2, 3, 4, 0, 0], seen


def test_steps_above_the_baseline_counted_between_scrapes_and_reset_by_a_learning_rate_jump(attach):
    """With no scrape between the steps, each step is still judged (against the median the
    next scrape reads); a learning-rate jump restarts the baselines and the run."""
    run, window = Run(lr=0.0), 10
    mon = attach(run.model, norm_baseline=window, baseline_warmup=0)
    for _ in range(12):
        run.step()
    mon.flush()
    fresh(mon)
    for _ in range(3):
        run.step(loss_scale=20.0)
    assert steps_above(mon) == 3
    for group in run.opt.param_groups:
        group["lr"] = 0.5  # a jump: the old median is no baseline for the new rate
    run.step(loss_scale=20.0)
    assert steps_above(mon) == 0


def test_the_first_baseline_warmup_steps_enter_no_baseline(attach):
    """A layer's norm in the first learning phase is no measure of its normal: the steps
    before ``baseline_warmup`` enter no median, so a norm 50x those steps is 1x its baseline."""
    run, window, warmup = Run(), 10, 20
    mon = attach(run.model, norm_baseline=window, baseline_warmup=warmup)
    for _ in range(warmup):
        run.step(loss_scale=0.02)  # an early phase of tiny gradients
    for i in range(S.MIN_BASELINE - 1):
        run.step()
        assert ratio(mon, M.GRAD_NORM_BASELINE_RATIO) is None, f"a ratio from {i + 1} steps past the warm-up"
    for _ in range(window + 2):
        run.step()
        got = ratio(mon, M.GRAD_NORM_BASELINE_RATIO)
        # the median of the steps after the warm-up alone (the window never reaches back into it)
        assert got == pytest.approx(expected(run.norms[warmup:], window), rel=1e-5)
        assert 0.3 < got < 3.0, "a norm 50x the warm-up's read as a jump"
    assert run.norms[warmup] > 10 * max(run.norms[:warmup])  # the early phase was that different


@pytest.mark.parametrize("bad", [-1, 1.5, "10"])
def test_a_baseline_warmup_that_is_not_a_step_count_is_refused(attach, bad):
    with pytest.raises((TypeError, ValueError), match="baseline_warmup"):
        attach(nn.Linear(2, 2), baseline_warmup=bad)


def test_update_ratio_baseline_ratio_is_the_update_ratio_over_the_median_of_its_own_readings(attach):
    run, window = Run(), 9
    mon = attach(run.model, optimizer_every=2, update_baseline=window, baseline_warmup=0)
    read: List[float] = []  # the readings gradmon takes: steps 1, 3, 5... (the first one included)
    for i in range(2 * (window + 6)):
        run.step(scale=40.0 if i == 2 * (window + 5) else 1.0)
        if i % 2 == 0:
            read.append(run.updates[-1])
        got = ratio(mon, M.UPDATE_RATIO_BASELINE_RATIO)
        if len(read) < S.MIN_BASELINE:
            assert got is None, f"a ratio after {len(read)} readings"
        else:
            assert got == pytest.approx(expected(read, window), rel=1e-4), i
    assert got > 5  # the last reading is the large step's


def test_both_baselines_restart_when_the_learning_rate_jumps_and_the_activation_ones_do_not(attach):
    run = Run(lr=0.05)
    mon = attach(run.model, norm_baseline=16, update_baseline=16, optimizer_every=1, detail_every=1,
                 baseline_warmup=0)
    for _ in range(12):
        run.step()
    assert ratio(mon, M.GRAD_NORM_BASELINE_RATIO) is not None
    assert ratio(mon, M.UPDATE_RATIO_BASELINE_RATIO) is not None
    for group in run.opt.param_groups:
        group["lr"] = 0.5  # a warm restart: 10x in one step
    jump = len(run.norms)
    for i in range(S.MIN_BASELINE - 1):
        run.step()
        # the old median would make the restart's 10x larger updates look like a blow-up
        assert ratio(mon, M.UPDATE_RATIO_BASELINE_RATIO) is None, i
        assert ratio(mon, M.GRAD_NORM_BASELINE_RATIO) is None, i
        assert ratio(mon, M.ACTIVATION_ABS_MAX_RATIO) is not None  # declared not to restart
    run.step()
    assert ratio(mon, M.GRAD_NORM_BASELINE_RATIO) == pytest.approx(expected(run.norms[jump:], 16), rel=1e-5)
    assert ratio(mon, M.UPDATE_RATIO_BASELINE_RATIO) == pytest.approx(expected(run.updates[jump:], 16), rel=1e-4)


def test_the_baseline_gauges_count_in_the_series_budget():
    for stat, spec in ((S.GRAD, M.GRAD_NORM_BASELINE_RATIO), (S.UPDATE_RATIO, M.UPDATE_RATIO_BASELINE_RATIO)):
        assert spec in [g.spec for g in stat.gauges]
        assert stat.series_per_layer == len(stat.gauges) + (len(M.NONFINITE_KINDS) if stat.counter else 0)


@pytest.mark.parametrize("option", ["norm_baseline", "update_baseline"])
def test_a_baseline_shorter_than_the_values_a_ratio_needs_is_refused(attach, option):
    with pytest.raises(ValueError, match=option):
        attach(nn.Linear(2, 2), **{option: S.MIN_BASELINE - 1})


def test_a_layer_jumping_far_outside_its_own_spread_counts_a_spike_step_between_scrapes(attach):
    """The jump is scored against the layer's own adaptive baseline and counted in the
    process at the step it happens: a scrape that comes after the next, ordinary step (when
    the gauge is back near 1) still sees it, and the steps since it say when it was."""
    run, warm = Run(), 40
    mon = attach(run.model, norm_baseline=10, spike_min_steps=32, baseline_warmup=0)

    def jumps() -> float:
        return value(fresh(mon), M.exposed_names(M.SPIKE_STEPS)[0], signal=M.SIGNAL_LAYER_GRAD_NORM)

    for _ in range(warm):
        run.step()
    assert jumps() == 0
    run.step(loss_scale=1.6)  # a bump within a few times the layers' own spread: no spike step
    assert jumps() == 0
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.step(loss_scale=1000.0)  # every gradient exactly 1000x what this batch gives
    assert expected(run.norms, 10) > 3.0
    assert value(fresh(mon), M.SPIKE_SCORE.name, signal=M.SIGNAL_LAYER_GRAD_NORM) > 6.0
    run.model.load_state_dict(weights)  # undo the huge update: the next step is an ordinary one
    run.step()  # the next step, before any scrape: the gauge has settled, the count stays
    assert ratio(mon, M.GRAD_NORM_BASELINE_RATIO) < 3.0
    assert jumps() == 1
    assert value(fresh(mon), M.STEPS_SINCE_SPIKE.name, signal=M.SIGNAL_LAYER_GRAD_NORM) == 1


def test_a_layer_jump_below_norm_jump_ratio_is_no_spike_however_quiet_the_layer(attach):
    """The ratio floor: a very quiet layer's 2x move is far outside its spread, yet below
    norm_jump_ratio it counts nothing."""
    run = Run()
    mon = attach(run.model, norm_jump_ratio=50.0, spike_min_steps=32)
    for _ in range(40):
        run.step()
    run.step(loss_scale=20.0)
    assert 3.0 < expected(run.norms, 10) < 50.0
    assert value(fresh(mon), M.exposed_names(M.SPIKE_STEPS)[0], signal=M.SIGNAL_LAYER_GRAD_NORM) == 0


def test_steps_above_the_baseline_are_judged_in_bounded_memory_when_nothing_scrapes():
    """A monitor whose gauges nobody reads still judges every step, holding at most
    ARRIVED_MAX values a layer (a folded statistic driven directly: no snapshot in between)."""
    from gradmon.aggregate.fold import ARRIVED_MAX, Folded
    folded = Folded(S.GRAD, 1, {"norm_baseline": 10}, None)
    gauge = next(g for g in S.GRAD.gauges if g.above is not None)
    norm = S.GRAD.index("norm")
    for i in range(10 * ARRIVED_MAX):
        columns = [0.0] * len(S.GRAD.columns)
        columns[norm] = (50.0 if i >= 10 * ARRIVED_MAX - 4 else 1.0 + 0.01 * (i % 7)) ** 2  # norms fold squared
        folded.update_gauges({0: columns})
        assert len(folded._arrived[gauge].get(0, ())) < ARRIVED_MAX
    assert folded.longest_streaks() == {M.GRAD_NORM_ABOVE_BASELINE_STEPS: 4}  # 4 of 10 leave the median calm


def test_a_lone_gradient_spike_is_counted_and_three_within_20_steps_are_a_burst(attach):
    """What the spike warnings read: steps since a burst (3 spike steps of a signal within 20
    steps), exported by a real monitor from real steps; one spike alone moves the spike count
    and the steps since a spike, and no burst."""
    run = Run()
    mon = attach(run.model, spike_min_steps=32, baseline_warmup=0)
    since, burst = M.STEPS_SINCE_SPIKE.name, M.STEPS_SINCE_SPIKE_BURST.name

    def spike() -> None:
        weights = {k: v.clone() for k, v in run.model.state_dict().items()}
        run.step(loss_scale=1000.0)  # every gradient 1000x: the global norm spikes
        run.model.load_state_dict(weights)  # and the huge update is undone

    for _ in range(40):
        run.step()
    spike()
    samples = fresh(mon)
    assert value(samples, since, signal=M.SIGNAL_GRAD_NORM) == 0
    with pytest.raises(KeyError):
        value(samples, burst, signal=M.SIGNAL_GRAD_NORM)
    for _ in range(30):  # the lone spike leaves the 20-step window
        run.step()
    spike()
    run.step()
    spike()
    with pytest.raises(KeyError):
        value(fresh(mon), burst, signal=M.SIGNAL_GRAD_NORM)  # two within 20 steps: still none
    run.step()
    spike()
    assert value(fresh(mon), burst, signal=M.SIGNAL_GRAD_NORM) == 0
    run.step()
    samples = fresh(mon)
    assert value(samples, burst, signal=M.SIGNAL_GRAD_NORM) == 1
    assert value(samples, M.exposed_names(M.SPIKE_STEPS)[0], signal=M.SIGNAL_GRAD_NORM) == 4
