"""Full-gradient statistics of sharded parameters (FSDP2 ``fully_shard``, DTensor, FSDP1).

Each rank holds a shard of the gradients (FSDP2: of every parameter; FSDP1: a slice of
each unit's flat parameter, in which a small parameter may lie wholly on another rank). At the end of backward gradmon reduces only
the local shard (``to_local()``, no communication: a collective inside an autograd
callback could hang a rank). At the step boundary, on the training thread and on every
rank, one small all-reduce (SUM) per group of parameters sharing a device mesh and
sharded mesh dimensions turns the local sums of squares and NaN/Inf counts into the
full gradient's (squares of norms added, then rooted). Only mesh dimensions whose placement is ``Shard`` are summed: HSDP's
replicate dimension and tensor-parallel ``Replicate`` placements hold copies, and
summing them would count the gradient twice; FSDP1's hybrid strategies likewise sum
over the unit's sharding group alone. Uneven shards need nothing special: a sum of
squares is a sum over whatever elements each rank holds.

If gradmon's own computation fails on one rank, that rank still calls the same
collectives with zeros and an error flag, so no rank ever waits for another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .kernels import host_values


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 kept it private
        try:
            from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
        except ImportError:
            return None
    return DTensor


def is_sharded(t: object) -> bool:
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (no communication); other tensors unchanged."""
    return t.to_local() if is_sharded(t) else t


@dataclass
class ShardGroup:
    """Parameters whose gradients are sharded over the same process groups."""

    process_groups: Tuple[object, ...]  # summed over each in turn (a mesh's sharded dimensions)
    device: torch.device  # where the process group's collectives take tensors
    params: List[int]  # indices into the recorder's parameter list
    dims: Tuple[int, ...] = ()  # the mesh dimensions they come from (DTensor)


@dataclass(frozen=True)
class FlatUnit:
    """An FSDP1 unit that shards its flat parameter."""

    process_group: object
    flat_param: torch.Tensor
    params: Tuple[torch.Tensor, ...]  # what the model registers: the original parameters
    # (use_orig_params=True), or the flat parameter itself
    orig: bool


def fsdp1_units(model: torch.nn.Module) -> List[FlatUnit]:
    """FSDP1 (``FullyShardedDataParallel``) units of ``model`` whose gradients are
    sharded (every strategy but NO_SHARD, whose gradients are all-reduced like DDP's)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    units = []
    for module in model.modules():
        if not isinstance(module, FullyShardedDataParallel) or module.sharding_strategy == ShardingStrategy.NO_SHARD:
            continue
        flat = getattr(getattr(module, "_handle", None), "flat_param", None)
        if flat is None:
            continue
        orig = tuple(getattr(flat, "_params", None) or ())
        units.append(FlatUnit(module.process_group, flat, orig or (flat,), bool(orig)))
    return units


def limits(units: Sequence[FlatUnit]) -> List[str]:
    """What gradmon cannot measure per layer because of how these units shard: one sentence
    each, for the log and ``Monitor.coverage().limits``."""
    flat = [u for u in units if not u.orig]
    if not flat:
        return []
    return [f"FSDP1 without use_orig_params: the layers' parameters live in {len(flat)} flat parameter(s), so "
            f"gradmon's layers are the FSDP units (each named after the module it wraps), not the modules inside "
            f"them; wrap with use_orig_params=True, or use FSDP2 (fully_shard), for per-layer series."]


DEEPSPEED = ("DeepSpeed ZeRO holds gradients outside p.grad: per-layer gradient norms and their NaN/Inf counts are "
             "not measured (gradmon_uncovered_layers{family=\"grad\"}); activations, gradient flow, the loss and the "
             "learning rate are.")


def plan(params: Sequence[Optional[torch.Tensor]], units: Sequence[FlatUnit] = ()) -> List[ShardGroup]:
    """Fixed at attach, identical on every rank (same model, same order)."""
    groups: Dict[Tuple[int, Tuple[int, ...]], ShardGroup] = {}
    flat = {id(p): unit for unit in units for p in unit.params}
    for i, p in enumerate(params):
        unit = flat.get(id(p))
        if unit is not None:
            key = (id(unit.process_group), ())
            groups.setdefault(key, ShardGroup((unit.process_group,), p.device, [])).params.append(i)
            continue
        if not is_sharded(p):
            continue
        dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
        if not dims:
            continue
        key = (id(p.device_mesh), dims)
        pgs = tuple(p.device_mesh.get_group(d) for d in dims)
        groups.setdefault(key, ShardGroup(pgs, p.to_local().device, [], dims)).params.append(i)
    return list(groups.values())


def all_reduce_rows(rows: Optional[torch.Tensor], order: Sequence[int], groups: Sequence[ShardGroup],
                    failed: bool, folds: Sequence[str]) -> Tuple[Optional[torch.Tensor], bool]:
    """Combine the sharded parameters' rows of ``rows`` (n x width, row j = parameter
    ``order[j]``) over their shard groups, column by column as ``folds`` says ("sum":
    added; "norm": root of the summed squares; "absmax": the largest). Returns the rows
    and whether every rank's contribution was valid. Called on every rank at every step,
    whatever happened before."""
    import torch.distributed as dist

    width = len(folds)
    norm = [f == "norm" for f in folds]
    absmax = [j for j, f in enumerate(folds) if f == "absmax"]
    row = {param: j for j, param in enumerate(order)} if rows is not None and not failed else {}
    ok = True  # False when any rank (this one included) had no valid numbers
    for group in groups:
        device = group.device
        n = len(group.params)
        vec = torch.zeros(width * n + 1, dtype=torch.float64, device=device)
        if failed:
            vec[-1] = 1.0  # "my numbers are missing": every rank discards this step's values
        elif rows is not None:
            for k, param in enumerate(group.params):
                j = row.get(param)
                if j is not None:
                    vec[width * k:width * (k + 1)] = rows[j].to(device=device, dtype=torch.float64)
        body = vec[:-1].view(n, width)
        squares = host_values(norm, device).expand(n, width)
        body.copy_(torch.where(squares, body.square(), body))
        peaks = body[:, absmax].clone() if absmax else None
        for pg in group.process_groups:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=pg)
            if peaks is not None:
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=pg)
        if failed:
            ok = False
            continue
        if rows is None:
            continue
        body.copy_(torch.where(squares, body.sqrt(), body))
        if peaks is not None:
            body[:, absmax] = peaks
        # Another rank's missing numbers poison the sum: drop this step's values (NaN,
        # counts 0) without reading the flag on the host, which would sync on CUDA.
        valid = vec[-1] == 0
        dropped = host_values([math.nan if f != "sum" else 0.0 for f in folds], device, vec.dtype)
        for k, param in enumerate(group.params):
            j = row.get(param)
            if j is not None:
                rows[j] = torch.where(valid, body[k], dropped).to(device=rows.device, dtype=rows.dtype)
    return rows, ok
