"""The step packet's one writer: a step's records, section by section in table order, each
part an (n, width) block, then the step scalars, packed into one vector on the device whose
copy to the host starts at once, where ``statistics.layout`` places them; ``statistics.read``
and ``statistics.read_scalars`` read them back from the same layout on the publisher thread.
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from operator import itemgetter
from typing import List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from .. import statistics as S
from ..errors import ErrorLog
from ..statistics import Section, Statistic
from . import kernels
from .packet import StepPacket

Record = Tuple[int, int, Sequence[torch.Tensor]]
"""One record: its key (a layer, a block, a parameter), the numel it measured, one tensor per part."""
Rows = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[torch.Tensor, ...]]
"""Records made many at once: their keys, numels, and one (n, width) block per part."""
_KEY, _NUMEL = itemgetter(0), itemgetter(1)  # of a Record, and of Rows
Batched = Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]
"""A batched statistic's (n, width) rows, with the parameter and the numel of each row."""


class Records(Protocol):
    """One statistic's records of the step as the recorder keeps them (``records._Records``)."""

    rows: List[Rows]

    def committed(self) -> List[Record]: ...


def write(packet: StepPacket, statistics: Sequence[Statistic], records: Mapping[str, Records],
          batched: Mapping[str, Batched], scale: Optional[torch.Tensor],
          scalars: Sequence[Tuple[str, Optional[torch.Tensor]]], errors: ErrorLog,
          sampled: bool = True, detail: bool = False) -> StepPacket:
    """``packet`` with this step's values: every statistic's section (one that fails misses
    the step, counted, the others go on), then each named scalar present. A GradScaler's loss
    ``scale`` is divided out on the device, column by column. Nothing measured: ``packet``."""
    made: List[Tuple[Section, List[torch.Tensor]]] = []
    home: Optional[torch.device] = None
    inv = scale.double().reciprocal().reshape(()) if scale is not None else None
    for st in statistics:
        try:
            section = _section(st, records, batched, home, inv, errors)
        except Exception as exc:  # this statistic misses the step; the others are in the packet
            errors.record("step", exc)
            continue
        if section is not None:
            made.append(section[:2])
            home = section[2]
    present = [(name, t) for name, t in scalars if t is not None]
    if present:
        home = home or present[0][1].device
    if home is None:
        return packet
    placed = S.layout([section for section, _ in made], [name for name, _ in present])
    data, event = kernels.to_host(kernels.pack(_in_layout(placed, made, present), home))
    return dataclasses.replace(packet, data=data, event=event, sections=tuple(section for section, _ in made),
                               scalars=tuple(placed.scalars), sampled=sampled, detail=detail)


def _in_layout(placed: S.PacketLayout, made: Sequence[Tuple[Section, List[torch.Tensor]]],
               scalars: Sequence[Tuple[str, torch.Tensor]]) -> List[torch.Tensor]:
    """The packet's parts in ``placed``'s order, each the size its place there has."""
    parts: List[torch.Tensor] = []
    for (section, blocks), (_, places) in zip(made, placed.sections):
        for block, place in zip(blocks, places):
            if block.numel() != place.rows * place.width:
                raise ValueError(f"gradmon: {section.statistic.name}'s block holds {block.numel()} values "
                                 f"where the packet's layout has {place.rows} x {place.width}")
            parts.append(block)
    parts.extend(t for _, t in scalars)
    return parts


def _section(st: Statistic, records: Mapping[str, Records], batched: Mapping[str, Batched],
             home: Optional[torch.device], inv: Optional[torch.Tensor], errors: ErrorLog
             ) -> Optional[Tuple[Section, List[torch.Tensor], torch.device]]:
    """``st``'s part of the packet: its section, its (n, width) blocks already in the
    packet's device and dtype (so that packing cannot fail on them), and the packet's
    device. When records cannot be stacked, those that are not plain tensors are dropped
    (counted), and the others kept."""
    if st.at in S.BATCHED:
        if st.name not in batched:
            return None
        rows, keys, numels = batched[st.name]
        blocks = [rows]
    else:
        made = _recorded(st, records[st.name], home, errors)
        if made is None:
            return None
        keys, numels, blocks, home = made
    home = home or blocks[0].device
    ship = kernels._ship_dtype(home)
    out = []
    for part, block in zip(st.parts, blocks):
        powers = [c.scale_power for c in part]
        if inv is not None and any(powers):
            block = block.double() * torch.stack([inv.to(block.device) ** p for p in powers])
        out.append(block.to(device=home, dtype=ship, non_blocking=True))
    return Section(st, keys, numels), out, home


def _recorded(st: Statistic, records: Records, home: Optional[torch.device], errors: ErrorLog
              ) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...], List[torch.Tensor], torch.device]]:
    """(keys, numels, one block per part, the packet's device) of a statistic recorded
    record by record and many at once; None without any."""
    committed = records.committed()
    if not committed and not records.rows:
        return None
    home = home or (committed[0][2][0] if committed else records.rows[0][2][0]).device
    try:
        blocks = _stack_parts(st, committed, home) if committed else []
    except Exception as exc:  # a tensor subclass's records: the plain ones go on
        errors.record("step", exc)
        committed = [rec for rec in committed if all(type(part) is torch.Tensor for part in rec[2])]
        blocks = _stack_parts(st, committed, home) if committed else []
    keys = tuple(map(_KEY, committed))
    numels = tuple(map(_NUMEL, committed))
    if records.rows:
        # C-level flattening: a model's thousand blocks come as one or two batches of rows
        keys += tuple(chain.from_iterable(map(_KEY, records.rows)))
        numels += tuple(chain.from_iterable(map(_NUMEL, records.rows)))
        blocks = [torch.cat([b.reshape(len(b), -1).to(home) for b in ([blocks[j]] if blocks else [])
                             + [rows[2][j] for rows in records.rows]])
                  for j in range(len(st.parts))]
    if not keys:
        return None
    return keys, numels, blocks, home


def _stack_parts(st: Statistic, records: Sequence[Record], home: torch.device) -> List[torch.Tensor]:
    return [kernels.stack_records([rec[2][j] for rec in records], home) for j in range(len(st.parts))]
