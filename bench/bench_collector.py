"""What Python's cyclic garbage collector costs a training step, with gradmon and without.

    python bench/bench_collector.py --model chain-1000 --steps 200 --rounds 2

Each copy trains in a process of its own (the collector walks a whole process), one torch
thread, ``--steps`` steps after a warm-up, gradmon flushed after each step; the rounds take
turns (unmonitored, monitored, unmonitored, ...). Printed per step, averaged over every step
(a full collection is rare and long, so a median would not see it): collections of each
generation, milliseconds in the collector (``gc.callbacks``), and the step's mean time.
The models are ``bench_layers.py``'s.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent


def one(model: str, steps: int, monitored: bool) -> Dict[str, object]:
    import torch
    sys.path.insert(0, str(HERE))
    import bench_layers

    torch.set_num_threads(1)
    net, step = bench_layers.make(model)
    mon = None
    if monitored:
        import gradmon
        from prometheus_client import CollectorRegistry
        mon = gradmon.attach(net, registry=CollectorRegistry(), final_scrape_timeout=0, ui=False, announce=False)
    for _ in range(25):  # past the first detail period: allocators, hooks and baselines settled
        step()
        if mon is not None:
            mon.flush(30)
    counts, seconds, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def timed(phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        if mon is not None:
            mon.flush(30)
    elapsed = time.perf_counter() - t0
    gc.callbacks.remove(timed)
    if mon is not None:
        mon.detach()
    return {"monitored": monitored, "step_ms": elapsed / steps * 1e3,
            "collections": [c / steps for c in counts], "collector_ms": [s / steps * 1e3 for s in seconds],
            "objects": len(gc.get_objects())}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="chain-1000")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", choices=["twin", "gradmon"], help=argparse.SUPPRESS)  # a child process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, args.steps, args.one == "gradmon")))
        return 0
    print(f"{args.model}, {args.steps} steps a process, {args.rounds} rounds; per step, averaged over every step:")
    print(f"{'copy':8s} {'step ms':>8s} {'young':>6s} {'middle':>6s} {'full':>6s} {'collector ms':>13s} "
          f"{'(young+middle / full)':>22s} {'objects':>8s}")
    for _ in range(args.rounds):
        for copy in ("twin", "gradmon"):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                  "--one", copy], capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            c, s = r["collections"], r["collector_ms"]
            print(f"{copy:8s} {r['step_ms']:8.1f} {c[0]:6.2f} {c[1]:6.2f} {c[2]:6.3f} {sum(s):13.2f} "
                  f"{s[0] + s[1]:12.2f} / {s[2]:6.2f} {r['objects']:8d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
