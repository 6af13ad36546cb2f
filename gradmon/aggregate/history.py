"""The last steps of one monitored model, kept in the process for the live page.

Float32 ring buffers filled on the publisher thread, one row per optimizer step: the
global gradient norm, the loss, the first group's learning rate, whether the step held
non-finite values or was skipped by a GradScaler, and every layer's gradient norm. At most :data:`MAX_BYTES`: a model
with many layers keeps fewer steps. What the page asks for is cut from them on request
(``since`` a step, the heatmap decimated to :data:`MAX_COLUMNS` columns and
:data:`MAX_ROWS` rows), under a lock the publisher holds only to write one row.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

MAX_BYTES = 16 * 2 ** 20
MAX_COLUMNS = 500
MAX_ROWS = 256
_SCALARS = ("global_norm", "loss", "lr", "nonfinite", "skipped")


class History:
    def __init__(self, layers: Sequence[str], steps: int) -> None:
        width = len(layers)
        self.layers = tuple(layers)
        self.capacity = max(1, min(steps, MAX_BYTES // (4 * (width + len(_SCALARS) + 2))))
        self._steps = torch.zeros(self.capacity, dtype=torch.int64)
        self._scalars = torch.full((self.capacity, len(_SCALARS)), math.nan)
        self._norms = torch.full((self.capacity, width), math.nan)
        self.count = 0  # rows ever written; row k lives at k % capacity
        self._cached: Optional[Tuple[int, Dict[str, Any]]] = None  # (count, the whole window)
        self._lock = threading.Lock()
        # layer -> heatmap row: consecutive layers share a row (its largest norm) past MAX_ROWS
        rows = min(width, MAX_ROWS)
        band = [i * rows // max(width, 1) for i in range(width)]
        self._band = torch.tensor(band, dtype=torch.int64)
        members: List[List[str]] = [[] for _ in range(rows)]
        for name, row in zip(self.layers, band):
            members[row].append(name)
        self.rows = [m[0] if len(m) == 1 else f"{m[0]} … {m[-1]} ({len(m)} layers)" for m in members]

    def record(self, step: int, global_norm: Optional[float], loss: Optional[float], lr: Optional[float],
               nonfinite: bool, layer_norms: Mapping[int, float], skipped: bool = False) -> None:
        """One step's row. Steps only increase (``since`` cuts by them): a step numbered at
        or below the last row's, as a GradScaler's skipped step and the step after it are in
        a loop that numbers only applied steps, takes the next number."""
        row = torch.full((len(self.layers),), math.nan)  # NaN: no value this step
        if layer_norms:
            norms = torch.tensor(list(layer_norms.values()), dtype=torch.float32)
            # a NaN/Inf norm is kept as +Inf, apart from "no value", and wins its band's amax
            row[torch.tensor(list(layer_norms), dtype=torch.int64)] = norms.nan_to_num(
                nan=math.inf, posinf=math.inf, neginf=math.inf)
        values = torch.tensor([math.nan if v is None else v for v in (global_norm, loss, lr)]
                              + [float(nonfinite), float(skipped)])
        with self._lock:
            if self.count:
                step = max(step, int(self._steps[(self.count - 1) % self.capacity]) + 1)
            i = self.count % self.capacity
            self._steps[i] = step
            self._scalars[i] = values
            self._norms[i] = row
            self.count += 1

    def document(self, since: Optional[int] = None) -> Dict[str, Any]:
        """The steps after ``since`` (all kept, when None): scalar series and heatmap columns.
        Heatmap columns are the kept steps whose position is a multiple of ``every``, so
        that columns sent in two responses line up; ``every`` grows as steps accumulate.
        The whole window is built once per new step that a request sees, whatever the
        number of clients; each request only cuts its ``since`` from it."""
        with self._lock:
            count = self.count
        cached = self._cached
        if cached is None or cached[0] != count:
            cached = self._cached = (count, self._window())
        return _after(cached[1], since)

    def _window(self) -> Dict[str, Any]:
        with self._lock:
            n = min(self.count, self.capacity)
            first = self.count - n
            order = torch.tensor([(first + k) % self.capacity for k in range(n)], dtype=torch.int64)
            steps = self._steps[order]
            scalars = self._scalars[order]
            every = max(1, math.ceil(n / MAX_COLUMNS))
            positions = torch.arange(first, self.count)
            columns = order[positions % every == 0]
            heat = self._norms[columns]
            column_steps = self._steps[columns]
            bad = torch.isinf(self._norms[order]) if every > 1 else None
        if bad is not None:
            heat = _with_stride_nonfinite(heat, bad, positions, every)
        out: Dict[str, Any] = {"capacity": self.capacity, "steps": steps.tolist()}
        for j, name in enumerate(_SCALARS):
            out[name] = _numbers(scalars[:, j], "{:.5g}")
        if len(self.rows) < len(self.layers):  # bands of layers: the largest norm of each
            banded = torch.full((heat.shape[0], len(self.rows)), -math.inf)
            banded.scatter_reduce_(1, self._band.expand(heat.shape[0], -1), torch.nan_to_num(heat, nan=-math.inf, posinf=math.inf),
                                   "amax")
            heat = banded
        out["heatmap"] = {"every": every, "rows": self.rows, "steps": column_steps.tolist(),
                          "log10": [_cells(torch.log10(col)) for col in heat]}
        return out


def _with_stride_nonfinite(heat: torch.Tensor, bad: torch.Tensor, positions: torch.Tensor,
                            every: int) -> torch.Tensor:
    """A decimated column stands for the ``every`` steps from it: a layer's NaN/Inf norm on
    any of them shows in the column (+Inf), not only on the step the column samples."""
    group = positions // every - (positions[0] + every - 1) // every  # the column each step falls in
    keep = group >= 0  # the steps before the first column belong to a column cut from the window
    hits = torch.zeros(heat.shape, dtype=torch.int64)
    hits.index_add_(0, group[keep], bad[keep].to(torch.int64))
    return heat.masked_fill(hits > 0, math.inf)


def _after(window: Dict[str, Any], since: Optional[int]) -> Dict[str, Any]:
    """The part of a built window after step ``since``: its lists sliced, never rebuilt."""
    if since is None:
        return window
    k = bisect.bisect_right(window["steps"], since)
    out = {key: (value[k:] if key in _SERIES else value) for key, value in window.items()}
    heat = window["heatmap"]
    c = bisect.bisect_right(heat["steps"], since)
    out["heatmap"] = {**heat, "steps": heat["steps"][c:], "log10": heat["log10"][c:]}
    return out


_SERIES = ("steps",) + _SCALARS


NONFINITE = "nonfinite"
"""A heatmap cell whose norm was NaN or Inf (null is a layer without a value that step)."""


def _cells(log10: torch.Tensor) -> List[Any]:
    """A heatmap column: log10 norms, :data:`NONFINITE` for a NaN/Inf norm, null for none
    (or a norm of exactly zero, which has no logarithm)."""
    return [NONFINITE if v == math.inf else float(f"{v:.2f}") if math.isfinite(v) else None
            for v in log10.tolist()]


def _numbers(values: torch.Tensor, fmt: str) -> List[Optional[float]]:
    """JSON numbers, shortened by ``fmt``; NaN, infinities and log10(0) become null (the
    page marks non-finite steps from their own flag)."""
    return [float(fmt.format(v)) if math.isfinite(v) else None for v in values.tolist()]
