"""What the Trainer callbacks share: their options checked when the callback is made, the
monitor attached at train begin (announced by the Trainer's own main process), and the
run ended whichever way ``train()``/``fit()`` is left.

The Hugging Face Trainer has no exception event, so a caught exception (a sweep's trial,
a retry, a notebook cell) never reaches the callback: the run it started is ended as
``failed`` at the callback's next train begin, by ``close()`` or the end of its ``with``
block, when the callback is collected, or at interpreter exit (``run_end.Guard``), so
that no endpoint, hook or publisher thread outlives the training that needed it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .. import config as _config
from .. import metrics as M
from .. import run_end
from ..monitor import Monitor, attach


class _RunEnd:
    """Ends one run: the callback's own hooks, then the monitor. It holds neither the
    callback nor its CallbackRun, so that a forgotten callback can be collected."""

    def __init__(self, monitor: Monitor, handles: List[Any]) -> None:
        self.monitor, self.handles = monitor, handles

    def __call__(self, state: str, failure: Optional[str]) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.monitor._end(state, failure)


class CallbackRun:
    """The monitor of one framework callback and the end of its run."""

    def __init__(self, options: Dict[str, Any]) -> None:
        if not _config.is_disabled():  # as attach(): the kill switch makes gradmon a no-op
            _config.resolve(options)  # attach()'s own check, now: a typo fails at once, not at train begin
        self.options = dict(options)
        self.monitor: Optional[Monitor] = None
        self._end: Optional[_RunEnd] = None
        self._guard: Optional[run_end.Guard] = None

    def start(self, model: Any, main_process: Optional[bool], **defaults: Any) -> Monitor:
        """Attach to ``model`` (``defaults`` are the framework's, the user's options win),
        after ending as ``failed`` a run that never saw its end."""
        self.close()
        options = {**defaults, **self.options}
        if main_process is not None:
            options.setdefault("announce", main_process)
        self.monitor = attach(model, **options)
        self._end = _RunEnd(self.monitor, [])
        self._guard = run_end.Guard(self, self._end)
        return self.monitor

    def own(self, handle: Any) -> None:
        """A hook of the callback's own, removed when the run ends."""
        if self._end is not None:
            self._end.handles.append(handle)

    def end(self, error: Optional[BaseException] = None) -> None:
        """The framework's end of the run: as ``monitor.detach(error)`` ends it."""
        if self._guard is not None and self._guard.disarm():
            self._end(*(run_end.outcome(error) if error is not None else run_end.outcome_now()))

    def close(self, error: Optional[BaseException] = None) -> None:
        """End a run that never saw its end: ``failed``, or the way ``error`` ends a run."""
        if self._guard is not None:
            self._guard.fire(run_end.outcome(error) if error is not None else (M.STATE_FAILED, None))


class ClosingCallback:
    """``close()`` and ``with``, for both callbacks: the pattern for sweeps and retries."""

    _run: CallbackRun

    @property
    def monitor(self) -> Optional[Monitor]:
        """The handle of the latest run (``monitor.url``, ``monitor.snapshot()``)."""
        return self._run.monitor

    @property
    def options(self) -> Dict[str, Any]:
        return self._run.options

    def close(self) -> None:
        """End this callback's run if ``train()`` left it running (an exception that was
        caught): ``failed``. Idempotent; the end of ``train()`` needs no ``close()``."""
        self._run.close()

    def __enter__(self) -> "ClosingCallback":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self._run.close(exc)
