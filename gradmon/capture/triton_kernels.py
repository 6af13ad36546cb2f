"""The Triton kernel of :mod:`counting`. Imported only where Triton is installed and a
CUDA tensor needs it: Triton is not a dependency of gradmon."""

import triton
import triton.language as tl


@triton.jit
def count_nonfinite(base, offsets, work, out, ITEMSIZE: tl.constexpr, ALIGN: tl.constexpr,
                    BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program p adds the NaN and Inf elements of one chunk to its tensor's row of ``out``.

    ``work[3p:3p+3]`` is (tensor i, chunk k, end): elements ``k * CHUNK`` to ``end`` of
    tensor i, which starts ``offsets[i]`` bytes after ``base`` (one of the tensors). A tensor
    is reached as ``base`` plus an element offset, not by casting its address to a pointer,
    so that the compiler keeps ``base``'s known alignment; offsets and starts are built as multiples of ``ALIGN``
    and ``CHUNK`` (every address is a multiple of ``ALIGN`` elements, the host checked), which
    lets it load 16 bytes at a time. A chunk's counts fit int32; the totals are int64
    atomics, and a chunk with nothing to add (the usual case) issues none."""
    p = tl.program_id(0)
    tensor = tl.load(work + 3 * p)
    start = tl.load(work + 3 * p + 1) * CHUNK
    end = tl.load(work + 3 * p + 2)
    offset = tl.load(offsets + tensor) // (ITEMSIZE * ALIGN) * ALIGN
    data = base + offset
    if end - start == CHUNK:  # a whole chunk: no mask, whose unknown end would keep loads narrow
        nans, infs = _count_chunk(data, start, end, False, BLOCK, CHUNK)
    else:
        nans, infs = _count_chunk(data, start, end, True, BLOCK, CHUNK)
    tl.atomic_add(out + 2 * tensor, nans.to(tl.int64), mask=nans > 0)
    tl.atomic_add(out + 2 * tensor + 1, infs.to(tl.int64), mask=infs > 0)


@triton.jit
def _count_chunk(data, start, end, MASKED: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    inf = tl.zeros([BLOCK], dtype=tl.int32)
    for step in range(0, CHUNK, BLOCK):
        index = start + step + tl.arange(0, BLOCK)
        if MASKED:
            x = tl.load(data + index, mask=index < end, other=0.0).to(tl.float32)
        else:
            x = tl.load(data + index).to(tl.float32)
        nan += (x != x).to(tl.int32)
        inf += (tl.abs(x) == float("inf")).to(tl.int32)
    return tl.sum(nan, axis=0), tl.sum(inf, axis=0)
