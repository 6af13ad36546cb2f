"""How a run ends: the run state each way out of a training script publishes.

=======================================  ===============================================
the script                               run state Prometheus sees last
=======================================  ===============================================
ends, with or without ``detach()``       ``finished`` (``detach()`` or ``atexit``)
``detach()`` while an exception is       as if that exception had left ``with``
handled (``finally``, ``except``)
raises out of ``with attach(...)``       ``failed`` and the exception's type name
raises to the top (``sys.excepthook``)   ``failed`` and the exception's type name
``sys.exit(n)``, n != 0                  ``failed`` (the exception being handled, if any)
Ctrl-C (KeyboardInterrupt)               ``interrupted``
SIGTERM, with ``handle_sigterm``         ``terminated``, then the signal's default action
``os._exit``, SIGKILL, a default-action  nothing: the target disappears after its last
signal, a fork-started child             scrape (``GradmonExporterDown`` if it was training)
a Trainer callback's run whose train     ``failed`` (no exception type: it was caught where
end never came (``train()`` raised and   gradmon could not see it), at the callback's next
the exception was caught)                train begin, ``close()``, collection or at exit
=======================================  ===============================================

Each end is published at once and the endpoint then waits (bounded) for the scrapers to
see it (``endpoint.Endpoint.await_final_scrape``). Everything here runs on the way out of
the user's program: nothing may raise into it, and the hooks it replaces are chained.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from typing import Callable, Optional, Set, Tuple

from .. import metrics as M

log = logging.getLogger("gradmon")

Outcome = Tuple[str, Optional[str]]  # (run state, exception type name)
EndAll = Callable[[str, Optional[str]], None]

#: Longest wait for a scrape after SIGTERM: well inside the 30 s that Kubernetes
#: (terminationGracePeriodSeconds) and SLURM (KillWait) leave before SIGKILL.
SIGTERM_GRACE_S = 10.0

_pid = -1  # the process that installed the hooks: a forked child inherits them, not its monitors
_outcome: Optional[Outcome] = None  # the first end seen outside a ``with`` block
_mark_all: Optional[EndAll] = None  # publish a state on every live monitor, tear nothing down
_end_all: Optional[EndAll] = None  # end and detach every live monitor
_previous_excepthook = sys.excepthook
_previous_exit = sys.exit
_sigterm_grace: Callable[[], float] = lambda: SIGTERM_GRACE_S
_guards: "Set[Guard]" = set()  # armed: their runs are ended at exit before the rest


class Guard:
    """Ends a run that its owner (a framework callback) started and never saw end: when
    the owner is collected, or at interpreter exit, before the exit ends the remaining
    runs as ``finished``: ``failed``, or the way the script ended if an exception reached
    the top. ``end`` must not hold the owner, or the owner is never collected. ``fire()``
    ends the run now, ``disarm()`` when it ended as it should; at most once in all."""

    def __init__(self, owner: object, end: EndAll) -> None:
        self._end = end
        self._finalizer = weakref.finalize(owner, self.fire)
        self._finalizer.atexit = False  # _at_exit fires it, before _end_all
        _guards.add(self)

    def disarm(self) -> bool:
        """True if it was armed."""
        try:
            _guards.remove(self)
        except KeyError:
            return False
        self._finalizer.detach()
        return True

    def fire(self, end: Outcome = (M.STATE_FAILED, None)) -> None:
        if self.disarm():
            try:
                self._end(*end)
            except Exception:  # noqa: BLE001 - it runs at collection or exit, inside nobody's code
                log.exception("gradmon: error while ending an abandoned run")


def outcome(exc: Optional[BaseException]) -> Outcome:
    """The end state of a run that an exception (or none) ends."""
    if exc is None or isinstance(exc, GeneratorExit):
        return M.STATE_FINISHED, None
    if isinstance(exc, KeyboardInterrupt):
        return M.STATE_INTERRUPTED, None
    if isinstance(exc, SystemExit):
        return _exit_outcome(exc.code, None)
    if isinstance(exc, Exception):
        return M.STATE_FAILED, type(exc).__name__
    return M.STATE_INTERRUPTED, None  # another BaseException (asyncio.CancelledError): cancelled, not crashed


def outcome_now() -> Outcome:
    """The end state of a run ended by a call made now: ``detach()`` in a ``finally`` or an
    ``except`` block while an exception is in flight is that exception's end, not a good
    one. The end of an iterator (a data loader's StopIteration) is no failure."""
    exc = sys.exc_info()[1]
    if isinstance(exc, (StopIteration, StopAsyncIteration)):
        return M.STATE_FINISHED, None
    return outcome(exc)


def _exit_outcome(code: object, handling: Optional[BaseException]) -> Outcome:
    if code is None or code is False or code == 0:
        return M.STATE_FINISHED, None
    # torch.multiprocessing's worker wrapper catches the worker's exception and calls
    # sys.exit(1) inside its ``except``: name that exception, not SystemExit
    return M.STATE_FAILED, type(handling).__name__ if handling is not None else "SystemExit"


def install(mark_all: EndAll, end_all: EndAll, handle_sigterm: bool, sigterm_grace: Callable[[], float]) -> None:
    """Once per process, at the first attach(): the exception hook, the ``sys.exit`` wrapper
    and the atexit handler; the SIGTERM handler on the first attach that asks for it."""
    global _pid, _mark_all, _end_all, _sigterm_grace
    if _pid != os.getpid():
        _pid, _mark_all, _end_all = os.getpid(), mark_all, end_all
        _chain_hooks()
        atexit.register(_at_exit)
    if handle_sigterm:
        _sigterm_grace = sigterm_grace
        _install_sigterm()


def _chain_hooks() -> None:
    global _previous_excepthook, _previous_exit
    if sys.excepthook is not _excepthook:
        _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook
    if sys.exit is not _exit:
        _previous_exit, sys.exit = sys.exit, _exit


def _record(end: Outcome) -> None:
    """The first end seen wins (the exception, not the sys.exit(1) that reports it); it is
    published at once, so a scrape before the process is gone already shows it."""
    global _outcome
    if os.getpid() != _pid or _outcome is not None or _mark_all is None:
        return
    _outcome = end
    _mark_all(*end)


def _excepthook(exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
    # an exception at an interactive prompt ends one statement, not the run
    if not hasattr(sys, "ps1") and not sys.flags.interactive:
        try:
            _record(outcome(exc))
        except Exception:  # noqa: BLE001 - the user's traceback must still print
            pass
    _previous_excepthook(exc_type, exc, tb)


def _exit(status: object = None) -> None:
    try:
        _record(_exit_outcome(status, sys.exc_info()[1]))
    except Exception:  # noqa: BLE001 - sys.exit must exit
        pass
    _previous_exit(status)


def _at_exit() -> None:
    if os.getpid() != _pid or _end_all is None:
        return  # a forked child that exits normally: its parent owns the monitors and the endpoint
    try:
        for guard in list(_guards):
            guard.fire(_outcome or (M.STATE_FAILED, None))
        _end_all(*(_outcome or (M.STATE_FINISHED, None)))
    except BaseException:  # noqa: BLE001 - a Ctrl-C at exit ends the wait, not with a traceback from gradmon
        pass


def _install_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        log.warning("gradmon: handle_sigterm needs attach() on the main thread (signal handlers are "
                    "installed there); SIGTERM keeps its default action")
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    if current is not signal.SIG_DFL:
        log.warning("gradmon: handle_sigterm: the job has its own SIGTERM handler; gradmon leaves it alone")
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    """Publish "terminated", wait briefly for a scrape, then die of the signal as if gradmon
    had never been there: nothing is torn down, the process ends right after."""
    try:
        if os.getpid() == _pid and _mark_all is not None:
            _mark_all(M.STATE_TERMINATED, None)
            from . import endpoint
            endpoint.await_final_scrapes(_sigterm_grace(), M.STATE_TERMINATED)
    except BaseException:  # noqa: BLE001 - the signal must do what it would have done
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
