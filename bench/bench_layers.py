"""gradmon's host cost as models grow: microseconds per monitored layer per step.

    python bench/bench_layers.py                 # the docs' figures (100 / 1,000 / 3,000 layers + transformer)
    python bench/bench_layers.py --quick         # a smoke run; figures meaningless

Models are tiny on purpose (width 8, batch 4): the step is all host time, so what gradmon
adds per layer is what a GPU job pays in CPU time before its kernels are launched.

* ``chain-N``: N top-level blocks of ``Linear(8, 8) + Tanh`` (N monitored layers, N blocks).
* ``transformer-1000``: 166 pre-LN transformer blocks of width 16 (bench/transformer.py:
  six layers each) plus embeddings, final norm and head: 1,000 layers, 166 blocks.
* ``gpt`` (not in the default list): bench_overhead.py's reference GPT and its step, so its
  defaults' cost can be read on the threads' own clocks, one torch thread.

Each model has an unmonitored twin built from the same seed; the two step in turn, one
step each. Time is CPU time, each thread's own clock (``time.thread_time``, the publisher's
``pthread_getcpuclockid``): on a shared machine wall time mostly measures the neighbours,
and the two threads of one process also wait for each other's GIL. ``train`` is the
training thread's (forward, backward, optimizer step: what delays a GPU's kernel
launches) minus the twin's step run beside it; ``fold`` is the publisher thread's fold of
that step (waited for after the step, outside its timer). ``us/layer`` is their sum per
monitored layer, the ratio (twin + train + fold) / twin. Steps are told apart by kind:
``ordinary`` (every step at the defaults) and ``detail`` (one in ``detail_every``, when
activations, gradient flow and kurtosis are read); each figure is the median over the
kind's steps. ``cycle`` is the mean over whole detail periods, every step counted: what a
step costs on average, the detail steps and what only some ordinary steps pay included (the
layers' hooks registered on the step before each detail step). One thread for torch
(``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from transformer import Block  # bench/ is on sys.path when a script here runs


def chain(layers: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)))


class TinyGPT(nn.Module):
    def __init__(self, depth: int = 166, d: int = 16, vocab: int = 32, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make(name: str, seed: int = 0) -> Tuple[nn.Module, Callable[[], None]]:
    if name == "gpt":  # bench_overhead.py's reference model and step (AdamW, clip_grad_norm_)
        import bench_overhead
        model, _, gpt_step = bench_overhead.make_training(seed)
        return model, gpt_step
    torch.manual_seed(seed)
    if name.startswith("chain-"):
        model: nn.Module = chain(int(name.split("-")[1]))
        x = torch.randn(4, 8)
        loss = lambda: model(x).square().mean()  # noqa: E731
    else:
        model = TinyGPT()
        idx = torch.randint(0, 32, (2, 8))
        loss = lambda: nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()
    return model, step


def _thread_cpu(thread) -> float:
    """CPU seconds ``thread`` has run (Linux: its own clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def measure(name: str, steps: int, options: Dict[str, object]) -> Dict[str, object]:
    import gradmon
    from prometheus_client import CollectorRegistry

    model, step = make(name)
    _twin, twin_step = make(name)
    mon = gradmon.attach(model, registry=CollectorRegistry(), final_scrape_timeout=0, ui=False,
                         announce=False, **options)
    publisher = mon._publisher._thread
    layers = len(mon.layers)
    every = mon.config.detail_every
    pairs: Dict[str, List[Tuple[float, float]]] = {"ordinary": [], "detail": []}
    folds: Dict[str, List[float]] = {"ordinary": [], "detail": []}
    timed: List[Tuple[float, float, float]] = []  # every timed step in order: (monitored, twin, fold)
    try:
        for i in range(steps + every):
            kind = "detail" if i % every == 0 else "ordinary"
            first_twin = i % 2 == 0  # who goes first alternates
            if first_twin:
                t0 = time.thread_time(); twin_step(); t_twin = time.thread_time() - t0
            c0 = _thread_cpu(publisher)
            t0 = time.thread_time(); step(); t_mon = time.thread_time() - t0
            mon.flush(30)  # the publisher's fold of this step, on its own clock
            fold = _thread_cpu(publisher) - c0
            if not first_twin:
                t0 = time.thread_time(); twin_step(); t_twin = time.thread_time() - t0
            if i >= every:  # the first detail period warms caches and allocators
                pairs[kind].append((t_mon, t_twin))
                folds[kind].append(fold)
                timed.append((t_mon, t_twin, fold))
    finally:
        mon.detach()
    out: Dict[str, object] = {"model": name, "layers": layers}
    for kind, got in pairs.items():
        if not got:
            continue
        mon_s, twin_s = (statistics.median(side) for side in zip(*got))
        train = statistics.median(m - t for m, t in got)
        fold = statistics.median(folds[kind])
        out[kind] = {"train_us_per_layer": train / layers * 1e6, "fold_us_per_layer": fold / layers * 1e6,
                     "us_per_layer": (train + fold) / layers * 1e6, "ratio": (twin_s + train + fold) / twin_s,
                     "twin_ms": twin_s * 1e3, "steps": len(got)}
    # whole detail periods, every step counted (the mean, not the median): the detail steps and
    # what only some ordinary steps pay (the layers' hooks registered before each detail step)
    whole = timed[:len(timed) // every * every]
    if whole:
        mon_s, twin_s, fold = (statistics.fmean(side) for side in zip(*whole))
        out["cycle"] = {"train_us_per_layer": (mon_s - twin_s) / layers * 1e6, "fold_us_per_layer": fold / layers * 1e6,
                        "us_per_layer": (mon_s - twin_s + fold) / layers * 1e6, "ratio": (mon_s + fold) / twin_s,
                        "twin_ms": twin_s * 1e3, "steps": len(whole)}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["chain-100", "chain-1000", "chain-3000", "transformer-1000"])
    p.add_argument("--steps", type=int, default=200, help="timed steps per model (after one warm-up period)")
    p.add_argument("--quick", action="store_true", help="tiny run for a smoke test; figures meaningless")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.models, args.steps = ["chain-10", "transformer-1000"], 21
    results = []
    print(f"{'model':<18}{'layers':>7}  {'kind':<9}{'us/layer':>9}{'train':>7}{'fold':>7}{'ratio':>7}"
          f"{'twin ms':>9}{'steps':>7}")
    for name in args.models:
        r = measure(name, args.steps, {})
        results.append(r)
        for kind in ("ordinary", "detail", "cycle"):
            if kind in r:
                k = r[kind]
                print(f"{name:<18}{r['layers']:>7}  {kind:<9}{k['us_per_layer']:>9.2f}{k['train_us_per_layer']:>7.2f}"
                      f"{k['fold_us_per_layer']:>7.2f}{k['ratio']:>7.3f}{k['twin_ms']:>9.2f}{k['steps']:>7}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
