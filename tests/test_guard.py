"""capture/guard.py on its own: how every hook runs its work on the training thread."""

from __future__ import annotations

import time

import pytest

from gradmon.capture.guard import Guards
from gradmon.errors import ErrorLog


def test_an_exception_inside_is_counted_under_its_stage_and_not_raised():
    guards = Guards(ErrorLog("m"))
    with guards("backward"):
        raise RuntimeError("injected")
    assert guards.errors.counts()["backward"] == 1 and guards.errors.total() == 1


def test_keyboard_interrupt_reaches_the_user_uncounted():
    guards = Guards(ErrorLog("m"))
    with pytest.raises(KeyboardInterrupt):
        with guards("forward"):
            raise KeyboardInterrupt
    assert guards.errors.total() == 0


def test_the_time_inside_is_added_whether_or_not_it_failed():
    guards = Guards(ErrorLog("m"))
    with guards("step"):
        time.sleep(0.02)
    after_one = guards.seconds
    with guards("step"):
        time.sleep(0.02)
        raise ValueError("injected")
    assert after_one >= 0.02 and guards.seconds - after_one >= 0.02


def test_on_error_runs_only_when_the_work_failed():
    failed = []
    guards = Guards(ErrorLog("m"))
    with guards("step", lambda: failed.append(1)):
        pass
    with guards("step", lambda: failed.append(2)):
        raise RuntimeError("injected")
    assert failed == [2]


def test_nested_guards_each_keep_their_own_start():
    guards = Guards(ErrorLog("m"))
    with guards("step"):
        time.sleep(0.01)
        with guards("forward"):
            time.sleep(0.01)
    assert 0.03 <= guards.seconds < 1.0  # the outer 0.02 s and the inner 0.01 s
