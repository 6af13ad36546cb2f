"""What gradmon leaves inside the user's model, made safe to copy and cheap to call.

Two kinds, both removable like a hook handle:

- :class:`BlockForward`, a top-level block's instance ``forward``: the block's own forward,
  then gradmon's check of its output. A module with any forward hook leaves
  ``nn.Module.__call__``'s fast path for the hooks' path, and the blocks' checks run every
  step; an instance ``forward`` keeps the fast path and costs one call.
- :class:`ModelHook`, a hook function as registered on a module (the root's, the layers').

A copy of the model (``copy.deepcopy``: an EMA model, a teacher) is unmonitored: a
:class:`BlockForward` copies as the block's own forward, a :class:`ModelHook` as a hook that
does nothing. A pickled model (``torch.save(model)``) loads the same way. Without this, a copy
would reach for the monitor itself (its locks cannot be copied) or, worse, run the original
model's blocks.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

from torch import nn


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
    had), then ``check(module, args, output)``, as a forward hook would be called."""

    __slots__ = ("module", "inner", "check", "_before", "__wrapped__")

    def __init__(self, module: nn.Module, check: Callable[[nn.Module, Any, Any], None]) -> None:
        self.module = module
        self._before = module.__dict__.get("forward")  # an instance forward it already had
        self.inner = module.forward
        self.__wrapped__ = self.inner  # inspect.signature(block.forward) is the block's own
        self.check: Optional[Callable[[nn.Module, Any, Any], None]] = check
        module.forward = self  # an instance attribute: nn.Module's call finds it first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.inner(*args, **kwargs)
        check = self.check
        if check is not None:
            check(self.module, args, output)
        return output

    def remove(self) -> None:
        """The block's forward back as it was; where something else has since replaced it
        (and may call this one), this one only stops checking."""
        self.check = None
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
