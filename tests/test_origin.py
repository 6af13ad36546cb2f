"""Where a NaN started, on the step it happens, at default settings (issue 8, part 2): the
batch or the first top-level block whose output went non-finite, kept for the whole run of
poisoned steps; norm overflow with finite elements; steps a GradScaler skipped."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import Leaves, fresh, origins, value


class Block(nn.Module):
    """Two layers; ``broken`` makes its forward take the log of negative values between them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.broken:
            h = torch.log(h - 2.0)  # tanh - 2 < 0: NaN everywhere
        return self.fc2(h)


def blocks(n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)])


def train(model, opt, steps, batch=lambda step: torch.randn(4, 8), before=lambda step: None):
    for step in range(steps):
        before(step)
        model(batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_nan_in_the_batch_on_a_non_detail_step_is_named_input(attach):
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)  # detail_every=10: steps 2..10 record no activations

    def batch(step):
        x = torch.randn(4, 8)
        if step == 3:
            x[1, 2] = float("nan")
        return x

    train(model, opt, 6, batch)
    s = fresh(mon)
    found = origins(s)
    assert found["block"] == ("input", 4), found
    assert "activation" not in found
    assert found["grad"] == ("3.fc2", 4)  # the last layer: first in backward order


class Doubling(nn.Module):
    """Its first op saves nothing for the backward: a batch made under ``torch.inference_mode``
    (a preprocessing step's) may enter its training forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*[Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * 2.0)


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def identity_first() -> nn.Module:
    """A top-level block that returns the batch itself (an inference tensor), then one that
    saves nothing for the backward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Identity(), Twice(), *[Block() for _ in range(3)])


@pytest.mark.parametrize("make", [Doubling, identity_first], ids=["the root doubles it", "an identity block returns it"])
def test_a_batch_made_in_inference_mode_is_checked_and_a_nan_in_it_named_input(attach, make):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=4)  # detail and ordinary steps alike

    def batch(step):
        x = torch.randn(4, 8)
        if step == 9:
            x[1, 2] = float("nan")
        with torch.inference_mode():
            return x.clone()

    train(model, opt, 11, batch)
    s = fresh(mon)
    # an inference tensor has no version counter: reading it failed every step, uncounted checks
    assert sum(mon._errors.counts().values()) == 0, mon._errors.counts()
    assert origins(s)["block"] == ("input", 10), origins(s)


def test_a_nan_made_inside_a_middle_block_names_it_and_five_poisoned_steps_keep_it(attach, caplog):
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    incidents = []
    mon = attach(model, detail_every=5, on_nonfinite=incidents.append)

    def before(step):
        model[2].broken = step == 5  # a detail step; the next five steps run on poisoned weights

    train(model, opt, 11, before=before)
    s = fresh(mon)
    found = origins(s)
    assert found["block"] == ("2", 6), found
    assert found["activation"] == ("2.fc2", 6)  # fc1's output was finite; the log came after it
    assert value(s, "gradmon_nonfinite_steps_total") == 6  # poisoned steps are counted, not re-blamed
    assert [(i.step, i.block, i.activation_layer, i.origin_step) for i in incidents] == [(6, "2", "2.fc2", 6)]
    assert "started at step 6 in 2" in caplog.text


def test_a_nan_made_in_the_backward_is_logged_as_no_blocks_doing(attach, caplog):
    """The forward stayed finite: the log says so in words rather than naming a block "-"."""
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    poison = model[1].fc2.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    train(model, opt, 1)
    poison.remove()
    train(model, opt, 2)
    assert mon.flush()
    assert "started at step 1 with this rank's forward finite (no block made them" in caplog.text, caplog.text
    assert "gradient first in layer 1.fc2" in caplog.text


@pytest.mark.parametrize("per_layer, detail_every", [(True, 10), (False, 10), (True, 1)])
def test_origin_per_layer_names_the_layer_on_a_non_detail_step(attach, per_layer, detail_every):
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # detail_every=10: step 4 is no detail step; 1: the activation record stands in for the per-layer one
    mon = attach(model, origin_per_layer=per_layer, detail_every=detail_every)

    def before(step):
        model[2].broken = step == 3

    train(model, opt, 5, before=before)
    found = origins(fresh(mon))
    assert found["block"] == ("2", 4), found
    if per_layer or detail_every == 1:
        assert found["activation"] == ("2.fc2", 4)  # fc1's output was finite; the log came after it
    else:
        assert "activation" not in found


def test_a_new_run_after_a_finite_step_starts_a_new_origin(attach):
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    for step in range(7):
        x = torch.randn(4, 8)
        if step in (2, 5):
            x[0, 0] = float("nan")
        model[1].broken = step == 5
        model(x).pow(2).mean().backward()
        for p in model.parameters():  # the job's NaN guard: each run is one step
            torch.nan_to_num_(p.grad, nan=0.0)
        opt.step()
        opt.zero_grad()
    found = origins(fresh(mon))
    assert found["block"] == ("input", 6)  # the second run's step, and the batch came first


class Masked(nn.Module):
    """Attention-like scores plus a float mask that holds -inf on every step."""

    def __init__(self) -> None:
        super().__init__()
        self.scores = nn.Linear(8, 8)
        self.masker = AddMask()
        self.head = Block()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.masker(self.scores(x), mask), dim=-1)
        return self.head(p)


class AddMask(nn.Module):
    def forward(self, s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return s + mask


def test_a_float_mask_with_minus_inf_on_every_step_is_no_origin_and_no_count(attach):
    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1)
    mask = torch.zeros(4, 8)
    mask[:, 5:] = -math.inf
    for step in range(8):
        model.head.broken = step == 6
        model(torch.randn(4, 8), mask).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            s = fresh(mon)
            assert value(s, "gradmon_nonfinite_steps_total") == 0
            assert not origins(s)
            assert all(v == 0 for (n, _), v in s.items() if n == "gradmon_nonfinite_total")
    found = origins(fresh(mon))
    # the input and the masker held -inf on every finite step: the head is where it started
    assert found["block"] == ("head", 7), found


def test_a_norm_that_overflows_with_finite_elements_is_counted_in_the_inf_bucket(attach):
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model)
    (model(torch.full((1, 4), 1e10)).sum() * 1e10).backward()  # each weight gradient 1e20: finite
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    opt.step()
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    s = fresh(mon)
    assert value(s, "gradmon_grad_norm_overflow_steps_total") == 1
    assert value(s, "gradmon_nonfinite_steps_total") == 0
    h = "gradmon_grad_global_norm_distribution"
    assert value(s, h + "_count") == 2
    assert value(s, h + "_bucket", le="+Inf") - value(s, h + "_bucket", le="100000000.0") == 1
    assert math.isfinite(value(s, h + "_sum")) and value(s, h + "_sum") < 100


def test_a_step_the_scaler_skipped_keeps_the_last_applied_norms(attach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    mon = attach(model, scaler=scaler)
    for step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        if step == 2:
            loss = loss * math.inf  # an overflow: the scaler skips this step
        scaler.scale(loss).backward()
        if step == 1:
            expected = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters())) / 8.0
            layer = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model[2].parameters())) / 8.0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    s = fresh(mon)
    assert value(s, "gradmon_amp_skipped_steps_total") == 1
    assert math.isclose(value(s, "gradmon_grad_global_norm"), expected, rel_tol=1e-5)
    assert math.isclose(value(s, "gradmon_grad_norm", layer="2"), layer, rel_tol=1e-5)
    assert value(s, "gradmon_nonfinite_steps_total") == 0
    assert not origins(s)


class Stack(nn.Module):
    """A GPT's shape: an embedding, a ModuleList of blocks called in a loop, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_blocks_of_a_module_list_are_blocks_of_their_own(attach):
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)  # a non-detail step: only the every-step block records can name it

    def before(step):
        model.blocks[2].broken = step == 3

    train(model, opt, 5, before=before)
    found = origins(fresh(mon))
    assert found["block"] == ("blocks.2", 4), found


class Scaled(nn.Module):
    """A root whose forward returns its last child's output, changed in place on ``poison``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = blocks(2)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.poison:
            out.add_(float("nan"))
        return out


def count_extremes(monkeypatch) -> list:
    """The shapes of the tensors gradmon reads extremes of, one by one or many at once
    (the ordinary step's batched block check)."""
    from gradmon.capture import kernels as stats

    calls: list = []
    real, real_many = stats.extremes, stats.extremes_many
    monkeypatch.setattr(stats, "extremes", lambda x, *rows: calls.append(x.shape) or real(x, *rows))
    monkeypatch.setattr(stats, "extremes_many",
                        lambda xs, home, *rows: calls.extend(x.shape for x in xs) or real_many(xs, home, *rows))
    return calls


def test_the_root_output_that_is_the_last_block_output_is_read_once_unless_changed_in_place(attach, monkeypatch):
    calls = count_extremes(monkeypatch)
    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    train(model, opt, 3)  # step 1 is a detail step: its activation records hold the extremes
    calls.clear()
    train(model, opt, 1)
    assert len(calls) == 2, calls  # the batch and `net`; the root's record is net's, reused
    model.poison = True
    calls.clear()
    train(model, opt, 1)
    # changed in place after `net` returned: the root's output is read on its own, and
    # `net`'s waiting check, which could only read the changed value, is dropped
    assert len(calls) == 2, calls
    found = origins(fresh(mon))
    assert found["block"] == ("output", 5), found  # `net` was finite; the in-place NaN came after it


def test_a_detail_step_takes_the_block_extremes_of_a_layer_from_its_activation_record(attach, monkeypatch):
    calls = count_extremes(monkeypatch)
    model = Leaves()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=2)
    train(model, opt, 2)
    calls.clear()
    train(model, opt, 1)  # step 3, a detail step: every block is a layer whose record holds them
    assert len(calls) == 1, calls  # the batch alone
    train(model, opt, 1)  # step 4: no activation records, the blocks are read
    assert len(calls) == 1 + 1 + 3, calls

    def before(step):
        if step == 0:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("nan")
    train(model, opt, 1, before=before)  # step 5, a detail step: fc2's output is the first NaN
    found = origins(fresh(mon))
    assert found["block"] == ("fc2", 5), found


def test_rank_level_counters_exist_at_zero_from_attach_and_count_every_layer(attach):
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1)
    s = fresh(mon)
    for tensor in ("grad", "grad_flow", "activation"):
        for kind in ("nan", "inf"):
            assert value(s, "gradmon_rank_nonfinite_total", tensor=tensor, kind=kind) == 0

    def before(step):
        model[1].broken = step == 2

    train(model, opt, 3, before=before)
    s = fresh(mon)
    per_layer = sum(v for (n, ls), v in s.items()
                    if n == "gradmon_nonfinite_total" and dict(ls)["tensor"] == "activation" and dict(ls)["kind"] == "nan")
    assert per_layer > 0
    assert value(s, "gradmon_rank_nonfinite_total", tensor="activation", kind="nan") == per_layer
    worst = [(dict(ls)["layer"], v) for (n, ls), v in s.items() if n == "gradmon_activation_abs_max_worst"]
    assert len(worst) == 1  # NaN outputs are no layer's "largest": the worst finite layer is named
    assert math.isfinite(worst[0][1])
    highest = max((v, dict(ls)["layer"]) for (n, ls), v in s.items() if n == "gradmon_activation_abs_max" and v == v)
    assert worst[0] == (highest[1], highest[0])
