"""Issue 23: the attention projections' and the logits' growth since attach
(gradmon_activation_growth), checked against the outputs the test captured itself."""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch
from torch import nn

from conftest import scrape, value
from gradmon.config import resolve

GROWTH = "gradmon_activation_growth"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.q_proj(x) * self.k_proj(x)))


class Tiny(nn.Module):
    """Two blocks with query/key projections, a norm after them and a linear head."""

    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(model: nn.Module, mon, scales: List[float]) -> Dict[str, List[float]]:
    """One step per scale of the input (a growth the test controls); each watched layer's
    max |x| per step, captured by the test's own hooks."""
    names = ["blocks.0.q_proj", "blocks.0.k_proj", "blocks.1.q_proj", "blocks.1.k_proj", "head", "blocks.0.fc"]
    seen: Dict[str, List[float]] = {n: [] for n in names}
    modules = dict(model.named_modules())
    for n in names:
        modules[n].register_forward_hook(lambda m, i, o, n=n: seen[n].append(o.detach().abs().max().item()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(1)
    for scale in scales:
        model(torch.randn(16, 8) * scale).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert mon.flush(10)
    return seen


def test_growth_is_each_watched_layers_max_over_its_first_and_only_they_have_it(attach):
    torch.manual_seed(0)
    model = Tiny()
    mon = attach(model, detail_every=1, incident_dir="")
    seen = train(model, mon, [1.0, 2.0, 5.0])
    samples = scrape(mon.url)
    for layer in ("blocks.0.q_proj", "blocks.0.k_proj", "blocks.1.q_proj", "blocks.1.k_proj"):
        want = seen[layer][-1] / seen[layer][0]
        assert value(samples, GROWTH, layer=layer, role="attention") == pytest.approx(want, rel=1e-5)
    assert value(samples, GROWTH, layer="head", role="output") == pytest.approx(
        seen["head"][-1] / seen["head"][0], rel=1e-5)
    named = {dict(labels)["layer"] for (name, labels) in samples if name == GROWTH}
    assert named == {"blocks.0.q_proj", "blocks.0.k_proj", "blocks.1.q_proj", "blocks.1.k_proj", "head"}
    # the rank-level gauge: the largest projection's growth, named (never the logits')
    growths = {layer: seen[layer][-1] / seen[layer][0] for layer in named - {"head"}}
    top = max(growths, key=growths.get)
    assert value(samples, GROWTH + "_worst", layer=top) == pytest.approx(growths[top], rel=1e-5)


def test_growth_moves_on_detail_steps_only_and_keeps_the_first_measurement_as_its_reference(attach):
    torch.manual_seed(0)
    model = Tiny()
    mon = attach(model, detail_every=2, incident_dir="")
    seen = train(model, mon, [1.0, 9.0, 3.0, 9.0])  # detail steps: the 1st and the 3rd
    got = value(scrape(mon.url), GROWTH, layer="blocks.1.q_proj", role="attention")
    assert got == pytest.approx(seen["blocks.1.q_proj"][2] / seen["blocks.1.q_proj"][0], rel=1e-5)


def test_attention_layers_names_the_projections_and_empty_watches_none(attach):
    torch.manual_seed(0)
    model = Tiny()
    mon = attach(model, detail_every=1, incident_dir="", attention_layers="blocks.1.*")
    train(model, mon, [1.0, 2.0])
    named = {dict(labels)["layer"] for (name, labels) in scrape(mon.url)
             if name == GROWTH and dict(labels)["role"] == "attention"}
    assert named == {"blocks.1.q_proj", "blocks.1.k_proj", "blocks.1.fc"}
    mon.detach()

    model = Tiny()
    mon = attach(model, detail_every=1, incident_dir="", attention_layers=())
    train(model, mon, [1.0, 2.0])
    roles = {dict(labels)["role"] for (name, labels) in scrape(mon.url) if name == GROWTH}
    assert roles == {"output"}


def test_a_model_without_a_linear_layer_has_no_output_growth(attach):
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.Tanh())
    mon = attach(model, detail_every=1, incident_dir="")
    model(torch.randn(4, 2, 3)).sum().backward()
    assert mon.flush(10)
    assert not [k for k in scrape(mon.url) if k[0] == GROWTH]


def test_bad_attention_layers_are_refused_at_attach():
    with pytest.raises(ValueError, match="attention_layers"):
        resolve({"attention_layers": ("*.q", "")}, environ={})
    with pytest.raises(TypeError, match="attention_layers"):
        resolve({"attention_layers": 3}, environ={})
    assert resolve({}, environ={"GRADMON_ATTENTION_LAYERS": "*.wq, *.wk"}).attention_layers == ("*.wq", "*.wk")


def test_a_growth_counts_one_event_step_at_its_bar_and_at_each_doubling_of_it(attach):
    torch.manual_seed(0)
    model = Tiny()
    mon = attach(model, detail_every=1, incident_dir="")
    seen = train(model, mon, [1.0, 10.0, 12.0, 30.0, 30.0, 70.0])
    bar = 8.0  # Thresholds().attention_growth
    reached = {n: -1 for n in ("blocks.0.q_proj", "blocks.0.k_proj", "blocks.1.q_proj", "blocks.1.k_proj")}
    events = []
    for k in range(1, 6):
        new = False
        for n in reached:
            growth = seen[n][k] / seen[n][0]
            level = math.floor(math.log2(growth / bar)) if growth >= bar else -1
            if level > reached[n]:
                reached[n], new = level, True
        if new:
            events.append(k)
    assert len(events) >= 2  # the scales above make at least the bar and one doubling
    samples = scrape(mon.url)
    assert value(samples, "gradmon_spike_steps_total", signal="attention_growth") == len(events)
    assert value(samples, "gradmon_steps_since_spike", signal="attention_growth") == 5 - events[-1]


def test_a_growth_event_is_not_evidence_that_a_loss_jump_the_step_after_is_the_model(attach):
    """A loss back at its starting level the step after a layer's gradient spiked pages at once
    (the gradients led it); the step after an attention growth event it does not: a growth
    event is a warning, never page evidence (it was not chosen as such on the tune split).
    The gradients are zero throughout (no gradient signal can spike): only the growth moves."""
    torch.manual_seed(0)
    model = Tiny()
    mon = attach(model, detail_every=1, incident_dir="")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 171):
        if step <= 20:
            loss = 2.0
        else:
            loss = max(0.5, 2.0 - 1.5 * (step - 20) / 80) * (1 + 0.05 * torch.rand(1, generator=g).item())
        if step == 161:
            loss = 2.0  # back at the starting level, one step after the growth event
        scale = 30.0 if step == 160 else 1.0
        (model(torch.randn(16, 8, generator=g) * scale) * 0.0).sum().backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert mon.flush(10)
    samples = scrape(mon.url)
    assert value(samples, "gradmon_spike_steps_total", signal="attention_growth") == 1
    assert value(samples, "gradmon_steps_since_spike", signal="attention_growth") == 10  # at step 160
    assert value(samples, "gradmon_spike_steps_total", signal="loss") >= 1  # the jump was a loss spike
    assert value(samples, "gradmon_loss_divergences_total") == 0
