"""Python's cyclic garbage collector held off through a detail step.

A detail step makes tens of Python objects per layer (records, their tensors, the layers'
hooks) that all live until the step's packet is written. Young collections during the step
find them alive and move them on; the ones that reach the oldest generation bring the next
full collection nearer, and a full collection walks every object of the process (hundreds
of thousands in a training job: a tenth of a second or more). On a model of a thousand
layers that was most of gradmon's cost per layer (docs/benchmark.md, "Many small layers:
the collector"). From the detail step's first forward to the step's close, the young
generation's threshold is raised to :data:`PAUSED_YOUNG` allocations, so those objects die
by reference count, never having been looked at.

The collector is never turned off: a pause that no step ever closes (a loop that raised and
left its monitor behind) costs a young collection every :data:`PAUSED_YOUNG` allocations
instead of every few hundred, and it ends when the step closes, when the monitor detaches,
and at the next forward once it has lasted :data:`LONGEST_S`. A process forked during one (a
DataLoader worker) starts with the thresholds as they were. A job that turned the collector
off, or set its own thresholds, is left alone: the thresholds are put back only where they
are still gradmon's. Several monitors share the one collector: its thresholds come back when
the last pause ends.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Optional, Set, Tuple

PAUSED_YOUNG = 200_000
"""The young generation's threshold during a pause: above the allocations of a detail step
of thousands of layers, and a bound on what a pause left behind lets pile up."""

LONGEST_S = 10.0
"""A pause found this old at a forward ends there; the rest of that step is not paused."""

_lock = threading.Lock()
_open: Set["CollectorPause"] = set()  # the pauses in force, over every monitor
_saved: Optional[Tuple[int, ...]] = None  # the thresholds before the first of them: gradmon raised them


class CollectorPause:
    """One monitor's pause of the collector, at most one in force at a time."""

    __slots__ = ("since", "spent")

    def __init__(self) -> None:
        self.since: Optional[float] = None  # when this pause began; None: not in force
        self.spent = False  # this step's pause ran its course: none again until the step closes

    def hold(self) -> None:
        """A detail step's training forward begins: pause, unless this step's pause is in
        force already (or outlived :data:`LONGEST_S`: it ends now) or the job manages its
        collector itself."""
        global _saved
        with _lock:
            if self.since is not None:
                if time.monotonic() - self.since > LONGEST_S:
                    self.spent = True
                    _end(self)
                return
            if self.spent:
                return
            if not _open:
                young, *older = gc.get_threshold()
                if not gc.isenabled() or young == 0 or young >= PAUSED_YOUNG:
                    return
                gc.set_threshold(PAUSED_YOUNG, *older)
                _saved = (young, *older)
            _open.add(self)
            self.since = time.monotonic()

    def release(self) -> None:
        """The step closed (or the monitor detached): the collector as it was."""
        with _lock:
            self.spent = False
            _end(self)


def _end(pause: CollectorPause) -> None:
    """``pause`` no longer in force; the thresholds back after the last one (under ``_lock``)."""
    global _saved
    if pause not in _open:
        return
    _open.discard(pause)
    pause.since = None
    if not _open and _saved is not None:
        if gc.get_threshold()[0] == PAUSED_YOUNG:  # else the job set its own since: leave them
            gc.set_threshold(*_saved)
        _saved = None


def _after_fork_in_child() -> None:
    # the child has none of the parent's steps: the thresholds as they were
    global _lock, _saved
    _lock = threading.Lock()
    for pause in _open:
        pause.since = None
    _open.clear()
    if _saved is not None and gc.get_threshold()[0] == PAUSED_YOUNG:
        gc.set_threshold(*_saved)
    _saved = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
