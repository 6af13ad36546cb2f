"""A DDP training rank for the multi-process tests (spawned with torch.multiprocessing).

Rank r trains on its own deterministic batches; the test drives it through phases by
files in ``work``: the rank writes ``<phase>.<rank>.ready`` after the phase and waits
for ``<phase>.go`` before the next, so the test can scrape both endpoints in between.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def ready(path: Path, what: dict) -> None:
    """``what`` as JSON at ``path``, whole or not at all: the test polls for the file and
    reads it at once (a rename, not a write a loaded machine may show half done)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(what))
    os.replace(tmp, path)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 6, generator=g)


def train_step(model, opt, rank: int, step: int, loss_scale: float = 1.0, nan: bool = False,
               input_scale: float = 1.0) -> None:
    """Two micro-batches, the first under no_sync (gradient accumulation). ``loss_scale``
    makes this rank's shard behave like one with outsized targets, ``input_scale`` like
    one with outsized inputs (its activations blow up too)."""
    for micro in range(2):
        x = batch(rank, step, micro) * input_scale
        if nan:
            x[0, 0] = float("nan")
        ctx = model.no_sync() if micro == 0 else torch.enable_grad()
        with ctx:
            (model(x).pow(2).mean() / 2 * loss_scale).backward()
    for p in model.parameters():  # the job's NaN guard, after gradmon looked
        torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def run(rank: int, world: int, work: str, master_port: int, gradmon_port: int, plan: list, fail_rank: int = -1) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    import gradmon
    from gradmon.capture import kernels as stats

    if rank == fail_rank:  # gradmon's own computation fails on this rank only
        def boom(*a, **k):
            raise RuntimeError("injected failure on one rank")
        stats.param_grad_stats = boom
    work_dir = Path(work)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gradmon.attach(model, port=gradmon_port, addr="127.0.0.1", final_scrape_timeout=0, detail_every=1)
    step = 0
    # [{"name":..., "steps":..., "loss_scale_by_rank":..., "input_scale_by_rank":..., "nan_rank":..., "delay":...}]
    for phase in plan:
        for group in opt.param_groups:
            group["lr"] = phase.get("lr", 0.05)
        for _ in range(phase["steps"]):
            train_step(model, opt, rank, step, phase.get("loss_scale_by_rank", {}).get(str(rank), 1.0),
                       nan=phase.get("nan_rank") == rank and step == phase.get("nan_step"),
                       input_scale=phase.get("input_scale_by_rank", {}).get(str(rank), 1.0))
            step += 1
            time.sleep(phase.get("delay", 0))
        mon.flush()
        ready(work_dir / f"{phase['name']}.{rank}.ready", {"url": mon.url, "step": step})
        wait_for(work_dir / f"{phase['name']}.go")
    mon.detach()
    dist.destroy_process_group()


def make_fsdp_model() -> nn.Module:
    torch.manual_seed(0)
    # 7 output rows over 2 ranks: shards of 4 and 3 rows (uneven)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def run_fsdp(rank: int, world: int, work: str, master_port: int, gradmon_port: int, steps: int, fail_rank: int,
             replicas: int = 1, flavour: str = "fsdp2") -> None:
    """FSDP2 over ``world`` ranks; ``replicas`` > 1 makes it HSDP: a (replicate, shard) mesh.
    ``flavour`` "fsdp1" / "fsdp1-flat": FSDP1 wrapping each Linear, with / without use_orig_params."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradmon
    from gradmon.capture import kernels as stats

    if rank == fail_rank:
        def boom(*a, **k):
            raise RuntimeError("injected failure on one rank")
        stats.param_grad_stats = boom
    model = make_fsdp_model()
    if flavour.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        # Linear(7, 3) is one unit of 24 elements: rank 0 holds 12 of the weight's 21, rank 1
        # the rest and the whole bias (a parameter with no local gradient on rank 0)
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=flavour == "fsdp1",
                                         auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        mesh = init_device_mesh("cpu", (world,)) if replicas == 1 else \
            init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        for sub in model:
            if isinstance(sub, nn.Linear):
                fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gradmon.attach(model, port=gradmon_port, addr="127.0.0.1", final_scrape_timeout=0)
    for step in range(steps):
        x = fsdp_batch(rank, step)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.flush()
    ready(Path(work) / f"fsdp.{rank}.ready", {"url": mon.url, "step": steps, "layers": mon.layers,
                                              "limits": mon.coverage().limits})
    wait_for(Path(work) / "fsdp.go")
    mon.detach()
    dist.destroy_process_group()


def fsdp_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def run_until_one_rank_raises(rank: int, world: int, master_port: int, gradmon_port: int, seconds: float,
                              raise_rank: int) -> None:
    """A torchrun-style worker with the one-line attach: rank ``raise_rank`` raises after ``seconds``."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    import gradmon

    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gradmon.attach(model, port=gradmon_port, addr="127.0.0.1")
    deadline = time.monotonic() + seconds
    step = 0
    while True:
        if rank == raise_rank and time.monotonic() > deadline:
            raise ValueError("a bad batch on one rank")
        train_step(model, opt, rank, step)
        step += 1
        time.sleep(0.02)


def run_stages(rank: int, world: int, work: str, master_port: int) -> None:
    """Two "pipeline stages" of two data-parallel replicas each: ranks {0, 1} and {2, 3}
    each wrap their model in DDP over their own process group. Writes the exposition."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    import gradmon
    from prometheus_client import CollectorRegistry, generate_latest

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    model = DDP(make_model(), process_group=groups[rank // 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    registry = CollectorRegistry()
    mon = gradmon.attach(model, registry=registry, final_scrape_timeout=0, detail_every=1)
    for step in range(3):
        train_step(model, opt, rank, step)
    mon.flush()
    (Path(work) / f"stages.{rank}.txt").write_text(generate_latest(registry).decode())
    mon.detach()
    dist.barrier()
    dist.destroy_process_group()
