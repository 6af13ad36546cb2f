"""Record the corpus: train each run of ``corpus.runs()`` with gradmon attached and keep every
step packet gradmon's publisher folded, exactly as it folded it.

    nice -n 19 python bench/instability/record_corpus.py                 # every run not yet recorded
    nice -n 19 python bench/instability/record_corpus.py --only lm-healthy-warmup-s0
    python bench/instability/record_corpus.py --manifest                 # rewrite manifest.json only
    nice -n 10 python bench/instability/record_corpus.py --set independent --dir /work/independent-corpus

Each run gets a fresh process, one at a time, one thread (gradmon's counters continue across
attaches of one model name in one process; a real job is one process). gradmon is attached as a
user would: ``gradmon.attach(model, registry=CollectorRegistry(), final_scrape_timeout=0,
name=<family>, scaler=<the GradScaler of an fp16 run>, detail_every=1, optimizer_every=1)`` with
every other option at its default, and ``monitor.observe(loss=...)`` every step: every statistic
on every step (:data:`EVERY_STEP`), so that a detector may read any of them on any step, and the
scorer replays what the defaults would have exported (``inprocess.at_cadence``). The recorder
wraps the publisher's queue (to note the loop step of each packet) and the aggregator's fold (to
copy each packet's host values after its transfer completed): gradmon itself runs unchanged. See
``corpus_files`` for the file layout.

Recordings are kept, not regenerated: CPU runs are not bitwise reproducible across torch
versions, so a re-recorded corpus is a different corpus (and needs new labels).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from prometheus_client import CollectorRegistry

import gradmon
from gradmon.capture.packet import StepPacket

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
import corpus_files as files  # noqa: E402
import independent  # noqa: E402
import inprocess  # noqa: E402

SETS = {  # which runs --set records, and what its manifest says about them
    "corpus": (corpus.runs, "Alert-evaluation corpus (issue 22). Split rule: test = every run of family "
                            f"'{corpus.TEST_FAMILY}' and every run with seed >= {corpus.LATE_SEED}; the rest is tune."),
    "independent": (independent.runs, "Independent set (issue 23, bench/instability/independent.py): seeds and "
                                      "settings the corpus never used; kept outside the repository, scored at the end."),
}


def layout_of(packet: StepPacket) -> dict:
    """Everything of a packet but its values: what the fold needs to read them."""
    return {"sections": [[s.statistic.name, list(s.keys), list(s.numels)] for s in packet.sections],
            "scalars": list(packet.scalars), "skipped": packet.skipped, "sampled": packet.sampled,
            "detail": packet.detail, "measured_at_step": packet.measured_at_step,
            "tensor_lr": [lr is None for lr in packet.learning_rates]}


class Tap:
    """What gradmon's publisher saw: each packet's loop step, layout and host values."""

    def __init__(self) -> None:
        self.step = 0  # the loop step in progress (observe() is called once a step)
        self.put_steps: List[int] = []
        self.packets: List[Tuple[StepPacket, np.ndarray]] = []

    def wrap(self, monitor: gradmon.Monitor) -> None:
        publisher = monitor._publisher
        aggregator = publisher._agg
        put, fold = publisher.put, aggregator.fold

        def tapped_put(item: object) -> None:
            if not isinstance(item, StepPacket):
                raise RuntimeError(f"the corpus loops never renumber steps; got {item!r}")
            self.put_steps.append(self.step)
            put(item)

        def tapped_fold(packet: StepPacket) -> None:
            data = packet.data
            values = np.empty(0) if data is None else data.numpy().astype(np.float64, copy=True)
            self.packets.append((packet, values))
            fold(packet)

        publisher.put = tapped_put
        aggregator.fold = tapped_fold

    def arrays(self, losses: List[float], columns: bool = False) -> Dict[str, np.ndarray]:
        """The recording's arrays; ``columns``: the values in ``corpus_files.encode_columns``."""
        if len(self.put_steps) != len(self.packets):
            raise RuntimeError(f"{len(self.put_steps)} packets published, {len(self.packets)} folded")
        layouts: List[str] = []
        index: Dict[str, int] = {}
        layout_ids, lrs = [], []
        groups = max((len(p.learning_rates) for p, _ in self.packets), default=0)
        for p, _ in self.packets:
            key = json.dumps(layout_of(p), sort_keys=True)
            layout_ids.append(index.setdefault(key, len(index)))
            if len(index) > len(layouts):
                layouts.append(key)
            lr = [np.nan if x is None else x for x in p.learning_rates]
            lrs.append(lr + [np.nan] * (groups - len(lr)))
        sizes = [len(v) for _, v in self.packets]
        offset = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        exact = np.concatenate([v for _, v in self.packets] or [np.empty(0)])
        layout = np.asarray(layout_ids, np.int16)
        return {
            "loss": np.asarray(losses, np.float32),
            "packet_step": np.asarray(self.put_steps, np.int32),
            "packet_index": np.asarray([p.index for p, _ in self.packets], np.int32),
            "packet_global_step": np.asarray([p.global_step for p, _ in self.packets], np.int32),
            "packet_layout": layout,
            "packet_lr": np.asarray(lrs, np.float64).reshape(len(self.packets), groups),
            "packet_offset": offset,
            **(files.encode_columns(exact, offset, layout, [len(json.loads(l)["scalars"]) for l in layouts])
               if columns else {"packet_values": files.encode(exact)}),
            "layouts": np.asarray("[" + ",".join(layouts) + "]"),
        }


EVERY_STEP = {"detail_every": 1, "optimizer_every": 1}  # every statistic gradmon has, on every step


def record(run: corpus.Run, steps: Optional[int] = None, registry: Optional[CollectorRegistry] = None,
           on_step: Optional[Callable[[gradmon.Monitor, int], None]] = None,
           cadence: Optional[Dict[str, int]] = None) -> Dict[str, np.ndarray]:
    """Train ``run`` (its first ``steps`` steps) with gradmon attached to ``registry``; ``on_step``
    sees the monitor after each step (a test compares what gradmon exported live). ``cadence``:
    attach options beside the defaults (:data:`EVERY_STEP`: then the values are stored by
    ``corpus_files.encode_columns``)."""
    tap = Tap()
    monitors: List[gradmon.Monitor] = []
    options = {"final_scrape_timeout": 0, "name": run.family, **(cadence or {})}

    def attach(model: torch.nn.Module, scaler):
        monitor = gradmon.attach(model, registry=registry or CollectorRegistry(), scaler=scaler, **options)
        monitors.append(monitor)
        tap.wrap(monitor)

        def observe(loss: torch.Tensor) -> None:
            tap.step += 1
            monitor.observe(loss=loss)
        return observe

    losses = corpus.train(run, attach, steps, None if on_step is None else lambda n: on_step(monitors[0], n))
    monitor = monitors[0]
    monitor.flush()
    layers = list(monitor.layers)
    monitor.detach()
    inprocess.forget_carried(monitor)  # a run is a process of its own (a test records and replays in one)
    arrays = tap.arrays(losses, columns=cadence == EVERY_STEP)
    arrays["meta"] = np.asarray(json.dumps({
        "run": run.name, "options": {**options, "scaler": run.fp16}, "layers": layers,
        "torch_version": torch.__version__, "gradmon_version": gradmon.__version__,
        "recorded": time.strftime("%Y-%m-%d", time.gmtime())}))
    return arrays


def write_manifest(which: str = "corpus") -> dict:
    """The manifest from the run declarations of set ``which`` and whatever recordings exist:
    cause, mechanism, chance level, split, settings, and each file's size and sha256."""
    declared, description = SETS[which]
    entries = {}
    for run in declared():
        p = files.path(run.name)
        entry = {"family": run.family, "cause": run.cause, "mechanism": corpus.MECHANISMS[run.cause],
                 "seed": run.seed, "split": corpus.split_of(run), "chance": corpus.FAMILIES[run.family].chance,
                 "steps": run.steps, "settings": {k: v for k, v in vars(run).items()
                                                  if k not in ("family", "cause", "seed", "steps", "tag")}}
        if p.exists():
            rec = files.load(run.name)
            m = files.meta(rec)
            entry.update({"file": p.name, "bytes": p.stat().st_size, "sha256": files.sha256(p),
                          "torch_version": m["torch_version"], "gradmon_version": m["gradmon_version"],
                          "recorded": m["recorded"], "layers": m["layers"]})
        entries[run.name] = entry
    doc = {"description": description,
           "test_family": corpus.TEST_FAMILY, "late_seed": corpus.LATE_SEED,
           "mechanisms": corpus.MECHANISMS, "runs": entries}
    files.MANIFEST.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="run names (default: every run without a recording)")
    p.add_argument("--manifest", action="store_true", help="only rewrite manifest.json")
    p.add_argument("--set", choices=sorted(SETS), default="corpus", help="which declared runs (default: corpus)")
    p.add_argument("--dir", type=Path, help="record into this directory instead of corpus/ (the independent set's "
                                            "lives outside the repository)")
    a = p.parse_args()
    if a.dir is not None:  # else the directory is corpus/ or, in a run's own process, the parent's
        files.use(a.dir)
    if a.set != "corpus" and files.ROOT in (files.DIR, *files.DIR.parents):
        p.error(f"--set {a.set} is recorded outside the repository (--dir), so that nobody tunes on it")
    if a.manifest:
        write_manifest(a.set)
        return
    torch.set_num_threads(1)
    files.DIR.mkdir(parents=True, exist_ok=True)
    declared = SETS[a.set][0]()
    chosen = [r for r in declared if (r.name in a.only if a.only else not files.path(r.name).exists())]
    if len(chosen) > 1 or not a.only:
        for run in chosen:  # a fresh process per run, as a real job is (it inherits the directory: files.use)
            subprocess.run([sys.executable, __file__, "--set", a.set, "--only", run.name], check=True)
        write_manifest(a.set)
        return
    for run in chosen:
        t0 = time.process_time()
        arrays = record(run, cadence=EVERY_STEP)
        out = files.path(run.name)
        files.save(out, arrays)
        print(f"{run.name}: {len(arrays['packet_step'])} packets, {int(arrays['packet_offset'][-1])} values, "
              f"{time.process_time() - t0:.0f} CPU-s, {out.stat().st_size // 1024} KiB", flush=True)


if __name__ == "__main__":
    main()
