"""The optimizer statistics (issue 10 part 2): the update-to-weight ratio rebuilt from the
optimizer's state equals the update the test watches the optimizer apply; Adam's
second-moment RMS equals the test's own computation from its copies of the gradients;
the learning rate is exported per param group at every step; an optimizer gradmon
cannot read is a coverage gap, said once, never an error."""

from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List

import pytest
import torch
from torch import nn

from conftest import fresh, value
from gradmon.thresholds import Thresholds
from gradmon.capture import optimizer as O

LAYERS = ("0", "2")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    (model(torch.randn(5, 6, generator=g)).square().mean() * scale).backward()


def _params(model: nn.Module, layer: str) -> List[torch.Tensor]:
    return list(model[int(layer)].parameters())


def _applied_ratio(before: List[torch.Tensor], after: List[torch.Tensor]) -> float:
    """‖w_t − w_{t-1}‖/‖w_{t-1}‖ of what the optimizer really did, in float64."""
    moved = sum((a.double() - b.double()).square().sum().item() for a, b in zip(after, before))
    weight = sum(b.double().square().sum().item() for b in before)
    return math.sqrt(moved / weight)


OPTIMIZERS: Dict[str, Callable[[List[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_weight_decay": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.1),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, maximize=True, weight_decay=0.1),
    "sgd_momentum_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, maximize=True, weight_decay=0.1),
    "sgd_nesterov_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, nesterov=True, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.5),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw_amsgrad_maximize": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, maximize=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=True),
}


def _check_ratio_each_step(attach, make, steps: int = 3) -> None:
    model = _model()
    opt = make(list(model.parameters()))
    mon = attach(model, optimizer_every=1)
    # Adam's step hardly depends on the gradient's scale: shrinking gradients make
    # amsgrad's max_exp_avg_sq differ from exp_avg_sq. SGD's relative update must stay
    # far above float32's rounding of the weights.
    shrink = 0.1 if isinstance(opt, torch.optim.Adam) else 1.0
    for step in range(steps):
        _backward(model, step, shrink ** step)
        _step_and_check_ratios(model, opt, mon, step)


def _step_and_check_ratios(model, opt, mon, step: int) -> None:
    """One optimizer step; each layer's exported ratio is the update it really applied."""
    before = {layer: [p.detach().clone() for p in _params(model, layer)] for layer in LAYERS}
    opt.step()
    opt.zero_grad()
    s = fresh(mon)
    for layer in LAYERS:
        expected = _applied_ratio(before[layer], _params(model, layer))
        assert value(s, "gradmon_update_to_weight_ratio", layer=layer) == pytest.approx(expected, rel=1e-4), (step, layer)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_to_weight_ratio_is_the_update_the_optimizer_applied(attach, name):
    _check_ratio_each_step(attach, OPTIMIZERS[name])


def test_large_parameters_are_read_in_chunks_with_the_same_result(attach, monkeypatch):
    monkeypatch.setattr(O, "CHUNK", 7)  # every parameter spans several chunks, the last one short
    _check_ratio_each_step(attach, OPTIMIZERS["adamw"], steps=2)
    _check_ratio_each_step(attach, OPTIMIZERS["sgd_nesterov"], steps=2)


def test_grouped_layers_get_the_ratio_of_their_summed_squares(attach):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    from gradmon import statistics as S
    from gradmon.config import Config
    per_layer = S.series_per_layer(S.enabled(Config(), local_view=False))
    mon = attach(model, optimizer_every=1, series_budget=2 * per_layer)  # "0.0", "0.1" -> group "0"
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    model(torch.randn(3, 4)).square().sum().backward()
    before = [p.detach().clone() for p in model[0].parameters()]
    opt.step()
    s = fresh(mon)
    assert value(s, "gradmon_grouped_layers") == 1
    expected = _applied_ratio(before, list(model[0].parameters()))  # not the sum or mean of two ratios
    assert value(s, "gradmon_update_to_weight_ratio", layer="0") == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("weight_decay", [0.0, 0.2], ids=["adam", "adam_l2"])
def test_adam_rms_is_the_gradient_over_the_root_of_the_bias_corrected_second_moment(attach, weight_decay):
    """The test keeps its own second moment from its own copies of the gradient the
    optimizer consumed (after clipping, plus Adam's L2 decay), never the optimizer's."""
    beta2, eps = 0.95, 1e-8
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, beta2), eps=eps, weight_decay=weight_decay)
    mon = attach(model, optimizer_every=1)
    v = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()}
    for t in range(1, 4):
        _backward(model, t)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the consumed gradient is the clipped one
        consumed = {id(p): p.grad.double() + weight_decay * p.detach().double() for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        s = fresh(mon)
        for layer in LAYERS:
            total, numel = 0.0, 0
            for p in _params(model, layer):
                g = consumed[id(p)]
                v[id(p)] = beta2 * v[id(p)] + (1 - beta2) * g.square()
                v_hat = v[id(p)] / (1 - beta2 ** t)
                total += (g.square() / v_hat.clamp_min(eps * eps)).sum().item()
                numel += p.numel()
            expected = math.sqrt(total / numel)
            got = value(s, "gradmon_adam_rms", layer=layer)
            assert got == pytest.approx(expected, rel=1e-4), (t, layer)
            assert got <= (1 - beta2) ** -0.5 * (1 + 1e-6)  # the documented bound
            # the gradients' scale as the second moment holds it, in units of ε
            second = sum((v[id(p)] / (1 - beta2 ** t)).sum().item() for p in _params(model, layer))
            assert value(s, "gradmon_adam_grad_rms_over_eps", layer=layer) == pytest.approx(
                math.sqrt(second / numel) / eps, rel=1e-4), (t, layer)
        if t == 1:
            assert got == pytest.approx(1.0, rel=1e-4)  # v̂_1 = g_1²


def test_sgd_has_no_adam_rms(attach):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, optimizer_every=1)
    _backward(model, 0)
    opt.step()
    s = fresh(mon)
    assert value(s, "gradmon_update_to_weight_ratio", layer="0") > 0
    assert not [k for k in s if k[0] in ("gradmon_adam_rms", "gradmon_adam_grad_rms_over_eps")]


def test_learning_rate_of_every_param_group_follows_a_scheduler(attach):
    model = _model()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[2].parameters(), "lr": 0.02}], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 0.5 ** e, lambda e: 1.0 + e])
    mon = attach(model)  # learning rates on every step at the default optimizer_every
    for step in range(4):
        _backward(model, step)
        used = [g["lr"] for g in opt.param_groups]
        opt.step()
        opt.zero_grad()
        sched.step()
        s = fresh(mon)
        for group, lr in enumerate(used):
            assert value(s, "gradmon_learning_rate", group=str(group)) == pytest.approx(lr, rel=1e-12)
    assert used == [pytest.approx(0.1 * 0.5 ** 3), pytest.approx(0.02 * 4)]


def test_a_tensor_learning_rate_is_packed_and_used_as_a_tensor(attach):
    model = _model()
    try:
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), capturable=True)
        _backward(model, 0)
        opt.step()  # CPU refuses capturable=True at the first step
    except (RuntimeError, AssertionError, ValueError):
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    opt.zero_grad()
    mon = attach(model, optimizer_every=1)
    for step, lr in enumerate((0.01, 0.003)):
        opt.param_groups[0]["lr"].fill_(lr)  # changed in place: the packet must hold this step's value
        _backward(model, step + 1)
        before = [p.detach().clone() for p in _params(model, "2")]
        opt.step()
        opt.zero_grad()
        s = fresh(mon)
        assert value(s, "gradmon_learning_rate", group="0") == pytest.approx(lr, rel=1e-6)
        expected = _applied_ratio(before, _params(model, "2"))
        assert value(s, "gradmon_update_to_weight_ratio", layer="2") == pytest.approx(expected, rel=1e-4)
    assert sum(mon._errors.counts().values()) == 0


class Halving(torch.optim.Optimizer):
    """A custom optimizer gradmon knows nothing about."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.5})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"])


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adagrad(ps, lr=0.1), Halving], ids=["adagrad", "custom"])
def test_an_optimizer_it_cannot_read_is_uncovered_and_said_once(attach, caplog, make):
    model = _model()
    opt = make(list(model.parameters()))
    mon = attach(model, optimizer_every=1)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        for step in range(3):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
        s = fresh(mon)
    said = [r for r in caplog.records if "cannot read the update of" in r.getMessage()]
    assert len(said) == 1 and type(opt).__name__ in said[0].getMessage()
    assert value(s, "gradmon_uncovered_layers", family="optimizer") == len(LAYERS)
    assert all("optimizer" in missing for missing in mon.coverage().gaps().values())
    assert not [k for k in s if k[0] in ("gradmon_update_to_weight_ratio", "gradmon_adam_rms")]
    assert value(s, "gradmon_steps_total") == 3 and sum(mon._errors.counts().values()) == 0
    assert value(s, "gradmon_learning_rate", group="0") == opt.param_groups[0]["lr"]


def test_a_supported_optimizer_covers_every_layer(attach):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mon = attach(model)
    _backward(model, 0)
    opt.step()
    s = fresh(mon)
    assert value(s, "gradmon_uncovered_layers", family="optimizer") == 0
    assert all("optimizer" in mon.coverage()[layer] for layer in LAYERS)


def test_optimizer_every_samples_the_ratio_and_zero_turns_everything_off(attach):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, optimizer_every=3)
    seen = []
    for step in range(4):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
        seen.append(value(fresh(mon), "gradmon_update_to_weight_ratio", layer="0"))
    assert seen[0] == seen[1] == seen[2] != seen[3]  # read on steps 0 and 3 only

    off = _model()
    opt = torch.optim.SGD(off.parameters(), lr=0.1)
    mon = attach(off, optimizer_every=0)
    _backward(off, 0)
    opt.step()
    s = fresh(mon)
    assert not [k for k in s if k[0] in ("gradmon_update_to_weight_ratio", "gradmon_adam_rms")]
    assert value(s, "gradmon_learning_rate", group="0") == 0.1  # read on every step, free, whatever the setting
    assert not [k for k in s if k[0] == "gradmon_uncovered_layers" and ("family", "optimizer") in k[1]]


def test_a_schedule_restarted_above_its_peak_is_exported_over_its_settled_peak(attach):
    """A warm-up, then a held rate, then a restart that triples it: the monitor exports the
    rate over its settled peak from the first settled peak on (scalars.LearningRatePeaks)."""
    settle = Thresholds().lr_settle_steps
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    warmup, restart = 20, 20 + settle + 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * (3.0 if i >= restart else 1.0))
    mon = attach(model, detail_every=1000, optimizer_every=0)
    seen = {}
    for step in range(restart + 2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step in (warmup // 2, warmup + settle - 3, restart - 1, restart, restart + 1):
            ratios = [v for (n, _), v in fresh(mon).items() if n == "gradmon_learning_rate_over_peak"]
            seen[step] = ratios[0] if ratios else None
    # the warm-up's last step (19) is the peak: it settles after lr_settle_steps more steps at it
    assert seen[warmup // 2] is None and seen[warmup + settle - 3] is None
    assert seen[restart - 1] == pytest.approx(1.0)
    assert seen[restart] == pytest.approx(3.0)  # the restart's first step ran at 3x
    assert seen[restart + 1] == pytest.approx(3.0)


@pytest.mark.parametrize("factor", [10.0, 1.0], ids=["restarted-above-its-peak", "held"])
def test_a_loss_back_at_its_start_pages_at_once_only_while_the_rate_is_above_its_peak(attach, factor):
    """A held rate, then (or not) a restart to 10x, and 10 steps into it the observed loss jumps
    back to where the run started, as a bad batch's would: with the rate above its settled peak
    the monitor pages on the jump's step and names the rate as its evidence; with the rate held,
    the same jump is a batch until it lasts."""
    settle = Thresholds().lr_settle_steps
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    restart = settle + 30
    jump = restart + 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: factor if i >= restart else 1.0)
    mon = attach(model, detail_every=1000, optimizer_every=0)
    seen = {}
    for step in range(jump + 3):
        _backward(model, step)
        mon.observe(loss=3.0 if step < 20 or step >= jump else 0.5 + 0.01 * (step % 7))
        opt.step()
        opt.zero_grad()
        sched.step()
        if step >= jump - 1:
            s = fresh(mon)
            seen[step] = (value(s, "gradmon_loss_diverging_steps"),
                          sorted(dict(k[1])["signal"] for k in s if k[0] == "gradmon_loss_divergence_evidence"))
    assert seen[jump - 1] == (0, [])
    if factor > 1:
        assert seen[jump] == (1, ["learning_rate_above_peak"]) and seen[jump + 2][0] == 3
    else:
        assert all(seen[s] == (0, []) for s in seen)


def test_channels_last_weights_and_their_state_are_read_element_for_element(attach):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    mon = attach(model, optimizer_every=1)
    for step in range(2):
        model(torch.randn(2, 3, 7, 7).to(memory_format=torch.channels_last)).square().mean().backward()
        _step_and_check_ratios(model, opt, mon, step)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_layer_whose_bias_starts_at_zero_gets_a_finite_ratio_at_its_first_step(attach, name):
    """‖w_{t-1}‖² of a bias that was 0 before the step is rebuilt from w_t and the update
    as an expansion whose terms cancel to 0: rounding must not take it below 0 (a NaN
    ratio for the whole layer, as a LayerNorm's at init once gave)."""
    for seed in range(5):  # rounding lands below 0 for some seeds and not others
        model = _model(seed)
        with torch.no_grad():
            model[0].bias.zero_()
            model[0].weight.zero_()
            model[0].weight[0, 0] = 1.0  # the layer's norm before the step: 1, all from one element
        opt = OPTIMIZERS[name](list(model.parameters()))
        mon = attach(model, optimizer_every=1, name=f"{name}{seed}")
        _backward(model, seed, 1e4)
        before = [p.detach().clone() for p in _params(model, "0")]
        opt.step()
        opt.zero_grad()
        got = value(fresh(mon), "gradmon_update_to_weight_ratio", layer="0")
        assert got == pytest.approx(_applied_ratio(before, _params(model, "0")), rel=1e-3), seed
        mon.detach()


def _bench_gpt(depth: int = 2):
    """The benchmark's GPT (docs/benchmark.md) at ``depth`` blocks."""
    import sys
    from pathlib import Path
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import bench_overhead
    finally:
        sys.path.remove(bench)
    torch.manual_seed(0)
    return bench_overhead.GPT(depth=depth)


def _train_gpt(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        data = torch.randint(0, 2048, (4, 65), generator=g)
        logits = model(data[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 2048), data[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name, depth, dtype", [("adamw", 2, torch.float32), ("adam_amsgrad", 1, torch.float32),
                                               ("adam_l2", 1, torch.float32), ("sgd_nesterov", 1, torch.float32),
                                               ("adamw", 1, torch.bfloat16)])
def test_a_large_parameter_is_read_through_a_sample_within_five_percent_of_every_element(name, depth, dtype):
    """The default sample against ``optimizer_sample=0`` on the benchmark's GPT after some
    steps, parameter by parameter: the embedding (rows its batch's tokens update unevenly)
    is the hardest."""
    model = _bench_gpt(depth).to(dtype)
    opt = OPTIMIZERS[name](list(model.parameters()))
    for group in opt.param_groups:
        group["lr"] = 1e-3 if isinstance(opt, torch.optim.Adam) else 0.05
    _train_gpt(model, opt, 8)
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 2048, (4, 65), generator=g)
    torch.nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, 2048), data[:, 1:].reshape(-1)).backward()
    opt.step()  # p.grad still there, as in the post-step hook
    params = list(model.parameters())
    home = torch.device("cpu")
    exact, sampled = O.read(opt, params, home, 0), O.read(opt, params, home, 16384)
    large = [j for j, p in enumerate(params) if p.numel() > 16384]
    assert len(large) >= 4 * depth and max(params[j].numel() for j in large) >= 2048 * 256
    pairs = [(exact.update, sampled.update)] + ([(exact.adam, sampled.adam)] if exact.adam else [])
    for (e_rows, e_at), (s_rows, s_at) in pairs:
        assert e_at == s_at == tuple(range(len(params)))
        for j, (e, s) in enumerate(zip(e_rows.tolist(), s_rows.tolist())):
            if j in large:
                assert s == pytest.approx(e, rel=0.05), (j, s, e)
                assert s != e  # a sample indeed, not every element
            else:
                assert s == pytest.approx(e, rel=1e-6), (j, s, e)  # small parameters are read whole


def test_optimizer_sample_reaches_the_reading_and_zero_reads_every_element(attach):
    for sample, rel in ((4096, 0.1), (0, 1e-4)):
        model = _bench_gpt(depth=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        _train_gpt(model, opt, 2)
        mon = attach(model, optimizer_every=1, optimizer_sample=sample, name=f"s{sample}")
        data = torch.randint(0, 2048, (4, 65), generator=torch.Generator().manual_seed(3))
        torch.nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, 2048), data[:, 1:].reshape(-1)).backward()
        before = [model.tok.weight.detach().clone()]
        opt.step()
        opt.zero_grad()
        got = value(fresh(mon), "gradmon_update_to_weight_ratio", layer="tok")
        want = _applied_ratio(before, [model.tok.weight])
        assert got == pytest.approx(want, rel=rel), (sample, got, want)
        if sample:
            assert got != pytest.approx(want, rel=1e-4)  # 4,096 of 524,288 elements: visibly an estimate
        mon.detach()


@pytest.mark.parametrize("name", ["adamw", "adam_l2", "adam_amsgrad", "adamw_amsgrad_maximize"])
@pytest.mark.parametrize("sample", [0, 16384], ids=["whole", "sampled"])
def test_step_counts_kept_on_the_device_are_read_in_one_batch_with_the_same_sums(name, sample, monkeypatch):
    """Fused and capturable Adam keep each parameter's step count on the device, which
    cannot be compared without a sync. They are read together all the same (each piece
    with its own bias corrections), not a batch per parameter: here the CPU counts are
    kept as tensors, as a device's are, and every parameter's sums equal the host path's."""
    model = _bench_gpt(1)
    opt = OPTIMIZERS[name](list(model.parameters()))
    _train_gpt(model, opt, 3)
    p0 = next(iter(model.parameters()))
    opt.state[p0]["step"] = opt.state[p0]["step"] - 1  # one count differs: a piece's own corrections
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 2048, (4, 65), generator=g)
    torch.nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, 2048), data[:, 1:].reshape(-1)).backward()
    opt.step()
    params, home = list(model.parameters()), torch.device("cpu")
    on_host = O.read(opt, params, home, sample)
    with monkeypatch.context() as m:
        m.setattr(O, "_host_step", lambda step: step)  # as a device's: a tensor, never read
        batches = O._batches(opt, params, True, sample)
        on_device = O.read(opt, params, home, sample)
    host_batches = O._batches(opt, params, True, sample)
    assert len(batches) <= len(host_batches) < len(params)  # not one per parameter
    assert all(b.steps and b.step is None for b in batches)
    for got, want in ((on_device.update, on_host.update), (on_device.adam, on_host.adam),
                      (on_device.eps, on_host.eps)):
        assert got[1] == want[1]
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
