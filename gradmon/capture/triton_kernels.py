"""The Triton kernels of :mod:`counting`. Imported only where Triton is installed and a
CUDA tensor needs them: Triton is not a dependency of gradmon."""

import triton
import triton.language as tl


@triton.jit
def count_nonfinite(base, offsets, work, out, ITEMSIZE: tl.constexpr, ALIGN: tl.constexpr,
                    BLOCK: tl.constexpr, CHUNK: tl.constexpr, SQUARES: tl.constexpr):
    """Program p adds the NaN and Inf elements of one chunk to its tensor's row of ``out``
    and, with ``SQUARES``, the sum of the chunk's squares before them.

    ``work[3p:3p+3]`` is (tensor i, chunk k, end): elements ``k * CHUNK`` to ``end`` of
    tensor i, which starts ``offsets[i]`` bytes after ``base`` (one of the tensors). A tensor
    is reached as ``base`` plus an element offset, not by casting its address to a pointer,
    so that the compiler keeps ``base``'s known alignment; offsets and starts are built as multiples of ``ALIGN``
    and ``CHUNK`` (every address is a multiple of ``ALIGN`` elements, the host checked), which
    lets it load 16 bytes at a time. A chunk's counts fit int32 and its squares are summed
    in float32 (a square overflows there as torch's float32 norm does: a NaN or an Inf
    element makes the sum NaN or Inf); the totals are atomics in ``out``'s dtype (int64
    counts; float64 rows [squares, NaN, Inf] with ``SQUARES``), and a count with nothing
    to add (the usual case) issues none."""
    tensor, data, start, end = _piece(base, offsets, work, ITEMSIZE, ALIGN, CHUNK)
    if end - start == CHUNK:  # a whole chunk: no mask, whose unknown end would keep loads narrow
        nans, infs, squares = _count_chunk(data, start, end, False, SQUARES, BLOCK, CHUNK)
    else:
        nans, infs, squares = _count_chunk(data, start, end, True, SQUARES, BLOCK, CHUNK)
    row = out + (2 + SQUARES) * tensor
    if SQUARES:
        tl.atomic_add(row, squares.to(tl.float64))
    kind = row.dtype.element_ty
    tl.atomic_add(row + SQUARES, nans.to(kind), mask=nans > 0)
    tl.atomic_add(row + SQUARES + 1, infs.to(kind), mask=infs > 0)


@triton.jit
def _piece(base, offsets, work, ITEMSIZE: tl.constexpr, ALIGN: tl.constexpr, UNIT: tl.constexpr):
    """(tensor i, its data, start, end) of this program's piece: ``work[3p:3p+3]`` is (i,
    start / ``UNIT``, end), and tensor i starts ``offsets[i]`` bytes after ``base``."""
    p = tl.program_id(0)
    tensor = tl.load(work + 3 * p)
    start = tl.load(work + 3 * p + 1) * UNIT
    end = tl.load(work + 3 * p + 2)
    offset = tl.load(offsets + tensor) // (ITEMSIZE * ALIGN) * ALIGN
    return tensor, base + offset, start, end


@triton.jit
def _count_chunk(data, start, end, MASKED: tl.constexpr, SQUARES: tl.constexpr, BLOCK: tl.constexpr,
                 CHUNK: tl.constexpr):
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    inf = tl.zeros([BLOCK], dtype=tl.int32)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for step in range(0, CHUNK, BLOCK):
        index = start + step + tl.arange(0, BLOCK)
        if MASKED:
            x = tl.load(data + index, mask=index < end, other=0.0).to(tl.float32)
        else:
            x = tl.load(data + index).to(tl.float32)
        nan += (x != x).to(tl.int32)
        inf += (tl.abs(x) == float("inf")).to(tl.int32)
        if SQUARES:
            squares += x * x
    return tl.sum(nan, axis=0), tl.sum(inf, axis=0), tl.sum(squares, axis=0)


@triton.jit
def row_extremes(base, offsets, work, out, ITEMSIZE: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Program p writes [min, -max] of one piece of one batch row to ``out[p]`` (NaN, both,
    where the piece holds a NaN; an Inf keeps its sign): ``work[3p:3p+3]`` is (tensor i,
    start / ``ALIGN``, end), at most :data:`CHUNK` elements of tensor i, reached as in
    :func:`count_nonfinite`. The max is negated so that one ``min`` reduction by segment
    takes both columns of every row's pieces, and every row's of a tensor, at once."""
    _, data, start, end = _piece(base, offsets, work, ITEMSIZE, ALIGN, ALIGN)
    if end - start == CHUNK:
        lo, hi, nans = _extremes_chunk(data, start, end, False, BLOCK, CHUNK)
    else:
        lo, hi, nans = _extremes_chunk(data, start, end, True, BLOCK, CHUNK)
    lo = tl.where(nans > 0, float("nan"), lo)
    hi = tl.where(nans > 0, float("nan"), -hi)
    p = tl.program_id(0)
    tl.store(out + 2 * p, lo)
    tl.store(out + 2 * p + 1, hi)


@triton.jit
def _extremes_chunk(data, start, end, MASKED: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # a NaN is counted apart: the min and max of the other values need no NaN rule of their own
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    for step in range(0, CHUNK, BLOCK):
        index = start + step + tl.arange(0, BLOCK)
        if MASKED:
            inside = index < end
            x = tl.load(data + index, mask=inside, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, tl.where(inside, x, float("inf")))
            hi = tl.maximum(hi, tl.where(inside, x, float("-inf")))
        else:
            x = tl.load(data + index).to(tl.float32)
            lo = tl.minimum(lo, x)
            hi = tl.maximum(hi, x)
        nan += (x != x).to(tl.int32)
    return tl.min(lo, axis=0), tl.max(hi, axis=0), tl.sum(nan, axis=0)
