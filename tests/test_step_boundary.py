"""The step boundary (gradmon/capture/boundary.py) on its own, driven by the events the
recorder's hooks turn into: a backward's end, an optimizer step (the one that measures, or a
second optimizer over the same model), ``monitor.step()`` and a GradScaler update."""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from gradmon.capture.boundary import TRANSITIONS, Event, State, StepBoundary


class Loop:
    """What the recorder does with a boundary, hook by hook (capture/hooks.py), reporting what
    each hook did: "measured", "closed", "relabelled", "skipped", or None (nothing)."""

    def __init__(self) -> None:
        self.b = StepBoundary()
        self.packets: List[Tuple[str, bool, bool]] = []  # (how, measured at step, measurement failed)

    def backward(self, fails: bool = False) -> Optional[str]:  # _after_backward, gradients accumulated
        self.b.fire(Event.BACKWARD)
        if fails:
            self.b.fail()
        return "measured"

    def optimizer(self, primary: bool = True) -> Optional[str]:  # on_optimizer_pre, then on_optimizer_post
        did = None
        if not self.b.measured and primary:
            self.b.fire(Event.AT_STEP)
            did = "measured"
        if not self.b.measured:
            return did
        self.packets.append(("optimizer", self.b.measured_at_step, self.b.failed))
        self.b.fire(Event.OPTIMIZER)
        return "closed"

    def manual(self) -> Optional[str]:  # manual_step
        if self.b.relabels:
            return "relabelled as skipped" if self.b.skipped else "relabelled"
        if not self.b.measured:
            self.b.fire(Event.AT_STEP)
        self.packets.append(("manual", self.b.measured_at_step, self.b.failed))
        self.b.fire(Event.MANUAL)
        return "closed"

    def scaler_update(self) -> Optional[str]:  # on_scaler_update
        if not self.b.skipped_at_update:
            self.b.fire(Event.SCALER_UPDATE)
            return None
        self.packets.append(("skipped", False, self.b.failed))
        self.b.fire(Event.SCALER_UPDATE)
        return "skipped"


class Flags:
    """The boolean flags the boundary replaced (hooks.py before issue 24), transcribed."""

    def __init__(self) -> None:
        self.fresh = self.at_step = self.stepped = self.failed = False
        self.last: Optional[str] = None
        self.packets: List[Tuple[str, bool, bool]] = []

    def _close(self, how: str) -> None:
        self.packets.append((how, self.at_step if how != "skipped" else False, self.failed))
        self.fresh = self.at_step = self.failed = False
        self.last = "scaler" if how == "skipped" else how

    def backward(self, fails: bool = False) -> Optional[str]:
        self.fresh, self.at_step = True, False
        self.failed = self.failed or fails
        return "measured"

    def optimizer(self, primary: bool = True) -> Optional[str]:
        did = None
        if not self.fresh and primary:
            self.fresh = self.at_step = True
            did = "measured"
        if not self.fresh:
            return did
        self.stepped = True
        self._close("optimizer")
        return "closed"

    def manual(self) -> Optional[str]:
        if self.last in ("optimizer", "scaler") and not self.fresh:
            return "relabelled as skipped" if self.last == "scaler" else "relabelled"
        if not self.fresh:
            self.at_step = True
        self.stepped = True
        self._close("manual")
        return "closed"

    def scaler_update(self) -> Optional[str]:
        if self.stepped or not self.fresh:
            self.stepped = False
            return None
        self._close("skipped")
        return "skipped"


ACTIONS: Dict[str, Callable] = {
    "backward": lambda loop: loop.backward(),
    "failed backward": lambda loop: loop.backward(fails=True),
    "optimizer": lambda loop: loop.optimizer(),
    "second optimizer": lambda loop: loop.optimizer(primary=False),
    "monitor.step": lambda loop: loop.manual(),
    "scaler update": lambda loop: loop.scaler_update(),
}


def run(*actions: str) -> Tuple[List[Optional[str]], Loop]:
    loop = Loop()
    return [ACTIONS[a](loop) for a in actions], loop


def test_every_state_has_a_transition_for_every_event():
    assert set(TRANSITIONS) == set(itertools.product(State, Event))


def test_a_backward_then_an_optimizer_step_closes_one_step_measured_at_the_backward():
    did, loop = run("backward", "optimizer")
    assert did == ["measured", "closed"] and loop.packets == [("optimizer", False, False)]


def test_accumulated_backwards_are_one_step():
    did, loop = run("backward", "backward", "backward", "optimizer")
    assert did[-1] == "closed" and len(loop.packets) == 1


def test_gradients_no_backward_accumulated_are_measured_at_the_optimizer_step():
    """``torch.autograd.grad`` and ``.grad`` assigned by hand: no backward end measured them."""
    did, loop = run("optimizer")
    assert did == ["closed"] and loop.packets == [("optimizer", True, False)]


def test_a_backward_inside_the_closure_measures_again_at_its_end():
    loop = Loop()
    loop.b.fire(Event.AT_STEP)  # on_optimizer_pre: no backward yet
    loop.backward()  # the closure's backward
    assert loop.b.measured and not loop.b.measured_at_step


def test_a_step_the_scaler_skipped_is_closed_by_its_update_and_numbered_as_skipped():
    did, loop = run("backward", "scaler update", "monitor.step")
    assert did == ["measured", "skipped", "relabelled as skipped"] and [p[0] for p in loop.packets] == ["skipped"]


def test_the_scaler_update_after_an_optimizer_step_closes_nothing():
    did, loop = run("backward", "optimizer", "scaler update", "backward", "optimizer", "scaler update")
    assert did.count("skipped") == 0 and len(loop.packets) == 2


def test_the_next_backward_before_the_scaler_updates_is_not_taken_for_a_skipped_step():
    did, _ = run("backward", "optimizer", "backward", "scaler update")
    assert did[-1] is None


def test_a_failed_measurement_goes_with_its_step_and_not_into_the_next():
    _, loop = run("failed backward", "optimizer", "backward", "optimizer")
    assert [p[2] for p in loop.packets] == [True, False]


def test_a_second_optimizer_over_the_same_model_neither_measures_nor_closes_another_step():
    did, loop = run("backward", "optimizer", "second optimizer")
    assert did == ["measured", "closed", None] and len(loop.packets) == 1


def test_a_second_optimizer_alone_closes_a_step_a_backward_measured():
    did, _ = run("backward", "second optimizer")
    assert did[-1] == "closed"


def test_monitor_step_after_the_optimizer_relabels_the_step_it_closed():
    did, loop = run("backward", "optimizer", "monitor.step", "monitor.step")
    assert did[2:] == ["relabelled", "relabelled"] and len(loop.packets) == 1


def test_monitor_step_alone_closes_a_step_measured_at_the_step():
    did, loop = run("monitor.step", "monitor.step")
    assert did == ["closed", "closed"] and loop.packets == [("manual", True, False)] * 2


@pytest.mark.parametrize("length", [6])
def test_every_sequence_of_events_does_what_the_flags_it_replaced_did(length):
    """Exhaustive over every sequence of ``length`` events (and so over all shorter ones, as
    prefixes): each event's effect and every packet's facts agree with the old flags."""
    for sequence in itertools.product(ACTIONS, repeat=length):
        loop, flags = Loop(), Flags()
        for i, action in enumerate(sequence):
            assert ACTIONS[action](loop) == ACTIONS[action](flags), sequence[:i + 1]
        assert loop.packets == flags.packets, sequence
