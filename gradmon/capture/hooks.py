"""The hooks: everything gradmon does on the training thread.

* Forward hooks on the root module, its top-level blocks and each layer record activation
  statistics and, for gradient flow, put a tensor hook on the layer's output
  (:class:`forward.Forward`).
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
  steps, the weights (the WEIGHT moment) and what the optimizer did (``optimizer.read``:
  the OPTIMIZER moment).

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import statistics as S
from ..config import Config
from ..errors import ErrorLog
from ..statistics import Statistic
from . import amp, optimizer, sharded, traced, writer
from .boundary import Event, StepBoundary
from .forward import WAIT_TIMED, Forward, LayerHooks
from .grads import ParamGradients
from .guard import Guards
from .layers import Layer
from .modelhooks import BlockForward, ModelHook
from .owners import Owners
from .packet import GlobalStepUpdate, StepPacket
from .params import ParamSlots
from .passes import BackwardPasses, graph_task_id
from .records import KEEP_SCRATCH_EVERY, StepRecords
from .stepguard import StepGuard, StepSignals, stepped_with_closure
from .traced import TracedSlots
from .values import StepValues

log = logging.getLogger("gradmon")


class Recorder:
    """Per-step state of one monitor on the training thread: device tensors and small lists.

    The backward and step hooks' entry points (``on_*``, ``observe_loss``, ``manual_step``);
    what they keep lives in units of their own: the forward hooks (``Forward``), the step's
    records (``StepRecords``) and its other values (``StepValues``), backward passes
    (``BackwardPasses``), the parameters (``ParamSlots``) and their gradients
    (``ParamGradients``), the optimizers that step them (``Owners``) and what those did
    (``optimizer.Reads``), the step boundary (``StepBoundary``), the packet's writer
    (``writer.write``), the guard around every hook (``Guards``).
    """

    def __init__(self, layers: Sequence[Layer], cfg: Config, errors: ErrorLog,
                 publish: Callable[[object], None], statistics: Sequence[Statistic] = (S.GRAD,),
                 flat_units: Sequence[sharded.FlatUnit] = (), step_guard: Optional[StepGuard] = None) -> None:
        self.cfg = cfg
        self.statistics = tuple(statistics)
        self._at: Dict[str, Tuple[Statistic, ...]] = {
            at: tuple(st for st in self.statistics if st.at == at)
            for at in (S.PARAM_GRAD, S.LOCAL_GRAD, S.OUTPUT, S.OUTPUT_GRAD, S.BLOCK, S.LAYER, S.OPTIMIZER, S.WEIGHT)}
        self.errors = errors
        self.publish = publish
        self._params = ParamSlots(layers)
        self.param_layer = self._params.param_layer
        self._grads = ParamGradients(self._at[S.PARAM_GRAD], self.current_params(), flat_units, self._at[S.WEIGHT])
        self.sharded = self._grads.sharded
        self._params.lasting = bool(self._at[S.LOCAL_GRAD]) or self.sharded
        self._passes = BackwardPasses(self.current_params)
        self._params_now: Optional[List[Optional[torch.Tensor]]] = None  # as this step's measure saw them
        self.scaler = cfg.scaler
        self._values = StepValues(cfg.scaler)
        self._step = StepBoundary()
        self._owners = Owners(self.current_params)
        self._reads = optimizer.Reads(cfg.optimizer_sample)
        self._active = True
        self._guard = Guards(errors)
        self._forward_warned = False
        self.step_guard = step_guard  # guard=: skips a bad optimizer step (StepGuard), None when off
        self.steps = 0
        self.step_offset = 0
        self._signals = StepSignals(self._at[S.PARAM_GRAD], self._values, self._grads.sharded, self.current_params)
        self._rec = StepRecords(self.statistics, tuple(layer.name for layer in layers), errors,
                                keep_scratch=cfg.detail_every <= KEEP_SCRATCH_EVERY)
        self.forward = Forward(self.statistics, self._rec, self._guard, errors,
                               self._on_backward_start, self._enter_backward, self._params.root_forward,
                               self._params.outside_root)

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, on: bool) -> None:
        self._active = self.forward.active = on

    @property
    def detail_now(self) -> bool:
        """This step reads the layers (``detail_every``)."""
        return self.forward.detail_now

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
        self.forward.collector.release()
        self._params.release()
        self._values.reset()
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
        if not self._active:
            return
        passes = self._passes
        if passes.accumulated and not self._at[S.LOCAL_GRAD] and graph_task_id() == passes.queued:
            return  # this backward's callback is queued: nothing else to do (77 calls a step on a small GPT)
        with self._guard("backward"):
            passes.accumulated = True
            self._enter_backward()
            if self._at[S.LOCAL_GRAD] and p.grad is not None:
                self._rec.record(S.LOCAL_GRAD, param, sharded.local(p.grad), "backward")

    # -- end of backward -----------------------------------------------------------

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if not self._active:
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
        self._rec.grads.drop()
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
        if not self._active:
            return
        with self._guard("backward", self._step.fail):
            self.forward.take_traced()  # a compiled forward's records
            # OUTPUT too: reentrant checkpointing re-runs forwards inside backward
            self._rec.flush_blocks()
            self._rec.flush_grads()
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
                self._params.measured(passes.seen())
                self._values.read_scale()
                self._step.fire(Event.BACKWARD)  # even if measuring fails: the step must still count
                self._measure_grads()
        if self.step_guard is not None and self.step_guard.deferred_measured():
            self._guard_step(self.step_guard.take_deferred())  # inside step(closure): its gradients exist now

    def _measure_grads(self) -> None:
        self._params_now = params = self.current_params()
        self._values.drop(self._at[S.PARAM_GRAD])
        self._values.add(self._grads.measure(params))
        if self.step_guard is not None:
            self.step_guard.measured(self._signals)

    # -- observed values -------------------------------------------------------------

    @torch._dynamo.disable  # a compiled train step calling observe() must not trace gradmon's state
    def observe_loss(self, loss: Any) -> None:
        """One micro-batch's loss: added on its device, never read; the step's packet
        carries the mean. Bad input is counted (stage ``observe``), never raised."""
        if not self._active:
            return
        with self._guard("observe"):
            self._values.loss.add(loss)

    def hash_rows(self, on: bool) -> None:
        """Hash the rows of the root's inputs (an incident's fallback for sample ids), or
        stop: on at attach with an ``incident_dir``, off once the job gives ids."""
        self._rec.rows.hashing = on

    # -- step boundary -------------------------------------------------------------

    def on_optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A global hook: it runs for every optimizer in the process, so nothing may escape.
        try:
            if not self._active or not self._owners.owns(opt):
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
                self._values.read_scale()
                self._measure_grads()
                if self._values.batched:
                    self._params.measured_unseen()
        if self.step_guard is not None:
            if stepped_with_closure(opt, args, kwargs):  # Lightning, LBFGS: the closure's backward is still to come
                self.step_guard.defer(opt)
            else:
                self._guard_step(opt)

    def _guard_step(self, opt: torch.optim.Optimizer) -> None:
        """The step guard's decision, applied to ``opt`` before it steps. Its collective
        runs on every rank whatever failed before; ``GuardPersisted`` is the one exception
        gradmon raises into training, and only when asked to (``guard_on_persist``)."""
        guard = self.step_guard
        with self._guard("step"):
            guard.before_step(opt, self._signals)
        guard.raise_if_persisted()

    def on_optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if self.step_guard is not None and self._active and self._owners.owns(opt):
                if self.step_guard.take_deferred() is opt:  # a closure without a backward: agree all the same
                    self._guard_step(opt)
                self.step_guard.after_step(opt)  # before anything reads the optimizer's flag or gradients
            if not self._active or not self._owners.owns(opt) or not self._step.measured:
                return
            gs = optimizer.step_count(opt)
            self._values.read_optimizer(opt)
        except Exception as exc:
            self.errors.record("step", exc)
            return
        self._read_optimizer(opt)
        self.end_step(gs, by_optimizer=True)

    def _read_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """After the step that closes this one, before its packet: the weights and what the
        optimizer did, on sampled steps (``optimizer_every``). A second optimizer over the
        same model steps after the packet is closed: its parameters stay unread (counted as
        uncovered)."""
        every = self.cfg.optimizer_every
        if not every or self.steps % every:
            return
        if self._at[S.WEIGHT]:
            with self._guard("step"):
                self._values.add(self._grads.measure_weights(self.current_params()))
        if self.step_guard is not None and self.step_guard.skipped_on_host:
            return  # a step the guard skipped did nothing to read
        with self._guard("step"):
            if self._at[S.OPTIMIZER]:
                self._values.add(self._reads.rows(opt, self.current_params(), self.sharded, self._at[S.OPTIMIZER]))

    def manual_step(self, global_step: Optional[int]) -> None:
        if not self._active:
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
                if self._values.batched:
                    self._params.measured_unseen()
        if global_step is not None:
            self.step_offset = global_step - (self.steps + 1)
        self.end_step(None, by_optimizer=False)

    def on_scaler_update(self) -> None:
        """Once per iteration, stepped or not: a backward without an optimizer step was a
        step the scaler skipped on overflow."""
        if not self._active:
            return
        if not self._step.skipped_at_update:
            self._step.fire(Event.SCALER_UPDATE)
            return
        with self._guard("step"):
            try:
                packet = StepPacket(self.steps, self.step_offset + self.steps, time.time(), skipped=True)
                self.publish(writer.write(packet, (), {}, {}, None, self._values.scalars(amp.scale_tensor(self.scaler)),
                                          self.errors))
            finally:
                self._step.fire(Event.SCALER_UPDATE)  # closes the step as skipped
                self._close_step()

    def end_step(self, optimizer_step: Optional[int], by_optimizer: bool) -> None:
        with self._guard("step"):
            index = self.steps
            global_step = optimizer_step if optimizer_step is not None else self.step_offset + index + 1
            rows, hashes = self._rec.rows.take()
            packet = StepPacket(index, global_step, time.time(), measured_at_step=self._step.measured_at_step,
                                learning_rates=self._values.host_learning_rates(), rows=rows, row_hashes=hashes)
            self._grads.reduce(self._values.batched, self._step.failed, self.errors)
            try:
                if self.forward.take_traced():  # a compiled forward that no backward followed
                    self._rec.commit(self._rec.each(*S.FORWARD), "forward")
                self._check_forward_hooks_ran(index)
                # what a forward or backward that did not complete recorded is not this step's
                self._rec.drop_pending()
                scalars = self._values.scalars(self._values.scale)
                if self.step_guard is not None:
                    scalars += self.step_guard.scalars()
                packet = writer.write(packet, self.statistics, self._rec.by_name, self._values.batched,
                                      self._values.scale, scalars, self.errors,
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
            self.forward.next_step(self.steps % self.cfg.detail_every == 0)
            try:
                self._next_hooks()
            except Exception as exc:
                self.errors.record("step", exc)

    def _check_forward_hooks_ran(self, index: int) -> None:
        """Say once when a backward measured the step's gradients but none of this
        monitor's forward hooks ran: compiled code without them ran the forward. Judged on
        detail steps only, when every layer is hooked: a backward into monitored parameters
        came through some layer's forward (an ordinary step may call a module below the
        blocks, whose layers then have no hook)."""
        forward = self.forward
        if (forward.ran or self._step.measured_at_step or self._forward_warned or not forward.detail_now
                or forward.layer_hooks is None):
            forward.ran = False
            return
        self._forward_warned = True
        log.warning("gradmon: step %d had a backward but none of gradmon's forward hooks ran. %s",
                    index, traced.HOOKS_COMPILED_OUT)

    def _next_hooks(self) -> None:
        """The hooks the next step needs, and only those: per-parameter hooks while a
        backward gradmon did not see may come (or LOCAL_GRAD reads them), the layers'
        forward hooks on the steps that read them. Under torch.compile hooks stay as they
        are (adding or removing one would recompile the model)."""
        self._params.next_step(bool(self._at[S.LOCAL_GRAD]) or self.forward.compiled)
        # parameters replaced since the last step are measured from now on
        self.hook_params(self._params_now)
        self._params_now = None
        self.forward.want_layer_hooks()

    def _close_step(self) -> None:
        try:
            self._values.reset()
            self._passes.accumulated = False
            self._rec.reset()
        finally:  # the step's records are gone: the collector has nothing of them left to look at
            self.forward.collector.release()


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
            forward = recorder.forward
            if recorder.statistics_at(S.BLOCK):
                forward.blocks = len(blocks)
                index = {id(layer.module): layer.index for layer in layers}
                layered = bool(recorder.statistics_at(S.OUTPUT, S.OUTPUT_GRAD, S.LAYER))
                for key, block in enumerate(blocks, start=1):
                    if layered and id(block) in index:
                        both[id(block)] = index[id(block)]
                    forward.keys[id(block)] = key
                    # one block in WAIT_TIMED charges its inline test to gradmon's clock
                    lanes = None if id(block) in both else forward
                    self._handles.append(BlockForward(
                        block, forward.layer_block_hook if id(block) in both else forward.block_hook, key, lanes,
                        0 if key % WAIT_TIMED else WAIT_TIMED))
            forward.layer_keys.update((id(layer.module), layer.index) for layer in layers)
            forward.traced = self._traced_slots(recorder, root, layers, blocks, f"{id(recorder):x}")
            if recorder.statistics_at(S.OUTPUT, S.OUTPUT_GRAD, S.LAYER):
                forward.layer_hooks = LayerHooks([layer for layer in layers if id(layer.module) not in both],
                                                 forward.layer_hook)
                self._handles.append(forward.layer_hooks)
                forward.layer_hooks.want(True)  # the first step is a detail step
            self._handles.append(root.register_forward_pre_hook(ModelHook(forward.on_root_forward_pre),
                                                                with_kwargs=True))
            self._handles.append(root.register_forward_hook(ModelHook(forward.on_root_forward)))
            self._handles.append(root.register_forward_hook(ModelHook(forward.on_root_exit), always_call=True))
            if recorder.scaler is not None:
                self._handles.append(amp.UpdateHook(recorder.scaler, recorder.on_scaler_update))
            recorder.hook_params()
            self._handles.append(register_optimizer_step_pre_hook(recorder.on_optimizer_pre))
            self._handles.append(register_optimizer_step_post_hook(recorder.on_optimizer_post))
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def _traced_slots(recorder: Recorder, root: nn.Module, layers: Sequence[Layer], blocks: Sequence[nn.Module],
                      tag: str) -> TracedSlots:
        """Where the hooks compiled with the model leave their records, and which key each is."""
        slots = TracedSlots(recorder.statistics, tag)
        slots.watch(root, traced.INPUT, 0)
        for key, block in enumerate(blocks, start=1):
            slots.watch(block, traced.BLOCK, key)
        slots.watch(root, traced.OUTPUT, len(blocks) + 1)
        for layer in layers:
            slots.watch(layer.module, traced.LAYER, layer.index)
        return slots

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
