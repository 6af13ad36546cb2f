"""Hardening against what real training loops do: a forward or backward that raises,
gradients assigned by hand, parameters replaced after attach, unhashable optimizers,
float64 models, re-attaching under the same name, fork(); and a detach()/attach() that
are exception-safe and leave nothing behind.

Every expected number is computed independently with plain torch (the value
``clip_grad_norm_`` returns, ``torch.linalg.vector_norm`` over gradients, the test's own
forward and tensor hooks) and compared with what a real HTTP scrape of the endpoint says.
"""

from __future__ import annotations

import _thread
import copy
import gc
import http.client
import json
import math
import os
import select
import signal
import socket
import threading
import time
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import pytest
import torch
from torch import nn

import gradmon
from conftest import fresh, scrape, value
from servers import free_port
from test_lifecycle import hook_state, optimizer_hook_count

REL = 1e-5


# -- helpers -------------------------------------------------------------------------------

def close(got: float, want: float, rel: float = REL) -> bool:
    return math.isclose(got, want, rel_tol=rel, abs_tol=1e-12)


def hook_errors(s: Dict) -> Dict[str, float]:
    out = {dict(labels).get("stage"): v for (name, labels), v in s.items() if name == "gradmon_hook_errors_total"}
    assert out, "no gradmon_hook_errors_total series on the endpoint"
    return out


def norm_of(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm over all elements of ``tensors``, in float64."""
    per = [torch.linalg.vector_norm(t.detach().double()) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(per)).item()


def module_grad_norm(module: nn.Module) -> float:
    return norm_of(p.grad for p in module.parameters(recurse=False) if p.grad is not None)


def gradmon_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("gradmon") and t.is_alive()}


def port_refuses(port: int) -> bool:
    """True once nothing listens on ``port``. A reset means the connection reached a
    listener that closed under it: not refused yet, ask again."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False


def all_hooks(model: nn.Module) -> list:
    """test_lifecycle's hook_state plus the parameters' post-accumulate-grad hooks."""
    return hook_state(model) + [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]


def pipeline_internals(mon) -> Tuple[int, Optional[int]]:
    """(items waiting in the publisher's queue, steps the recorder counted). The one place
    this file reads gradmon's internals; None/absent parts read as "nothing there"."""
    publisher = getattr(mon, "_publisher", None)
    recorder = getattr(mon, "_recorder", None)
    queued = publisher._queue.qsize() if publisher is not None else 0
    return queued, (recorder.steps if recorder is not None else None)


class Switch:
    """Which exception the backward fault point raises (None: it passes gradients on)."""

    exc: Optional[type] = None


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises ``switch.exc`` when set, partway through
    the backward pass (the layers after it already got their gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, switch: Switch) -> torch.Tensor:
        ctx.switch = switch
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.switch.exc is not None:
            raise ctx.switch.exc("backward failed on purpose")
        return grad, None


class FlakyLinear(nn.Linear):
    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("forward failed on purpose")
        return super().forward(x)


class Net(nn.Module):
    """fc1 -> relu -> (backward fault point) -> fc2 -> relu -> head. Layers: fc1, fc2, head.
    When ``head.fail`` is set the input is scaled by 1000 (huge activations in fc1, fc2)
    and head's forward raises."""

    LAYERS = ("fc1", "fc2", "head")

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, width)
        self.head = FlakyLinear(width, 4)
        self.backward_fault = Switch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head.fail:
            x = x * 1000
        h = torch.relu(self.fc1(x))
        h = RaiseInBackward.apply(h, self.backward_fault)
        h = torch.relu(self.fc2(h))
        return self.head(h)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


# -- 8: an exception out of backward ----------------------------------------------------------

@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_backward_that_raises_keeps_later_global_norms_pre_clip(attach, exc):
    torch.manual_seed(8)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    checked = 0
    for i in range(6):
        x, y = torch.randn(16, 8), 3 * torch.randn(16, 4)
        loss = (model(x) - y).pow(2).mean()
        if i == 2:
            model.backward_fault.exc = exc
            try:
                loss.backward()
            except BaseException as caught:  # noqa: BLE001 - KeyboardInterrupt is the point
                assert isinstance(caught, exc)
            else:
                pytest.fail("the backward fault point did not raise")
            finally:
                model.backward_fault.exc = None
            opt.zero_grad()
            continue
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
        assert total > 0.1, "the clip must really change the gradients for this test to mean anything"
        opt.step()
        opt.zero_grad()
        s = fresh(mon)
        got = value(s, "gradmon_grad_global_norm")
        assert close(got, total), f"iteration {i}: gradmon says {got}, clip_grad_norm_ returned {total}"
        checked += i > 2
    assert checked == 3
    assert all(v == 0 for v in hook_errors(s).values()), hook_errors(s)


# -- 9: .grad assigned by hand after torch.autograd.grad -----------------------------------------

def assign_grads_by_hand(model: nn.Module, params: List[torch.Tensor], poison: bool = False) -> List[torch.Tensor]:
    """The meta-learning pattern: torch.autograd.grad, then ``.grad`` assigned by hand."""
    loss = model(torch.randn(16, 8)).pow(2).mean()
    grads = [g.clone() for g in torch.autograd.grad(loss, params)]
    if poison:
        grads[0].view(-1)[0] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    return grads


def hand_assigned_setup(attach):
    torch.manual_seed(9)
    model = Net()
    params = list(model.parameters())
    return model, params, torch.optim.SGD(params, lr=0.01), attach(model)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grads_assigned_by_hand_after_autograd_grad_give_the_global_norm(attach, set_to_none):
    model, params, opt, mon = hand_assigned_setup(attach)
    for i in range(4):
        want = norm_of(assign_grads_by_hand(model, params))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        s = fresh(mon)
        assert value(s, "gradmon_steps_total") == i + 1
        got = value(s, "gradmon_grad_global_norm")
        assert close(got, want), f"step {i}: gradmon says {got}, the assigned grads have norm {want}"


def test_grads_assigned_by_hand_are_stated_once_in_the_log_and_in_coverage(attach, caplog):
    model, params, opt, mon = hand_assigned_setup(attach)
    train(model, opt)  # an ordinary backward: measured at its end, nothing to state
    assert mon.flush() and mon.coverage().measured_at_step == 0
    for _ in range(3):
        assign_grads_by_hand(model, params)
        torch.nn.utils.clip_grad_norm_(params, 1e-3)
        opt.step()
        opt.zero_grad()
    assert mon.flush()
    cov = mon.coverage()
    assert cov.measured_at_step == 3
    assert cov["head"] == frozenset({"grad", "grad_flow", "activation", "optimizer"})  # still reads as {layer: families}
    said = [r for r in caplog.records if "measured at the optimizer step" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_nan_in_a_grad_assigned_by_hand_counts_one_nonfinite_step(attach, set_to_none):
    model, params, opt, mon = hand_assigned_setup(attach)
    counts = []
    for i in range(3):
        # NaN on the last step only, so that SGD does not spread it into the weights
        assign_grads_by_hand(model, params, poison=i == 2)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        counts.append(value(fresh(mon), "gradmon_nonfinite_steps_total"))
    assert counts == [0, 0, 1]


# -- 10: detach() is exception-safe and complete ---------------------------------------------------

def test_detach_inside_on_nonfinite_callback_tears_everything_down(attach):
    before = gradmon_threads()
    torch.manual_seed(10)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    holder = {}
    mon = attach(model, on_nonfinite=lambda incident: holder["mon"].detach())
    holder["mon"] = mon
    port = mon.port
    train(model, opt, 1)
    assert value(fresh(mon), "gradmon_steps_total") == 1
    x = torch.randn(16, 8)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    opt.step()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if mon.state == "detached" and port_refuses(port) and not gradmon_threads() - before:
            break
        time.sleep(0.05)
    assert mon.state == "detached"
    assert port_refuses(port), f"port {port} still accepts connections after detach() in on_nonfinite"
    assert not gradmon_threads() - before, f"left running: {gradmon_threads() - before}"
    mon.detach()  # a second detach is a no-op, not an error


def test_final_scrape_wait_does_not_block_another_models_attach(attach):
    torch.manual_seed(10)
    a = attach(Net(), port=free_port(), final_scrape_timeout=3)
    scrape(a.url)  # a periodic scraper (two scrapes) is what the final-scrape wait waits for
    time.sleep(0.5)
    scrape(a.url)
    detaching = threading.Thread(target=a.detach, name="test-detach-a", daemon=True)
    detaching.start()
    try:
        time.sleep(0.3)
        assert detaching.is_alive(), "A's detach() should be waiting for its final scrape"
        t0 = time.monotonic()
        b = attach(Net())
        took = time.monotonic() - t0
        assert b.state == "running"
    finally:
        detaching.join(10)
    assert took < 1.0, f"attach() of another model waited {took:.2f}s for A's final-scrape wait"


def test_head_requests_are_not_scrapes_for_the_final_scrape_wait(attach):
    mon = attach(Net(), final_scrape_timeout=3)
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", mon.port, timeout=5)
        try:
            conn.request("HEAD", "/metrics")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
        finally:
            conn.close()
    t0 = time.monotonic()
    mon.detach()
    took = time.monotonic() - t0
    assert took < 1.0, f"detach() waited {took:.2f}s for a final scrape although only HEAD requests came"


def test_a_detach_that_failed_partway_is_completed_by_the_next_one(attach, monkeypatch, caplog):
    from gradmon.serve import endpoint
    before = gradmon_threads()
    model = Net()
    mon = attach(model)
    port = mon.port
    real_release = endpoint.release
    monkeypatch.setattr(endpoint, "release", lambda *a: (_ for _ in ()).throw(OSError("injected")))
    mon.detach()  # must not raise: the failure is logged, the rest of the teardown still runs
    assert mon.state == "detached" and "detach() again retries the rest" in caplog.text
    assert hook_state(model) == hook_state(Net()), "hooks must be gone even though a later part failed"
    assert not port_refuses(port), "the injected failure kept the endpoint: nothing to retry otherwise"
    monkeypatch.setattr(endpoint, "release", real_release)
    mon.detach()
    assert port_refuses(port)
    assert not gradmon_threads() - before


def test_ctrl_c_during_the_final_scrape_wait_still_tears_everything_down(attach):
    before = gradmon_threads()
    mon = attach(Net(), final_scrape_timeout=5)
    port = mon.port
    scrape(mon.url)  # a periodic scraper (two scrapes) is what the final-scrape wait waits for
    time.sleep(0.5)
    scrape(mon.url)
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(0.5, interrupt)
    raised = False
    t0 = time.monotonic()
    took = None
    try:
        try:
            timer.start()
            mon.detach()
        finally:
            took = time.monotonic() - t0
            timer.cancel()
        if fired.is_set():  # detach() returned: a pending interrupt lands here, not in pytest
            for _ in range(100):
                time.sleep(0.01)
    except KeyboardInterrupt:
        raised = True
    assert fired.is_set(), f"detach() returned after {took:.2f}s, before the interrupt: it did not wait"
    assert took < 4.0, f"the interrupt did not end the final-scrape wait (detach took {took:.2f}s)"
    assert mon.state == "detached"
    assert port_refuses(port), f"port {port} still open after a Ctrl-C in detach() (raised={raised})"
    assert not gradmon_threads() - before, f"left running: {gradmon_threads() - before}"


# -- 11: a failed attach leaves nothing behind ----------------------------------------------------

def _assert_nothing_left(model, hooks, opt_hooks, threads) -> None:
    assert all_hooks(model) == hooks, "the failed attach left hooks on the model"
    assert optimizer_hook_count() == opt_hooks, "the failed attach left global optimizer hooks"
    assert not gradmon_threads() - threads, f"the failed attach left threads: {gradmon_threads() - threads}"


def _assert_attach_works(attach, model) -> None:
    mon = attach(model)
    assert mon.state == "running"
    train(model, torch.optim.SGD(model.parameters(), lr=0.01), 1)
    assert value(fresh(mon), "gradmon_steps_total") == 1


def test_failed_attach_with_an_integer_addr_leaves_nothing_behind(attach):
    model = Net()
    hooks, opt_hooks, threads = all_hooks(model), optimizer_hook_count(), gradmon_threads()
    with pytest.raises((TypeError, ValueError), match="addr"):
        gradmon.attach(model, addr=2130706433, port=0)
    _assert_nothing_left(model, hooks, opt_hooks, threads)
    _assert_attach_works(attach, model)


def test_failed_attach_with_port_plus_local_rank_past_65535_leaves_nothing_behind(attach, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = Net()
    hooks, opt_hooks, threads = all_hooks(model), optimizer_hook_count(), gradmon_threads()
    with pytest.raises(ValueError, match="port"):
        gradmon.attach(model, port=65535, addr="127.0.0.1")
    _assert_nothing_left(model, hooks, opt_hooks, threads)
    _assert_attach_works(attach, model)


# -- 12: parameters replaced after attach -----------------------------------------------------------

def _seq() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _train_checking_layer_0(model: nn.Sequential, mon, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # a new optimizer over the new parameters
    for i in range(steps):
        model(torch.randn(16, 64)).pow(2).mean().backward()
        want_layer = norm_of([model[0].weight.grad, model[0].bias.grad])
        want_global = norm_of(p.grad for p in model.parameters())
        opt.step()
        opt.zero_grad()
        s = fresh(mon)
        assert close(value(s, "gradmon_grad_norm", layer="0"), want_layer), f"step {i}"
        assert close(value(s, "gradmon_grad_global_norm"), want_global), f"step {i}"
    assert value(s, "gradmon_steps_total") == steps


def test_parameter_replaced_after_attach_is_measured_and_the_old_one_freed(attach):
    torch.manual_seed(12)
    model = _seq()
    mon = attach(model)
    old = weakref.ref(model[0].weight)
    model[0].weight = nn.Parameter(0.1 * torch.randn(64, 64))
    _train_checking_layer_0(model, mon)
    gc.collect()
    assert old() is None, "gradmon keeps the replaced parameter alive"
    assert mon.state == "running"


def test_load_state_dict_assign_after_attach_is_measured_and_the_old_params_freed(attach):
    torch.manual_seed(12)
    model = _seq()
    mon = attach(model)
    old = weakref.ref(model[0].weight)
    model.load_state_dict(_seq().state_dict(), assign=True)
    assert model[0].weight is not old()
    _train_checking_layer_0(model, mon)
    gc.collect()
    assert old() is None, "gradmon keeps the replaced parameter alive"
    assert mon.state == "running"


# -- 13: an unhashable optimizer -------------------------------------------------------------------

class EqSGD(torch.optim.SGD):
    """Defines __eq__ without __hash__, so instances are unhashable."""

    def __eq__(self, other: object) -> bool:
        return self is other


def test_unhashable_optimizer_of_the_monitored_model_steps_and_is_counted(attach):
    model = Net()
    opt = EqSGD(model.parameters(), lr=0.01)
    with pytest.raises(TypeError):
        hash(opt)
    mon = attach(model)
    train(model, opt, 3)
    assert value(fresh(mon), "gradmon_steps_total") == 3


def test_unhashable_optimizer_of_an_unrelated_model_steps_while_another_is_monitored(attach):
    monitored, other = Net(), Net()
    opt = torch.optim.SGD(monitored.parameters(), lr=0.01)
    other_opt = EqSGD(other.parameters(), lr=0.01)
    mon = attach(monitored)
    for _ in range(2):
        train(other, other_opt, 1)
        train(monitored, opt, 1)
    assert value(fresh(mon), "gradmon_steps_total") == 2


# -- 14: a forward or backward that raises leaks nothing into the next step -----------------------

def test_forward_that_raises_leaks_no_activation_stats_into_the_next_step(attach):
    torch.manual_seed(14)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref: Dict[str, List[Tuple[float, float]]] = {}

    def keep(name):
        def hook(mod, inp, out):
            ref.setdefault(name, []).append((out.detach().double().pow(2).mean().sqrt().item(),
                                             out.detach().abs().max().item()))
        return hook

    for name in Net.LAYERS:
        model.get_submodule(name).register_forward_hook(keep(name))
    mon = attach(model, detail_every=1)
    train(model, opt, 1)
    model.head.fail = True
    with pytest.raises(RuntimeError, match="on purpose"):
        model(torch.randn(16, 8))
    model.head.fail = False
    opt.zero_grad()
    ref.clear()
    train(model, opt, 1)  # the clean step
    s = fresh(mon)
    for name in Net.LAYERS:
        (rms, amax), = ref[name]
        got = value(s, "gradmon_activation_abs_max", layer=name)
        assert close(got, amax), f"{name}: abs_max {got}, the clean step's max|output| is {amax}"
        got = value(s, "gradmon_activation_rms", layer=name)
        assert close(got, rms), f"{name}: rms {got}, the clean step's rms is {rms}"


def test_backward_that_raises_leaks_no_grad_flow_into_the_next_step(attach):
    torch.manual_seed(14)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flow: Dict[str, float] = {}

    def keep(name):
        def hook(mod, inp, out):
            out.register_hook(lambda g: flow.__setitem__(name, torch.linalg.vector_norm(g.double()).item()))
        return hook

    for name in Net.LAYERS:
        model.get_submodule(name).register_forward_hook(keep(name))
    mon = attach(model, detail_every=1)
    train(model, opt, 1)
    model.backward_fault.exc = RuntimeError
    loss = model(10 * torch.randn(16, 8)).pow(2).mean()
    with pytest.raises(RuntimeError, match="on purpose"):
        loss.backward()
    model.backward_fault.exc = None
    opt.zero_grad()
    flow.clear()
    train(model, opt, 1)  # the clean step
    s = fresh(mon)
    assert sorted(flow) == sorted(Net.LAYERS)
    for name, want in flow.items():
        got = value(s, "gradmon_grad_flow_norm", layer=name)
        assert close(got, want), f"{name}: grad_flow_norm {got}, the clean step's is {want}"


# -- 15: float64 layers ------------------------------------------------------------------------------

def test_float64_model_is_measured_without_errors_and_matches_float64_references(attach):
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    layers = ("0", "2", "4")
    ref: Dict[Tuple[str, str], float] = {}

    def keep(name):
        def hook(mod, inp, out):
            ref["rms", name] = out.detach().pow(2).mean().sqrt().item()
            ref["max", name] = out.detach().abs().max().item()
            out.register_hook(lambda g: ref.__setitem__(("flow", name), torch.linalg.vector_norm(g).item()))
        return hook

    for name in layers:
        model.get_submodule(name).register_forward_hook(keep(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1)
    for _ in range(3):
        model(torch.randn(8, 6, dtype=torch.float64)).pow(2).sum().backward()
        for name in layers:
            ref["grad", name] = module_grad_norm(model.get_submodule(name))
        opt.step()
        opt.zero_grad()
    s = fresh(mon)
    assert all(v == 0 for v in hook_errors(s).values()), hook_errors(s)
    for family, metric in (("rms", "gradmon_activation_rms"), ("max", "gradmon_activation_abs_max"),
                           ("flow", "gradmon_grad_flow_norm"), ("grad", "gradmon_grad_norm")):
        for name in layers:
            got, want = value(s, metric, layer=name), ref[family, name]
            assert close(got, want, rel=1e-6), f"{metric}{{layer={name}}}: {got} != {want}"


# -- 16: counters continue on re-attach under the same name ----------------------------------------

def test_counters_never_go_backwards_on_reattach_under_the_same_name(attach):
    torch.manual_seed(16)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, name="m")
    for i in range(3):
        x = torch.randn(16, 8)
        if i == 1:
            clean = copy.deepcopy(model.state_dict())
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            model.load_state_dict(clean)  # in place: the NaN step does not poison the next ones
    first = fresh(mon)
    nan_fc1 = value(first, "gradmon_nonfinite_total", layer="fc1", tensor="grad", kind="nan")
    assert value(first, "gradmon_steps_total") == 3
    assert nan_fc1 > 0 and value(first, "gradmon_nonfinite_steps_total") == 1
    mon.detach()

    again = attach(model, name="m")
    assert again.name == "m"
    train(model, opt, 1)
    second = fresh(again)
    assert value(second, "gradmon_steps_total", model="m") >= 4
    assert value(second, "gradmon_nonfinite_total", model="m", layer="fc1", tensor="grad", kind="nan") >= nan_fc1
    assert value(second, "gradmon_nonfinite_steps_total", model="m") >= 1


# -- 7b: a forked child is inert -----------------------------------------------------------------

def _read_child(pid: int, fd: int, timeout: float) -> Tuple[bytes, Optional[int]]:
    """What the child wrote, and its exit code (None: it hung and was killed)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    for _ in range(50):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return data, os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return data, None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_that_trains_is_inert_and_can_attach_its_own_monitor(attach):
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    mon = attach(model)
    train(model, opt, 1)
    assert value(fresh(mon), "gradmon_steps_total") == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code, report = 3, {"error": "child did not finish"}
        try:
            os.close(r)
            queued0, steps0 = pipeline_internals(mon)
            train(model, opt, 500)
            queued1, steps1 = pipeline_internals(mon)
            report = {"queued_before": queued0, "queued_after": queued1, "steps_before": steps0,
                      "steps_after": steps1}
            # docs/integrations.md's way to monitor a child that trains: its own attach, its own port
            own = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, name="child")
            train(model, opt, 2)
            report.update(child_steps=value(fresh(own), "gradmon_steps_total"), child_port=own.port)
            own.detach()
            code = 0
        except BaseException as exc:  # noqa: BLE001
            report = {"error": repr(exc)}
        finally:
            try:
                os.write(w, json.dumps(report).encode())
            finally:
                os._exit(code)
    os.close(w)
    try:
        data, code = _read_child(pid, r, timeout=120)
    finally:
        os.close(r)
    assert code == 0, f"child exit code {code}, report {data!r}"
    report = json.loads(data)
    assert report["queued_after"] == 0, f"the child's publisher queue grew: {report}"
    assert report["steps_after"] == report["steps_before"], f"the child's recorder counted steps: {report}"
    assert report["child_steps"] == 2 and report["child_port"] != mon.port, report
    assert value(fresh(mon), "gradmon_steps_total") == 1
