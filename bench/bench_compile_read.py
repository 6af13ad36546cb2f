"""What a layer's compiled record costs (issue 27): the activation statistics of one output,
compiled with it by Inductor, against the same function compiled without them.

    python bench/bench_compile_read.py            # CPU, the figures in docs/benchmark.md
    python bench/bench_compile_read.py --quick    # a smoke run

Two producers of one (rows, width) float32 output: a matmul (an extern kernel: Inductor
cannot fuse a reduction into it, so the record reads the output once more) and a matmul
followed by GELU (a pointwise kernel: the record's reductions can be fused into it). Each
is timed with and without the record gradmon makes at a layer's output under compile
(every statistic at OUTPUT and LAYER at the defaults: norm, min, max, NaN and Inf counts, the
kurtosis sample), interleaved call by call; printed: the median time of each and the
record's extra time against the time of one plain read of the output (``x.sum()``).

The detail statistics are made in a branch on the host's gate (``capture/traced.py``): open
here, as on a detail step; ``--ordinary`` closes it, as on the other steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
from torch.nn import functional as F

import gradmon
from gradmon import statistics as S
from gradmon.capture.traced import _on_detail_steps, _records


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ordinary", action="store_true", help="the gate closed: an ordinary step's record")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.width, args.calls = 64, 64, 5
    torch.set_num_threads(args.threads)
    stats = tuple(st for st in S.enabled(gradmon.Config()) if st.at in (S.OUTPUT, S.LAYER))
    x = torch.randn(args.rows, args.width)
    w = torch.randn(args.width, args.width) / args.width ** 0.5
    gate = torch.tensor(not args.ordinary)

    def plain(act: Callable) -> Callable:
        return torch.compile(lambda x, w: act(x @ w), fullgraph=True)

    def recorded(act: Callable) -> Callable:
        def f(x, w):
            y = act(x @ w)
            made, detail = _records(stats, y)
            _on_detail_steps(detail, gate)
            return y, made
        return torch.compile(f, fullgraph=True)

    ident = lambda y: y  # noqa: E731
    fns: Dict[str, Callable] = {
        "matmul": plain(ident), "matmul+record": recorded(ident),
        "matmul+gelu": plain(F.gelu), "matmul+gelu+record": recorded(F.gelu),
        "read (sum)": torch.compile(lambda x, w: x.sum(), fullgraph=True),
    }
    y = x @ w
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        for _ in range(3):
            fn(y if name == "read (sum)" else x, w)  # compiled, warm
    for _ in range(args.calls):
        for name, fn in fns.items():
            arg = y if name == "read (sum)" else x
            t0 = time.perf_counter()
            fn(arg, w)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(f"torch {torch.__version__}, {args.threads} threads, output {args.rows}x{args.width} float32 "
          f"({args.rows * args.width * 4 / 2 ** 20:.0f} MiB), {args.calls} calls each, interleaved; median us")
    for name, us in med.items():
        print(f"{name:22s} {us:10.1f}")
    read = med["read (sum)"]
    for base in ("matmul", "matmul+gelu"):
        extra = med[base + "+record"] - med[base]
        print(f"record after {base:12s}: +{extra:.1f} us = {extra / read:.2f} reads of the output, "
              f"{med[base + '+record'] / med[base]:.3f}x the producer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
