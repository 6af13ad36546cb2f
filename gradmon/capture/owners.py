"""Which optimizers step the monitored parameters.

The optimizer step hooks are global: they run for every optimizer in the process, this
monitor's or not. The first optimizer found stepping monitored parameters is the one that
measures gradients at the step when no backward did, so that a second optimizer over the
same model does not count the step twice.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch


class Owners:
    def __init__(self, params: Callable[[], Sequence[Optional[torch.Tensor]]]) -> None:
        self._params = params
        # id(optimizer) -> (weakref, mine): keyed by id with a weak reference, never by hash:
        # an optimizer class may define __eq__ and be unhashable
        self._owned: Dict[int, Tuple[weakref.ref, bool]] = {}
        self._primary: Optional[weakref.ref] = None

    def owns(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` steps monitored parameters (decided once per optimizer)."""
        known = self._owned.get(id(opt))
        if known is not None and known[0]() is opt:
            return known[1]
        ids = {id(p) for p in self._params() if p is not None}
        mine = any(id(p) in ids for g in opt.param_groups for p in g["params"])
        self._owned[id(opt)] = (weakref.ref(opt), mine)
        if mine and (self._primary is None or self._primary() is None):
            self._primary = weakref.ref(opt)
        return mine

    def primary(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` is the first optimizer found stepping monitored parameters (still alive)."""
        return self._primary is not None and self._primary() is opt

    def forget(self) -> None:
        """The parameters were replaced: every optimizer is asked again."""
        self._owned.clear()
        self._primary = None
