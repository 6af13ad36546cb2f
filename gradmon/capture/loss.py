"""``monitor.observe(loss=...)``: each micro-batch's loss added on its device, never read on
the training thread; the step's packet carries their mean (``statistics.SCALAR_LOSS``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import kernels


class LossMean:
    __slots__ = ("_sum", "_count")

    def __init__(self) -> None:
        self._sum: Optional[torch.Tensor] = None
        self._count = 0

    def add(self, loss: Any) -> None:
        """One micro-batch's loss: a scalar tensor or a number, else TypeError/ValueError
        (which the recorder counts, never raises)."""
        self._sum = _add(self._sum, _loss_value(loss))
        self._count += 1

    def mean(self) -> Optional[torch.Tensor]:
        """The mean of the losses since the last :meth:`reset`, a 0-d tensor; None without any."""
        return self._sum / self._count if self._sum is not None else None

    def reset(self) -> None:
        self._sum, self._count = None, 0


def _loss_value(loss: Any) -> torch.Tensor:
    """A loss as a detached 0-d tensor of the ship dtype, on the loss's own device (a
    copy: the caller may reuse its tensor in place)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"gradmon: observe(loss=...) takes a scalar loss, got a tensor of shape "
                             f"{tuple(loss.shape)}; pass loss.mean() or the loss you call backward() on")
        return loss.detach().reshape(()).to(kernels._ship_dtype(loss.device), copy=True)
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor(float(loss), dtype=torch.float64)
    raise TypeError(f"gradmon: observe(loss=...) takes a tensor or a number, got {type(loss).__name__}")


def _add(total: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    if total is None:
        return value
    # Losses given as numbers live on the host; add there only while every loss does:
    # moving a device value to the host would wait for the device.
    home = total if value.device.type == "cpu" else value
    return (total.to(home.device, home.dtype, non_blocking=True)
            + value.to(home.device, home.dtype, non_blocking=True))
