"""On-device statistics: small reductions launched from hooks, and the one per-step packet.

Nothing here reads a value on the host. Every function returns device tensors; the
only device-to-host transfer is :func:`to_host`, once per optimizer step, and on CUDA
it is asynchronous (pinned buffer, ``non_blocking``, an event waited on by the
publisher thread, never by the training thread).

Values are shipped as float64 so that element counts stay exact far beyond float32's
2**24 (a 100M-element gradient that is all NaN must count 100M).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections import defaultdict
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import counting

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_ZERO_COUNTS = torch.zeros(2, dtype=torch.int64)  # CPU only: see _host_says_finite


def host_values(values: Sequence[object], device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A small tensor of values the host knows, on ``device``: built in host memory and
    copied with ``non_blocking``, because ``torch.tensor`` given a CUDA ``device`` copies
    synchronously (a stream sync, which ``set_sync_debug_mode("error")`` refuses)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _ship_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; counts there are exact only below 2**24 per tensor.
    return torch.float32 if device.type == "mps" else torch.float64


def _norm_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """Reduce in float32 at least (a large fp16/bf16 norm must not overflow to Inf), and
    in the tensor's own dtype when it is wider: vector_norm refuses to narrow float64."""
    return torch.float32 if t.dtype in _LOW_PRECISION or t.dtype == torch.float32 else None


_DOT_MIN = 2 ** 14  # below it the dot's extra sqrt launch costs more than it saves


def _l2(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``t`` as a 0-d tensor, reduced in float32 at least. A large
    contiguous float32/float64 tensor on the CPU takes the root of its BLAS dot product
    with itself: as fast as ``vector_norm`` there or faster, and closer to the float64
    norm (docs/benchmark.md, "Kernel choices"). Both overflow alike
    (a value above ~1.8e19 squares to Inf in float32), so a finite norm still proves the
    tensor finite (:func:`_host_says_finite`). Inside a compiled region the dot would be an
    extern call, which Inductor cannot fuse with the record's other reductions: there it
    is ``vector_norm``."""
    if _takes_dot(t):
        return _dot(t).sqrt()
    return torch.linalg.vector_norm(t, 2, dtype=_norm_dtype(t))


def _takes_dot(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and t.numel() >= _DOT_MIN
            and t.is_contiguous() and not torch.compiler.is_compiling())


def _dot(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.dot(flat, flat)


def _counts(t: torch.Tensor) -> torch.Tensor:
    """int64 [NaN, Inf] of one tensor: one kernel launch on CUDA where Triton serves
    (:mod:`counting`), else torch ops. Inside a compiled region the torch ops, which fuse
    into the record's other reductions there (and :mod:`counting` is not traced)."""
    found = None if torch.compiler.is_compiling() else counting.nonfinite_counts((t,))
    if found is not None:
        return found.reshape(2)
    return torch.stack((torch.isnan(t).sum(), torch.isinf(t).sum()))


def _host_says_finite(norms: torch.Tensor) -> bool:
    """Whether counting can be skipped because every norm is finite.

    A NaN element makes an L2 norm NaN and an Inf element makes it Inf (or NaN), so a
    finite norm proves the tensor finite. Exact counts cost two more passes over the
    data, ten times the norm itself. Only a CPU norm is looked at: it is host memory
    already, so reading it waits for nothing (``tolist`` does not even dispatch). On
    an accelerator the answer is always False and the counts are computed on the
    device every step, because looking would be a host sync. Inside a compiled region
    too: there the counts fuse into the norm's own pass, and a read would break the graph.
    """
    if norms.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    values = norms.tolist()
    return all(map(math.isfinite, values if isinstance(values, list) else [values]))


def _dense(g: torch.Tensor) -> torch.Tensor:
    # Sparse gradients (nn.Embedding(sparse=True)) carry duplicate indices until
    # coalesced; their values hold every element that is not an implicit zero.
    return g.coalesce().values() if g.is_sparse else g


def activation_record(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float32 or float64 [L2 norm, min, max], int64 [nan, inf]) of one layer output.

    Three kernels per call, because hooks run once per layer per forward: the squaring
    and max(|min|, |max|) happen on the host. min/max come from aminmax, faster on the
    CPU than the inf-norm kernel (docs/benchmark.md, "Kernel choices")."""
    x = x.detach()
    norm = _l2(x)
    lo, hi = torch.aminmax(x)
    if lo.dtype != norm.dtype:  # a call per layer saved where they agree (float32, float64)
        lo, hi = lo.to(norm.dtype), hi.to(norm.dtype)
    counts = _ZERO_COUNTS if _host_says_finite(norm) else _counts(x)
    return torch.stack((norm, lo, hi)), counts


def extremes(x: torch.Tensor, batch: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
    """(min, max) of a tensor: one reduction kernel and no full-size temporary, where
    ``isfinite(x).all()`` would allocate a bool copy as large as ``x`` (gigabytes for an
    LLM's logits). Enough to tell a NaN or an Inf of either sign, and never overflows.

    Given ``batch`` (``x`` :func:`has_rows`): (min, max, rows), the same pass made per
    batch row, ``rows`` the (batch, 2) [min, max] of each row and min/max reduced from
    them (over ``batch`` values, not the data). NaN propagates, so a row's pair says
    whether that row holds a NaN or an Inf.

    On the CPU the whole tensor's pair comes first, and the rows only when it is not
    finite: the rows are read at an incident only, the pair is host memory already
    (:func:`_host_says_finite`), and two more passes over every block's output each step
    would cost more than all the other ordinary-step checks. The rows of a finite tensor
    are then zeros, finite as its rows are. The rows take ``amin`` and ``amax`` apart:
    the CPU's ``aminmax`` along a dimension is a slow kernel (several times one pass over
    the whole tensor), where the two reductions cost about one pass each."""
    if batch is None:
        return torch.aminmax(x.detach())
    x = x.detach()
    if x.device.type == "cpu":
        lo, hi = torch.aminmax(x)
        if _host_says_finite(lo) and _host_says_finite(hi):
            return lo, hi, torch.zeros((batch, 2), dtype=x.dtype)
        by_row = x.reshape(batch, -1)
        lo, hi = by_row.amin(dim=1), by_row.amax(dim=1)
    else:
        lo, hi = torch.aminmax(x.reshape(batch, -1), dim=1)
    return lo.min(), hi.max(), torch.stack((lo, hi), dim=1)


def finite_check(x: torch.Tensor, batch: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
    """What the NaN origin needs of a forward value, as :func:`extremes` returns it: a
    (lo, hi) pair whose NaN or Inf of either sign says what non-finite kinds ``x`` holds
    (``statistics.nonfinite_flags``), with ``batch``'s rows where it has them.

    On the CPU a large float tensor is first proved finite by its dot product with itself
    (a BLAS pass, about half the time of ``aminmax`` over the same memory, and block
    outputs are the forward's largest tensors); a finite one returns (-norm, norm), which
    bound every value (``|x_i| <= ||x||``), and rows of zeros as :func:`extremes` does.
    Only a tensor that is not finite, or whose squares overflow (values above ~1e19),
    pays for the exact extremes. Elsewhere (a tensor subclass too), and inside a compiled
    region, the extremes."""
    x = x.detach()
    if type(x) is torch.Tensor and _takes_dot(x):
        squares = _dot(x)
        if _host_says_finite(squares):
            bound = squares.sqrt_()
            if batch is None:
                return -bound, bound
            return -bound, bound, torch.zeros((batch, 2), dtype=x.dtype)
    return extremes(x, batch)


def has_rows(x: torch.Tensor, batch: Optional[int]) -> bool:
    """Whether ``x``'s first dimension is the batch of ``batch`` rows."""
    return batch is not None and x.dim() > 0 and x.shape[0] == batch and x.numel() > 0


def extremes_and_nonzero(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """((min, max), [non-zero elements]) of an fp16 gradient: two reductions and no
    full-size temporary (``count_nonzero`` reduces in place, where ``g == 0`` would
    allocate a bool copy); the zeros are the rest of ``numel``, counted on the host."""
    g = _dense(g.detach())
    return torch.stack(torch.aminmax(g)), torch.count_nonzero(g).reshape(1)


MOMENTS_SAMPLE = 2 ** 14
"""Most elements of one output that :func:`moments_record` reads. The kurtosis of 16,384
elements has a standard error near 0.04 for a Gaussian (3 ± 0.04), far below what an
outlier feature does to it (tens to thousands), and an output of any size then costs one
copy of the sample during forward."""


@functools.lru_cache(maxsize=1024)
def _sample_stride(shape: Sequence[int], numel: int, limit: int) -> int:
    """The step of a systematic sample of at most ``limit`` elements of a contiguous
    tensor of ``shape``: a prime that divides no dimension, so that the sample visits every
    index of every dimension (every feature, channel and position) in equal measure
    rather than one column over and over."""
    step = max(1, -(-numel // limit))
    while step > 1 and (not _is_prime(step) or any(d % step == 0 for d in shape)):
        step += 1
    return step


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, int(n ** 0.5) + 1))


RUN = 16
"""Elements of one contiguous run of :func:`sample_runs`: 64 bytes of float32, one cache
line read whole, where single elements a stride apart cost a line each. Longer runs
are cheaper still but, with fewer of them per matrix, miss whole rows and move an
embedding's ratio more (docs/benchmark.md, "Kernel choices", for the figures)."""


@functools.lru_cache(maxsize=1024)
def sample_runs(shape: Sequence[int], numel: int, limit: int) -> Tuple[int, int]:
    """(runs, step): a sample of a contiguous tensor of ``shape`` (``numel`` > ``limit``)
    made of ``runs`` runs of :data:`RUN` consecutive elements starting every ``step``
    elements, at most ``limit`` elements in all. ``step`` shares no factor with any
    dimension, so the runs start at every offset of every row in equal measure rather than
    all at column 0 (a run shorter than a row would otherwise never see its last columns)."""
    runs = max(1, min(limit, numel) // RUN)
    if runs == 1:
        return 1, 0
    step = (numel - RUN) // (runs - 1)
    while step > RUN and any(math.gcd(step, d) > 1 for d in shape if d > 1):
        step -= 1
    return runs, step


def sample(x: torch.Tensor, limit: int) -> torch.Tensor:
    """The elements of ``x`` (flat) that a sampled statistic reads: all of them up to
    ``limit``, else every ``_sample_stride``-th one; a view of ``x`` (no copy). Single
    elements a prime stride apart reach every index of every dimension (every feature,
    channel and spatial row); :func:`sample_runs` is cheaper to gather but only spreads
    evenly over a matrix's rows and columns."""
    flat = x.detach().reshape(-1)
    # traced, the cache is the compiler's: it computes the stride once per shape anyway
    stride = (_sample_stride.__wrapped__ if torch.compiler.is_compiling() else _sample_stride)(
        tuple(x.shape), flat.numel(), limit)
    return flat[::stride] if stride > 1 else flat


def moments_record(x: torch.Tensor, limit: int = MOMENTS_SAMPLE) -> Tuple[torch.Tensor]:
    """One record's raw material for the MOMENTS columns: the output's sample
    (:func:`sample`), copied flat in float32 at least. The moments themselves are computed
    for all of a step's records at once by :func:`moments_block`: a handful of kernels per
    step instead of a dozen per layer."""
    part = sample(x, limit)
    wide = torch.float64 if part.dtype == torch.float64 else torch.float32
    return part.to(dtype=wide, copy=True).reshape(-1),


class Scratch:
    """Memory one caller reuses from call to call, for the large temporaries of a step's
    batched statistics. On the CPU a fresh block of a few MB is fresh pages from the OS,
    and faulting them in costs more than the arithmetic on them (docs/benchmark.md,
    "Kernel choices"); a device's caching allocator already reuses its blocks, so
    elsewhere each call gets fresh memory and nothing is held. Held memory is the largest
    block asked for under each name; nothing returned to callers may alias it."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: Dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``; on the CPU the memory ``name`` held last time."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        held = self._held.get(name)
        if held is None or held.dtype != dtype or held.numel() < numel:
            held = self._held[name] = torch.empty(numel, dtype=dtype)
        return held[:numel].view(shape)

    def padded(self, name: str, pieces: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
               ) -> torch.Tensor:
        """1-D ``pieces`` as the zero-padded rows of one (n, longest) block on ``device``."""
        if device.type != "cpu":
            return torch.nn.utils.rnn.pad_sequence([t.to(device, dtype) for t in pieces], batch_first=True)
        lengths = [t.numel() for t in pieces]
        block = self.take(name, (len(pieces), max(lengths)), dtype, device)
        for row, t, k in zip(block, pieces, lengths):
            row[:k].copy_(t)
            if k < row.shape[0]:
                row[k:].zero_()
        return block


def moments_block(samples: Sequence[torch.Tensor], numels: Sequence[int], home: torch.device,
                  scratch: Optional[Scratch] = None) -> torch.Tensor:
    """(n, 6) MOMENTS rows [mean, scale, m1, m2, m3, m4] of n records' samples, with
    m_k = sum(z**k), z = (x - mean) / scale, each row's sums scaled from its sample to the
    ``numels`` elements its output held, so that outputs of different sizes fold in
    proportion to their sizes. Centred, because raw power sums cancel catastrophically
    (activations near 1e4 with a spread of 0.1 lose every digit even in float64); scaled to
    unit RMS, because the fourth power of a blown-up activation overflows float32 long
    before the activation itself does. The float32 mean's rounding is left in m1 for the
    host to correct. The samples are zero-padded to one (n, longest) block; the padding is
    masked out after centring."""
    lengths = tuple(t.numel() for t in samples)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in samples) else torch.float32
    scratch = scratch or Scratch()
    return _moments(scratch.padded("moments", samples, dtype, home), lengths, numels, home, scratch)


def _moments(block: torch.Tensor, lengths: Sequence[int], numels: Sequence[int], home: torch.device,
             scratch: Scratch) -> torch.Tensor:
    """:func:`moments_block`'s rows of ``block``, the samples as zero-padded rows of
    ``lengths`` elements (float32 or float64, on ``home``; overwritten)."""
    dtype, lengths = block.dtype, tuple(lengths)
    n = host_values(lengths, home, dtype).unsqueeze(1)
    mean = block.sum(1, keepdim=True) / n
    # in place where it can be: on the CPU every fresh block-sized tensor is fresh pages
    # from the OS, slower to fault in than the arithmetic on them
    z = block.sub_(mean)
    if min(lengths) < block.shape[1]:
        z.mul_(_padding_mask(lengths, home, dtype))
    norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
    scale = (norm / n.sqrt()).clamp_min_(torch.finfo(dtype).tiny)
    z.div_(scale)
    z2 = torch.mul(z, z, out=scratch.take("moments_squares", tuple(z.shape), dtype, home))
    m4 = torch.linalg.vector_norm(z2, dim=1, keepdim=True).square_()
    sums = torch.cat((z.sum(1, keepdim=True),
                      (norm / scale).square_(),  # sum(z**2) without another pass
                      z2.mul_(z).sum(1, keepdim=True), m4), dim=1)
    up = host_values([numel / length for numel, length in zip(numels, lengths)], home, dtype)
    return torch.cat((mean, scale, sums * up.unsqueeze(1)), dim=1)


@functools.lru_cache(maxsize=16)
def _padding_mask(lengths: Tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """(n, longest) 1 where a row of lengths ``lengths`` holds an element, 0 in its padding,
    in ``dtype`` (a multiplier in the block's own dtype: a bool one costs a conversion pass
    on the CPU; docs/benchmark.md, "Kernel choices"): the same few layouts come back every detail step,
    so it is built once each."""
    n = torch.tensor(lengths).unsqueeze(1)
    return (torch.arange(max(lengths)) < n).to(device=device, dtype=dtype, non_blocking=True)


def padded_rows(pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Small ``pieces`` (a few thousand elements each, of any shape, read flat) as the
    zero-padded rows of one (n, longest) block in ``dtype``: one flat copy of all of them (one
    C++ call, no view made per piece) scattered under a cached mask, half the time of
    ``pad_sequence``'s copy per row at these sizes (it wins back above ~10K)."""
    lengths = tuple(map(torch.Tensor.numel, pieces))
    mask = _padding_mask(lengths, pieces[0].device)
    flat = torch._C._nn.flatten_dense_tensors(list(pieces)) if len(pieces) > 1 else pieces[0].reshape(-1)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_scatter_(mask, flat.to(dtype))


def gradient_record(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float32 [L2 norm], int64 [nan, inf]) of one gradient: w.r.t. a layer's output
    (gradient flow), or one parameter's own gradient before DDP's all-reduce."""
    g = _dense(g)
    norm = _l2(g)
    counts = _ZERO_COUNTS if _host_says_finite(norm) else _counts(g)
    return norm.reshape(1), counts


def param_grad_stats(grads: Sequence[torch.Tensor], home: torch.device) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """(an (n, 3) tensor on ``home``, row order): columns are L2 norm, NaN count, Inf
    count; row j describes ``grads[order[j]]``.

    On CUDA one kernel per device and dtype counts and sums the squares in one pass
    (:func:`_fused_rows`); elsewhere, or where it cannot serve, the norms go through
    ``torch._foreach_norm`` (one multi-tensor kernel per device and dtype rather than one
    per parameter) and the counts follow. fp16/bf16 gradients are reduced in float32 so
    that a large but finite norm does not overflow to Inf. Rows come grouped by device
    and the host undoes the grouping, because scattering them back on the device would
    need an index tensor copied from the host.
    """
    dense = [_dense(g) for g in grads] if any(map(_IS_SPARSE, grads)) else grads
    fused = _fused_rows(dense, home) if dense[0].is_cuda else None
    return fused if fused is not None else _grouped_rows(dense, home, _norms_and_counts)


def _fused_rows(tensors: Sequence[torch.Tensor], home: torch.device) -> Optional[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """:func:`param_grad_stats`' rows where the counting kernel sums the squares as it
    counts (:func:`counting.norms_and_counts`): one launch per device and dtype, small
    and large tensors alike; None where it cannot serve them all."""
    groups = _groups(tensors, (), split_small=False)
    made = counting.norms_and_counts([tensors if len(idx) == len(tensors) else [tensors[i] for i in idx]
                                      for idx in groups.values()])
    if made is None:
        return None
    blocks = [rows.to(home, _ship_dtype(home), non_blocking=True) for rows in made]
    order = tuple(itertools.chain.from_iterable(groups.values()))
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks)), order


def param_norms(weights: Sequence[torch.Tensor], home: torch.device) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """(an (n, 1) tensor of L2 norms on ``home``, row order): each parameter's own norm,
    reduced as :func:`param_grad_stats` reduces a gradient's."""
    return _grouped_rows(weights, home, lambda group, norms, ship, small: norms.to(ship).unsqueeze(1))


def _grouped_rows(tensors: Sequence[torch.Tensor], home: torch.device,
                  columns: Callable[[Sequence[torch.Tensor], torch.Tensor, torch.dtype, bool], torch.Tensor]
                  ) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """The rows ``columns(group, its norms, ship dtype, small)`` makes of each group of ``tensors``
    that one kernel reduces (:func:`_groups`), on ``home``, and the order of their rows."""
    numels = list(map(torch.Tensor.numel, tensors))
    ship = _ship_dtype(home)
    blocks: List[torch.Tensor] = []
    order: List[int] = []
    for (_device, dtype, small), idx in _groups(tensors, numels).items():
        whole = len(idx) == len(tensors)  # one group: the common case, read without copies
        group = tensors if whole else [tensors[i] for i in idx]
        norms = _norms(group, dtype, small, tuple(numels) if whole else tuple(map(numels.__getitem__, idx)))
        blocks.append(columns(group, norms, ship, small).to(home, non_blocking=True))
        order.extend(idx)
    rows = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return rows, tuple(order)


def _norms_and_counts(group: Sequence[torch.Tensor], norms: torch.Tensor, ship: torch.dtype, small: bool
                      ) -> torch.Tensor:
    if _host_says_finite(norms):
        counts = torch.zeros((len(group), 2), dtype=ship, device=norms.device)
    else:
        counts = _group_counts(group, ship, small)
    return torch.cat((norms.to(ship).unsqueeze(1), counts), dim=1)


def _group_counts(group: Sequence[torch.Tensor], ship: torch.dtype, small: bool) -> torch.Tensor:
    """(n, 2) [NaN, Inf] counts of one group in ``ship``: one kernel launch on CUDA where
    Triton serves (:mod:`counting`), else torch ops, to the same counts."""
    counts = counting.nonfinite_counts(group)
    if counts is not None:
        return counts.to(ship)
    if small and len(group) > 1:
        return _segment_counts(group, ship)
    # two stacks for the group, not one per tensor
    return torch.stack([torch.stack([torch.isnan(g).sum() for g in group]),
                        torch.stack([torch.isinf(g).sum() for g in group])], dim=1).to(ship)


_IS_SPARSE = operator.attrgetter("is_sparse")
_IS_CUDA = operator.attrgetter("is_cuda")
_DTYPE = operator.attrgetter("dtype")


def _groups(tensors: Sequence[torch.Tensor], numels: Sequence[int], split_small: bool = True
            ) -> Dict[Tuple[torch.device, torch.dtype, bool], List[int]]:
    """Positions of ``tensors`` by (device, dtype, small): the reductions' groups; a small
    tensor (below ``_DOT_MIN`` elements) costs less to copy than to launch a kernel for
    (``split_small`` False: all are called large, and ``numels`` is not read). Read
    with C-level maps (a model's thousands of gradients all share one device and dtype),
    not a Python loop of attribute reads per tensor."""
    # a device index and the CUDA flag: reading ``.device`` builds an object per tensor; a
    # CPU tensor's index is -1, which no accelerator's is, so CPU tensors need no flag
    indices, dtypes = set(map(torch.Tensor.get_device, tensors)), set(map(_DTYPE, tensors))
    if len(dtypes) == 1 and (indices == {-1} or (len(indices) == 1 and len(set(map(_IS_CUDA, tensors))) == 1)):
        device, dtype = tensors[0].device, tensors[0].dtype
        if not split_small:
            return {(device, dtype, False): list(range(len(tensors)))}
        small = [i for i, n in enumerate(numels) if n < _DOT_MIN]
        if len(small) == len(numels):
            return {(device, dtype, True): small}
        large = [i for i, n in enumerate(numels) if n >= _DOT_MIN]
        return {key: idx for key, idx in (((device, dtype, True), small), ((device, dtype, False), large)) if idx}
    groups: Dict[Tuple[torch.device, torch.dtype, bool], List[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype, split_small and numels[i] < _DOT_MIN)].append(i)
    return groups


def _norms(group: Sequence[torch.Tensor], dtype: torch.dtype, small: bool,
           numels: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """L2 norms of tensors of one device and ``dtype``, stacked: one multi-tensor kernel,
    except on the CPU, where ``_foreach_norm`` is a loop over ``vector_norm`` (a dispatch
    per tensor, the whole cost of a small one): there the small float32/float64 ones are
    copied into one vector and reduced by segment (:func:`_segment_norms`), and the large
    ones take :func:`_l2`'s dot product (for the figures against ``_foreach_norm``:
    docs/benchmark.md, "Kernel choices")."""
    low = torch.float32 if dtype in _LOW_PRECISION else None
    if group[0].device.type != "cpu" or low is not None:
        return torch.stack(torch._foreach_norm(group, 2, dtype=low))
    if small:
        return _segment_norms(group, numels)
    if all(map(_takes_dot, group)):  # one root for the group, not a root kernel per tensor
        return torch.stack([_dot(g) for g in group]).sqrt_()
    return torch.stack([_l2(g) for g in group])


# Every segment_reduce here passes unsafe=True: the checked form validates the lengths
# with .item(), a host sync on CUDA, and gradmon builds its lengths itself.
def _flat(group: Sequence[torch.Tensor], numels: Optional[Tuple[int, ...]] = None
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(one 1-D copy of every tensor of ``group``, in order; their lengths on its device).
    One C++ call however many tensors: no Python and no kernel dispatch per tensor."""
    flat = torch._C._nn.flatten_dense_tensors(list(group))
    return flat, _lengths(numels if numels is not None else tuple(map(torch.Tensor.numel, group)), flat.device)


@functools.lru_cache(maxsize=64)
def _lengths(lengths: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    # the same few layouts come back every step: built and copied once each
    return host_values(lengths, device, torch.int64)


def _segment_counts(group: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """(n, 2) [NaN, Inf] counts of small tensors: their one flat copy counted by segment,
    a handful of kernels where counting each tensor costs five. On an accelerator, which
    cannot skip counting finite gradients without a host read, this runs every step.
    Exact: a small tensor holds fewer elements than float32 counts exactly."""
    return _counts_by_segment(*_flat(group), dtype)


def _counts_by_segment(flat: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([torch.segment_reduce(mask.to(dtype), "sum", lengths=lengths, unsafe=True)
                        for mask in (torch.isnan(flat), torch.isinf(flat))], dim=1)


def _segment_norms(group: Sequence[torch.Tensor], numels: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """L2 norms of small float32/float64 tensors: squared in their own dtype, so that they
    overflow as :func:`_l2` and vector_norm do (a finite norm proves a tensor finite, and
    a float32 norm past float32's range is Inf whichever path took it), summed in float64.
    Many tensors of a few sizes (a deep stack's weights and biases) are stacked by size, or
    by shape where a size has several (:func:`_size_plan`), with no view made per tensor as
    the flat copy makes one. ``numels``: the tensors' sizes, in order, where the caller has
    them."""
    numels = numels if numels is not None else tuple(map(torch.Tensor.numel, group))
    plan = _size_plan(numels) if len(group) >= SIZE_PLAN_MIN else None
    while plan is not None:
        if not plan.stackable:  # a size of several shapes (a transformer's wide and tall weights)
            plan = plan.by_shape
            continue
        try:
            stacks = [torch.stack(get(group)) for get in plan.getters]
        except RuntimeError:  # read by shape from now on, where shapes are few enough; else the flat copy
            plan.stackable = False
            if plan.by_shape is None and plan.by_size:
                plan.by_shape = _size_plan(tuple(map(_SHAPE, group)), by_size=False)
            continue
        sums = [(x * x).view(x.shape[0], -1).double().sum(dim=1) for x in stacks]
        return torch.cat(sums).index_select(0, plan.inverse).sqrt_()
    return _segment_l2(*_flat(group, numels))


def _segment_l2(flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each segment's L2 norm in float64, squared in ``flat``'s own dtype (see above)."""
    return torch.segment_reduce((flat * flat).double(), "sum", lengths=lengths, unsafe=True).sqrt_()


SIZE_PLAN_MIN = 64
"""Fewest small tensors read by size (:func:`_size_plan`): below it the flat copy's view per
tensor costs less than the plan."""


class _SizePlan:
    """How to read tensors of given sizes a size at a time: a getter per size (its tensors,
    in order, as a tuple) and where each tensor's row lies in the getters' results
    concatenated (an index, on the CPU). ``stackable`` turns False the first time a size
    holds tensors of several shapes, which cannot be stacked together: from then on the
    tensors are read a shape at a time (``by_shape``, a plan of the same kind keyed by
    shape), or, where that cannot serve either, by the flat copy, without trying again
    every step."""

    __slots__ = ("getters", "inverse", "stackable", "by_size", "by_shape")

    def __init__(self, getters: Tuple[Callable[[Sequence[torch.Tensor]], Tuple[torch.Tensor, ...]], ...],
                 inverse: torch.Tensor, by_size: bool) -> None:
        self.getters, self.inverse, self.stackable = getters, inverse, True
        self.by_size = by_size
        self.by_shape: Optional[_SizePlan] = None


_SHAPE = operator.attrgetter("shape")


@functools.lru_cache(maxsize=16)
def _size_plan(sizes: Tuple[Hashable, ...], by_size: bool = True) -> Optional[_SizePlan]:
    """The :class:`_SizePlan` of tensors of ``sizes`` (in order: their element counts, or
    with ``by_size`` False their shapes); None where the sizes are more than one in 16 of
    the tensors, or a tensor is empty. A model's gradients have the same sizes every step:
    built once."""
    buckets: Dict[Hashable, List[int]] = {}
    for i, n in enumerate(sizes):
        buckets.setdefault(n, []).append(i)
    if len(buckets) > len(sizes) // 16 or (0 in buckets if by_size else any(0 in shape for shape in buckets)):
        return None
    order = [i for idx in buckets.values() for i in idx]
    inverse = torch.empty(len(order), dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return _SizePlan(tuple(operator.itemgetter(*idx) if len(idx) > 1 else (lambda g, i=idx[0]: (g[i],))
                           for idx in buckets.values()), inverse, by_size)


@torch.no_grad()  # the outputs are read, never differentiated: no graph for the copy, no detach per tensor
def extremes_many(tensors: Sequence[torch.Tensor], home: torch.device, batch: Optional[int] = None,
                  rows: Optional[List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]] = None,
                  stacked: Union[torch.Tensor, "Stacks", bool] = True) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """(lo, hi, order): the min and max of each of ``tensors`` as two (n, 1) columns on
    ``home`` in the ship dtype, row j describing ``tensors[order[j]]``. The check of many
    small outputs at once (the top-level blocks of a forward): those of one device and
    dtype are copied into one vector and reduced by segment, a few kernels in all where
    :func:`extremes` would dispatch one per tensor; a large one gets its own
    :func:`finite_check` (on the CPU a finite one's bounds, not its extremes).
    NaN propagates through both, and an Inf keeps its sign, as in :func:`extremes`.

    Given ``batch`` and a list ``rows``, a tensor whose first dimension is the batch
    (:func:`has_rows`) is reduced by batch row instead of whole, its lo/hi then taken from
    its rows' (no second pass over the data), and ``(indices, block, starts)`` is appended
    to ``rows`` for each block of rows: ``block[start:start + batch]`` are the [min, max]
    of ``tensors[i]``'s rows, for each ``i``, ``start`` of ``indices``, ``starts`` (one
    (n, 2) block per group, shared, so that no kernel is launched per tensor, and one
    entry, so that no Python object is made per tensor: a model of thousands of blocks
    would keep thousands alive for the incident recorder's steps, and the collector
    would walk them).

    ``stacked``: :func:`stack_alike` of ``tensors`` (or :func:`stack_by_shape`'s
    :class:`Stacks`), where the caller made it (False: neither serves; True: not asked yet)."""
    if stacked is True:
        stacked = stack_alike(tensors)
    if isinstance(stacked, torch.Tensor):
        return _extremes_stacked(stacked, home, batch, rows)
    if isinstance(stacked, Stacks):
        return _extremes_of_stacks(stacked, home, batch, rows)
    groups = _groups(tensors, list(map(torch.Tensor.numel, tensors)))
    ship = _ship_dtype(home)
    los: List[torch.Tensor] = []
    his: List[torch.Tensor] = []
    order: List[int] = []
    for (_device, dtype, small), idx in groups.items():
        group = [tensors[i] for i in idx]
        split = [rows is not None and has_rows(t, batch) for t in group]
        if small:
            flat, lengths = _flat(group)
            if dtype in _LOW_PRECISION:
                flat = flat.float()  # every fp16/bf16 value is exact in float32
            if any(split):
                lo, hi = _by_rows(flat, group, split, batch, idx, rows)  # type: ignore[arg-type]
            else:
                lo = torch.segment_reduce(flat, "min", lengths=lengths, unsafe=True)
                hi = torch.segment_reduce(flat, "max", lengths=lengths, unsafe=True)
        else:
            made = [finite_check(t, batch) if cut else (*finite_check(t), None)
                    for t, cut in zip(group, split)]
            if rows is not None:
                rows.extend(((i,), m[2], (0,)) for i, m in zip(idx, made) if m[2] is not None)
            lo, hi = torch.stack([m[0] for m in made]), torch.stack([m[1] for m in made])
        los.append(lo.to(home, ship, non_blocking=True))
        his.append(hi.to(home, ship, non_blocking=True))
        order.extend(idx)
    lo, hi = (parts[0] if len(parts) == 1 else torch.cat(parts) for parts in (los, his))
    return lo.unsqueeze(1), hi.unsqueeze(1), tuple(order)


def extremes_held(tensors: Sequence[torch.Tensor], home: torch.device, batch: Optional[int] = None,
                  rows: Optional[List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]] = None
                  ) -> Optional[Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]]:
    """:func:`extremes_many`'s result for large CUDA tensors (the top-level blocks' outputs
    a forward keeps until its end anyway): reduced by batch row (where they have the batch's
    rows; else whole), one kernel launch per dtype and two reductions for all of a device
    (:func:`counting.row_extremes`), where a check in each block's hook cost a launch and
    its Python apiece. None where the kernel cannot serve every group."""
    groups = _groups(tensors, (), split_small=False)
    by_device: Dict[torch.device, List[List[int]]] = defaultdict(list)
    for (device, _dtype, _small), idx in groups.items():
        by_device[device].append(idx)
    ship = _ship_dtype(home)
    wholes: List[torch.Tensor] = []
    order: List[int] = []
    for dtype_groups in by_device.values():
        idx = list(itertools.chain.from_iterable(dtype_groups))
        cut = {i: has_rows(tensors[i], batch) for i in idx}
        made = counting.row_extremes([[tensors[i] for i in group] for group in dtype_groups],
                                     [[batch if cut[i] else 1 for i in group] for group in dtype_groups])
        if made is None:
            return None
        whole, by_row, starts = made
        if rows is not None and any(cut.values()):
            rows.append((tuple(i for i in idx if cut[i]), by_row, tuple(st for i, st in zip(idx, starts) if cut[i])))
        wholes.append(whole.to(home, ship, non_blocking=True))
        order.extend(idx)
    whole = wholes[0] if len(wholes) == 1 else torch.cat(wholes)
    return whole[:, :1], whole[:, 1:], tuple(order)


def stack_alike(tensors: Sequence[torch.Tensor], least: int = 2) -> Optional[torch.Tensor]:
    """``least`` or more small CPU tensors of one shape, with values, stacked, where the stack
    is a dense floating-point tensor (mixed floating dtypes stack to the widest, which holds
    every value of the others exactly); else None. The stack checks shape and device itself,
    in C++, where asking each tensor took a pass of attribute reads apiece."""
    if len(tensors) < least or tensors[0].device.type != "cpu" or not 0 < tensors[0].numel() < _DOT_MIN:
        return None
    try:
        with torch.no_grad():  # read, never differentiated
            x = torch.stack(tensors)
    except RuntimeError:  # shapes or devices differ
        return None
    return (x if x.device.type == "cpu" and x.dtype.is_floating_point and x.layout == torch.strided
            and not x.is_meta else None)


class Stacks(NamedTuple):
    """Small CPU tensors of a few shapes (a transformer's embeddings, blocks and head),
    stacked by shape: :func:`stack_alike` of each shape's tensors."""

    positions: Tuple[Tuple[int, ...], ...]
    """The tensors in each stack, by their position in the list stacked; every one once."""
    stacks: Tuple[torch.Tensor, ...]


def stack_by_shape(tensors: Sequence[torch.Tensor], last: Optional[Tuple[Tuple[int, ...], ...]] = None
                   ) -> Optional[Stacks]:
    """:func:`stack_alike` for tensors of several shapes: one stack per shape; None where a
    shape's tensors do not stack (or are not small CPU ones). ``last``: the positions of the
    stacks of the forward before, tried first (the same layout comes back every step; a stack
    proves its tensors' shapes, so a layout that changed is found out and made anew)."""
    if not tensors or tensors[0].device.type != "cpu":  # no pass over an accelerator's outputs
        return None
    if last is not None and sum(map(len, last)) == len(tensors):
        made = _stacks(tensors, last)
        if made is not None:
            return made
    by_shape: Dict[torch.Size, List[int]] = {}
    for i, t in enumerate(tensors):
        by_shape.setdefault(t.shape, []).append(i)
    return _stacks(tensors, tuple(map(tuple, by_shape.values())))


def _stacks(tensors: Sequence[torch.Tensor], positions: Tuple[Tuple[int, ...], ...]) -> Optional[Stacks]:
    stacks = []
    for idx in positions:
        x = stack_alike([tensors[i] for i in idx], least=1)
        if x is None:
            return None
        stacks.append(x)
    return Stacks(positions, tuple(stacks))


def _extremes_of_stacks(stacked: Stacks, home: torch.device, batch: Optional[int],
                        rows: Optional[List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]]
                        ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """:func:`_extremes_stacked` of each stack, the rows told by the tensors' positions."""
    los, his = [], []
    for idx, x in zip(stacked.positions, stacked.stacks):
        mine: Optional[List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]] = [] if rows is not None else None
        lo, hi, _ = _extremes_stacked(x, home, batch, mine)
        if rows is not None:
            rows.extend((tuple(idx[k] for k in local), block, starts) for local, block, starts in mine)  # type: ignore[union-attr]
        los.append(lo)
        his.append(hi)
    order = tuple(itertools.chain.from_iterable(stacked.positions))
    return torch.cat(los), torch.cat(his), order


def _extremes_stacked(x: torch.Tensor, home: torch.device, batch: Optional[int],
                      rows: Optional[List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]]
                      ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """:func:`extremes_many` of small CPU tensors of one shape (the blocks of a residual
    stream), stacked in ``x``: reduced along its rows, with no per-tensor view in the copy
    that :func:`_flat` makes (a few times faster at a thousand outputs); by batch row where
    each is split, in the block layout :func:`_by_rows` gives."""
    n = x.shape[0]
    if x.dtype in _LOW_PRECISION:
        x = x.float()  # every fp16/bf16 value is exact in float32
    if rows is not None and batch is not None and x.dim() > 1 and x.shape[1] == batch:
        by_row = x.view(n, batch, -1)
        lo_rows, hi_rows = by_row.amin(dim=2), by_row.amax(dim=2)
        rows.append((tuple(range(n)), torch.stack((lo_rows, hi_rows), dim=2).view(n * batch, 2),
                     tuple(range(0, n * batch, batch))))
        lo, hi = lo_rows.amin(dim=1), hi_rows.amax(dim=1)
    else:
        flat = x.view(n, -1)
        lo, hi = flat.amin(dim=1), flat.amax(dim=1)
    ship = _ship_dtype(home)
    return (lo.to(home, ship, non_blocking=True).unsqueeze(1), hi.to(home, ship, non_blocking=True).unsqueeze(1),
            tuple(range(n)))


@torch.no_grad()  # read, never differentiated
def activation_many(tensors: Sequence[torch.Tensor], home: torch.device,
                    stacked: Union[torch.Tensor, "Stacks", bool] = True
                    ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """:func:`activation_record` of many small outputs at once (the layers' outputs of a
    detail step's forward): ((n, 3) [L2 norm, min, max] in float64, (n, 2) [NaN, Inf]
    counts, row order), a few kernels in all where the record of each launched its own.
    Stacked outputs (``stacked``, as :func:`extremes_many` takes it) are reduced along their
    rows; others by segment of their flat copy, per device and dtype. As in the record of
    one output, the squares are taken in the outputs' dtype (a finite norm still proves its
    output finite) and the counts are read only where a norm is not finite (on an
    accelerator: always)."""
    stacks = _stacks_of(tensors, stacked)
    if stacks is not None:
        return (*_cat_each([_activation_rows(_rows_of(x)) for x in stacks[0]]), stacks[1])
    made: List[Tuple[torch.Tensor, torch.Tensor]] = []
    order: Tuple[int, ...] = ()
    for (_device, dtype, _small), idx in _groups(tensors, (), split_small=False).items():
        group = [tensors[i] for i in idx]
        flat, lengths = _flat(group)
        if dtype in _LOW_PRECISION:
            flat = flat.float()
        norm = _segment_l2(flat, lengths)
        lo = torch.segment_reduce(flat, "min", lengths=lengths, unsafe=True)
        hi = torch.segment_reduce(flat, "max", lengths=lengths, unsafe=True)
        counts = (torch.zeros((len(group), 2), dtype=torch.float64) if _host_says_finite(norm)
                  else _counts_by_segment(flat, lengths, torch.float64))
        made.append((torch.stack((norm, lo.double(), hi.double()), dim=1).to(home, non_blocking=True),
                     counts.to(home, non_blocking=True)))
        order += tuple(idx)
    return (*_cat_each(made), order)


def _stacks_of(tensors: Sequence[torch.Tensor], stacked: Union[torch.Tensor, "Stacks", bool]
               ) -> Optional[Tuple[Tuple[torch.Tensor, ...], Tuple[int, ...]]]:
    """(the stacks, the order of their rows among ``tensors``) of ``stacked`` (True: stack
    them now, :func:`stack_alike`); None where they are not stacked."""
    if stacked is True:
        stacked = stack_alike(tensors)
    if isinstance(stacked, torch.Tensor):
        return (stacked,), tuple(range(len(tensors)))
    if isinstance(stacked, Stacks):
        return stacked.stacks, tuple(itertools.chain.from_iterable(stacked.positions))
    return None


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """A stack's tensors as the (n, k) rows of one block, fp16/bf16 widened to float32 (which
    holds each of their values exactly)."""
    rows = x.view(x.shape[0], -1)
    return rows.float() if rows.dtype in _LOW_PRECISION else rows


def _cat_each(made: Sequence[Tuple[torch.Tensor, ...]]) -> Tuple[torch.Tensor, ...]:
    """Each position of ``made``'s tuples, concatenated over them (one: as it is)."""
    return made[0] if len(made) == 1 else tuple(torch.cat(parts) for parts in zip(*made))


def _activation_rows(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`activation_many`'s two blocks of the (n, k) CPU rows ``v``, one output each."""
    norm, counts = _norm_rows(v)
    return torch.stack((norm, v.amin(dim=1).double(), v.amax(dim=1).double()), dim=1), counts


def _norm_rows(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float64 L2 norms, (n, 2) float64 [NaN, Inf] counts) of the (n, k) CPU rows ``v``:
    squared in their own dtype (a finite norm proves its row finite), counted only where
    a norm is not."""
    norm = (v * v).double().sum(dim=1).sqrt_()
    if _host_says_finite(norm):
        return norm, torch.zeros((v.shape[0], 2), dtype=torch.float64)
    return norm, torch.stack((torch.isnan(v).sum(dim=1), torch.isinf(v).sum(dim=1)), dim=1).double()


@torch.no_grad()  # read, never differentiated
def gradient_many(grads: Sequence[torch.Tensor], home: torch.device,
                  stacked: Union[torch.Tensor, "Stacks", bool] = True
                  ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """:func:`gradient_record` of many small gradients at once (a detail step's gradient
    flow, at the end of its backward): ((n, 1) L2 norms, (n, 2) [NaN, Inf] counts, row
    order). Stacked ones (``stacked``, as :func:`activation_many` takes it) along their
    rows; others as :func:`param_grad_stats` reduces parameters' gradients."""
    stacks = _stacks_of(grads, stacked)
    if stacks is not None:
        norms, counts = _cat_each([_norm_rows(_rows_of(x)) for x in stacks[0]])
        return norms.unsqueeze(1), counts, stacks[1]
    rows, order = param_grad_stats(grads, home)
    return rows[:, :1], rows[:, 1:], order


@torch.no_grad()  # read, never differentiated
def moments_many(tensors: Sequence[torch.Tensor], home: torch.device,
                 stacked: Union[torch.Tensor, "Stacks", bool] = True, limit: int = MOMENTS_SAMPLE
                 ) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """(:func:`moments_block`'s rows, row order) of many small outputs at once: each one's
    sample (:func:`sample`) as its record would take it, read from the stacks as one
    strided copy per stack where ``stacked`` has them."""
    stacks = _stacks_of(tensors, stacked)
    if stacks is not None:
        return _cat_each([(_moments_stacked(x, home, limit),) for x in stacks[0]])[0], stacks[1]
    return (moments_block([sample(t, limit) for t in tensors], list(map(torch.Tensor.numel, tensors)), home),
            tuple(range(len(tensors))))


def _moments_stacked(x: torch.Tensor, home: torch.device, limit: int) -> torch.Tensor:
    n = x.shape[0]
    per = x.numel() // n
    stride = _sample_stride(tuple(x.shape[1:]), per, limit)
    rows = x.view(n, -1)
    picked = rows[:, ::stride] if stride > 1 else rows
    block = torch.empty(picked.shape, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                        device=x.device)
    block.copy_(picked)  # a copy of its own: the moments overwrite it
    return _moments(block.to(home, non_blocking=True), (picked.shape[1],) * n, (per,) * n, home, Scratch())


def _by_rows(flat: torch.Tensor, group: Sequence[torch.Tensor], split: Sequence[bool], batch: int,
             idx: Sequence[int], rows: List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's (lo, hi) of the flat copy of ``group``, reduced by segment: one
    segment per batch row of a tensor ``split`` by rows, one per other tensor; each
    tensor's lo/hi then reduced from its segments' (a second reduction over a few values
    per tensor, not over the data). Appends where each split tensor's rows lie in the
    group's one (segments, 2) block of [min, max]."""
    segments, counts, starts = _row_layout(tuple(map(torch.Tensor.numel, group)), tuple(split), batch, flat.device)
    lo = torch.segment_reduce(flat, "min", lengths=segments, unsafe=True)
    hi = torch.segment_reduce(flat, "max", lengths=segments, unsafe=True)
    block = torch.stack((lo, hi), dim=1)
    cut = [(i, start) for i, split_, start in zip(idx, split, starts) if split_]
    rows.append((tuple(i for i, _ in cut), block, tuple(start for _, start in cut)))
    return (torch.segment_reduce(lo, "min", lengths=counts, unsafe=True),
            torch.segment_reduce(hi, "max", lengths=counts, unsafe=True))


@functools.lru_cache(maxsize=64)
def _row_layout(numels: Tuple[int, ...], split: Tuple[bool, ...], batch: int, device: torch.device
                ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """(segment lengths, segments per tensor, each tensor's first segment) of :func:`_by_rows`:
    the same layout comes back every ordinary step, built and copied once."""
    per = tuple(batch if cut else 1 for cut in split)
    lengths = tuple(n for numel, cut in zip(numels, split) for n in ((numel // batch,) * batch if cut else (numel,)))
    starts = tuple(itertools.accumulate(per, initial=0))[:-1]
    return host_values(lengths, device, torch.int64), host_values(per, device, torch.int64), starts


def pack(parts: Sequence[torch.Tensor], home: torch.device) -> torch.Tensor:
    """One flat vector on ``home`` of every part, in order (the step's only packet)."""
    ship = _ship_dtype(home)
    flat = [p.reshape(-1).to(device=home, dtype=ship, non_blocking=True) for p in parts if p.numel()]
    if not flat:
        return torch.empty(0, dtype=ship, device=home)
    return torch.cat(flat) if len(flat) > 1 else flat[0].clone()


def stack_records(records: Sequence[torch.Tensor], home: torch.device) -> torch.Tensor:
    """Stack per-call records (possibly on several devices) into one tensor on ``home``."""
    if not records:
        return torch.empty(0, device=home)
    devices = {r.device for r in records}
    if len(devices) > 1:
        records = [r.to(home, non_blocking=True) for r in records]
    return torch.stack(list(records))


def to_host(packet: torch.Tensor) -> Tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
    """Start the packet's transfer to host memory; return (host tensor, event or None).

    The caller must not read the host tensor before ``event.synchronize()``. CPU packets
    are already host memory. Devices without events (MPS, XLA) copy synchronously,
    which is once per step, not per layer. The event is a blocking one: the thread that
    waits for it (the publisher, up to a step behind the device) sleeps, where CUDA's
    default would spin a CPU core for the whole wait, a core the job's data loaders need.
    """
    if packet.device.type == "cpu":
        return packet, None
    if packet.device.type == "cuda":
        host = torch.empty(packet.shape, dtype=packet.dtype, pin_memory=True)
        host.copy_(packet, non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record()
        return host, event
    return packet.to("cpu"), None
