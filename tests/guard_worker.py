"""A rank of the step guard's multi-process job (spawned by tests/test_stepguard_ranks.py):
four processes, gloo on the CPU, one launch for five runs in turn, each ``STEPS`` steps with
the guard on.

At ``NAN_STEP`` rank 1's batch holds a NaN:

* ``ddp``: a DistributedDataParallel model (its all-reduce spreads the NaN, the guard's agrees on it);
* ``local``: a model each rank steps on its own gradients, where only rank 1 ever sees the
  NaN and only the guard's all-reduce can tell the others to skip too;
* ``fsdp1`` (FSDP1 wrapping each Linear, use_orig_params), ``fsdp2`` (fully_shard over the
  four ranks, fused AdamW) and ``hsdp`` (fully_shard over a 2 x 2 (replicate, shard) mesh):
  the reduce-scatter spreads the NaN into every shard.

The sharded runs have a second bad step, ``POISON_STEP``: rank 3's backward puts NaN into the
gradient of the first layer's last output unit alone, so only the ranks whose shard holds
that unit see a NaN (``poisoned``); the others learn of it from the guard's all-reduce, or
step. Each rank writes, per run and bad step, whether its own parameters (or shards) and
optimizer state after the step equal a copy from before it; its parameters and optimizer
state at the end; its skip counts; and whether its local gradient held a NaN at the poisoned step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch import nn

WORLD = 4
STEPS = 16
NAN_STEP, POISON_STEP = 6, 11
NAN_RANK, POISON_RANK = 1, 3
POISON_UNIT = 6  # the first layer's last output unit: on rank 3 alone (FSDP2), on ranks 1 and 3 (HSDP)
REPLICATED, SHARDED = ("ddp", "local"), ("fsdp1", "fsdp2", "hsdp")
RUNS = REPLICATED + SHARDED


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(rank: int, step: int) -> torch.Tensor:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))
    if rank == NAN_RANK and step == NAN_STEP:
        x[0, 0] = float("nan")
    return x


class _Poison(torch.autograd.Function):
    """The identity forward; backward, NaN in the gradient of ``POISON_UNIT`` alone."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[:, POISON_UNIT] = float("nan")
        return grad


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(model: nn.Module) -> List[torch.Tensor]:
    """This rank's parameters: its shards of them where they are sharded."""
    return [_local(p.detach()).clone() for p in model.parameters()]


def _state(opt: torch.optim.Optimizer) -> List[Any]:
    return [(k, _local(v).clone() if isinstance(v, torch.Tensor) else v)
            for s in opt.state.values() for k, v in sorted(s.items())]


def _same(a: List[Any], b: List[Any]) -> bool:
    """Bit for bit: tensors, and (key, value) pairs of the optimizer state."""
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, tuple):
        return x[0] == y[0] and _equal(x[1], y[1])
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
    return x == y


def _wrap(model: nn.Module, run: str) -> nn.Module:
    if run == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    if run == "local":
        return model
    if run == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,)) if run == "fsdp2" else \
        init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    for sub in model:
        if isinstance(sub, nn.Linear):
            fully_shard(sub, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _optimizer(run: str, params) -> torch.optim.Optimizer:
    if run == "fsdp2":  # fused: the guard's verdict as found_inf, on DTensor parameters
        return torch.optim.AdamW(params, lr=0.01, fused=True)
    if run == "hsdp":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01)


def _train(rank: int, run: str) -> Dict[str, Any]:
    import gradmon

    plain = _model()
    step_now = [-1]
    if run in SHARDED:
        plain[0].register_forward_hook(
            lambda m, i, y: _Poison.apply(y) if rank == POISON_RANK and step_now[0] == POISON_STEP else y)
    model = _wrap(plain, run)
    opt = _optimizer(run, model.parameters())
    out: Dict[str, Any] = {"unchanged": {}}
    with gradmon.attach(model, registry=CollectorRegistry(), final_scrape_timeout=0, guard="nonfinite",
                        incident_dir="", name=run) as mon:
        for step in range(STEPS):
            step_now[0] = step
            before = (_params(model), _state(opt))
            model(_batch(rank, step)).pow(2).mean().backward()
            if step == POISON_STEP:
                out["poisoned"] = any(not bool(torch.isfinite(_local(p.grad)).all())
                                      for p in model.parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step in (NAN_STEP, POISON_STEP):
                out["unchanged"][str(step)] = _same(before[0], _params(model)) and _same(before[1], _state(opt))
        assert mon.flush()
        out["skipped"] = dict(mon.snapshot().guard_skipped_steps)
        out["errors"] = sum(mon._errors.counts().values())
    out["params"] = [p.tolist() for p in _params(model)]
    out["state"] = [[k, v.tolist() if isinstance(v, torch.Tensor) else v] for k, v in _state(opt)]
    return out


def run(rank: int, work: str, master_port: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=WORLD)
    try:
        results = {r: _train(rank, r) for r in RUNS}
        (Path(work) / f"guard.{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
