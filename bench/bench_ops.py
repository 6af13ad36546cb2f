"""The aten operations gradmon adds to a training step, counted on the CPU: a proxy for the
kernel launches it adds on a GPU (bench/bench_launches.py counts those where a GPU is lent).

    python bench/bench_ops.py                # the reference GPT, as this CPU runs it
    python bench/bench_ops.py --as-device    # the code paths a device takes

``--as-device`` makes the CPU take what a device takes: the NaN/Inf counts computed every
step (a CPU reads a finite norm for free and skips them; a device cannot without a sync),
the norms through ``_foreach_norm``, and Adam's step counts kept as tensors. The counts are
the torch ops' (``isnan``, ``isinf``, sums): on a CUDA device with Triton each group's or
tensor's counts are one Triton launch instead (``capture/counting.py``), which a CPU cannot
take. Views (no kernel) are not counted. Printed: operations per step for the unmonitored model, what
gradmon adds on ordinary and detail steps, and the commonest added operations.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from typing import Counter, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_overhead as B  # bench/ is on sys.path when a script here runs

VIEWS = {"view", "detach", "slice", "as_strided", "select", "unsqueeze", "promote_types", "lift_fresh", "alias",
         "_reshape_alias", "t", "expand", "squeeze", "split", "split_with_sizes", "unbind", "transpose", "permute",
         "reshape", "_unsafe_view"}


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def as_device() -> None:
    from gradmon.capture import kernels, optimizer
    kernels._host_says_finite = lambda norms: False
    kernels._norms = lambda group, dtype, small, *rest: torch.stack(torch._foreach_norm(group, 2))
    optimizer._host_step = lambda step: step


class Errors(logging.Handler):
    """gradmon's own error reports while counting: a patched path that no longer fits the
    code it replaces fails inside gradmon's guards (counted, training goes on) and the
    counts would silently leave out what it skipped."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "error in" in record.getMessage():
            self.seen.append(record.getMessage())


def per_step(name: str, period: int) -> List[Counter[str]]:
    model, opt, step = B.make_training()
    for _ in range(2):
        step()
    teardown = B.VARIANTS[name](model, opt, {})
    for _ in range(period + 5):
        step()
    out = []
    for _ in range(period):
        with Count() as c:
            step()
        out.append(c.ops)
    teardown()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-device", action="store_true", help="take the code paths a device takes")
    p.add_argument("--period", type=int, default=20, help="steps counted: one sampling period at the defaults")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    if args.as_device:
        as_device()
    errors = Errors()
    logging.getLogger("gradmon").addHandler(errors)
    base = per_step("baseline", 1)[0]
    steps = per_step("gradmon_defaults", args.period)
    if errors.seen:
        print(f"gradmon reported errors while counting (the counts would be wrong): {errors.seen[0]}",
              file=sys.stderr)
        return 1
    totals = [sum(c.values()) for c in steps]
    print(f"torch {torch.__version__}, reference GPT{', device code paths' if args.as_device else ''}: "
          f"{sum(base.values())} operations per unmonitored step")
    for kind, pick in (("an ordinary", min), ("a detail", max)):
        added = steps[pick(range(len(steps)), key=totals.__getitem__)] - base
        print(f"gradmon adds {sum(added.values())} on {kind} step: "
              + ", ".join(f"{n} {op}" for op, n in added.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
