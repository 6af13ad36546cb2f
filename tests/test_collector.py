"""Python's cyclic collector is held off from a detail step's first training forward to the
step's close (``capture/collector.py``: the young generation's threshold raised), and never
beyond: the step closes, the monitor detaches, the pause outlives its bound, a process forks.
A job that turned the collector off or set its own thresholds is left alone. What it saves is
measured by ``bench/bench_collector.py`` (docs/benchmark.md)."""

from __future__ import annotations

import gc
import os
from typing import List

import pytest
import torch
from torch import nn

import gradmon
from gradmon.capture import collector


def paused() -> bool:
    return gc.get_threshold()[0] == collector.PAUSED_YOUNG


def chain(blocks: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(blocks)))


class Seen:
    """Whether the collector was paused as the training sees it: in a layer's forward and
    in the backward."""

    def __init__(self, model: nn.Module) -> None:
        self.forward: List[bool] = []
        self.backward: List[bool] = []
        self.handle = model[-1][0].register_forward_hook(self._forward)

    def _forward(self, module, args, out) -> None:
        self.forward.append(paused())
        if out.requires_grad:
            out.register_hook(lambda g: self.backward.append(paused()))

    def clear(self) -> None:
        self.forward, self.backward = [], []


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture(autouse=True)
def collector_as_python_starts():
    with collector._lock:  # a monitor an earlier test left mid-step holds no pause here
        for pause in list(collector._open):
            collector._end(pause)
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.set_threshold(700, 10, 10)
    yield
    assert not collector._open, "a pause outlived its test"
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


def test_the_collector_is_held_off_through_a_detail_step_only(attach):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = Seen(model)
    mon = attach(model, detail_every=3)
    assert mon._recorder.detail_now  # the first step is a detail step
    step(model, opt)
    assert seen.forward == [True] and seen.backward == [True]
    assert gc.get_threshold() == (700, 10, 10)  # back once the optimizer step closed it
    seen.clear()
    step(model, opt)
    step(model, opt)
    assert seen.forward == [False, False] and seen.backward == [False, False]  # ordinary steps
    seen.clear()
    step(model, opt)  # the next detail step
    assert seen.forward == [True] and seen.backward == [True] and not paused()


def test_a_detail_step_makes_no_collection(attach, monkeypatch):
    """What the pause is for: the detail step's objects are never looked at. The
    collector's own callbacks count collections from the forward to the optimizer step
    (a young one right after the close is expected: the step's objects are gone by then);
    the same step without the pause makes several."""
    model = chain(300)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    attach(model, detail_every=2)
    step(model, opt)  # detail
    step(model, opt)  # ordinary
    collections: List[int] = []
    during: List[List[int]] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])
    handle = opt.register_step_pre_hook(lambda *args: during.append(list(collections)))
    gc.callbacks.append(count)
    try:
        step(model, opt)  # the detail step: hundreds of records
        step(model, opt)
        collections.clear()
        monkeypatch.setattr(collector.CollectorPause, "hold", lambda self: None)
        step(model, opt)  # the next detail step, not paused
    finally:
        gc.callbacks.remove(count)
        handle.remove()
    assert during[0] == [], during[0]
    assert len(during[2]) >= 3, during[2]


def test_micro_batches_of_a_detail_step_share_one_pause(attach):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = Seen(model)
    attach(model, detail_every=3)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        assert paused()  # held between micro-batches, until the step
    opt.step()
    assert not paused() and seen.forward == [True] * 3


def test_an_evaluation_forward_does_not_pause_the_collector(attach):
    model = chain()
    attach(model, detail_every=1)
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert not paused()
    model.eval()
    model(torch.randn(4, 8))
    assert not paused()


def test_a_job_that_turned_the_collector_off_or_set_its_thresholds_is_left_alone(attach):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    attach(model, detail_every=1)
    gc.disable()
    model(torch.randn(4, 8))
    assert gc.get_threshold() == (700, 10, 10)
    step(model, opt)
    assert not gc.isenabled() and gc.get_threshold() == (700, 10, 10)
    gc.enable()
    model(torch.randn(4, 8)).square().mean().backward()
    assert paused()
    gc.set_threshold(5000, 20, 20)  # the job's own, mid-step
    opt.step()
    assert gc.get_threshold() == (5000, 20, 20)


def test_a_forward_long_after_the_pause_began_ends_it(attach, monkeypatch):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = Seen(model)
    attach(model, detail_every=1)
    monkeypatch.setattr(collector, "LONGEST_S", 0.0)
    model(torch.randn(4, 8))  # gradients, no backward, no step: the pause begins
    assert paused()
    model(torch.randn(4, 8))  # the bound passed: over, and not paused again in this step
    model(torch.randn(4, 8)).square().mean().backward()
    assert not paused() and seen.forward == [True, False, False]
    opt.step()
    seen.clear()
    step(model, opt)  # the next step pauses again
    assert seen.forward == [True] and not paused()


def test_a_pause_left_behind_still_collects_every_paused_young_allocations(attach):
    """A loop that raised in a detail step, its monitor never called again: the collector
    still runs, every PAUSED_YOUNG allocations."""
    model = chain()
    attach(model, detail_every=1)
    model(torch.randn(4, 8))
    assert paused()
    ran: List[int] = []

    def count(phase: str, info: dict) -> None:
        # the young generation's overflow collects the oldest generation that is due with it
        # (the middle one, after every tenth young collection): any generation counts
        if phase == "start":
            ran.append(info["generation"])
    gc.callbacks.append(count)
    try:
        kept = [[] for _ in range(collector.PAUSED_YOUNG + 10_000)]
    finally:
        gc.callbacks.remove(count)
    assert ran and len(kept) > collector.PAUSED_YOUNG


def test_detaching_mid_step_ends_the_pause():
    model = chain()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, detail_every=1)
    try:
        model(torch.randn(4, 8)).square().mean().backward()
        assert paused()
    finally:
        mon.detach()
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_process_forked_during_a_pause_starts_with_the_thresholds_as_they_were(attach):
    model = chain()
    attach(model, detail_every=1)
    model(torch.randn(4, 8))
    assert paused()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker forked mid-step
        os.write(write, b"1" if gc.get_threshold() == (700, 10, 10) else b"0")
        os._exit(0)
    os.close(write)
    got = os.read(read, 1)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert paused()  # the parent's pause goes on


def test_two_monitors_end_the_pause_when_the_last_step_closes(attach):
    a, b = chain(), chain()
    opt_a = torch.optim.SGD(a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-3)
    attach(a, detail_every=1)
    attach(b, detail_every=1)
    a(torch.randn(4, 8)).square().mean().backward()
    b(torch.randn(4, 8)).square().mean().backward()
    opt_a.step()
    assert paused()  # b's step is still open
    opt_b.step()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_pause_that_fails_is_counted_and_training_goes_on(attach, monkeypatch):
    from conftest import fresh, value

    def broken(self) -> None:
        raise RuntimeError("no collector here")
    monkeypatch.setattr(collector.CollectorPause, "hold", broken)
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=1)
    for _ in range(2):
        step(model, opt)  # raises nothing into the loop
    s = fresh(mon)
    assert value(s, "gradmon_hook_errors_total", stage="forward") == 2
    assert value(s, "gradmon_steps_total") == 2
