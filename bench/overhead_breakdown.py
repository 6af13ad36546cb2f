"""Where gradmon's time goes on the benchmark's GPT, hook by hook, in milliseconds per step.

    python bench/overhead_breakdown.py                                   # every family every step
    python bench/overhead_breakdown.py --options detail_every=100000 optimizer_every=0   # always-on only
    python bench/overhead_breakdown.py --cpu --threads 1 --options      # the defaults, in CPU time
    python bench/overhead_breakdown.py --device cuda --size gpt2 --bf16 --fused --options   # on a GPU
    python bench/overhead_breakdown.py --profile 40 --options           # cProfile, torch calls included

The same setting as bench_overhead.py: the monitored copy steps in turn with two
unmonitored copies, so its tensors are as cold in the cache as in the benchmark's rounds.
Each Recorder and forward hook and each on-device record function is wrapped in a timer; nested
entries are included in their callers (``on_forward`` holds ``activation_record``...).
``host`` is gradmon's own clock over the same steps; ``publisher`` the publisher thread's CPU
time per step (its fold of each packet); ``fold_wait`` the training thread's wait for the
interpreter lock while that fold holds it, paid right after each packet is handed over (it
would otherwise land in whichever hook next lets the lock go; on a model whose steps are shorter
than the publisher's ``WAKE_EVERY_S`` the fold comes later, with the next packets, and lands
there). A diagnostic, not a figure to publish: the timers add their own small cost.

``--cpu`` times with the training thread's CPU clock instead of the wall clock (gradmon's own
clock too): on a machine other jobs load, a wall clock charges their time slices to whatever
was running. With ``--threads 1`` every kernel runs on the training thread, so its CPU clock
sees all of gradmon's work there.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import pstats
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

import bench_overhead as bench

RECORDER = ("on_param_grad", "_measure_grads", "on_optimizer_post", "end_step", "_close_step")
FORWARD = ("on_forward", "on_block", "_waits", "_check_block", "on_grad_flow", "on_root_forward")  # capture/forward.py's hooks
STATS = ("activation_record", "gradient_record", "moments_record", "moments_block", "param_grad_stats", "extremes")


def _timed(owner: object, name: str, totals: Dict[str, float], clock: Callable[[], float]) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return f(*args, **kwargs)
        finally:
            totals[name] += clock() - t0
    setattr(owner, name, timed)


def _fold_wait(recorder: object, totals: Dict[str, float], clock: Callable[[], float]) -> None:
    """Each step's packet handed over, then the interpreter lock let go at once and the time
    until it comes back counted as ``fold_wait``: the publisher thread folds the packet holding
    the lock, and the training thread's first release of it after the hand-over (any torch
    call, a tensor freed) waits that long. Without this the wait lands in whichever timed
    hook makes that release (``_close_step`` on the reference GPT). On the CPU clock it reads
    about nothing: waiting for the lock takes no CPU."""
    publish = recorder.publish  # type: ignore[attr-defined]

    def handed_over(item: object) -> None:
        publish(item)
        t0 = clock()
        time.sleep(0)
        totals["fold_wait"] += clock() - t0
    recorder.publish = handed_over  # type: ignore[attr-defined]


def _cpu_seconds(threads: List[threading.Thread]) -> float:
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads if t.is_alive())


def breakdown(options: Dict[str, object], steps: int, discard: int, cpu: bool = False,
              profile: int = 0, dump: Optional[str] = None) -> Dict[str, float]:
    """ms per step of each timed function, ``host`` and ``publisher``, for gradmon attached
    with ``options``; ``cpu``: timed with the training thread's CPU clock. ``profile``:
    print the ``profile`` functions of the monitored copy's steps (and flushes) that
    cProfile finds costliest in their own time, instead of timing hook by hook; ``dump``:
    also write the steps' profile there (``pstats``), to be read where it was not made."""
    import gradmon
    from gradmon.capture import forward, guard, hooks, optimizer, writer
    from gradmon.capture import kernels as stats
    from prometheus_client import CollectorRegistry

    clock = time.thread_time if cpu else time.perf_counter
    for module in (guard, forward):  # gradmon's own clock (host)
        module.perf_counter = clock  # type: ignore[attr-defined]
    totals: Dict[str, float] = collections.defaultdict(float)
    if not profile:
        for name in RECORDER:
            _timed(hooks.Recorder, name, totals, clock)
        for name in FORWARD:
            _timed(forward.Forward, name, totals, clock)
        for name in STATS:
            _timed(stats, name, totals, clock)
        _timed(optimizer, "read", totals, clock)
        _timed(writer, "write", totals, clock)
    copies = [bench.make_training() for _ in range(3)]
    monitor = gradmon.attach(copies[0][0], registry=CollectorRegistry(), final_scrape_timeout=0, **options)
    if not profile:
        _fold_wait(monitor._recorder, totals, clock)
    publisher = [t for t in threading.enumerate() if t.name.startswith("gradmon-publisher")]
    profiler = cProfile.Profile() if profile else None
    timed = [False]  # the timed rounds are on: the warm-up rounds are not profiled
    # on CUDA the backward and its end-of-backward callback run on autograd's device thread,
    # which the main thread's profiler does not see: that callback gets a profiler of its own
    # (from Python 3.12 on, cProfile sees every thread: one profiler serves)
    backward = (cProfile.Profile() if profile and bench.SETUP["device"] != "cpu" and sys.version_info < (3, 12)
                else None)
    if backward is not None:
        after = hooks.Recorder._after_backward

        def profiled(self):  # type: ignore[no-untyped-def]
            return backward.runcall(after, self) if timed[0] else after(self)
        hooks.Recorder._after_backward = profiled
    try:
        def round_() -> None:
            for i, (_, _, step) in enumerate(copies):
                if i == 0 and profiler is not None and timed[0]:
                    profiler.enable()
                    step()
                    monitor.flush(10)
                    profiler.disable()
                else:
                    step()
            monitor.flush(10)
        for _ in range(discard):
            round_()
        totals.clear()
        timed[0] = True
        before, folded = monitor._recorder.overhead, _cpu_seconds(publisher)
        for _ in range(steps):
            round_()
        out = {name: seconds / steps * 1000 for name, seconds in totals.items()}
        out["host"] = (monitor._recorder.overhead - before) / steps * 1000
        out["publisher"] = (_cpu_seconds(publisher) - folded) / steps * 1000
        if profiler is not None:
            text = io.StringIO()
            for what, prof in (("steps and flushes", profiler), ("end-of-backward callbacks", backward)):
                if prof is None:
                    continue
                stats_ = pstats.Stats(prof, stream=text)
                print(f"cProfile of the monitored copy's {what}, {steps} steps (seconds in all):", file=text)
                stats_.sort_stats("tottime").print_stats(profile)
                stats_.sort_stats("cumulative").print_stats("gradmon/", profile)
            print(text.getvalue())
            if dump:
                profiler.dump_stats(dump)
        return out
    finally:
        monitor.detach()
        if backward is not None:
            hooks.Recorder._after_backward = after


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--discard", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu", action="store_true",
                   help="time with the training thread's CPU clock (with --threads 1: all of its kernels)")
    p.add_argument("--options", nargs="*", default=["detail_every=1", "optimizer_every=1"], metavar="KEY=VALUE",
                   help="gradmon.attach options (default: every family every step)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead of timing hook by hook, print the N costliest functions (own time) of the "
                        "monitored copy's steps under cProfile: where the host time goes, torch calls included")
    p.add_argument("--dump", metavar="FILE", help="with --profile: write the steps' profile to FILE (pstats)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (as bench_overhead.py)")
    p.add_argument("--size", choices=sorted(bench.SIZES), default="reference")
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    p.add_argument("--fused", action="store_true", help="fused AdamW (a CUDA kernel)")
    a = p.parse_args(argv)
    bench.SETUP.update(size=a.size, device=a.device, bf16=a.bf16, fused=a.fused)
    torch.set_num_threads(a.threads)
    options = dict(bench._option(kv) for kv in a.options)
    result = breakdown(options, a.steps, a.discard, a.cpu, a.profile, a.dump)
    clock = "training thread's CPU" if a.cpu else "wall"
    print(f"gradmon {options}, {a.steps} steps, {a.threads} threads, ms per step of {clock} time "
          f"(nested entries included in their callers; publisher: its thread's CPU time):")
    for name, ms in sorted(result.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
