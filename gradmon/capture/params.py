"""The monitored parameters, and their post-accumulate-grad hooks while those are wanted.

Parameters are held by (module, attribute name), never by reference: a parameter replaced
after attach (a new ``nn.Parameter``, ``load_state_dict(assign=True)``) is measured in place
of the old one, and the old one can be freed.

Per-parameter hooks find the end of a backward that passed through no output gradmon saw (a
forward of a deeper submodule), and record LOCAL_GRAD. They cost a Python call per parameter
per backward, so once a step shows every backward passing through the root's output (or a
top-level block's, called alone) they are removed; a step whose gradients came from a
backward gradmon did not see (measured at the optimizer step) brings them back for good.
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .layers import Layer

log = logging.getLogger("gradmon")


class ParamSlots:
    def __init__(self, layers: Sequence[Layer]) -> None:
        self._slots: List[Tuple[weakref.ref, str]] = []
        for layer in layers:
            names = {id(p): n for n, p in layer.module._parameters.items() if p is not None}
            self._slots += [(weakref.ref(layer.module), names[id(p)]) for p in layer.params]
        self.param_layer: Tuple[int, ...] = tuple(layer.index for layer in layers for _ in layer.params)
        """The layer of each parameter, in slot order."""
        self.hooked = True
        """Whether each parameter carries a post-accumulate-grad hook (decided per step:
        :meth:`next_step`)."""
        self._unseen = False  # a step had gradients from a backward gradmon did not see
        self._step_seen = False  # this step's gradients were measured at the end of a seen backward
        self._known: List[Optional[weakref.ref]] = []  # the parameters as last seen
        self._hooks: List[Any] = []

    def current(self) -> List[Optional[torch.Tensor]]:
        """The monitored parameters as the modules hold them now (None: gone, or frozen)."""
        return [p if (p := (m._parameters.get(name) if (m := ref()) is not None else None)) is not None
                and p.requires_grad else None for ref, name in self._slots]

    def sync(self, params: List[Optional[torch.Tensor]], on_grad: Callable[[int, torch.Tensor], None]) -> bool:
        """Notice parameters replaced since last time (``params``: :meth:`current`) and keep
        ``on_grad(slot, p)`` hooked on the current ones while :attr:`hooked`; True if any
        parameter changed (always, the first time)."""
        changed = not (len(self._known) == len(params) and all(
            (r is None and p is None) or (r is not None and r() is p) for r, p in zip(self._known, params)))
        if changed and self._known:
            log.warning("gradmon: monitored parameters were replaced after attach (new nn.Parameter or "
                        "load_state_dict(assign=True)); measuring the new ones")
        if changed:
            self.remove_hooks()
            self._known = [weakref.ref(p) if p is not None else None for p in params]
        if self.hooked and not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(partial(on_grad, i))
                           for i, p in enumerate(params) if p is not None]
        elif not self.hooked and self._hooks:
            self.remove_hooks()
        return changed

    def measured(self, seen: bool) -> None:
        """This step's gradients were measured at the end of a backward gradmon ``seen`` (or not)."""
        self._step_seen = seen

    def measured_unseen(self) -> None:
        """This step's gradients came from a backward gradmon did not see: hooks for good."""
        self._unseen = True

    def next_step(self, wanted: bool) -> None:
        """Whether the next step's parameters carry hooks (:meth:`sync` adds or removes
        them); ``wanted``: hooked whatever the backwards were (LOCAL_GRAD, torch.compile)."""
        self.hooked = self._unseen or wanted or (self.hooked and not self._step_seen)
        self._step_seen = False

    def remove_hooks(self) -> None:
        handles, self._hooks = self._hooks, []
        for h in handles:
            h.remove()

    def release(self) -> None:
        """Hold nothing of the model any more (after detach)."""
        self.remove_hooks()
        self._known = []

    def __len__(self) -> int:
        return len(self._slots)
