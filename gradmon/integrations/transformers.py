"""gradmon for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[GradmonCallback()])``.

At train begin it attaches to the model the Trainer trains (``local_view`` on when the
job has several ranks, since the callback sees the model inside any DDP wrapper). Callbacks
never receive the loss, so a forward hook reads the ``loss`` field of the model's output on
training forwards (kept on the device) and, just before each optimizer step, hands the
step's loss to ``monitor.observe()``: the micro-batches' mean, or their sum where the
Trainer normalised them by ``num_items_in_batch`` (each is then its share of the step's
loss), so that ``gradmon_loss`` is the loss the Trainer logs for that step on this rank.
Callbacks never see the batch either: a forward pre-hook takes a sample-id column the model
does not take (``ID_KEYS``; the Trainer keeps it with ``remove_unused_columns=False`` or in
``label_names``) out of the model's inputs and gives it to ``observe(batch=...)``.
After each optimizer step ``gradmon_step`` becomes ``state.global_step``, also after a
step an fp16 GradScaler skipped (counted in ``gradmon_amp_skipped_steps_total``). Train end detaches
(``finished``). Callbacks have no exception event: an exception out of ``train()`` that
reaches the top ends the run as ``failed`` through gradmon's exception hook, and one that
is caught (a sweep, a retry, a notebook) at the callback's next train begin, its
``close()`` or the end of ``with GradmonCallback(...) as callback:``, its collection, or
exit. Under FSDP1 the gradients are reduced over the shards as for ``attach()``; under
DeepSpeed ZeRO, which keeps them outside ``p.grad``, gradmon warns and states the gap in
``coverage().limits``.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch
from transformers import TrainerCallback

from .. import sharded
from ..incidents.recorder import ID_KEYS, ids_in
from ..monitor import Monitor
from ._run import CallbackRun, ClosingCallback


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    """The ``loss`` of a model output (a ``ModelOutput`` or a dict), if it holds one."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class _LossTap:
    """The model's forward hook: the training forwards' losses of one optimizer step, kept
    on the device. Apart from the callback, so that the model never holds the callback."""

    def __init__(self) -> None:
        self.sum: Optional[torch.Tensor] = None
        self.count = 0
        self.shares = False  # the micro-batch losses are shares of the step's (num_items_in_batch)

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = _loss_of(output)
        if loss is None:
            return
        loss = loss.detach()
        self.sum = loss if self.sum is None else self.sum + loss
        self.count += 1
        self.shares = kwargs.get("num_items_in_batch") is not None

    def take(self) -> Optional[torch.Tensor]:
        """The step's loss, and a fresh start for the next step."""
        loss = None if self.sum is None else self.sum if self.shares else self.sum / self.count
        self.sum, self.count = None, 0
        return loss


class _IdTap:
    """The model's forward pre-hook: a batch's sample ids from its id column (``ID_KEYS``),
    which the model's forward does not take, are taken out of its inputs (in every forward,
    so that an evaluation batch reaches the model as it would without the column) and, in a
    training forward, given to ``monitor.observe(batch=...)``. The Trainer's callbacks never
    see the batch; this is where its ids still are."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.monitor: Optional[Monitor] = None
        try:
            taken = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            taken = {}
        # a forward that names the key takes it as its own input (nanoGPT's ``idx``: tokens)
        self.keys = tuple(k for k in ID_KEYS if k not in taken)

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
        key = next((k for k in self.keys if k in kwargs), None)
        if key is None:
            return None
        ids = ids_in({key: kwargs[key]})
        if ids is None:
            return None  # not sample ids: the model gets what it was given
        kwargs = {k: v for k, v in kwargs.items() if k != key}
        if self.monitor is not None and module.training and torch.is_grad_enabled():
            self.monitor.observe(batch=ids)
        return args, kwargs


class GradmonCallback(ClosingCallback, TrainerCallback):
    """``options`` are :func:`gradmon.attach`'s, checked here (a TypeError or ValueError
    naming the option); the ``GRADMON_*`` variables still win. ``callback.monitor`` is the
    handle of the latest run (``callback.monitor.url``). For a sweep or retries, where
    ``train()`` may raise and be caught, use ``with GradmonCallback(...) as callback:`` or
    ``callback.close()``; one callback reused for every trial ends a crashed trial's run
    at the next trial's train begin."""

    def __init__(self, **options: Any) -> None:
        self._run = CallbackRun(options)
        self._loss = _LossTap()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        if model is None:
            return
        defaults = {}
        if args.world_size > 1:
            defaults["local_view"] = True
        scaler = getattr(optimizer, "scaler", None)  # fp16: the GradScaler that may skip a step
        if scaler is not None:
            defaults["scaler"] = scaler
        monitor = self._run.start(model, getattr(state, "is_world_process_zero", None), **defaults)
        if getattr(args, "deepspeed", None):
            monitor._add_limit(sharded.DEEPSPEED)
        self._loss.take()  # a crashed step's losses are not the next run's
        self._run.own(model.register_forward_hook(self._loss, with_kwargs=True))
        ids = _IdTap(model)
        ids.monitor = monitor
        # first of the pre-hooks: gradmon's own then sees the batch without its ids, and no row is hashed
        self._run.own(model.register_forward_pre_hook(ids, with_kwargs=True, prepend=True))

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        loss = self._loss.take()
        if self.monitor is not None and loss is not None:
            self.monitor.observe(loss=loss)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        # The Trainer's step boundary: after gradmon's optimizer hook closed the step (or the
        # scaler skipped it, which the Trainer counts too) this only sets its number.
        if self.monitor is not None:
            self.monitor.step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._run.end()
