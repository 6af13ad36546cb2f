"""The counters that never reset, and what a detached monitor leaves for a later one to continue.

A counter back at 0 under the same labels reads to ``rate()`` as a reset, and what it
counted before is lost from ``increase()``: a model attached again under the same name and
labels (a notebook cell run twice, a sweep's trial) continues its counters.
"""

from __future__ import annotations

import threading
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Set

from ..statistics import Statistic


class Counters:
    """The step counters and, per counted statistic and layer, the NaN and Inf elements."""

    def __init__(self, statistics: Sequence[Statistic], layers: int, amp: bool = False) -> None:
        self.steps_total = 0
        self.nonfinite_steps = 0
        self.amp = amp  # whether AMP skips are counted: a scaler given, or a fused optimizer's skip seen
        self.amp_skipped_steps = 0
        self.norm_overflow_steps = 0
        # statistic -> per layer [NaN elements, Inf elements], in M.NONFINITE_KINDS order
        self.cells: Dict[str, List[List[int]]] = {
            st.name: [[0, 0] for _ in range(layers)] for st in statistics if st.counter is not None}

    def skipped(self) -> None:
        """A step the GradScaler skipped: a step, though not one of ``steps_total``."""
        self.amp_skipped_steps += 1
        self.amp = True  # a fused optimizer's skip shows it even without scaler=

    def amp_skipped(self) -> Optional[int]:
        """The AMP-skipped steps; None when nothing says the job uses a GradScaler."""
        return self.amp_skipped_steps if self.amp else None

    def saved(self, layer_names: Sequence[str]) -> Dict[str, object]:
        """The counters, keyed by layer name rather than index, for :meth:`resume`."""
        return {
            "steps_total": self.steps_total, "nonfinite_steps": self.nonfinite_steps,
            "amp_skipped_steps": self.amp_skipped_steps, "norm_overflow_steps": self.norm_overflow_steps,
            "nonfinite": {(stat, layer_names[i], k): cell[k] for stat, cells in self.cells.items()
                          for i, cell in enumerate(cells) for k in range(2) if cell[k]},
        }

    def resume(self, saved: Mapping[str, object], layer_names: Sequence[str]) -> None:
        """Add an earlier monitor's counters; a layer or statistic this one lacks is dropped."""
        self.steps_total += saved["steps_total"]  # type: ignore[operator]
        self.nonfinite_steps += saved["nonfinite_steps"]  # type: ignore[operator]
        self.amp_skipped_steps += saved["amp_skipped_steps"]  # type: ignore[operator]
        self.norm_overflow_steps += saved.get("norm_overflow_steps", 0)  # type: ignore[operator]
        index = {name: i for i, name in enumerate(layer_names)}
        for (stat, name, k), count in saved["nonfinite"].items():  # type: ignore[union-attr]
            cells = self.cells.get(stat)
            if cells is not None and name in index:
                cells[index[name]][k] += count


class CarriedCounters:
    """Counters of detached monitors by (model name, labels), for a monitor attached again
    under the same name and labels to continue: a counter back at 0 under the same labels
    reads to rate() as a reset, and what it counted before is lost from increase().

    At most ``most`` are kept, the least recently stored dropped first, so that a process
    attaching thousands of differently labelled models (a sweep) does not keep every
    one's per-layer counters. A dropped key's series end: it is remembered (its hash, a
    few dozen bytes) as ended, and ``attach()`` gives a later monitor another name rather
    than start those series again from 0."""

    def __init__(self, most: int = 64) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._kept: Dict[Hashable, object] = {}  # insertion order: the oldest first
        self._ended: Set[int] = set()

    def __setitem__(self, key: Hashable, counters: object) -> None:
        with self._lock:
            self._kept.pop(key, None)
            while len(self._kept) >= self.most:
                oldest = next(iter(self._kept))
                del self._kept[oldest]
                self._ended.add(hash(oldest))
            self._kept[key] = counters

    def get(self, key: Hashable) -> Optional[object]:
        with self._lock:
            return self._kept.get(key)

    def pop(self, key: Hashable, default: Optional[object] = None) -> Optional[object]:
        with self._lock:
            return self._kept.pop(key, default)

    def ended(self, key: Hashable) -> bool:
        """Whether ``key``'s counters were dropped: its series must not start again."""
        with self._lock:
            return key not in self._kept and hash(key) in self._ended

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._ended.clear()

    def __len__(self) -> int:
        return len(self._kept)
