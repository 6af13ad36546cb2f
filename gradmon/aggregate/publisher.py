"""The publisher thread: between the training thread's packets and the exporter's snapshots."""

from __future__ import annotations

import queue
import threading
import time
from typing import Dict

from ..capture.packet import GlobalStepUpdate
from ..errors import ErrorLog
from ..incidents.recorder import BatchIds
from .aggregator import Aggregator
from .snapshot import Snapshot


_STOP = object()

WAKE_EVERY_S = 0.02
"""Least time between two of the publisher's wake-ups: packets that come faster (a step of
a few milliseconds) are folded a batch at a time. Each wake-up costs the training thread
about what a fold costs again (the interpreter lock handed over and back, the packets' data
cold in the other core's cache); a step slower than this is folded as it arrives. A flush or
a close cuts the wait short."""


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


class Publisher:
    """The thread between the training thread and the exporter."""

    def __init__(self, aggregator: Aggregator, errors: ErrorLog, name: str) -> None:
        self._agg = aggregator
        self._errors = errors
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._hurry = threading.Event()  # a flush or a close waits in the queue: no gathering
        self.wakes = 0  # batches folded (the thread's wake-ups), for tests and benchmarks
        self._thread = threading.Thread(target=self._run, name=f"gradmon-publisher-{name}", daemon=True)
        # Folding and building a snapshot both read the aggregator; reentrant, because an
        # on_nonfinite callback runs inside a fold and may ask for a snapshot.
        self._lock = threading.RLock()
        self._stale = False
        # Built before the thread starts: every counter exists at 0 from attach().
        self._latest: Snapshot = aggregator.snapshot()
        self._thread.start()

    @property
    def latest(self) -> Snapshot:
        """The newest snapshot: immutable, so any thread may keep it. Built when read
        after new steps were folded, not at every step: a scrape every 15 s builds one
        where a step every 100 ms would build 150, each taking the training thread's
        interpreter lock and CPU."""
        with self._lock:
            if self._stale:
                try:
                    self._latest = self._agg.snapshot()
                except Exception as exc:  # pragma: no cover - snapshot building is plain Python
                    self._errors.record("publish", exc)
                self._stale = False
            return self._latest

    def put(self, item: object) -> None:
        self._queue.put(item)

    def add_limit(self, text: str) -> None:
        """State a limit of coverage found after attach (see ``Coverage.limits``)."""
        with self._lock:
            self._agg.cover.add_limit(text)
            self._stale = True

    def flush(self, timeout: float) -> bool:
        if not self._thread.is_alive():
            return False
        token = _Flush()
        self._put_at_once(token)
        return token.done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued items. From the publisher thread itself (a detach() in
        an on_nonfinite callback) it cannot wait for itself: the thread stops after the
        item it is folding."""
        if self._thread.is_alive():
            self._put_at_once(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)

    def _put_at_once(self, item: object) -> None:
        """Queue ``item`` and end the thread's gathering wait: queued first, so that the
        drain after the wait (``_run``) finds it whenever the wait ends."""
        self._queue.put(item)
        self._hurry.set()

    def counters(self) -> Dict[str, object]:
        """The aggregator's counters; call after close() (or from the publisher thread)."""
        return self._agg.counters()

    def _run(self) -> None:
        woke = float("-inf")
        while True:
            batch = [self._queue.get()]
            rest = woke + WAKE_EVERY_S - time.monotonic()
            if rest > 0:
                self._hurry.wait(rest)  # the packets of the next few steps join this one
            self._hurry.clear()  # after the wait: a token put before it was set is drained below
            woke = time.monotonic()
            self.wakes += 1
            try:
                while True:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            stop = False
            flushes = []
            with self._lock:
                for item in batch:
                    if item is _STOP:
                        stop = True
                    elif isinstance(item, _Flush):
                        flushes.append(item)
                    else:
                        self._fold(item)
                        self._stale = True
            for token in flushes:
                token.done.set()
            if stop:
                return

    def _fold(self, item: object) -> None:
        try:
            if isinstance(item, GlobalStepUpdate):
                self._agg.relabel(item.global_step, item.skipped)
                return
            if isinstance(item, BatchIds):
                if self._agg.black_box is not None:
                    self._agg.black_box.batch(item.ids)
                return
            event = getattr(item, "event", None)
            if event is not None:
                event.synchronize()
            self._agg.fold(item)  # type: ignore[arg-type]
        except Exception as exc:
            self._errors.record("publish", exc)
