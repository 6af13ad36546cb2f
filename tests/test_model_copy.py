"""A monitored model can be copied and saved whole: the copy (an EMA model, a teacher) and the
loaded model are models of their own, unmonitored, and the monitored one goes on as before.
gradmon leaves in the model only what copies that way (``capture/modelhooks.py``)."""

from __future__ import annotations

import copy
import functools
import io
import os
import sys
from typing import List

import torch
from prometheus_client import CollectorRegistry
from torch import nn

import gradmon

GRADMON_DIR = os.path.dirname(gradmon.__file__)


def chain(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(blocks)))


def monitored_blocks(fn) -> int:
    """The top-level blocks whose forward ran gradmon's (``BlockForward``) while ``fn()`` runs."""
    seen: List[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("modelhooks.py") and frame.f_code.co_name == "__call__":
            seen.append(type(frame.f_locals.get("self")).__name__)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen.count("BlockForward")


def gradmon_calls(fn) -> List[str]:
    """The gradmon functions entered while ``fn()`` runs, but for ``nothing``: the hook a copy
    keeps where gradmon's was (a module's hooks cannot be taken out of its copy)."""
    seen: List[str] = []

    def profile(frame, event, arg):
        if (event == "call" and frame.f_code.co_filename.startswith(GRADMON_DIR)
                and frame.f_code.co_name != "nothing"):
            seen.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def attach(model: nn.Module) -> gradmon.Monitor:
    return gradmon.attach(model, registry=CollectorRegistry(), final_scrape_timeout=0, ui=False, announce=False)


def test_a_deep_copy_of_a_monitored_model_is_an_unmonitored_model_of_its_own():
    model = chain(8)  # block #8's check is timed on ordinary steps (forward.WAIT_TIMED)
    mon = attach(model)
    try:
        train(model)
        ema = copy.deepcopy(model)
        x = torch.randn(4, 8)
        assert torch.equal(ema(x), model(x))
        assert gradmon_calls(lambda: ema(x).sum().backward()) == []  # the copy runs no gradmon code
        with torch.no_grad():
            for p in ema.parameters():
                p.zero_()
        # its blocks are its own: zeroed weights give zeros, the monitored model is untouched
        assert torch.equal(ema(x), torch.zeros(4, 8)) and not torch.equal(model(x), torch.zeros(4, 8))
        train(model)
        assert mon.flush(10) and mon._errors.total() == 0
        assert monitored_blocks(lambda: model(x)) == 8  # the monitored model still is
        copied = gradmon.attach(ema, registry=CollectorRegistry(), final_scrape_timeout=0, ui=False,
                                announce=False, name="ema")  # and the copy can be, on its own
        try:
            train(ema)
            assert copied.flush(10) and copied._errors.total() == 0
            assert monitored_blocks(lambda: ema(x)) == 8
        finally:
            copied.detach()
    finally:
        mon.detach()


def test_a_monitored_model_saved_whole_loads_as_an_unmonitored_model():
    model = chain()
    mon = attach(model)
    try:
        train(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x = torch.randn(4, 8)
        assert torch.equal(loaded(x), model(x))
        assert gradmon_calls(lambda: loaded(x).sum().backward()) == []
    finally:
        mon.detach()


def test_detach_gives_each_block_back_the_forward_it_had():
    model = chain()
    own = functools.partial(nn.Sequential.forward, model[1])  # an instance forward of its own (accelerate's way)
    model[1].forward = own
    mon = attach(model)
    train(model)
    mon.detach()
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__
    assert model[1].__dict__["forward"] is own
    assert not any(block._forward_hooks for block in model)
    x = torch.randn(4, 8)
    assert gradmon_calls(lambda: model(x)) == []


def test_a_forward_wrapped_by_someone_else_after_attach_still_runs_after_detach():
    model = chain()
    mon = attach(model)
    inner = model[0].forward
    model[0].forward = lambda *args: inner(*args)  # a wrapper that calls gradmon's
    train(model)
    mon.detach()
    x = torch.randn(4, 8)
    assert gradmon_calls(lambda: model(x)) == ["__call__"]  # called through, checking nothing
    assert torch.equal(model(x), nn.Sequential.forward(model, x))
