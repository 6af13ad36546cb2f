"""gradmon for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[GradmonCallback()])``.

At train begin it attaches to the model the Trainer trains (``local_view`` on when the
job has several ranks, since the callback sees the model inside any DDP wrapper). Callbacks
never receive the loss, so a forward hook reads the ``loss`` field of the model's output on
training forwards (kept on the device) and, just before each optimizer step, hands the
step's loss to ``monitor.observe()``: the micro-batches' mean, or their sum where the
Trainer normalised them by ``num_items_in_batch`` (each is then its share of the step's
loss), so that ``gradmon_loss`` is the loss the Trainer logs for that step on this rank.
After each optimizer step ``gradmon_step`` becomes ``state.global_step``, also after a
step an fp16 GradScaler skipped (counted in ``gradmon_amp_skipped_steps_total``). Train end detaches
(``finished``); an exception out of ``train()`` ends the run as ``failed`` through
gradmon's exception hook (callbacks have no exception event). Under FSDP1 the gradients
are reduced over the shards as for ``attach()``; under DeepSpeed ZeRO, which keeps them
outside ``p.grad``, gradmon warns and states the gap in ``coverage().limits``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import TrainerCallback

from .. import sharded
from ..monitor import Monitor, attach


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    """The ``loss`` of a model output (a ``ModelOutput`` or a dict), if it holds one."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class GradmonCallback(TrainerCallback):
    """``options`` are :func:`gradmon.attach`'s; the ``GRADMON_*`` variables still win."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.monitor: Optional[Monitor] = None
        self._hooks: list = []
        self._sum: Optional[torch.Tensor] = None
        self._count = 0
        self._shares = False  # the micro-batch losses are shares of the step's (num_items_in_batch)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        if model is None or (self.monitor is not None and self.monitor.state != "detached"):
            return
        options = dict(self.options)
        if args.world_size > 1:
            options.setdefault("local_view", True)
        scaler = getattr(optimizer, "scaler", None)  # fp16: the GradScaler that may skip a step
        if scaler is not None:
            options.setdefault("scaler", scaler)
        self.monitor = attach(model, **options)
        if getattr(args, "deepspeed", None):
            self.monitor._add_limit(sharded.DEEPSPEED)
        self._hooks = [model.register_forward_hook(self._on_forward, with_kwargs=True)]

    def _on_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = _loss_of(output)
        if loss is None:
            return
        loss = loss.detach()
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1
        self._shares = kwargs.get("num_items_in_batch") is not None

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self.monitor is not None and self._sum is not None:
            self.monitor.observe(loss=self._sum if self._shares else self._sum / self._count)
        self._sum, self._count = None, 0

    def on_step_end(self, args, state, control, **kwargs) -> None:
        # The Trainer's step boundary: after gradmon's optimizer hook closed the step (or the
        # scaler skipped it, which the Trainer counts too) this only sets its number.
        if self.monitor is not None:
            self.monitor.step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.monitor is not None:
            self.monitor.detach()

