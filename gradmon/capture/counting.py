"""Exact NaN and Inf counts of a group of CUDA tensors in one kernel launch.

On an accelerator the counts of every gradient are taken every step: only a host read of
the norms could skip those of finite tensors, and the training thread never waits for the
device. Counted with torch ops, each tensor costs several kernels (``isnan``; ``abs`` and
a compare for ``isinf``; a sum of a bool, which CUDA copies to int64 first). One Triton
kernel (:mod:`triton_kernels`) reads every element of the group once instead.

Where it cannot serve (Triton not installed, not CUDA, a dtype it does not read, a tensor
that is not contiguous, inside a compiled region) :func:`nonfinite_counts` returns None and
the caller counts with torch ops, to the same counts. A failure to import, compile or
launch the kernel is logged once, and the torch ops serve from then on: a count is never lost.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from typing import Any, Optional, Sequence, Tuple

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
    global _failed
    if _failed:
        return None
    try:
        return _counted(group, interpreted)
    except Exception as exc:  # a failure to compile or launch: the torch ops count from now on
        _failed = True
        log.warning("gradmon: the one-launch NaN/Inf count failed; counting with torch ops from now on",
                    exc_info=(type(exc), exc, exc.__traceback__))
        return None


def _counted(group: Sequence[torch.Tensor], interpreted: bool) -> Optional[torch.Tensor]:
    first = group[0]
    itemsize = _ITEMSIZE.get(first.dtype)
    # plain tensors only: a subclass (DTensor, a fake tensor) has no memory of its own to read
    if (itemsize is None or not (first.is_cuda or interpreted) or torch.compiler.is_compiling()
            or set(map(type, group)) != {torch.Tensor} or not all(map(torch.Tensor.is_contiguous, group))):
        return None
    addresses = tuple(map(torch.Tensor.data_ptr, group))
    # 16-byte loads where every tensor starts on a 16-byte boundary (the allocator's blocks
    # do; a view into a flat buffer may not), else one element at a time, which needs the
    # tensors a whole number of elements apart
    aligned = not any(map((16).__rmod__, addresses))
    if not aligned and any(map(itemsize.__rmod__, addresses)):
        return None
    kernel = _kernel()
    return None if kernel is None else _launch(kernel, group, addresses, itemsize, 16 // itemsize if aligned else 1)


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    try:
        from .triton_kernels import count_nonfinite
    except ImportError:  # Triton is not installed: no log, the torch ops are the normal case
        return None
    return count_nonfinite


def _launch(kernel: Any, group: Sequence[torch.Tensor], addresses: Tuple[int, ...], itemsize: int, align: int
            ) -> torch.Tensor:
    device = group[0].device
    # The cached tables are kept per stream: one made (copied) on another stream would not
    # be ordered before this launch, nor its memory's reuse after it.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    numels = tuple(map(torch.Tensor.numel, group))
    work, programs = _work(numels, device, stream)
    out = torch.zeros((len(group), 2), dtype=torch.int64, device=device)
    if programs:
        # the base pointer is a tensor with elements: an empty one's may be null, which
        # Triton refuses as an argument
        base = next(i for i, n in enumerate(numels) if n)
        offsets = _offset_table(tuple(map(operator.sub, addresses, itertools.repeat(addresses[base]))), device, stream)
        # Triton launches on the current device's current stream: the tensors' device,
        # and the stream their memory is ordered on (as a torch op on them would be)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            # enable_fp_fusion: the kernel has no multiply-add to fuse; said, so that Triton
            # does not warn the user about its default
            kernel[(programs,)](group[base], offsets, work, out, ITEMSIZE=itemsize, ALIGN=align, BLOCK=BLOCK,
                                CHUNK=CHUNK, enable_fp_fusion=False)
    return out


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


def _to_device(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, by a non-blocking copy from pinned
    memory: the host never waits. The caching host allocator does not hand the pinned
    block out again before the copy has run (the copy records an event on it), so a later
    step cannot overwrite a table still in flight."""
    host = torch.tensor(values, dtype=torch.int64)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
