"""The numbers on the endpoint equal independently computed values (issue 2, correctness)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import fresh, origins, scrape, value


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 12)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(2)])
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


LAYERS = ["embed", "blocks.0.0", "blocks.1.0", "norm", "head"]


def layer_grad_norms(model: nn.Module):
    out = {}
    for name, mod in model.named_modules():
        params = [p for p in mod.parameters(recurse=False) if p.grad is not None]
        if params:
            out[name] = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)).item()
    return out


def rel_close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_layer_and_global_grad_norms_equal_the_grads_at_the_optimizer_step(attach):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    seen = {}
    for _ in range(3):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        seen = layer_grad_norms(model)  # what the optimizer is about to use
        opt.step()
        opt.zero_grad()
    assert mon.flush()
    s = scrape(mon.url)
    assert sorted(mon.layers) == sorted(LAYERS)
    for layer, expected in seen.items():
        assert rel_close(value(s, "gradmon_grad_norm", layer=layer), expected), layer
    expected_global = math.sqrt(sum(v * v for v in seen.values()))
    assert rel_close(value(s, "gradmon_grad_global_norm"), expected_global)
    assert value(s, "gradmon_steps_total") == 3


class Wrapper(nn.Module):
    """A model whose training loop calls a submodule (``model.net(x)``), never the
    attached module's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("call", ["attached module", "submodule"])
def test_norms_are_pre_clip(attach, call):
    torch.manual_seed(1)
    model = Wrapper()
    forward = model if call == "attached module" else model.net
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    for step in range(3):
        forward(torch.randn(8, 6)).pow(2).sum().backward()
        returned = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3).item()
        opt.step()
        opt.zero_grad()
        mon.flush()
        s = scrape(mon.url)
        assert returned > 1e-2  # the clip really did something
        assert rel_close(value(s, "gradmon_grad_global_norm"), returned), f"step {step}"


def test_gradient_accumulation_gives_one_sample_of_the_accumulated_gradient(attach):
    torch.manual_seed(2)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    for _ in range(4):  # four micro-batches, one optimizer step
        (model(torch.randn(4, 6)).pow(2).mean() / 4).backward()
    expected = layer_grad_norms(model)
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total") == 1
    assert value(s, "gradmon_grad_global_norm_distribution_count") == 1
    for layer, want in expected.items():
        assert rel_close(value(s, "gradmon_grad_norm", layer=layer), want), layer


# a detail step's layer records are made in the layers' hooks on the first detail step, and
# at the end of the forward, all at once, on the later ones (capture/forward.py): both are checked
LATER_DETAIL_STEP = pytest.mark.parametrize("steps", [1, 3], ids=["first detail step", "later detail step"])


@LATER_DETAIL_STEP
def test_activation_rms_and_max_equal_a_plain_forward_hook(attach, steps):
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reference = {}

    def ref_hook(name):
        def hook(mod, inp, out):
            reference[name] = (out.detach().double().pow(2).mean().sqrt().item(),
                               out.detach().abs().max().item())
        return hook

    for name in LAYERS:
        model.get_submodule(name).register_forward_hook(ref_hook(name))
    mon = attach(model, detail_every=1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
    mon.flush()
    s = scrape(mon.url)
    for layer, (rms, amax) in reference.items():
        assert rel_close(value(s, "gradmon_activation_rms", layer=layer), rms), layer
        assert rel_close(value(s, "gradmon_activation_abs_max", layer=layer), amax), layer


@LATER_DETAIL_STEP
def test_grad_flow_norm_equals_the_gradient_of_each_layer_output(attach, steps):
    torch.manual_seed(4)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = {}

    def keep(name):
        def hook(mod, inp, out):
            out.retain_grad()
            outputs[name] = out
        return hook

    for name in LAYERS:
        model.get_submodule(name).register_forward_hook(keep(name))
    mon = attach(model, detail_every=1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).sum().backward()
        expected = {n: o.grad.double().norm().item() for n, o in outputs.items()}
        opt.step()
    mon.flush()
    s = scrape(mon.url)
    for layer, want in expected.items():
        assert rel_close(value(s, "gradmon_grad_flow_norm", layer=layer), want), layer


@LATER_DETAIL_STEP
def test_injected_nan_and_inf_give_exact_element_counts(attach, steps):
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, detail_every=1)
    for _ in range(steps - 1):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    s0 = fresh(mon)
    for tensor in ("grad", "grad_flow", "activation"):  # every counter exists at 0 from attach on
        assert value(s0, "gradmon_nonfinite_total", layer="head", tensor=tensor, kind="nan") == 0

    def poison(mod, inp, out):
        out = out.clone()
        out.view(-1)[:3] = float("nan")
        out.view(-1)[3:5] = float("inf")
        return out

    for _ in range(2):  # two micro-batches, one optimizer step
        handle = model.blocks[0][0].register_forward_hook(poison, prepend=True)
        model(torch.randn(2, 6)).sum().backward()
        handle.remove()
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    # the poisoned forward ran twice before one step: 3 NaN + 2 Inf each time
    assert value(s, "gradmon_nonfinite_total", layer="blocks.0.0", tensor="activation", kind="nan") == 6
    assert value(s, "gradmon_nonfinite_total", layer="blocks.0.0", tensor="activation", kind="inf") == 4
    assert value(s, "gradmon_nonfinite_total", layer="embed", tensor="activation", kind="nan") == 0
    assert value(s, "gradmon_nonfinite_steps_total") == 1
    assert origins(s)["activation"][0] == "blocks.0.0"


def test_exact_gradient_nan_and_inf_counts(attach):
    torch.manual_seed(6)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model)

    def plant(grad):
        grad = grad.clone()
        grad.view(-1)[:7] = float("nan")
        grad.view(-1)[7:9] = float("inf")
        return grad

    handle = model.head.weight.register_hook(plant)
    model(torch.randn(4, 6)).sum().backward()
    handle.remove()
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_nonfinite_total", layer="head", tensor="grad", kind="nan") == 7
    assert value(s, "gradmon_nonfinite_total", layer="head", tensor="grad", kind="inf") == 2
    assert value(s, "gradmon_nonfinite_total", layer="norm", tensor="grad", kind="nan") == 0
    assert value(s, "gradmon_nonfinite_steps_total") == 1
    assert math.isnan(value(s, "gradmon_grad_norm", layer="head"))


def test_histogram_keeps_every_step_and_scrapes_do_not_reset_it(attach):
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    norms = []
    for i in range(5):
        (model(torch.randn(4, 6)).sum() * (10.0 ** i)).backward()
        norms.append(math.sqrt(sum(v * v for v in layer_grad_norms(model).values())))
        opt.step()
        opt.zero_grad()
        mon.flush()
        scrape(mon.url)  # a scrape between steps must not reset anything
    s1, s2 = scrape(mon.url), scrape(mon.url)
    gradmon_own = {k: v for k, v in s1.items() if "process" not in k[0]}
    assert gradmon_own == {k: v for k, v in s2.items() if "process" not in k[0]}
    assert value(s2, "gradmon_grad_global_norm_distribution_count") == 5
    assert rel_close(value(s2, "gradmon_grad_global_norm_distribution_sum"), sum(norms))
    # the one-step spike (the largest norm) lands in a bucket above all the others
    top = max(norms)
    below = [v for (n, ls), v in s2.items() if n == "gradmon_grad_global_norm_distribution_bucket"
             and float(dict(ls)["le"]) < top]
    assert max(below) == 4
    assert value(s2, "gradmon_grad_global_norm_distribution_bucket", le="+Inf") == 5


def test_global_step_is_the_optimizers_own_step_and_survives_a_resume(attach):
    torch.manual_seed(8)
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    for state in opt.state.values():  # a job resumed from a checkpoint at step 81233
        state["step"] = torch.tensor(81233.0)
    mon = attach(model)
    opt.zero_grad()
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_step") == 81234
    assert value(s, "gradmon_steps_total") == 1
    assert not any("step" in dict(ls) for (_n, ls) in s)  # a value, never a label


def test_manual_step_for_loops_without_torch_optim(attach):
    torch.manual_seed(9)
    model = Net()
    mon = attach(model)
    for i in range(3):
        model(torch.randn(2, 6)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        mon.step(500 + i)
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total") == 3
    assert value(s, "gradmon_step") == 502


def test_manual_step_after_optimizer_step_only_sets_the_step_number(attach):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    mon.step(1234)
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total") == 1
    assert value(s, "gradmon_step") == 1234


def test_detail_families_are_sampled_every_n_steps_and_counters_every_step(attach):
    torch.manual_seed(10)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, detail_every=3)
    calls = []
    real = mon._recorder.forward.on_forward

    for i in range(6):
        model(torch.randn(2, 6)).sum().backward()
        calls.append(len(mon._recorder._rec.by_name["activation"].keys()))
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert real is not None
    assert calls == [5, 0, 0, 5, 0, 0]  # detail steps 0 and 3 only
    assert value(s, "gradmon_grad_global_norm_distribution_count") == 6
