"""What the last step said of itself: its number and time, learning rates, loss scale, loss."""

from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple

from .. import statistics as S
from ..capture.packet import StepPacket


class LastStep:
    """The step scalars of the last step folded, and the loss's running minimum."""

    def __init__(self) -> None:
        self.global_step: Optional[int] = None
        self.time: Optional[float] = None
        self.learning_rates: Tuple[float, ...] = ()  # per param group of the optimizer that closed the last step
        self.amp_loss_scale: Optional[float] = None
        self.loss: Optional[float] = None  # the last loss observed, kept through steps without one
        self.loss_running_min: Optional[float] = None
        self.step_loss: Optional[float] = None  # this step's loss; None when it observed none

    def counted(self, packet: StepPacket) -> None:
        """A step that applied its update (not one the scaler skipped)."""
        self.global_step = packet.global_step
        self.time = packet.time

    def rates(self, scalars: Mapping[str, float], packet: StepPacket) -> Tuple[float, ...]:
        """Read the loss scale and the learning rates (a rate the packet carries as a tensor
        is among its scalars); the rates of this step, empty when it carried none."""
        if S.SCALAR_AMP_SCALE in scalars:
            self.amp_loss_scale = scalars[S.SCALAR_AMP_SCALE]
        lrs = tuple(scalars.get(S.learning_rate_scalar(group), math.nan) if lr is None else lr
                    for group, lr in enumerate(packet.learning_rates))
        self.learning_rates = lrs or self.learning_rates
        return lrs

    def observe_loss(self, scalars: Mapping[str, float]) -> Optional[float]:
        """Read this step's loss, if it observed one."""
        loss = self.step_loss = scalars.get(S.SCALAR_LOSS)
        if loss is not None:
            self.loss = loss
            if math.isfinite(loss) and (self.loss_running_min is None or loss < self.loss_running_min):
                self.loss_running_min = loss
        return loss

    @property
    def first_rate(self) -> Optional[float]:
        return self.learning_rates[0] if self.learning_rates else None
