"""The forward hooks' records inside a compiled region (``torch.compile``).

There the hooks are traced into the model's graph, so what they do must be tensor work
the compiler keeps, and nothing it would turn into a guard or a graph break: no Python
flag that changes from step to step is read (a flag that flips becomes a guard, and the
model is compiled again each time it does), no host read, no timer, no try/except, no
``register_hook``. What the eager hooks record on every step (the blocks' extremes, which
name a NaN's origin on the step it happens) is recorded on every step, and Inductor fuses
it into one pass over the output or into the kernel that produced it. What they record
only on detail steps (``detail_every``: activation norm, extremes, counts, the kurtosis
sample) is made under a branch (``torch.cond``) on a one-element bool tensor, the gate,
that the host sets between steps (:meth:`TracedSlots.arm`): a tensor's value is not
guarded on, so flipping it recompiles nothing, and the compiled code skips the branch's
reductions on the other steps. The gate lives on the CPU whatever the model's device:
Inductor reads a branch's predicate on the host, and a CPU one costs no device sync. A
region replayed as CUDA graphs cannot hold a branch: there the detail statistics are made
on every step (:func:`_replayed_as_graphs`).

Records are stored as an attribute of the module the hook ran on: a store of a value the
compiled code never reads is replayed after the graph runs and guarded on nothing, and it
names no layer index, so the identical blocks of a model compiled block by block share one
compiled graph. The host takes them (:meth:`TracedSlots.take`) after the forward, at the
end of backward or of the step; on other steps than detail steps the gated records are
left unwritten, and dropped.

A module holds one call's records: a layer called several times in one forward, or one
model's several forwards before a backward, keeps its last call's (docs/limits.md).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from .. import statistics as S
from ..statistics import Statistic
from .layers import is_floating
from .records import StepRecords, iter_tensors

log = logging.getLogger("gradmon")

HOOKS_COMPILED_OUT = (
    "torch.compile does not guard on hooks (torch._dynamo.config.skip_nnmodule_hook_guards): the model was "
    "compiled before attach(), or another instance of its class was compiled without gradmon (before or after "
    "it), and that code runs without gradmon's hooks. Gradient norms and non-finite counts are measured; "
    "activations and the per-block NaN origin are not. Attach before the first compiled call, and set "
    "torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling where the process compiles "
    "several instances of the class (hooks are then guarded); or call torch._dynamo.reset() after attach() "
    "(every compiled function is compiled again, once). "
    "See docs/integrations.md#torchcompile.")
"""What to do when gradmon's hooks were compiled out of a model."""

INPUT, BLOCK, LAYER, OUTPUT = "input", "block", "layer", "output"
"""Where a compiled hook ran: the root's pre-hook (its input), a top-level block, a
layer, the root's hook (its output)."""


class TracedSlots:
    """Where one monitor's compiled hooks leave their records: an attribute per kind of
    hook on each module (named for the monitor, so that two monitors of one module keep
    theirs apart), and the record key each stands for."""

    def __init__(self, statistics: Sequence[Statistic], tag: str) -> None:
        self._stats = {kind: tuple(st for st in statistics if st.at in moments)
                       for kind, moments in ((INPUT, (S.BLOCK,)), (BLOCK, (S.BLOCK,)), (OUTPUT, (S.BLOCK,)),
                                             (LAYER, (S.OUTPUT, S.LAYER)))}
        self._attr = {kind: f"_gradmon_{tag}_{kind}" for kind in self._stats}
        self._detail = {st.name: st.detail for st in statistics}
        # the gate of the detail statistics' branch: a tensor, so that the compiled code reads
        # its value where a Python bool would be guarded on (the first step is a detail step)
        self._gate = torch.ones((), dtype=torch.bool)
        self._armed = True  # what the gate holds: written only when it changes (a step's fixed cost)
        self._slots: List[Tuple["weakref.ref[nn.Module]", str, int]] = []  # (module, its attribute, key)
        self._told = False  # the warning that the layers' hooks were compiled out

    def watch(self, module: nn.Module, kind: str, key: int) -> None:
        """At attach: ``module``'s ``kind`` hook records under ``key``."""
        if self._stats[kind]:
            self._slots.append((weakref.ref(module), self._attr[kind], key))

    def wants(self, kind: str) -> bool:
        return bool(self._stats[kind])

    def arm(self, detail: bool) -> None:
        """Host, between steps: whether the next step's compiled hooks make the detail
        statistics' records (a write to a CPU tensor: no device work, no recompile)."""
        if detail != self._armed:
            self._gate.fill_(detail)
            self._armed = detail

    def record(self, module: nn.Module, kind: str, values: Any) -> None:
        """Traced: the records of ``values`` made at a ``kind`` hook, left on ``module``."""
        setattr(module, self._attr[kind], _records(self._stats[kind], values, self._gate))

    def take(self, records: StepRecords, detail: bool) -> bool:
        """Host: every record a compiled hook left, into ``records`` (pending, committed
        like the eager hooks' own), the detail statistics' only on a detail step; each is
        taken once. Whether there was any. Records are folded in key order here; the
        origin is decided by key, not by arrival."""
        filled, layers = False, False
        for ref, attr, key in self._slots:
            module = ref()
            made = module.__dict__.pop(attr, None) if module is not None else None
            if made is None:
                continue
            filled = True
            layers = layers or attr == self._attr[LAYER]
            for numel, by_name in made:
                for name, parts in by_name.items():
                    if detail or not self._detail[name]:
                        records.by_name[name].add(key, numel, parts)
        if filled and not layers and self._stats[LAYER] and not self._told:
            self._told = True
            log.warning("gradmon: the compiled model ran gradmon's hooks on the root module but on none of its "
                        "layers. %s", HOOKS_COMPILED_OUT)
        return filled


_Made = Tuple[Tuple[int, Dict[str, Tuple[torch.Tensor, ...]]], ...]  # each tensor's (numel, records by name)


def _records(statistics: Sequence[Statistic], values: Any, gate: torch.Tensor) -> _Made:
    """Each statistic's record of each floating-point tensor among ``values``, as the
    eager hooks make them (``Statistic.record``: the kernels take their compiled branch);
    the detail statistics' only where ``gate`` holds True (:func:`_on_detail_steps`)."""
    made = []
    for t in iter_tensors(values):
        if not is_floating(t) or t.numel() == 0:
            continue
        x = t.detach()
        wanted = [st for st in statistics if st.dtypes is None or t.dtype in st.dtypes]
        by_name = {st.name: tuple(st.record(x)) for st in wanted if not st.detail}
        by_name.update(_on_detail_steps([st for st in wanted if st.detail], x, gate))
        made.append((t.numel(), by_name))
    return tuple(made)


def _on_detail_steps(statistics: Sequence[Statistic], x: torch.Tensor, gate: torch.Tensor
                     ) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """The records of ``statistics`` of ``x`` made in one branch taken where ``gate`` holds
    True, tensors of the same shapes left unwritten otherwise (the host drops them). The branches must agree
    on their outputs' shapes and dtypes: read from a call made at trace time whose results
    nothing uses, so the compiler drops its work (tests/test_compile.py checks that the
    generated code reduces nothing outside the branch)."""
    if not statistics:
        return {}

    def made(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(part for st in statistics for part in st.record(x))

    # plain tuples: a torch.Size of symbolic sizes (dynamic shapes) cannot enter a branch
    like = [[(tuple(part.shape), part.dtype) for part in st.record(x)] for st in statistics]

    def blank(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        # never read (the gate and the host's detail flag are set together, and the host takes
        # detail records on detail steps only): left unwritten, where zeros would cost a kernel
        # per layer on every ordinary step
        return tuple(x.new_empty(shape, dtype=dtype) for parts in like for shape, dtype in parts)

    flat = iter(made(x) if _replayed_as_graphs() else torch.cond(gate, made, blank, (x,)))
    return {st.name: tuple(next(flat) for _ in parts) for st, parts in zip(statistics, like)}


@torch._dynamo.assume_constant_result
def _replayed_as_graphs() -> bool:
    """Run at trace time, its answer a constant (no guard): whether the backend compiling
    this region replays it as CUDA graphs (``mode="reduce-overhead"`` or ``"max-autotune"``,
    or Inductor's ``triton.cudagraphs`` set). Inductor records no graph that holds a
    ``torch.cond`` as a CUDA graph (it runs the whole region without them), so there the
    detail statistics are made on every step, ungated, and the host drops them between
    detail steps: a few fused reductions, where a skipped graph would cost the job the
    mode's whole gain. Read from dynamo's internals; where they are not as expected, the
    gated branch is kept."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._inductor import config

        backend = InstructionTranslator.current_tx().output.compiler_fn
        for _ in range(8):  # dynamo's wrappers, down to the one that carries the mode's options
            if hasattr(backend, "get_compiler_config"):
                options = backend.get_compiler_config() or {}
                return bool(options.get("triton.cudagraphs", config.triton.cudagraphs))
            backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        return False
    except Exception:  # noqa: BLE001 - internals moved: the gated branch, as before
        return False
