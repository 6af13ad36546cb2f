"""How every hook runs its work on the training thread: timed, and unable to raise into it.

    with guards("forward"):
        ...  # an Exception here is counted under "forward" (gradmon_hook_errors_total), never raised

KeyboardInterrupt and SystemExit pass through: they are the user's, not gradmon's. The time
spent inside adds to ``seconds`` (gradmon_overhead_seconds_total) whether or not it failed.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable, Optional

from ..errors import ErrorLog


class Guards:
    __slots__ = ("errors", "seconds")

    def __init__(self, errors: ErrorLog) -> None:
        self.errors = errors
        self.seconds = 0.0

    def __call__(self, stage: str, on_error: Optional[Callable[[], None]] = None) -> "Guard":
        """A guard for one block of work; ``on_error`` runs first when it fails."""
        return Guard(self, stage, on_error)


class Guard:
    # One per use, holding its own start: backward hooks may run on autograd's device threads.
    __slots__ = ("_guards", "_stage", "_on_error", "_t0")

    def __init__(self, guards: Guards, stage: str, on_error: Optional[Callable[[], None]]) -> None:
        self._guards = guards
        self._stage = stage
        self._on_error = on_error

    def __enter__(self) -> None:
        self._t0 = perf_counter()

    def __exit__(self, kind: object, exc: Optional[BaseException], tb: object) -> bool:
        guards = self._guards
        try:
            if not isinstance(exc, Exception):
                return False
            if self._on_error is not None:
                self._on_error()
            guards.errors.record(self._stage, exc)
            return True
        finally:
            guards.seconds += perf_counter() - self._t0
