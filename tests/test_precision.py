"""Mixed precision: fp16 with GradScaler (unscaled norms, skipped steps are not NaN
incidents) and bf16 autocast (issue 5)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import scrape, value


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.01),
                                      lambda ps: torch.optim.SGD(ps, lr=0.01, fused=True),
                                      lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)],
                         ids=["sgd", "fused-sgd", "fused-adamw"])
def test_fp16_gradscaler_norms_are_unscaled_and_overflow_skips_are_not_nonfinite(attach, make_opt):
    """An unfused optimizer is not stepped on overflow; a fused one is stepped with the
    scaler's flag and applies nothing: both are skips."""
    model = net()
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # overflows until it has halved enough
    mon = attach(model, scaler=scaler, detail_every=1, local_view=True)
    skipped = stepped = 0
    expected = None
    for _ in range(40):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(16, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # what a job that clips does; gradmon measured before this
        grads = [p.grad for p in model.parameters()]
        finite = all(torch.isfinite(g).all() for g in grads)
        if finite:
            expected = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped += 1
        else:
            stepped += 1
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert skipped >= 3 and stepped >= 10  # the scenario really exercised both paths
    assert value(s, "gradmon_amp_skipped_steps_total") == skipped
    assert value(s, "gradmon_steps_total") == stepped
    assert value(s, "gradmon_nonfinite_steps_total") == 0
    assert all(v == 0 for (n, _), v in s.items() if n == "gradmon_nonfinite_total")
    assert math.isclose(value(s, "gradmon_grad_global_norm"), expected, rel_tol=1e-4)
    # the local (pre-all-reduce) view is unscaled as well; one process: it equals the gradient
    assert math.isclose(value(s, "gradmon_local_grad_global_norm"), expected, rel_tol=1e-4)
    assert value(s, "gradmon_amp_loss_scale") == scaler.get_scale()
    # gradient flow is unscaled too: of the same order as the parameter gradients, not 1e9 larger
    assert value(s, "gradmon_grad_flow_norm", layer="4") < 1e3


def test_a_real_nan_under_a_scaler_is_still_reported_after_the_scale_collapses(attach):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    mon = attach(model, scaler=scaler)
    for _ in range(6):  # NaN every step: every step skipped, the scale collapses
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.full((2, 8), float("nan"))).float().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_amp_skipped_steps_total") == 6
    assert value(s, "gradmon_amp_loss_scale") == 2.0 ** 5  # the scale the last step used, before update() halved it


def test_bf16_autocast_activations_and_gradients(attach):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outs = {}
    model[2].register_forward_hook(lambda m, i, o: outs.__setitem__("2", o.detach()))
    mon = attach(model, detail_every=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    loss.backward()
    want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert outs["2"].dtype == torch.bfloat16
    assert math.isclose(value(s, "gradmon_activation_abs_max", layer="2"), outs["2"].float().abs().max().item(), rel_tol=1e-6)
    assert math.isclose(value(s, "gradmon_grad_global_norm"), want, rel_tol=1e-5)


def test_scaler_option_must_be_a_gradscaler():
    import gradmon
    with pytest.raises(ValueError, match="'scaler'"):
        gradmon.attach(net(), scaler=object())
