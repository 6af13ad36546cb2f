"""The training runs the instability replay records: a small pre-LN transformer on a copy task.

Issue 10 part 3's scenario: 4 layers, width 128, 4 heads, GELU MLP, no QK-layernorm, AdamW with
betas (0.9, 0.999), no clipping. Unstable: lr 3e-2, no warm-up. Healthy: lr 1e-3 or 3e-4 with a
linear warm-up. ``python bench/instability/scenario.py --lr 3e-2 --seed 0`` prints the loss curve
only (no gradmon), which is how the setup below was tuned.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer import Block  # noqa: E402  (bench/transformer.py, shared with bench_overhead.py)


@dataclass(frozen=True)
class Setup:
    """The task and model. Values are the tuned ones (see README's instability section)."""

    vocab: int = 32
    copy_len: int = 8
    batch: int = 32
    width: int = 128
    layers: int = 4
    heads: int = 4
    steps: int = 800
    init_std: float = 0.0


@dataclass(frozen=True)
class Run:
    name: str
    seed: int
    lr: float
    warmup: int  # linear warm-up steps; 0 is none

    @property
    def unstable(self) -> bool:
        return self.warmup == 0


def runs() -> Tuple[Run, ...]:
    """5 unstable seeds, and 5 healthy seeds at each of 2 sane learning rates."""
    out = [Run(f"unstable-lr3e-2-s{s}", s, 3e-2, 0) for s in range(5)]
    for lr, tag in ((1e-3, "1e-3"), (3e-4, "3e-4")):
        out += [Run(f"healthy-lr{tag}-s{s}", s, lr, 100) for s in range(5)]
    return tuple(out)


class CopyModel(nn.Module):
    def __init__(self, s: Setup) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab + 1, s.width)  # + the separator token
        self.pos = nn.Embedding(2 * s.copy_len + 1, s.width)
        self.blocks = nn.ModuleList(Block(s.width, s.heads) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab + 1)
        if s.init_std:
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=s.init_std)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batches(s: Setup, seed: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, the separator, the same tokens: the loss counts only the copy."""
    g = torch.Generator().manual_seed(1000 + seed)
    sep = torch.full((s.batch, 1), s.vocab)
    while True:
        x = torch.randint(0, s.vocab, (s.batch, s.copy_len), generator=g)
        seq = torch.cat([x, sep, x], dim=1)
        yield seq[:, :-1], seq[:, s.copy_len + 1:]


def train(s: Setup, run: Run, on_step: Optional[Callable[[int, float], None]] = None,
          model_hook: Optional[Callable[[nn.Module, torch.optim.Optimizer], Callable[[torch.Tensor], None]]] = None,
          steps: Optional[int] = None) -> list:
    """Train one run; ``model_hook(model, opt)`` returns the per-step loss observer (gradmon's
    ``monitor.observe``), ``on_step(step, loss)`` runs after every optimizer step."""
    torch.manual_seed(run.seed)
    model = CopyModel(s)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / run.warmup) if run.warmup else 1.0)
    observe = model_hook(model, opt) if model_hook else None
    losses = []
    data = batches(s, run.seed)
    for step in range(1, (steps or s.steps) + 1):
        inp, target = next(data)
        logits = model(inp)[:, s.copy_len:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if observe is not None:
            observe(loss.detach())
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))  # the recorder's own bookkeeping, outside gradmon
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def divergence_point(losses: list, factor: float = 2.0, hold: int = 20) -> Optional[int]:
    """The first step (1-based) whose loss is non-finite or that starts ``hold`` steps in a row
    above ``factor`` x the running minimum of the loss so far; None if there is none."""
    lo = math.inf
    above = 0
    for i, loss in enumerate(losses, start=1):
        if not math.isfinite(loss):
            return i - above
        lo = min(lo, loss)
        above = above + 1 if loss > factor * lo else 0
        if above == hold:
            return i - hold + 1
    return None


def trailing_mean(losses: list, n: int = 20) -> list:
    """Each step's mean over its last ``n`` steps (fewer at the start): the divergence point of
    this curve is where the loss as a whole left its minimum, not where one batch's noise did."""
    return [sum(losses[max(0, i - n + 1):i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(losses))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--copy-len", type=int, default=Setup.copy_len)
    p.add_argument("--batch", type=int, default=Setup.batch)
    p.add_argument("--vocab", type=int, default=Setup.vocab)
    p.add_argument("--init-std", type=float, default=Setup.init_std)
    a = p.parse_args()
    torch.set_num_threads(1)
    s = Setup(vocab=a.vocab, copy_len=a.copy_len, batch=a.batch, steps=a.steps, init_std=a.init_std)
    run = Run("try", a.seed, a.lr, a.warmup)
    losses = train(s, run)
    for i in range(0, len(losses), 25):  # min/max of every 25 steps: spikes show as a jump in max
        w = losses[i:i + 25]
        print(f"{i + 25}:{min(w):.2f}/{max(w):.2f}", end=" ")
    print()
    print("divergence point:", divergence_point(losses))


if __name__ == "__main__":
    main()
