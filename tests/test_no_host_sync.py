"""gradmon launches reductions; it never reads a device value on the training thread (issue 2.4)."""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradmon

# Ops that force the host to wait for the device: reading a scalar (item(), bool(t),
# float(t) all land in _local_scalar_dense), data-dependent output shapes, equality
# returning a Python bool, and copies from a device to the host.
SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


class RaiseOnSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS or func.overloadpacket in {f.overloadpacket for f in SYNC_OPS}:
            raise AssertionError(f"host sync: {func}")
        if func.overloadpacket is torch.ops.aten.copy_ and len(args) > 2 and args[2] and args[0].is_pinned():
            return func(*args, **kwargs)  # a non-blocking copy into pinned memory: the host does not wait
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            src = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
            dst = kwargs.get("device") if func.overloadpacket is torch.ops.aten._to_copy else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
                    and torch.device(dst).type == "cpu":
                raise AssertionError(f"device-to-host copy: {func}")
        return func(*args, **kwargs)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.lstm = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu_(self.conv(x)).transpose(1, 2)
        h, _ = self.lstm(self.norm(h))
        return self.head(h)


def train_steps(model, opt, steps, device, mon=None):
    for _ in range(steps):
        for _micro in range(2):
            loss = model(torch.randn(4, 3, 5, device=device)).pow(2).mean()
            loss.backward()
            if mon is not None:  # the loss stays on the device: no .item() to hand it over
                mon.observe(loss=loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_dispatch_mode_catches_an_item_call():
    with pytest.raises(AssertionError, match="host sync"):
        with RaiseOnSync():
            torch.ones(2).sum().item()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adamw(params):
    # amsgrad: the optimizer statistics' widest reading of the state. (A tensor lr makes
    # CPU Adam itself call .item(); the CUDA test below covers tensor lr and step.)
    return torch.optim.AdamW(params, lr=0.01, amsgrad=True, weight_decay=0.1)


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


# Every family on every step; the per-layer origin records on steps with no detail; the
# optimizer statistics on every step, SGD's and Adam's; the step guard on a fused optimizer,
# which takes the verdict on the device (an unfused one reads it: docs/guard.md).
@pytest.mark.parametrize("options,make", [
    (dict(detail_every=1, optimizer_every=1), _sgd),
    (dict(origin_per_layer=True, detail_every=100), _sgd),
    (dict(detail_every=1, optimizer_every=1), _adamw),
    (dict(detail_every=1, optimizer_every=1, guard="nonfinite"), _adamw_fused)],
    ids=["every_family", "origin_per_layer", "optimizer_adamw", "guard_fused"])
def test_hooked_forward_backward_and_step_never_sync_on_cpu(options, make, monkeypatch):
    # CPU Adam reads its own step count with .item() (capturable Adam, which does not,
    # needs CUDA): that read is the optimizer's, not gradmon's, so it reads host memory here.
    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_value",
                        lambda x: x.tolist() if isinstance(x, torch.Tensor) else x)
    torch.manual_seed(0)
    model = Model()
    opt = make(model.parameters())
    train_steps(model, opt, 1, "cpu")  # the unmonitored loop itself is sync-free
    with gradmon.attach(model, port=0, addr="127.0.0.1", **options) as mon:
        with RaiseOnSync():
            train_steps(model, opt, 3, "cpu", mon)
        assert mon.flush()
        snap = mon.snapshot()
        assert snap.loss is not None and math.isfinite(snap.loss)
        errors = mon._errors.counts()
    assert snap.steps_total == 3
    assert sum(errors.values()) == 0, errors
    assert {f for fams in snap.coverage.values() for f in fams} == {"grad", "grad_flow", "activation", "optimizer"}
    assert snap.learning_rates == (pytest.approx(0.01),)


@contextlib.contextmanager
def cuda_sync_is_an_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def train_half_model(device: str, guard=contextlib.nullcontext) -> None:
    """A float16 model under RaiseOnSync (and ``guard``): kurtosis, abs-max ratio and the
    fp16 families."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).half().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(steps):
        for _ in range(steps):
            model(torch.randn(4, 6, device=device).half()).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    train(1)
    with gradmon.attach(model, port=0, addr="127.0.0.1", detail_every=1) as mon:
        with guard(), RaiseOnSync():
            train(3)
        assert mon.flush()
        snap = mon.snapshot()
        errors = mon._errors.counts()
    assert snap.steps_total == 3 and sum(errors.values()) == 0, errors
    exported = {(s.spec.name, tuple(sorted(s.labels.items()))) for s in snap.layer_gauges if s.values}
    assert {("gradmon_fp16_range_used", (("tensor", "activation"),)), ("gradmon_fp16_range_used", (("tensor", "grad"),)),
            ("gradmon_grad_fp16_underflow_fraction", ()), ("gradmon_activation_kurtosis", ())} <= exported


def test_fp16_headroom_and_kurtosis_of_a_float16_model_never_sync_on_cpu():
    train_half_model("cpu")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: checks real device-to-host syncs "
                                       "with torch.cuda.set_sync_debug_mode('error')")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    # step counts and the learning rate on the device: read as tensors, never on the host
    lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01, device="cuda"), capturable=True, amsgrad=True)],
    ids=["sgd", "adamw_capturable"])
def test_no_host_sync_on_cuda_under_sync_debug_mode_error(make):
    torch.manual_seed(0)
    model = Model().cuda()
    opt = make(model.parameters())
    train_steps(model, opt, 1, "cuda")
    with gradmon.attach(model, port=0, addr="127.0.0.1", detail_every=1, origin_per_layer=True,
                        optimizer_every=1) as mon:
        with cuda_sync_is_an_error(), RaiseOnSync():
            train_steps(model, opt, 3, "cuda", mon)
        assert mon.flush()
        assert mon.snapshot().steps_total == 3 and mon.snapshot().loss is not None
        assert sum(mon._errors.counts().values()) == 0


@needs_cuda
@pytest.mark.cuda
def test_block_outputs_held_to_the_end_of_the_forward_never_sync_on_cuda_under_sync_debug_mode_error(monkeypatch):
    """The defaults' ordinary steps with every block output counted large (``DEFER_MAX``
    lowered): held to the end of the forward, checked in one launch by batch row, the
    gradients' norms and counts in one launch too."""
    from gradmon.capture import counting, records
    monkeypatch.setattr(records, "DEFER_MAX", 8)
    launches = []
    real = counting.row_extremes
    monkeypatch.setattr(counting, "row_extremes", lambda groups, rows: launches.append(sum(map(len, groups))) or real(groups, rows))
    torch.manual_seed(0)
    model = Model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    train_steps(model, opt, 1, "cuda")
    with gradmon.attach(model, port=0, addr="127.0.0.1") as mon:
        train_steps(model, opt, 3, "cuda", mon)  # the first a detail step; the blocks probed
        with cuda_sync_is_an_error(), RaiseOnSync():
            train_steps(model, opt, 3, "cuda", mon)
        assert mon.flush()
        assert mon.snapshot().steps_total == 6 and sum(mon._errors.counts().values()) == 0
    assert launches and not counting._failed or not counting.available()


@needs_cuda
@pytest.mark.cuda
def test_the_step_guard_on_a_fused_optimizer_never_syncs_on_cuda_under_sync_debug_mode_error():
    torch.manual_seed(0)
    model = Model().cuda()
    opt = _adamw_fused(model.parameters())
    train_steps(model, opt, 1, "cuda")
    with gradmon.attach(model, port=0, addr="127.0.0.1", guard="nonfinite") as mon:
        with cuda_sync_is_an_error(), RaiseOnSync():
            train_steps(model, opt, 3, "cuda", mon)
        assert mon.flush()
        assert mon.snapshot().steps_total == 3 and mon._recorder.step_guard.syncs == 0
        assert sum(mon._errors.counts().values()) == 0


@needs_cuda
@pytest.mark.cuda
def test_fp16_headroom_of_a_float16_model_never_syncs_on_cuda_under_sync_debug_mode_error():
    train_half_model("cuda", cuda_sync_is_an_error)


def incident_under_raise_on_sync(device: str, out, ids: bool, guard=contextlib.nullcontext) -> dict:
    """Three steps under RaiseOnSync (and ``guard``), the third with a NaN in row 1 of its
    batch: with ``ids`` each step's ids are a tensor on the device (``observe(batch=...)``),
    else the rows of the input are hashed. The bundle's ``batch`` and ``rows``."""
    from gradmon.capture.rowhash import row_hash
    from gradmon.incidents import bundle as B
    torch.manual_seed(0)
    model = Model().to(device)
    opt = _sgd(model.parameters())
    train_steps(model, opt, 1, device)
    batches = [torch.randn(4, 3, 5, device=device) for _ in range(3)]
    batches[2][1, 0, 0] = float("nan")
    with gradmon.attach(model, port=0, addr="127.0.0.1", incident_dir=str(out)) as mon:
        with guard(), RaiseOnSync():
            for step, x in enumerate(batches):
                loss = model(x).pow(2).mean()
                mon.observe(loss=loss, batch=torch.arange(4, device=device) + 10 * step if ids else None)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert mon.flush()
        assert sum(mon._errors.counts().values()) == 0, mon._errors.counts()
    (path,) = out.glob("*.npz")
    meta = B.load(str(path)).meta
    assert meta["rows"]["rows"] == [1]
    if ids:
        assert meta["batch"]["ids"] == [20, 21, 22, 23] and meta["batch"]["hashes"] == {}
    else:
        hashes = [format(v & 0xFFFFFFFFFFFFFFFF, "016x") for v in row_hash(batches[2].cpu()).tolist()]
        assert not meta["batch"]["known"] and meta["batch"]["hashes"] == {"args[0]": hashes}
    return meta


@pytest.mark.parametrize("ids", [True, False], ids=["observe_batch_tensor", "row_hash"])
def test_batch_ids_given_as_a_tensor_and_the_row_hash_never_sync_on_cpu(ids, tmp_path):
    incident_under_raise_on_sync("cpu", tmp_path, ids)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("ids", [True, False], ids=["observe_batch_tensor", "row_hash"])
def test_batch_ids_given_as_a_tensor_and_the_row_hash_never_sync_on_cuda(ids, tmp_path):
    incident_under_raise_on_sync("cuda", tmp_path, ids, cuda_sync_is_an_error)


@needs_cuda
@pytest.mark.cuda
def test_a_thread_waiting_for_a_packet_on_cuda_sleeps_instead_of_spinning():
    """The publisher waits up to a step for each packet's copy: with CUDA's default event
    its thread spins a core for the whole wait; the packet's event is a blocking one."""
    import time
    from gradmon.capture import kernels

    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # about half a second of the device's clock
    host, event = kernels.to_host(x)
    cpu, wall = time.thread_time(), time.perf_counter()
    event.synchronize()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert wall > 0.1, "the wait ended before the device's work: nothing was measured"
    assert cpu < 0.25 * wall, f"the waiting thread spent {cpu:.3f} s of CPU in a {wall:.3f} s wait"
    assert host.tolist() == [1.0] * 4


def test_every_segment_reduce_skips_its_lengths_check():
    """segment_reduce's checked form reads its lengths with .item() inside the kernel, where
    no dispatch mode sees it (CUDA's sync debug mode does): gradmon passes unsafe=True."""
    import re
    from pathlib import Path
    calls = [(path.name, m.group(0)) for path in Path(gradmon.__file__).parent.rglob("*.py")
             for m in re.finditer(r"segment_reduce\([^()]*(\([^()]*\)[^()]*)*\)", path.read_text())]
    assert calls and all("unsafe=True" in call for _, call in calls), [c for c in calls if "unsafe=True" not in c[1]]


def test_host_values_reach_a_device_by_non_blocking_copies_only():
    """``torch.tensor`` given a CUDA device copies host memory synchronously (a stream sync,
    which set_sync_debug_mode("error") refuses and this CPU machine cannot see): gradmon
    builds such tensors with stats.host_values, a non-blocking copy."""
    import re
    from pathlib import Path
    from gradmon.capture import kernels as stats
    blocking = re.compile(r"torch\.(tensor|as_tensor)\([^()]*(\([^()]*\)[^()]*)*device=")
    found = [f"{path.name}:{n}" for path in Path(gradmon.__file__).parent.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if blocking.search(line)]
    assert not found, found
    copies = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy:
                copies.append((kwargs or {}).get("non_blocking", False))
            return func(*args, **(kwargs or {}))
    with Record():
        t = stats.host_values([1.0, 2.0], torch.device("meta"), torch.float64)
    assert t.device.type == "meta" and t.dtype == torch.float64 and copies == [True]


def train_compiled(device: str, backend: str, guard=contextlib.nullcontext, mode=None) -> None:
    """The model compiled whole (fullgraph) with gradmon attached. Inside the compiled
    forward a host read would be a graph break, which fullgraph refuses (and dynamo runs
    nothing under a dispatch mode such as RaiseOnSync); the compiled backward and the step,
    where gradmon's host side takes the compiled hooks' records and closes the step, run
    under RaiseOnSync (and ``guard``). On the CPU the ``eager`` backend is enough: the
    hooks are traced by dynamo all the same, and it compiles in a second."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch._dynamo.reset()
    try:
        with gradmon.attach(model, port=0, addr="127.0.0.1", detail_every=2, origin_per_layer=True) as mon:
            compiled = torch.compile(model, fullgraph=True, backend=backend, mode=mode)

            def train(steps, check=contextlib.nullcontext):
                for _ in range(steps):
                    out = compiled(torch.randn(4, 6, device=device))
                    with check():
                        out.square().mean().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            train(1)  # compiled
            with torch._dynamo.config.patch(error_on_recompile=True), guard():
                train(4, RaiseOnSync)
            assert mon.flush(120)
            snap = mon.snapshot()
            errors = mon._errors.counts()
    finally:
        torch._dynamo.reset()
    assert snap.steps_total == 5 and sum(errors.values()) == 0, errors
    assert {"grad", "activation"} <= {f for fams in snap.coverage.values() for f in fams}


def test_a_compiled_model_with_gradmon_never_syncs_on_cpu():
    train_compiled("cpu", "eager")


@needs_cuda
@pytest.mark.cuda
def test_a_compiled_model_with_gradmon_never_syncs_on_cuda_under_sync_debug_mode_error():
    train_compiled("cuda", "inductor", cuda_sync_is_an_error)


@needs_cuda
@pytest.mark.cuda
def test_a_model_compiled_as_cuda_graphs_with_gradmon_never_syncs():
    train_compiled("cuda", "inductor", cuda_sync_is_an_error, mode="reduce-overhead")
