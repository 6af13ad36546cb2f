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
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
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
    rank: Optional[int] = None  # None: every rank

    @classmethod
    def parse(cls, spec: str, layers: Sequence[str]) -> "Fault":
        kind, at, rest = spec.partition("@")
        step_text, *more = rest.split(":")
        ranks = [m for m in more if m.startswith("rank=")]
        names = [m for m in more if not m.startswith("rank=")]
        if kind not in KINDS or not at or len(ranks) > 1 or len(names) > 1:
            raise ValueError(f"{spec!r}: expected KIND@STEP[:LAYER][:rank=R] with KIND one of {sorted(KINDS)}")
        layer = names[0] if names else ""
        try:
            rank = int(ranks[0][len("rank="):]) if ranks else None
        except ValueError:
            raise ValueError(f"{spec!r}: rank=R must be a whole number") from None
        try:
            step = int(step_text)
        except ValueError:
            raise ValueError(f"{spec!r}: STEP must be a whole number, got {step_text!r}") from None
        if step < 1:
            raise ValueError(f"{spec!r}: STEP must be >= 1 (the first optimizer step is step 1)")
        layer = layer or DEFAULT_FAULT_LAYER
        if layer not in layers:
            raise ValueError(f"{spec!r}: unknown layer {layer!r}; layers: {', '.join(layers)}")
        return cls(kind, step, layer, rank)

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
    p.add_argument("--fault", action="append", default=[], metavar="KIND@STEP[:LAYER][:rank=R]",
                   help=f"inject a fault: KIND is nan (one step), explode or vanish (from STEP on); "
                        f"LAYER defaults to {DEFAULT_FAULT_LAYER}; rank=R: on that rank only (--ranks). Repeatable.")
    p.add_argument("--ranks", type=int, default=1,
                   help="train as N data-parallel ranks (N processes, DistributedDataParallel over gloo on the CPU), "
                        "each serving on port + rank (default 1)")
    p.add_argument("--stall-at", type=int, default=None, metavar="STEP",
                   help="stop stepping at STEP but keep the process and endpoint alive (a hung job)")
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep the endpoint up this long after the last step")
    return p


REPO_URL = "https://github.com/gradmon/gradmon"


def _port_in_use(addr: str, port: int) -> bool:
    """Whether binding ``addr:port`` fails now. Checked before attaching, so that a taken
    port costs the demo one line instead of gradmon's endpoint error."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return False  # let attach() report an unusable address in its own words
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the endpoint binds
        try:
            sock.bind(sockaddr)
        except OSError:
            return True
    return False


def _deploy_dir() -> str:
    """Where the rules and dashboards are: the checkout gradmon runs from, else the repository."""
    root = Path(__file__).resolve().parents[1]
    return str(root) if (root / "deploy").is_dir() and (root / "dashboards").is_dir() else REPO_URL + "/tree/main"


def _next_steps(url: str, out) -> None:
    where = _deploy_dir()
    page = url[:-len("metrics")] if url.endswith("/metrics") else url
    for what, how in (
            ("watch it", f"open {page} in a browser (the live page, unless GRADMON_UI=0), or run: gradmon top {url}"),
            ("see the metrics", f"curl -s {url} | grep -E '^gradmon_(steps_total|grad_global_norm|nonfinite)'"),
            ("inject a fault", "gradmon demo --fault nan@200   (or explode@STEP, vanish@STEP; "
                               f"add :LAYER, default {DEFAULT_FAULT_LAYER})"),
            ("alert rules", f"{where}/deploy/prometheus/rules/gradmon.rules.yml "
                            "(Prometheus Operator: deploy/kubernetes/prometheusrule.yaml)"),
            ("dashboards", f"{where}/dashboards/*.json (import into Grafana)"),
            ("all of it", f"docker compose -f {where}/deploy/docker-compose.yml up -d   "
                          "(Prometheus, Alertmanager, Grafana on :3000, scraping port 9400)"),
            ("stop", "Ctrl-C")):
        print(f"  {what + ':':17s}{how}", file=out)


def _summary(steps: int, monitor, incidents: "List[object]") -> str:
    if monitor.state == "disabled":
        return f"finished after {steps} steps (monitoring was disabled)"
    text = f"finished after {steps} steps; "
    bad = monitor.snapshot().nonfinite_steps
    if not incidents:
        return text + f"{bad} non-finite steps" if bad else text + "no non-finite gradients"
    text += f"{bad} non-finite step{'s' if bad != 1 else ''} in {len(incidents)} incident" \
            f"{'s' if len(incidents) != 1 else ''}:"
    for inc in incidents:
        text += (f"\n  step {inc.step}: gradient first non-finite in layer {inc.grad_layer or '-'}"
                 f", activation in layer {inc.activation_layer or '- (not measured on that step)'}")
    return text


def run(argv: Optional[Sequence[str]] = None, out=sys.stdout) -> int:
    import gradmon
    from gradmon import config

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    if not 1 <= args.ranks <= 64:
        parser.error("--ranks must be in 1..64")
    names = layer_names(DemoNet())
    try:
        faults = [Fault.parse(spec, names) for spec in args.fault]
    except ValueError as exc:
        parser.error(f"--fault {exc}")
    if any(f.rank is not None and not 0 <= f.rank < args.ranks for f in faults):
        parser.error(f"--fault rank=R must name one of the {args.ranks} ranks (0..{args.ranks - 1})")
    if args.ranks > 1:
        return _run_ranks(args, out)
    return _train(args, faults, out)


def _run_ranks(args: argparse.Namespace, out) -> int:
    """N processes on this machine, as torchrun would start them (RANK, LOCAL_RANK,
    WORLD_SIZE); each serves its own endpoint on port + LOCAL_RANK."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the processes to meet on
        s.bind(("127.0.0.1", 0))
        master = s.getsockname()[1]
    print(f"gradmon demo: {args.ranks} ranks (DistributedDataParallel, gloo); rank 0 reports, every rank serves "
          "its own metrics", file=out, flush=True)
    try:
        mp.start_processes(_rank_main, args=(args, master), nprocs=args.ranks, join=True, start_method="spawn")
    except KeyboardInterrupt:
        pass
    except mp.ProcessRaisedException as exc:
        print(f"gradmon demo: a rank failed: {exc}", file=out, flush=True)
        return 1
    return 0


def _rank_main(rank: int, args: argparse.Namespace, master: int) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master}", rank=rank, world_size=args.ranks)
    try:
        names = layer_names(DemoNet())
        faults = [f for f in (Fault.parse(spec, names) for spec in args.fault) if f.rank in (None, rank)]
        _train(args, faults, sys.stdout if rank == 0 else _Quiet(), rank=rank)
    finally:
        dist.destroy_process_group()


class _Quiet:
    """The other ranks' output: only their summary line, prefixed with the rank."""

    def __init__(self) -> None:
        self.rank = os.environ.get("RANK", "?")

    def write(self, text: str) -> int:
        if "finished after" in text or "step " in text and "gradient first non-finite" in text:
            sys.stdout.write(text.replace("gradmon demo:", f"gradmon demo (rank {self.rank}):"))
        return len(text)

    def flush(self) -> None:
        sys.stdout.flush()


def _train(args: argparse.Namespace, faults: Sequence[Fault], out, rank: Optional[int] = None) -> int:
    import gradmon
    from gradmon import config

    torch.manual_seed(args.seed)
    model: nn.Module = DemoNet()
    if rank is not None:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)

    def say(line: str) -> None:
        print(f"gradmon demo: {line}", file=out, flush=True)

    incidents: List[object] = []  # appended on gradmon's publisher thread, read after flush()
    options = {k: v for k, v in (("port", args.port), ("addr", args.addr), ("every", args.every),
                                 ("detail_every", args.detail_every), ("name", args.name)) if v is not None}
    options["on_nonfinite"] = incidents.append
    if config.is_disabled():
        say(f"monitoring is disabled: {config.env_var('disable')}={os.environ[config.env_var('disable')]} "
            "is set in the environment, so gradmon attaches nothing and serves no metrics "
            "(the model trains as it would without gradmon). Unset it to see the metrics.")
    else:
        try:
            cfg = config.resolve(options)
        except (TypeError, ValueError) as exc:
            say(str(exc))
            return 2
        if cfg.port and cfg.registry is None and rank is None and _port_in_use(cfg.addr, cfg.port):
            say(f"port {cfg.port} is in use; serving on a free port instead (choose one with --port)")
            options["port"] = 0
            os.environ.pop(config.env_var("port"), None)  # it would win over port=0; this process is the demo's
    monitor = gradmon.attach(model, **options)
    if monitor.state == "server_failed":
        say(f"{monitor.error}; nothing to look at, stopping (choose another --port)")
        monitor.detach()
        return 1
    served = monitor.url
    if monitor.state != "disabled":
        say(f"{len(monitor.layers)} layers, metrics at {monitor.url}")
        _next_steps(monitor.url, out)
    for fault in faults:
        say(f"will inject {fault.kind} into {fault.layer} at step {fault.step}")
    out.flush()

    step = 0
    inner = model.module if rank is not None else model
    for layer in {f.layer for f in faults}:
        for param in inner.get_submodule(layer).parameters(recurse=False):
            # step + 1: the step being computed, numbered as gradmon and the progress lines count
            param.register_hook(_gradient_fault(faults, layer, lambda: step + 1))

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    teacher = Teacher(16, 8, torch.Generator().manual_seed(args.seed))
    if rank:  # each rank its own shard of the data: the same teacher, its own samples
        teacher.generator = torch.Generator().manual_seed(args.seed + 1000 * rank)
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
            monitor.observe(loss=loss)  # gradmon_loss and its spike score: no .item() here
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
        monitor.flush()  # every step's incident reaches the summary
        if args.hold > 0:
            stop.wait(args.hold)
        monitor.detach()
    say(_summary(step, monitor, incidents))
    if served is not None and monitor.config.ui:
        say(f"the live page was at {served[:-len('metrics')]} (and gradmon top {served}); "
            "--hold SECONDS keeps them up after the last step")
    return 0
