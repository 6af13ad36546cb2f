"""Training setups users really run (issue 5): checkpointing, torch.compile, several
optimizers, schedulers, modules added later."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradmon
from conftest import scrape, value


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(6, 12)
        self.block = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
        self.out = nn.Linear(12, 2)

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_measures_each_forward_once(attach, reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ref = {}
    def reference(m, i, o):  # the first (original or only) forward of block.0
        if "rms" not in ref:
            ref["rms"] = o.detach().double().pow(2).mean().sqrt().item()

    model.block[0].register_forward_hook(reference)
    mon = attach(model, detail_every=1)
    x = torch.randn(4, 6, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    model(x).sum().backward()
    calls = mon._recorder._rec.by_name["activation"].keys()
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    index = {name: i for i, name in enumerate(mon.layers)}
    assert calls.count(index["block.0"]) == 1 and calls.count(index["inp"]) == 1  # recomputation not counted twice
    assert math.isclose(value(s, "gradmon_activation_rms", layer="block.0"), ref["rms"], rel_tol=1e-5)
    assert value(s, "gradmon_grad_flow_norm", layer="block.2") > 0


def test_torch_compile_after_attach_stays_compiled_and_reports_gradients(attach, caplog):
    from torch._dynamo.utils import counters
    torch.manual_seed(1)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=3)
    compiled = torch.compile(model, backend="aot_eager")
    counters.clear()
    norms = []
    for _ in range(20):
        compiled(torch.randn(4, 8)).pow(2).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item())
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert counters["stats"]["unique_graphs"] <= 2
    assert not counters["recompiles"] and "recompile_limit" not in str(dict(counters["frames"]))
    assert value(s, "gradmon_steps_total") == 20
    assert math.isclose(value(s, "gradmon_grad_global_norm"), norms[-1], rel_tol=1e-5)  # pre-clip, under compile
    assert "under torch.compile" in caplog.text


def test_attaching_to_an_already_compiled_module(attach):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(compiled)
    assert mon.layers == ("0", "2")  # names of the module inside, not "_orig_mod.0"
    for _ in range(3):
        compiled(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.flush()
    assert value(scrape(mon.url), "gradmon_steps_total") == 3


def test_two_optimizers_over_parts_of_one_model_count_one_step(attach):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.01)
    opt_b = torch.optim.Adam(model[1].parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    mon = attach(model)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
        opt_a.step()
        opt_b.step()
        sched.step()
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total") == 3
    assert math.isclose(value(s, "gradmon_grad_global_norm"), want, rel_tol=1e-5)


def test_an_optimizer_of_another_model_is_ignored(attach):
    mine, other = nn.Linear(3, 3), nn.Linear(3, 3)
    mon = attach(mine)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.randn(1, 3)).sum().backward()
    opt.step()
    mon.flush()
    assert value(scrape(mon.url), "gradmon_steps_total") == 0


def test_modules_added_after_attach_are_not_monitored_until_reattached(attach):
    model = nn.Sequential(nn.Linear(4, 4))
    mon = attach(model)
    model.append(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert mon.layers == ("0",)
    assert value(s, "gradmon_steps_total") == 1
    assert not [k for k in s if dict(k[1]).get("layer") == "1"]
    mon.detach()
    assert attach(model).layers == ("0", "1")


def test_dataclass_outputs_are_measured(attach):
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor
        aux: dict

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 3)

        def forward(self, x):
            y = self.proj(x)
            return Out(y, {"hidden": y * 2})

    model = nn.Sequential(nn.Linear(4, 4), Head())
    mon = attach(model, detail_every=1)
    model(torch.randn(2, 4)).logits.sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    assert mon.coverage()["1.proj"] == frozenset({"grad", "grad_flow", "activation", "optimizer"})


def test_a_nan_on_an_unsampled_step_still_reaches_the_counters(attach):
    """detail_every=5: activations are not measured on step 3, the gradients are, every step."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, detail_every=5)
    for step in range(5):
        x = torch.randn(2, 4)
        if step == 3:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        for p in model.parameters():
            torch.nan_to_num_(p.grad, nan=0.0)
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_nonfinite_steps_total") == 1
    assert value(s, "gradmon_nonfinite_total", layer="0", tensor="grad", kind="nan") > 0
    assert value(s, "gradmon_nonfinite_total", layer="0", tensor="activation", kind="nan") == 0  # not sampled


def test_a_failing_publisher_fold_counts_the_error_and_keeps_every_step(attach, monkeypatch):
    from gradmon.aggregate import Aggregator

    model = nn.Sequential(nn.Linear(4, 4))
    mon = attach(model)
    real = Aggregator._fold
    calls = {"n": 0}

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(self, *args)

    monkeypatch.setattr(Aggregator, "_fold", flaky)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total") == 4
    assert value(s, "gradmon_hook_errors_total", stage="publish") == 1


def test_the_server_thread_dying_is_reported_and_training_goes_on(attach, caplog):
    model = nn.Sequential(nn.Linear(4, 4))
    mon = attach(model)
    mon._endpoint.server._httpd.shutdown()  # the serving loop ends, as if its thread died
    mon._endpoint.server._thread.join(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert mon.state == "server_failed" and "server thread stopped" in mon.error
    assert "training continues" in caplog.text
    mon.flush()
    assert mon.snapshot().steps_total == 1
