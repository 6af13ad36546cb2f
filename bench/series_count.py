"""Series per rank and per job, counted from a real exposition (README's Multi-GPU table).

    python bench/series_count.py

For each model size it attaches gradmon as a DDP rank would be configured (local view on,
RANK/WORLD_SIZE from the environment as torchrun sets them), trains until every family
exists (gauges relative to a baseline need a few detail steps), renders the
registry and counts samples. Data-parallel rank 0 carries the per-layer series; the other
ranks carry their rank-level summaries only (``all_ranks_per_layer`` off, the default).
"""

from __future__ import annotations

import os
import sys
from typing import Dict

import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

import gradmon
from gradmon.statistics import MIN_BASELINE


def model_with(layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(layers)])


def exposition(layers: int, rank: int, world: int, incident: bool = False) -> str:
    """What rank ``rank`` of a ``world``-rank job on a ``layers``-layer model serves, every family on;
    ``incident``: after one more step whose batch held a NaN."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    model = model_with(layers)
    registry = CollectorRegistry()
    mon = gradmon.attach(model, registry=registry, local_view=world > 1, final_scrape_timeout=0, detail_every=1)
    for _ in range(MIN_BASELINE):  # until the gauges relative to a baseline exist too
        model(torch.randn(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    if incident:
        model(torch.full((2, 4), float("nan"))).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    text = generate_latest(registry).decode()
    mon.detach()
    return text


def count(layers: int, rank: int, world: int, incident: bool = False) -> int:
    return sum(1 for line in exposition(layers, rank, world, incident).splitlines()
               if line and not line.startswith("#"))


def main() -> int:
    rows: Dict[int, Dict[str, int]] = {}
    for layers in (100, 1000):
        rows[layers] = {"single": count(layers, 0, 1), "rank0": count(layers, 0, 8), "other": count(layers, 1, 8),
                        "incident": count(layers, 1, 8, incident=True)}
    print("| ranks | layers | series on rank 0 | series on each other rank (during a NaN incident) | series per job |")
    print("|---:|---:|---:|---:|---:|")
    most = 0
    for ranks in (1, 8, 64, 1024):
        for layers in (100, 1000):
            r = rows[layers]
            r0 = r["single"] if ranks == 1 else r["rank0"]
            other = 0 if ranks == 1 else r["other"]
            most = max(most, r0, other)
            job = r0 + (ranks - 1) * other
            others = f"{other} ({r['incident']})" if ranks > 1 else "-"
            print(f"| {ranks} | {layers} | {r0} | {others} | {job:,} |")
    # a scrape target is one rank: its limit needs headroom over the most series one rank exports
    print(f"\nsampleLimit per target: at least {int(most * 1.5 // 1000 + 1) * 1000:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
