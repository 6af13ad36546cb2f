"""Kernel launches gradmon adds to a training step on a CUDA device, counted by the profiler.

    python bench/bench_launches.py --size gpt2 --bf16 --fused [--compiled]

Each step of a sampling period (``detail_every`` steps at the defaults) is profiled on its
own, for the unmonitored model and for an identical copy with gradmon attached at the
defaults (and, with ``--compiled``, for both compiled whole). Printed per variant: the
device kernels per step (each a launch: kernels, memsets and copies) on ordinary steps and
on detail steps, the host's launch calls, and the device's busy time (the kernels'
durations added up); the difference to the unmonitored copy is what gradmon adds. Whether
a step's added time is the device's or the host's: compare the added busy time with it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from typing import Dict, List

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import bench_overhead as B  # bench/ is on sys.path when a script here runs

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaMemsetAsync", "cudaMemcpyAsync", "cudaGraphLaunch")


def count(step, steps: int) -> List[Dict[str, int]]:
    out = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        events = prof.events()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        names = collections.Counter(e.name for e in kernels)
        busy: Dict[str, float] = collections.Counter()
        for e in kernels:
            busy[e.name] += e.device_time_total
        out.append({"device": sum(names.values()), "names": names, "busy_us": busy,
                    "device_us": sum(busy.values()),
                    "launch_calls": sum(1 for e in events if e.name in LAUNCH_CALLS)})
    return out


def measure(compiled: bool, period: int) -> Dict[str, Dict[str, object]]:
    res = {}
    for name in ("baseline", "gradmon_defaults"):
        model, opt, step = B.make_training(compiled=compiled)
        if compiled:
            teardown = B.VARIANTS[name](model, opt, {})
        for _ in range(3):
            step()  # warm, compiled
        if not compiled:
            teardown = B.VARIANTS[name](model, opt, {})
        for _ in range(period):  # a full period after attaching: the monitor settled
            step()
        per_step = count(step, period)
        teardown()
        device = [c["device"] for c in per_step]
        res[name] = {"per_step": per_step, "min": min(device), "median": statistics.median(device),
                     "max": max(device), "launch_calls_median": statistics.median(c["launch_calls"] for c in per_step),
                     "device_ms_median": statistics.median(c["device_us"] for c in per_step) / 1000}
        del model, opt, step
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(B.SIZES), default="gpt2")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fused", action="store_true")
    p.add_argument("--compiled", action="store_true", help="also the pair compiled whole (Inductor)")
    p.add_argument("--period", type=int, default=20, help="steps profiled: one sampling period at the defaults")
    p.add_argument("--top", type=int, default=25, help="kernel names listed")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device: kernel launches are counted by the CUDA profiler")
        return 2
    B.SETUP.update(size=args.size, device="cuda", bf16=args.bf16, fused=args.fused)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, model {args.size}"
          f"{', bf16 autocast' if args.bf16 else ''}{', fused AdamW' if args.fused else ''}")
    print(f"{'pair':10s} {'variant':18s} {'kernels/step min':>17s} {'median':>7s} {'max':>5s} {'host launch calls':>18s}"
          f" {'device busy ms/step':>20s}")
    for compiled in ([False, True] if args.compiled else [False]):
        res = measure(compiled, args.period)
        for name, r in res.items():
            print(f"{'compiled' if compiled else 'eager':10s} {name:18s} {r['min']:17d} {r['median']:7.0f} "
                  f"{r['max']:5d} {r['launch_calls_median']:18.0f} {r['device_ms_median']:20.2f}")
        base, mon = res["baseline"], res["gradmon_defaults"]
        print(f"{'':10s} added by gradmon: ordinary steps {mon['min'] - base['min']:+d} kernels, "
              f"detail steps {mon['max'] - base['max']:+d}; per step of the period: "
              f"{[c['device'] - b['device'] for c, b in zip(mon['per_step'], base['per_step'])]}")
        for kind, pick in (("an ordinary", min), ("a detail", max)):
            step = pick(mon["per_step"], key=lambda c: c["device"])
            added = step["names"] - base["per_step"][0]["names"]
            busy = {n: step["busy_us"][n] * k / step["names"][n] for n, k in added.items()}
            print(f"{'':10s} {kind} step's added kernels by name (top {args.top}), with the device time they "
                  f"took ({sum(busy.values()) / 1000:.2f} ms in all):")
            for name, n in added.most_common(args.top):
                print(f"{'':12s}{n:6d} {busy[name]:9.0f} us  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
