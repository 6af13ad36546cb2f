"""The hooks: everything gradmon does on the training thread.

* Forward hooks on each layer record activation statistics and, for gradient flow,
  put a tensor hook on the layer's output. Tensor hooks rather than
  ``register_full_backward_hook``: a full backward hook wraps the output in a
  BackwardHookFunction, so an in-place op on it (``ReLU(inplace=True)`` after a
  Conv/BN, as in torchvision's ResNet) raises inside the user's forward, and under
  ``torch.compile`` one module backward hook makes the whole model run eagerly. A
  tensor hook registered before an in-place op receives the gradient of the value the
  layer returned, which is exactly gradient flow, and covers the same layers.
* A tensor hook on the root module's output fires when backward starts and queues an
  end-of-backward callback; the callback re-queues itself once so that it runs after
  the callbacks DDP and FSDP queue during backward (their gradient reduction finishes
  there). It then reduces every parameter gradient: the accumulated, reduced gradient,
  before any ``clip_grad_norm_`` the user calls between backward and step.
* Global optimizer step hooks close the step: one packet, one device-to-host copy.

Between detail steps (``detail_every``) the forward hooks return at once. Nothing here
reads a device value on the host.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from functools import partial
from time import perf_counter
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import amp, sharded, stats
from .config import Config
from .errors import ErrorLog
from .layers import Layer, is_floating
from .snapshot import GlobalStepUpdate, StepPacket


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


def _optimizer_step_value(opt: torch.optim.Optimizer) -> Optional[int]:
    """The optimizer's own step count (Adam & co.), read without a device sync."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or "step" not in state:
                continue
            value = state["step"]
            if isinstance(value, (int, float)):
                return int(value)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                return int(value.tolist())  # tolist reads CPU memory, no dispatch, no sync
            return None  # capturable/fused state lives on the device: reading it would sync
    return None


class Recorder:
    """Per-step state of one monitor on the training thread: device tensors and small lists."""

    def __init__(self, layers: Sequence[Layer], cfg: Config, errors: ErrorLog,
                 publish: Callable[[object], None], local_view: bool = False) -> None:
        self.cfg = cfg
        self.local_view = local_view
        self.errors = errors
        self.publish = publish
        self.params: List[nn.Parameter] = [p for layer in layers for p in layer.params]
        self.param_layer: Tuple[int, ...] = tuple(layer.index for layer in layers for _ in layer.params)
        self._param_ids = frozenset(id(p) for p in self.params)
        self._shard_groups = sharded.plan(self.params)
        self.sharded = bool(self._shard_groups)
        self._measure_failed = False
        self.scaler = cfg.scaler
        self._scale: Optional[torch.Tensor] = None  # loss scale during this step's backward
        self._stepped = False
        self._owned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self._primary: Optional[weakref.ref] = None
        self.active = True
        self.overhead = 0.0
        self.steps = 0
        self.step_offset = 0
        self.detail_now = True
        self._grad: Optional[Tuple[torch.Tensor, Tuple[int, ...]]] = None
        self._backward_queued = False
        self._fresh_backward = False
        self._last_step_by_optimizer = False
        self._reset_records()

    def _reset_records(self) -> None:
        self._act_f: List[torch.Tensor] = []
        self._act_i: List[torch.Tensor] = []
        self._act_meta: List[Tuple[int, int]] = []
        self._flow_f: List[torch.Tensor] = []
        self._flow_i: List[torch.Tensor] = []
        self._flow_meta: List[int] = []
        self._local: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def release(self) -> None:
        """Drop every reference to the model so it can be garbage-collected after detach."""
        self.active = False
        self.params = []
        self._grad = None
        self._reset_records()

    # -- forward / grad flow -------------------------------------------------------

    def on_forward(self, layer: int, module: nn.Module, inputs: Any, output: Any) -> None:
        if _compiling():
            return
        if not (self.detail_now and self.active and module.training and torch.is_grad_enabled()):
            return
        t0 = perf_counter()
        try:
            if _recomputed_twice():
                return
            for t in iter_tensors(output):
                if not is_floating(t) or t.numel() == 0:
                    continue
                if self.cfg.activations:
                    f, i = stats.activation_record(t)
                    self._act_f.append(f)
                    self._act_i.append(i)
                    self._act_meta.append((layer, t.numel()))
                if self.cfg.grad_flow and t.requires_grad:
                    t.register_hook(partial(self.on_grad_flow, layer))
        except Exception as exc:
            self.errors.record("forward", exc)
        finally:
            self.overhead += perf_counter() - t0

    def on_grad_flow(self, layer: int, grad: torch.Tensor) -> None:
        if not self.active or grad is None:
            return
        t0 = perf_counter()
        try:
            f, i = stats.gradient_record(grad)
            self._flow_f.append(f)
            self._flow_i.append(i)
            self._flow_meta.append(layer)
        except Exception as exc:
            self.errors.record("grad_flow", exc)
        finally:
            self.overhead += perf_counter() - t0

    def on_local_grad(self, param: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: runs inside AccumulateGrad, before DDP's reducer
        copies the gradient into its bucket, so ``p.grad`` is still this rank's own
        (accumulated over ``no_sync`` micro-batches). The latest call per parameter wins."""
        if not self.active or p.grad is None:
            return
        t0 = perf_counter()
        try:
            self._local[param] = stats.gradient_record(p.grad)
        except Exception as exc:
            self.errors.record("backward", exc)
        finally:
            self.overhead += perf_counter() - t0

    # -- end of backward -----------------------------------------------------------

    @torch._dynamo.disable
    def on_root_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Runs eagerly even when the model is compiled (a graph break after the whole
        forward, not inside it), so end-of-backward measurement works under compile."""
        if not (self.active and torch.is_grad_enabled()):
            return
        try:
            for t in iter_tensors(output):
                if t.requires_grad:
                    t.register_hook(self._on_backward_start)
        except Exception as exc:
            self.errors.record("backward", exc)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if self._backward_queued or not self.active:
            return
        try:
            Variable._execution_engine.queue_callback(self._after_backward_queued)
            self._backward_queued = True
        except Exception as exc:
            self.errors.record("backward", exc)

    def _after_backward_queued(self) -> None:
        try:
            Variable._execution_engine.queue_callback(self._after_backward)
        except Exception as exc:
            self._backward_queued = False
            self.errors.record("backward", exc)

    def _after_backward(self) -> None:
        self._backward_queued = False
        if not self.active:
            return
        t0 = perf_counter()
        try:
            self._scale = amp.scale_tensor(self.scaler)
            self._measure_grads()
        except Exception as exc:
            self._measure_failed = True
            self.errors.record("backward", exc)
        finally:
            self._fresh_backward = True  # even if measuring failed: the step must still count
            self.overhead += perf_counter() - t0

    def _measure_grads(self) -> None:
        present: List[int] = []
        grads: List[torch.Tensor] = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None:
                present.append(i)
                grads.append(sharded.local(g))  # a shard's own elements; summed at the step
        if not grads:
            self._grad = None
            return
        block, order = stats.param_grad_stats(grads, grads[0].device)
        self._grad = (block, tuple(present[j] for j in order))

    # -- step boundary -------------------------------------------------------------

    def owns(self, opt: torch.optim.Optimizer) -> bool:
        try:
            return self._owned[opt]
        except KeyError:
            mine = any(id(p) in self._param_ids for g in opt.param_groups for p in g["params"])
            self._owned[opt] = mine
            if mine and self._primary is None:
                self._primary = weakref.ref(opt)
            return mine

    def on_optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active or not self.owns(opt):
            return
        t0 = perf_counter()
        try:
            # No end-of-backward callback ran (the root forward was bypassed): measure
            # now, after any clipping. Only for the first optimizer, so that a second
            # optimizer over the same model does not count the step twice.
            if not self._fresh_backward and self._primary is not None and self._primary() is opt:
                self._fresh_backward = True
                self._measure_grads()
        except Exception as exc:
            self._measure_failed = True
            self.errors.record("step", exc)
        finally:
            self.overhead += perf_counter() - t0

    def on_optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active or not self.owns(opt) or not self._fresh_backward:
            return
        gs: Optional[int] = None
        try:
            gs = _optimizer_step_value(opt)
        except Exception as exc:
            self.errors.record("step", exc)
        self.end_step(gs, by_optimizer=True)

    def manual_step(self, global_step: Optional[int]) -> None:
        if not self.active:
            return
        if self._last_step_by_optimizer and not self._fresh_backward and self.steps:
            # The optimizer hook already published this step; only its number changes.
            if global_step is not None:
                self.step_offset = global_step - self.steps
                self.publish(GlobalStepUpdate(global_step))
            return
        if not self._fresh_backward:
            t0 = perf_counter()
            try:
                self._measure_grads()
            except Exception as exc:
                self.errors.record("step", exc)
            finally:
                self.overhead += perf_counter() - t0
        if global_step is not None:
            self.step_offset = global_step - (self.steps + 1)
        self.end_step(None, by_optimizer=False)

    def on_scaler_update(self) -> None:
        """Once per iteration, stepped or not: a backward without an optimizer step was a
        step the scaler skipped on overflow."""
        if not self.active:
            return
        if self._stepped or not self._fresh_backward:
            self._stepped = False
            return
        t0 = perf_counter()
        try:
            scale = amp.scale_tensor(self.scaler)
            host, event = stats.to_host(scale.double()) if scale is not None else (None, None)
            self.publish(StepPacket(self.steps, self.step_offset + self.steps, time.time(), data=host, event=event,
                                    skipped=True, amp_scale=host is not None))
        except Exception as exc:
            self.errors.record("step", exc)
        finally:
            self._grad = None
            self._scale = None
            self._measure_failed = False
            self._fresh_backward = False
            self._reset_records()
            self.overhead += perf_counter() - t0

    def end_step(self, optimizer_step: Optional[int], by_optimizer: bool) -> None:
        t0 = perf_counter()
        index = self.steps
        self._stepped = True
        global_step = optimizer_step if optimizer_step is not None else self.step_offset + index + 1
        packet = StepPacket(index, global_step, time.time())
        if self._shard_groups:
            self._reduce_shards()
        try:
            packet = self._build_packet(packet)
        except Exception as exc:
            self.errors.record("step", exc)
        try:
            self.publish(packet)
        except Exception as exc:  # pragma: no cover - SimpleQueue.put does not fail
            self.errors.record("step", exc)
        self._grad = None
        self._scale = None
        self._measure_failed = False
        self._fresh_backward = False
        self._last_step_by_optimizer = by_optimizer
        self._reset_records()
        self.steps += 1
        self.detail_now = self.steps % self.cfg.detail_every == 0
        self.overhead += perf_counter() - t0

    def _reduce_shards(self) -> None:
        """The step's collective: every rank calls it at every step, whatever failed before."""
        block, order = self._grad if self._grad is not None else (None, ())
        try:
            block, _ok = sharded.all_reduce_columns(block, order, self._shard_groups, self._measure_failed)
            self._grad = (block, order) if block is not None else None
        except Exception as exc:
            self._grad = None
            self.errors.record("step", exc)

    def _build_packet(self, packet: StepPacket) -> StepPacket:
        parts: List[torch.Tensor] = []
        home: Optional[torch.device] = None
        grad_params: Tuple[int, ...] = ()
        inv_sq: Optional[torch.Tensor] = None
        inv: Optional[torch.Tensor] = None
        if self._scale is not None:
            # unscale on the device: gradients (and gradients w.r.t. outputs) carry the
            # loss scale, their sums of squares its square; NaN/Inf counts are unchanged
            inv = self._scale.double().reciprocal()
            inv_sq = inv.square()
        if self._grad is not None:
            block, grad_params = self._grad
            if inv_sq is not None:
                block = torch.cat((block[:1] * inv_sq.to(block.device), block[1:]))
            parts.append(block)
            home = block.device
        if self._act_f:
            home = home or self._act_f[0].device
            parts += [stats.stack_records(self._act_f, home), stats.stack_records(self._act_i, home)]
        if self._flow_f:
            home = home or self._flow_f[0].device
            flow = stats.stack_records(self._flow_f, home)
            if inv is not None:
                flow = flow.double() * inv.to(home)
            parts += [flow, stats.stack_records(self._flow_i, home)]
        local_params = tuple(sorted(self._local))
        if local_params:
            records = [self._local[i] for i in local_params]
            home = home or records[0][0].device
            parts += [stats.stack_records([f for f, _ in records], home),
                      stats.stack_records([c for _, c in records], home)]
        if self._scale is not None:
            home = home or self._scale.device
            parts.append(self._scale)
        if home is None:
            return packet
        data, event = stats.to_host(stats.pack(parts, home))
        return dataclasses.replace(
            packet, data=data, event=event, grad_params=grad_params,
            act_meta=tuple(self._act_meta), flow_meta=tuple(self._flow_meta), local_params=local_params,
            amp_scale=self._scale is not None,
            sampled=packet.index % self.cfg.every == 0, detail=self.detail_now)


class HookSet:
    """Owns every hook one monitor registered; ``remove()`` undoes all of them."""

    def __init__(self) -> None:
        self._handles: List[Any] = []

    def install(self, recorder: Recorder, root: nn.Module, layers: Sequence[Layer], cfg: Config) -> None:
        try:
            if cfg.activations or cfg.grad_flow:
                for layer in layers:
                    self._handles.append(layer.module.register_forward_hook(
                        partial(recorder.on_forward, layer.index)))
            self._handles.append(root.register_forward_hook(recorder.on_root_forward))
            if recorder.scaler is not None:
                self._handles.append(amp.UpdateHook(recorder.scaler, recorder.on_scaler_update))
            if recorder.local_view:
                for i, p in enumerate(recorder.params):
                    self._handles.append(p.register_post_accumulate_grad_hook(partial(recorder.on_local_grad, i)))
            self._handles.append(register_optimizer_step_pre_hook(recorder.on_optimizer_pre))
            self._handles.append(register_optimizer_step_post_hook(recorder.on_optimizer_post))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __len__(self) -> int:
        return len(self._handles)
