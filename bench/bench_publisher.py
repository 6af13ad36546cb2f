"""What the publisher's wake-ups cost a job that steps fast: wall clock, steps back to back.

    python bench/bench_publisher.py              # the docs' figures
    python bench/bench_publisher.py --quick      # a smoke run; figures meaningless

The publisher folds each step's packet on its own thread, holding the interpreter lock; a
step of a few milliseconds then pays, besides the fold, for the lock handed over and back
and for a fold that reads its packet cold from the other core's cache. So it wakes at most
every ``WAKE_EVERY_S`` and folds the packets that came meanwhile together. This benchmark
times both policies in one run on one monitor: rounds of ``--steps`` steps back to back
(the wall clock, what a job sees; each round ends with a flush, so a round pays for all its
folds), the unmonitored twin's round beside each, the two policies' rounds interleaved and
their order alternated. ``per packet`` is ``WAKE_EVERY_S = 0`` (a wake-up for every packet,
as before 2026-11-28), ``gathered`` the default. Printed per model: the twin's step, each
policy's median ratio to its twin round, the publisher's wake-ups per step. Models from
bench_layers.py (width 8, batch 4: all host time); a model whose steps take longer than
``WAKE_EVERY_S`` has one packet a wake-up either way. One thread for torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from bench_layers import make  # bench/ is on sys.path when a script here runs

MODELS = ("chain-1", "chain-10", "chain-100", "chain-1000")


def measure(name: str, rounds: int, steps: int) -> Dict[str, object]:
    import gradmon
    from gradmon.aggregate import publisher as publisher_module
    from prometheus_client import CollectorRegistry

    gathered = publisher_module.WAKE_EVERY_S
    model, step = make(name)
    _twin, twin_step = make(name)
    mon = gradmon.attach(model, registry=CollectorRegistry(), final_scrape_timeout=0, ui=False, announce=False)
    publisher = mon._publisher

    def timed(f) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            f()
        mon.flush(60)
        return time.perf_counter() - t0

    ratios: Dict[str, List[float]] = {"per_packet": [], "gathered": []}
    wakes: Dict[str, List[float]] = {"per_packet": [], "gathered": []}
    twin_s: List[float] = []
    try:
        for _ in range(2):  # warm-up: the first detail period, caches, allocators
            timed(step)
            timed(twin_step)
        for r in range(rounds):
            order = ("per_packet", "gathered") if r % 2 else ("gathered", "per_packet")
            for policy in order:
                publisher_module.WAKE_EVERY_S = 0.0 if policy == "per_packet" else gathered
                twin = timed(twin_step)
                before = publisher.wakes
                ratios[policy].append(timed(step) / twin)
                wakes[policy].append((publisher.wakes - before) / steps)
                twin_s.append(twin / steps)
    finally:
        publisher_module.WAKE_EVERY_S = gathered
        mon.detach()
    out: Dict[str, object] = {"model": name, "twin_ms": statistics.median(twin_s) * 1e3}
    for policy in ratios:
        out[policy] = {"ratio": statistics.median(ratios[policy]), "wakes_per_step": statistics.median(wakes[policy])}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--rounds", type=int, default=12, help="rounds of each policy (default 12)")
    p.add_argument("--steps", type=int, default=100, help="steps a round (default 100)")
    p.add_argument("--quick", action="store_true", help="chain-10, 2 rounds of 20 steps: a smoke run")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.steps = ["chain-10"], 2, 20
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds of {args.steps} steps a policy, wall clock")
    print(f"{'model':<12} {'twin step':>10} {'per packet':>11} {'gathered':>9} {'wake-ups a step':>17}")
    results = []
    for name in args.models:
        got = measure(name, args.rounds, args.steps)
        results.append(got)
        per, gat = got["per_packet"], got["gathered"]
        print(f"{name:<12} {got['twin_ms']:>8.2f}ms {per['ratio']:>11.3f} {gat['ratio']:>9.3f} "
              f"{per['wakes_per_step']:>8.2f} -> {gat['wakes_per_step']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
