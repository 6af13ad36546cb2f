"""The forward hooks of one monitor: the root module's, its top-level blocks' and, on the
steps that read them, the layers'; what they record goes into the step's records
(``StepRecords``), and the outputs they see mark where a backward will start.

Tensor hooks on a layer's output rather than ``register_full_backward_hook``: a full
backward hook wraps the output in a BackwardHookFunction, so an in-place op on it
(``ReLU(inplace=True)`` after a Conv/BN, as in torchvision's ResNet) raises inside the
user's forward, and under ``torch.compile`` one module backward hook makes the whole model
run eagerly. A tensor hook registered before an in-place op receives the gradient of the
value the layer returned, which is exactly gradient flow, and covers the same layers.
"""

from __future__ import annotations

import weakref
from functools import partial
from time import perf_counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import statistics as S
from ..errors import ErrorLog
from ..statistics import Statistic
from .collector import CollectorPause
from .guard import Guards
from .layers import Layer
from .modelhooks import ModelHook
from .records import BlockChecks, StepRecords, iter_tensors
from . import traced
from .traced import TracedSlots


def _recomputed_twice() -> bool:
    """A forward that activation checkpointing re-runs inside backward, whose original
    was already measured. Non-reentrant checkpointing ran the original with grad
    enabled (measured): skip the re-run. Reentrant checkpointing ran the original under
    no_grad (skipped as an eval forward): its re-run, inside CheckpointFunctionBackward,
    is the only training forward there is, so it is measured once, there."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ != "CheckpointFunctionBackward"


WAIT_TIMED = 8
"""One block in this many (by key) has its ordinary step's check timed, scaled, for
gradmon_overhead_seconds_total (a clock read costs about as much as the check)."""


class Forward:
    """The forward hooks' entry points (``on_*``) and what they keep from one call to the
    next: whether the root's forward is running, whether this step reads the layers
    (``detail_now``), whether a hook ran inside a compiled region (``compiled``), whether
    any ran since the last step (``ran``).

    Inside a compiled region (``torch.compiler.is_compiling()``, which dynamo folds to
    True when it traces a hook) each hook takes its traced branch first: its records go
    to its slot in ``traced`` (see ``capture/traced.py``), read by the host after the
    forward (:meth:`take_traced`).

    ``on_backward_start(grad)`` is hooked on the outputs a backward starts from (the
    root's, or a top-level block's called alone); ``enter_backward()`` runs first in each
    layer's gradient-flow hook."""

    def __init__(self, statistics: Sequence[Statistic], records: StepRecords, guard: Guards, errors: ErrorLog,
                 on_backward_start: Callable[[torch.Tensor], None], enter_backward: Callable[[], None],
                 root_forward: Callable[[], None] = lambda: None,
                 outside_root: Callable[[], None] = lambda: None) -> None:
        def at(moment: str) -> Tuple[Statistic, ...]:
            return tuple(st for st in statistics if st.at == moment)
        self._block, self._layer, self._grad_flow = bool(at(S.BLOCK)), bool(at(S.LAYER)), bool(at(S.OUTPUT_GRAD))
        # a record at OUTPUT that flags a layer's non-finite values (the activation statistic)
        self._output_has_extremes = any(st.origin == S.LAYER_FINITE.origin for st in at(S.OUTPUT))
        # the blocks' checks wait for the end of each training forward, detail steps included:
        # only a block that is a layer is checked in its hook on a detail step (on_block)
        self._batch_blocks = all(st.record_many is not None for st in at(S.BLOCK))
        # a detail step's layer outputs are recorded at the end of the forward too, where every
        # statistic recorded of them can be made many at once
        self._batch_outputs = bool(at(S.OUTPUT)) and all(st.record_many is not None for st in at(S.OUTPUT))
        self._batch_grads = bool(at(S.OUTPUT_GRAD)) and all(st.record_many is not None for st in at(S.OUTPUT_GRAD))
        self._rec = records
        self._guard = guard
        self._errors = errors
        self._on_backward_start = on_backward_start
        self._enter_backward = enter_backward
        self._root_forward = root_forward  # called as the root's (eager) training forward begins
        self._outside_root = outside_root  # called once a step when a layer runs outside the root's forward
        self._outside_told = False
        self.active = True
        self.detail_now = True
        self.compiled = False  # a hook ran inside a compiled region: hooks stay as they are
        self.ran = False  # a hook of this monitor ran since the last step (see Recorder.end_step)
        self.traced: Optional[TracedSlots] = None  # set by HookSet.install
        self.keys: Dict[int, int] = {}  # id(top-level block) -> its BLOCK key
        self.layer_keys: Dict[int, int] = {}  # id(layer) -> its index
        self.blocks = 0  # the root module's direct children: BLOCK keys 1..blocks
        self.layer_hooks: Optional[LayerHooks] = None  # set by HookSet.install
        self._in_root = False  # inside the root's forward
        # inside a root's (eager) training forward whose block checks wait: where the blocks'
        # outputs are kept, by their hooks' lean path and by their forwards (BlockForward)
        self.lane: Optional[BlockChecks] = None
        # likewise the layers' outputs, inside a detail step's root training forward
        self._outputs: Optional[BlockChecks] = None
        self.collector = CollectorPause()  # from a detail step's first training forward to its close

    def next_step(self, detail: bool) -> None:
        """The next step reads the layers (a detail step) or not."""
        self.detail_now = detail
        self._outside_told = False
        if self.traced is not None:
            self.traced.arm(detail)

    def want_layer_hooks(self) -> None:
        """The layers' hooks registered for the next step if it reads them, else removed;
        under torch.compile they stay (adding or removing one would recompile the model)."""
        if self.layer_hooks is not None:
            self.layer_hooks.want(self.detail_now or self._layer or self.compiled)

    def _training_forward(self, module: nn.Module) -> bool:
        return self.active and module.training and torch.is_grad_enabled() and not _recomputed_twice()

    def _traced_forward(self, module: nn.Module) -> bool:
        """A training forward, inside a compiled region: ``active`` (which changes only at
        detach, then at the cost of one recompile) and what dynamo guards anyway; a
        recomputation under compiled activation checkpointing is the compiler's own."""
        self.compiled = self.ran = True
        return self.active and self.traced is not None and module.training and torch.is_grad_enabled()

    def take_traced(self) -> bool:
        """The records the last compiled forward left, into this step's records (pending);
        whether there were any. Nothing to look at before a hook ran compiled."""
        return self.compiled and self.traced is not None and self.traced.take(self._rec, self.detail_now)

    def on_root_forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward whose root never returned (it raised) left records: drop them. The
        batch's own values are the first block record (key 0): a NaN that came with the
        data is named ``input``, not blamed on the first layer that passed it on."""
        if torch.compiler.is_compiling():
            if self._traced_forward(module) and self._block:
                self.traced.record(module, traced.INPUT, (args, kwargs))
            return
        if not self.active:
            return
        self.ran = True
        self._rec.drop_pending(*S.FORWARD)
        self._rec.blocks.drop()
        self._rec.drop_outputs()
        self._in_root = True
        training = self._training_forward(module)
        self.lane = self._rec.blocks if self._batch_blocks and self._block and training else None
        self._outputs = self._rec.outputs if self._batch_outputs and self.detail_now and training else None
        with self._guard("forward"):
            if training:
                self._root_forward()
            if training and self.detail_now:
                self.collector.hold()
            self._rec.rows.start(module, args, kwargs)
            if self._block and training:
                self._record_input(args, kwargs)
        if training and self._rec.rows.hashing:
            with self._guard("forward"):  # apart: a failure here costs only the row hashes
                self._rec.rows.hash_inputs(args, kwargs)

    def _record_input(self, args: Any, kwargs: Any) -> None:
        """The batch's values, block record 0: a lone small input tensor waits for the end
        of a training forward with the blocks' small outputs, on the same terms
        (``BlockChecks.defer``); anything else is checked now (a large one, which the
        caller keeps alive, would be weighed as held by autograd only where a layer saves it)."""
        lane = self.lane
        if lane is not None and not kwargs and len(args) == 1 and lane.plain(args[0]) and lane.defer(0, args[0]):
            return
        self._rec.record_values(S.BLOCK, 0, (args, kwargs))

    def on_root_exit(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """The root's forward ended, returned or raised (``always_call``). A forward that
        returned has had its waiting block outputs checked (:meth:`on_root_forward`); one
        that raised (out of memory, say) leaves them unchecked, and none may stay held: a
        retry must find the memory free."""
        self._in_root = False
        self.lane = self._outputs = None
        self._rec.blocks.drop()
        self._rec.drop_outputs()

    # The hooks registered on blocks and layers carry no index of their own (a partial's
    # arguments are guarded when compiled, so identical blocks compiled one by one would
    # each compile again): the eager path looks the module's keys up.

    def block_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """A top-level block's forward hook (one that is also a layer: :meth:`layer_block_hook`)."""
        if torch.compiler.is_compiling():
            if self._traced_forward(module):
                self.traced.record(module, traced.BLOCK, output)
            return
        key = self.keys[id(module)]
        if not self._waits(key, module, output):
            self._check_block(key, module, output)

    def layer_block_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """The forward hook of a top-level block that is also a layer."""
        if torch.compiler.is_compiling():
            if self._traced_forward(module):
                self.traced.record(module, traced.LAYER, output)
                self.traced.record(module, traced.BLOCK, output)
            return
        self.on_block(self.keys[id(module)], self.layer_keys[id(module)], module, inputs, output)

    def layer_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """A layer's forward hook."""
        if torch.compiler.is_compiling():
            # no read of detail_now here (a guard: the model would compile again each time
            # it flips): the detail records are gated by a tensor the host sets (traced.py)
            if self._traced_forward(module):
                self.traced.record(module, traced.LAYER, output)
            return
        self.on_forward(self.layer_keys[id(module)], module, inputs, output)

    def on_block(self, block: int, layer: Optional[int], module: nn.Module, inputs: Any, output: Any) -> None:
        """A top-level block returned: its check waits for the end of the forward
        (:class:`BlockChecks`), else one small reduction now; on a detail step a block that
        is a layer takes its extremes from the activation record just made. Called alone,
        outside the root's forward, its output marks the start of the backward."""
        if layer is not None:
            waits = self._layer_returned(layer, module, output)
            if self.detail_now and self._output_has_extremes:
                if waits:  # taken from the activation rows made at the end of the forward
                    self._rec.derived[layer] = block
                else:  # taken from the record just made
                    self._check_block(block, module, output, defer=False)
                return
        if not self._waits(block, module, output):
            self._check_block(block, module, output)

    def _waits(self, block: int, module: nn.Module, output: Any) -> bool:
        """The lean path of a block already deferred, inside the root's training
        forward: its output joins the end-of-forward check (``BlockChecks.wait``). Run for
        every block of every forward, so with no guard object (a failure leaves the output to
        the guarded path, which checks it again and counts what fails) and on gradmon's clock
        one block in ``WAIT_TIMED`` (a clock read costs about as much as the rest), scaled."""
        timed = not block % WAIT_TIMED
        t0 = perf_counter() if timed else 0.0
        try:
            lane = self.lane
            waits = (lane is not None and type(output) is torch.Tensor and module.training
                     and torch.is_grad_enabled() and lane.wait(block, output))
        except Exception:  # noqa: BLE001 - an inference tensor has no version counter, say
            waits = False
        if timed:
            self._guard.seconds += WAIT_TIMED * (perf_counter() - t0)
        return waits

    @property
    def clock(self) -> Guards:
        """gradmon's clock on the training thread (``seconds``), which the blocks' forwards
        charge with their timed checks."""
        return self._guard

    def _check_block(self, block: int, module: nn.Module, output: Any, defer: bool = True) -> None:
        self.ran = True
        with self._guard("forward"):
            if self._training_forward(module):
                if not (defer and self._batch_blocks and self._rec.blocks.defer(block, output)):
                    self._rec.record_values(S.BLOCK, block, output)
                if not self._in_root:
                    self._watch_backward(output)

    def on_forward(self, layer: int, module: nn.Module, inputs: Any, output: Any) -> None:
        """A layer returned (a forward hook: it returns None, or it would replace the output)."""
        self._layer_returned(layer, module, output)

    def _layer_returned(self, layer: int, module: nn.Module, output: Any) -> bool:
        """:meth:`on_forward`; whether the layer's detail records wait for the end of the forward."""
        self.ran = True
        if not (self.detail_now or self._layer):
            return False
        waits = False
        with self._guard("forward"):
            if self._training_forward(module):
                if not (self._in_root or self._outside_told):
                    self._outside_told = True
                    self._outside_root()
                # on a detail step the activation record already holds the same extremes
                if not (self.detail_now and self._output_has_extremes):
                    self._rec.record_values(S.LAYER, layer, output)
                if self.detail_now:
                    waits = self._output_waits(layer, output)
                    if not waits:
                        self._rec.record_values(S.OUTPUT, layer, output,
                                                self.on_grad_flow if self._grad_flow else None)
        return waits

    def _output_waits(self, layer: int, output: Any) -> bool:
        """A detail step's small layer output, known from an earlier detail step to stay
        unchanged until the end of the forward (``BlockChecks.defer``), waits for it, to be
        recorded with the others at once (``StepRecords.flush_outputs``); its gradient-flow
        hook goes on now, before any in-place op can change it."""
        lanes = self._outputs
        if lanes is None or not lanes.defer(layer, output):
            return False
        if self._grad_flow and output.requires_grad:
            output.register_hook(partial(self.on_grad_flow, layer))
        return True

    def on_grad_flow(self, layer: int, grad: torch.Tensor) -> None:
        if not self.active or grad is None:
            return
        with self._guard("grad_flow"):
            self._enter_backward()
            # a small one waits for the end of the backward, measured with the others at once
            # (``StepRecords.flush_grads``), once a backward showed it unchanged until then
            if self._batch_grads and self._rec.grads.defer(layer, grad):
                return
            values_of = self._rec.measurable(grad, S.OUTPUT_GRAD, layer)
            if values_of is not None:
                self._rec.record(S.OUTPUT_GRAD, layer, values_of, "grad_flow")

    def on_root_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Commits the forward's records. Compiled with the model, it records the root's
        output and nothing else: no tensor hook on the output (``register_hook`` inside a
        compiled region breaks the graph); the monitored parameters' post-accumulate-grad
        hooks, kept under compile, tell the backward's start instead."""
        if torch.compiler.is_compiling():
            if self._traced_forward(module) and self._block:
                self.traced.record(module, traced.OUTPUT, output)
            return
        self.lane = self._outputs = None  # the outputs kept so far are measured now; none is kept after
        if not self.active:
            return
        with self._guard("forward"):
            self.take_traced()  # the top-level blocks compiled one by one (torchtitan's way)
            alias = self._record_root_output(module, output)
            self._rec.flush_outputs()
            self._rec.flush_blocks(alias)
            self._rec.end_of_pass()
            self._rec.commit(self._rec.each(*S.FORWARD), "forward")
            self._rec.rows.commit()
        if not torch.is_grad_enabled():
            return
        try:
            self._watch_backward(output)
        except Exception as exc:
            self._errors.record("backward", exc)

    def _record_root_output(self, module: nn.Module, output: Any) -> Tuple[int, ...]:
        """The root's output, the last block record; the keys that take the last block's
        record as theirs instead (its output returned unchanged). A failure costs only this
        record (counted)."""
        try:
            if self._block and self._training_forward(module):
                last = self._rec.blocks.last()
                if last is not None and output is last[1] and output._version == last[2]:
                    return (self.blocks + 1,)
                if not self._rec.derives_last(output, self.blocks + 1):
                    self._rec.record_values(S.BLOCK, self.blocks + 1, output)
        except Exception as exc:
            self._errors.record("forward", exc)
        return ()

    def _watch_backward(self, output: Any) -> None:
        """The gradient of ``output`` is the first thing a backward through it computes."""
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._on_backward_start)


class LayerHooks:
    """The layers' forward hooks, registered only for the steps that read them (detail
    steps, or every step with ``origin_per_layer``): a module with a forward hook leaves
    PyTorch's fast call path, which alone costs about a microsecond a call."""

    def __init__(self, layers: Sequence[Layer], hook: Callable[..., None]) -> None:
        self._layers = [weakref.ref(layer.module) for layer in layers]
        self._hook = hook
        self._handles: List[Any] = []

    def want(self, on: bool) -> None:
        if on and not self._handles:
            for ref in self._layers:
                module = ref()
                if module is not None:
                    self._handles.append(module.register_forward_hook(ModelHook(self._hook)))
        elif not on and self._handles:
            self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
