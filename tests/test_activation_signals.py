"""Issue 10 part 2: activation kurtosis, the relative activation blow-up and fp16 headroom,
each checked against an independent computation on the tensors the test captured itself."""

from __future__ import annotations

import math
import statistics
from typing import Dict, List

import pytest
import torch
from torch import nn

from conftest import scrape, value
from gradmon import metrics as M
from gradmon import statistics as S
from gradmon.config import Config

FP16_MAX = 65504.0


def pearson_kurtosis(values: List[torch.Tensor]) -> float:
    """Plain (Pearson) kurtosis of every element of ``values``, centred two-pass in float64."""
    x = torch.cat([v.detach().double().flatten() for v in values])
    d = x - x.mean()
    return (d.pow(4).mean() / d.square().mean().square()).item()


def capture_outputs(modules: Dict[str, nn.Module]) -> Dict[str, List[torch.Tensor]]:
    """Every output of each module, per call, keyed by name (cleared by the caller)."""
    seen: Dict[str, List[torch.Tensor]] = {name: [] for name in modules}
    for name, m in modules.items():
        m.register_forward_hook(lambda mod, i, o, name=name: seen[name].append(o.detach().clone()))
    return seen


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    model.zero_grad(set_to_none=True)


class Twice(nn.Module):
    """One layer called twice per forward: its two records fold into one value."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.inner(torch.relu(self.inner(x)))))


# -- kurtosis -----------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [1, 3], ids=["first detail step", "later detail step"])
def test_kurtosis_of_a_layer_equals_the_float64_kurtosis_of_its_flattened_outputs(attach, steps):
    """On the first detail step each output is sampled in its layer's hook; on the later
    ones all of them at the end of the forward (capture/forward.py): the same samples."""
    torch.manual_seed(0)
    model = Twice()
    outputs = capture_outputs({"inner": model.inner, "head": model.head})
    mon = attach(model, detail_every=1)
    for _ in range(steps):
        for seen in outputs.values():
            seen.clear()
        step(model, torch.randn(64, 6) ** 3)  # heavy-tailed inputs: kurtosis far from 3
    mon.flush()
    s = scrape(mon.url)
    assert len(outputs["inner"]) == 2
    for layer in ("inner", "head"):
        want = pearson_kurtosis(outputs[layer])
        assert math.isclose(value(s, "gradmon_activation_kurtosis", layer=layer), want, rel_tol=1e-4)
    # the two calls fold by the parallel rule, not by averaging the calls' kurtoses
    per_call = [pearson_kurtosis([o]) for o in outputs["inner"]]
    assert not math.isclose(value(s, "gradmon_activation_kurtosis", layer="inner"), sum(per_call) / 2, rel_tol=1e-3)


class Recurrent(nn.Module):
    """One cell called many times in one forward, as an RNN steps through a sequence."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = torch.tanh(self.cell(x)) * 3
        return x


def test_a_layer_called_many_times_holds_a_bounded_sample_and_keeps_its_exact_kurtosis(attach, monkeypatch):
    """Raw samples are combined into rows as soon as RAW_BUDGET elements wait, not kept
    until the forward returns; the rows fold as exactly as the samples would have."""
    from gradmon.capture import records as hooks
    monkeypatch.setattr(hooks, "RAW_BUDGET", 3 * 64 * 8)  # three calls' outputs
    waiting: List[int] = []
    add = hooks._Records.add

    def spy(self, key, numel, parts):
        add(self, key, numel, parts)
        if self.combine is not None:
            waiting.append(self.raw_elements)
    monkeypatch.setattr(hooks._Records, "add", spy)
    torch.manual_seed(2)
    model = Recurrent(steps=20)
    outputs = capture_outputs({"cell": model.cell})
    mon = attach(model, detail_every=1)
    step(model, torch.randn(64, 8))
    mon.flush()
    assert len(outputs["cell"]) == 20 and len(waiting) == 20
    assert max(waiting) <= 3 * 64 * 8 and waiting.count(0) >= 5  # combined every fourth call
    got = value(scrape(mon.url), "gradmon_activation_kurtosis", layer="cell")
    assert math.isclose(got, pearson_kurtosis(outputs["cell"]), rel_tol=1e-4)


def test_a_failure_to_combine_the_samples_loses_the_kurtosis_only(attach, monkeypatch):
    from gradmon.capture import kernels as stats

    def broken(*args, **kwargs):
        raise RuntimeError("combine failed")
    monkeypatch.setattr(stats, "moments_block", broken)
    torch.manual_seed(3)
    model = Twice()
    mon = attach(model, detail_every=1)
    step(model, torch.randn(16, 6))
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_hook_errors_total", stage="forward") == 1
    assert value(s, "gradmon_grad_norm", layer="inner") > 0 and value(s, "gradmon_activation_rms", layer="inner") > 0
    assert not [k for k in s if k[0] == "gradmon_activation_kurtosis"]


class Outliers(nn.Module):
    """A large output (above the kurtosis sample) with one outlier feature: channel 7 is
    30x the others on every token, as outlier features are in transformers."""

    def __init__(self, width: int = 384) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(width))
            self.proj.weight[7, 7] = 30.0
            self.proj.bias.zero_()

    def forward(self, x):
        return self.proj(x)


def test_kurtosis_of_a_large_output_is_estimated_from_a_sample_that_sees_every_feature(attach):
    from gradmon.capture import kernels as stats
    torch.manual_seed(0)
    model = Outliers()
    outputs = capture_outputs({"proj": model.proj})
    mon = attach(model, detail_every=1)
    x = torch.randn(16, 64, 384)  # 393,216 elements per output, 24x the sample
    assert x.numel() > 20 * stats.MOMENTS_SAMPLE
    step(model, x)
    mon.flush()
    want = pearson_kurtosis(outputs["proj"])
    got = value(scrape(mon.url), "gradmon_activation_kurtosis", layer="proj")
    # the outlier feature lifts the kurtosis far above a Gaussian's 3; a sample that read
    # one column over and over (a stride sharing a factor with the width) would miss it
    assert want > 50
    assert math.isclose(got, want, rel_tol=0.25), (got, want)


def test_kurtosis_sample_stride_visits_every_index_of_every_dimension():
    from gradmon.capture import kernels as stats
    for shape in [(16, 64, 384), (8, 128, 1024), (8, 64, 56, 56), (4, 3 * 5 * 7 * 11 * 13), (10 ** 6,)]:
        numel = math.prod(shape)
        k = stats._sample_stride(torch.Size(shape), numel, stats.MOMENTS_SAMPLE)
        assert numel // k <= stats.MOMENTS_SAMPLE + 1
        assert all(d % k for d in shape if d > 1), (shape, k)  # coprime with every size: k is prime
        assert all(k % j for j in range(2, int(k ** 0.5) + 1))
    assert stats._sample_stride(torch.Size((100, 100)), 10_000, stats.MOMENTS_SAMPLE) == 1  # small: every element


def test_kurtosis_of_grouped_layers_is_the_kurtosis_of_all_their_outputs_together(attach):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16)), nn.Linear(16, 2))
    with torch.no_grad():
        model[0][1].bias.fill_(5.0)  # groups whose layers' means differ: the cross terms matter
    per_layer = S.series_per_layer(S.enabled(Config(), local_view=False, fp16_headroom=False))
    outputs = capture_outputs({"0.0": model[0][0], "0.1": model[0][1]})
    mon = attach(model, detail_every=1, series_budget=2 * per_layer)  # 3 layers -> groups "0", "1"
    step(model, torch.randn(32, 8))
    mon.flush()
    s = scrape(mon.url)
    assert mon.layers == ("0.0", "0.1", "1") and value(s, "gradmon_grouped_layers") == 1
    want = pearson_kurtosis(outputs["0.0"] + outputs["0.1"])
    assert math.isclose(value(s, "gradmon_activation_kurtosis", layer="0"), want, rel_tol=1e-4)
    # a mean of the two layers' kurtoses (what a naive fold would give) is far off
    assert abs(want - (pearson_kurtosis(outputs["0.0"]) + pearson_kurtosis(outputs["0.1"])) / 2) > 0.1


def test_moments_reuse_their_scratch_memory_and_give_the_same_rows():
    """The recorder's scratch (reused step after step on the CPU) holds the last step's
    samples: a shorter row later must see zeros past its end, not the old values."""
    from gradmon.capture import kernels as stats
    torch.manual_seed(4)
    home, scratch = torch.device("cpu"), stats.Scratch()
    first = [torch.randn(9000) * 3 + 7, torch.randn(5000)]
    second = [torch.randn(4000) + 100, torch.randn(8999) * 0.1, torch.randn(10)]
    for samples in (first, second, first):
        numels = [4 * t.numel() for t in samples]
        want = stats.moments_block(samples, numels, home)
        got = stats.moments_block(samples, numels, home, scratch)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    held = scratch.take("moments", (2, 9000), torch.float32, home)
    assert held.data_ptr() == scratch.take("moments", (3, 10), torch.float32, home).data_ptr()  # reused


@pytest.mark.parametrize("detail_every, kept", [(1, True), (20, False)])
def test_the_recorder_keeps_scratch_memory_only_where_detail_steps_come_often(attach, detail_every, kept):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 8))
    mon = attach(model, detail_every=detail_every)
    x = torch.randn(64, 64)  # 32K-element outputs: sampled, so the moments block is a few hundred KB
    held = []
    for _ in range(2):
        step(model, x)
        mon.flush()
        scratch = mon._recorder._rec._scratch
        held.append(None if scratch is None else {k: t.data_ptr() for k, t in scratch._held.items()})
    if kept:
        assert held[0] and held[0] == held[1]  # the second detail step wrote where the first did
    else:
        assert held == [None, None]  # nothing outlives the step at the default cadence
    assert value(scrape(mon.url), "gradmon_activation_kurtosis", layer="0") > 0


def test_kurtosis_is_exact_for_activations_near_1e4_with_a_spread_of_0_1(attach):
    torch.manual_seed(2)
    layer = nn.Linear(16, 256)
    with torch.no_grad():
        layer.weight.mul_(0.1)
        layer.bias.fill_(1e4)
    model = nn.Sequential(layer, nn.Linear(256, 1))
    outputs = capture_outputs({"0": layer})
    mon = attach(model, detail_every=1)
    step(model, torch.randn(64, 16))
    mon.flush()
    want = pearson_kurtosis(outputs["0"])
    got = value(scrape(mon.url), "gradmon_activation_kurtosis", layer="0")
    assert math.isclose(got, want, rel_tol=1e-4)
    # the case discriminates: float32 raw moments (what a naive record would ship) are garbage
    x = outputs["0"][0].flatten()
    n = x.numel()
    m1, m2, m3, m4 = ((x ** k).sum() / n for k in (1, 2, 3, 4))
    naive = ((m4 - 4 * m1 * m3 + 6 * m1 ** 2 * m2 - 3 * m1 ** 4) / (m2 - m1 ** 2) ** 2).item()
    assert not math.isclose(naive, want, rel_tol=0.1)


def test_kurtosis_stays_finite_when_activations_blow_up_past_float32_fourth_powers(attach):
    torch.manual_seed(7)
    layer = nn.Linear(16, 64)
    with torch.no_grad():
        layer.weight.mul_(1e10)  # outputs ~1e10: their fourth powers overflow float32 (3.4e38)
    model = nn.Sequential(layer, nn.Linear(64, 1))
    outputs = capture_outputs({"0": layer})
    mon = attach(model, detail_every=1)
    model(torch.randn(8, 16)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    assert outputs["0"][0].float().pow(4).sum().isinf()
    got = value(scrape(mon.url), "gradmon_activation_kurtosis", layer="0")
    assert math.isclose(got, pearson_kurtosis(outputs["0"]), rel_tol=1e-4)


def test_kurtosis_is_off_with_its_switch_and_with_activations():
    assert S.ACTIVATION_KURTOSIS in S.enabled(Config(), local_view=False)
    assert S.ACTIVATION_KURTOSIS not in S.enabled(Config(activation_kurtosis=False), local_view=False)
    assert S.ACTIVATION_KURTOSIS not in S.enabled(Config(activations=False), local_view=False)


# -- relative blow-up -----------------------------------------------------------------------

def test_abs_max_ratio_follows_the_median_of_the_layers_own_last_measurements(attach):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    maxima: List[float] = []
    model[0].register_forward_hook(lambda m, i, o: maxima.append(o.detach().abs().max().item()))
    window = 10
    mon = attach(model, detail_every=1, activation_baseline=window, baseline_warmup=0)

    def ratio():
        mon.flush()
        s = scrape(mon.url)
        hits = [v for (n, ls), v in s.items() if n == "gradmon_activation_abs_max_ratio" and ("layer", "0") in ls]
        return hits[0] if hits else None

    for i in range(S.MIN_BASELINE - 1):
        step(model, torch.randn(16, 8))
        assert ratio() is None, f"a ratio after {i + 1} measurements"
    for _ in range(window + 4 - (S.MIN_BASELINE - 1)):  # past the window: old values roll out
        step(model, torch.randn(16, 8))
        got = ratio()
        assert math.isclose(got, maxima[-1] / statistics.median(maxima[-window:]), rel_tol=1e-6)
        assert 0.5 < got < 2.0  # healthy steps: near 1
    with torch.no_grad():
        model[0].weight.mul_(50)
        model[0].bias.mul_(50)
    step(model, torch.randn(16, 8))
    got = ratio()
    assert math.isclose(got, maxima[-1] / statistics.median(maxima[-window:]), rel_tol=1e-6)
    assert got > 20


def test_abs_max_ratio_of_an_all_zero_baseline():
    assert S.relative(0.0, S.baseline_median([0.0] * S.MIN_BASELINE)) == 1.0
    assert S.relative(3.0, S.baseline_median([0.0] * S.MIN_BASELINE)) == math.inf
    assert S.relative(3.0, S.baseline_median([1.0] * (S.MIN_BASELINE - 1))) is None


# -- fp16 headroom ----------------------------------------------------------------------------

def half_model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).half()


def capture_grads(modules: Dict[str, nn.Module]) -> Dict[str, List[torch.Tensor]]:
    seen: Dict[str, List[torch.Tensor]] = {name: [] for name in modules}

    def hook(name: str, mod: nn.Module, inputs, output: torch.Tensor) -> None:
        output.register_hook(lambda g: seen[name].append(g.detach().clone()))
    for name, m in modules.items():
        m.register_forward_hook(lambda mod, i, o, name=name: hook(name, mod, i, o))
    return seen


def test_fp16_range_used_is_max_abs_over_65504_for_a_float16_model(attach):
    model = half_model()
    outputs = capture_outputs({"0": model[0], "2": model[2]})
    grads = capture_grads({"0": model[0], "2": model[2]})
    mon = attach(model, detail_every=1)
    x = torch.randn(32, 8).half() * 100
    model(x).float().square().sum().mul(1e-3).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    s = scrape(mon.url)
    for layer in ("0", "2"):
        act = outputs[layer][0].float().abs().max().item() / FP16_MAX
        grad = grads[layer][0].float().abs().max().item() / FP16_MAX
        assert math.isclose(value(s, "gradmon_fp16_range_used", layer=layer, tensor="activation"), act, rel_tol=1e-9)
        assert math.isclose(value(s, "gradmon_fp16_range_used", layer=layer, tensor="grad"), grad, rel_tol=1e-9)
        zeros = (grads[layer][0] == 0).sum().item() / grads[layer][0].numel()
        assert value(s, "gradmon_grad_fp16_underflow_fraction", layer=layer) == pytest.approx(zeros, abs=1e-12)
    assert 0 < value(s, "gradmon_fp16_range_used", layer="0", tensor="activation") < 1


def test_under_fp16_autocast_the_grad_headroom_is_of_the_scaled_gradient(attach):
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # fp32 parameters
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    grads = capture_grads({"0": model[0]})
    mon = attach(model, detail_every=1, scaler=scaler)  # a scaler: fp16 families resolve on
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    mon.flush()
    g = grads["0"][0]
    assert g.dtype == torch.float16
    got = value(scrape(mon.url), "gradmon_fp16_range_used", layer="0", tensor="grad")
    assert math.isclose(got, g.float().abs().max().item() / FP16_MAX, rel_tol=1e-9)
    # the loss scale is in it: 4096x the range the unscaled gradient uses, computed afresh
    with torch.autocast("cpu", dtype=torch.float16):
        out0 = model[0](x)
        unscaled, = torch.autograd.grad(model[2](model[1](out0)).float().square().mean(), out0)
    assert math.isclose(got, unscaled.float().abs().max().item() * 2.0 ** 12 / FP16_MAX, rel_tol=1e-3)


class Weighted(nn.Module):
    """An fp16 layer whose output gradient is exactly a given weight, cast to fp16."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.layer = nn.Linear(4, weight.numel()).half()
        self.weight = weight

    def forward(self, x):
        return (self.layer(x).float() * self.weight).sum()


def test_underflow_fraction_counts_the_zeros_of_a_float16_gradient(attach):
    torch.manual_seed(5)
    # 40 elements per row: 10 true zeros, 6 that underflow in fp16 (1e-8 < 2**-24), 24 normal
    weight = torch.cat((torch.zeros(10), torch.full((6,), 1e-8), torch.rand(24) + 0.5))
    model = Weighted(weight)
    mon = attach(model, detail_every=1)
    model(torch.randn(3, 4).half()).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    assert value(scrape(mon.url), "gradmon_grad_fp16_underflow_fraction", layer="layer") == pytest.approx(16 / 40)


def test_no_fp16_series_and_no_fp16_budget_for_a_float32_model(attach):
    torch.manual_seed(6)
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    without = S.series_per_layer(S.enabled(Config(), local_view=False, fp16_headroom=False))
    fp16 = [st for st in S.STATISTICS if st.switches == ("fp16_headroom",)]
    assert S.series_per_layer(S.enabled(Config(), local_view=False, fp16_headroom=True)) == without + sum(
        st.series_per_layer for st in fp16) > without
    mon = attach(fp32, detail_every=1, series_budget=2 * without)  # exactly what 2 layers cost
    step(fp32, torch.randn(4, 8))
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_grouped_layers") == 0
    assert value(s, "gradmon_activation_rms", layer="0") > 0
    assert not [n for n, _ in s if n in (M.FP16_RANGE_USED.name, M.GRAD_FP16_UNDERFLOW_FRACTION.name)]
    # the same budget is too small once the fp16 families can exist: they are counted
    mon.detach()
    half = half_model()
    mon = attach(half, detail_every=1, series_budget=2 * without)
    step(half, torch.randn(4, 8).half())
    mon.flush()
    assert value(scrape(mon.url), "gradmon_grouped_layers") == 1


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def fp16_layers(s) -> Dict[str, set]:
    """Layers with a sample of each fp16 family (by name and tensor label)."""
    out: Dict[str, set] = {}
    for name, labels in s:
        if name in (M.FP16_RANGE_USED.name, M.GRAD_FP16_UNDERFLOW_FRACTION.name):
            d = dict(labels)
            out.setdefault(f"{name}{{{d.get('tensor', '')}}}", set()).add(d["layer"])
    return out


def test_only_float16_layers_get_fp16_series_in_a_mixed_model(attach):
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(8, 8).half(), Cast(torch.float32), nn.Linear(8, 4),
                          Cast(torch.bfloat16), nn.Linear(4, 4).bfloat16())
    mon = attach(model, detail_every=1)  # a float16 parameter: the fp16 families resolve on
    model(torch.randn(4, 8).half()).float().sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_activation_rms", layer="2") > 0 and value(s, "gradmon_activation_rms", layer="4") > 0
    assert fp16_layers(s) == {"gradmon_fp16_range_used{activation}": {"0"}, "gradmon_fp16_range_used{grad}": {"0"},
                              "gradmon_grad_fp16_underflow_fraction{}": {"0"}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_on_the_fp16_families_have_no_series_for_fp32_or_bf16_layers(attach, dtype):
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    mon = attach(model, detail_every=1, fp16_headroom=True)
    step(model, torch.randn(4, 8, dtype=dtype))
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_activation_rms", layer="0") > 0
    assert fp16_layers(s) == {}


def test_fp16_headroom_is_resolved_at_attach_from_the_model_and_the_scaler():
    from gradmon.capture.layers import discover
    from gradmon.wiring import _fp16_headroom
    fp32 = discover(nn.Linear(2, 2), Config())
    half = discover(nn.Linear(2, 2).half(), Config())
    assert not _fp16_headroom(Config(), fp32) and _fp16_headroom(Config(), half)
    assert _fp16_headroom(Config(scaler=torch.amp.GradScaler("cpu")), fp32)
    assert not _fp16_headroom(Config(fp16_headroom=False), half)
    assert _fp16_headroom(Config(fp16_headroom=True), fp32)
