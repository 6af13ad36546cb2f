"""What gradmon leaves inside the user's model, made safe to copy and cheap to call.

Two kinds, both removable like a hook handle:

- :class:`BlockForward`, a top-level block's instance ``forward``: the block's own forward,
  then gradmon's check of its output. A module with any forward hook leaves
  ``nn.Module.__call__``'s fast path for the hooks' path, and the blocks' checks run every
  step; an instance ``forward`` keeps the fast path and costs one call. On an ordinary
  step the check of a block already known to wait is made here, inline, without entering
  the hook at all: a model whose every layer is a block pays per block per step.
- :class:`ModelHook`, a hook function as registered on a module (the root's, the layers').

A copy of the model (``copy.deepcopy``: an EMA model, a teacher) is unmonitored: a
:class:`BlockForward` copies as the block's own forward, a :class:`ModelHook` as a hook that
does nothing. A pickled model (``torch.save(model)``) loads the same way. Without this, a copy
would reach for the monitor itself (its locks cannot be copied) or, worse, run the original
model's blocks.
"""

from __future__ import annotations

import copy
from time import perf_counter
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from torch.compiler import is_compiling

from .records import DEFER_MAX


def nothing(*args: Any, **kwargs: Any) -> None:
    """The hook a copied or unpickled model keeps where gradmon's was."""
    return None


def _same(forward: Callable[..., Any]) -> Callable[..., Any]:
    return forward


class ModelHook:
    """A hook function as gradmon registers it on a module: called through."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Callable[..., None]:
        return nothing

    def __reduce__(self) -> Any:
        return (_same, (nothing,))


class BlockForward:
    """A top-level block's forward (``inner``: its class's, bound, or the instance forward it
    had), then ``check(module, args, output)``, as a forward hook would be called.

    With ``lanes`` (the monitor's ``Forward``), an output may skip ``check``: while
    ``lanes.lane`` is a ``BlockChecks`` (inside a root's training forward, eager),
    the output of a block it has settled or holds (``key``) is kept there for the end of
    the forward: ``BlockChecks.wait``'s test, made inline (a call would cost as much as the
    test). Anything else goes to ``check``, which decides again. With ``timed``, that test
    is charged to gradmon's clock (``lanes.clock.seconds``) times ``timed``: one block in
    ``timed`` is timed, since a clock read costs about as much as the test."""

    __slots__ = ("module", "inner", "check", "_before", "__wrapped__", "key", "lanes", "timed", "_clock")

    def __init__(self, module: nn.Module, check: Callable[[nn.Module, Any, Any], None], key: int = 0,
                 lanes: Any = None, timed: int = 0) -> None:
        self.module = module
        self._before = module.__dict__.get("forward")  # an instance forward it already had
        self.inner = module.forward
        self.__wrapped__ = self.inner  # inspect.signature(block.forward) is the block's own
        self.check: Optional[Callable[[nn.Module, Any, Any], None]] = check
        self.key = key
        self.lanes = lanes
        self.timed = timed
        self._clock = lanes.clock if timed and lanes is not None else None
        module.forward = self  # an instance attribute: nn.Module's call finds it first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.inner(*args, **kwargs)
        check = self.check
        if check is None:
            return output
        # is_compiling() first: compiled, the lane is never read (no guard on it)
        if self.lanes is not None and not is_compiling():
            t0 = perf_counter() if self.timed else 0.0
            lane = self.lanes.lane
            if (lane is not None and type(output) is torch.Tensor and self.module.training
                    and torch.is_grad_enabled()
                    and (self.key in lane.held or (self.key in lane.settled and output.numel() <= DEFER_MAX))):
                try:
                    lane.waiting.append((self.key, output, output._version))
                    if self.timed:
                        self._clock.seconds += self.timed * (perf_counter() - t0)
                    return output
                except Exception:  # noqa: BLE001 - an inference tensor has no version counter
                    pass  # the hook's path decides, guarded
        check(self.module, args, output)
        return output

    def remove(self) -> None:
        """The block's forward back as it was; where something else has since replaced it
        (and may call this one), this one only stops checking."""
        self.check = self.lanes = self._clock = None
        if self.module.__dict__.get("forward") is self:
            if self._before is None:
                del self.module.__dict__["forward"]
            else:
                self.module.__dict__["forward"] = self._before

    def __deepcopy__(self, memo: Dict[int, Any]) -> Callable[..., Any]:
        # the copy's own forward: a bound method copies bound to the copy under construction
        return copy.deepcopy(self.inner, memo)

    def __reduce__(self) -> Any:
        return (_same, (self.inner,))
