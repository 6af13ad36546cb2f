"""The endpoints the collector (``collector``) is served on: one per address and port, or
per user registry, shared by the monitors of a process that ask for the same one, with the
same TLS, auth and connection settings; the last monitor out closes it, after waiting for
the scrapers to see the run's final state.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from . import tls, ui
from ..config import Config
from .collector import ExportView, GradmonCollector
from .server import CachedExposition, MetricsServer

log = logging.getLogger("gradmon")


_MAX_SCRAPERS = 64  # addresses remembered per endpoint: a flood of clients cannot grow it


@dataclass
class _Scraper:
    """What the final-scrape wait knows of one address that scrapes the endpoint."""

    last_start: float = 0.0  # monotonic time its latest scrape started
    interval: float = 0.0  # between its last two scrapes; 0 until it has scraped twice
    answered: int = 0  # the start sequence number of its latest scrape answered to the last byte


@dataclass
class Endpoint:
    """One served registry (gradmon's own) or one user registry, shared by monitors."""

    key: Tuple[object, ...]
    registry: CollectorRegistry
    collector: GradmonCollector
    server: Optional[MetricsServer] = None
    cache: Optional[CachedExposition] = None
    users: set = field(default_factory=set)  # keys of the monitors using it
    scrapes_started: int = 0  # also the sequence number of the latest scrape
    scrapers: Dict[str, _Scraper] = field(default_factory=dict)  # by peer address
    requested: Tuple[int, int] = (0, 0)  # (port option, port after the rank offset)
    serving_options: Tuple[object, ...] = ()
    scraped: threading.Condition = field(default_factory=threading.Condition)
    changed_seq: Optional[int] = None  # the latest scrape started before the last change()

    @property
    def port(self) -> Optional[int]:
        return self.server.port if self.server is not None else None

    @property
    def url(self) -> Optional[str]:
        if self.server is None:
            return None
        host = "127.0.0.1" if self.server.addr in ("0.0.0.0", "") else self.server.addr
        host = "::1" if host == "::" else host
        host = f"[{host}]" if ":" in host else host
        return f"{self.server.scheme}://{host}:{self.server.port}/metrics"

    def serving(self) -> bool:
        """False once a server thread this endpoint started has died."""
        return self.server is None or self.server.alive()

    def start_scrape(self, peer: str) -> Tuple[_Scraper, int]:
        with self.scraped:
            self.scrapes_started += 1
            now = time.monotonic()
            scraper = self.scrapers.get(peer)
            if scraper is None:
                if len(self.scrapers) >= _MAX_SCRAPERS:
                    del self.scrapers[min(self.scrapers, key=lambda p: self.scrapers[p].last_start)]
                scraper = self.scrapers[peer] = _Scraper()
            else:
                scraper.interval = now - scraper.last_start
            scraper.last_start = now
            return scraper, self.scrapes_started

    def count_scrape(self, token: Tuple[_Scraper, int]) -> None:
        scraper, seq = token
        with self.scraped:
            scraper.answered = max(scraper.answered, seq)
            self.scraped.notify_all()

    def await_final_scrape(self, timeout: float, state: str) -> bool:
        """Let every periodic scraper render the run state just set once before the endpoint goes.

        Waited for: each address that scraped twice or more and, at its own interval, is
        due again (it scraped within its last two intervals, and a second more: a loaded
        machine delays the scrapes it serves); HA Prometheus pairs scrape at interleaved
        times, so one scrape is not enough. A single curl is nobody to wait for. Returns
        as soon as each has been answered, within its scrape timeout, a scrape that started
        after the change, or after ``timeout``; False then. A KeyboardInterrupt ends the
        wait at once."""
        with self.scraped:
            # a scrape started after the state changed renders it: counted from the change,
            # not from this wait, which a detach on another thread may reach later
            changed_at = self.scrapes_started if self.changed_seq is None else self.changed_seq
            now = time.monotonic()
            due = {peer: s for peer, s in self.scrapers.items()
                   if s.interval > 0 and now - s.last_start <= 2 * s.interval + 1.0}
        if not due or timeout <= 0:
            return True
        expected = min(timeout, max(s.interval for s in due.values()))
        (log.warning if expected > 2 else log.debug)(
            "gradmon: waiting up to %.0f s for %s (scraping every %s) to scrape the run state %r once "
            "before the endpoint %s goes, so that the end of the run pages only if it should; "
            "final_scrape_timeout=0 (or GRADMON_FINAL_SCRAPE_TIMEOUT=0) ends runs without waiting",
            timeout, ", ".join(sorted(due)), ", ".join(f"{s.interval:.0f} s" for s in due.values()),
            state, self.url)
        deadline = now + timeout
        with self.scraped:
            # in short slices: a Ctrl-C must end the wait at once, not after ``timeout``
            while any(s.answered <= changed_at for s in due.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(p for p, s in due.items() if s.answered <= changed_at)
                    log.warning("gradmon: %s did not scrape %s within final_scrape_timeout=%ss; "
                                "Prometheus may not have seen the run state %r", ", ".join(missing),
                                self.url, timeout, state)
                    return False
                self.scraped.wait(min(left, 0.1))
        return True

    def changed(self) -> None:
        """A run state changed without a new snapshot: the next scrape must render anew."""
        if self.cache is not None:
            self.cache.invalidate()
        with self.scraped:  # after the invalidation: a scrape started later renders anew
            self.changed_seq = self.scrapes_started


_ENDPOINTS: Dict[Tuple[object, ...], Endpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()

# The options an endpoint is served with. Monitors that share an endpoint must agree on
# all of them: a second model meant to be behind basic auth must never be served
# without it just because another model opened the port first.
_SERVING_OPTIONS = ("tls_certfile", "tls_keyfile", "tls_client_cafile", "tls_key_password",
                    "basic_auth_user", "basic_auth_password", "connection_timeout", "max_connections",
                    "ui", "ui_hosts")
_SECRET_OPTIONS = ("tls_key_password", "basic_auth_password")


def _serving(cfg: Config) -> Tuple[object, ...]:
    return tuple(getattr(cfg, name) for name in _SERVING_OPTIONS)


def _check_same_serving(ep: Endpoint, cfg: Config) -> None:
    for name, have, want in zip(_SERVING_OPTIONS, ep.serving_options, _serving(cfg)):
        if have != want:
            shown = "" if name in _SECRET_OPTIONS else f" ({have!r} there, {want!r} here)"
            raise ValueError(
                f"gradmon: option {name!r} differs from the endpoint this monitor would share on "
                f"{ep.url}{shown}; monitors on one endpoint are served with the same TLS, auth and "
                "connection settings: use the same options, or another port")


def _find_served(addr: str, wanted_port: int, port: int) -> Optional[Endpoint]:
    """An endpoint of this process that ``attach(port=wanted_port)`` joins: the same
    address, and the same requested port (before the rank offset; ``port=0`` twice
    shares one endpoint) or the port it is bound to."""
    for ep in _ENDPOINTS.values():
        if ep.server is None or ep.server.addr != addr:
            continue
        if (wanted_port, port) == ep.requested or wanted_port == ep.server.port:
            return ep
    return None


def _warn_about_exposure(cfg: Config) -> None:
    if cfg.basic_auth_user and not cfg.tls_certfile and not _is_loopback(cfg.addr):
        log.warning("gradmon: basic auth on %s is served over plain HTTP: the password crosses the network "
                    "in clear text; set tls_certfile/tls_keyfile, or bind addr=127.0.0.1", cfg.addr)
    if cfg.tls_certfile:
        tls.warn_if_expired(cfg.tls_certfile)


def _is_loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def acquire(cfg: Config, port: int, user: int) -> Endpoint:
    """The endpoint for these settings, started on first use.

    Raises ValueError (before anything is started) when the TLS files are unusable or
    the settings differ from the endpoint being joined, and OSError when the port
    cannot be bound; the caller keeps training without an endpoint on OSError."""
    registry = cfg.registry
    with _ENDPOINTS_LOCK:
        if registry is not None:
            key: Tuple[object, ...] = ("registry", id(registry))
            ep = _ENDPOINTS.get(key)
            if ep is None:
                collector = GradmonCollector()
                registry.register(collector)
                ep = _ENDPOINTS[key] = Endpoint(key, registry, collector)
        else:
            ep = _find_served(cfg.addr, cfg.port, port)
            if ep is not None:
                _check_same_serving(ep, cfg)
            else:
                ep = _serve(cfg, port)
                _ENDPOINTS[ep.key] = ep
        ep.users.add(user)
        return ep


def _serve(cfg: Config, port: int) -> Endpoint:
    collector = GradmonCollector()
    context = None
    if cfg.tls_certfile:
        files = tls.TLSFiles(cfg.tls_certfile, cfg.tls_keyfile, cfg.tls_client_cafile, cfg.tls_key_password)
        context = tls.ReloadingContext(files, lambda exc: collector.report_error("server", exc))
    own = CollectorRegistry(auto_describe=False)
    own.register(collector)
    ep = Endpoint(("serve", cfg.addr, port), own, collector, requested=(cfg.port, port),
                  serving_options=_serving(cfg))
    ep.cache = CachedExposition(lambda: generate_latest(own), collector.generation)
    auth = (cfg.basic_auth_user, cfg.basic_auth_password) if cfg.basic_auth_user is not None else None
    ep.server = MetricsServer(ep.cache.get, addr=cfg.addr, port=port, tls=context, basic_auth=auth,
                              connection_timeout=cfg.connection_timeout, max_connections=cfg.max_connections,
                              on_scrape=ep.count_scrape, on_scrape_start=ep.start_scrape,
                              pages=ui.pages(collector.views) if cfg.ui else None, host_ok=ui.host_check(cfg),
                              on_render_error=lambda exc: collector.report_error("collect", exc))
    _warn_about_exposure(cfg)
    log.info("gradmon: serving metrics on %s", ep.url)
    return ep


def _after_fork_in_child() -> None:
    """A forked child serves nothing of its parent's (the server module closes the
    sockets): forget the endpoints, so that a monitor attached in the child starts its own."""
    global _ENDPOINTS_LOCK
    _ENDPOINTS_LOCK = threading.Lock()  # another thread may have held it at fork time
    _ENDPOINTS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def release(ep: Endpoint, source_key: int, final: Optional[ExportView] = None,
            final_scrape_timeout: float = 0.0) -> None:
    """Forget one monitor; the last one out stops the server and frees the port. Safe to
    call again after it failed: a detach() that is retried must not count twice.

    With ``final`` (the monitor's view in its end state), the endpoint serves that view
    until it closes, and the last monitor out waits (up to ``final_scrape_timeout``) for
    the scrapers to see it: one wait per endpoint, however many models end together.
    A KeyboardInterrupt during that wait ends the wait, not the release; it is re-raised."""
    interrupted: Optional[BaseException] = None
    with _ENDPOINTS_LOCK:
        last = ep.users <= {source_key}
    if final is not None and last and ep.server is not None:
        try:  # outside the lock: another model's attach() must not wait for it
            ep.await_final_scrape(final_scrape_timeout, final.run_state)
        except KeyboardInterrupt as exc:
            interrupted = exc
    with _ENDPOINTS_LOCK:
        ep.users.discard(source_key)
        if ep.users and final is not None:
            ep.collector.retire(source_key, final)
        else:
            ep.collector.remove(source_key)
        if ep.users:
            return _reraise(interrupted)
        _ENDPOINTS.pop(ep.key, None)
    if ep.server is not None:
        ep.server.close()
    else:
        try:
            ep.registry.unregister(ep.collector)
        except KeyError:
            pass
    _reraise(interrupted)


def _reraise(exc: Optional[BaseException]) -> None:
    if exc is not None:
        raise exc


def await_final_scrapes(timeout: float, state: str) -> None:
    """Every served endpoint of this process waits for its final scrape (at SIGTERM,
    where nothing is torn down: the signal ends the process right after)."""
    for ep in list(_ENDPOINTS.values()):  # no lock: this may run in a signal handler
        if ep.server is not None:
            ep.changed()
            ep.await_final_scrape(timeout, state)
