"""Replay a recording through gradmon's real in-process code: the exposition after every step.

The run's model is rebuilt (for its layer names; it never runs), gradmon is attached to it with
the options it was recorded with, and each recorded packet is handed to the monitor's publisher
in its loop step, as the training thread handed it: the publisher's fold, the non-finite
counters, the spike detectors, the baselines and the exporter are gradmon's own, whatever they
are when the replay runs. After each step the publisher is flushed and the registry collected,
keeping the samples a caller wants (the families the rules read: promtool's time grows with
the series it loads).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from prometheus_client import CollectorRegistry

import gradmon
from gradmon import monitor as _monitor
from gradmon import statistics as S
from gradmon.capture.packet import StepPacket

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
import corpus_files as files  # noqa: E402
from record import DROPPED, series_key  # noqa: E402  (the families no rule should see: the machine, the clock)

Series = Dict[str, List[Optional[float]]]  # "name{labels}" -> value after attach (0) and after each step


def _sections(layout: dict) -> tuple:
    by_name = {st.name: st for st in S.STATISTICS}
    return tuple(S.Section(by_name[name], tuple(keys), tuple(numels)) for name, keys, numels in layout["sections"])


def _collect(registry: CollectorRegistry, wanted: Callable[[str], bool]) -> Dict[str, float]:
    return {series_key(s.name, s.labels): s.value for family in registry.collect() for s in family.samples
            if s.name not in DROPPED and wanted(s.name)}


def forget_carried(monitor: gradmon.Monitor) -> None:
    """Drop what a detached monitor left for a later attach of its name to continue (gradmon's
    re-attach within one process): each recorded run was a process of its own, and one process
    replays many runs."""
    _monitor._CARRIED.pop(monitor._carry_key(), None)


class Packets:
    """A recording's packets, rebuilt as gradmon's ``StepPacket``s."""

    def __init__(self, rec: Dict[str, np.ndarray]) -> None:
        self.rec = rec
        self.layouts = [(_sections(l), tuple(l["scalars"]), l) for l in files.layouts(rec)]
        self.values = files.values(rec)
        self.offset = rec["packet_offset"]
        self.step = rec["packet_step"]

    def __len__(self) -> int:
        return len(self.step)

    def packet(self, i: int) -> StepPacket:
        sections, scalars, layout = self.layouts[int(self.rec["packet_layout"][i])]
        lrs = tuple(None if tensor else float(lr) for lr, tensor in zip(self.rec["packet_lr"][i], layout["tensor_lr"]))
        data = self.values[self.offset[i]:self.offset[i + 1]]
        return StepPacket(int(self.rec["packet_index"][i]), int(self.rec["packet_global_step"][i]), 0.0,
                          data=torch.from_numpy(data.copy()) if len(data) or layout["scalars"] else None,
                          sections=sections, scalars=scalars, skipped=layout["skipped"], sampled=layout["sampled"],
                          detail=layout["detail"], measured_at_step=layout["measured_at_step"], learning_rates=lrs)


def expositions(name: str, wanted: Callable[[str], bool] = lambda n: True, steps: Optional[int] = None) -> Series:
    """The wanted samples gradmon exported after attach and after each of the first ``steps``
    steps of recording ``name``, replayed in this process."""
    return replay_recording(files.load(name), corpus.by_name()[name], wanted, steps)


def replay_recording(rec: Dict[str, np.ndarray], run: corpus.Run, wanted: Callable[[str], bool] = lambda n: True,
                     steps: Optional[int] = None) -> Series:
    """:func:`expositions` of a recording's arrays (as ``corpus_files.load`` returns them)."""
    wanted = functools.lru_cache(maxsize=None)(wanted)  # asked once a sample name, not once a sample
    name = run.name
    meta = files.meta(rec)
    options = dict(meta["options"])
    options.setdefault("incident_dir", "")  # a replay is no incident: no bundles in the working directory
    scaler = torch.amp.GradScaler("cpu") if options.pop("scaler") else None
    registry = CollectorRegistry()
    monitor = gradmon.attach(corpus.build(run), registry=registry, scaler=scaler, **options)
    try:
        if list(monitor.layers) != meta["layers"]:
            raise RuntimeError(f"{name}: the model's layers are not the recorded ones")
        packets = Packets(rec)
        total = len(rec["loss"]) if steps is None else min(steps, len(rec["loss"]))
        scrapes = [_collect(registry, wanted)]
        i = 0
        for step in range(1, total + 1):
            while i < len(packets) and packets.step[i] == step:
                monitor._publish(packets.packet(i))  # the training thread's one hand-over
                i += 1
            if not monitor.flush(30.0):
                raise RuntimeError(f"{name}: gradmon's publisher did not fold step {step}")
            scrapes.append(_collect(registry, wanted))
        if monitor._errors.total():
            raise RuntimeError(f"{name}: gradmon counted errors while folding the recorded packets: "
                               f"{monitor._errors.counts()}")
    finally:
        monitor.detach()
        forget_carried(monitor)
    keys = sorted({k for s in scrapes for k in s})
    return {k: [s.get(k) for s in scrapes] for k in keys}
