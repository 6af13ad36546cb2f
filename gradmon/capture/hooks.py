"""The hooks: everything gradmon does on the training thread.

* Forward hooks on each layer record activation statistics and, for gradient flow,
  put a tensor hook on the layer's output. Tensor hooks rather than
  ``register_full_backward_hook``: a full backward hook wraps the output in a
  BackwardHookFunction, so an in-place op on it (``ReLU(inplace=True)`` after a
  Conv/BN, as in torchvision's ResNet) raises inside the user's forward, and under
  ``torch.compile`` one module backward hook makes the whole model run eagerly. A
  tensor hook registered before an in-place op receives the gradient of the value the
  layer returned, which is exactly gradient flow, and covers the same layers.
* The first hook of a backward pass (a tensor hook on the root module's output, or on a
  top-level block's output when that block is called alone, or a monitored parameter's
  post-accumulate-grad hook) queues one end-of-backward callback for that pass,
  identified by its graph task: a pass that raised never runs its callback, and the next
  one must not be mistaken for it. The callback re-queues itself once so that it runs
  after the callbacks DDP and FSDP queue during backward (their gradient reduction
  finishes there). It then reduces every parameter gradient: the accumulated, reduced
  gradient, before any ``clip_grad_norm_`` the user calls between backward and step,
  whichever module's forward the user called. The per-parameter hooks are a Python call
  per parameter per backward: they stay only while a backward may come that no watched
  output sees (until a step shows otherwise, and for good once a step's gradients came
  from such a backward), or where LOCAL_GRAD reads each gradient in them.
* Global optimizer step hooks close the step: one packet, one device-to-host copy.
  Before it is closed, the post-step hook reads the learning rates and, on sampled
  steps, what the optimizer did (``optimizer.read``: the OPTIMIZER moment).

Between detail steps (``detail_every``) the layers' forward hooks are not registered at
all (a hooked module leaves PyTorch's fast call path); the hooks on the root module and
its top-level blocks check their values every step (where a NaN entered), the blocks' small
outputs all at once when the root's forward returns (:class:`BlockChecks`). An ordinary
step thus enters Python once per block and a few times per step, never per layer or per
parameter (``tests/test_host_cost.py``). Nothing here reads a device value on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import amp, optimizer, sharded, writer
from .boundary import Event, StepBoundary
from .guard import Guards
from .loss import LossMean
from .owners import Owners
from .params import ParamSlots
from . import kernels as stats
from .. import statistics as S
from ..config import Config
from ..errors import ErrorLog
from .layers import Layer, is_floating
from .packet import GlobalStepUpdate, RowBlock, StepPacket
from ..statistics import Statistic

log = logging.getLogger("gradmon")


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a module output: tensors, tuples/lists (LSTM), dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth > 4 or obj is None:
        return
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item, _depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), _depth + 1)


def _fake_type() -> Optional[type]:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return FakeTensor


def measurable(t: torch.Tensor) -> Tuple[Optional[torch.Tensor], str]:
    """(the tensor to measure, "") for a floating-point output or gradient, or (None, what
    it is) when it has no values gradmon can reduce: a meta or fake tensor has none, a
    nested tensor has no kernel for the reductions, a DTensor that is not replicated holds
    only part of the value here (a replicated one is measured through its local copy).
    Such a tensor costs its own record, never the step's other records."""
    if t.is_meta:
        return None, "a meta tensor"
    if t.is_nested:
        return None, "a nested tensor"
    if type(t) is torch.Tensor:
        return t, ""
    fake = _fake_type()
    if fake is not None and isinstance(t, fake):
        return None, "a FakeTensor"
    if sharded.is_sharded(t):
        if all(p.is_replicate() for p in t.placements):
            return t.to_local(), ""
        return None, f"a DTensor placed {tuple(t.placements)}"
    return t, ""


def _recomputed_twice() -> bool:
    """A forward that activation checkpointing re-runs inside backward, whose original
    was already measured. Non-reentrant checkpointing ran the original with grad
    enabled (measured): skip the re-run. Reentrant checkpointing ran the original under
    no_grad (skipped as an eval forward): its re-run, inside CheckpointFunctionBackward,
    is the only training forward there is, so it is measured once, there."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ != "CheckpointFunctionBackward"


def _compiling() -> bool:
    # Under torch.compile the per-layer hooks are traced into the graph; a Python flag
    # read there (detail_now) becomes a guard that recompiles every time it flips, and
    # register_hook breaks the graph. So inside a compiled region they do nothing:
    # dynamo folds this check to True and traces an empty hook.
    return torch.compiler.is_compiling()


RAW_BUDGET = 2 ** 22
"""Elements of raw material (see ``Statistic.combine``) one statistic holds before it is
combined into rows early: a recurrent cell called a thousand times in one forward must not
keep a thousand 64 KB samples alive until the forward returns."""


KEEP_SCRATCH_EVERY = 4
"""Largest ``detail_every`` at which the recorder keeps its scratch memory between steps."""


class _Records:
    """The records one statistic made in the current step.

    Records become part of the step only when what produced them completed: a forward
    that raised, or a backward that raised (KeyboardInterrupt, OOM), must not leak its
    partial statistics into the next step. ``commit()`` marks the records so far as
    complete; ``drop_pending()`` forgets the rest. Keyed records (one per parameter)
    replace that key's earlier record: the latest holds every micro-batch so far. A
    statistic with ``combine`` records raw material, turned into its rows (all pending
    records at once) when committed or when :data:`RAW_BUDGET` elements are waiting."""

    __slots__ = ("keyed", "done", "pending", "combine", "scratch", "raw", "raw_elements", "rows", "pending_rows")

    def __init__(self, keyed: bool, combine: Optional[Callable[..., torch.Tensor]] = None,
                 scratch: Optional[stats.Scratch] = None) -> None:
        self.keyed = keyed
        self.combine = combine
        self.scratch = scratch if scratch is not None else stats.Scratch()  # this step's only
        self.done: Dict[Any, Tuple[int, int, Sequence[torch.Tensor]]] = {}  # insertion order
        self.pending: List[Tuple[int, int, Sequence[torch.Tensor]]] = []
        self.raw: List[int] = []  # positions in pending still holding raw material
        self.raw_elements = 0
        self.rows: List[_Rows] = []  # committed records made many at once
        self.pending_rows: List[_Rows] = []

    def add(self, key: int, numel: int, parts: Sequence[torch.Tensor]) -> None:
        self.pending.append((key, numel, parts))
        if self.combine is not None:
            self.raw.append(len(self.pending) - 1)
            self.raw_elements += parts[0].numel()
            if self.raw_elements > RAW_BUDGET:
                self._combine()

    def add_rows(self, keys: Sequence[int], numels: Sequence[int], parts: Sequence[torch.Tensor]) -> None:
        """Records of many tensors at once: ``parts`` are (n, width) blocks whose row j is
        the record of ``keys[j]`` (not for keyed or combined statistics)."""
        self.pending_rows.append((tuple(keys), tuple(numels), tuple(parts)))

    def _combine(self) -> None:
        if not self.raw:
            return
        raw = [self.pending[i] for i in self.raw]
        rows = self.combine([r[2][0] for r in raw], [r[1] for r in raw], raw[0][2][0].device, self.scratch)
        for i, row in zip(self.raw, rows.unbind(0)):
            key, numel, _ = self.pending[i]
            self.pending[i] = (key, numel, (row,))
        self.raw, self.raw_elements = [], 0

    def commit(self) -> None:
        self._combine()
        for record in self.pending:
            self.done[record[0] if self.keyed else len(self.done)] = record
        self.pending = []
        self.rows.extend(self.pending_rows)
        self.pending_rows = []

    def drop_pending(self) -> None:
        self.pending = []
        self.pending_rows = []
        self.raw, self.raw_elements = [], 0

    def keys(self) -> List[int]:
        """Keys of the committed records, in the order the packet carries them."""
        return [key for key, _, _ in self.committed()] + [key for keys, _, _ in self.rows for key in keys]

    def committed(self) -> List[Tuple[int, int, Sequence[torch.Tensor]]]:
        records = list(self.done.values())
        return sorted(records, key=lambda r: r[0]) if self.keyed else records


_Rows = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[torch.Tensor, ...]]  # keys, numels, (n, width) parts


DEFER_MAX = 2 ** 14
"""Largest top-level block output (elements) whose non-finite check waits for the end of
the forward, to be made with every other one in a few kernels (``stats.extremes_many``).
A larger one is checked in its hook: its kernel costs more than the hook's Python, and
holding it until the end of the forward could keep alive memory that the forward (or
activation checkpointing) would have freed."""


class BlockChecks:
    """The ordinary step's non-finite check of the top-level blocks' outputs, batched.

    A small plain tensor returned by a block is kept, with its version counter, until the
    root's forward returns; then all are checked at once. A later in-place op on it (a
    ``ReLU(inplace=True)`` sibling, a residual ``+=`` in the root) would make the check
    read a value the block never returned: a block is deferred only once one forward
    showed its output unchanged at the end (until then its hook checks it at once), and a
    deferred output found changed loses that record and goes back to being checked in its
    hook. Holds no tensor between forwards."""

    __slots__ = ("waiting", "probing", "settled")

    def __init__(self) -> None:
        self.waiting: List[Tuple[int, torch.Tensor, int]] = []  # (block key, output, its version then)
        self.probing: List[Tuple[int, torch.Tensor, int]] = []  # checked in the hook, watched for a change
        self.settled: set = set()  # block keys whose outputs may wait

    @staticmethod
    def plain(t: Any) -> bool:
        """A tensor whose check may wait: a small dense floating-point torch.Tensor with values."""
        return (type(t) is torch.Tensor and t.is_floating_point() and t.layout == torch.strided
                and not t.is_meta and not t.is_nested and 0 < t.numel() <= DEFER_MAX)

    def defer(self, key: int, t: Any) -> bool:
        """Keep ``t`` for the end of the forward; False when its hook must check it now: it
        is no :meth:`plain` tensor, or not yet known to stay unchanged (it is then watched,
        to learn whether it may wait next time)."""
        if not self.plain(t):
            return False
        if key in self.settled:
            self.waiting.append((key, t, t._version))
            return True
        self.probing.append((key, t, t._version))
        return False

    def last(self) -> Optional[Tuple[int, torch.Tensor, int]]:
        return self.waiting[-1] if self.waiting else None

    def drop(self) -> None:
        self.waiting, self.probing = [], []

    def flush(self, into: Sequence[Tuple[Statistic, "_Records"]], alias: Sequence[int] = (),
              rows: Optional["BatchRows"] = None) -> None:
        """Check the waiting outputs: one batch of rows per statistic (``record_many``) into
        its records; ``alias`` are more keys whose record is the last waiting output's (the
        root's output, when it is the last block's, unchanged). ``BLOCK_FINITE`` checks
        them by batch row, into ``rows``, where the batch is known."""
        waiting, probing = self.waiting, self.probing
        self.drop()
        for key, t, version in probing:
            if t._version == version:
                self.settled.add(key)
        kept = [entry for entry in waiting if entry[1]._version == entry[2]]
        if len(kept) < len(waiting):
            self.settled.difference_update(key for key, t, version in waiting if t._version != version)
        if not kept:
            return
        alias = alias if waiting[-1][1]._version == waiting[-1][2] else ()
        tensors = [entry[1] for entry in kept]
        every_key = [entry[0] for entry in kept]
        every_numel = list(map(torch.Tensor.numel, tensors))
        for st, records in into:
            if st is S.BLOCK_FINITE and rows is not None and rows.size is not None:
                per_row: List[Tuple[int, torch.Tensor, int]] = []
                *parts, order = stats.extremes_many(tensors, tensors[0].device, rows.size, per_row)
                rows.pending.extend((every_key[i], block, start, rows.size) for i, block, start in per_row)
            else:
                *parts, order = st.record_many(tensors, tensors[0].device)
            keys = list(map(every_key.__getitem__, order))
            numels = list(map(every_numel.__getitem__, order))
            if alias:
                at = order.index(len(kept) - 1)
                keys += alias
                numels += [numels[at]] * len(alias)
                parts = [torch.cat((part, part[at:at + 1].expand(len(alias), -1))) for part in parts]
            records.add_rows(keys, numels, parts)


class BatchRows:
    """Which batch rows of each top-level block's output went non-finite: the block check's
    per-row result (``stats.extremes``/``extremes_many`` given the batch), kept as device
    tensors for the step's packet and read on the host only at an incident (publisher
    thread). The batch is the root input's first dimension; a block output whose first
    dimension is another size has no rows, nor has any output of a forward whose batch
    cannot be told (:func:`batch_size`)."""

    __slots__ = ("size", "pending", "kept", "forwards")

    def __init__(self) -> None:
        self.size: Optional[int] = None  # rows of this forward's batch
        # (block key, block, start, size): block[start:start + size] is the [min, max] of each row
        self.pending: List[Tuple[int, torch.Tensor, int, int]] = []
        # this step's completed forwards' (micro-batches), each with its forward's index
        self.kept: List[RowBlock] = []
        self.forwards = 0

    def start(self, root: nn.Module, args: Any, kwargs: Any) -> None:
        self.pending, self.size = [], None
        self.size = batch_size(root, args, kwargs)

    def commit(self) -> None:
        self.kept.extend(RowBlock(*entry, self.forwards) for entry in self.pending)
        self.pending = []
        self.forwards += 1

    def take(self) -> Tuple[RowBlock, ...]:
        kept, self.kept, self.pending, self.forwards = tuple(self.kept), [], [], 0
        return kept


def batch_size(root: nn.Module, args: Any, kwargs: Any) -> Optional[int]:
    """The root input's batch size: the first dimension of its first tensor; None where
    it cannot be told (a packed sequence, a sequence-first recurrent root, no tensor)."""
    if isinstance(root, nn.RNNBase) and not root.batch_first:
        return None
    if any(isinstance(x, nn.utils.rnn.PackedSequence) for x in (*args, *(kwargs or {}).values())):
        return None
    first = next((t for t in iter_tensors((args, kwargs)) if t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else None


def _will_accumulate(p: torch.Tensor) -> bool:
    """Whether the running backward accumulates into ``p.grad`` (RuntimeError inside
    ``torch.autograd.grad``, which accumulates nothing)."""
    return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)


def _graph_task_id() -> int:
    """Which backward pass is running (-1 outside one). A backward that raised never runs
    its queued callbacks, so "a callback is queued" must be tied to one pass, not a flag."""
    return torch._C._current_graph_task_id()


def _empty_shard(p: Optional[torch.Tensor], flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's (empty) part of an FSDP1 parameter held wholly by other ranks, when its
    unit received a gradient in this backward."""
    if p is None or flat is None or flat.grad is None:
        return None
    return torch.zeros(0, dtype=flat.grad.dtype, device=flat.grad.device)


class Recorder:
    """Per-step state of one monitor on the training thread: device tensors and small lists.

    The hooks' entry points (``on_*``, ``observe_loss``, ``manual_step``); what they keep
    lives in units of their own: the parameters (``ParamSlots``), the optimizers that step
    them (``Owners``), the step boundary (``StepBoundary``), the loss (``LossMean``), the
    packet's writer (``writer.write``), the guard around every hook (``Guards``).
    """

    def __init__(self, layers: Sequence[Layer], cfg: Config, errors: ErrorLog,
                 publish: Callable[[object], None], statistics: Sequence[Statistic] = (S.GRAD,),
                 flat_units: Sequence[sharded.FlatUnit] = ()) -> None:
        self.cfg = cfg
        self.statistics = tuple(statistics)
        self._layer_names = tuple(layer.name for layer in layers)
        self._at: Dict[str, Tuple[Statistic, ...]] = {
            at: tuple(st for st in self.statistics if st.at == at)
            for at in (S.PARAM_GRAD, S.LOCAL_GRAD, S.OUTPUT, S.OUTPUT_GRAD, S.BLOCK, S.LAYER, S.OPTIMIZER)}
        # a record at OUTPUT that flags a layer's non-finite values (the activation statistic)
        self._output_has_extremes = any(st.origin == S.LAYER_FINITE.origin for st in self._at[S.OUTPUT])
        self.errors = errors
        self.publish = publish
        self._params = ParamSlots(layers)
        self.param_layer = self._params.param_layer
        params = self.current_params()
        self._shard_groups = sharded.plan(params, flat_units)
        self.sharded = bool(self._shard_groups)
        # FSDP1: a parameter lying wholly on other ranks has no local gradient, yet its row
        # must join the step's all-reduce for this rank to learn its norm
        flat_of = {id(p): unit.flat_param for unit in flat_units for p in unit.params}
        self._flat_of: Dict[int, weakref.ref] = {i: weakref.ref(flat_of[id(p)]) for i, p in enumerate(params)
                                                 if p is not None and id(p) in flat_of}
        # Per-parameter hooks find the end of a backward that passed through no output
        # gradmon saw (a forward of a deeper submodule), and record LOCAL_GRAD. They cost a
        # Python call per parameter per backward, so once a step shows every backward
        # passing through the root's output (or a top-level block's, called alone) they
        # are removed; a step whose gradients came from a backward gradmon did not see
        # (measured at the optimizer step) brings them back for good (self._params.hooked).
        self._unseen = False  # a step had gradients from a backward gradmon did not see
        self._step_seen = False  # this step's gradients were measured at the end of a seen backward
        self._seen_task = -2  # graph task that passed through an output gradmon watches
        self._probe: Optional[weakref.ref] = None  # the parameter that last answered _accumulates
        self._blocks = BlockChecks()
        self._rows = BatchRows()
        self._in_root = False  # inside the root's forward
        self.layer_hooks: Optional[LayerHooks] = None  # set by HookSet.install
        self._compiled = False  # a hook ran inside a compiled region: hooks stay as they are
        self._batch_blocks = all(st.record_many is not None for st in self._at[S.BLOCK])
        self._defer_blocks = False  # this step's block checks wait for the end of the forward
        self._params_now: Optional[List[Optional[torch.Tensor]]] = None  # as this step's measure saw them
        self.scaler = cfg.scaler
        self._scale: Optional[torch.Tensor] = None  # loss scale during this step's backward
        self._loss = LossMean()  # observe(loss=...) since the last step, on the device
        self._step = StepBoundary()
        self._owners = Owners(self.current_params)
        self._reads = optimizer.Reads(cfg.optimizer_sample)
        self.active = True
        self._guard = Guards(errors)
        self.steps = 0
        self.step_offset = 0
        self.detail_now = True
        self.blocks = 0  # the root module's direct children: BLOCK keys 1..blocks
        # PARAM_GRAD and OPTIMIZER statistics of this step: name -> (rows, parameter and numel of each row)
        self._batched: Dict[str, Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]] = {}
        self._learning_rates: Tuple[Any, ...] = ()  # this step's, per param group: floats or tensors
        self._unmeasured: set = set()  # kinds of output tensor skipped, already logged
        self._task = -2  # graph task whose end-of-backward callback is queued
        self._accumulated = False  # autograd accumulated a monitored gradient in this backward
        self._found_inf: Optional[torch.Tensor] = None  # a fused optimizer's overflow flag, this step
        self._last_record: Dict[str, Tuple[torch.Tensor, int, List[Tuple[Statistic, Any]]]] = {}
        # The combined statistics' temporaries, kept from one detail step to the next only
        # where those come often: on the CPU fresh pages for them cost 0.8 ms a detail step
        # on the benchmark's GPT (0.3 % with every family every step), where at the default
        # cadence keeping them would hold memory (5 MB there, up to 32 MB) for 0.02 %.
        self._scratch = stats.Scratch() if cfg.detail_every <= KEEP_SCRATCH_EVERY else None
        self._reset_records()

    @property
    def overhead(self) -> float:
        """Seconds the hooks spent on the training thread (gradmon_overhead_seconds_total)."""
        return self._guard.seconds

    def _reset_records(self) -> None:
        # OUTPUT records are complete once the root forward returned; the others once
        # their backward pass ended
        self._records: Dict[str, _Records] = {st.name: _Records(st.by_parameter, st.combine, self._scratch)
                                              for st in self.statistics if st.at not in S.BATCHED}

    def statistics_at(self, *moments: str) -> Tuple[Statistic, ...]:
        return tuple(st for at in moments for st in self._at[at])

    def _each_records(self, *moments: str) -> Iterator[_Records]:
        for at in moments:
            for st in self._at[at]:
                yield self._records[st.name]

    def current_params(self) -> List[Optional[torch.Tensor]]:
        """The monitored parameters as the modules hold them now (None: gone)."""
        return self._params.current()

    def release(self) -> None:
        """Drop every reference to the model so it can be garbage-collected after detach."""
        self.active = False
        self._params.release()
        self._batched = {}
        self._scratch = None
        self._params_now = None
        self._blocks = BlockChecks()
        self._rows = BatchRows()
        self._reset_records()

    # -- parameter hooks -----------------------------------------------------------

    def hook_params(self, params: Optional[List[Optional[torch.Tensor]]] = None) -> bool:
        """Notice parameters replaced since last time (``params``: as the modules hold them
        now, if the caller has them) and keep the post-accumulate-grad hooks on the current
        ones while they are wanted; True if any parameter changed."""
        changed = self._params.sync(self.current_params() if params is None else params, self.on_param_grad)
        if changed:  # replaced parameters: every optimizer and the probe are asked again
            self._owners.forget()
            self._probe = None
        return changed

    def on_param_grad(self, param: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: autograd accumulated this gradient in this backward.
        It runs inside AccumulateGrad, before DDP's reducer copies the gradient into its
        bucket, so ``p.grad`` is still this rank's own (the local view)."""
        if not self.active:
            return
        if self._accumulated and not self._at[S.LOCAL_GRAD] and _graph_task_id() == self._task:
            return  # this backward's callback is queued: nothing else to do (77 calls a step on a small GPT)
        with self._guard("backward"):
            self._accumulated = True
            self._enter_backward()
            if self._at[S.LOCAL_GRAD] and p.grad is not None:
                self._record(S.LOCAL_GRAD, param, sharded.local(p.grad), "backward")

    def _record(self, at: str, key: int, t: torch.Tensor, stage: str) -> None:
        """One record of every statistic recorded at ``at``, of the tensor ``t``; a
        statistic that fails on it misses this record alone (counted under ``stage``). The
        tensor recorded last at ``at``, recorded again unchanged, reuses its records: a
        model whose forward returns its last child's output (the logits: an LLM's largest
        tensor) would otherwise be read twice every step, as a block and as the root."""
        last = self._last_record.get(at)
        if last is not None and last[0] is t and last[1] == t._version:
            made = last[2]
        else:
            made = []
            for st in self._at[at]:
                if st.dtypes is None or t.dtype in st.dtypes:
                    try:
                        made.append((st, self._make(st, key, t)))
                    except Exception as exc:
                        self.errors.record(stage, exc)
            # one tensor held per moment, until the next record or the end of the pass
            self._last_record[at] = (t, t._version, made)
        for st, parts in made:
            self._records[st.name].add(key, t.numel(), parts)

    def _make(self, st: Statistic, key: int, t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``st``'s record of ``t`` (of record ``key``): derived from another's where it can
        be; BLOCK_FINITE's made by batch row where ``t`` has the batch's rows (into
        ``self._rows``). A block derived from its activation record (a direct child that is
        a layer, on a detail step) has no rows that step: they would cost another pass."""
        derived = st.derive is not None and self._derived(st, t)
        if derived:
            return derived
        if st is S.BLOCK_FINITE and stats.has_rows(t, self._rows.size):
            lo, hi, rows = stats.extremes(t, self._rows.size)
            self._rows.pending.append((key, rows, 0, self._rows.size))
            return lo, hi
        return st.record(t)

    def _measurable(self, t: torch.Tensor, at: str, key: int) -> Optional[torch.Tensor]:
        """``measurable(t)``, saying once per kind of tensor what is skipped."""
        out, what = measurable(t)
        if out is None and what not in self._unmeasured:
            self._unmeasured.add(what)
            where = (f"the value of top-level block #{key} (#0: the model's input)" if at == S.BLOCK else
                     ("the gradient of the output" if at == S.OUTPUT_GRAD else "the output")
                     + f" of layer {self._layer_names[key]!r}")
            log.warning("gradmon: %s is %s, which has no values gradmon can reduce; that record is skipped, "
                        "the rest of the step is measured (said once per kind of tensor)", where, what)
        return out

    def _derived(self, st: Statistic, t: torch.Tensor) -> Optional[Tuple[torch.Tensor, ...]]:
        """``st``'s record of ``t`` taken from the record another statistic made of it
        (see ``Statistic.derive``), or None where there is none."""
        source, pick = st.derive
        for tensor, version, made in self._last_record.values():
            if tensor is t and version == t._version:
                parts = next((parts for other, parts in made if other.name == source), None)
                if parts is not None:
                    return pick(parts)
        return None

    # -- forward / grad flow -------------------------------------------------------

    def _training_forward(self, module: nn.Module) -> bool:
        return self.active and module.training and torch.is_grad_enabled() and not _recomputed_twice()

    def _record_forward(self, at: str, key: int, values: Any, grad_flow: bool = False) -> None:
        """Records of each floating-point tensor among ``values``; one that cannot be
        measured, or whose measurement fails, costs only its own records."""
        for t in iter_tensors(values):
            if not is_floating(t) or t.numel() == 0:
                continue
            try:
                values_of = self._measurable(t, at, key)
                if values_of is None:
                    continue
                self._record(at, key, values_of, "forward")
                if grad_flow and t.requires_grad:
                    t.register_hook(partial(self.on_grad_flow, key))
            except Exception as exc:
                self.errors.record("forward", exc)

    @torch._dynamo.disable
    def on_root_forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward whose root never returned (it raised) left records: drop them. The
        batch's own values are the first block record (key 0): a NaN that came with the
        data is named ``input``, not blamed on the first layer that passed it on."""
        if not self.active:
            return
        for records in self._each_records(*S.FORWARD):
            records.drop_pending()
        self._blocks.drop()
        self._in_root = True
        with self._guard("forward"):
            self._rows.start(module, args, kwargs)
            if self._at[S.BLOCK] and self._training_forward(module):
                self._record_forward(S.BLOCK, 0, (args, kwargs))

    def on_root_exit(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """The root's forward ended, returned or raised (``always_call``)."""
        self._in_root = False

    def on_block(self, block: int, layer: Optional[int], module: nn.Module, inputs: Any, output: Any) -> None:
        """A top-level block returned: its check waits for the end of the forward on an
        ordinary step (:class:`BlockChecks`), else one small reduction now. Called alone,
        outside the root's forward, its output marks the start of the backward."""
        if layer is not None:
            self.on_forward(layer, module, inputs, output)
        if torch.compiler.is_compiling():  # see _compiling; called directly: this runs per block per step
            self._compiled = True
            return
        with self._guard("forward"):
            if self._training_forward(module):
                if not (self._defer_blocks and self._blocks.defer(block, output)):
                    self._record_forward(S.BLOCK, block, output)
                if not self._in_root:
                    self._watch_backward(output)

    def on_forward(self, layer: int, module: nn.Module, inputs: Any, output: Any) -> None:
        if _compiling():
            self._compiled = True
            return
        if not (self.detail_now or self._at[S.LAYER]):
            return
        with self._guard("forward"):
            if self._training_forward(module):
                # on a detail step the activation record already holds the same extremes
                if not (self.detail_now and self._output_has_extremes):
                    self._record_forward(S.LAYER, layer, output)
                if self.detail_now:
                    self._record_forward(S.OUTPUT, layer, output, grad_flow=bool(self._at[S.OUTPUT_GRAD]))

    def on_grad_flow(self, layer: int, grad: torch.Tensor) -> None:
        if not self.active or grad is None:
            return
        with self._guard("grad_flow"):
            self._enter_backward()
            values_of = self._measurable(grad, S.OUTPUT_GRAD, layer)
            if values_of is not None:
                self._record(S.OUTPUT_GRAD, layer, values_of, "grad_flow")

    # -- end of backward -----------------------------------------------------------

    @torch._dynamo.disable
    def on_root_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Runs eagerly even when the model is compiled (a graph break after the whole
        forward, not inside it), so end-of-backward measurement works under compile."""
        if not self.active:
            return
        with self._guard("forward"):
            self._flush_blocks(self._record_root_output(module, output))
            self._last_record.clear()
            self._commit(self._each_records(*S.FORWARD), "forward")
            self._rows.commit()
        if not torch.is_grad_enabled():
            return
        try:
            self._watch_backward(output)
        except Exception as exc:
            self.errors.record("backward", exc)

    def _record_root_output(self, module: nn.Module, output: Any) -> Tuple[int, ...]:
        """The root's output, the last block record; the keys that take the last block's
        record as theirs instead (its output returned unchanged). A failure costs only this
        record (counted)."""
        try:
            if self._at[S.BLOCK] and self._training_forward(module):
                last = self._blocks.last()
                if last is not None and output is last[1] and output._version == last[2]:
                    return (self.blocks + 1,)
                self._record_forward(S.BLOCK, self.blocks + 1, output)
        except Exception as exc:
            self.errors.record("forward", exc)
        return ()

    def _watch_backward(self, output: Any) -> None:
        """The gradient of ``output`` is the first thing a backward through it computes."""
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._on_backward_start)

    def _flush_blocks(self, alias: Sequence[int] = ()) -> None:
        try:
            self._blocks.flush([(st, self._records[st.name]) for st in self._at[S.BLOCK]], alias, self._rows)
        except Exception as exc:
            self.errors.record("forward", exc)

    def _commit(self, records: Iterable[_Records], stage: str) -> None:
        """Commit each statistic's pending records; one whose raw records fail to combine
        misses them (counted under ``stage``), the others are unaffected."""
        for r in records:
            try:
                r.commit()
            except Exception as exc:
                r.drop_pending()
                self.errors.record(stage, exc)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if not self.active:
            return
        try:
            self._enter_backward()
            task = _graph_task_id()
            if task != self._seen_task:
                self._seen_task = task
                self._accumulated = self._accumulated or self._accumulates()
        except Exception as exc:
            self.errors.record("backward", exc)

    def _accumulates(self) -> bool:
        """Whether the running backward accumulates into a monitored parameter's ``.grad``
        (not ``torch.autograd.grad``, not ``backward(inputs=...)`` over other tensors): asked
        of the parameter that answered yes last time first, so usually once."""
        known = self._probe() if self._probe is not None else None
        try:
            if known is not None and _will_accumulate(known):
                return True
            for p in self.current_params():
                if p is not None and _will_accumulate(p):
                    self._probe = weakref.ref(p)
                    return True
        except RuntimeError:
            return False  # torch.autograd.grad: it accumulates nothing
        return False

    def _enter_backward(self) -> None:
        """First hook of a backward pass: queue its end-of-backward callback once. A pass
        that raised never ran its callback and left partial records: drop them."""
        task = _graph_task_id()
        if task == self._task:
            return
        for records in self._each_records(S.OUTPUT_GRAD, S.LOCAL_GRAD):
            records.drop_pending()
        self._last_record.clear()
        self._task = task
        Variable._execution_engine.queue_callback(self._after_backward_queued)

    def _after_backward_queued(self) -> None:
        # Re-queued once so that it runs after the callbacks DDP and FSDP queue during
        # backward: their gradient reduction finishes there.
        try:
            Variable._execution_engine.queue_callback(self._after_backward)
        except Exception as exc:
            self.errors.record("backward", exc)

    def _after_backward(self) -> None:
        if not self.active:
            return
        with self._guard("backward", self._step.fail):
            # OUTPUT too: reentrant checkpointing re-runs forwards inside backward
            self._flush_blocks()
            self._last_record.clear()
            self._commit(self._records.values(), "backward")
            # Without an accumulated gradient (torch.autograd.grad, .grad assigned by
            # hand later) there is nothing to measure yet: the optimizer step will.
            # FSDP2 assigns sharded gradients itself, after its own callbacks. Parameters
            # replaced since the last step had no hook yet: they get one now.
            if not (self._accumulated or self.sharded) and self.hook_params():
                self._accumulated = True
            if self._accumulated or self.sharded:
                self._accumulated = False
                self._step_seen = _graph_task_id() == self._seen_task
                self._scale = amp.scale_tensor(self.scaler)
                self._step.fire(Event.BACKWARD)  # even if measuring fails: the step must still count
                self._measure_grads()

    def _measure_grads(self) -> None:
        self._params_now = params = self.current_params()
        every = [p.grad if p is not None else None for p in params]
        for i, ref in self._flat_of.items():
            if every[i] is None:
                every[i] = _empty_shard(params[i], ref())
        present = [i for i, g in enumerate(every) if g is not None]
        grads = every if len(present) == len(every) else [every[i] for i in present]
        if set(map(type, grads)) - {torch.Tensor}:
            # a shard's own elements, summed at the step (a plain tensor is its own)
            grads = [g if type(g) is torch.Tensor else sharded.local(g) for g in grads]
        for st in self._at[S.PARAM_GRAD]:
            self._batched.pop(st.name, None)
        numels = list(map(torch.Tensor.numel, grads))
        for st in self._at[S.PARAM_GRAD] if grads else ():
            rows, order = st.record(grads, grads[0].device)
            self._batched[st.name] = (rows, tuple(map(present.__getitem__, order)),
                                      tuple(map(numels.__getitem__, order)))

    # -- observed values -------------------------------------------------------------

    @torch._dynamo.disable  # a compiled train step calling observe() must not trace gradmon's state
    def observe_loss(self, loss: Any) -> None:
        """One micro-batch's loss: added on its device, never read; the step's packet
        carries the mean. Bad input is counted (stage ``observe``), never raised."""
        if not self.active:
            return
        with self._guard("observe"):
            self._loss.add(loss)

    def _step_scalars(self, scale: Optional[torch.Tensor]) -> List[Tuple[str, Optional[torch.Tensor]]]:
        """The step scalars of this step, names and 0-d device tensors (None: absent), in packet order."""
        return [(S.SCALAR_AMP_SCALE, scale), (S.SCALAR_AMP_FOUND_INF, self._found_inf),
                (S.SCALAR_LOSS, self._loss.mean()),
                *((S.learning_rate_scalar(group), lr.detach().reshape(()))
                  for group, lr in enumerate(self._learning_rates) if isinstance(lr, torch.Tensor))]

    # -- step boundary -------------------------------------------------------------

    def on_optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A global hook: it runs for every optimizer in the process, so nothing may escape.
        try:
            if not self.active or not self._owners.owns(opt):
                return
        except Exception as exc:
            self.errors.record("step", exc)
            return
        with self._guard("step", self._step.fail):
            # No backward accumulated a monitored gradient since the last step (.grad
            # assigned by hand, or the closure's backward is still to come): measure
            # now, after any clipping; a backward inside the closure measures again.
            # Only for the first optimizer, so that a second optimizer over the same
            # model does not count the step twice.
            if not self._step.measured and self._owners.primary(opt):
                self._step.fire(Event.AT_STEP)
                self._scale = amp.scale_tensor(self.scaler)
                self._measure_grads()
                self._unseen = self._unseen or bool(self._batched)

    def on_optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if not self.active or not self._owners.owns(opt) or not self._step.measured:
                return
            gs = optimizer.step_count(opt)
            # every step, whatever optimizer_every says: floats are free, tensors are packed
            self._learning_rates = tuple(group.get("lr") for group in opt.param_groups)
            # A fused optimizer is stepped even on overflow, with the scaler's flag, and applies
            # nothing: the flag rides in the packet (reading it here would sync the device).
            found = getattr(opt, "found_inf", None)
            self._found_inf = found.detach().reshape(()).float() if isinstance(found, torch.Tensor) else None
        except Exception as exc:
            self.errors.record("step", exc)
            return
        self._read_optimizer(opt)
        self.end_step(gs, by_optimizer=True)

    def _read_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """After the step that closes this one, before its packet: what the optimizer did,
        on sampled steps (``optimizer_every``). A second optimizer over the same model
        steps after the packet is closed: its parameters stay unread (counted as uncovered)."""
        every = self.cfg.optimizer_every
        if not every:
            return
        with self._guard("step"):
            if self._at[S.OPTIMIZER] and self.steps % every == 0:
                self._batched.update(self._reads.rows(opt, self.current_params(), self.sharded, self._at[S.OPTIMIZER]))

    def manual_step(self, global_step: Optional[int]) -> None:
        if not self.active:
            return
        if self._step.relabels:
            # The optimizer hook already published this step, or the scaler skipped it (a
            # trainer counts it all the same); only the number changes, and the next step
            # follows it.
            if global_step is not None:
                self.step_offset = global_step - self.steps
                self.publish(GlobalStepUpdate(global_step, skipped=self._step.skipped))
            return
        if not self._step.measured:
            with self._guard("step"):
                self._step.fire(Event.AT_STEP)
                self._measure_grads()
                self._unseen = self._unseen or bool(self._batched)
        if global_step is not None:
            self.step_offset = global_step - (self.steps + 1)
        self.end_step(None, by_optimizer=False)

    def on_scaler_update(self) -> None:
        """Once per iteration, stepped or not: a backward without an optimizer step was a
        step the scaler skipped on overflow."""
        if not self.active:
            return
        if not self._step.skipped_at_update:
            self._step.fire(Event.SCALER_UPDATE)
            return
        with self._guard("step"):
            try:
                packet = StepPacket(self.steps, self.step_offset + self.steps, time.time(), skipped=True)
                self.publish(writer.write(packet, (), {}, {}, None, self._step_scalars(amp.scale_tensor(self.scaler)),
                                          self.errors))
            finally:
                self._step.fire(Event.SCALER_UPDATE)  # closes the step as skipped
                self._close_step()

    def end_step(self, optimizer_step: Optional[int], by_optimizer: bool) -> None:
        with self._guard("step"):
            index = self.steps
            global_step = optimizer_step if optimizer_step is not None else self.step_offset + index + 1
            packet = StepPacket(index, global_step, time.time(), measured_at_step=self._step.measured_at_step,
                                learning_rates=S.host_learning_rates(self._learning_rates), rows=self._rows.take())
            if self._shard_groups:
                self._reduce_shards()
            try:
                # what a forward or backward that did not complete recorded is not this step's
                for records in self._records.values():
                    records.drop_pending()
                packet = writer.write(packet, self.statistics, self._records, self._batched, self._scale,
                                      self._step_scalars(self._scale), self.errors,
                                      sampled=packet.index % self.cfg.every == 0, detail=self.detail_now)
            except Exception as exc:
                self.errors.record("step", exc)
            try:
                self.publish(packet)
            except Exception as exc:  # pragma: no cover - SimpleQueue.put does not fail
                self.errors.record("step", exc)
            self._step.fire(Event.OPTIMIZER if by_optimizer else Event.MANUAL)
            self._close_step()
            self.steps += 1
            self.detail_now = self.steps % self.cfg.detail_every == 0
            # on a detail step a block that is a layer takes its extremes from its activation record
            self._defer_blocks = self._batch_blocks and not self.detail_now
            try:
                self._next_hooks()
            except Exception as exc:
                self.errors.record("step", exc)

    def _next_hooks(self) -> None:
        """The hooks the next step needs, and only those: per-parameter hooks while a
        backward gradmon did not see may come (or LOCAL_GRAD reads them), the layers'
        forward hooks on the steps that read them. Under torch.compile hooks stay as they
        are (adding or removing one would recompile the model)."""
        self._params.hooked = (self._unseen or bool(self._at[S.LOCAL_GRAD]) or self._compiled
                               or (self._params.hooked and not self._step_seen))
        self._step_seen = False
        # parameters replaced since the last step are measured from now on
        self.hook_params(self._params_now)
        self._params_now = None
        if self.layer_hooks is not None:
            self.layer_hooks.want(self.detail_now or bool(self._at[S.LAYER]) or self._compiled)

    def _close_step(self) -> None:
        self._batched = {}
        self._found_inf = None
        self._learning_rates = ()
        self._scale = None
        self._accumulated = False
        self._loss.reset()
        self._blocks.drop()
        self._rows.take()
        self._reset_records()

    def _reduce_shards(self) -> None:
        """The step's collective: every rank calls it at every step, whatever failed before."""
        for st in self._at[S.PARAM_GRAD]:
            rows, order, numels = self._batched.pop(st.name, (None, (), ()))
            try:
                rows, _ok = sharded.all_reduce_rows(rows, order, self._shard_groups, self._step.failed,
                                                    [c.fold for c in st.columns])
                if rows is not None:
                    self._batched[st.name] = (rows, order, numels)
            except Exception as exc:
                self.errors.record("step", exc)


class LayerHooks:
    """The layers' forward hooks, registered only for the steps that read them (detail
    steps, or every step with ``origin_per_layer``): a module with a forward hook leaves
    PyTorch's fast call path, which alone costs about a microsecond a call."""

    def __init__(self, layers: Sequence[Layer], hook: Callable[..., None]) -> None:
        self._layers = [(layer.index, weakref.ref(layer.module)) for layer in layers]
        self._hook = hook
        self._handles: List[Any] = []

    def want(self, on: bool) -> None:
        if on and not self._handles:
            for index, ref in self._layers:
                module = ref()
                if module is not None:
                    self._handles.append(module.register_forward_hook(partial(self._hook, index)))
        elif not on and self._handles:
            self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


class HookSet:
    """Owns every hook one monitor registered; ``remove()`` undoes all of them."""

    def __init__(self) -> None:
        self._handles: List[Any] = []

    def install(self, recorder: Recorder, root: nn.Module, layers: Sequence[Layer], cfg: Config,
                blocks: Sequence[nn.Module] = ()) -> None:
        try:
            # A layer that is also a block is recorded by its block hook, layer first (the
            # block's extremes are then taken from the layer's activation record), since
            # the layers' own hooks come and go and would then run after the block's.
            both: Dict[int, int] = {}
            if recorder.statistics_at(S.BLOCK):
                recorder.blocks = len(blocks)
                index = {id(layer.module): layer.index for layer in layers}
                layered = bool(recorder.statistics_at(S.OUTPUT, S.OUTPUT_GRAD, S.LAYER))
                for key, block in enumerate(blocks, start=1):
                    if layered and id(block) in index:
                        both[id(block)] = index[id(block)]
                    self._handles.append(block.register_forward_hook(
                        partial(recorder.on_block, key, both.get(id(block)))))
            if recorder.statistics_at(S.OUTPUT, S.OUTPUT_GRAD, S.LAYER):
                recorder.layer_hooks = LayerHooks([layer for layer in layers if id(layer.module) not in both],
                                                  recorder.on_forward)
                self._handles.append(recorder.layer_hooks)
                recorder.layer_hooks.want(True)  # the first step is a detail step
            self._handles.append(root.register_forward_pre_hook(recorder.on_root_forward_pre, with_kwargs=True))
            self._handles.append(root.register_forward_hook(recorder.on_root_forward))
            self._handles.append(root.register_forward_hook(recorder.on_root_exit, always_call=True))
            if recorder.scaler is not None:
                self._handles.append(amp.UpdateHook(recorder.scaler, recorder.on_scaler_update))
            recorder.hook_params()
            self._handles.append(register_optimizer_step_pre_hook(recorder.on_optimizer_pre))
            self._handles.append(register_optimizer_step_post_hook(recorder.on_optimizer_post))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Removes every handle, even if one of them fails; the first failure is raised after."""
        handles, self._handles = self._handles, []
        failure: Optional[BaseException] = None
        for handle in handles:
            try:
                handle.remove()
            except Exception as exc:  # noqa: BLE001
                failure = failure or exc
        if failure is not None:
            raise failure

    def __len__(self) -> int:
        return len(self._handles)
