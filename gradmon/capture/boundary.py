"""The step boundary: where the current optimizer step stands, as one small state machine.

A step's gradients are measured at the end of a backward that accumulated a monitored
gradient, or, when no backward gradmon saw did (``.grad`` assigned by hand,
``torch.autograd.grad``, a closure whose backward is still to come), at the optimizer step or
``monitor.step()``; a later backward in the same step measures again. The step is closed by
the optimizer's post-step hook, by ``monitor.step()``, or by a GradScaler update that finds it
measured and never stepped: a step the scaler skipped on overflow. The scaler updates once per
iteration, stepped or not, so a step closed since its last update is remembered until then.
How the last step was closed also decides what a ``monitor.step(n)`` right after it does:
relabel the step the optimizer (or the scaler) already closed, or close one itself.
"""

from __future__ import annotations

from enum import Enum
from typing import Dict, NamedTuple, Optional, Tuple


class Event(Enum):
    BACKWARD = "the end of a backward measured the gradients"
    AT_STEP = "the gradients were measured at the optimizer step or monitor.step()"
    OPTIMIZER = "the optimizer's post-step hook closed the step"
    MANUAL = "monitor.step() closed the step"
    SCALER_UPDATE = "the GradScaler updated its scale"


class _Facts(NamedTuple):
    measured: Optional[str]
    """None: nothing measured in this step yet; "backward" or "step": where it was measured."""
    closed_by: Optional[str]
    """While nothing is measured, who closed the last step when ``monitor.step(n)`` only relabels
    it: "optimizer", "scaler"; else None (no step yet, or ``monitor.step()`` closed it)."""
    update_due: bool
    """A step was closed since the GradScaler's last update (or there is no scaler)."""


class State(Enum):
    READY = _Facts(None, None, False)
    CLOSED_MANUALLY = _Facts(None, None, True)
    CLOSED_BY_OPTIMIZER = _Facts(None, "optimizer", True)
    UPDATED_AFTER_OPTIMIZER = _Facts(None, "optimizer", False)
    SKIPPED = _Facts(None, "scaler", False)
    MEASURED = _Facts("backward", None, False)
    MEASURED_AT_STEP = _Facts("step", None, False)
    MEASURED_BEFORE_UPDATE = _Facts("backward", None, True)
    MEASURED_AT_STEP_BEFORE_UPDATE = _Facts("step", None, True)

    @property
    def measured(self) -> bool:
        return self.value.measured is not None


_S = State
_CLOSING = (Event.OPTIMIZER, Event.MANUAL)

TRANSITIONS: Dict[Tuple[State, Event], State] = {
    # a backward measures (again); the scaler update it may still wait for stays due
    **{(s, Event.BACKWARD): _S.MEASURED_BEFORE_UPDATE if s.value.update_due else _S.MEASURED for s in State},
    # at the step only where nothing is measured yet: a measured step keeps its measurement
    **{(s, Event.AT_STEP): s if s.measured else (
        _S.MEASURED_AT_STEP_BEFORE_UPDATE if s.value.update_due else _S.MEASURED_AT_STEP) for s in State},
    **{(s, Event.OPTIMIZER): _S.CLOSED_BY_OPTIMIZER for s in State},
    **{(s, Event.MANUAL): _S.CLOSED_MANUALLY for s in State},
    (_S.READY, Event.SCALER_UPDATE): _S.READY,
    (_S.CLOSED_MANUALLY, Event.SCALER_UPDATE): _S.READY,
    (_S.CLOSED_BY_OPTIMIZER, Event.SCALER_UPDATE): _S.UPDATED_AFTER_OPTIMIZER,
    (_S.UPDATED_AFTER_OPTIMIZER, Event.SCALER_UPDATE): _S.UPDATED_AFTER_OPTIMIZER,
    (_S.SKIPPED, Event.SCALER_UPDATE): _S.SKIPPED,
    # measured, and no step since the scaler's last update: it skipped this one
    (_S.MEASURED, Event.SCALER_UPDATE): _S.SKIPPED,
    (_S.MEASURED_AT_STEP, Event.SCALER_UPDATE): _S.SKIPPED,
    (_S.MEASURED_BEFORE_UPDATE, Event.SCALER_UPDATE): _S.MEASURED,
    (_S.MEASURED_AT_STEP_BEFORE_UPDATE, Event.SCALER_UPDATE): _S.MEASURED_AT_STEP,
}


class StepBoundary:
    """The current step's place between measuring and closing, and whether its measurement
    failed (every rank still joins the step's shard reduction, saying so)."""

    __slots__ = ("state", "failed")

    def __init__(self) -> None:
        self.state = State.READY
        self.failed = False

    def fire(self, event: Event) -> State:
        before, self.state = self.state, TRANSITIONS[self.state, event]
        if event in _CLOSING or (event is Event.SCALER_UPDATE and before.measured and not self.state.measured):
            self.failed = False
        return self.state

    @property
    def measured(self) -> bool:
        """This step's gradients are measured (at the end of a backward, or at the step)."""
        return self.state.measured

    @property
    def measured_at_step(self) -> bool:
        return self.state.value.measured == "step"

    @property
    def relabels(self) -> bool:
        """``monitor.step(n)`` now renumbers the step the optimizer or the scaler closed
        instead of closing one."""
        return self.state.value.closed_by is not None

    @property
    def skipped(self) -> bool:
        """The last step closed was one the scaler skipped."""
        return self.state is State.SKIPPED

    @property
    def skipped_at_update(self) -> bool:
        """A GradScaler update now finds the step skipped (and closes it)."""
        return TRANSITIONS[self.state, Event.SCALER_UPDATE] is State.SKIPPED and self.state.measured

    def fail(self) -> None:
        self.failed = True
