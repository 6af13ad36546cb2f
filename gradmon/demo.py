"""``gradmon demo``: a small model training on the CPU with gradmon attached.

It behaves like a real run, so that dashboards and alerts have something honest to
show: large gradients in the first steps that settle (warm-up), batch noise, and a
slow drift because the data distribution moves. ``--fault KIND@STEP[:LAYER]`` injects
the failures gradmon exists to catch:

* ``nan``: NaN elements in the layer's parameter gradients at exactly that step. The loop
  then does what a guarded production loop does: it zeroes non-finite gradients
  before the optimizer step (gradmon has already counted them at the end of backward).
* ``explode``: the layer's parameter gradients multiplied by 1e4 from that step on (the loop
  clips at 1.0, so the weights survive; the pre-clip norm shows the explosion).
* ``vanish``: the layer's parameter gradients multiplied by 1e-7 from that step on.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

KINDS = {"nan", "explode", "vanish"}
SCALE = {"explode": 1e4, "vanish": 1e-7}
DEFAULT_FAULT_LAYER = "blocks.1.fc2"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class DemoNet(nn.Module):
    """A small residual MLP: embed, four blocks (norm, fc1, fc2), norm, head: 15 layers."""

    def __init__(self, inputs: int = 16, width: int = 32, depth: int = 4, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    layer: str

    @classmethod
    def parse(cls, spec: str, layers: Sequence[str]) -> "Fault":
        kind, at, rest = spec.partition("@")
        step_text, _, layer = rest.partition(":")
        if kind not in KINDS or not at:
            raise ValueError(f"{spec!r}: expected KIND@STEP[:LAYER] with KIND one of {sorted(KINDS)}")
        try:
            step = int(step_text)
        except ValueError:
            raise ValueError(f"{spec!r}: STEP must be a whole number, got {step_text!r}") from None
        if step < 0:
            raise ValueError(f"{spec!r}: STEP must be >= 0")
        layer = layer or DEFAULT_FAULT_LAYER
        if layer not in layers:
            raise ValueError(f"{spec!r}: unknown layer {layer!r}; layers: {', '.join(layers)}")
        return cls(kind, step, layer)

    def active(self, step: int) -> bool:
        return step == self.step if self.kind == "nan" else step >= self.step


def layer_names(model: nn.Module) -> List[str]:
    return [name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _gradient_fault(faults: Sequence[Fault], layer: str, step: Callable[[], int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        for fault in faults:
            if fault.layer == layer and fault.active(step()):
                if fault.kind == "nan":
                    grad = grad.clone()
                    grad.view(-1)[:: max(1, grad.numel() // 16)] = float("nan")
                else:
                    grad = grad * SCALE[fault.kind]
        return grad
    return hook


class Teacher:
    """The data: a fixed random network whose weights drift slowly (a moving distribution)."""

    def __init__(self, inputs: int, classes: int, generator: torch.Generator) -> None:
        self.generator = generator
        self.w = torch.randn(inputs, classes, generator=generator)
        self.drift = torch.randn(inputs, classes, generator=generator) * 1e-3

    def batch(self, size: int) -> "tuple[torch.Tensor, torch.Tensor]":
        self.w += self.drift
        x = torch.randn(size, self.w.shape[0], generator=self.generator)
        logits = x @ self.w + 0.5 * torch.randn(size, self.w.shape[1], generator=self.generator)
        return x, logits.argmax(-1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradmon demo",
        description="Train a small model on synthetic data with gradmon attached, so you can watch "
                    "its metrics (and any fault you inject) on the Prometheus endpoint.")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps to run; 0 runs until Ctrl-C (default 3000)")
    p.add_argument("--port", type=int, default=None, help="metrics port (default: gradmon's, 9400; 0 picks a free one)")
    p.add_argument("--addr", default=None, help="bind address (default: gradmon's, 0.0.0.0)")
    p.add_argument("--every", type=int, default=None, help="publish per-layer norms every N steps")
    p.add_argument("--detail-every", type=int, default=None, help="activation/gradient-flow statistics every N steps")
    p.add_argument("--step-delay", type=float, default=0.05, help="seconds to sleep after each step, so a person can watch (default 0.05)")
    p.add_argument("--log-every", type=int, default=100, help="print a progress line every N steps (default 100)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="demo", help="value of the model label (default 'demo')")
    p.add_argument("--fault", action="append", default=[], metavar="KIND@STEP[:LAYER]",
                   help=f"inject a fault: KIND is nan (one step), explode or vanish (from STEP on); "
                        f"LAYER defaults to {DEFAULT_FAULT_LAYER}. Repeatable.")
    p.add_argument("--stall-at", type=int, default=None, metavar="STEP",
                   help="stop stepping at STEP but keep the process and endpoint alive (a hung job)")
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep the endpoint up this long after the last step")
    return p


def run(argv: Optional[Sequence[str]] = None, out=sys.stdout) -> int:
    import gradmon

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    torch.manual_seed(args.seed)
    model = DemoNet()
    names = layer_names(model)
    try:
        faults = [Fault.parse(spec, names) for spec in args.fault]
    except ValueError as exc:
        parser.error(f"--fault {exc}")

    options = {k: v for k, v in (("port", args.port), ("addr", args.addr), ("every", args.every),
                                 ("detail_every", args.detail_every), ("name", args.name)) if v is not None}
    monitor = gradmon.attach(model, **options)
    print(f"gradmon demo: {len(monitor.layers)} layers, metrics at {monitor.url or monitor.error}", file=out, flush=True)
    for fault in faults:
        print(f"gradmon demo: will inject {fault.kind} into {fault.layer} at step {fault.step}", file=out, flush=True)

    step = 0
    for layer in {f.layer for f in faults}:
        for param in model.get_submodule(layer).parameters(recurse=False):
            param.register_hook(_gradient_fault(faults, layer, lambda: step))

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    teacher = Teacher(16, 8, torch.Generator().manual_seed(args.seed))
    stop = threading.Event()  # SIGTERM ends the loop, a stall and the hold at once
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    try:
        while not stop.is_set() and (args.steps == 0 or step < args.steps):
            if args.stall_at is not None and step >= args.stall_at:
                stop.wait(0.1)  # hung: alive, serving, not stepping
                continue
            x, y = teacher.batch(args.batch_size)
            # warm-up: the first steps see inputs at 4x scale, so gradients start large and settle
            scale = 1.0 + 3.0 * math.exp(-step / 20)
            loss = nn.functional.cross_entropy(model(x * scale), y)
            loss.backward()
            for p in model.parameters():  # the job's own NaN guard, after gradmon has looked
                if p.grad is not None:
                    torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if args.log_every and step % args.log_every == 0:
                snap = monitor.snapshot()
                norm = f"{snap.global_norm:.4g}" if snap.global_norm is not None else "-"
                print(f"step {step:6d}  loss {loss.item():.4f}  grad_global_norm {norm}", file=out, flush=True)
            if args.step_delay:
                stop.wait(args.step_delay)
    except KeyboardInterrupt:
        pass
    finally:
        if args.hold > 0:
            stop.wait(args.hold)
        monitor.detach()
    print(f"gradmon demo: finished after {step} steps", file=out, flush=True)
    return 0
