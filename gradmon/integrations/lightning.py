"""gradmon for Lightning: ``Trainer(callbacks=[GradmonCallback()])``.

It attaches when training starts, to the LightningModule Lightning trains (the same
parameters its strategy wrapped), so the norms are the accumulated, pre-clip gradient of
each optimizer step (gradmon finds the end of every backward itself, whichever forward
``training_step`` calls). It gives each micro-batch's loss to ``monitor.observe()`` from
``on_before_backward``, exports ``trainer.global_step`` as ``gradmon_step``, hands
``precision="16-mixed"``'s GradScaler to gradmon (its overflow steps are skips, not
non-finite incidents), and ends the
run with Lightning: ``finished`` at the end of ``fit``, ``failed`` (with the exception's
type) or ``interrupted`` from ``on_exception``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch

from ..monitor import Monitor, attach


class GradmonCallback(pl.Callback):
    """``options`` are :func:`gradmon.attach`'s (``port``, ``labels``, ``detail_every``...);
    the environment's ``GRADMON_*`` variables still win. ``monitor`` is the handle while
    training runs."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.monitor: Optional[Monitor] = None
        self._step: Optional[int] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.monitor is not None and self.monitor.state != "detached":
            return  # a second fit() on the same trainer keeps the run
        options = dict(self.options)
        if trainer.world_size > 1:
            # the strategy's wrapper is not what is attached: ask for each rank's own view
            options.setdefault("local_view", True)
        # 16-mixed: the GradScaler that skips overflow steps, so that they count as skips
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None:
            options.setdefault("scaler", scaler)
        self.monitor = attach(pl_module, **options)
        self._step = trainer.global_step

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self.monitor is None:
            return
        # automatic optimization divides each micro-batch's loss by accumulate_grad_batches
        # before backward; the loss the user returned is that times the same number
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            loss = loss.detach() * trainer.accumulate_grad_batches
        self.monitor.observe(loss=loss)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.monitor is not None and trainer.global_step != self._step:
            self._step = trainer.global_step
            self.monitor.step(trainer.global_step)  # the step just closed is Lightning's global_step

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.monitor is not None:
            self.monitor.detach()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                     exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.detach(error=exception)
