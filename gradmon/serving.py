"""One monitor's part in an endpoint (``serve.endpoint``): the endpoint is shared by the
monitors of a process on one address; each registers its view, and at the end of its run
leaves after the scrapers have seen its final view or, with ``keep_serving``, holds that
view until the process exits or a monitor of the same name and labels takes over.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable, Optional

from .config import Config
from .errors import ErrorLog
from .serve import endpoint as endpoints
from .serve.collector import ExportView

log = logging.getLogger("gradmon")


class Serving:
    def __init__(self, cfg: Config, owner: int, view: Callable[[], ExportView]) -> None:
        self._cfg = cfg
        self._owner = owner  # the monitor's id in the endpoint's collector
        self._view = view
        self.endpoint: Optional[endpoints.Endpoint] = None
        self.holding = False  # keep_serving: the run ended, the endpoint still serves its final view

    def join(self, port: int, errors: ErrorLog, name: str) -> Optional[str]:
        """Join or start the endpoint on ``port``; a bad setting (TLS files) raises. A taken
        port must not kill a training job: what went wrong is returned, logged loudly and
        counted, and training goes on without an endpoint."""
        try:
            self.endpoint = endpoints.acquire(self._cfg, port, self._owner)
        except OSError as exc:
            error = f"could not serve metrics on {self._cfg.addr}:{port}: {exc}"
            errors.record("server", exc, log_first=False)
            log.error("gradmon[%s]: %s; training continues without an endpoint "
                      "(set GRADMON_PORT or port=0)", name, error)
            return error
        return None

    def register(self, on_error: Callable[[str, BaseException], None],
                 generation: Callable[[], Hashable]) -> None:
        """The endpoint serves this monitor's view from now on (``generation`` changes when it does)."""
        if self.endpoint is not None:
            self.endpoint.collector.add(self._owner, self._view, on_error, generation)

    def changed(self) -> None:
        if self.endpoint is not None:
            self.endpoint.changed()

    def leave(self, forked: bool, final_scrape: bool) -> bool:
        """Leave the endpoint at the end of the run, its final view served until the scrapers
        have seen it (one wait per endpoint, by its last user); True where it holds that view
        instead (``keep_serving``). An inherited endpoint (``forked``) is the parent's."""
        if self.endpoint is None or self.holding:
            return False
        if forked:
            self.endpoint = None
            return False
        final = self._view() if final_scrape else None
        if final is not None and self._cfg.keep_serving and self.endpoint.server is not None:
            self.endpoint.collector.retire(self._owner, final)
            self.endpoint.changed()
            self.holding = True
            return True
        self._release(final)
        return False

    def stop_holding(self, final_scrape: bool) -> None:
        if self.holding:
            self.holding = False
            self._release(self._view() if final_scrape else None)

    def _release(self, final: Optional[ExportView]) -> None:
        try:  # if this fails, the next detach() retries it
            endpoints.release(self.endpoint, self._owner, final, self._cfg.final_scrape_timeout)
        except KeyboardInterrupt:
            self.endpoint = None  # it ended the wait; the endpoint is released all the same
            raise
        self.endpoint = None
