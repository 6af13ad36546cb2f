"""Python's cyclic collector is paused from a detail step's first training forward to the
step's close (``capture/collector.py``), and never beyond: the step closes, the monitor
detaches, or the pause outlives its bound. A job that turned the collector off itself is left
alone. What it saves is measured by ``bench/bench_layers.py`` (docs/benchmark.md)."""

from __future__ import annotations

import gc
from typing import List

import pytest
import torch
from torch import nn

import gradmon
from gradmon.capture import collector


def chain(blocks: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(blocks)))


class Seen:
    """gc.isenabled() as the training sees it: in a layer's forward and in the backward."""

    def __init__(self, model: nn.Module) -> None:
        self.forward: List[bool] = []
        self.backward: List[bool] = []
        self.handle = model[-1][0].register_forward_hook(self._forward)

    def _forward(self, module, args, out) -> None:
        self.forward.append(gc.isenabled())
        if out.requires_grad:
            out.register_hook(lambda g: self.backward.append(gc.isenabled()))

    def clear(self) -> None:
        self.forward, self.backward = [], []


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    assert collector._holders == 0, "a pause outlived its test"
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_through_a_detail_step_only(attach):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = Seen(model)
    mon = attach(model, detail_every=3)
    assert mon._recorder.detail_now  # the first step is a detail step
    step(model, opt)
    assert seen.forward == [False] and seen.backward == [False]
    assert gc.isenabled()  # back once the optimizer step closed it
    seen.clear()
    step(model, opt)
    step(model, opt)
    assert seen.forward == [True, True] and seen.backward == [True, True]  # ordinary steps
    seen.clear()
    step(model, opt)  # the next detail step
    assert seen.forward == [False] and seen.backward == [False] and gc.isenabled()


def test_micro_batches_of_a_detail_step_share_one_pause(attach):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = Seen(model)
    attach(model, detail_every=3)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        assert not gc.isenabled()  # held between micro-batches, until the step
    opt.step()
    assert gc.isenabled() and seen.forward == [False] * 3


def test_an_evaluation_forward_does_not_pause_the_collector(attach):
    model = chain()
    attach(model, detail_every=1)
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert gc.isenabled()
    model.eval()
    model(torch.randn(4, 8))
    assert gc.isenabled()


def test_a_job_that_turned_the_collector_off_keeps_it_off(attach):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    attach(model, detail_every=1)
    gc.disable()
    step(model, opt)
    model(torch.randn(4, 8))
    assert not gc.isenabled()  # not turned on at the close, nor by the next forward
    gc.enable()
    step(model, opt)
    assert gc.isenabled()


def test_a_forward_no_step_follows_gives_the_collector_back_past_the_bound(attach, monkeypatch):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = Seen(model)
    attach(model, detail_every=1)
    monkeypatch.setattr(collector, "LONGEST_S", 0.0)
    model(torch.randn(4, 8))  # gradients, no backward, no step: the pause begins
    assert not gc.isenabled()
    model(torch.randn(4, 8))  # the bound passed: back on, and not paused again in this step
    model(torch.randn(4, 8)).square().mean().backward()
    assert gc.isenabled() and seen.forward == [False, True, True]
    opt.step()
    seen.clear()
    step(model, opt)  # the next step pauses again
    assert seen.forward == [False] and gc.isenabled()


def test_detaching_mid_step_gives_the_collector_back():
    model = chain()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, detail_every=1)
    try:
        model(torch.randn(4, 8)).square().mean().backward()
        assert not gc.isenabled()
    finally:
        mon.detach()
    assert gc.isenabled()


def test_two_monitors_give_the_collector_back_when_the_last_step_closes(attach):
    a, b = chain(), chain()
    opt_a = torch.optim.SGD(a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-3)
    attach(a, detail_every=1)
    attach(b, detail_every=1)
    a(torch.randn(4, 8)).square().mean().backward()
    b(torch.randn(4, 8)).square().mean().backward()
    opt_a.step()
    assert not gc.isenabled()  # b's step is still open
    opt_b.step()
    assert gc.isenabled()
