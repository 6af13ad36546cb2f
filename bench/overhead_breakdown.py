"""Where gradmon's time goes on the benchmark's GPT, hook by hook, in milliseconds per step.

    python bench/overhead_breakdown.py                                   # every family every step
    python bench/overhead_breakdown.py --options detail_every=100000 optimizer_every=0   # always-on only

The same setting as bench_overhead.py: the monitored copy steps in turn with two
unmonitored copies, so its tensors are as cold in the cache as in the benchmark's rounds.
Each Recorder and forward hook and each on-device record function is wrapped in a timer; nested
entries are included in their callers (``on_forward`` holds ``activation_record``...).
``host`` is gradmon's own clock over the same steps. A diagnostic, not a figure to publish:
the timers add their own small cost.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from typing import Dict, List, Optional

import torch

import bench_overhead as bench

RECORDER = ("on_param_grad", "_measure_grads", "on_optimizer_post", "end_step", "_close_step")
FORWARD = ("on_forward", "on_block", "on_grad_flow", "on_root_forward")  # capture/forward.py's hooks
STATS = ("activation_record", "gradient_record", "moments_record", "moments_block", "param_grad_stats", "extremes")


def _timed(owner: object, name: str, totals: Dict[str, float]) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    setattr(owner, name, timed)


def breakdown(options: Dict[str, object], steps: int, discard: int) -> Dict[str, float]:
    """ms per step of each timed function, and ``host``, for gradmon attached with ``options``."""
    import gradmon
    from gradmon.capture import forward, hooks, optimizer, writer
    from gradmon.capture import kernels as stats
    from prometheus_client import CollectorRegistry

    totals: Dict[str, float] = collections.defaultdict(float)
    for name in RECORDER:
        _timed(hooks.Recorder, name, totals)
    for name in FORWARD:
        _timed(forward.Forward, name, totals)
    for name in STATS:
        _timed(stats, name, totals)
    _timed(optimizer, "read", totals)
    _timed(writer, "write", totals)
    copies = [bench.make_training() for _ in range(3)]
    monitor = gradmon.attach(copies[0][0], registry=CollectorRegistry(), final_scrape_timeout=0, **options)
    try:
        def round_() -> None:
            for _, _, step in copies:
                step()
            monitor.flush(10)
        for _ in range(discard):
            round_()
        totals.clear()
        before = monitor._recorder.overhead
        for _ in range(steps):
            round_()
        out = {name: seconds / steps * 1000 for name, seconds in totals.items()}
        out["host"] = (monitor._recorder.overhead - before) / steps * 1000
        return out
    finally:
        monitor.detach()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--discard", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--options", nargs="*", default=["detail_every=1", "optimizer_every=1"], metavar="KEY=VALUE",
                   help="gradmon.attach options (default: every family every step)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    options = dict(bench._option(kv) for kv in a.options)
    result = breakdown(options, a.steps, a.discard)
    print(f"gradmon {options}, {a.steps} steps, ms per step (nested entries included in their callers):")
    for name, ms in sorted(result.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
