"""Python's cyclic garbage collector kept out of a detail step.

A detail step makes tens of Python objects per layer (records, their tensors, the layers'
hooks) that all live until the step's packet is written. Young collections during the step
find them alive and move them on; the ones that reach the oldest generation bring the next
full collection nearer, and a full collection walks every object of the process (hundreds
of thousands in a training job: a tenth of a second or more). On a model of a thousand
layers that was most of gradmon's cost per layer (docs/benchmark.md, "Many small layers:
the collector"). With the collector paused from the detail step's first forward to the
step's close, those objects die by reference count, never having been looked at.

The pause is bounded: it ends when the step closes, when the monitor detaches, and at the
next forward once it has lasted :data:`LONGEST_S` (a forward with gradients that no step
follows, an evaluation loop run in training mode). A job that turned the collector off
itself (``gc.disable()`` and collections of its own, as torchtitan does) is left alone, and
a collector off at the end of a pause is turned back on only if gradmon turned it off.
Several monitors share the one collector: it comes back when the last pause ends.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Optional

LONGEST_S = 10.0
"""Longest pause: a forward after this long with no step closed turns the collector back on
for the rest of the step."""

_lock = threading.Lock()
_holders = 0  # pauses in force now, over every monitor
_turned_off = False  # the collector was on when the first of them began: gradmon turned it off


def _take() -> bool:
    global _holders, _turned_off
    with _lock:
        if _holders == 0:
            if not gc.isenabled():
                return False  # the job manages its collector
            gc.disable()
            _turned_off = True
        _holders += 1
        return True


def _give() -> None:
    global _holders, _turned_off
    with _lock:
        _holders -= 1
        if _holders == 0 and _turned_off:
            _turned_off = False
            gc.enable()


class CollectorPause:
    """One monitor's pause of the collector, at most one in force at a time."""

    __slots__ = ("since", "spent")

    def __init__(self) -> None:
        self.since: Optional[float] = None  # when this pause began; None: not in force
        self.spent = False  # this step's pause ran its course: none again until the step closes

    def hold(self) -> None:
        """A detail step's training forward begins: pause, or go on pausing while the
        step has lasted less than :data:`LONGEST_S`."""
        if self.since is not None:
            if time.monotonic() - self.since > LONGEST_S:
                self.release()
                self.spent = True
        elif not self.spent and _take():
            self.since = time.monotonic()

    def release(self) -> None:
        """The step closed (or the monitor detached): the collector as it was."""
        self.spent = False
        if self.since is not None:
            self.since = None
            _give()
