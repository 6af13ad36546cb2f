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

A branch is a fence in the graph: its operands must exist as buffers, kernels on its two
sides do not fuse, and the partitioner changes what it saves for the backward (a branch
after each layer of a transformer block had the forward compute GELU's derivative). So the
layers of one top-level block share one branch, made where the block returns (at the
block's record), and the kernels inside a block are fused as they would be unmonitored.
Where there is no block record (no block statistic), or the block is not traced with its
layers, each layer has its own branch, made at once: outputs kept longer would hold
memory Inductor reuses, and a list left waiting between compiled regions would be
guarded on.

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import statistics as S
from ..statistics import Statistic
from .layers import is_floating
from .modelhooks import BlockForward
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
        # the layers' records whose detail statistics wait for their block's branch: each
        # layer call's module and its records, and the detail statistics still to make
        self._waiting: List[Tuple[nn.Module, _Made, List[_Detail]]] = []

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
        """Traced: the records of ``values`` made at a ``kind`` hook, left on ``module``. A
        layer's detail statistics wait for the next block or root record, where one branch
        makes those of every layer waiting: where there are block records and the layer ran
        inside a top-level block traced in the same region (a layer compiled by itself
        makes its own)."""
        made, detail = _records(self._stats[kind], values)
        if kind == LAYER and detail and self._stats[BLOCK] and _inside_a_block() and not _replayed_as_graphs():
            # a clone, not the output itself: what the block later does to the output in place
            # (a ReLU(inplace=True) after the layer) would show through an alias when the branch
            # reads it; in the compiled graph the clone is the output's value as the layer
            # returned it, and Inductor drops a clone of a tensor of the same layout as a no-op
            self._waiting.append((module, made, [(sts, x.clone(), by_name) for sts, x, by_name in detail]))
            return
        if kind != LAYER:
            self._settle(self._gate)
        _on_detail_steps(detail, self._gate)
        setattr(module, self._attr[kind], made)

    def _settle(self, gate: Optional[torch.Tensor], detail: bool = True) -> None:
        """The waiting layers' detail statistics, made in one branch on ``gate`` (traced),
        or on the host at once where ``gate`` is None (what a compiled region left waiting,
        the next record being outside it: made on a detail step only, ``detail``); their
        records left on their modules."""
        if not self._waiting:
            return
        waiting = list(self._waiting)
        self._waiting.clear()
        if detail:
            _on_detail_steps([entry for _, _, entries in waiting for entry in entries], gate)
        for module, made, _ in waiting:
            setattr(module, self._attr[LAYER], made)

    def take(self, records: StepRecords, detail: bool) -> bool:
        """Host: every record a compiled hook left, into ``records`` (pending, committed
        like the eager hooks' own), the detail statistics' only on a detail step; each is
        taken once. Whether there was any. Records are folded in key order here; the
        origin is decided by key, not by arrival."""
        self._settle(None, detail)  # a compiled region that ended between a layer and its block
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
# detail statistics still to make of one tensor, and the records (by name) they go into
_Detail = Tuple[Sequence[Statistic], torch.Tensor, Dict[str, Tuple[torch.Tensor, ...]]]


def _records(statistics: Sequence[Statistic], values: Any) -> Tuple[_Made, List[_Detail]]:
    """Each statistic's record of each floating-point tensor among ``values``, as the
    eager hooks make them (``Statistic.record``: the kernels take their compiled branch),
    and the detail statistics left to make (:func:`_on_detail_steps`)."""
    made, detail = [], []
    for t in iter_tensors(values):
        if not is_floating(t) or t.numel() == 0:
            continue
        x = t.detach()
        wanted = [st for st in statistics if st.dtypes is None or t.dtype in st.dtypes]
        by_name = {st.name: tuple(st.record(x)) for st in wanted if not st.detail}
        later = [st for st in wanted if st.detail]
        if later:
            detail.append((later, x, by_name))
        made.append((t.numel(), by_name))
    return tuple(made), detail


def _on_detail_steps(detail: Sequence[_Detail], gate: Optional[torch.Tensor]) -> None:
    """Each entry's statistics of its tensor, into its records by name, all made in one
    branch taken where ``gate`` holds True, tensors of the same shapes left unwritten
    otherwise (the host drops them); made at once where ``gate`` is None or the region is
    replayed as CUDA graphs. The branches must agree on their outputs' shapes
    and dtypes: read from a call made at trace time whose results nothing uses, so the
    compiler drops its work (tests/test_compile.py checks that the generated code reduces
    nothing outside the branch)."""
    if not detail:
        return

    def each(xs: Sequence[torch.Tensor]) -> List[List[Tuple[torch.Tensor, ...]]]:
        return [[tuple(st.record(x)) for st in statistics] for (statistics, _, _), x in zip(detail, xs)]

    def made(*xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(part for records in each(xs) for record in records for part in record)

    xs = tuple(x for _, x, _ in detail)
    shaped = each(xs)  # outside a branch: the records themselves, or their shapes' pattern
    if gate is not None and not _replayed_as_graphs():
        # plain tuples: a torch.Size of symbolic sizes (dynamic shapes) cannot enter a branch
        like = [(tuple(part.shape), part.dtype) for records in shaped for record in records for part in record]

        def blank(*xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
            # never read (the gate and the host's detail flag are set together, and the host
            # takes detail records on detail steps only): left unwritten, where zeros would
            # cost a kernel per layer on every ordinary step
            return tuple(xs[0].new_empty(shape, dtype=dtype) for shape, dtype in like)

        flat = iter(torch.cond(gate, made, blank, xs))
        shaped = [[tuple(next(flat) for _ in record) for record in records] for records in shaped]
    for (statistics, _, by_name), records in zip(detail, shaped):
        by_name.update((st.name, record) for st, record in zip(statistics, records))


_BLOCK_CALL = BlockForward.__call__.__code__
_BLOCK_LINES = frozenset(line for _, _, line in _BLOCK_CALL.co_lines() if line is not None)


@torch._dynamo.assume_constant_result
def _inside_a_block() -> bool:
    """Run at trace time, its answer a constant (no guard): whether the code being traced
    runs inside a top-level block's forward (:class:`BlockForward`), so that the block's
    record follows in the same compiled region and settles the layers waiting. Where the
    layer is compiled by itself, a list left waiting between regions would be guarded on
    at the next one's entry, and compile it again. Read from dynamo's stack of traced
    frames; where it is not as expected, each layer makes its own branch."""
    try:
        from torch._guards import TracingContext

        return any(frame.filename == _BLOCK_CALL.co_filename and frame.lineno in _BLOCK_LINES
                   for frame in TracingContext.extract_stack())
    except Exception:  # noqa: BLE001 - internals moved: a branch per layer, as before
        return False


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
