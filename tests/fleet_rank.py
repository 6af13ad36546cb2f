"""One simulated rank of several training jobs, for the sharding test (tests/test_fleet.py).

    RANK=r WORLD_SIZE=n python tests/fleet_rank.py '{"job-a": 9500, ...}' '{"job-a": 3}' READY_FILE

Each job is a tiny model with gradmon attached as a DDP rank would be (its local view on,
named after the job, so that every rank of a job carries the same ``model`` label), served
on its own port. The rank named for a job in the second argument multiplies its loss by 50:
its local gradient norm diverges from the job's other ranks. Trains until terminated.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradmon


def main() -> None:
    rank = int(os.environ["RANK"])
    ports, diverging, ready = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    runs = []
    for name, port in ports.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        gradmon.attach(model, name=name, port=port, addr="127.0.0.1", port_offset_by_local_rank=False,
                       local_view=True, final_scrape_timeout=0)
        runs.append((model, torch.optim.SGD(model.parameters(), lr=0.0), 50.0 if diverging.get(name) == rank else 1.0))
    ready.write_text("ready")
    data = torch.Generator().manual_seed(rank)
    while True:
        for model, opt, scale in runs:
            (model(torch.randn(4, 8, generator=data)).square().mean() * scale).backward()
            opt.step()
            opt.zero_grad()
        time.sleep(0.05)


if __name__ == "__main__":
    main()
