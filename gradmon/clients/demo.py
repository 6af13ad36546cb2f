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

What gradmon saw is logged as it happens and summarised at the end: each non-finite
incident where it started, each gradient explosion (:class:`ExplosionWatch`) from its onset
step with the layer furthest above its own baseline and, with ``--ranks``, one line a rank
and the rank whose own gradient (before the all-reduce) held the fault.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gradmon import metrics as M

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


DEFAULT_STEPS = 1000  # about a minute at the default --step-delay, compute included
DEFAULT_PORT = 9400  # gradmon's, and the one deploy/'s Prometheus scrapes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradmon demo",
        description="Train a small model on synthetic data with gradmon attached, so you can watch "
                    "its metrics (and any fault you inject) on the Prometheus endpoint and the live page. "
                    f"By default it runs {DEFAULT_STEPS} steps, about a minute.")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"optimizer steps to run; 0 runs until Ctrl-C (default {DEFAULT_STEPS}: about a minute "
                        "at the default --step-delay)")
    p.add_argument("--port", type=int, default=None,
                   help="metrics port; an error if it is taken (default: gradmon's, 9400, or a free one if "
                        "9400 is taken; 0 picks a free one)")
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
                   help="keep the endpoint and the live page up this long after the last step, "
                        "with the run state 'finished'")
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


def _port_asked(args: argparse.Namespace) -> Optional[str]:
    """How the user chose the port (``--port 9500``, ``GRADMON_PORT=9500``), or None for
    gradmon's default: only the default may move to a free port when it is taken."""
    from gradmon import config

    if args.port is not None:
        return f"--port {args.port}"
    env = config.env_var("port")
    return f"{env}={os.environ[env]}" if os.environ.get(env) else None


def gradmon_command() -> str:
    """What to type to run this gradmon again: ``gradmon`` where that name on PATH is this
    installation, else the path of this installation's own script (a virtual environment
    that is not activated: ``.venv/bin/gradmon``)."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    # the console script, or the one beside the interpreter that runs ``python -m gradmon``
    script = argv0 if argv0.name == "gradmon" else Path(sys.executable).parent / "gradmon"
    if not script.is_file():
        return f"{sys.executable} -m gradmon"
    on_path = shutil.which("gradmon")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "gradmon"
    return str(script)


def _deploy_dir() -> str:
    """Where the rules and dashboards are: the checkout gradmon runs from, else the repository."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "deploy").is_dir() and (root / "dashboards").is_dir() else REPO_URL + "/tree/main"


def _page(url: str) -> str:
    return url[:-len("metrics")] if url.endswith("/metrics") else url


def _next_steps(url: str, port: int, asked: Optional[int], out) -> None:
    """What to do next: each command with the URL this demo serves, this gradmon's own path
    and, for another demo, the port the user asked for."""
    where, gradmon = _deploy_dir(), gradmon_command()
    same_port = f" --port {asked}" if asked else ""
    compose = (f"scraping port {DEFAULT_PORT}" if port == DEFAULT_PORT else
               f"it scrapes port {DEFAULT_PORT}: this demo serves {port}, so run it with --port {DEFAULT_PORT}")
    for what, how in (
            ("watch it", f"open {_page(url)} in a browser (the live page, unless GRADMON_UI=0), "
                         f"or run: {gradmon} top {url}"),
            ("see the metrics", f"curl -s {url} | grep -E '^gradmon_(steps_total|grad_global_norm|nonfinite)'"),
            ("inject a fault", f"{gradmon} demo{same_port} --fault nan@200   (or explode@STEP, vanish@STEP; "
                               f"add :LAYER, default {DEFAULT_FAULT_LAYER})"),
            ("alert rules", f"{where}/deploy/prometheus/rules/gradmon.rules.yml "
                            "(Prometheus Operator: deploy/kubernetes/prometheusrule.yaml)"),
            ("dashboards", f"{where}/dashboards/*.json (import into Grafana)"),
            ("all of it", f"docker compose -f {where}/deploy/docker-compose.yml up -d   "
                          f"(Prometheus, Alertmanager, Grafana on :3000; {compose})"),
            ("stop", "Ctrl-C")):
        print(f"  {what + ':':17s}{how}", file=out)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _plan(args: argparse.Namespace) -> str:
    """How long the run takes, said before it starts, and how to change that."""
    if args.steps == 0:
        return "training until Ctrl-C (--steps N stops after N steps)"
    least = args.steps * args.step_delay
    pace = f"; at --step-delay {args.step_delay:g} that is more than {_duration(least)}" if least >= 1 else ""
    return (f"training {args.steps} steps{pace} (--steps N for a shorter or longer run, "
            "--steps 0 until Ctrl-C)")


@dataclass
class Explosion:
    """A run of steps whose pre-clip global norm was exploding, as one rank saw it."""

    step: int  # the onset: the run's first step
    peak: float  # the largest global norm in the run
    layer: Optional[str] = None  # the layer furthest above its own baseline at the onset
    ratio: Optional[float] = None  # that layer's norm over its baseline
    local: Optional[float] = None  # this rank's own global norm before the all-reduce (several ranks)
    until: Optional[int] = None  # the first step back under the thresholds; None: still on at the end

    def where(self) -> str:
        return (f"first in layer {self.layer} ({_times(self.ratio)} its own baseline)" if self.layer
                else "no layer of this rank above its own baseline (its gradients came in the all-reduce)")

    def describe(self) -> str:
        end = f"until step {self.until}" if self.until is not None else "still on at the end"
        return f"explosion from step {self.step} ({end}): global norm up to {_num(self.peak)}, {self.where()}"


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def _times(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"


class ExplosionWatch:
    """Gradient explosions as the GradmonGradientExplosion alert defines them, with its
    thresholds (``thresholds.Thresholds``) counted in steps where the rule counts minutes:
    after ``warmup_steps``, a pre-clip global norm above ``explode_abs``, or above
    ``explode_floor`` and ``explode_jump`` times the median of the last :attr:`BASELINE`
    steps before it. A run of such steps is one explosion, from its onset to the first
    step back under; its steps never enter the baseline, so a lasting one stays one."""

    BASELINE = 100
    MIN_BASELINE = 8

    def __init__(self) -> None:
        from gradmon.thresholds import Thresholds

        self.th = Thresholds()
        self.baseline: Deque[float] = deque(maxlen=self.BASELINE)
        self.found: List[Explosion] = []
        self._seen: Optional[int] = None

    def update(self, snap: Any) -> Optional[str]:
        """Read the snapshot of the step just published; a line to log when an explosion
        starts or ends. A non-finite norm is the non-finite incident's business, not this."""
        step, norm = snap.global_step, snap.global_norm
        if step is None or step == self._seen or norm is None or not math.isfinite(norm):
            return None
        self._seen = step
        if snap.steps_total <= self.th.warmup_steps:
            return None
        last = self.found[-1] if self.found and self.found[-1].until is None else None
        median = statistics.median(self.baseline) if len(self.baseline) >= self.MIN_BASELINE else None
        exploding = norm > self.th.explode_abs or (
            median is not None and norm > self.th.explode_floor and norm > self.th.explode_jump * median)
        if not exploding:
            self.baseline.append(norm)
            if last is not None:
                last.until = step
                return f"step {step}: the gradient explosion that started at step {last.step} is over"
            return None
        if last is not None:
            last.peak = max(last.peak, norm)
            return None
        layer, ratio = _furthest_layer(snap)
        found = Explosion(step, norm, layer, ratio, snap.totals.get(M.LOCAL_GRAD_GLOBAL_NORM))
        self.found.append(found)
        why = f"> {self.th.explode_abs:g}" if norm > self.th.explode_abs else \
            f"{_times(norm / median)} the median of the steps before"  # type: ignore[operator]
        own = f"; this rank's own gradient norm before the all-reduce {_num(found.local)}" \
            if found.local is not None else ""
        return f"step {step}: gradient explosion: global norm {_num(norm)} ({why}), {found.where()}{own}"


def _furthest_layer(snap: Any) -> "Tuple[Optional[str], Optional[float]]":
    """The layer furthest above its own baseline now: the largest ``grad_norm_baseline_ratio``
    where this rank exports per-layer series, else this rank's own worst
    (``local_grad_norm_baseline_ratio_worst``, which names a layer from a ratio of 2 up)."""
    ratios = {layer: v for g in snap.layer_gauges if g.spec is M.GRAD_NORM_BASELINE_RATIO
              for layer, v in g.values if v is not None and math.isfinite(v)}
    if ratios:
        layer = max(ratios, key=ratios.__getitem__)
        return layer, ratios[layer]
    return next(((layer, v) for spec, layer, v in snap.worst if spec is M.LOCAL_GRAD_NORM_RATIO_WORST and layer),
                (None, None))


@dataclass
class Report:
    """What one process of the demo saw, for its end summary."""

    steps: int
    disabled: bool = False
    nonfinite_steps: int = 0
    incidents: List[Tuple[int, Optional[str], Optional[str]]] = field(default_factory=list)  # step, grad, activation layer
    explosions: List[Explosion] = field(default_factory=list)
    own_nonfinite: Optional[int] = None  # this rank's own gradient's non-finite elements (several ranks)
    rank: Optional[int] = None
    url: Optional[str] = None

    def text(self) -> str:
        """The summary of the only process: a first line, then one per incident and explosion."""
        head, details = self._parts()
        return "\n  ".join([head + (":" if details else "")] + details)

    def line(self) -> str:
        """The summary of one rank among several, on one line."""
        head, details = self._parts()
        return "; ".join([head + (f": {details[0]}" if details else "")] + details[1:])

    def _parts(self) -> Tuple[str, List[str]]:
        if self.disabled:
            return f"finished after {self.steps} steps (monitoring was disabled)", []
        bad, n = self.nonfinite_steps, len(self.incidents)
        head = f"finished after {self.steps} steps; "
        if not n:
            head += f"{bad} non-finite steps" if bad else "no non-finite gradients"
        else:
            head += f"{bad} non-finite step{'s' if bad != 1 else ''} in {n} incident{'s' if n != 1 else ''}"
        if self.explosions:
            head += f"; {len(self.explosions)} gradient explosion{'s' if len(self.explosions) != 1 else ''}"
        own = ""
        if self.own_nonfinite is not None:
            own = (" (this rank's own gradient held them before the all-reduce)" if self.own_nonfinite else
                   " (received in the all-reduce: this rank's own gradient was finite)")
        details = [f"step {step}: gradient first non-finite in layer {grad or '-'}, activation in layer "
                   f"{act or '- (not measured on that step)'}{own}" for step, grad, act in self.incidents]
        details += [e.describe() for e in self.explosions]
        return head, details

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Report":
        doc = json.loads(text)
        doc["explosions"] = [Explosion(**e) for e in doc["explosions"]]
        doc["incidents"] = [tuple(i) for i in doc["incidents"]]
        return cls(**doc)


def sources(reports: Sequence[Report]) -> List[str]:
    """Which rank a fault came from, from every rank's own gradient before the all-reduce:
    after it, every rank holds the same (bad) gradient."""
    from gradmon.thresholds import Thresholds

    out = []
    steps = sorted({step for r in reports for step, _, _ in r.incidents})
    own = [r.rank for r in reports if r.own_nonfinite]
    if steps and own:
        out.append(f"{_ranks(own)} the source of the non-finite gradients (step {', '.join(map(str, steps))}): "
                   "its own gradient held NaN/Inf before the all-reduce; the other ranks received them in it")
    factor = Thresholds().divergence_factor
    for onset in sorted({e.step for r in reports for e in r.explosions}):
        local = {r.rank: e.local for r in reports for e in r.explosions if e.step == onset and e.local is not None}
        if len(local) < 2:
            continue
        top = max(local, key=local.__getitem__)
        others = [v for rank, v in local.items() if rank != top]
        if local[top] >= factor * statistics.median(others):  # type: ignore[operator]
            out.append(f"{_ranks([top])} the source of the gradient explosion from step {onset}: its own gradient "
                       f"norm before the all-reduce was {_num(local[top])}, the other ranks' at most "
                       f"{_num(max(others))}")  # type: ignore[type-var]
    return out


def _ranks(ranks: Sequence[Optional[int]]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"


def run(argv: Optional[Sequence[str]] = None, out=sys.stdout) -> int:
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
    report = _train(args, faults, Console(out))
    return report if isinstance(report, int) else 0


class Console:
    """The demo's output. With several ranks, rank 0 prints everything but its summary (the
    parent prints every rank's), the other ranks only their events, each line prefixed
    with the rank; one write per line, so that the ranks' lines never interleave."""

    def __init__(self, out: Any, rank: Optional[int] = None) -> None:
        self.out, self.rank = out, rank

    def say(self, line: str) -> None:
        """A line of the run's story: rank 0's (or the only process's)."""
        if not self.rank:
            self._write(f"gradmon demo: {line}")

    def event(self, line: str) -> None:
        """Something that happened on this rank: every rank prints its own."""
        self._write(f"gradmon demo{f' (rank {self.rank})' if self.rank is not None else ''}: {line}")

    def raw(self, write: Callable[[Any], None]) -> None:
        if not self.rank:
            write(self.out)
            self.out.flush()

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


def _run_ranks(args: argparse.Namespace, out) -> int:
    """N processes on this machine, as torchrun would start them (RANK, LOCAL_RANK,
    WORLD_SIZE); each serves its own endpoint on port + LOCAL_RANK. Each rank leaves its
    report in a file; this process prints them, one line a rank, and names the source."""
    import tempfile

    import torch.multiprocessing as mp

    taken = _taken_rank_ports(args)
    if taken:
        print(f"gradmon demo: {taken}", file=out, flush=True)
        return 1
    print(f"gradmon demo: {args.ranks} ranks (DistributedDataParallel, gloo); rank 0 reports, every rank serves "
          "its own metrics", file=out, flush=True)
    with tempfile.TemporaryDirectory(prefix="gradmon-demo-") as folder:
        files = [Path(folder) / f"rank{r}.json" for r in range(args.ranks)]
        printed = False
        try:
            context = mp.start_processes(_rank_main, args=(args, folder), nprocs=args.ranks, join=False,
                                         start_method="spawn")
            while not context.join(timeout=0.2):
                if not printed and all(f.exists() for f in files):  # before any --hold
                    printed = _print_ranks(files, args, out)
        except KeyboardInterrupt:
            pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            print(f"gradmon demo: a rank failed: {exc}", file=out, flush=True)
            return 1
        if not printed and all(f.exists() for f in files):
            _print_ranks(files, args, out)
    return 0


def _taken_rank_ports(args: argparse.Namespace) -> Optional[str]:
    """Why the ranks cannot serve on port + rank, or None: checked before any rank starts,
    so that a taken port is one line and no half-started job."""
    from gradmon import config

    if config.is_disabled():
        return None
    try:
        cfg = config.resolve({k: v for k, v in (("port", args.port), ("addr", args.addr)) if v is not None})
    except (TypeError, ValueError) as exc:
        return str(exc)
    if not cfg.port or cfg.registry is not None:
        return None
    taken = [p for p in range(cfg.port, cfg.port + args.ranks) if _port_in_use(cfg.addr, p)]
    if not taken:
        return None
    asked = _port_asked(args) or f"the default, {cfg.port}"
    return (f"port {taken[0]} is in use; the ranks serve on {cfg.port}..{cfg.port + args.ranks - 1} (port + rank, "
            f"port from {asked}): choose another base with --port")


def _print_ranks(files: Sequence[Path], args: argparse.Namespace, out) -> bool:
    reports = [Report.from_json(f.read_text()) for f in files]
    for r in reports:
        print(f"gradmon demo: rank {r.rank}: {r.line()}", file=out)
    for line in sources(reports):
        print(f"gradmon demo: {line}", file=out)
    urls = [r.url for r in reports if r.url]
    if urls:
        print(f"gradmon demo: {_after(args, urls[0])}", file=out)
    out.flush()
    return True


def _rank_main(rank: int, args: argparse.Namespace, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(1)
    # A file to meet at, not a port: a port found free can be taken before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{Path(folder) / 'rendezvous'}", rank=rank,
                            world_size=args.ranks)
    try:
        names = layer_names(DemoNet())
        faults = [f for f in (Fault.parse(spec, names) for spec in args.fault) if f.rank in (None, rank)]
        report = _train(args, faults, Console(sys.stdout, rank), rank=rank,
                        done=lambda r: (Path(folder) / f"rank{rank}.json").write_text(r.to_json()))
        if isinstance(report, int):
            raise SystemExit(report)
    finally:
        dist.destroy_process_group()


def _after(args: argparse.Namespace, url: str) -> str:
    """The last line: where the page is, or was."""
    top = f"{gradmon_command()} top {url}"
    if args.hold > 0:
        return (f"the live page stays up for {_duration(args.hold)} at {_page(url)} (and {top}), "
                "with the run state 'finished'; Ctrl-C ends it")
    return f"the live page was at {_page(url)} (and {top}); --hold SECONDS keeps them up after the last step"


def _train(args: argparse.Namespace, faults: Sequence[Fault], console: Console, rank: Optional[int] = None,
           done: Optional[Callable[[Report], None]] = None) -> "Report | int":
    """Train; the report, or an exit status when the demo cannot start. ``done`` gets the
    report before any --hold (a rank hands it to the parent); without it, this prints it."""
    torch.manual_seed(args.seed)
    model: nn.Module = DemoNet()
    if rank is not None:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    incidents: List[Any] = []  # appended on gradmon's publisher thread, read after flush()
    options = _options(args, incidents, console, rank)
    if isinstance(options, int):
        return options
    monitor = _attach(model, options, args, faults, console)
    if isinstance(monitor, int):
        return monitor
    served = monitor.url
    stop = threading.Event()  # SIGTERM ends the loop, a stall and the hold at once
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    step, watch = _loop(model, monitor, args, faults, console, rank, stop)
    monitor.detach()  # finished; with keep_serving the page and /metrics stay up until the process exits
    report = Report(step, disabled=monitor.state == "disabled", nonfinite_steps=monitor.snapshot().nonfinite_steps,
                    incidents=[(i.step, i.grad_layer, i.activation_layer) for i in incidents],
                    explosions=watch.found, rank=rank, url=served,
                    own_nonfinite=None if rank is None else sum(
                        count for tensor, _, count, _ in monitor.snapshot().rank_nonfinite
                        if tensor == M.TENSOR_LOCAL_GRAD))
    if done is not None:
        done(report)
    else:
        console.say(report.text())
        if served is not None and monitor.config.ui:
            console.say(_after(args, served))
    if args.hold > 0 and served is not None:
        try:
            stop.wait(args.hold)
        except KeyboardInterrupt:
            pass  # the hold's own way out, as its line says
    return report


def _options(args: argparse.Namespace, incidents: List[Any], console: Console, rank: Optional[int]
             ) -> "Dict[str, Any] | int":
    """gradmon's options for this demo, or the exit status when they cannot work (said why)."""
    from gradmon import config

    options: Dict[str, Any] = {k: v for k, v in (("port", args.port), ("addr", args.addr), ("every", args.every),
                                                 ("detail_every", args.detail_every), ("name", args.name))
                               if v is not None}
    options["on_nonfinite"] = incidents.append
    options["announce"] = False  # the demo says where everything is, and more
    options["keep_serving"] = args.hold > 0  # --hold: the ended run stays served, as finished
    if config.is_disabled():
        console.say(f"monitoring is disabled: {config.env_var('disable')}={os.environ[config.env_var('disable')]} "
                    "is set in the environment, so gradmon attaches nothing and serves no metrics "
                    "(the model trains as it would without gradmon). Unset it to see the metrics.")
        return options
    try:
        cfg = config.resolve(options)
    except (TypeError, ValueError) as exc:
        console.say(str(exc))
        return 2
    if cfg.port and cfg.registry is None and rank is None and _port_in_use(cfg.addr, cfg.port):
        asked = _port_asked(args)
        if asked:
            console.say(f"port {cfg.port} is in use ({asked}); choose another with --port, "
                        "or --port 0 for a free one")
            return 1
        console.say(f"port {cfg.port} is in use; serving on a free port instead (choose one with --port)")
        options["port"] = 0
    return options


def _attach(model: nn.Module, options: Dict[str, Any], args: argparse.Namespace, faults: Sequence[Fault],
            console: Console) -> Any:
    """gradmon attached to ``model``, where everything is and what will happen said; or the
    exit status when its server could not start."""
    import gradmon

    monitor = gradmon.attach(model, **options)
    if monitor.state == "server_failed":
        console.say(f"{monitor.error}; nothing to look at, stopping (choose another --port)")
        monitor.detach()
        return 1
    if monitor.state != "disabled":
        console.say(f"{len(monitor.layers)} layers, metrics at {monitor.url}")
        console.raw(lambda out: _next_steps(monitor.url, monitor.port, args.port, out))
    console.say(_plan(args))
    for fault in faults:
        console.event(f"will inject {fault.kind} into {fault.layer} at step {fault.step}")
    return monitor


def _loop(model: nn.Module, monitor: Any, args: argparse.Namespace, faults: Sequence[Fault], console: Console,
          rank: Optional[int], stop: threading.Event) -> "Tuple[int, ExplosionWatch]":
    """The training loop, until --steps, SIGTERM or Ctrl-C: the steps taken, and the explosions seen."""
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
    watch = ExplosionWatch()
    started = time.monotonic()
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
            # the watch reads each step's published snapshot: flush, so that none is skipped
            news = watch.update(monitor.snapshot()) if monitor.flush() else None
            if news:
                console.event(news)
            if args.log_every and step % args.log_every == 0:
                console.say(_progress(step, loss, monitor.snapshot(), args.steps, time.monotonic() - started))
            if args.step_delay:
                stop.wait(args.step_delay)
    except KeyboardInterrupt:
        pass
    finally:
        monitor.flush()  # every step's incident reaches the summary
    return step, watch


def _progress(step: int, loss: torch.Tensor, snap: Any, steps: int, elapsed: float) -> str:
    norm = f"{snap.global_norm:.4g}" if snap.global_norm is not None else "-"
    left = f"  (~{_duration(elapsed / step * (steps - step))} left)" if steps and step < steps else ""
    return f"step {step:6d}  loss {loss.item():.4f}  grad_global_norm {norm}{left}"
