"""gradmon for Lightning: ``Trainer(callbacks=[GradmonCallback()])``.

It attaches when training starts, to the LightningModule Lightning trains (the same
parameters its strategy wrapped), so the norms are the accumulated, pre-clip gradient of
each optimizer step (gradmon finds the end of every backward itself, whichever forward
``training_step`` calls). It gives each micro-batch's loss to ``monitor.observe()`` from
``on_before_backward`` (and, from a dict batch, its ``id``/``ids``/``idx``/``index``
field to ``observe(batch=...)``, for the incident bundle), exports ``trainer.global_step`` as ``gradmon_step``, hands
``precision="16-mixed"``'s GradScaler to gradmon (its overflow steps are skips, not
non-finite incidents), and ends the
run with Lightning: ``finished`` at the end of ``fit``, ``failed`` (with the exception's
type) or ``interrupted`` from ``on_exception``. ``close()`` and ``with`` work as for the
Hugging Face callback.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch

from ..incidents.recorder import ids_in
from ._run import CallbackRun, ClosingCallback


class GradmonCallback(ClosingCallback, pl.Callback):
    """``options`` are :func:`gradmon.attach`'s (``port``, ``labels``, ``detail_every``...),
    checked here (a TypeError or ValueError naming the option); the environment's
    ``GRADMON_*`` variables still win. ``callback.monitor`` is the handle of the latest run
    (``callback.monitor.url``)."""

    def __init__(self, **options: Any) -> None:
        self._run = CallbackRun(options)
        self._step: Optional[int] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        defaults = {}
        if trainer.world_size > 1:
            # the strategy's wrapper is not what is attached: ask for each rank's own view
            defaults["local_view"] = True
        # 16-mixed: the GradScaler that skips overflow steps, so that they count as skips
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None:
            defaults["scaler"] = scaler
        self._run.start(pl_module, trainer.is_global_zero, **defaults)
        self._step = trainer.global_step

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        # a dict batch that carries its samples' ids (ID_KEYS): an incident bundle names them
        ids = ids_in(batch)
        if self.monitor is not None and ids is not None:
            self.monitor.observe(batch=ids)

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
        self._run.end()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                     exception: BaseException) -> None:
        self._run.end(exception)
