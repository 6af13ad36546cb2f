"""gradmon's host cost on an ordinary step, checked by structure rather than by timing
(issue 26): how many times Python is entered from PyTorch, and what each entry costs, must
not grow with the layers; the guarantees that cost paid for before still hold."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Callable, List, Optional, Tuple

import pytest
import torch
from torch import nn

import gradmon
from gradmon.aggregate import publisher as publisher_module
from conftest import Leaves, fresh, origins, value

GRADMON_DIR = os.path.dirname(gradmon.__file__)
# what gradmon leaves in the model (a block's forward, a hook) only calls through: the entry
# counted is the function it calls
CALLED_THROUGH = os.path.join(GRADMON_DIR, "capture", "modelhooks.py")


def _in_gradmon(frame) -> bool:
    return (frame is not None and frame.f_code.co_filename.startswith(GRADMON_DIR)
            and frame.f_code.co_filename != CALLED_THROUGH)


def _called_by_gradmon(frame) -> bool:
    while frame is not None:
        if _in_gradmon(frame):
            return True
        frame = frame.f_back
    return False


class Entries:
    """Counts the calls that enter gradmon's code from PyTorch or the training loop with
    no gradmon frame below (a hook, a callback, an optimizer step hook) while active, by
    the name of the function entered."""

    def __init__(self) -> None:
        self.names: List[str] = []

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and _in_gradmon(frame) and not _called_by_gradmon(frame.f_back):
            self.names.append(frame.f_code.co_name)

    def __enter__(self) -> "Entries":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def chain(blocks: int, layers_per_block: int = 1) -> nn.Module:
    """``blocks`` top-level blocks, each ``layers_per_block`` Linear+Tanh pairs."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(*(m for _ in range(layers_per_block) for m in (nn.Linear(8, 8), nn.Tanh())))
                           for _ in range(blocks)))


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, forward: Callable[[torch.Tensor], torch.Tensor],
             clip: float = 0.0) -> float:
    forward(torch.randn(4, 8)).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else 0.0
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def entries_of_an_ordinary_step(model: nn.Module) -> List[str]:
    """One monitor alone in the process: another's global optimizer hooks would count."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0)
    try:
        for _ in range(3):  # past the detail step 0 and the first step's probing
            sgd_step(model, opt, model)
        assert not mon._recorder.detail_now
        with Entries() as seen:
            sgd_step(model, opt, model)
        return seen.names
    finally:
        mon.detach()


def test_an_ordinary_step_enters_python_a_few_times_per_step_whatever_the_blocks():
    few = entries_of_an_ordinary_step(chain(10))
    many = entries_of_an_ordinary_step(chain(40))
    # every block's output is kept in its own forward (BlockForward), entering no gradmon
    # function, the timed ones (one in WAIT_TIMED) included
    assert len(many) == len(few), (sorted(few), sorted(many))
    assert "block_hook" not in many, sorted(many)
    # the root's three hooks, the backward's start and its two callbacks, the optimizer's two
    assert len(many) == 8, sorted(set(many))


def test_one_block_in_eight_charges_its_check_to_gradmons_clock(attach, monkeypatch):
    from gradmon.capture import modelhooks
    from gradmon.capture.forward import WAIT_TIMED
    assert WAIT_TIMED == 8
    reads = []
    real = modelhooks.perf_counter
    monkeypatch.setattr(modelhooks, "perf_counter", lambda: reads.append(1) or real())
    model = chain(20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=100)
    for _ in range(3):
        sgd_step(model, opt, model)
    assert not mon._recorder.detail_now
    clock = mon._recorder.forward.clock
    charged = []
    seconds = type(clock).seconds  # the slot's descriptor: every charge to the clock seen
    monkeypatch.setattr(type(clock), "seconds", property(seconds.__get__,
                        lambda self, v: charged.append(v - seconds.__get__(self)) or seconds.__set__(self, v)))
    reads.clear()
    sgd_step(model, opt, model)
    assert len(reads) == 2 * (20 // 8), reads  # blocks 8 and 16, a clock read before and after
    assert any(s > 0 for s in charged), charged


def test_layers_inside_a_block_cost_no_python_call_on_an_ordinary_step():
    flat = entries_of_an_ordinary_step(chain(8, layers_per_block=1))
    deep = entries_of_an_ordinary_step(chain(8, layers_per_block=6))
    assert len(deep) == len(flat), (sorted(flat), sorted(deep))
    assert "layer_hook" not in deep and "on_param_grad" not in deep


def test_a_detail_step_still_records_every_layer(attach):
    model = chain(4, layers_per_block=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=5)
    for _ in range(5):
        sgd_step(model, opt, model)
    assert mon._recorder.detail_now
    with Entries() as seen:
        sgd_step(model, opt, model)
    assert seen.names.count("layer_hook") == 12  # the layers' hooks are back for the detail step
    with Entries() as seen:
        sgd_step(model, opt, model)
    assert "layer_hook" not in seen.names  # and gone again after it


def block_checks(monkeypatch) -> Tuple[List[torch.Size], List[int]]:
    """The block checks gradmon makes from here on: the shape of each output checked alone,
    and the size of each batch checked at once."""
    from gradmon.capture import kernels as stats
    single: List[torch.Size] = []
    batched: List[int] = []
    real, real_many = stats.extremes, stats.extremes_many
    monkeypatch.setattr(stats, "extremes", lambda x, *rows: single.append(x.shape) or real(x, *rows))
    monkeypatch.setattr(stats, "extremes_many",
                        lambda xs, home, *rows: batched.append(len(xs)) or real_many(xs, home, *rows))
    return single, batched


def test_the_block_checks_of_an_ordinary_forward_are_one_batched_call(attach, monkeypatch):
    single, batched = block_checks(monkeypatch)
    model = chain(12)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    for _ in range(3):
        sgd_step(model, opt, model)
    single.clear(), batched.clear()
    sgd_step(model, opt, model)
    assert not mon._recorder.detail_now
    assert single == []  # nothing checked alone
    # the batch (block #0) and every block's output in one call; the root's output is the last block's
    assert batched == [13]


def test_the_block_checks_of_a_detail_step_are_one_batched_call_too(attach, monkeypatch):
    """A detail step reads every layer; its blocks (none a layer here) wait for the end of
    the forward as on an ordinary step instead of one check each, and a NaN made in one of
    them is still named on that very step."""
    single, batched = block_checks(monkeypatch)
    torch.manual_seed(3)
    model = nn.Sequential(*(Poisoned() for _ in range(12)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=4)
    for _ in range(4):
        sgd_step(model, opt, model)
    assert mon._recorder.detail_now
    single.clear(), batched.clear()
    sgd_step(model, opt, model)  # step 5, a detail step
    assert single == [] and batched == [13], (single, batched)
    for step in range(6, 10):
        model[6].poison = step == 9  # step 9: a detail step
        sgd_step(model, opt, model)
    found = origins(fresh(mon))
    assert found["block"] == ("6", 9), found


def test_the_layer_records_of_a_later_detail_step_are_made_at_once(attach, monkeypatch):
    """The first detail step records each layer's output in its hook (and learns which stay
    unchanged until the end of the forward); the later ones record them all at once there:
    one batched call for the activations, one for the kurtosis samples and one for the
    gradient flow (at the end of the backward), none per layer, and a NaN made in a layer
    named on that step, its elements counted."""
    from gradmon.capture import kernels
    one: List[int] = []
    many: List[int] = []
    for name in ("activation_record", "moments_record", "gradient_record"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda x, *a, real=real: one.append(x.numel()) or real(x, *a))
    for name in ("activation_many", "moments_many", "gradient_many"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda xs, *a, real=real: many.append(len(xs)) or real(xs, *a))
    model = nn.Sequential(*(Poisoned() for _ in range(12)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=2)
    layers = len(mon.layers)
    sgd_step(model, opt, model)  # step 1, the first detail step
    assert len(one) == 3 * layers and many == [], (one, many)
    one.clear()
    sgd_step(model, opt, model)  # step 2: no layer read
    sgd_step(model, opt, model)  # step 3, a later detail step
    assert one == [] and many == [layers, layers, layers], (one, many)
    flow = value(fresh(mon), "gradmon_grad_flow_norm", layer="11.fc")
    assert flow > 0 and math.isfinite(flow)
    sgd_step(model, opt, model)  # step 4
    with torch.no_grad():
        model[3].fc.weight[0, 0] = float("nan")
    sgd_step(model, opt, model)  # step 5, a detail step: the NaN starts in layer 3.fc
    s = fresh(mon)
    assert origins(s)["activation"] == ("3.fc", 5), origins(s)
    assert value(s, "gradmon_nonfinite_total", layer="3.fc", tensor="activation", kind="nan") == 4  # column 0 of each of the 4 rows
    assert value(s, "gradmon_nonfinite_total", layer="2.fc", tensor="activation", kind="nan") == 0


def test_a_failure_of_the_batched_activation_records_costs_them_alone(attach, monkeypatch):
    """The activations of a later detail step failing (counted): the kurtosis is still
    recorded, and the blocks whose records would have been taken from the activations are
    read themselves, so a NaN is still named in its block on that step."""
    from gradmon.capture import kernels

    def boom(*a, **k):
        raise RuntimeError("injected")
    model = Leaves()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, detail_every=1)
    sgd_step(model, opt, model)  # the first detail step: recorded in the hooks
    monkeypatch.setattr(kernels, "activation_many", boom)
    kurtosis = value(fresh(mon), "gradmon_activation_kurtosis", layer="fc2")
    sgd_step(model, opt, lambda x: model(x * 3))
    s = fresh(mon)
    assert value(s, "gradmon_hook_errors_total", stage="forward") == 1
    assert value(s, "gradmon_activation_kurtosis", layer="fc2") != kurtosis  # this step's, made without them
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")
    sgd_step(model, opt, model)  # step 3
    s = fresh(mon)
    assert value(s, "gradmon_hook_errors_total", stage="forward") == 2
    assert origins(s)["block"] == ("fc2", 3), origins(s)


class Deep(nn.Module):
    """A model whose training loop may call a module two levels down: no root output, no
    top-level block output marks its backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("when", ["from the first step", "after steps through the root",
                                  "from the first step, moved to float64 after attach"])
def test_norms_stay_pre_clip_when_the_loop_calls_a_module_gradmon_sees_no_output_of(attach, when):
    """The moved model: torch gives a parameter moved to another dtype or device a new
    gradient accumulator, and the end of the first backward must still be found."""
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    inner = model.body[0]
    if "float64" in when:
        model.double()
        body = inner
        inner = lambda x: body(x.double())  # noqa: E731
    rooted = 3 if when == "after steps through the root" else 0
    for _ in range(rooted):
        sgd_step(model, opt, model, clip=1e-4)
    if rooted:
        assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # dropped: not needed
        sgd_step(model, opt, inner, clip=1e-4)  # unseen: measured at the optimizer step, hooks come back
    for step in range(3):
        returned = sgd_step(model, opt, inner, clip=1e-4)
        assert returned > 1e-3  # the clip did something
        s = fresh(mon)
        assert math.isclose(value(s, "gradmon_grad_global_norm"), returned, rel_tol=1e-5), step


def test_the_first_steps_hooks_leave_nothing_on_the_parameters(attach):
    """The hooks that find the end of the first steps' backwards go once a step shows it
    through the root's output, and leave nothing behind: a parameter's own
    post-accumulate-grad hook, once registered, makes every later backward call into
    Python for it even after removal (torch keeps its caller), so none is ever registered
    on a model whose loop goes through the root."""
    model = chain(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    for _ in range(3):
        sgd_step(model, opt, model)
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    assert value(fresh(mon), "gradmon_grad_global_norm") > 0


class Resized(nn.Module):
    """A parameter whose storage a wrapper swaps for one of another size between steps, as
    FSDP and DeepSpeed do (``p.data = ...``); its forward works with either."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w.sum()


def test_a_parameter_whose_storage_changes_size_after_attach_trains_on(attach):
    """A gradient accumulator held from before the swap would expect the old size, and the
    backward would raise in the training loop: the root's forward lets go of it first."""
    model = Resized()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    for size in (6, 2, 5):
        with torch.no_grad():
            model.w.data = torch.ones(size)
        opt.zero_grad(set_to_none=True)
        model(torch.ones(4)).sum().backward()
        assert model.w.grad.shape == (size,)
        opt.step()
    assert value(fresh(mon), "gradmon_grad_global_norm") > 0


class Partitioned(nn.Module):
    """A model whose loop calls a submodule (no root output is watched) and whose parameter
    holds no elements between steps, gathered for each forward (DeepSpeed's ZeRO-3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Resized()


def test_a_parameter_gathered_only_for_its_forward_trains_on_when_the_loop_calls_a_submodule(attach):
    model = Partitioned()
    w = model.inner.w
    with torch.no_grad():
        w.data = torch.empty(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    for _ in range(3):
        with torch.no_grad():
            w.data = torch.ones(3)
        opt.zero_grad(set_to_none=True)
        model.inner(torch.ones(4)).sum().backward()
        opt.step()
        with torch.no_grad():
            w.data = torch.empty(0)
    assert value(fresh(mon), "gradmon_grad_global_norm") > 0


class ChangeInPlace(nn.Module):
    """Changes its input in place and returns it: on every step (a ``ReLU(inplace=True)``
    sibling) or only on the poisoned one; ``poison`` makes the change a NaN."""

    def __init__(self, every_step: bool) -> None:
        super().__init__()
        self.every_step = every_step
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.poison:
            return x.mul_(math.nan)
        return x.mul_(1.0) if self.every_step else x * 1.0


@pytest.mark.parametrize("detail_every", [20, 1], ids=["ordinary steps", "detail steps"])
@pytest.mark.parametrize("every_step", [True, False], ids=["changed every step", "changed once"])
def test_a_block_output_changed_in_place_later_is_not_blamed_for_the_change(attach, every_step, detail_every):
    """The batched check reads a block's output at the end of the forward: one that a later
    block changed in place (the version counter says so) must not carry that change; on a
    detail step as on an ordinary one (the first block is no layer: its check waits then too)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), ChangeInPlace(every_step),
                          nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=detail_every)
    for step in range(6):
        model[1].poison = step == 4
        sgd_step(model, opt, model)
    found = origins(fresh(mon))
    assert found["block"][0] == "1", found


class Poisoned(nn.Module):
    """Linear + Tanh whose output becomes NaN while ``poison`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return y * math.nan if self.poison else y


@pytest.mark.parametrize("key", [5, 8], ids=["kept in its forward", "kept in its forward, timed"])
def test_a_nan_of_an_ordinary_step_names_its_block_whichever_path_its_check_took(attach, key):
    """Blocks settled by then keep their outputs in their own forwards (BlockForward), one
    in WAIT_TIMED (#8) on gradmon's clock: both name the block on the very step."""
    torch.manual_seed(3)
    model = nn.Sequential(*(Poisoned() for _ in range(12)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model, detail_every=100)
    for step in range(6):
        model[key - 1].poison = step == 4
        sgd_step(model, opt, model)
    assert not mon._recorder.detail_now
    found = origins(fresh(mon))
    assert found["block"] == (str(key - 1), 5), found  # the fifth step


def test_the_layer_scaling_benchmark_reports_both_kinds_of_step_and_their_mean_for_every_model(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_layers.py"
    out = tmp_path / "layers.json"
    r = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [row["model"] for row in rows] == ["chain-10", "transformer-1000"]
    assert rows[1]["layers"] == 1000
    for row in rows:
        for kind in ("ordinary", "detail", "cycle"):
            assert row[kind]["steps"] > 0 and row[kind]["twin_ms"] > 0, (row["model"], kind)
            assert row[kind]["fold_us_per_layer"] > 0  # the publisher's clock was read
        assert row["cycle"]["steps"] % 20 == 0  # whole detail periods of the defaults


def test_a_settled_block_of_an_ordinary_step_costs_no_guard_object(monkeypatch):
    """A block whose output waits for the end of the forward takes the lean path: no
    guard is built per block (a context manager per call is a Python allocation per block
    per step), the per-step guards stay a handful whatever the blocks."""
    from gradmon.capture.guard import Guards

    def guards_of_an_ordinary_step(blocks: int) -> int:
        made = []
        real = Guards.__call__
        model = chain(blocks)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0)
        try:
            for _ in range(3):
                sgd_step(model, opt, model)
            monkeypatch.setattr(Guards, "__call__", lambda self, *a: made.append(a[0]) or real(self, *a))
            sgd_step(model, opt, model)
            monkeypatch.setattr(Guards, "__call__", real)
            assert not mon._recorder.detail_now
            return len(made)
        finally:
            mon.detach()

    assert guards_of_an_ordinary_step(30) == guards_of_an_ordinary_step(6)


def test_an_ordinary_step_asks_no_block_output_alone_whether_it_may_wait(monkeypatch):
    """The deferred blocks' outputs are proved plain all at once at the end of the forward
    (their stack), not by a Python call per block in the hooks."""
    from gradmon.capture.records import BlockChecks

    def plain_calls(blocks: int) -> int:
        model = chain(blocks)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0)
        calls = []
        real = BlockChecks.plain
        try:
            for _ in range(3):
                sgd_step(model, opt, model)
            monkeypatch.setattr(BlockChecks, "plain", staticmethod(lambda t: calls.append(1) or real(t)))
            sgd_step(model, opt, model)
            monkeypatch.setattr(BlockChecks, "plain", staticmethod(real))
            assert not mon._recorder.detail_now
            return len(calls)
        finally:
            mon.detach()

    assert plain_calls(30) == plain_calls(6)


def _settled(checks, keys, like):
    """``checks`` after one forward that probed ``keys`` with outputs like ``like``, unchanged."""
    for key in keys:
        assert checks.defer(key, like.clone()) is False  # probed: checked in its hook this time
    assert checks.flush(checks.take(), []) == []
    assert checks.settled == set(keys)


def test_a_deferred_output_that_is_not_plain_is_checked_alone_and_its_block_no_longer_waits():
    """A block deferred on earlier forwards whose output is now no plain tensor (here empty)
    goes to its hook's own check at the end of the forward, with the root's output keys
    that took the same tensor, and its block back to checking in its hook."""
    from gradmon import statistics as S
    from gradmon.capture.records import BlockChecks, _Records

    checks = BlockChecks()
    _settled(checks, (1, 2), torch.randn(4, 8))
    full, empty = torch.randn(4, 8), torch.empty(0, 8)
    assert checks.wait(1, full) and checks.wait(2, empty)
    records = _Records(keyed=False)
    alone = checks.flush(checks.take(), [(S.BLOCK_FINITE, records)], alias=(3,))
    assert [(key, t is empty) for key, t in alone] == [(2, True), (3, True)]
    records.commit()
    assert records.keys() == [1]
    assert checks.settled == {1}


def _heavy_on_the_cpu(monkeypatch, served):
    """``BlockChecks.heavy`` for large CPU tensors, and ``extremes_held`` answered by the
    per-tensor reductions (the kernel itself: tests/test_counting.py, and the CUDA tests):
    what is left to test on the CPU is which outputs wait and when."""
    from gradmon.capture import kernels as K
    from gradmon.capture import records

    monkeypatch.setattr(records.BlockChecks, "heavy",
                        staticmethod(lambda t: t.is_floating_point() and t.numel() > records.DEFER_MAX))

    def held(tensors, home, batch=None, rows=None):
        if None in served:  # told to refuse
            return None
        served.append(len(tensors))
        pairs = [K.extremes(t) for t in tensors]
        return (torch.stack([lo for lo, _ in pairs]).double().unsqueeze(1),
                torch.stack([hi for _, hi in pairs]).double().unsqueeze(1), tuple(range(len(tensors))))
    monkeypatch.setattr(K, "extremes_held", held)


def test_a_large_output_waits_only_once_a_forward_showed_it_alive_and_unchanged_at_its_end(monkeypatch):
    """Kept by the forward (here by the test, as autograd keeps a saved input): it waits from
    the next forward on; freed during the forward, changed in place after its block
    returned, or refused by the one-launch check: its hook goes on checking it."""
    from gradmon import statistics as S
    from gradmon.capture.records import DEFER_MAX, BlockChecks, _Records

    served = []
    _heavy_on_the_cpu(monkeypatch, served)
    checks = BlockChecks()
    kept, changed = torch.randn(DEFER_MAX + 1), torch.randn(DEFER_MAX + 1)
    assert not checks.defer(1, kept) and not checks.defer(2, torch.randn(DEFER_MAX + 1))  # 2's is freed
    assert not checks.defer(3, changed)
    changed.add_(1)
    assert checks.flush(checks.take(), []) == []
    checks.weigh()  # the pass's end
    assert checks.held == {1} and checks.settled == set()
    assert checks.wait(1, kept) and not checks.wait(2, kept) and not checks.wait(3, kept)
    records = _Records(keyed=False)
    assert checks.flush(checks.take(), [(S.BLOCK_FINITE, records)], alias=(9,)) == []
    records.commit()
    assert records.keys() == [1, 9] and served == [1]
    (keys, numels, (lo, hi)), = records.rows
    assert numels == (kept.numel(),) * 2 and torch.equal(lo[:, 0], kept.min().double().expand(2))
    assert checks.wait(1, kept)
    served[:] = [None]  # the kernel cannot serve: checked alone, back to the hook
    assert checks.flush(checks.take(), [(S.BLOCK_FINITE, records)]) == [(1, kept)]
    assert checks.held == set()


def test_small_and_held_outputs_of_one_forward_are_checked_in_their_own_batches(monkeypatch):
    from gradmon import statistics as S
    from gradmon.capture.records import DEFER_MAX, BlockChecks, _Records

    served = []
    _heavy_on_the_cpu(monkeypatch, served)
    checks = BlockChecks()
    outs = {1: torch.randn(4, 8), 2: torch.randn(DEFER_MAX + 5), 3: torch.randn(4, 8), 4: torch.randn(DEFER_MAX + 7)}
    for key, t in outs.items():
        assert not checks.defer(key, t)
    checks.flush(checks.take(), [])
    checks.weigh()
    assert checks.settled == {1, 3} and checks.held == {2, 4}
    for key, t in outs.items():
        assert checks.wait(key, t)
    records = _Records(keyed=False)
    assert checks.flush(checks.take(), [(S.BLOCK_FINITE, records)], alias=(5,)) == []
    records.commit()
    assert sorted(records.keys()) == [1, 2, 3, 4, 5] and served == [2]
    by_key = {k: (n, lo, hi) for keys, numels, (los, his) in records.rows
              for k, n, lo, hi in zip(keys, numels, los[:, 0], his[:, 0])}
    assert by_key[5][0] == outs[4].numel() and by_key[5][2] == outs[4].max().double()  # the last output's


@contextlib.contextmanager
def _held_chain(monkeypatch, blocks: int):
    """(model, its input, a training step, the monitor, the held checks' calls): ``blocks``
    blocks of Linear(64, 64) + Tanh whose outputs count large, three steps in: every block's
    output held (saved by the next Linear; the last one returned)."""
    from gradmon.capture.records import DEFER_MAX

    served: List[Optional[int]] = []
    _heavy_on_the_cpu(monkeypatch, served)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(blocks)))
    x = torch.randn(DEFER_MAX // 64 + 8, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0)
    try:
        for _ in range(3):
            step()
        assert mon._recorder._rec.blocks.held == set(range(1, blocks + 1))
        yield model, x, step, mon, served
    finally:
        mon.detach()


def test_a_held_output_that_autograd_stops_keeping_is_held_no_more(monkeypatch):
    """Block 2's output is saved by block 3's Linear while that Linear trains; frozen, it
    saves nothing (its input's gradient needs only its weight): the output is then held by
    gradmon alone, and from the next forward on its hook checks it again (and the probe
    finds it freed). The last block's output stays held: the root returns it."""
    with _held_chain(monkeypatch, 3) as (model, x, step, mon, served):
        blocks = mon._recorder._rec.blocks
        model[2][0].requires_grad_(False)  # block 3's Linear: block 2's output is no longer saved
        step()
        assert blocks.held == {1, 3}
        step()
        assert blocks.held == {1, 3} and sum(mon._errors.counts().values()) == 0


def test_a_forward_that_raises_leaves_no_block_output_held(monkeypatch):
    """Out of memory in a late block, say: the outputs that waited for the end of the forward
    are not held after it, so that a retry finds their memory free; the next forward is
    measured as usual."""
    import weakref

    with _held_chain(monkeypatch, 4) as (model, x, step, mon, served):
        kept = []
        hooks = [model[0].register_forward_hook(lambda m, i, out: kept.append(weakref.ref(out))),
                 model[2].register_forward_hook(lambda m, i, out: 1 / 0)]
        try:
            model(x)
        except ZeroDivisionError:
            pass
        for hook in hooks:
            hook.remove()
        assert mon._recorder._rec.blocks.waiting == []
        assert kept and kept[0]() is None  # the first block's output: held by nothing now
        served.clear()
        step()
        assert served == [4]


@pytest.mark.parametrize("case", ["mixed dtypes", "a NaN", "an Inf"])
def test_outputs_checked_as_one_stack_give_each_output_its_own_extremes(case):
    from gradmon.capture import kernels as K

    torch.manual_seed(1)
    outs = [torch.randn(4, 8) for _ in range(5)]
    if case == "mixed dtypes":
        outs[2] = outs[2].half()
    else:
        outs[3][1, 2] = math.nan if case == "a NaN" else -math.inf
    stacked = K.stack_alike(outs)
    assert stacked is not None
    lo, hi, order = K.extremes_many(outs, torch.device("cpu"), stacked=stacked)
    for j, i in enumerate(order):
        want = K.extremes(outs[i].float())
        assert torch.equal(lo[j, 0], want[0].float()) or (lo[j, 0].isnan() and want[0].isnan())
        assert torch.equal(hi[j, 0], want[1].float()) or (hi[j, 0].isnan() and want[1].isnan())


def test_outputs_of_several_shapes_or_no_values_are_not_stacked():
    from gradmon.capture import kernels as K

    assert K.stack_alike([torch.randn(4, 8), torch.randn(4, 7)]) is None
    assert K.stack_alike([torch.empty(0, 8), torch.empty(0, 8)]) is None
    assert K.stack_alike([torch.ones(4, 8, dtype=torch.int64)] * 2) is None
    assert K.stack_alike([torch.randn(4, 8)]) is None  # one output: nothing to batch
    assert K.stack_by_shape([torch.empty(4, 8, device="meta"), torch.empty(4, 7, device="meta")]) is None
    assert K.stack_by_shape([torch.empty(0, 8), torch.randn(4, 7)]) is None


class TurnsToInference(nn.Module):
    """Returns its input until ``inference`` is set, then a tensor made under inference_mode,
    which has no version counter to read."""

    def __init__(self) -> None:
        super().__init__()
        self.inference = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inference:
            with torch.inference_mode():
                return torch.ones(4, 8)
        return x * 1.0


class Shift(nn.Module):
    """Adds a parameter: an add saves neither input, so an inference tensor may come in."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


def test_a_deferred_block_whose_output_has_no_version_counter_never_raises_into_the_forward(attach):
    """The lean path reads the output's version counter with no guard object around it: an
    inference tensor (which has none) must fall to the guarded path, never raise."""
    model = nn.Sequential(nn.Linear(8, 8), TurnsToInference(), Shift())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    for step in range(6):
        model[1].inference = step >= 3  # blocks settled by then: their outputs wait
        sgd_step(model, opt, model)
    assert mon._recorder.steps == 6


class ChangedLater(nn.Module):
    """A layer whose output (or its gradient) is changed in place after gradmon saw it,
    on the steps ``on`` is set: by the block itself, or by a later hook of the user's."""

    def __init__(self, change: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.change = change
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.on:
            self.change(y)
        return torch.tanh(y)


@pytest.mark.parametrize("what", ["output", "gradient"])
def test_a_value_changed_in_place_while_its_record_waits_is_never_read_changed(attach, what):
    """A layer's output (its gradient) whose record waited for the end of a later detail
    step's forward (backward) and was changed in place meanwhile loses that record: the
    value it had is gone. Its layer is measured in its hook again from then on, before the
    change."""
    torch.manual_seed(0)
    if what == "output":
        change, metric = (lambda y: y.mul_(1000.0)), "gradmon_activation_abs_max"
    else:
        change, metric = (lambda y: y.register_hook(lambda g: g.mul_(1000.0))), "gradmon_grad_flow_norm"
    model = nn.Sequential(nn.Linear(8, 8), ChangedLater(change), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same values every step
    seen: List[float] = []
    model[1].fc.register_forward_hook(lambda m, i, o: seen.append(o.detach().abs().max().item()))
    mon = attach(model, detail_every=1)
    x = torch.randn(4, 8)

    def step() -> float:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return value(fresh(mon), metric, layer="1.fc")

    first = step()  # measured in its hook, unchanged until the end of its pass: it waits from now on
    if what == "output":
        assert first == pytest.approx(seen[0])
    assert step() == pytest.approx(first)  # measured at the end of the pass: the same
    model[1].on = True
    assert step() == pytest.approx(first)  # changed while it waited: no record, never the changed value
    assert step() == pytest.approx(first)  # back in its hook, before the change


def _outputs(kind: str) -> Tuple[List[torch.Tensor], object]:
    """Layer outputs as a detail step's forward may leave them, and how they are stacked:
    of one shape (stacked), of a few shapes (stacked by shape) or of shapes that are not
    stacked (each by segment of one flat copy); a NaN, an Inf of each sign, and a bfloat16 one."""
    from gradmon.capture import kernels
    torch.manual_seed(0)
    shapes = {"one shape": [(4, 8)] * 5, "a few shapes": [(4, 8), (4, 16), (4, 8), (4, 16), (2, 3)],
              "flat": [(4, 8), (4, 16), (7,), (3, 5, 2), (1,)]}[kind]
    tensors = [torch.randn(shape) * (i + 1) for i, shape in enumerate(shapes)]
    tensors[1].view(-1)[3] = float("nan")
    tensors[2].view(-1)[0], tensors[2].view(-1)[-1] = float("inf"), float("-inf")
    if kind == "flat":
        tensors[4] = tensors[4].to(torch.bfloat16)
    stacked = {"one shape": True, "a few shapes": kernels.stack_by_shape(tensors), "flat": False}[kind]
    return tensors, stacked


@pytest.mark.parametrize("kind", ["one shape", "a few shapes", "flat"])
def test_the_records_of_many_outputs_at_once_are_the_records_of_each(kind):
    """``activation_many``, ``gradient_many`` and ``moments_many`` against the records made
    one tensor at a time (a layer's output or its gradient takes either path, and both fold
    into the same series)."""
    from gradmon.capture import kernels
    tensors, stacked = _outputs(kind)
    if kind == "a few shapes":
        assert isinstance(stacked, kernels.Stacks) and len(stacked.stacks) == 3
    rows, counts, order = kernels.activation_many(tensors, torch.device("cpu"), stacked)
    assert sorted(order) == list(range(len(tensors))) and rows.shape == (5, 3) and counts.shape == (5, 2)
    for j, i in enumerate(order):
        want, want_counts = kernels.activation_record(tensors[i])
        got = rows[j].tolist()
        assert got[0] == pytest.approx(want[0].item(), rel=1e-6, nan_ok=True), (i, got)
        assert got[1:] == pytest.approx(want[1:].double().tolist(), nan_ok=True), (i, got)
        assert counts[j].tolist() == want_counts.double().tolist(), i
    norms, counts, order = kernels.gradient_many(tensors, torch.device("cpu"), stacked)
    assert sorted(order) == list(range(len(tensors))) and norms.shape == (5, 1)
    for j, i in enumerate(order):
        want, want_counts = kernels.gradient_record(tensors[i])
        assert norms[j].item() == pytest.approx(want.item(), rel=1e-6, nan_ok=True), i
        assert counts[j].tolist() == want_counts.double().tolist(), i
    finite = [t.nan_to_num(0.0, 0.0, 0.0).double() * 3 for t in tensors]  # moments of finite values
    got, order = kernels.moments_many(finite, torch.device("cpu"), kernels.stack_by_shape(finite)
                                      if kind == "a few shapes" else stacked is True, limit=8)
    want = kernels.moments_block([kernels.moments_record(finite[i], limit=8)[0] for i in order],
                                 [finite[i].numel() for i in order], torch.device("cpu"))
    assert torch.allclose(got, want, rtol=1e-9), (got, want)


def test_packets_faster_than_the_publishers_wake_ups_are_folded_a_batch_at_a_time(attach, monkeypatch):
    """Each wake-up of the publisher costs the training thread about a fold: steps that come
    faster than ``WAKE_EVERY_S`` are folded together, and not one is lost."""
    every = 0.05
    monkeypatch.setattr(publisher_module, "WAKE_EVERY_S", every)
    model = chain(2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    publisher = mon._publisher
    start, before = time.monotonic(), publisher.wakes
    for _ in range(100):
        sgd_step(model, opt, model)
    assert mon.flush()
    elapsed, wakes = time.monotonic() - start, publisher.wakes - before
    assert mon.snapshot().steps_total == 100
    # one at the first packet, one at least `every` after each, one for the flush
    assert wakes <= elapsed / every + 2, (wakes, elapsed)
    assert wakes < 100 / 4, (wakes, elapsed)


def test_a_flush_or_a_detach_does_not_wait_for_the_publishers_next_wake_up(attach, monkeypatch):
    monkeypatch.setattr(publisher_module, "WAKE_EVERY_S", 30.0)
    model = chain(2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = attach(model)
    thread = mon._publisher._thread
    sgd_step(model, opt, model)  # folded at once: the first wake-up
    assert mon.flush(2)
    sgd_step(model, opt, model)  # would wait 30 s for the next
    assert mon.flush(2)
    assert mon.snapshot().steps_total == 2
    sgd_step(model, opt, model)
    mon.detach()
    assert not thread.is_alive()
    assert mon.snapshot().steps_total == 3
