"""What the hooks recorded in the current step, one tensor at a time: each statistic's records
(``_Records``), the top-level blocks' outputs waiting for their batched check (``BlockChecks``),
the batch rows those checks flagged (``BatchRows``), and :class:`StepRecords`, which owns them
for one monitor. Records become part of the step only when the forward or backward that made
them completed.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import statistics as S
from ..errors import ErrorLog
from ..statistics import Statistic
from . import kernels as stats
from . import counting, rowhash, sharded
from .layers import is_floating
from .packet import RowBlock, RowHashes

log = logging.getLogger("gradmon")


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter; 0 for an inference tensor (a batch made under
    ``torch.inference_mode``), which has none, and which no op outside inference mode, the
    training forward's included, may change in place."""
    try:
        return t._version
    except RuntimeError:
        return 0


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
A larger one is checked in its hook (its kernel costs more than the hook's Python, and
holding it until the end of the forward could keep alive memory that the forward, or
activation checkpointing, would have freed), unless it is a CUDA tensor that one forward
showed alive at its end without gradmon holding it (:attr:`BlockChecks.held`): its check
then waits too, for one launch with the others (``stats.extremes_held``)."""


class BlockChecks:
    """The non-finite check of the top-level blocks' outputs, batched (on a detail step
    too, but for a block that is a layer: its activation record holds its extremes).

    A small plain tensor returned by a block is kept, with its version counter, until the
    root's forward returns; then all are checked at once. A later in-place op on it (a
    ``ReLU(inplace=True)`` sibling, a residual ``+=`` in the root) would make the check
    read a value the block never returned: a block is deferred only once one forward
    showed its output unchanged at the end (until then its hook checks it at once), and a
    deferred output found changed loses that record and goes back to being checked in its
    hook. Holds no tensor between forwards.

    A large CUDA output (:meth:`heavy`) waits on the same terms, and only once one forward
    showed it alive at its end through a weak reference (:attr:`held`): kept by autograd
    for the backward (the next block's first layer saves its input), holding it until the
    end of the forward costs no memory; one that the forward frees (inference, a consumer
    that saves nothing) goes on being checked in its hook, and one held that autograd no
    longer keeps (seen at the end of each forward) is held no more after that forward.

    The hook of a block already deferred keeps its output after two cheap tests
    (:meth:`wait`); whether it is a plain tensor (:meth:`plain`) is asked at the end of
    the forward, of all of them at once, and one that is not is checked alone then, as its
    hook would have, and goes back to its hook's check."""

    __slots__ = ("waiting", "probing", "settled", "weighing", "held", "shapes", "weighs")

    def __init__(self, weighs: bool = True) -> None:
        self.weighs = weighs  # whether a large CUDA output may wait (:meth:`heavy`), once weighed
        self.waiting: List[Tuple[int, torch.Tensor, int]] = []  # (block key, output, its version then)
        self.probing: List[Tuple[int, torch.Tensor, int]] = []  # checked in the hook, watched for a change
        self.settled: set = set()  # block keys whose small outputs may wait
        self.weighing: List[Tuple[int, "weakref.ref[torch.Tensor]", int]] = []  # heavy ones checked, weighed
        self.held: set = set()  # block keys whose heavy outputs may wait
        # where the last forward's outputs had several shapes: their positions by shape
        self.shapes: Optional[Tuple[Tuple[int, ...], ...]] = None

    @staticmethod
    def plain(t: Any) -> bool:
        """A tensor whose check may wait: a small dense floating-point torch.Tensor with values
        and a version counter (an inference tensor, a batch made under ``inference_mode``
        that a block returned unchanged, has none)."""
        # the size first: a large output (an accelerator's, checked in its hook) is told by it
        return (type(t) is torch.Tensor and not t.is_nested and 0 < t.numel() <= DEFER_MAX
                and t.is_floating_point() and t.layout == torch.strided and not t.is_meta and not t.is_inference())

    @staticmethod
    def heavy(t: Any) -> bool:
        """A large output whose check may wait where the forward keeps it anyway: a dense
        contiguous floating-point CUDA torch.Tensor, where the one-launch check serves."""
        return (type(t) is torch.Tensor and t.is_cuda and t.numel() > DEFER_MAX and not t.is_nested
                and t.is_floating_point() and t.layout == torch.strided and t.is_contiguous()
                and not t.is_inference() and counting.available())

    def defer(self, key: int, t: Any) -> bool:
        """Keep ``t`` for the end of the forward; False when its hook must check it now: it
        is no :meth:`plain` or :meth:`heavy` tensor, or not yet known to stay unchanged (and
        alive, if heavy): it is then watched, to learn whether it may wait next time."""
        if self.plain(t):
            if key in self.settled:
                self.waiting.append((key, t, t._version))
                return True
            self.probing.append((key, t, t._version))
        elif self.weighs and self.heavy(t):
            if key in self.held:
                self.waiting.append((key, t, t._version))
                return True
            self.weighing.append((key, weakref.ref(t), t._version))
        return False

    def wait(self, key: int, t: torch.Tensor) -> bool:
        """Keep ``t`` (a torch.Tensor) of a block already known to stay unchanged, unless it
        is too large to hold until the end of the forward (a block whose output is
        :attr:`held` is not asked); False where :meth:`defer` must decide. ``BlockForward``
        makes the same test inline: the two change together."""
        if key in self.held or (key in self.settled and t.numel() <= DEFER_MAX):
            self.waiting.append((key, t, t._version))
            return True
        return False

    def last(self) -> Optional[Tuple[int, torch.Tensor, int]]:
        return self.waiting[-1] if self.waiting else None

    def drop(self) -> None:
        self.waiting, self.probing, self.weighing = [], [], []

    def take(self) -> List[Tuple[int, torch.Tensor, int]]:
        """The waiting outputs to check now, those found changed since their block returned
        left out (their blocks go back to their hooks' checks); learns which probed blocks
        may wait from now on. Nothing is held after."""
        waiting, probing = self.waiting, self.probing
        self.waiting, self.probing = [], []
        for key, t, version in probing:
            if t._version == version:
                self.settled.add(key)
        if waiting and list(map(_VERSION, map(_OUTPUT, waiting))) != list(map(_VERSION_THEN, waiting)):
            changed = [key for key, t, version in waiting if t._version != version]
            self.settled.difference_update(changed)
            self.held.difference_update(changed)
            waiting = [entry for entry in waiting if entry[1]._version == entry[2]]
        return waiting

    def weigh(self) -> None:
        """At the end of a pass, once gradmon holds none of its tensors: the heavy outputs
        checked in their hooks whose memory something else keeps (autograd, for the
        backward) and that stayed unchanged may wait from the next forward on."""
        weighing, self.weighing = self.weighing, []
        for key, ref, version in weighing:
            t = ref()
            if t is not None and t._version == version:
                self.held.add(key)

    def flush(self, waiting: Sequence[Tuple[int, torch.Tensor, int]], into: Sequence[Tuple[Statistic, "_Records"]],
              alias: Sequence[int] = (), rows: Optional["BatchRows"] = None,
              failed: Optional[Callable[[Statistic, Exception], None]] = None) -> List[Tuple[int, torch.Tensor]]:
        """Check the ``waiting`` outputs (:meth:`take`): one batch of rows per statistic
        (``record_many``) into its records; ``alias`` are more keys whose record is the last
        waiting output's (the root's output, when it is the last block's, unchanged).
        ``BLOCK_FINITE`` checks them by batch row, into ``rows``, where the batch is known.
        Returns the (key, output) to be checked one by one instead, as their hooks would
        have: outputs that are no :meth:`plain` tensor (known here, where they are asked
        all at once; their blocks go back to their hooks' checks), and held ones the
        one-launch check could not serve. ``failed(statistic, exception)``, where given, is
        told of a statistic whose records failed, and the others are made all the same."""
        if not waiting:
            return []
        alone: List[Tuple[int, torch.Tensor]] = []
        # a large output waits only where its block is held (none on the CPU): only then are
        # the outputs asked their sizes here, where a model of thousands of blocks pays per output
        numels = list(map(torch.Tensor.numel, map(_OUTPUT, waiting))) if self.held else ()
        if numels and max(numels) > DEFER_MAX:
            last_held = numels[-1] > DEFER_MAX
            alone = self._flush_held([entry for entry, n in zip(waiting, numels) if n > DEFER_MAX], into,
                                     alias if last_held else (), rows)
            alias = () if last_held else alias
            waiting = [entry for entry, n in zip(waiting, numels) if n <= DEFER_MAX]
            if not waiting:
                return alone
        tensors = list(map(_OUTPUT, waiting))
        stacked = self._stack(tensors)  # proves them plain, all at once
        if stacked is None and not _all_plain(tensors):
            plain = list(map(self.plain, tensors))
            alone += [(key, t) for (key, t, _), ok in zip(waiting, plain) if not ok]
            self.settled.difference_update(key for (key, _, _), ok in zip(waiting, plain) if not ok)
            if not plain[-1]:  # the root's output went alone: so do the keys that take its record
                alone += [(key, tensors[-1]) for key in alias]
                alias = ()
            waiting = [entry for entry, ok in zip(waiting, plain) if ok]
            tensors = list(map(_OUTPUT, waiting))
            if not waiting:
                return alone
        every_key = [entry[0] for entry in waiting]
        every_numel = ([tensors[0].numel()] * len(tensors) if isinstance(stacked, torch.Tensor)
                       else list(map(torch.Tensor.numel, tensors)))
        given = stacked if stacked is not None else False  # how the kernels take "not stacked"
        for st, records in into:
            try:
                if st is S.BLOCK_FINITE and rows is not None and rows.size is not None:
                    per_row: List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]] = []
                    *parts, order = stats.extremes_many(tensors, tensors[0].device, rows.size, per_row, given)
                    rows.add(every_key, per_row)
                else:
                    *parts, order = st.record_many(tensors, tensors[0].device, given)
                _add_rows(records, every_key, every_numel, parts, order, alias)
            except Exception as exc:
                if failed is None:
                    raise
                failed(st, exc)
        return alone

    def _stack(self, tensors: Sequence[torch.Tensor]) -> Union[torch.Tensor, stats.Stacks, None]:
        """The outputs stacked (:func:`stats.stack_alike`), or stacked by shape where they
        have a few (:func:`stats.stack_by_shape`: a transformer's embeddings, blocks and
        head), whose layout is kept for the next forward, which goes to it directly."""
        if self.shapes is None:
            x = stats.stack_alike(tensors)
            if x is not None or len(tensors) < 2:
                return x
        made = stats.stack_by_shape(tensors, self.shapes)
        self.shapes = made.positions if made is not None and len(made.stacks) > 1 else None
        if made is not None and len(made.stacks) == 1:  # one shape after all
            return made.stacks[0]
        return made

    def _flush_held(self, held: Sequence[Tuple[int, torch.Tensor, int]], into: Sequence[Tuple[Statistic, "_Records"]],
                    alias: Sequence[int], rows: Optional["BatchRows"]) -> List[Tuple[int, torch.Tensor]]:
        """:meth:`flush` of the held (large) outputs: one launch per device and dtype
        (``stats.extremes_held``), where ``BLOCK_FINITE`` is the only statistic at the blocks;
        else, or where the kernel cannot serve, the (key, output) to be checked one by one,
        their blocks back to their hooks' checks."""
        keys, tensors = [entry[0] for entry in held], list(map(_OUTPUT, held))
        # one that nothing but gradmon holds now would have been freed (a later layer frozen
        # since it was weighed): held no more from the next forward. The last is exempt: the
        # root may be returning it, and it was made last, so holding it cost nothing
        self.held.difference_update(key for key, t in zip(keys[:-1], tensors[:-1]) if _held_by_nothing_else(t))
        per_row: List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]] = []
        made = None
        if len(into) == 1 and into[0][0] is S.BLOCK_FINITE:
            made = stats.extremes_held(tensors, tensors[0].device, rows.size if rows is not None else None,
                                       per_row if rows is not None else None)
        if made is None:
            self.held.difference_update(keys)
            return list(zip(keys, tensors)) + [(key, tensors[-1]) for key in alias]
        *parts, order = made
        if rows is not None:
            rows.add(keys, per_row)
        _add_rows(into[0][1], keys, list(map(torch.Tensor.numel, tensors)), parts, order, alias)
        return []


def _held_by_nothing_else(t: torch.Tensor) -> bool:
    """Whether no C++ owner (autograd's saved tensors, a view's base link) holds ``t``, only
    Python references: torch's use count of its TensorImpl, where this torch has one."""
    use_count = getattr(t, "_use_count", None)
    return use_count is not None and use_count() == 1


def _add_rows(records: "_Records", every_key: Sequence[int], every_numel: Sequence[int], parts: Sequence[torch.Tensor],
              order: Sequence[int], alias: Sequence[int]) -> None:
    """One statistic's records of a batch of outputs (row j of ``parts`` describes output
    ``order[j]``), the ``alias`` keys taking the last output's."""
    keys = list(map(every_key.__getitem__, order))
    numels = list(map(every_numel.__getitem__, order))
    if alias:
        at = order.index(len(every_key) - 1)
        keys += alias
        numels += [numels[at]] * len(alias)
        parts = [torch.cat((part, part[at:at + 1].expand(len(alias), -1))) for part in parts]
    records.add_rows(keys, numels, parts)


_OUTPUT, _VERSION_THEN = operator.itemgetter(1), operator.itemgetter(2)  # of a waiting entry
_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_IS_META = operator.attrgetter("is_meta")
_IS_NESTED = operator.attrgetter("is_nested")
_FLOATING = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _all_plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every one of ``tensors`` (torch.Tensors no larger than ``DEFER_MAX``) is
    :meth:`BlockChecks.plain`: a few C-level passes over all of them, where asking each
    in its hook cost a Python call apiece."""
    return (set(map(_DTYPE, tensors)) <= _FLOATING and set(map(_LAYOUT, tensors)) == {torch.strided}
            and not any(map(_IS_META, tensors)) and not any(map(_IS_NESTED, tensors))
            and 0 not in map(torch.Tensor.numel, tensors))


ROW_TABLE = 32
"""Block outputs of one device and dtype whose per-row checks share one :class:`RowTable`."""


class RowTable:
    """On an accelerator, one forward's per-row block checks of one device and dtype, in
    the slots of one table: a kernel per block output (``aminmax`` by batch row, written
    into its slot), where reducing each output's rows to its own min and max and stacking
    them took four, launched from the forward's hooks. The outputs' own min and max are
    reduced for every slot at once (:meth:`finish`, when the forward ends); until then
    their records hold views of a result not yet written, which nothing reads before the
    step's packet is written."""

    __slots__ = ("rows", "whole", "used", "done")

    def __init__(self, like: torch.Tensor, batch: int) -> None:
        self.rows = torch.empty((2, ROW_TABLE, batch), dtype=like.dtype, device=like.device)
        self.whole = torch.empty((2, ROW_TABLE), dtype=like.dtype, device=like.device)
        self.used = self.done = 0

    def full(self) -> bool:
        return self.used == ROW_TABLE

    def check(self, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(min, max, rows) of ``t`` as :func:`stats.extremes` gives them, min and max
        written by :meth:`finish`."""
        i = self.used
        rows = self.rows[:, i]
        torch.aminmax(t.detach().reshape(rows.shape[1], -1), dim=1, out=(rows[0], rows[1]))
        self.used += 1
        return self.whole[0, i], self.whole[1, i], rows.t()

    def finish(self) -> None:
        """Every checked slot's min and max (NaN propagates): two kernels for all of them."""
        if self.done < self.used:
            lo, hi = self.rows[0, self.done:self.used], self.rows[1, self.done:self.used]
            torch.amin(lo, dim=1, out=self.whole[0, self.done:self.used])
            torch.amax(hi, dim=1, out=self.whole[1, self.done:self.used])
            self.done = self.used


class BatchRows:
    """Which batch rows of each top-level block's output went non-finite: the block check's
    per-row result (``stats.extremes``/``extremes_many`` given the batch), kept as device
    tensors for the step's packet and read on the host only at an incident (publisher
    thread). The batch is the root input's first dimension; a block output whose first
    dimension is another size has no rows, nor has any output of a forward whose batch
    cannot be told (:func:`batch_size`)."""

    __slots__ = ("size", "pending", "kept", "forwards", "hashing", "hashes", "kept_hashes", "tables", "filled")

    def __init__(self, hashing: bool = False) -> None:
        self.size: Optional[int] = None  # rows of this forward's batch
        # inside a root forward on an accelerator: its RowTables by (CUDA or not, device index, dtype),
        # and the filled ones
        self.tables: Optional[Dict[Tuple[bool, int, torch.dtype], RowTable]] = None
        self.filled: List[RowTable] = []
        # (block keys, block, starts, size): block[start:start + size] is the [min, max] of each
        # row of the output of each key, start
        self.pending: List[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...], int]] = []
        # this step's completed forwards' (micro-batches), each with its forward's index
        self.kept: List[RowBlock] = []
        self.forwards = 0
        # the rows of the root's inputs are hashed (``rowhash``) until the job gives sample ids
        self.hashing = hashing
        self.hashes: List[Tuple[str, torch.Tensor]] = []  # this forward's, by input name
        self.kept_hashes: List[RowHashes] = []

    def start(self, root: nn.Module, args: Any, kwargs: Any) -> None:
        self.pending, self.hashes, self.size, self.tables, self.filled = [], [], None, {}, []
        self.size = batch_size(root, args, kwargs)

    def check(self, key: int, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The block check of ``t`` (of record ``key``), whose first dimension is the batch:
        (min, max) for its record, its rows kept for the packet. Inside a root forward on
        an accelerator, in a :class:`RowTable` (a plain tensor: a subclass such as a
        DTensor cannot write into the table's slots); elsewhere :func:`stats.finite_check`."""
        if self.tables is None or t.is_cpu or type(t) is not torch.Tensor:
            lo, hi, rows = stats.finite_check(t, self.size)
        else:
            where = (t.is_cuda, t.get_device(), t.dtype)  # no device object made per call
            table = self.tables.get(where)
            if table is None or table.full():
                if table is not None:
                    self.filled.append(table)
                table = self.tables[where] = RowTable(t, self.size)  # type: ignore[arg-type]
            lo, hi, rows = table.check(t)
        self.pending.append(((key,), rows, (0,), self.size))  # type: ignore[arg-type]
        return lo, hi

    def add(self, keys: Sequence[int], per_row: Sequence[Tuple[Tuple[int, ...], torch.Tensor, Tuple[int, ...]]]
            ) -> None:
        """Rows of outputs checked at the end of the forward: (positions in ``keys``, block,
        starts) each, as ``stats.extremes_many`` gives them."""
        self.pending.extend((tuple(map(keys.__getitem__, idx)), block, starts, self.size)  # type: ignore[misc]
                            for idx, block, starts in per_row)

    def finish(self) -> None:
        """The min and max of every output this forward's tables checked (:meth:`RowTable.finish`)."""
        if self.tables:
            for table in (*self.filled, *self.tables.values()):
                table.finish()

    def hash_inputs(self, args: Any, kwargs: Any) -> None:
        """Each batch-first input tensor's row hashes, on its device, for this forward."""
        if self.size is not None:
            self.hashes = rowhash.hash_rows(args, kwargs, self.size)

    def commit(self) -> None:
        """The end of a root forward, whose tables ``StepRecords.flush_blocks`` finished."""
        self.tables, self.filled = None, []
        self.kept.extend(RowBlock(*entry, self.forwards) for entry in self.pending)
        self.kept_hashes.extend(RowHashes(name, hashes, self.forwards) for name, hashes in self.hashes)
        self.pending, self.hashes = [], []
        self.forwards += 1

    def take(self) -> Tuple[Tuple[RowBlock, ...], Tuple[RowHashes, ...]]:
        """This step's per-row block checks and input row hashes; a fresh start for the next."""
        kept, hashes = tuple(self.kept), tuple(self.kept_hashes)
        self.kept, self.kept_hashes, self.pending, self.hashes, self.forwards = [], [], [], [], 0
        self.tables, self.filled = None, []
        return kept, hashes


def batch_size(root: nn.Module, args: Any, kwargs: Any) -> Optional[int]:
    """The root input's batch size: the first dimension of its first tensor; None where
    it cannot be told (a packed sequence, a sequence-first recurrent root, no tensor)."""
    if isinstance(root, nn.RNNBase) and not root.batch_first:
        return None
    if any(isinstance(x, nn.utils.rnn.PackedSequence) for x in (*args, *(kwargs or {}).values())):
        return None
    first = next((t for t in iter_tensors((args, kwargs)) if t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else None


class StepRecords:
    """One monitor's records of the current step: every statistic recorded one tensor at a
    time, by moment (``statistics.OUTPUT``, ``BLOCK``, ``OUTPUT_GRAD``, ...), with the block
    checks waiting for the end of the forward and the batch rows they flagged.

    The tensor recorded last at a moment is held until the next record or the end of its
    pass: recorded again unchanged, it reuses its records, and another statistic may derive
    its record from them (``Statistic.derive``)."""

    def __init__(self, statistics: Sequence[Statistic], layer_names: Sequence[str], errors: ErrorLog,
                 keep_scratch: bool) -> None:
        self._statistics = tuple(st for st in statistics if st.at not in S.BATCHED)
        self._at: Dict[str, Tuple[Statistic, ...]] = {
            at: tuple(st for st in self._statistics if st.at == at) for at in {st.at for st in self._statistics}}
        self._layer_names = tuple(layer_names)
        self._errors = errors
        # The combined statistics' temporaries, kept from one detail step to the next only
        # where those come often: on the CPU fresh pages for them cost a page fault per
        # page every detail step, which matters only when detail steps are frequent; at the
        # default cadence keeping them would hold memory for almost no time saved
        # (docs/benchmark.md, "Kernel choices", for the figures).
        self._scratch = stats.Scratch() if keep_scratch else None
        self._last: Dict[str, Tuple[torch.Tensor, int, List[Tuple[Statistic, Any]]]] = {}
        self._unmeasured: set = set()  # kinds of tensor skipped, already logged
        self._new_checks()
        # waiting layers that are top-level blocks -> their block keys, and the root's output
        # where it is the last of them (its key, the layer, the tensor): block records taken
        # from the activation rows made at the end of the forward
        self.derived: Dict[int, int] = {}
        self.root_derived: Optional[Tuple[int, int, torch.Tensor]] = None
        self.rows = BatchRows()
        self.by_name: Dict[str, _Records] = {}
        self.reset()

    def reset(self) -> None:
        """A new step: nothing recorded, nothing waiting."""
        self.by_name = {st.name: _Records(st.by_parameter, st.combine, self._scratch) for st in self._statistics}
        self.blocks.drop()
        self.drop_outputs()
        self.grads.drop()
        self.rows.take()

    def release(self) -> None:
        """Hold no tensor and no scratch memory any more (after detach)."""
        self._scratch = None
        self._last.clear()
        self._new_checks()
        self.rows = BatchRows()
        self.reset()

    def _new_checks(self) -> None:
        """What waits for the end of a pass, none of it learned yet."""
        self.blocks = BlockChecks()
        self.outputs = BlockChecks(weighs=False)  # the layers' outputs of a detail step's forward
        self.grads = BlockChecks(weighs=False)  # and their gradients, in its backward

    def each(self, *moments: str) -> Iterator[_Records]:
        for at in moments:
            for st in self._at.get(at, ()):
                yield self.by_name[st.name]

    def drop_pending(self, *moments: str) -> None:
        """Forget what a pass that did not complete recorded at ``moments`` (all: every moment)."""
        for records in (self.each(*moments) if moments else self.by_name.values()):
            records.drop_pending()

    def end_of_pass(self) -> None:
        """A forward or backward pass ended: the last tensors recorded are held no longer,
        and then the heavy block outputs are weighed (``BlockChecks.weigh``)."""
        self._last.clear()
        self.blocks.weigh()

    def commit(self, records: Iterable[_Records], stage: str) -> None:
        """Commit each statistic's pending records; one whose raw records fail to combine
        misses them (counted under ``stage``), the others are unaffected."""
        for r in records:
            try:
                r.commit()
            except Exception as exc:
                r.drop_pending()
                self._errors.record(stage, exc)

    def flush_blocks(self, alias: Sequence[int] = ()) -> None:
        """The waiting block checks, made now (``BlockChecks.flush``); a failure is counted."""
        try:
            last = self.blocks.last()
            waiting = self.blocks.take()
            if not waiting or waiting[-1] is not last:  # the root's output changed since: no record takes it
                alias = ()
            into = [(st, self.by_name[st.name]) for st in self._at.get(S.BLOCK, ())]
            for key, t in self.blocks.flush(waiting, into, alias, self.rows):
                self.record_values(S.BLOCK, key, t)
        except Exception as exc:
            self._errors.record("forward", exc)
        self.rows.finish()  # before anything commits a record that views a table

    def drop_outputs(self) -> None:
        self.outputs.drop()
        self.derived = {}
        self.root_derived = None

    def derives_last(self, t: torch.Tensor, key: int) -> bool:
        """Whether ``t`` is the last waiting layer output, unchanged, of a layer that is a
        block; if so, the BLOCK record ``key`` (the root's output) is taken from its row too."""
        last = self.outputs.last()
        if last is None or t is not last[1] or t._version != last[2] or last[0] not in self.derived:
            return False
        self.root_derived = (key, last[0], t)
        return True

    def flush_outputs(self) -> None:
        """The layers' outputs that waited for the end of the forward (:attr:`outputs`),
        recorded now, all at once (``Statistic.record_many``), and the block records taken
        from them (:attr:`derived`, :attr:`root_derived`); a failure is counted."""
        derived, root = self.derived, self.root_derived
        self.derived, self.root_derived = {}, None
        try:
            waiting = self.outputs.take()
            if not waiting:
                return
            into = [(st, self.by_name[st.name]) for st in self._at.get(S.OUTPUT, ())]
            lost: List[str] = []  # statistics whose records failed: a failure costs only its own

            def failed(st: Statistic, exc: Exception) -> None:
                lost.append(st.name)
                self._errors.record("forward", exc)
            alone = self.outputs.flush(waiting, into, failed=failed)
            for key, t in alone:  # recorded one by one, its blocks' records taken from its own
                self.record_values(S.OUTPUT, key, t)
            if not derived:
                return
            if any(st.derive[0] in lost for st in self._at.get(S.BLOCK, ())):  # type: ignore[index]
                alone = [(key, t) for key, t, _ in waiting]  # no rows to take them from: read them now
            else:
                self._derive_rows(S.BLOCK, derived, root if root is not None and not any(
                    t is root[2] for _, t in alone) else None)
            for key, t in alone:
                if key in derived:
                    self.record_values(S.BLOCK, derived[key], t)
                if root is not None and t is root[2]:
                    self.record_values(S.BLOCK, root[0], t)
        except Exception as exc:
            self._errors.record("forward", exc)

    def flush_grads(self) -> None:
        """The layers' output gradients that waited for the end of the backward
        (:attr:`grads`), recorded now, all at once; a failure is counted."""
        try:
            waiting = self.grads.take()
            if waiting:
                into = [(st, self.by_name[st.name]) for st in self._at.get(S.OUTPUT_GRAD, ())]
                for key, g in self.grads.flush(waiting, into, failed=lambda st, exc: self._errors.record("grad_flow", exc)):
                    values_of = self.measurable(g, S.OUTPUT_GRAD, key)
                    if values_of is not None:
                        self.record(S.OUTPUT_GRAD, key, values_of, "grad_flow")
        except Exception as exc:
            self._errors.record("grad_flow", exc)

    def _derive_rows(self, at: str, derived: Mapping[int, int], root: Optional[Tuple[int, int, torch.Tensor]]
                     ) -> None:
        """Records at ``at`` of the block each layer of ``derived`` is (one per row of it: a
        layer called twice is two records) and of the root's output (``root``: its key and
        the layer whose last row it is), taken from the rows just made of the layers'
        outputs (``Statistic.derive``: its pick, given a block of rows transposed, a vector
        of column vectors, picks columns)."""
        for st in self._at.get(at, ()):
            source, pick = st.derive  # type: ignore[misc]
            keys, numels, parts = self.by_name[source].pending_rows[-1]
            at_row = [(i, derived[key]) for i, key in enumerate(keys) if key in derived]
            if root is not None:
                at_row.append((max(i for i, key in enumerate(keys) if key == root[1]), root[0]))
            index = stats.host_values([i for i, _ in at_row], parts[0].device, torch.int64)
            picked = pick(tuple(part.index_select(0, index).T for part in parts))
            self.by_name[st.name].add_rows([block for _, block in at_row], [numels[i] for i, _ in at_row],
                                           [col.unsqueeze(1) for col in picked])

    def record_values(self, at: str, key: int, values: Any,
                      grad_flow: Optional[Callable[[int, torch.Tensor], None]] = None) -> None:
        """Records of each floating-point tensor among ``values`` (and ``grad_flow(key, grad)``
        hooked on each that requires grad, where given); one that cannot be measured, or
        whose measurement fails, costs only its own records."""
        for t in iter_tensors(values):
            if not is_floating(t) or t.numel() == 0:
                continue
            try:
                values_of = self.measurable(t, at, key)
                if values_of is None:
                    continue
                self.record(at, key, values_of, "forward")
                if grad_flow is not None and t.requires_grad:
                    t.register_hook(partial(grad_flow, key))
            except Exception as exc:
                self._errors.record("forward", exc)

    def record(self, at: str, key: int, t: torch.Tensor, stage: str) -> None:
        """One record of every statistic recorded at ``at``, of the tensor ``t``; a
        statistic that fails on it misses this record alone (counted under ``stage``). The
        tensor recorded last at ``at``, recorded again unchanged, reuses its records: a
        model whose forward returns its last child's output (the logits: an LLM's largest
        tensor) would otherwise be read twice every step, as a block and as the root."""
        last = self._last.get(at)
        if last is not None and last[0] is t and last[1] == version_of(t):
            made = last[2]
        else:
            made = []
            for st in self._at.get(at, ()):
                if st.dtypes is None or t.dtype in st.dtypes:
                    try:
                        made.append((st, self._make(st, key, t)))
                    except Exception as exc:
                        self._errors.record(stage, exc)
            # one tensor held per moment, until the next record or the end of the pass
            self._last[at] = (t, version_of(t), made)
        for st, parts in made:
            self.by_name[st.name].add(key, t.numel(), parts)

    def _make(self, st: Statistic, key: int, t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``st``'s record of ``t`` (of record ``key``): derived from another's where it can
        be; BLOCK_FINITE's made by batch row where ``t`` has the batch's rows (into
        ``self.rows``). A block derived from its activation record (a direct child that is
        a layer, on a detail step) has no rows that step: they would cost another pass."""
        derived = st.derive is not None and self._derived(st, t)
        if derived:
            return derived
        if st is S.BLOCK_FINITE and stats.has_rows(t, self.rows.size):
            return self.rows.check(key, t)
        return st.record(t)

    def _derived(self, st: Statistic, t: torch.Tensor) -> Optional[Tuple[torch.Tensor, ...]]:
        """``st``'s record of ``t`` taken from the record another statistic made of it
        (see ``Statistic.derive``), or None where there is none."""
        source, pick = st.derive
        for tensor, version, made in self._last.values():
            if tensor is t and version == version_of(t):
                parts = next((parts for other, parts in made if other.name == source), None)
                if parts is not None:
                    return pick(parts)
        return None

    def measurable(self, t: torch.Tensor, at: str, key: int) -> Optional[torch.Tensor]:
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
