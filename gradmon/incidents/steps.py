"""The kept steps as the bundle's arrays, decoded with tensor indexing.

A step's packet is laid out section by section (``statistics.layout``, which its writer and
every reader share). The same few layouts come back step after step (ordinary, detail,
optimizer steps), so each is read once: for every statistic's column, the positions of its
values in the packet. Every
kept step is then gathered with one indexing per column, not a Python loop per value: the
bundle is built while the publisher holds its lock (scrapes wait for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import statistics as S


@dataclass
class Step:
    """One kept step: its packet's host data (a float32 copy) and layout."""

    step: int
    data: Optional[torch.Tensor]
    sections: Tuple[S.Section, ...]
    scalars: Tuple[str, ...]
    learning_rates: Tuple[Optional[float], ...]
    skipped: bool
    batch: List[object]
    rows: Tuple[Tuple[int, torch.Tensor, int, int, int], ...] = ()
    """The packet's per-row block checks (``StepPacket.rows``), still on their device."""
    hashes: Tuple[Tuple[str, torch.Tensor, int], ...] = ()
    """The packet's row hashes of the root's inputs (``StepPacket.row_hashes``), on their device."""


class Layout:
    """Where each statistic's column lies in the packets of one layout."""

    def __init__(self, sections: Sequence[S.Section]) -> None:
        self.columns: Dict[str, Tuple[S.Statistic, Tuple[int, ...], torch.Tensor]] = {}
        self.grad_norm: Optional[str] = None  # the column of the statistic that declares the global norm
        for section, blocks in S.layout(sections).sections:
            stat = section.statistic
            for part, block in zip(stat.parts, blocks):
                for j, column in enumerate(part):
                    name = f"stat.{stat.name}.{column.name}"
                    self.columns[name] = (stat, tuple(section.keys), torch.tensor(block.column(j), dtype=torch.int64))
                    if stat.histogram is not None and column.fold == S.NORM and self.grad_norm is None:
                        self.grad_norm = name

    @staticmethod
    def key(step: Step) -> Tuple[Any, ...]:
        return (len(step.data) if step.data is not None else 0,
                tuple((sec.statistic.name, sec.keys) for sec in step.sections))


def decode(steps: Sequence[Step], layers: int, param_layer: Sequence[int]
           ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, Any]]]:
    """(arrays, statistics described): per-step scalars, each layer's gradient norm and the
    global norm, and every statistic's record columns by key (NaN where a step had none)."""
    n, nan = len(steps), math.nan
    layouts: Dict[Tuple[Any, ...], Layout] = {}

    def layout_of(s: Step) -> Optional[Layout]:
        if s.data is None or s.skipped:
            return None
        key = Layout.key(s)
        if key not in layouts:
            layouts[key] = Layout(s.sections)
        return layouts[key]
    of_step = [layout_of(s) for s in steps]
    arrays: Dict[str, torch.Tensor] = {
        "history.step": torch.tensor([s.step for s in steps], dtype=torch.int64),
        "history.skipped": torch.tensor([s.skipped for s in steps], dtype=torch.uint8),
        **_scalars(steps)}
    keys: Dict[str, List[int]] = {}
    described: Dict[str, Dict[str, Any]] = {}
    for layout in layouts.values():
        for name, (stat, ks, _) in layout.columns.items():
            keys.setdefault(name, [])
            keys[name] = sorted(set(keys[name]) | set(ks))
            described.setdefault(stat.name, {
                "at": stat.at, "columns": [{"name": c.name, "fold": c.fold} for c in stat.columns],
                "key_is": "parameter" if stat.by_parameter else "block" if stat.at == S.BLOCK else "layer"})
    slots = {name: {k: j for j, k in enumerate(ks)} for name, ks in keys.items()}
    where = {(id(layout), name): torch.tensor([slots[name][k] for k in ks], dtype=torch.int64)
             for layout in layouts.values() for name, (_, ks, _) in layout.columns.items()}
    tables = {name: torch.full((n, len(ks)), nan) for name, ks in keys.items()}
    heat = torch.full((n, layers), nan)
    global_norm = torch.full((n,), nan)
    owner = torch.tensor(list(param_layer), dtype=torch.int64)
    for i, (s, layout) in enumerate(zip(steps, of_step)):
        if layout is None:
            continue
        for name, (_, _, index) in layout.columns.items():
            tables[name][i, where[(id(layout), name)]] = s.data[index]
        if layout.grad_norm is not None:
            stat, ks, index = layout.columns[layout.grad_norm]
            global_norm[i] = _layer_norms(heat[i], s.data[index], ks, stat, owner)
    arrays["history.global_norm"] = global_norm
    arrays["history.layer_grad_norm"] = heat
    arrays.update(tables)
    for name, ks in keys.items():
        stat_name = name.split(".")[1]
        arrays.setdefault(f"stat.{stat_name}.keys", torch.tensor(ks, dtype=torch.int64))
        if described[stat_name]["key_is"] == "parameter":
            arrays.setdefault(f"stat.{stat_name}.layer", owner[torch.tensor(ks, dtype=torch.int64)])
    return arrays, described


def _scalars(steps: Sequence[Step]) -> Dict[str, torch.Tensor]:
    """Loss, the first group's learning rate and the loss scale of each step."""
    n, nan = len(steps), math.nan
    out = {name: torch.full((n,), nan) for name in ("loss", "lr", "loss_scale")}
    for i, s in enumerate(steps):
        named = S.read_scalars(s.data[len(s.data) - len(s.scalars):].tolist(), s.scalars) \
            if s.data is not None and s.scalars else {}
        lr = s.learning_rates[0] if s.learning_rates else None
        if lr is None and s.learning_rates:
            lr = named.get(S.learning_rate_scalar(0))
        for key, value in (("loss", named.get(S.SCALAR_LOSS)), ("lr", lr),
                           ("loss_scale", named.get(S.SCALAR_AMP_SCALE))):
            if value is not None:
                out[key][i] = value
    return {f"history.{k}": v for k, v in out.items()}


def _layer_norms(heat_row: torch.Tensor, norms: torch.Tensor, keys: Tuple[int, ...], stat: S.Statistic,
                 owner: torch.Tensor) -> float:
    """Each layer's gradient norm (the root of its parameters' summed squares, in float64)
    into ``heat_row``; returns the global norm. NaN and Inf propagate."""
    index = torch.tensor(keys, dtype=torch.int64)
    layer = owner[index] if stat.by_parameter else index
    squares = torch.zeros(heat_row.shape[0], dtype=torch.float64).index_add_(0, layer, norms.double() ** 2)
    present = torch.zeros(heat_row.shape[0], dtype=torch.bool)
    present[layer] = True
    heat_row[present] = squares[present].sqrt().float()
    return float(squares.sum().sqrt())


def optimizer_values(steps: Sequence[Step], wanted: Sequence[int], param_layer: Sequence[int]
                     ) -> Dict[int, Dict[str, Any]]:
    """The optimizer statistics' record columns of the parameters of the ``wanted``
    layers, at the last kept step that read the optimizer's state: layer -> "param <i>" ->
    column -> value (with the step)."""
    for s in reversed(steps):
        if s.data is None or s.skipped or not any(sec.statistic.at == S.OPTIMIZER for sec in s.sections):
            continue
        out: Dict[int, Dict[str, Any]] = {layer: {} for layer in wanted}
        for stat, section, rows in S.read(s.data.tolist(), s.sections):
            if stat.at != S.OPTIMIZER:
                continue
            for key, row in zip(section.keys, rows):
                layer = param_layer[key]
                if layer in out:
                    values = out[layer].setdefault(f"param {key}", {"step": s.step})
                    values.update({f"{stat.name}.{c.name}": v for c, v in zip(stat.columns, row)})
        return out
    return {layer: {} for layer in wanted}
