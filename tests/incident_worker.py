"""A small transformer-shaped model and a training run that goes non-finite on purpose,
for the incident-bundle tests: in this process, or as a script in another one (a
read-only incident_dir as another user, a SIGKILL, a DDP rank).

    python incident_worker.py SCENARIO STEPS [--hold]

trains ``STEPS`` steps with gradmon attached (options from ``GRADMON_*``), prints the
endpoint's URL and, with ``--hold``, waits to be killed after the last step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

BATCH, TOKENS, WIDTH = 8, 6, 16
STEP, ROW = 40, 5  # the incident's step (gradmon counts steps from 1) and the row that carries it


class Block(nn.Module):
    """Pre-norm residual block; ``log_feature`` and ``exp_feature`` are the explicit
    ``torch.log`` and ``torch.exp`` the scenarios break."""

    def __init__(self, log_feature: bool = False, exp_feature: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.log_feature, self.exp_feature = log_feature, exp_feature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log_feature:  # finite unless a row's first feature reaches -10
            x = x + 0.01 * torch.log(10.0 + x[..., :1])
        if self.exp_feature:  # float32's exp overflows past 88
            x = x + 0.01 * torch.exp(x[..., 1:2])
        h = self.norm(x)
        return x + 0.1 * self.mix(h) + 0.1 * self.mlp(h)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block0 = Block()
        self.block1 = Block(exp_feature=True)
        self.block2 = Block(log_feature=True)
        self.block3 = Block()
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in (self.block0, self.block1, self.block2, self.block3):
            x = block(x)
        return self.head(x)


def poison_log(x: torch.Tensor) -> None:
    x[ROW, :, 0] = -1000.0  # passes blocks 0 and 1 finite; block 2's log of it is NaN


def poison_input(x: torch.Tensor) -> None:
    x[ROW, 2, 3] = float("nan")


def poison_exp(x: torch.Tensor) -> None:
    x[ROW, :, 1] = 200.0  # exp(200) is +Inf in float32, in block 1


SCENARIOS: Dict[str, Callable[[torch.Tensor], None]] = {"log": poison_log, "input": poison_input, "exp": poison_exp}


def ids_of(step: int, rank: int = 0) -> List[str]:
    """The batch's sample ids, as a data loader would name them."""
    return [f"r{rank}-s{step}-n{n}" for n in range(BATCH)]


def batch(step: int, rank: int = 0, poison: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """The batch of ``step`` on ``rank``, broken by ``poison`` at :data:`STEP`."""
    x = torch.randn(BATCH, TOKENS, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))
    if poison is not None and step == STEP:
        poison(x)
    return x


def train(monitor, model: nn.Module, steps: int, poison: Optional[Callable[[torch.Tensor], None]],
          rank: int = 0, poison_rank: int = 0, delay: float = 0.0, ids: bool = True, device: str = "cpu") -> None:
    """``steps`` AdamW steps; at :data:`STEP`, ``poison`` breaks row :data:`ROW` of
    ``poison_rank``'s batch. The job's own guard zeroes non-finite gradients after
    gradmon looked, so training goes on. ``ids``: each step's sample ids are observed."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, steps + 1):
        x = batch(step, rank, poison if rank == poison_rank else None).to(device)
        loss = (model(x) - x).pow(2).mean()
        monitor.observe(loss=loss, batch=ids_of(step, rank) if ids else None)
        loss.backward()
        for p in model.parameters():
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(delay)


DIVERGE_FROM, DIVERGE_LR = 40, 0.3  # a warmup gone wrong: the learning rate climbs past what AdamW bears


def train_diverging(monitor, model: nn.Module, steps: int, after_step: Optional[Callable[[int], None]] = None) -> None:
    """A regression that learns for :data:`DIVERGE_FROM` steps, then loses its fit as its
    learning rate climbs 25 % a step to :data:`DIVERGE_LR`: the loss rises over a dozen
    steps and stays finite. ``after_step(step)`` runs after each optimizer step."""
    target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, steps + 1):
        x = torch.randn(BATCH, TOKENS, WIDTH, generator=torch.Generator().manual_seed(step))
        if step > DIVERGE_FROM:
            for group in opt.param_groups:
                group["lr"] = min(DIVERGE_LR, group["lr"] * 1.25)
        loss = (model(x) - x @ target).pow(2).mean()
        monitor.observe(loss=loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step)


def summary(path: str, cwd: str) -> str:
    """What ``gradmon incident PATH --no-html`` prints, run in ``cwd``; it must succeed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "gradmon", "incident", path, "--no-html"], capture_output=True,
                         text=True, timeout=120, cwd=str(cwd), env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    return out.stdout


def documented_row_hash() -> Callable[[Any], List[str]]:
    """The reference code of docs/incidents.md's *Row hashes*, as a user would run it on
    their data (a NumPy array, as the model received it): one hex string per row."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "incidents.md"), encoding="utf-8") as f:
        section = f.read().split("## Row hashes", 1)[1].split("\n## ", 1)[0]
    namespace: Dict[str, Any] = {}
    exec(section.split("```python\n", 1)[1].split("```", 1)[0], namespace)  # noqa: S102 - the repository's own docs
    return namespace["gradmon_row_hash"]


def ddp_rank(rank: int, world: int, master_port: int, out: str, poison_rank: int = 1) -> None:
    """One rank of a gloo DDP job whose NaN is in ``poison_rank``'s batch (spawned by the test)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradmon
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), GRADMON_INCIDENT_DIR=out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    try:
        model = DDP(TinyTransformer())
        monitor = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, announce=False)
        train(monitor, model, STEP + 2, poison_input, rank=rank, poison_rank=poison_rank)
        monitor.flush()
        monitor.detach()
    finally:
        dist.destroy_process_group()


def main(argv: List[str]) -> int:
    import gradmon
    scenario, steps = argv[0], int(argv[1])
    torch.set_num_threads(1)
    model = TinyTransformer()
    monitor = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, announce=False)
    print(json.dumps({"url": monitor.url}), flush=True)
    train(monitor, model, steps, SCENARIOS.get(scenario), delay=float(os.environ.get("INCIDENT_STEP_DELAY", "0")))
    monitor.flush()
    snap = monitor.snapshot()
    print(json.dumps({"steps_total": snap.steps_total, "errors": monitor._errors.counts()}), flush=True)
    if "--hold" in argv:
        while True:
            time.sleep(1)
    monitor.detach()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
