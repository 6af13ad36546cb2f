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

import logging
import time
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import statistics as S
from ..config import Config
from ..errors import ErrorLog
from ..statistics import Statistic
from . import amp, optimizer, sharded, writer
from .boundary import Event, StepBoundary
from .grads import ParamGradients
from .guard import Guards
from .layers import Layer
from .loss import LossMean
from .owners import Owners
from .packet import GlobalStepUpdate, StepPacket
from .params import ParamSlots
from .passes import BackwardPasses, graph_task_id
from .records import KEEP_SCRATCH_EVERY, StepRecords, iter_tensors

log = logging.getLogger("gradmon")


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


class Recorder:
    """Per-step state of one monitor on the training thread: device tensors and small lists.

    The hooks' entry points (``on_*``, ``observe_loss``, ``manual_step``); what they keep
    lives in units of their own: the step's records (``StepRecords``), backward passes
    (``BackwardPasses``), the parameters (``ParamSlots``) and their gradients
    (``ParamGradients``), the optimizers that step them (``Owners``) and what those did
    (``optimizer.Reads``), the step boundary (``StepBoundary``), the loss (``LossMean``), the
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
        self._grads = ParamGradients(self._at[S.PARAM_GRAD], self.current_params(), flat_units)
        self.sharded = self._grads.sharded
        # Per-parameter hooks find the end of a backward that passed through no output
        # gradmon saw (a forward of a deeper submodule), and record LOCAL_GRAD. They cost a
        # Python call per parameter per backward, so once a step shows every backward
        # passing through the root's output (or a top-level block's, called alone) they
        # are removed; a step whose gradients came from a backward gradmon did not see
        # (measured at the optimizer step) brings them back for good (self._params.hooked).
        self._unseen = False  # a step had gradients from a backward gradmon did not see
        self._step_seen = False  # this step's gradients were measured at the end of a seen backward
        self._passes = BackwardPasses(self.current_params)
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
        self._found_inf: Optional[torch.Tensor] = None  # a fused optimizer's overflow flag, this step
        self._rec = StepRecords(self.statistics, self._layer_names, errors,
                                keep_scratch=cfg.detail_every <= KEEP_SCRATCH_EVERY)

    @property
    def overhead(self) -> float:
        """Seconds the hooks spent on the training thread (gradmon_overhead_seconds_total)."""
        return self._guard.seconds

    def statistics_at(self, *moments: str) -> Tuple[Statistic, ...]:
        return tuple(st for at in moments for st in self._at[at])

    def current_params(self) -> List[Optional[torch.Tensor]]:
        """The monitored parameters as the modules hold them now (None: gone)."""
        return self._params.current()

    def release(self) -> None:
        """Drop every reference to the model so it can be garbage-collected after detach."""
        self.active = False
        self._params.release()
        self._batched = {}
        self._params_now = None
        self._rec.release()

    # -- parameter hooks -----------------------------------------------------------

    def hook_params(self, params: Optional[List[Optional[torch.Tensor]]] = None) -> bool:
        """Notice parameters replaced since last time (``params``: as the modules hold them
        now, if the caller has them) and keep the post-accumulate-grad hooks on the current
        ones while they are wanted; True if any parameter changed."""
        changed = self._params.sync(self.current_params() if params is None else params, self.on_param_grad)
        if changed:  # replaced parameters: every optimizer and the probe are asked again
            self._owners.forget()
            self._passes.forget_probe()
        return changed

    def on_param_grad(self, param: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: autograd accumulated this gradient in this backward.
        It runs inside AccumulateGrad, before DDP's reducer copies the gradient into its
        bucket, so ``p.grad`` is still this rank's own (the local view)."""
        if not self.active:
            return
        passes = self._passes
        if passes.accumulated and not self._at[S.LOCAL_GRAD] and graph_task_id() == passes.queued:
            return  # this backward's callback is queued: nothing else to do (77 calls a step on a small GPT)
        with self._guard("backward"):
            passes.accumulated = True
            self._enter_backward()
            if self._at[S.LOCAL_GRAD] and p.grad is not None:
                self._rec.record(S.LOCAL_GRAD, param, sharded.local(p.grad), "backward")

    # -- forward / grad flow -------------------------------------------------------

    def _training_forward(self, module: nn.Module) -> bool:
        return self.active and module.training and torch.is_grad_enabled() and not _recomputed_twice()

    @torch._dynamo.disable
    def on_root_forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward whose root never returned (it raised) left records: drop them. The
        batch's own values are the first block record (key 0): a NaN that came with the
        data is named ``input``, not blamed on the first layer that passed it on."""
        if not self.active:
            return
        self._rec.drop_pending(*S.FORWARD)
        self._rec.blocks.drop()
        self._in_root = True
        with self._guard("forward"):
            self._rec.rows.start(module, args, kwargs)
            if self._at[S.BLOCK] and self._training_forward(module):
                self._rec.record_values(S.BLOCK, 0, (args, kwargs))

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
                if not (self._defer_blocks and self._rec.blocks.defer(block, output)):
                    self._rec.record_values(S.BLOCK, block, output)
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
                    self._rec.record_values(S.LAYER, layer, output)
                if self.detail_now:
                    self._rec.record_values(S.OUTPUT, layer, output,
                                            self.on_grad_flow if self._at[S.OUTPUT_GRAD] else None)

    def on_grad_flow(self, layer: int, grad: torch.Tensor) -> None:
        if not self.active or grad is None:
            return
        with self._guard("grad_flow"):
            self._enter_backward()
            values_of = self._rec.measurable(grad, S.OUTPUT_GRAD, layer)
            if values_of is not None:
                self._rec.record(S.OUTPUT_GRAD, layer, values_of, "grad_flow")

    # -- end of backward -----------------------------------------------------------

    @torch._dynamo.disable
    def on_root_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Runs eagerly even when the model is compiled (a graph break after the whole
        forward, not inside it), so end-of-backward measurement works under compile."""
        if not self.active:
            return
        with self._guard("forward"):
            self._rec.flush_blocks(self._record_root_output(module, output))
            self._rec.end_of_pass()
            self._rec.commit(self._rec.each(*S.FORWARD), "forward")
            self._rec.rows.commit()
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
                last = self._rec.blocks.last()
                if last is not None and output is last[1] and output._version == last[2]:
                    return (self.blocks + 1,)
                self._rec.record_values(S.BLOCK, self.blocks + 1, output)
        except Exception as exc:
            self.errors.record("forward", exc)
        return ()

    def _watch_backward(self, output: Any) -> None:
        """The gradient of ``output`` is the first thing a backward through it computes."""
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if not self.active:
            return
        try:
            self._enter_backward()
            self._passes.through_watched_output()
        except Exception as exc:
            self.errors.record("backward", exc)

    def _enter_backward(self) -> None:
        """First hook of a backward pass: queue its end-of-backward callback once. A pass
        that raised never ran its callback and left partial records: drop them."""
        if not self._passes.first_hook():
            return
        self._rec.drop_pending(S.OUTPUT_GRAD, S.LOCAL_GRAD)
        self._rec.end_of_pass()
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
            self._rec.flush_blocks()
            self._rec.end_of_pass()
            self._rec.commit(self._rec.by_name.values(), "backward")
            # Without an accumulated gradient (torch.autograd.grad, .grad assigned by
            # hand later) there is nothing to measure yet: the optimizer step will.
            # FSDP2 assigns sharded gradients itself, after its own callbacks. Parameters
            # replaced since the last step had no hook yet: they get one now.
            passes = self._passes
            if not (passes.accumulated or self.sharded) and self.hook_params():
                passes.accumulated = True
            if passes.accumulated or self.sharded:
                passes.accumulated = False
                self._step_seen = passes.seen()
                self._scale = amp.scale_tensor(self.scaler)
                self._step.fire(Event.BACKWARD)  # even if measuring fails: the step must still count
                self._measure_grads()

    def _measure_grads(self) -> None:
        self._params_now = params = self.current_params()
        for st in self._at[S.PARAM_GRAD]:
            self._batched.pop(st.name, None)
        self._batched.update(self._grads.measure(params))

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
                                learning_rates=S.host_learning_rates(self._learning_rates),
                                rows=self._rec.rows.take())
            self._grads.reduce(self._batched, self._step.failed, self.errors)
            try:
                # what a forward or backward that did not complete recorded is not this step's
                self._rec.drop_pending()
                packet = writer.write(packet, self.statistics, self._rec.by_name, self._batched, self._scale,
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
        self._passes.accumulated = False
        self._loss.reset()
        self._rec.reset()

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
