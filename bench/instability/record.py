"""Record what gradmon exported after every step of the instability runs.

    nice -n 19 python bench/instability/record.py            # all 15 runs, one after another
    nice -n 19 python bench/instability/record.py --only unstable-lr3e-2-s0

writes ``tests/data/instability/<run>.json.gz``: the run's setup, its losses as the training
loop saw them, and, for the scrape right after attach (step 0) and after every optimizer step,
every ``gradmon_*`` sample of the registry (``generate_latest``, after ``monitor.flush()``),
without the families that measure the machine rather than the model (process, overhead) or
the wall clock (the last step's timestamp: the replay derives it from its step-to-time mapping).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import gradmon
from gradmon import metrics as M

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenario  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "instability"
DROPPED = {M.LAST_STEP_TIMESTAMP.name, M.PROCESS_RESIDENT_MEMORY.name, M.PROCESS_THREADS.name,
           *M.exposed_names(M.PROCESS_CPU_SECONDS), *M.exposed_names(M.OVERHEAD_SECONDS)}


def series_key(name: str, labels: Dict[str, str]) -> str:
    """The series as promtool's input_series spells it."""
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def samples(registry: CollectorRegistry) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.startswith(M.PREFIX + "_") and s.name not in DROPPED:
                out[series_key(s.name, s.labels)] = s.value
    return out


def compact(v: float) -> float:
    """4 significant digits, but counts stay exact."""
    return v if not math.isfinite(v) or v == int(v) else float(f"{v:.4g}")


def record(setup: scenario.Setup, run: scenario.Run) -> dict:
    registry = CollectorRegistry()
    scrapes: List[Dict[str, float]] = []
    monitor: Optional[gradmon.Monitor] = None

    def attach(model: torch.nn.Module, opt: torch.optim.Optimizer):
        nonlocal monitor
        monitor = gradmon.attach(model, registry=registry, final_scrape_timeout=0, name="copy")
        scrapes.append(samples(registry))
        return lambda loss: monitor.observe(loss=loss)

    def after_step(step: int, loss: float) -> None:
        monitor.flush()
        scrapes.append(samples(registry))

    losses = scenario.train(setup, run, on_step=after_step, model_hook=attach)
    monitor.detach()
    keys = sorted({k for s in scrapes for k in s})
    return {"setup": asdict(setup), "run": asdict(run), "losses": [compact(x) for x in losses],
            "series": {k: [compact(s[k]) if k in s else None for s in scrapes] for k in keys}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="run names (default: all)")
    p.add_argument("--steps", type=int, help="override the step budget (smoke tests)")
    p.add_argument("--out", type=Path, default=DATA)
    a = p.parse_args()
    torch.set_num_threads(1)
    setup = scenario.Setup() if a.steps is None else scenario.Setup(steps=a.steps)
    a.out.mkdir(parents=True, exist_ok=True)
    chosen = [run for run in scenario.runs() if not a.only or run.name in a.only]
    if len(chosen) > 1:
        # a fresh process per run, as in a real job: gradmon's counters (steps_total above all,
        # which the warm-up rules read) continue across attaches of one model name in one process
        for run in chosen:
            cmd = [sys.executable, __file__, "--only", run.name, "--out", str(a.out)]
            subprocess.run(cmd + (["--steps", str(a.steps)] if a.steps else []), check=True)
        return
    for run in chosen:
        t0 = time.process_time()
        rec = record(setup, run)
        path = a.out / f"{run.name}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(rec, f, separators=(",", ":"))
        print(f"{run.name}: {len(rec['series'])} series, divergence point "
              f"{scenario.divergence_point(rec['losses'])}, {time.process_time() - t0:.0f} CPU-s, "
              f"{path.stat().st_size // 1024} KiB", flush=True)


if __name__ == "__main__":
    main()
