"""A rank of the step guard's two-process job (spawned by tests/test_stepguard.py): gloo on the CPU.

Two runs, each 50 steps with the guard on and a NaN in rank 1's batch alone at step 40:
``ddp``, a DistributedDataParallel model (its all-reduce spreads the NaN, the guard's
agrees on it), and ``local``, a model each rank steps on its own gradients, where only rank
1 ever sees the NaN and only the guard's all-reduce can tell rank 0 to skip too. Each
writes what the test compares: the parameters after step 40 and before it, and the counts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

NAN_STEP = 40


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank: int, step: int) -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))
    if rank == 1 and step == NAN_STEP:
        x[0, 0] = float("nan")
    return x


def _train(rank: int, kind: str, work: Path) -> dict:
    import gradmon

    model = _model()
    stepped = DDP(model) if kind == "ddp" else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out: dict = {}
    with gradmon.attach(stepped, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        incident_dir=str(work / f"incidents-{kind}"), name=kind) as mon:
        for step in range(50):
            if step == NAN_STEP:
                out["before"] = [p.detach().clone().tolist() for p in model.parameters()]
            mon.observe(batch=[1000 * rank + 10 * step + i for i in range(2)])
            stepped(_batch(rank, step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == NAN_STEP:
                out["at"] = [p.detach().clone().tolist() for p in model.parameters()]
        assert mon.flush()
        out["skipped"] = dict(mon.snapshot().guard_skipped_steps)
        out["errors"] = sum(mon._errors.counts().values())
    out["after"] = [p.detach().tolist() for p in model.parameters()]
    return out


def run(rank: int, world: int, work: str, master_port: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    try:
        results = {kind: _train(rank, kind, Path(work)) for kind in ("ddp", "local")}
        (Path(work) / f"guard.{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
