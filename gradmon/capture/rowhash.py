"""A hash of each batch row of the root forward's tensor inputs, made on the device.

Where the job gives no sample ids (``Monitor.observe(batch=...)``), an incident bundle names
a row by these hashes, which the user can compute over their own data to find it. Per input
tensor, a few kernels and no host sync: its rows' bit patterns times fixed odd multipliers,
summed in integers. Integer sums wrap the same way in any order, so a row hashes to the same
value on any device and in NumPy (docs/incidents.md gives the reference code); a float sum
would depend on the reduction's order.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

MAX_INPUTS = 8
"""Input tensors hashed per forward: a model's batch is a few tensors (ids, mask, labels)."""
RUNS = RUN = 64
"""A row of more than RUNS × RUN elements (an image) is hashed on RUNS runs of RUN elements,
one at the start of each RUNS-th of the row, so that the hash costs a few small kernels
whatever the input's size; runs rather than every s-th element, which would read a cache
line per element. A token row (a sequence of up to 4096) is hashed whole."""
_CACHE_MAX = 16

# splitmix64's constants as signed 64-bit values (torch has no uint64 arithmetic)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_multipliers: Dict[Tuple[int, torch.device], torch.Tensor] = {}


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def multipliers(n: int, device: torch.device) -> torch.Tensor:
    """The odd multiplier of each of a row's ``n`` elements: splitmix64 of 1..n with the
    low bit set. Made once per width and device."""
    key = (n, device)
    m = _multipliers.get(key)
    if m is None:
        z = torch.arange(1, n + 1, dtype=torch.int64, device=device) * _GOLDEN
        z = (z ^ _shr(z, 30)) * _MIX1
        z = (z ^ _shr(z, 27)) * _MIX2
        m = (z ^ _shr(z, 31)) | 1
        if len(_multipliers) >= _CACHE_MAX:
            _multipliers.clear()
        _multipliers[key] = m
    return m


def hashable(t: torch.Tensor, rows: int) -> bool:
    """A dense tensor of numbers or booleans whose first dimension is the batch's."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.dim() > 0 and t.shape[0] == rows
            and not t.is_complex() and not t.is_meta and not t.is_nested and t.numel() > 0)


def row_hash(t: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: the sum over a row's elements (its runs: :data:`RUNS`) of
    value × multiplier, modulo 2**64. An
    integer or boolean element is its value, a float its IEEE bit pattern read as a signed
    integer of its width; so ids hash alike as int32 or int64, and a float row must be in
    the dtype the model received."""
    rows = t.shape[0]
    x = t.detach().reshape(rows, -1)
    if x.shape[1] > RUNS * RUN:
        x = x[:, :RUNS * (x.shape[1] // RUNS)].view(rows, RUNS, -1)[:, :, :RUN]
    if x.is_floating_point():
        x = x.view(_BITS[x.element_size()])
    x = x.to(torch.int64).reshape(rows, -1)
    return (x * multipliers(x.shape[1], x.device)).sum(dim=1)


def named_inputs(args: Any, kwargs: Optional[Mapping[str, Any]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The root forward's tensors by name: ``args[i]``, a keyword's name, one level into a
    dict, list or tuple argument (``args[0].input_ids``, ``args[0][1]``)."""
    def inside(name: str, value: Any) -> Iterator[Tuple[str, torch.Tensor]]:
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(v, torch.Tensor):
                    yield f"{name}.{k}", v
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    yield f"{name}[{i}]", v
    for i, a in enumerate(args):
        yield from inside(f"args[{i}]", a)
    for k, v in (kwargs or {}).items():
        yield from inside(str(k), v)


def hash_rows(args: Any, kwargs: Optional[Mapping[str, Any]], rows: int) -> List[Tuple[str, torch.Tensor]]:
    """Each batch-first input tensor's row hashes (at most :data:`MAX_INPUTS`), by name."""
    out = []
    for name, t in named_inputs(args, kwargs):
        if hashable(t, rows):
            out.append((name, row_hash(t)))
            if len(out) == MAX_INPUTS:
                break
    return out
