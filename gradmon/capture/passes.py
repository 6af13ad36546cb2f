"""Backward passes, told apart by autograd's graph task.

A backward that raised (KeyboardInterrupt, out of memory) never runs the callbacks queued in
it, so "a callback is queued" must belong to one pass, not be a flag that outlives it. Not
every pass accumulates into the monitored parameters' ``.grad``: ``torch.autograd.grad``
and ``backward(inputs=...)`` over other tensors leave them as they were.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch


def graph_task_id() -> int:
    """Which backward pass is running (-1 outside one)."""
    return torch._C._current_graph_task_id()


def _will_accumulate(p: torch.Tensor) -> bool:
    """Whether the running backward accumulates into ``p.grad`` (RuntimeError inside
    ``torch.autograd.grad``, which accumulates nothing)."""
    return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)


class BackwardPasses:
    def __init__(self, params: Callable[[], Sequence[Optional[torch.Tensor]]]) -> None:
        self._params = params
        self.queued = -2
        """The pass whose end-of-backward callback is queued."""
        self.watched = -2
        """The pass last seen going through an output gradmon watches."""
        self.accumulated = False
        """A pass since the last measurement accumulated a monitored gradient."""
        self._probe: Optional[weakref.ref] = None  # the parameter that last answered yes

    def first_hook(self) -> bool:
        """Whether this is the first hook of the running pass (the caller queues its callback)."""
        task = graph_task_id()
        if task == self.queued:
            return False
        self.queued = task
        return True

    def through_watched_output(self) -> None:
        """The running pass went through an output gradmon watches: whether it accumulates
        into a monitored ``.grad`` is asked once per pass."""
        task = graph_task_id()
        if task != self.watched:
            self.watched = task
            self.accumulated = self.accumulated or self._accumulates()

    def seen(self) -> bool:
        """Whether the running pass went through an output gradmon watches."""
        return graph_task_id() == self.watched

    def forget_probe(self) -> None:
        """The parameters were replaced: the one that answered last may be gone."""
        self._probe = None

    def _accumulates(self) -> bool:
        """Whether the running backward accumulates into a monitored parameter's ``.grad``:
        asked of the parameter that answered yes last time first, so usually once."""
        known = self._probe() if self._probe is not None else None
        try:
            if known is not None and _will_accumulate(known):
                return True
            for p in self._params():
                if p is not None and _will_accumulate(p):
                    self._probe = weakref.ref(p)
                    return True
        except RuntimeError:
            return False  # torch.autograd.grad: it accumulates nothing
        return False
