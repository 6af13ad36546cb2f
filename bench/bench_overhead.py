"""gradmon's overhead on a GPT-style training step, as ratios to the unmonitored step.

    python bench/bench_overhead.py            # the README figures (20 rounds of 20 steps)
    python bench/bench_overhead.py --quick    # a smoke run
    python bench/bench_overhead.py --compiled --variants gradmon_defaults   # the torch.compile pair

Reference model (issue 2): 6 blocks, width 256, 4 heads, sequence 128, batch 8, vocab
2048, AdamW, clip_grad_norm_(1.0), torch on 2 CPU threads.

Design: one identical copy of the model per variant plus one unmonitored copy (the
baseline), all in one process, stepped in turn one step each, the order rotating every
step; so a slow second of the machine (this one drifts by +-10 % within a minute) hits
every variant alike, and each variant's ratio is taken against baseline steps run
interleaved with its own. A round is ``--steps`` steps of every copy, a multiple of the
sampling cadence (``detail_every``, ``optimizer_every``: 20 at the defaults) so that every
round holds the same number of sampled steps (two, at the default 20 steps: a round's ratio
then varies half as much as with one, and the confidence interval narrows accordingly);
the round's ratio is the variant's mean step time over the baseline's. gradmon's publisher
thread folds a step while the next copy trains: the timer of a monitored step stops only
after ``flush()``, so that work is charged to the step that caused it (an upper bound: in a
real job it overlaps the next step). Printed: the median of the rounds' ratios and the upper bound of the 95 %
confidence interval of their mean (Student t); ``unmonitored_twin`` is a second
unmonitored copy, so its row is the noise of the method. Host time is gradmon's own
clock (time spent in its hooks) per timed step. Peak memory is each variant's peak
resident set during training steps in a fresh subprocess: what a user's process would
see, allocator caching included.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.nn import functional as F

from transformer import Block  # bench/ is on sys.path when a script here runs


class GPT(nn.Module):
    def __init__(self, vocab: int = 2048, d: int = 256, depth: int = 6, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# -- variants: each returns a teardown ---------------------------------------------------------

def v_baseline(model, opt, state) -> Callable[[], None]:
    return lambda: None


def _gradmon(**options) -> Callable:
    def setup(model, opt, state):
        import gradmon
        from prometheus_client import CollectorRegistry
        mon = gradmon.attach(model, registry=CollectorRegistry(), final_scrape_timeout=0, **options)
        state["monitor"] = mon

        def teardown():
            mon.flush(10)
            mon.detach()
        return teardown
    return setup


def v_floor(model, opt, state) -> Callable[[], None]:
    """The unavoidable read of every gradient: one _foreach_norm per step, results kept on device."""
    params = [p for p in model.parameters() if p.requires_grad]
    kept: List[torch.Tensor] = []

    def hook(opt, args, kwargs):
        kept[:] = torch._foreach_norm([p.grad for p in params if p.grad is not None])
    handle = opt.register_step_pre_hook(hook)
    return handle.remove


def v_tutorial(model, opt, state) -> Callable[[], None]:
    """What tutorials show: a Python hook per parameter calling .norm().item()."""
    log: Dict[str, float] = {}
    handles = [p.register_hook(lambda g, n=n: log.__setitem__(n, g.norm().item()))
               for n, p in model.named_parameters()]
    return lambda: [h.remove() for h in handles]


VARIANTS = {
    "baseline": v_baseline,
    "unmonitored_twin": v_baseline,
    "gradmon_defaults": _gradmon(),
    # every family on every step, the optimizer statistics (issue 10) included
    "gradmon_all_every_step": _gradmon(detail_every=1, optimizer_every=1),
    "gradmon_origin_per_layer": _gradmon(origin_per_layer=True),
    "floor_foreach_norm": v_floor,
    "tutorial_hooks_item": v_tutorial,
}
TARGETS = {"gradmon_defaults": 1.03, "gradmon_all_every_step": 1.10, "compiled_gradmon_defaults": 1.03}

# With --compiled: the model compiled whole (torch.compile, Inductor, fullgraph), gradmon
# attached before the first compiled call; its ratio is to the compiled unmonitored copy.
COMPILED = {"compiled_baseline": v_baseline, "compiled_gradmon_defaults": _gradmon()}
RATIO_TO = {"compiled_gradmon_defaults": "compiled_baseline"}


# Model sizes: ``reference`` is issue 2's CPU model; ``gpt2`` is GPT-2 small's shape (124M
# parameters at vocab 50,304), for a GPU.
SIZES = {"reference": dict(vocab=2048, d=256, depth=6, heads=4, seq=128, batch=8),
         "gpt2": dict(vocab=50304, d=768, depth=12, heads=12, seq=1024, batch=8)}
# Set by main(): where and how every copy trains. On a GPU, bf16 autocast and fused AdamW,
# as production jobs run; each step ends with a device synchronize, so a step's time is
# the device's as well as the host's.
SETUP = dict(size="reference", device="cpu", bf16=False, fused=False, batch=0)  # batch 0: the size's own


def make_training(seed: int = 0, compiled: bool = False):
    shape = dict(SIZES[SETUP["size"]])
    batch, vocab, seq = shape.pop("batch"), shape["vocab"], shape["seq"]
    batch = SETUP["batch"] or batch
    device = torch.device(SETUP["device"])
    torch.manual_seed(seed)
    model = GPT(**shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if SETUP["fused"] else {}))
    data = torch.randint(0, vocab, (batch, seq + 1), device=device)
    forward = torch.compile(model, fullgraph=True) if compiled else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=SETUP["bf16"])
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        with autocast:
            logits = forward(data[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize()
    return model, opt, step


def interleaved(names: List[str], rounds: int, steps: int, discard: int, back_to_back: bool = False
                ) -> Dict[str, Dict[str, float]]:
    # the same seed: identical copies
    copies = {name: make_training(compiled=name in COMPILED) for name in names}
    states: Dict[str, dict] = {name: {} for name in names}
    # a compiled model sees only the hooks there at its first call: attached before it
    teardowns = {name: VARIANTS[name](*copies[name][:2], states[name]) for name in names if name in COMPILED}
    for _, _, step in copies.values():
        for _ in range(3):
            step()  # allocator and kernels warm, compiled
    teardowns.update({name: VARIANTS[name](*copies[name][:2], states[name]) for name in names
                      if name not in COMPILED})
    # each monitor's own clock (time in its hooks), read before and after the timed rounds
    recorders = {name: getattr(st.get("monitor"), "_recorder", None) for name, st in states.items()}

    def timed(name: str, n: int = 1) -> float:
        """``n`` steps of one copy, then its monitor flushed: with n = 1 the fold of each
        step is charged to it in full; with a round's steps the fold overlaps the next step,
        as in a job (on a GPU, the device's work)."""
        monitor = states[name].get("monitor")
        t0 = time.perf_counter()
        for _ in range(n):
            copies[name][2]()
        if monitor is not None:
            monitor.flush(10)
        return (time.perf_counter() - t0) / n

    for _ in range(discard):  # a fresh attach starts on a sampled step: not a round's
        for name in names:
            timed(name)
    host0 = {name: r.overhead for name, r in recorders.items() if r is not None}
    times: Dict[str, List[float]] = {n: [] for n in names}
    ratios: Dict[str, List[float]] = {n: [] for n in names}
    k = 0
    for _ in range(rounds):
        sums = dict.fromkeys(names, 0.0)
        for _ in range(1 if back_to_back else steps):
            for name in names[k % len(names):] + names[:k % len(names)]:
                dt = timed(name, steps if back_to_back else 1)
                sums[name] += dt
                times[name].append(dt)
            k += 1
        for name in names:
            ratios[name].append(sums[name] / sums[RATIO_TO.get(name, "baseline")])
    for name, teardown in teardowns.items():
        teardown()
    out = {}
    for name in names:
        r = recorders[name]
        out[name] = {"mean_step_ms": statistics.fmean(times[name]) * 1e3, "ratio": statistics.median(ratios[name]),
                     "ratio_ci95_high": ci95_high(ratios[name]) if name != "baseline" else math.nan,
                     "host_us_per_step": (r.overhead - host0[name]) / (rounds * steps) * 1e6 if r else math.nan}
    return out


# two-sided 95 % Student t quantiles by degrees of freedom; past 30 the normal one
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def ci95_high(samples: List[float]) -> float:
    """Upper bound of the 95 % confidence interval of the mean of ``samples``."""
    if len(samples) < 2:
        return math.nan
    t = _T975[len(samples) - 2] if len(samples) - 1 <= len(_T975) else 1.960
    return statistics.mean(samples) + t * statistics.stdev(samples) / math.sqrt(len(samples))


def _peak_during_steps(name: str, steps: int) -> float:
    """Run in a fresh process: peak RSS (MB) while training with the variant attached.

    The kernel's high-water mark is reset after model creation and two warm-up steps
    (``/proc/self/clear_refs``), so the peak is that of the training steps, not of
    importing torch.
    """
    model, opt, step = make_training()
    step()
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    teardown = VARIANTS[name](model, opt, {})
    for _ in range(steps):
        step()
    teardown()
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 1024


def peak_rss_mb(name: str, steps: int) -> float:
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r});"
            f"import bench_overhead as b, torch; torch.set_num_threads({torch.get_num_threads()});"
            f"print(b._peak_during_steps({name!r}, {steps}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _option(text: str):
    key, _, value = text.partition("=")
    return key, json.loads(value) if value not in ("True", "False") else value == "True"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps of every copy per round: a multiple of the sampling cadence (20 at the defaults)")
    p.add_argument("--discard", type=int, default=1, help="untimed steps of every copy after attaching")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=10)
    p.add_argument("--variants", nargs="+", choices=[n for n in VARIANTS if n != "baseline"],
                   help="measure only these (with the baseline); default: all")
    p.add_argument("--options", nargs="+", metavar="KEY=VALUE", default=[],
                   help="also measure gradmon attached with these options (variant gradmon_options), "
                        "e.g. --options detail_every=50 optimizer_every=0")
    p.add_argument("--compiled", action="store_true",
                   help="also measure the compiled pair (compiled_baseline, compiled_gradmon_defaults); "
                        "Inductor compiles each copy first, which takes minutes on a CPU")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--quick", action="store_true", help="tiny run for a smoke test; figures meaningless")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--size", choices=sorted(SIZES), default="reference")
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    p.add_argument("--fused", action="store_true", help="fused AdamW (a CUDA kernel)")
    p.add_argument("--batch", type=int, default=0,
                   help="sequences a step (default: the size's own; a GPU step with more is bound by the device "
                        "rather than by the host's launches)")
    p.add_argument("--back-to-back", action="store_true",
                   help="each round runs a copy's steps one after another and flushes once (copies still take "
                        "turns by round): the fold overlaps the next step, as in a job; default: copies take turns "
                        "every step and each step waits for its own fold (an upper bound)")
    args = p.parse_args(argv)
    SETUP.update(size=args.size, device=args.device, bf16=args.bf16, fused=args.fused, batch=args.batch)
    if args.quick:
        args.rounds, args.steps, args.discard, args.memory_steps = 1, 2, 1, 2
    torch.set_num_threads(args.threads)
    names = ["baseline"] + (args.variants or [n for n in VARIANTS if n != "baseline"])
    if args.compiled:
        # torch.compile does not guard on hooks by default: the unmonitored copy's code
        # would otherwise serve the monitored one (docs/integrations.md#torchcompile)
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        VARIANTS.update(COMPILED)
        names += list(COMPILED)
    if args.options:
        VARIANTS["gradmon_options"] = _gradmon(**dict(_option(kv) for kv in args.options))
        names.append("gradmon_options")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {where}, model {args.size}{f', batch {args.batch}' if args.batch else ''}"
          f"{', bf16 autocast' if args.bf16 else ''}"
          f"{', fused AdamW' if args.fused else ''}, {args.threads} threads, {args.rounds} rounds x {args.steps} steps "
          f"of every copy, {'back to back, copies in turn by round' if args.back_to_back else 'interleaved step by step'}",
          flush=True)
    res = interleaved(names, args.rounds, args.steps, args.discard, args.back_to_back)
    # a fresh process knows only the named variants, on the reference CPU setup
    measured = [name for name in names if not (args.no_memory or args.device != "cpu" or name == "gradmon_options"
                                               or name in COMPILED)]
    # each in its own process (a peak RSS is that process's alone), as many at once as the cores hold
    with concurrent.futures.ThreadPoolExecutor(max(1, (os.cpu_count() or 1) // args.threads)) as pool:
        peaks = dict(zip(measured, pool.map(lambda name: peak_rss_mb(name, args.memory_steps), measured)))
    for name in names:
        res[name]["peak_rss_mb"] = peaks.get(name, math.nan)
    base_rss = res["baseline"]["peak_rss_mb"]
    print(f"{'variant':26s} {'step ms':>9s} {'ratio':>7s} {'ci95 hi':>8s} {'target':>7s} {'host us/step':>13s} "
          f"{'peak RSS MB':>12s} {'mem ratio':>9s}")
    for name in names:
        r = res[name]
        r["mem_ratio"] = r["peak_rss_mb"] / base_rss
        target = f"<={TARGETS[name]:.2f}" if name in TARGETS else ""
        host = f"{r['host_us_per_step']:.0f}" if not math.isnan(r["host_us_per_step"]) else "-"
        print(f"{name:26s} {r['mean_step_ms']:9.1f} {r['ratio']:7.3f} {r['ratio_ci95_high']:8.3f} {target:>7s} {host:>13s} "
              f"{r['peak_rss_mb']:12.1f} {r['mem_ratio']:9.3f}")
    for name, base in RATIO_TO.items():
        if name in names:
            print(f"({name}: its ratio is to {base})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
