"""The step packet: what the training thread hands the publisher once per optimizer step.

Written on the training thread (``hooks``), read on the publisher thread (``snapshot``); it
lives apart from both so that neither side imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Tuple

import torch

from ..statistics import Section


class RowBlock(NamedTuple):
    """Which batch rows of tensors of top-level blocks' values went non-finite in one
    forward: for each ``key``, ``start`` of ``keys``, ``starts``, ``block[start:start +
    batch]`` is the [min, max] of each batch row of one tensor of that block's value. A
    device tensor, read on the host only at an incident (``incidents``); one per block of
    rows, not per tensor (the small outputs of a forward share one)."""

    keys: Tuple[int, ...]
    """The blocks' record keys (0: the model's input)."""
    block: torch.Tensor
    starts: Tuple[int, ...]
    batch: int
    forward: int
    """Which forward (micro-batch) of the step, from 0."""

    def of(self, key: int) -> Iterator[torch.Tensor]:
        """The (batch, 2) rows of each tensor of block ``key`` in this block of rows."""
        for k, start in zip(self.keys, self.starts):
            if k == key:
                yield self.block[start:start + self.batch]


class RowHashes(NamedTuple):
    """One root input tensor's batch rows, hashed (``rowhash.row_hash``) in one forward: a
    device tensor, read on the host only at an incident (``incidents``)."""

    name: str
    """The input: ``args[i]``, a keyword's name, ``args[0].input_ids``."""
    hashes: torch.Tensor
    forward: int


@dataclass(frozen=True)
class StepPacket:
    """What one optimizer step measured, still in the packed device layout: the
    records of each statistic in ``sections``, then one value per name in ``scalars``,
    where ``statistics.layout`` places them (read back by ``statistics.read`` and
    ``statistics.read_scalars``)."""

    index: int
    global_step: int
    time: float
    data: Optional[torch.Tensor] = None
    """Host memory, valid once ``event`` has completed."""
    event: Optional[torch.cuda.Event] = None
    """The device-to-host copy's completion, where the device has events (``kernels.to_host``)."""
    sections: Tuple[Section, ...] = ()
    scalars: Tuple[str, ...] = ()  # the step scalars after the sections (statistics.SCALAR_*)
    skipped: bool = False  # an overflow step the GradScaler skipped: data holds only the step scalars
    sampled: bool = True
    detail: bool = False
    measured_at_step: bool = False  # gradients measured at the optimizer step, not at the end of backward
    learning_rates: Tuple[Optional[float], ...] = ()
    """Per param group; None: a tensor, packed as the step scalar ``lr/<group>``."""
    rows: Tuple[RowBlock, ...] = ()
    row_hashes: Tuple[RowHashes, ...] = ()


@dataclass(frozen=True)
class GlobalStepUpdate:
    """``monitor.step(n)`` after the optimizer already published the step: relabel it;
    after a step the scaler skipped: only the current step number moves."""

    global_step: int
    skipped: bool = False
