"""The Triton kernels of gradmon/capture/counting.py: NaN/Inf counts (and the gradients'
norms) of a group of tensors in one launch, exact against torch's own counts, without a host
sync on CUDA, in one launch where torch ops take several per tensor, torch ops counting
wherever the kernel cannot serve; the block outputs' extremes by batch row.

Triton is not a dependency of gradmon (it is one of its tests'): without it the kernels'
tests skip, and fail under CI. Where it is installed but no GPU is, the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) in a child process, because the
interpreter must be chosen before Triton is imported; the CUDA tests run where a GPU is lent
(scripts/gpu_checks.sh)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from typing import List, Sequence

import pytest
import torch
from torch import nn

from conftest import needs_cuda
from gradmon.capture import counting
from gradmon.capture import kernels as stats

# a test dependency (pyproject's test extra): under CI a missing Triton fails these tests
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None and os.environ.get("CI") != "true",
                                  reason="needs Triton (pip install triton): gradmon does not depend on it")

B, C = counting.BLOCK, counting.CHUNK
SIZES = (1, 7, B - 1, B, B + 1, C - 1, C, C + 1, 3 * C + 5)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def planted(size: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Gaussian values with NaN, Inf and -Inf in turn at the edges a kernel gets wrong: the
    first and last element and both sides of every block and chunk boundary."""
    g = torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    edges = sorted({0, size - 1} | {b + d for b in (B, 2 * B, C, 2 * C, 3 * C) for d in (-1, 0) if 0 <= b + d < size})
    for j, e in enumerate(edges[seed % 3:]):
        g[e] = (float("nan"), float("inf"), float("-inf"))[j % 3]
    return g.to(device)


def reference(group: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.stack((torch.isnan(g).sum(), torch.isinf(g).sum())) for g in group]).cpu()


def groups(device: str) -> List[List[torch.Tensor]]:
    """Groups of one dtype: every size at once; empty tensors among them, one first; views into one
    flat buffer, the first one element off a 16-byte boundary (the kernel's narrow loads)."""
    out = []
    for dtype in DTYPES:
        out.append([planted(n, dtype, device, seed) for seed, n in enumerate(SIZES)])
        empty = torch.empty(0, dtype=dtype, device=device)  # on CUDA its address is 0
        out.append([empty, planted(5, dtype, device, 0), empty, planted(C, dtype, device, 1)])
        out.append(views(dtype, device))
    return out


def views(dtype: torch.dtype, device: str) -> List[torch.Tensor]:
    """Views into one flat buffer, finite elements between them, each with a NaN first and
    an Inf last, so that a view read from the wrong place counts differently."""
    flat = torch.randn(3 * C + 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    bounds = [(1, C + 4), (C + 11, 2 * C + 9), (2 * C + 12, 3 * C + 37)]
    for start, end in bounds:
        flat[start], flat[end - 1] = float("nan"), float("inf")
    flat = flat.to(device)
    return [flat[start:end] for start, end in bounds]


def mismatches(device: str, interpreted: bool = False) -> List[str]:
    """The groups whose kernel counts differ from torch's or that the kernel did not serve."""
    bad = []
    for group in groups(device):
        got = counting.nonfinite_counts(group, interpreted=interpreted)
        want = reference(group)
        if got is None or got.dtype != torch.int64 or not torch.equal(got.cpu(), want):
            bad.append(f"{group[0].dtype} sizes {[g.numel() for g in group]}: {got} != {want.tolist()}")
    return bad


@needs_triton
def test_the_kernel_counts_exactly_under_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "mismatches": [], "groups": len(groups("cpu")),
        "param_grad_stats": {"served": 4, "equal": True},  # bf16 and float32, large and small
        "norms": {"mismatches": [], "groups": len(groups("cpu")), "fused_rows": True, "unservable": None},
        "rows": {"mismatches": [], "groups": len(row_groups("cpu"))},
        "held": {"mismatches": [], "order": [0, 1, 2, 3]}}


@needs_triton
def test_aligned_tensors_are_read_16_bytes_at_a_time_by_the_kernel_compiled_for_an_h100():
    """Compiled ahead of time for sm_90 (no GPU needed): with every address on a 16-byte
    boundary the whole chunks' loads are 16 bytes wide; a view off that boundary gets the
    narrow variant, which must still compile; the same with the squares summed (float64 rows)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from gradmon.capture.triton_kernels import count_nonfinite
    loads = {}
    for squares in (False, True):
        for name, itemsize, align in (("bf16", 2, 8), ("fp32", 4, 4), ("fp32", 4, 1)):
            signature = {"base": "*" + name, "offsets": "*i64", "work": "*i64", "out": "*fp64" if squares else "*i64",
                         "ITEMSIZE": "constexpr", "ALIGN": "constexpr", "BLOCK": "constexpr", "CHUNK": "constexpr",
                         "SQUARES": "constexpr"}
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
            source = ASTSource(count_nonfinite, signature, attrs=aligned, constexprs={
                "ITEMSIZE": itemsize, "ALIGN": align, "BLOCK": B, "CHUNK": C, "SQUARES": squares})
            ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
            loads[(name, align, squares)] = set(re.findall(r"ld\.global\.v4\.b32", ptx))
    wide = {"ld.global.v4.b32"}
    assert loads == {(name, align, squares): wide if align > 1 else set()
                     for squares in (False, True) for name, align in (("bf16", 8), ("fp32", 4), ("fp32", 1))}
    from gradmon.capture.triton_kernels import row_extremes  # the block outputs' rows, whose starts are ALIGN's
    rows = {}
    for name, itemsize, align in (("bf16", 2, 8), ("fp32", 4, 4), ("fp32", 4, 1)):
        signature = {"base": "*" + name, "offsets": "*i64", "work": "*i64", "out": "*fp32", "ITEMSIZE": "constexpr",
                     "ALIGN": "constexpr", "BLOCK": "constexpr", "CHUNK": "constexpr"}
        source = ASTSource(row_extremes, signature, attrs={(i,): [["tt.divisibility", 16]] for i in range(4)},
                           constexprs={"ITEMSIZE": itemsize, "ALIGN": align, "BLOCK": B, "CHUNK": C})
        ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        rows[(name, align)] = set(re.findall(r"ld\.global\.v4\.b32", ptx))
    assert rows == {("bf16", 8): wide, ("fp32", 4): wide, ("fp32", 1): set()}


@pytest.mark.parametrize("lengths,rows,align", [((C + 3, 700, 3 * C), (4, 4, 1), 8), ((1001,), (2,), 1),
                                                 ((5 * C, 1, 16 * C + 8), (3, 7, 1), 4)])
def test_the_row_pieces_are_every_row_cut_into_chunks_in_order(lengths, rows, align):
    """The work table of ``counting.row_extremes`` (built by tensor ops) against the rows cut
    one by one: piece k of row r of tensor i covers its elements r·L + k·C up to the row's end."""
    want, pieces = [], []
    for i, (length, count) in enumerate(zip(lengths, rows)):
        per_row = -(-length // C)
        for r in range(count):
            for k in range(per_row):
                start = r * length + k * C
                want += [i, start // align, min(start + C, (r + 1) * length)]
        pieces += [per_row] * count
    work, programs, got_pieces, per_tensor, starts = counting._row_work.__wrapped__(
        ((lengths, rows, align),), torch.device("cpu"), 0)
    assert work.tolist() == want and programs == (len(want) // 3,) and got_pieces.tolist() == pieces
    assert per_tensor.tolist() == list(rows) and starts == tuple(sum(rows[:i]) for i in range(len(rows)))
    # a second group after it: its pieces follow, its tensors numbered from 0, its rows after the first's
    work2, programs2, pieces2, _, starts2 = counting._row_work.__wrapped__(
        ((lengths, rows, align), ((C,), (3,), 1)), torch.device("cpu"), 0)
    assert work2.tolist() == want + [0, 0, C, 0, C, 2 * C, 0, 2 * C, 3 * C]
    assert programs2 == (len(want) // 3, 3) and pieces2.tolist() == pieces + [1, 1, 1]
    assert starts2 == starts + (sum(rows),)


def test_torch_ops_count_where_the_kernel_cannot_serve(monkeypatch):
    calls = []
    monkeypatch.setattr(counting, "_kernel", lambda: calls.append(1))
    g = torch.randn(64, 64)
    assert counting.nonfinite_counts([g]) is None  # a CPU tensor
    assert counting.nonfinite_counts([g.t()], interpreted=True) is None  # not contiguous
    assert counting.nonfinite_counts([g.double()], interpreted=True) is None  # a dtype it does not read
    assert counting.nonfinite_counts([g.view(torch.int32)], interpreted=True) is None
    assert counting.nonfinite_counts([nn.Parameter(g)], interpreted=True) is None  # not a plain tensor
    assert calls == []


def test_without_triton_there_is_no_kernel_and_nothing_is_logged(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "gradmon.capture.triton_kernels", raising=False)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        assert counting._kernel.__wrapped__() is None
    assert caplog.records == []


def test_a_triton_that_fails_to_import_is_logged_once_and_serves_no_more(monkeypatch, caplog):
    """``available()`` (asked in a block's forward hook) never raises: an import that fails
    otherwise than by Triton's absence is a failure, logged once, and the kernels serve no
    more."""
    def broken(name="count_nonfinite"):
        raise RuntimeError("triton: no usable driver")
    monkeypatch.setattr(counting, "_failed", False)
    monkeypatch.setattr(counting, "_kernel", broken)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        assert counting.available() is False and counting.available() is False
    assert counting._failed and len(caplog.records) == 1


def test_a_failing_launch_is_logged_once_and_torch_ops_count_from_then_on(monkeypatch, caplog):
    class Failing:
        launches = 0

        def __getitem__(self, grid):
            Failing.launches += 1
            raise RuntimeError("no compiler for the launcher")
    monkeypatch.setattr(counting, "_failed", False)
    monkeypatch.setattr(counting, "_kernel", Failing)
    group = [torch.full((10,), float("nan"))]
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        assert counting.nonfinite_counts(group, interpreted=True) is None
        assert counting.nonfinite_counts(group, interpreted=True) is None
    assert Failing.launches == 1 and len(caplog.records) == 1
    assert "counting with torch ops from now on" in caplog.records[0].getMessage()


@needs_cuda
@needs_triton
@pytest.mark.cuda
def test_the_kernel_counts_exactly_on_cuda():
    assert mismatches("cuda") == []
    assert not counting._failed


@needs_cuda
@needs_triton
@pytest.mark.cuda
def test_the_kernel_counts_exactly_on_a_side_stream_on_cuda():
    group = [planted(n, torch.float32, "cuda", seed) for seed, n in enumerate(SIZES)]
    counting.nonfinite_counts(group)  # the tables cached on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = counting.nonfinite_counts(group)
    torch.cuda.current_stream().wait_stream(side)
    assert got is not None and torch.equal(got.cpu(), reference(group))


@needs_cuda
@needs_triton
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_gpt2_embedding_sized_gradient_counts_exactly_on_cuda(dtype):
    """50257 x 768 elements: all NaN (one count per element, far past a program's chunk),
    then 1 in 1000 elements NaN and 1 in 1000 Inf at random places."""
    g = torch.full((50257, 768), float("nan"), dtype=dtype, device="cuda")
    assert counting.nonfinite_counts([g]).tolist() == [[g.numel(), 0]]
    g.normal_()
    flat = g.view(-1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    flat[torch.randint(0, g.numel(), (g.numel() // 1000,), device="cuda", generator=gen)] = float("nan")
    flat[torch.randint(0, g.numel(), (g.numel() // 1000,), device="cuda", generator=gen)] = float("-inf")
    assert torch.equal(counting.nonfinite_counts([g]).cpu(), reference([g]))


def _grads(device: str) -> List[torch.Tensor]:
    """A GPT-2-like mix: large bf16 matrices, small bf16 vectors, a few float32 ones."""
    out = [planted(n, torch.bfloat16, device, i) for i, n in enumerate((768 * 2304, 768 * 768, 768 * 3072) * 4)]
    out += [planted(n, torch.bfloat16, device, i) for i, n in enumerate((768, 2304, 3072) * 8)]
    out += [planted(n, torch.float32, device, i) for i, n in enumerate((768, 40000))]
    return out


@needs_cuda
@needs_triton
@pytest.mark.cuda
def test_param_grad_stats_rows_equal_those_of_torch_ops_on_cuda(monkeypatch):
    """The kernel's rows (norms summed as it counts, one launch per dtype) against torch's
    (``_foreach_norm`` and counts by torch ops): counts exact, norms to float32 rounding,
    finite gradients among the planted ones."""
    grads = _grads("cuda") + [torch.randn(n, device="cuda").to(dtype) * 3
                              for n, dtype in ((768 * 768, torch.bfloat16), (5, torch.bfloat16), (40000, torch.float32))]
    home = torch.device("cuda")
    served = []
    real = counting.norms_and_counts
    monkeypatch.setattr(counting, "norms_and_counts", lambda groups: served.append(real(groups)) or served[-1])
    rows, order = stats.param_grad_stats(grads, home)
    assert len(served) == 1 and len(served[0]) == 2  # one call, a group per dtype, small and large together
    monkeypatch.setattr(counting, "norms_and_counts", lambda groups: None)
    monkeypatch.setattr(counting, "nonfinite_counts", lambda group: None)
    rows_torch, order_torch = stats.param_grad_stats(grads, home)
    assert rows.dtype == rows_torch.dtype == torch.float64
    by_tensor, by_tensor_torch = rows[torch.tensor(order).argsort()].cpu(), rows_torch[torch.tensor(order_torch).argsort()].cpu()
    assert torch.equal(by_tensor[:, 1:], by_tensor_torch[:, 1:])
    assert torch.equal(by_tensor[:, 1:], reference(grads).double())
    assert torch.allclose(by_tensor[:, 0], by_tensor_torch[:, 0], rtol=1e-5, equal_nan=True)
    assert by_tensor[-3:, 0].isfinite().all()


def _device_kernels(fn) -> dict:
    """The device's kernels (memsets and copies too: each a launch) ``fn`` runs, by name."""
    import collections
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()  # compiled, tables built
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)


@needs_cuda
@needs_triton
@pytest.mark.cuda
def test_counting_51_large_gradients_takes_one_launch_on_cuda(monkeypatch):
    """What bench/bench_launches.py sees on GPT-2 small's ordinary step: its 51 large
    gradients' counts took several kernels each; with the kernel, one in all, which sums
    their squares too: no norm kernel of torch's."""
    grads = [planted(768 * 768, torch.bfloat16, "cuda", i) for i in range(51)]
    home = torch.device("cuda")
    with_kernel = _device_kernels(lambda: stats.param_grad_stats(grads, home))
    monkeypatch.setattr(counting, "norms_and_counts", lambda groups: None)
    monkeypatch.setattr(counting, "nonfinite_counts", lambda group: None)
    with_torch_ops = _device_kernels(lambda: stats.param_grad_stats(grads, home))
    counted = sum(n for name, n in with_kernel.items() if "count_nonfinite" in name)
    print(f"device kernels of param_grad_stats over 51 large bf16 gradients: {sum(with_kernel.values())} "
          f"with the kernel ({dict(with_kernel)}), {sum(with_torch_ops.values())} with torch ops")
    assert counted == 1 and not [name for name in with_kernel if "norm" in name.lower()], with_kernel
    assert sum(with_kernel.values()) <= 4, with_kernel  # its zeroed rows, the kernel, the root
    assert sum(with_torch_ops.values()) - sum(with_kernel.values()) >= 4 * 51, (with_kernel, with_torch_ops)


@needs_cuda
@needs_triton
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_tensors_counts_take_one_launch_and_no_copy_on_cuda(dtype):
    """The detail step's per-layer records (an output's, a gradient flow's) count one tensor at
    a time: the kernel, its zeroed block, and no table copied (a lone tensor's offsets are (0,))."""
    g = planted(3 * C + 5, dtype, "cuda", 0)
    x = planted(C + 1, dtype, "cuda", 1).reshape(-1, 1)
    assert torch.equal(stats.gradient_record(g)[1].cpu(), reference([g])[0])
    assert torch.equal(stats.activation_record(x)[1].cpu(), reference([x])[0])
    names = _device_kernels(lambda: stats.gradient_record(g))
    assert sum(n for name, n in names.items() if "count_nonfinite" in name) == 1
    assert not [name for name in names if "isnan" in name.lower() or "Memcpy" in name], names


@needs_cuda
@needs_triton
@pytest.mark.cuda
def test_an_ordinary_step_counts_by_the_kernel_without_a_host_sync_and_exactly_on_cuda(monkeypatch, tmp_path):
    """Three steps under set_sync_debug_mode("error"), then one whose gradients carry 768 NaN
    (three rows of layer 0's weight) and 512 -Inf (one row of layer 2's): the exported counters
    say exactly that."""
    import gradmon
    from conftest import scrape, value
    from test_no_host_sync import RaiseOnSync, cuda_sync_is_an_error
    served = []
    real, real_norms = counting.nonfinite_counts, counting.norms_and_counts
    monkeypatch.setattr(counting, "nonfinite_counts", lambda group: served.append(real(group)) or served[-1])
    monkeypatch.setattr(counting, "norms_and_counts", lambda groups: served.append(real_norms(groups)) or served[-1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256),
                          nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def train(steps):
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(torch.randn(32, 256, device="cuda")).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    train(1)
    # the defaults (ordinary steps); the poisoned step's incident bundle goes to tmp_path
    with gradmon.attach(model, port=0, addr="127.0.0.1", incident_dir=str(tmp_path)) as mon:
        train(1)
        with cuda_sync_is_an_error(), RaiseOnSync():
            train(3)
        rows = torch.arange(3, device="cuda")
        hooks = [model[0].weight.register_hook(lambda g: g.index_fill(0, rows, float("nan"))),
                 model[2].weight.register_hook(lambda g: g.index_fill(0, rows[:1], float("-inf")))]
        train(1)
        for hook in hooks:
            hook.remove()
        assert mon.flush()
        errors = mon._errors.counts()
        snap = mon.snapshot()
        samples = {k: v for k, v in scrape(mon.url).items() if dict(k[1]).get("model") == mon.name}
    assert snap.steps_total == 5 and sum(errors.values()) == 0, errors
    assert served and all(s is not None for s in served) and not counting._failed
    counts = {(layer, kind): value(samples, "gradmon_nonfinite_total", layer=layer, tensor="grad", kind=kind)
              for layer in ("0", "2", "4") for kind in ("nan", "inf")}
    assert counts == {("0", "nan"): 3 * 256, ("0", "inf"): 0, ("2", "nan"): 0, ("2", "inf"): 512,
                      ("4", "nan"): 0, ("4", "inf"): 0}


def param_grad_stats_through_the_kernel() -> dict:
    """Under the interpreter: the groups ``param_grad_stats`` counts by the kernel (CPU
    tensors let through) and whether its counts equal those it makes with torch ops."""
    real, served = counting.nonfinite_counts, []
    grads = [planted(n, dtype, "cpu", i) for i, (n, dtype) in enumerate(
        [(20000, torch.bfloat16), (30000, torch.bfloat16), (768, torch.bfloat16), (2304, torch.bfloat16),
         (768, torch.float32), (40000, torch.float32)])]
    counting.nonfinite_counts = lambda group: served.append(real(group, interpreted=True)) or served[-1]
    rows, order = stats.param_grad_stats(grads, torch.device("cpu"))
    counting.nonfinite_counts = lambda group: None
    rows_torch, order_torch = stats.param_grad_stats(grads, torch.device("cpu"))
    counting.nonfinite_counts = real
    equal = order == order_torch and torch.equal(rows[:, 1:], rows_torch[:, 1:])  # the count columns
    return {"served": sum(s is not None for s in served), "equal": equal}


def norms_through_the_kernel() -> dict:
    """Under the interpreter: the kernel's norms and counts of every group at once
    (``counting.norms_and_counts``) against torch's (norms to float32 rounding, counts
    exact), the gradients' rows ``param_grad_stats`` makes from them against its torch
    path's, and a set of groups one of which it cannot read (not contiguous): none served."""
    every = groups("cpu")
    made = counting.norms_and_counts(every, interpreted=True)
    bad = []
    for group, rows in zip(every, made or []):
        want = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in group]).double()
        if (rows.dtype != torch.float64 or not torch.allclose(rows[:, 0], want, rtol=1e-5, equal_nan=True)
                or not torch.equal(rows[:, 1:].long(), reference(group))):
            bad.append(f"{group[0].dtype} sizes {[g.numel() for g in group]}: {rows.tolist()}")
    finite = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
              for n, dtype in ((20000, torch.bfloat16), (768, torch.bfloat16), (40000, torch.float32), (5, torch.float32))]
    finite[2][7] = float("inf")
    real = counting.norms_and_counts
    counting.norms_and_counts = lambda gs: real(gs, interpreted=True)
    fused, order = stats._fused_rows(finite, torch.device("cpu"))
    counting.norms_and_counts = real
    counting_off = counting.nonfinite_counts
    counting.nonfinite_counts = lambda group: None
    rows, order_torch = stats._grouped_rows(finite, torch.device("cpu"), stats._norms_and_counts)
    counting.nonfinite_counts = counting_off
    by_tensor = lambda r, o: r[torch.tensor(o).argsort()]  # noqa: E731
    fused_rows = bool(torch.allclose(by_tensor(fused, order), by_tensor(rows, order_torch), rtol=1e-5))
    strided = torch.randn(8, 8)[:, ::2]
    return {"mismatches": bad, "groups": len(made or []), "fused_rows": fused_rows,
            "unservable": counting.norms_and_counts([finite[:2], [strided]], interpreted=True)}


def row_groups(device: str) -> List[tuple]:
    """(group, rows per tensor): rows of several pieces with a short last one, rows shorter
    than a block, a row length that breaks 16-byte loads, a tensor taken whole (1 row); NaN,
    Inf and -Inf planted in some rows only, at piece edges."""
    out = []
    for dtype in DTYPES:
        a = planted(4 * (C + 3), dtype, device, 0)  # 4 rows of C + 3: two pieces each
        b = torch.randn(4 * 700, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)  # rows of 700
        b[700 + 5] = float("-inf")
        c = torch.randn(3 * C, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)  # whole: 1 row
        out.append(([a, b, c], [4, 4, 1]))
        odd = torch.randn(2 * 1001, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
        odd[1001] = float("nan")
        out.append(([odd], [2]))  # rows of 1001 elements: one element at a time
    return out


def row_extremes_through_the_kernel() -> dict:
    """Under the interpreter: ``counting.row_extremes`` of every group at once (a launch each,
    one buffer) against ``torch.aminmax`` by row."""
    bad = []
    every = row_groups("cpu")
    made = counting.row_extremes([group for group, _ in every], [rows for _, rows in every], interpreted=True)
    if made is None:
        return {"mismatches": ["not served"], "groups": len(every)}
    whole, by_row, starts = made
    tensors = [(t, r) for group, rows in every for t, r in zip(group, rows)]
    if len(whole) != len(tensors) or len(starts) != len(tensors):
        return {"mismatches": [f"{len(whole)} wholes, {len(starts)} starts for {len(tensors)} tensors"],
                "groups": len(every)}
    for i, (t, r) in enumerate(tensors):
        lo, hi = torch.aminmax(t.float().reshape(r, -1), dim=1)
        want = torch.stack((lo, hi), 1)
        got = by_row[starts[i]:starts[i] + r]
        whole_want = torch.stack((lo.min(), hi.max())) if not want.isnan().any() else None
        if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.nan_to_num(), want.nan_to_num()):
            bad.append(f"{t.dtype} tensor {i} rows: {got.tolist()} != {want.tolist()}")
        if whole_want is not None and not torch.equal(whole[i], whole_want):
            bad.append(f"{t.dtype} tensor {i} whole: {whole[i].tolist()} != {whole_want.tolist()}")
        if whole_want is None and not whole[i].isnan().all():
            bad.append(f"{t.dtype} tensor {i} whole: {whole[i].tolist()} is not NaN")
    return {"mismatches": bad, "groups": len(every)}


def held_through_the_kernel() -> dict:
    """Under the interpreter: ``kernels.extremes_held`` of float32 and bf16 outputs, some with
    the batch's rows and one without (taken whole), against ``torch.aminmax``: each output's
    own pair in the returned order, and each batch row's pair where the rows are kept."""
    batch = 4
    gen = torch.Generator().manual_seed(5)
    outs = [torch.randn(batch, 3 * C + 7, generator=gen), torch.randn(batch, 900, generator=gen).bfloat16(),
            torch.randn(7, C + 1, generator=gen), torch.randn(batch, 2 * C, generator=gen).bfloat16()]
    outs[0][2, 5] = float("nan")
    outs[3][1, -1] = float("-inf")
    real = counting.row_extremes
    counting.row_extremes = lambda groups, rows: real(groups, rows, interpreted=True)
    kept: list = []
    made = stats.extremes_held(outs, torch.device("cpu"), batch, kept)
    counting.row_extremes = real
    if made is None:
        return {"mismatches": ["not served"]}
    lo, hi, order = made
    bad = []
    for j, i in enumerate(order):
        want = torch.aminmax(outs[i].float())
        got = torch.stack((lo[j, 0], hi[j, 0])).float()
        if not torch.equal(got.nan_to_num(), torch.stack(want).nan_to_num()) or got.isnan().any() != (i == 0):
            bad.append(f"output {i}: {got.tolist()} != {[w.item() for w in want]}")
    rows_seen = set()
    for idx, block, starts in kept:
        for i, start in zip(idx, starts):
            rows_seen.add(i)
            want = torch.stack(torch.aminmax(outs[i].float().reshape(batch, -1), dim=1), dim=1)
            got = block[start:start + batch]
            if not (torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())):
                bad.append(f"output {i} rows: {got.tolist()} != {want.tolist()}")
    if rows_seen != {0, 1, 3}:
        bad.append(f"rows kept for {sorted(rows_seen)}")
    return {"mismatches": bad, "order": sorted(order)}


if __name__ == "__main__":  # the interpreter's child process (TRITON_INTERPRET=1)
    print(json.dumps({"mismatches": mismatches("cpu", interpreted=True), "groups": len(groups("cpu")),
                      "param_grad_stats": param_grad_stats_through_the_kernel(),
                      "norms": norms_through_the_kernel(), "rows": row_extremes_through_the_kernel(),
                      "held": held_through_the_kernel()}))
