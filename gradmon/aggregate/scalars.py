"""What the last step said of itself: its number and time, learning rates, loss scale, loss."""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Sequence, Tuple

from .. import statistics as S
from ..capture.packet import StepPacket
from ..thresholds import Thresholds


class _GroupRate:
    __slots__ = ("high", "quiet", "settled", "now")

    def __init__(self) -> None:
        self.high = 0.0  # the highest rate seen
        self.quiet = 0  # steps since the rate last rose above it
        self.settled: Optional[float] = None
        self.now: Optional[float] = None  # the last finite, positive rate


class LearningRatePeaks:
    """Each parameter group's learning rate over its settled peak (the highest rate it held
    before ``settle`` steps without a new high: ``Thresholds.lr_settle_steps``), from the
    first settled peak on. A warm-up, a decay, a cosine restart back to the same peak read at
    most 1; a schedule restarted above it, a resume with the wrong schedule or a rate scaled
    by mistake read above 1 until the new rate has held for ``settle`` steps and settles."""

    def __init__(self, settle: int = Thresholds().lr_settle_steps) -> None:
        self._settle = settle
        self._groups: List[_GroupRate] = []

    def step(self, rates: Sequence[float]) -> None:
        """One optimizer step's rates, by group (a NaN or a rate at or below 0 is left out)."""
        self._groups += [_GroupRate() for _ in range(len(rates) - len(self._groups))]
        for g, lr in zip(self._groups, rates):
            if not 0.0 < lr < math.inf:
                continue
            g.now = lr
            if lr > g.high:
                g.high, g.quiet = lr, 0
                continue
            g.quiet += 1
            if g.quiet >= self._settle:
                g.settled = g.high

    def ratios(self) -> Tuple[Tuple[int, float], ...]:
        """(group, its rate over its settled peak) of each group with a settled peak."""
        return tuple((i, g.now / g.settled) for i, g in enumerate(self._groups)
                     if g.now is not None and g.settled is not None)


class LastStep:
    """The step scalars of the last step folded, and the loss's running minimum."""

    def __init__(self) -> None:
        self.global_step: Optional[int] = None
        self.time: Optional[float] = None
        self.learning_rates: Tuple[float, ...] = ()  # per param group of the optimizer that closed the last step
        self.peaks = LearningRatePeaks()
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
        self.peaks.step(lrs)
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
