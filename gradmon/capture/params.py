"""The monitored parameters, and their post-accumulate-grad hooks while those are wanted.

Parameters are held by (module, attribute name), never by reference: a parameter replaced
after attach (a new ``nn.Parameter``, ``load_state_dict(assign=True)``, an entry written into
the module's parameter dict directly) is measured in place of the old one, and the old one can
be freed. Each step reads the modules' parameter dicts, kept while the modules live, and
re-reads the modules themselves every few dozen reads (a module given a new dict as a whole).

Per-parameter hooks find the end of a backward that passed through no output gradmon saw (a
forward of a deeper submodule), and record LOCAL_GRAD. They cost a Python call per parameter
per backward, so once a step shows every backward passing through the root's output (or a
top-level block's, called alone) they are removed; a step whose gradients came from a
backward gradmon did not see (measured at the optimizer step) brings them back for good.

Removed must mean gone: a parameter's own post-accumulate-grad hook leaves its C++ caller on
the parameter for good, which takes the interpreter lock in every later backward, once per
parameter, to find no hook. So the hooks that are likely to go (those of the first steps,
until one shows its backward through an output gradmon watches) are put on the parameters'
gradient accumulators instead (autograd's AccumulateGrad nodes, which run once the gradient
is accumulated), held by gradmon while hooked: once dropped, and the backward's graph freed,
a node goes, and the next forward makes a fresh one with nothing on it. They are dropped as
the root's training forward begins (its output will be watched), before the graph links
to them: a node kept from before a change of its parameter's storage (FSDP's, DeepSpeed's)
must not join a graph. The hooks meant to stay (LOCAL_GRAD's, whose must run before DDP's
reducer takes the gradient; sharded parameters'; after a backward gradmon did not see) go on
the parameters themselves.
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from operator import attrgetter
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .layers import Layer

log = logging.getLogger("gradmon")


class AccumulatorHook:
    """``fn(p)`` after autograd accumulated ``p``'s gradient, from a hook on ``p``'s gradient
    accumulator, which is held (and so reused by every forward) until :meth:`remove`."""

    __slots__ = ("_ref", "_after", "_node", "_handle")

    def __init__(self, p: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
        ref = self._ref = weakref.ref(p)  # the node holds the parameter; the hook holds neither

        def after_accumulated(grad_inputs: Any, grad_outputs: Any) -> None:
            param = ref()
            if param is not None:
                fn(param)
        self._after = after_accumulated
        self._node = torch.autograd.graph.get_gradient_edge(p).node
        self._handle = self._node.register_hook(after_accumulated)

    def follow(self) -> None:
        """Move to the accumulator autograd uses now, if torch replaced the one held (it does
        when a parameter's storage moves to another dtype or device: ``.to()``)."""
        p = self._ref()
        if p is None:
            return
        node = torch.autograd.graph.get_gradient_edge(p).node
        if node is not self._node:
            self._handle.remove()
            self._node, self._handle = node, node.register_hook(self._after)

    def remove(self) -> None:
        self._handle.remove()
        self._node = None


def hook_accumulated(p: torch.Tensor, fn: Callable[[torch.Tensor], None], on_param: bool) -> Any:
    """A removable hook calling ``fn(p)`` once autograd accumulated ``p``'s gradient: on the
    parameter itself with ``on_param``, where ``p`` is no leaf (it has no accumulator) and
    where it holds no elements now (its storage is elsewhere between forwards, as DeepSpeed's
    ZeRO-3 keeps it: an accumulator made now would expect the empty size); else on its
    accumulator (:class:`AccumulatorHook`)."""
    if on_param or not p.is_leaf or p.numel() == 0:
        return p.register_post_accumulate_grad_hook(fn)
    return AccumulatorHook(p, fn)


_REQUIRES_GRAD = attrgetter("requires_grad")
_REREAD = 64
"""Reads of the parameters from the modules' parameter dicts kept between two reads through
the modules themselves (which notice a module given a new dict as a whole)."""


class ParamSlots:
    def __init__(self, layers: Sequence[Layer]) -> None:
        self._slots: List[Tuple[weakref.ref, str]] = []
        for layer in layers:
            names = {id(p): n for n, p in layer.module._parameters.items() if p is not None}
            ref = weakref.ref(layer.module, self._module_gone)
            self._slots += [(ref, names[id(p)]) for p in layer.params]
        self._names = [name for _, name in self._slots]
        # each slot's module's parameter dict: read each step at C level, the modules untouched
        # (a model's thousands of modules are a cache miss each right after a backward); dropped
        # when a module goes, so that a model deleted while monitored frees its parameters
        self._dicts: Optional[List[Any]] = None
        self._reads = 0
        self.param_layer: Tuple[int, ...] = tuple(layer.index for layer in layers for _ in layer.params)
        """The layer of each parameter, in slot order."""
        self.hooked = True
        """Whether each parameter carries a post-accumulate-grad hook (decided per step:
        :meth:`next_step`)."""
        self._unseen = False  # a step had gradients from a backward gradmon did not see
        self._step_seen = False  # this step's gradients were measured at the end of a seen backward
        self._known: List[Optional[weakref.ref]] = []  # the parameters as last seen
        self._hooks: List[Any] = []
        self.lasting = False
        """Hook the parameters themselves, not their accumulators, from the first
        :meth:`sync` on: for LOCAL_GRAD, and for sharded parameters."""
        self._on_params = False  # whether the hooks held are the parameters' own

    def current(self) -> List[Optional[torch.Tensor]]:
        """The monitored parameters as the modules hold them now (None: gone, or frozen):
        whatever a module's parameter dict holds under the name, however it got there."""
        self._reads += 1
        dicts = self._dicts  # once: a module's death may drop them from another thread
        if dicts is None or self._reads % _REREAD == 0:
            dicts = self._dicts = self._module_dicts()
        try:
            got = list(map(dict.get, dicts, self._names))  # type: ignore[arg-type]
        except TypeError:  # a module is gone (None), or its parameters are no dict
            self._dicts = None
            return [p if (p := (m._parameters.get(name) if (m := ref()) is not None else None)) is not None
                    and p.requires_grad else None for ref, name in self._slots]
        try:
            if all(map(_REQUIRES_GRAD, got)):
                return got
        except AttributeError:  # a None: a parameter deleted or set to None
            pass
        return [p if p is not None and p.requires_grad else None for p in got]

    def _module_dicts(self) -> Optional[List[Any]]:
        modules = [ref() for ref, _ in self._slots]
        if any(m is None for m in modules):
            return None
        return [m._parameters for m in modules]

    def _module_gone(self, _ref: Any) -> None:
        self._dicts = None

    def sync(self, params: List[Optional[torch.Tensor]], on_grad: Callable[[int, torch.Tensor], None]) -> bool:
        """Notice parameters replaced since last time (``params``: :meth:`current`) and keep
        ``on_grad(slot, p)`` hooked on the current ones while :attr:`hooked`; True if any
        parameter changed (always, the first time)."""
        changed = not (len(self._known) == len(params) and all(
            (r is None and p is None) or (r is not None and r() is p) for r, p in zip(self._known, params)))
        if changed and self._known:
            log.warning("gradmon: monitored parameters were replaced after attach (new nn.Parameter or "
                        "load_state_dict(assign=True)); measuring the new ones")
        on_params = self.lasting or self._unseen
        if changed or (self._hooks and self._on_params != on_params):
            self.remove_hooks()
        if changed:
            self._known = [weakref.ref(p) if p is not None else None for p in params]
        if self.hooked and not self._hooks:
            self._hooks = [hook_accumulated(p, partial(on_grad, i), on_params)
                           for i, p in enumerate(params) if p is not None]
            self._on_params = on_params
        elif not self.hooked and self._hooks:
            self.remove_hooks()
        return changed

    def root_forward(self) -> None:
        """The root's training forward begins: its backward will be seen, so the
        accumulators' hooks go now, before the forward's graph links to them (a
        :meth:`sync` brings them back while still :attr:`hooked`)."""
        if self._hooks and not self._on_params:
            self.remove_hooks()

    def outside_root(self) -> None:
        """A training forward outside the root's (the loop calls a submodule) reached a
        layer: the accumulators' hooks follow any accumulator torch replaced since they were
        put on (a model moved to another dtype or device after attach), so that this
        backward's end is still found."""
        if self._hooks and not self._on_params:
            for hook in self._hooks:
                if isinstance(hook, AccumulatorHook):
                    hook.follow()

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
        self._dicts = None

    def __len__(self) -> int:
        return len(self._slots)
