"""Where a NaN started, the on_nonfinite callback, and the series budget (issue 4, items 4-5)."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

import gradmon
from conftest import scrape, value
from gradmon import statistics as S
from gradmon.config import Config
from gradmon.grouping import group_layers


def deep_model(blocks: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(blocks)])


def test_nan_origin_names_the_first_layer_forward_and_backward_and_calls_back_once(attach, caplog):
    torch.manual_seed(0)
    model = deep_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    incidents = []
    mon = attach(model, detail_every=1, on_nonfinite=incidents.append)

    def poison(mod, inp, out):
        return out * float("nan")

    for step in range(4):
        handle = model[3][0].register_forward_hook(poison, prepend=True) if step in (1, 2) else None
        model(torch.randn(2, 8)).sum().backward()
        if handle:
            handle.remove()
        for p in model.parameters():  # the job's NaN guard (0 * NaN is NaN even at lr=0)
            torch.nan_to_num_(p.grad, nan=0.0)
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    # NaN leaves blocks.3's first Linear; downstream activations and upstream gradients inherit it.
    # Steps 2 and 3 are one run: its origin is step 2's.
    assert value(s, "gradmon_nonfinite_origin_step", tensor="activation", layer="3.0") == 2, [k for k in s if "origin" in k[0]]
    assert value(s, "gradmon_nonfinite_origin_step", tensor="block", layer="3") == 2
    grad_origin = [dict(ls)["layer"] for (n, ls), v in s.items()
                   if n == "gradmon_nonfinite_origin_step" and dict(ls)["tensor"] == "grad"]
    assert grad_origin == ["5.2"]  # the last layer's gradient is the first to go NaN in backward
    assert [(i.step, i.activation_layer, i.block, i.rank) for i in incidents] == [(2, "3.0", "3", 0)]  # one run, one call
    assert caplog.text.count("non-finite values on rank 0") == 1
    assert "activation first in layer 3.0" in caplog.text


def test_a_failing_callback_is_counted_not_raised(attach):
    model = deep_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def bad(incident):
        raise RuntimeError("user callback failed")

    mon = attach(model, on_nonfinite=bad)
    (model(torch.full((1, 8), float("nan"))).sum()).backward()
    opt.step()
    mon.flush()
    assert value(scrape(mon.url), "gradmon_hook_errors_total", stage="publish") == 1


def test_grouping_fits_the_budget_by_prefix():
    names = [f"blocks.{b}.{part}" for b in range(100) for part in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    g = group_layers(names, per_layer=13, budget=2000)
    assert g.names[:2] == ("blocks.0", "blocks.1") and len(g.names) == 100
    assert g.grouped_layers == 300
    assert group_layers(names[:20], 13, 2000).grouped_layers == 0


def test_grouped_series_combine_norms_maxima_and_counts_correctly(attach):
    torch.manual_seed(1)
    model = deep_model(6)  # 12 layers "i.0", "i.2"
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    per_layer = S.series_per_layer(S.enabled(Config(), local_view=False, fp16_headroom=False))
    mon = attach(model, detail_every=1, series_budget=6 * per_layer)  # room for 6 groups, not 12 layers

    def plant(grad):
        grad = grad.clone()
        grad.view(-1)[:3] = float("nan")
        return grad

    model[4][2].weight.register_hook(plant)
    outs = {}
    for i in range(6):
        for j in (0, 2):
            model[i][j].register_forward_hook(lambda m, inp, o, k=(i, j): outs.__setitem__(k, o.detach()))
    model(torch.randn(3, 8)).sum().backward()
    grads = {(i, j): torch.cat([p.grad.flatten() for p in model[i][j].parameters()]).double()
             for i in range(6) for j in (0, 2)}
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_grouped_layers") == 6
    for i in range(6):
        both = torch.cat([grads[(i, 0)], grads[(i, 2)]])
        if i != 4:
            assert math.isclose(value(s, "gradmon_grad_norm", layer=str(i)), both.norm().item(), rel_tol=1e-5)
        acts = torch.cat([outs[(i, 0)].flatten(), outs[(i, 2)].flatten()]).double()
        assert math.isclose(value(s, "gradmon_activation_abs_max", layer=str(i)), acts.abs().max().item(), rel_tol=1e-6)
        assert math.isclose(value(s, "gradmon_activation_rms", layer=str(i)), acts.pow(2).mean().sqrt().item(), rel_tol=1e-5)
    assert value(s, "gradmon_nonfinite_total", layer="4", tensor="grad", kind="nan") == 3
    assert not [k for k in s if dict(k[1]).get("layer") == "4.2"]  # no per-layer series past the budget


def test_flat_names_are_grouped_into_consecutive_ranges_not_one_bucket():
    names = [f"{i}.0" for i in range(1000)]
    g = group_layers(names, per_layer=13, budget=2000)
    assert len(g.names) * 13 <= 2000 and len(g.names) > 100
    assert g.names[0] == "0..6" and g.of_layer[6] == 0 and g.of_layer[7] == 1
