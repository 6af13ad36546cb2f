"""Replay a recording through gradmon's real in-process code: the exposition after every step.

The run's model is rebuilt (for its layer names; it never runs), gradmon is attached to it with
the options it was recorded with, and each recorded packet is handed to the monitor's publisher
in its loop step, as the training thread handed it: the publisher's fold, the non-finite
counters, the spike detectors, the baselines and the exporter are gradmon's own, whatever they
are when the replay runs. After each step the publisher is flushed and the registry collected,
keeping the samples a caller wants (the families the rules read: promtool's time grows with
the series it loads).

A recording of every statistic on every step (``record_corpus.py``) can be replayed
as gradmon at another cadence would have published it (``cadence``, e.g. the defaults,
:data:`DEFAULT_CADENCE`): on a step that cadence does not read, the packet loses the sections of
the statistics it would not have recorded (``Statistic.detail``: ``detail_every``; the optimizer
and weight reads: ``optimizer_every``), and the monitor is attached with that cadence. Both
decisions are gradmon's own (``capture.hooks``: a step's index modulo the option); a test
checks the replay so made against a recording made at that cadence.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np
import torch
from prometheus_client import CollectorRegistry

import gradmon
from gradmon import monitor as _monitor
from gradmon import statistics as S
from gradmon.config import Config
from gradmon.capture.packet import StepPacket

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
import corpus_files as files  # noqa: E402
from record import DROPPED, series_key  # noqa: E402  (the families no rule should see: the machine, the clock)

Series = Dict[str, List[Optional[float]]]  # "name{labels}" -> value after attach (0) and after each step

CADENCE_OPTIONS = ("detail_every", "optimizer_every")
DEFAULT_CADENCE = {name: getattr(Config(), name) for name in CADENCE_OPTIONS}  # what a user who sets none gets
_OPTIMIZER_READS = (S.OPTIMIZER, S.WEIGHT)  # the moments gradmon reads on optimizer_every steps only


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


def at_cadence(packet: StepPacket, cadence: Mapping[str, int]) -> StepPacket:
    """``packet`` (of a monitor that read everything on every step) as a monitor at ``cadence``
    would have published it: the sections of statistics that cadence does not read on this step
    dropped, ``detail`` as it would have said."""
    detail = packet.detail and packet.index % cadence["detail_every"] == 0  # a skipped step's packet has none
    every = cadence["optimizer_every"]
    optimizer = bool(every) and packet.index % every == 0
    kept = [(section, blocks) for section, blocks in S.layout(packet.sections, packet.scalars).sections
            if (detail or not section.statistic.detail) and (optimizer or section.statistic.at not in _OPTIMIZER_READS)]
    if len(kept) == len(packet.sections):
        return dataclasses.replace(packet, detail=detail)
    data = packet.data
    if data is not None:
        at = [torch.arange(b.start, b.stop) for _, blocks in kept for b in blocks]
        scalars = len(packet.scalars)
        at.append(torch.arange(len(data) - scalars, len(data)))
        data = data[torch.cat(at)]
    return dataclasses.replace(packet, data=data, sections=tuple(section for section, _ in kept), detail=detail)


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


def expositions(name: str, wanted: Callable[[str], bool] = lambda n: True, steps: Optional[int] = None,
                cadence: Optional[Mapping[str, int]] = None) -> Series:
    """The wanted samples gradmon exported after attach and after each of the first ``steps``
    steps of recording ``name``, replayed in this process (at ``cadence``: :func:`replay_recording`)."""
    return replay_recording(files.load(name), corpus.by_name()[name], wanted, steps, cadence)


def replay_recording(rec: Dict[str, np.ndarray], run: corpus.Run, wanted: Callable[[str], bool] = lambda n: True,
                     steps: Optional[int] = None, cadence: Optional[Mapping[str, int]] = None) -> Series:
    """:func:`expositions` of a recording's arrays (as ``corpus_files.load`` returns them).
    ``cadence`` (``detail_every`` and ``optimizer_every``; None: the recording's own): a recording
    of every statistic on every step replayed as a monitor at that cadence would have published it;
    a recording at that cadence as it is; any other is refused."""
    wanted = functools.lru_cache(maxsize=None)(wanted)  # asked once a sample name, not once a sample
    name = run.name
    meta = files.meta(rec)
    options = dict(meta["options"])
    recorded = {k: options.get(k, DEFAULT_CADENCE[k]) for k in CADENCE_OPTIONS}
    if cadence is not None and dict(cadence) == recorded:
        cadence = None  # as recorded
    if cadence is not None:
        if recorded != {k: 1 for k in CADENCE_OPTIONS}:
            raise ValueError(f"{name} was recorded at {recorded}: only a recording of every step can be "
                             f"replayed at another cadence")
        options.update({k: cadence[k] for k in CADENCE_OPTIONS})
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
                packet = packets.packet(i) if cadence is None else at_cadence(packets.packet(i), cadence)
                monitor._publish(packet)  # the training thread's one hand-over
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
