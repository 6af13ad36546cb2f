"""monitor.observe(loss=...) and in-process spike detection, end to end: a real training
loop, the real packet, a real scrape."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import fresh, value

SPIKE_STEPS = "gradmon_spike_steps_total"


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class Regression:
    """A fixed noisy linear target: gradient norms that stay within tens of percent."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.w = torch.randn(8, 1, generator=g)
        self.g = g

    def batch(self, n: int = 64):
        x = torch.randn(n, 8, generator=self.g)
        return x, x @ self.w + 0.1 * torch.randn(n, 1, generator=self.g)


def test_gradmon_loss_is_the_mean_of_the_steps_micro_batch_losses(attach):
    model, data = net(), Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    means = []
    for _ in range(3):
        losses = []
        for _micro in range(2):
            x, y = data.batch(16)
            loss = nn.functional.mse_loss(model(x), y)
            (loss / 2).backward()
            mon.observe(loss=loss)
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        means.append(sum(losses) / 2)
    s = fresh(mon)
    assert value(s, "gradmon_loss") == pytest.approx(means[-1], rel=1e-6)
    assert value(s, "gradmon_loss_running_min") == pytest.approx(min(means), rel=1e-6)


def test_the_running_minimum_is_the_lowest_step_mean_so_far(attach):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model)
    for losses in ((3.0, 5.0), (1.0, 2.0), (2.0, 2.5)):  # step means 4, 1.5, 2.25
        for loss in losses:
            mon.observe(loss=loss)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    s = fresh(mon)
    assert value(s, "gradmon_loss") == 2.25 and value(s, "gradmon_loss_running_min") == 1.5


def test_a_loss_observed_before_a_step_goes_into_that_step_numbers_too(attach):
    model, data = net(), Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    assert "gradmon_loss" not in {n for n, _ in fresh(mon)}  # nothing observed yet: no sample
    mon.observe(loss=2.5)  # before any forward: a plain number
    x, y = data.batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    mon.observe(loss=loss)
    mon.observe(loss=torch.tensor([0.5], dtype=torch.float64))  # one element, any dtype
    opt.step()
    assert value(fresh(mon), "gradmon_loss") == pytest.approx((2.5 + loss.item() + 0.5) / 3, rel=1e-6)
    mon.observe(loss=7.0)  # after the step: the next step's
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert value(fresh(mon), "gradmon_loss") == 7.0


def test_bad_input_is_counted_never_raised(attach):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    mon.observe(loss="0.3")  # type: ignore[arg-type]
    mon.observe(loss=torch.ones(4))  # a per-sample loss, not reduced
    mon.observe(loss=1.5)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    s = fresh(mon)
    assert value(s, "gradmon_hook_errors_total", stage="observe") == 2
    assert value(s, "gradmon_loss") == 1.5  # the bad ones left the good one alone


def test_a_non_finite_loss_is_exported_but_never_the_running_minimum(attach):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model)
    for loss in (3.0, -math.inf, math.nan):
        mon.observe(loss=loss)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    s = fresh(mon)
    assert math.isnan(value(s, "gradmon_loss"))
    assert value(s, "gradmon_loss_running_min") == 3.0


def test_spike_counters_exist_at_zero_from_attach_for_the_signals_that_apply(attach):
    s = fresh(attach(net()))
    assert {dict(k)["signal"]: v for (n, k), v in s.items() if n == SPIKE_STEPS} == {
        "loss": 0, "grad_norm": 0, "layer_grad_norm": 0}
    assert not [n for n, _ in s if n == "gradmon_spike_score"]  # nothing scored yet
    s = fresh(attach(nn.Linear(2, 2), local_view=True, name="local"))
    assert {dict(k)["signal"] for (n, k), v in s.items() if n == SPIKE_STEPS} == {
        "loss", "grad_norm", "local_grad_norm", "layer_grad_norm"}


def train(mon, steps: int, spike_at: int = -1, lr_from: int = -1):
    """SGD with clipping, as large jobs run: a 1000x loss on one step is a 1000x
    pre-clip gradient norm (what gradmon measures), and a clipped update."""
    model, data = mon._test_model, Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    norms = []
    for step in range(steps):
        if step == lr_from:
            opt.param_groups[0]["lr"] = 0.1
        x, y = data.batch()
        loss = nn.functional.mse_loss(model(x), y) * (1e3 if step == spike_at else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
    return norms


def _attached(attach, **options):
    model = net()
    mon = attach(model, **options)
    mon._test_model = model
    return mon


def test_a_one_step_gradient_spike_between_two_scrapes_is_counted_exactly_once(attach):
    mon = _attached(attach)
    norms = train(mon, 60, spike_at=40)
    median = sorted(norms[:40])[20]
    assert norms[40] > 100 * median and max(norms[41:]) < 2 * median  # one spike, and only one
    s = fresh(mon)  # the only scrape, 19 steps after the spike
    assert value(s, SPIKE_STEPS, signal="grad_norm") == 1
    assert value(s, SPIKE_STEPS, signal="loss") == 1
    assert value(s, "gradmon_spike_score", signal="grad_norm") < 6  # the gauge alone would have missed it


def test_the_same_run_without_the_spike_counts_none(attach):
    mon = _attached(attach)
    train(mon, 60)
    s = fresh(mon)
    assert value(s, SPIKE_STEPS, signal="grad_norm") == 0 and value(s, SPIKE_STEPS, signal="loss") == 0
    assert 0 <= value(s, "gradmon_spike_score", signal="loss") < 6


def test_a_learning_rate_jump_restarts_the_windows(attach):
    # 40 steps at 0.01, then 0.1 from step 40 on: the spike at step 41 has no baseline yet
    mon = _attached(attach)
    train(mon, 60, spike_at=41, lr_from=40)
    s = fresh(mon)
    assert value(s, SPIKE_STEPS, signal="grad_norm") == 0 and value(s, SPIKE_STEPS, signal="loss") == 0


def test_spike_counts_continue_across_detach_and_attach_under_the_same_name(attach):
    mon = _attached(attach, name="run")
    train(mon, 45, spike_at=40)
    mon.detach()
    mon = _attached(attach, name="run")
    assert value(fresh(mon), SPIKE_STEPS, signal="grad_norm") == 1


def test_a_step_the_gradscaler_skipped_still_carries_its_loss_and_scale(attach):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # overflows until it has halved enough
    mon = attach(model, scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    mon.observe(loss=loss)
    scaler.step(opt)
    scaler.update()
    s = fresh(mon)
    assert value(s, "gradmon_amp_skipped_steps_total") == 1 and scaler.get_scale() < 2.0 ** 40
    assert value(s, "gradmon_amp_loss_scale") == 2.0 ** 40  # the scale its backward ran under
    assert value(s, "gradmon_loss") == pytest.approx(loss.item(), rel=1e-6)


def test_a_reduced_norm_is_scored_only_where_this_rank_exports_the_reduced_series():
    from gradmon import statistics as S
    from gradmon.config import Config
    enabled = S.enabled(Config(), local_view=True)
    assert S.spike_signals(enabled, reduced_here=True) == ("loss", "grad_norm", "local_grad_norm", "layer_grad_norm")
    # DDP/FSDP rank > 0: the same reduced norm (and per-layer norms) as rank 0's, so one
    # spike is counted once per job
    assert S.spike_signals(enabled, reduced_here=False) == ("loss", "local_grad_norm")
    assert S.spike_signals(S.enabled(Config(), local_view=False), reduced_here=False) == ("loss",)


@pytest.mark.parametrize("options", [dict(spike_min_steps=200), dict(spike_min_steps=3), dict(spike_threshold=0.0),
                                     dict(spike_window=2)])
def test_spike_options_out_of_range_are_refused_at_attach(options):
    from gradmon.config import Config
    with pytest.raises(ValueError, match="spike_"):
        Config(**options)


def test_spike_options_come_from_the_environment():
    from gradmon.config import resolve
    cfg = resolve({}, {"GRADMON_SPIKE_THRESHOLD": "4.5", "GRADMON_SPIKE_WINDOW": "64", "GRADMON_SPIKE_MIN_STEPS": "16"})
    assert (cfg.spike_threshold, cfg.spike_window, cfg.spike_min_steps) == (4.5, 64, 16)
