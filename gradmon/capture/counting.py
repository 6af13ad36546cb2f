"""Exact NaN and Inf counts of a group of CUDA tensors in one kernel launch, and their L2
norms in the same pass where they are asked; and the min and max of each batch row of a
group (the top-level blocks' outputs, :func:`row_extremes`) in one launch.

On an accelerator the counts of every gradient are taken every step: only a host read of
the norms could skip those of finite tensors, and the training thread never waits for the
device. Counted with torch ops, each tensor costs several kernels (``isnan``; ``abs`` and
a compare for ``isinf``; a sum of a bool, which CUDA copies to int64 first). One Triton
kernel (:mod:`triton_kernels`) reads every element of the group once instead; asked for
the norms as well (:func:`norms_and_counts`, the gradients' every-step record), it sums
the squares in that pass, where ``_foreach_norm`` read every gradient again, and its
host cost (a few microseconds per tensor: an output tensor for each) was the largest
part of the gradients' record on a GPU.

Where it cannot serve (Triton not installed, not CUDA, a dtype it does not read, a tensor
that is not contiguous, inside a compiled region) :func:`nonfinite_counts` returns None and
the caller counts with torch ops, to the same counts (and norms, to float32 rounding). A failure to import, compile or
launch the kernel is logged once, and the torch ops serve from then on: a count is never lost.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import log

_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}

BLOCK = 1024
"""Elements a program reads in one iteration."""

CHUNK = 16 * BLOCK
"""Elements one program counts: enough to amortise its start and its atomics, few enough
that a large gradient spreads over many programs (and far below int32's range, which
holds a program's partial counts)."""

_failed = False


def nonfinite_counts(group: Sequence[torch.Tensor], interpreted: bool = False) -> Optional[torch.Tensor]:
    """(n, 2) int64 [NaN, Inf] counts of ``group`` (tensors of one device and dtype), row i
    for ``group[i]``, from one kernel launch; or None where the kernel cannot serve. Nothing
    is read on the host and nothing raises. ``interpreted`` lets CPU tensors through, for
    Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported): how the
    tests run the kernel without a GPU."""
    if _failed:
        return None
    try:
        layout = _layout(group, interpreted)
        return None if layout is None else _launch(group, *layout, squares=False)
    except Exception as exc:
        _fail(exc)
        return None


def norms_and_counts(groups: Sequence[Sequence[torch.Tensor]], interpreted: bool = False
                     ) -> Optional[List[torch.Tensor]]:
    """For each of ``groups`` (tensors of one device and dtype), an (n, 3) float64 [L2 norm,
    NaN, Inf] tensor, row i for ``group[i]``: one kernel launch and a root per group; or
    None, with nothing launched, where the kernel cannot serve every group (as
    :func:`nonfinite_counts`). The norm is summed in float32 within a chunk of
    :data:`CHUNK` elements and in float64 across them; a NaN element makes it NaN and an
    Inf one Inf (or NaN), as ``torch.linalg.vector_norm`` in float32 does."""
    if _failed:
        return None
    try:
        layouts = [_layout(group, interpreted) for group in groups]
        if None in layouts:
            return None
        out = [_launch(group, *layout, squares=True) for group, layout in zip(groups, layouts)]  # type: ignore[misc]
    except Exception as exc:
        _fail(exc)
        return None
    for rows in out:
        rows[:, 0].sqrt_()
    return out


def _fail(exc: BaseException) -> None:
    """A failure to compile or launch: the torch ops count from now on."""
    global _failed
    _failed = True
    log.warning("gradmon: the one-launch NaN/Inf count failed; counting with torch ops from now on",
                exc_info=(type(exc), exc, exc.__traceback__))


def _layout(group: Sequence[torch.Tensor], interpreted: bool, pieces: Tuple[int, ...] = ()
            ) -> Optional[Tuple[Tuple[int, ...], int, int]]:
    """(the tensors' addresses, item size, elements a load reads) where the kernels can read
    ``group``, else None; ``pieces``: lengths at which the reads start over (batch rows)."""
    first = group[0]
    itemsize = _ITEMSIZE.get(first.dtype)
    # plain tensors only: a subclass (DTensor, a fake tensor) has no memory of its own to read
    if (itemsize is None or not (first.is_cuda or interpreted) or torch.compiler.is_compiling()
            or set(map(type, group)) != {torch.Tensor} or not all(map(torch.Tensor.is_contiguous, group))
            or _kernel() is None):
        return None
    addresses = tuple(map(torch.Tensor.data_ptr, group))
    # 16-byte loads where every tensor starts on a 16-byte boundary (the allocator's blocks
    # do; a view into a flat buffer may not), else one element at a time, which needs the
    # tensors a whole number of elements apart
    aligned = not any(map((16).__rmod__, addresses)) and not any(map((16 // itemsize).__rmod__, pieces))
    if not aligned and any(map(itemsize.__rmod__, addresses)):
        return None
    return addresses, itemsize, 16 // itemsize if aligned else 1


def row_extremes(groups: Sequence[Sequence[torch.Tensor]], rows: Sequence[Sequence[int]], interpreted: bool = False
                 ) -> Optional[Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]]:
    """(whole, by_row, starts) of the tensors of ``groups`` (each of one dtype, all on one
    device, none empty), taken in order, group after group: tensor i cut into ``rows``' i-th
    count of equal rows (its batch, or 1); ``whole`` the (n, 2) float32 [min, max] of each
    tensor, ``by_row[starts[i] + r]`` the [min, max] of row r of tensor i. NaN propagates
    and an Inf keeps its sign, as ``torch.aminmax``. One kernel launch a group (pieces of at
    most :data:`CHUNK` elements of a row each) into one buffer, then two reductions by
    segment for all; None, with nothing launched, where the kernel cannot serve them all."""
    if _failed:
        return None
    try:
        layouts = []
        for group, counts in zip(groups, rows):
            lengths = tuple(map(operator.floordiv, map(torch.Tensor.numel, group), counts))
            layout = _layout(group, interpreted, lengths)
            if layout is None:
                return None
            layouts.append((lengths, tuple(counts), layout))
        kernel = _kernel("row_extremes")
        if kernel is None:
            return None
        device = groups[0][0].device
        stream = _stream(device)
        work, programs, pieces, per_tensor, starts = _row_work(
            tuple((lengths, counts, layout[2]) for lengths, counts, layout in layouts), device, stream)
        out = torch.empty((sum(programs), 2), dtype=torch.float32, device=device)
        at = 0
        with _on_its_device(device):
            for group, (_, _, (addresses, itemsize, align)), n in zip(groups, layouts, programs):
                kernel[(n,)](group[0], _offsets(addresses, 0, device, stream), work[3 * at:], out[at:],
                             ITEMSIZE=itemsize, ALIGN=align, BLOCK=BLOCK, CHUNK=CHUNK, enable_fp_fusion=False)
                at += n
        # [min, -max]: one min by segment takes every row, then every tensor
        by_row = torch.segment_reduce(out, "min", lengths=pieces, axis=0, unsafe=True)
        whole = torch.segment_reduce(by_row, "min", lengths=per_tensor, axis=0, unsafe=True)
        sign = _sign(device)
        return whole.mul_(sign), by_row.mul_(sign), starts
    except Exception as exc:
        _fail(exc)
        return None


@functools.lru_cache(maxsize=64)
def _row_work(layouts: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...], int], ...], device: torch.device, stream: int
              ) -> Tuple[torch.Tensor, Tuple[int, ...], torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """For groups of (row lengths, rows, align): (the flat (tensor i within its group, start /
    align, end) rows of every piece of every batch row, group after group, on ``device``;
    each group's number of pieces; the pieces of each row and the rows of each tensor, on
    ``device``; each tensor's first row among all). The same few layouts come back every
    step: built and copied once each; built by tensor ops, so that a new layout (a batch
    of another shape) costs the same few operations however many pieces it has."""
    works, pieces, counts, programs = [], [], [], []
    for lengths, rows, align in layouts:
        length, count = torch.tensor(lengths, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)
        per_row = (length + CHUNK - 1) // CHUNK
        per_tensor = count * per_row
        tensor = torch.repeat_interleave(torch.arange(len(lengths)), per_tensor)
        first_piece = torch.cumsum(per_tensor, 0) - per_tensor
        j = torch.arange(len(tensor)) - first_piece[tensor]  # a piece's place within its tensor
        n, p = length[tensor], per_row[tensor]
        start = j // p * n + j % p * CHUNK
        end = torch.minimum(start + CHUNK, (j // p + 1) * n)
        works.append(torch.stack((tensor, start // align, end), dim=1).reshape(-1))
        pieces.append(torch.repeat_interleave(per_row, count))
        counts.append(count)
        programs.append(len(tensor))
    every_row = [r for _, rows, _ in layouts for r in rows]
    starts = tuple(itertools.accumulate(every_row, initial=0))[:-1]
    return (_on(torch.cat(works), device), tuple(programs), _on(torch.cat(pieces), device),
            _on(torch.cat(counts), device), starts)


@functools.lru_cache(maxsize=8)
def _sign(device: torch.device) -> torch.Tensor:
    return _to_device((1, -1), device).to(torch.float32)


@functools.lru_cache(maxsize=2)
def _kernel(name: str = "count_nonfinite") -> Any:
    try:
        from .triton_kernels import count_nonfinite, row_extremes
    except ImportError:  # Triton is not installed: no log, the torch ops are the normal case
        return None
    return {"count_nonfinite": count_nonfinite, "row_extremes": row_extremes}[name]


def available() -> bool:
    """Whether the kernels may serve here (Triton importable, none failed). Never raises:
    a Triton whose import fails otherwise than by its absence is a failure, logged once."""
    if _failed:
        return False
    try:
        return _kernel() is not None
    except Exception as exc:
        _fail(exc)
        return False


def _launch(group: Sequence[torch.Tensor], addresses: Tuple[int, ...], itemsize: int, align: int,
            squares: bool) -> torch.Tensor:
    kernel, device = _kernel(), group[0].device
    stream = _stream(device)
    numels = tuple(map(torch.Tensor.numel, group))
    work, programs = _work(numels, device, stream)
    out = (torch.zeros((len(group), 3), dtype=torch.float64, device=device) if squares
           else torch.zeros((len(group), 2), dtype=torch.int64, device=device))
    if programs:
        # the base pointer is a tensor with elements: an empty one's may be null, which
        # Triton refuses as an argument
        base = next(i for i, n in enumerate(numels) if n)
        with _on_its_device(device):
            # enable_fp_fusion: said, so that Triton does not warn the user about its default
            # (the squares' sum needs no fused multiply-add)
            kernel[(programs,)](group[base], _offsets(addresses, base, device, stream), work, out, ITEMSIZE=itemsize,
                                ALIGN=align, BLOCK=BLOCK, CHUNK=CHUNK, SQUARES=squares, enable_fp_fusion=False)
    return out


def _stream(device: torch.device) -> int:
    """The stream a launch on ``device`` is ordered on (its current one; 0 off CUDA). The
    cached tables are kept per stream: one made (copied) on another stream would not be
    ordered before this launch, nor its memory's reuse after it."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _on_its_device(device: torch.device) -> Any:
    """Triton launches on the current device's current stream: the tensors' device, and the
    stream their memory is ordered on (as a torch op on them would be)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _offsets(addresses: Tuple[int, ...], base: int, device: torch.device, stream: int) -> torch.Tensor:
    """The byte offsets of ``addresses`` from ``addresses[base]``, on ``device`` (cached)."""
    return _offset_table(tuple(map(operator.sub, addresses, itertools.repeat(addresses[base]))), device, stream)


@functools.lru_cache(maxsize=64)
def _work(numels: Tuple[int, ...], device: torch.device, stream: int) -> Tuple[torch.Tensor, int]:
    """(the flat (tensor, chunk, end) rows of every chunk of :data:`CHUNK` elements, on
    ``device``; their number). The same few layouts come back every step: built and copied
    once each."""
    rows = [(i, k, min((k + 1) * CHUNK, n)) for i, n in enumerate(numels) for k in range(-(-n // CHUNK))]
    return _to_device(tuple(itertools.chain.from_iterable(rows)), device), len(rows)


@functools.lru_cache(maxsize=8)
def _offset_table(offsets: Tuple[int, ...], device: torch.device, stream: int) -> torch.Tensor:
    """Cached. Offsets from the group's first tensor, not addresses: a lone tensor's table is
    always (0,), and gradients freed and reallocated every step (``zero_grad(set_to_none=True)``)
    mostly come back at the same places, so most calls copy nothing."""
    return _to_device(offsets, device)


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, as :func:`_to_device` copies."""
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def _to_device(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, by a non-blocking copy from pinned
    memory: the host never waits. The caching host allocator does not hand the pinned
    block out again before the copy has run (the copy records an event on it), so a later
    step cannot overwrite a table still in flight."""
    return _on(torch.tensor(values, dtype=torch.int64), device)
