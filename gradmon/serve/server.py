"""The /metrics HTTP server: TLS, client certificates, basic auth, the live page's few paths.

It knows nothing about where numbers come from: it serves what ``render()`` returns.
Why not prometheus_client's ``start_http_server``: it has no authentication, answers
any method on any path, and gives a connection unlimited time to send its headers, so
one slow client holds a thread forever. Here:

* only GET and HEAD of the metrics path (405 with ``Allow`` for other methods, 404 for
  other paths, ``/healthz`` for liveness probes); a request with a body is refused and
  its connection closed, because the body is never read and would otherwise be parsed
  as the next request;
* every connection is closed ``connection_timeout`` seconds after it was accepted,
  whatever it is doing (TLS handshake, headers, reading the response, idle keep-alive):
  a timeout per read restarts with every byte a slowloris client drips. The handshake
  runs in the connection's own thread, so no client ever blocks the accept loop;
* at most ``min(max_connections, RLIMIT_NOFILE / 4)`` connections, one thread each, so
  an attack cannot take the training job's file descriptors or grow threads without
  bound. At the cap a new connection evicts the oldest one still sending its request
  headers, so a scraper always gets in; paths other than the metrics path share a
  quarter of the connections, so no page can crowd out scrapes;
* HTTP basic auth compared with ``hmac.compare_digest`` (constant time); a wrong or
  missing credential gets 401 and not a byte of the exposition. Failed attempts are
  throttled per client address and, for addresses that never authenticated, all together
  (:data:`AUTH_FAILURES`): every 127.x.y.z is loopback, so a local client has thousands of
  addresses; the live page likewise has a rate per client and one over all (:data:`UI_OVERALL`);
* the exposition is rendered once per new snapshot (``CachedExposition``), not once per
  scrape: twenty dashboards scraping at 1 Hz cost one render per training step at most;
* a forked child (a DataLoader worker) closes its copies of the sockets at once: the
  port must not outlive the parent's ``close()``, and a child must never answer.
"""

from __future__ import annotations

import base64
import errno
import gzip
import hmac
import os
import resource
import socket
import socketserver
import ssl
import struct
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Tuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST

Render = Callable[[], bytes]

_FD_SHARE = 4  # the endpoint may hold at most 1/_FD_SHARE of the process's file descriptors
_OTHER_PATHS_SHARE = 4  # paths but the metrics path share 1/_OTHER_PATHS_SHARE of the connections
_CLOSE_JOIN_S = 2.0  # close() waits this long in all for connection threads to finish


class CachedExposition:
    """Re-renders only when ``generation()`` changed or the cached bytes are ``max_age`` old
    (process metrics such as memory move without a training step)."""

    def __init__(self, render: Render, generation: Callable[[], Hashable], max_age: float = 5.0) -> None:
        self._render = render
        self._generation = generation
        self._max_age = max_age
        self._lock = threading.Lock()
        self._key: Optional[Hashable] = None
        self._at = 0.0
        self._body = b""
        self.renders = 0

    def invalidate(self) -> None:
        with self._lock:
            self._key = None

    def get(self) -> bytes:
        key = self._generation()
        with self._lock:
            if key != self._key or time.monotonic() - self._at > self._max_age:
                self._body = self._render()
                self._key, self._at = key, time.monotonic()
                self.renders += 1
            return self._body


def connection_cap(max_connections: int) -> int:
    """``max_connections``, but never more than a quarter of the open-file limit: the
    training job's checkpoints and data loaders need the rest."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        max_connections = min(max_connections, soft // _FD_SHARE)
    return max(4, max_connections)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` value allows gzip (RFC 9110 12.5.3): the q-value of
    ``gzip`` if listed, else that of ``*``, must be above zero. A substring test would send
    gzip to ``gzip;q=0`` (an explicit refusal) and to made-up tokens that contain it."""
    weights: Dict[str, float] = {}
    for item in accept_encoding.split(","):
        coding, *params = item.split(";")
        q = 1.0
        for param in params:
            name, _, v = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(v.strip())
                except ValueError:
                    q = 0.0  # an unreadable weight is no consent
        weights[coding.strip().lower()] = q
    return weights.get("gzip", weights.get("*", 0.0)) > 0


class _Connection:
    """An accepted connection, as the reaper and the evictor see it."""

    __slots__ = ("sock", "deadline", "in_request", "hung_up")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + timeout
        self.in_request = False  # headers complete, response not sent yet: not evictable
        self.hung_up = False

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def hang_up(self) -> None:
        """Wake the connection's thread from whatever recv, send or handshake it is in, so that
        it exits and closes the fd. The base class's shutdown: SSLSocket's also drops the TLS
        object under the thread still using it. Linger 0 turns the final close into a reset,
        so the kernel drops what a slow reader left unread instead of keeping it for minutes."""
        self.hung_up = True
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass  # the peer is gone already


def _close_copy(sock: socket.socket) -> None:
    """Close this process's fd of ``sock`` even while a makefile() of it is open (the
    handler's rfile/wfile), which makes ``sock.close()`` a no-op."""
    fd = socket.socket.detach(sock)
    if fd >= 0:
        os.close(fd)


@dataclass(frozen=True)
class Page:
    """One path beside the metrics: ``body`` gets the query string. A ``ui`` page is part
    of the live page: served only to a Host that passes the DNS-rebinding check, at most
    :data:`UI_RATE` requests a second per client, with headers that forbid framing,
    inline script and content sniffing."""

    body: Callable[[str], bytes]
    auth: bool  # behind basic auth, like the metrics
    ctype: str = "text/plain; charset=utf-8"
    ui: bool = False
    # a ui page whose body never changes (the page's files): its validator. Cacheable and
    # outside the rate limit, so a reload costs one data request and never shows a 429
    etag: Optional[str] = None


UI_RATE = 2.0  # requests a second per client address, with a burst of UI_BURST
UI_BURST = 6  # a page load: the page, its script and style, and its first data request
UI_OVERALL = (10.0, 30)  # (rate, burst) of the live page for every client together
AUTH_FAILURES = (1.0, 10)  # (rate, burst) of failed basic-auth attempts a client address may make
AUTH_FAILURES_OVERALL = (5.0, 30)  # the same for every address that has not authenticated before
UI_HEADERS = (("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"),
              ("X-Content-Type-Options", "nosniff"), ("X-Frame-Options", "DENY"),
              ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store"))
# kept, and revalidated by its ETag before each use: never stale after an upgrade
STATIC_HEADERS = tuple(h for h in UI_HEADERS if h[0] != "Cache-Control") + (("Cache-Control", "no-cache"),)


class _Buckets:
    """A token bucket per client address, bounded in size, and one over all of them.

    The table forgets its least recently seen address past ``most``, and one host holds
    many addresses (every 127.x.y.z is loopback): per address alone, a client could
    multiply its rate by its addresses. ``overall`` (rate, burst) caps every address
    together, so whatever a client does costs the process at most that rate."""

    def __init__(self, rate: float, burst: int, most: int = 256,
                 overall: Optional[Tuple[float, int]] = None) -> None:
        self.rate, self.burst, self.most = rate, burst, most
        self.overall = overall
        self._lock = threading.Lock()
        self._tokens: Dict[str, Tuple[float, float]] = {}  # address -> (tokens, at)
        self._all = (float(overall[1]), time.monotonic()) if overall else (0.0, 0.0)

    def _levels(self, address: str, alone: bool, now: float) -> List[float]:
        """Tokens now in the address's bucket and, unless ``alone``, the overall one."""
        tokens, at = self._tokens.pop(address, (float(self.burst), now))
        if len(self._tokens) >= self.most:
            self._tokens.pop(next(iter(self._tokens)))  # the least recently seen
        self._tokens[address] = (min(float(self.burst), tokens + (now - at) * self.rate), now)
        levels = [self._tokens[address][0]]
        if self.overall is not None and not alone:
            rate, burst = self.overall
            self._all = (min(float(burst), self._all[0] + (now - self._all[1]) * rate), now)
            levels.append(self._all[0])
        return levels

    def allows(self, address: str, alone: bool = False) -> bool:
        """Whether ``take`` would succeed now; takes nothing. ``alone``: by the address's
        own bucket only."""
        with self._lock:
            return all(level >= 1 for level in self._levels(address, alone, time.monotonic()))

    def take(self, address: str, alone: bool = False) -> bool:
        """A token from the address's bucket and the overall one, if each has one."""
        now = time.monotonic()
        with self._lock:
            levels = self._levels(address, alone, now)
            allowed = all(level >= 1 for level in levels)
            if allowed:
                self._tokens[address] = (levels[0] - 1, now)
                if len(levels) > 1:
                    self._all = (levels[1] - 1, now)
            return allowed


class _Recent:
    """The ``most`` client addresses added last; connection threads add and ask at once."""

    def __init__(self, most: int = 64) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._seen: Dict[str, None] = {}  # insertion order: the oldest first

    def add(self, address: str) -> None:
        with self._lock:
            self._seen.pop(address, None)
            if len(self._seen) >= self.most:
                self._seen.pop(next(iter(self._seen)))
            self._seen[address] = None

    def __contains__(self, address: object) -> bool:
        with self._lock:
            return address in self._seen


@dataclass
class _Site:
    """What is served: the metrics path and the few pages beside it."""

    path: str
    render: Render
    auth: Tuple[bytes, ...]  # the Authorization headers accepted; none: no auth
    on_scrape_start: Callable[[str], object]  # the scraper's address -> a token for on_scrape
    on_scrape: Callable[[object], None]
    pages: Dict[str, Page] = field(default_factory=dict)
    host_ok: Callable[[str], bool] = lambda host: True
    ui_buckets: _Buckets = field(default_factory=lambda: _Buckets(UI_RATE, UI_BURST, overall=UI_OVERALL))
    auth_failures: _Buckets = field(default_factory=lambda: _Buckets(*AUTH_FAILURES, overall=AUTH_FAILURES_OVERALL))
    # addresses that authenticated: only their own failures limit them, so that guesses from
    # many other addresses cannot lock a scraper out
    authenticated: _Recent = field(default_factory=_Recent)
    on_render_error: Callable[[BaseException], None] = lambda exc: None


class _Server(socketserver.TCPServer):
    """The listening socket and its table of live connections."""

    allow_reuse_address = True
    # A full accept queue drops SYNs and the client retries only a second later; under a
    # connection flood that second is a failed scrape. Queued connections cost no fd.
    request_queue_size = 1024

    def __init__(self, addr: Tuple[str, int], site: _Site, tls: Optional[Callable[[], ssl.SSLContext]],
                 connection_timeout: float, cap: int) -> None:
        self.site = site
        self.tls = tls
        self.connection_timeout = connection_timeout
        self.cap = cap
        self.other_paths_limit = max(1, cap // _OTHER_PATHS_SHARE)
        self._lock = threading.Lock()
        self._conns: Dict[_Connection, None] = {}  # insertion order: oldest first
        self._other_paths_in_flight = 0
        # every connection thread until it has ended, which is after it left the table
        self._threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, _Handler)  # binds; on failure it calls server_close(), which needs the above
        _SERVERS.add(self)

    def get_request(self) -> Tuple[socket.socket, object]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.05)  # the pending connection stays ready: don't spin a core on it
            raise

    def process_request(self, sock: socket.socket, addr: object) -> None:  # type: ignore[override]
        conn = _Connection(sock, self.connection_timeout)
        if not self._admit(conn):
            self.shutdown_request(sock)
            return
        thread = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                  name=f"gradmon-http-{self.server_address[1]}-conn")
        self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: this client goes without
            self._threads.discard(thread)
            self._release(conn)

    def _admit(self, conn: _Connection) -> bool:
        """Room for ``conn`` at the cap: evict the oldest connection still sending its request
        headers (a slowloris client, an idle keep-alive), so that a scraper always gets in.
        When every connection is inside a request, the newcomer is the one turned away."""
        with self._lock:
            live = [c for c in self._conns if not c.hung_up]
            if len(live) >= self.cap:
                waiting = next((c for c in live if not c.in_request), None)
                if waiting is None:
                    return False
                waiting.hang_up()
            self._conns[conn] = None
            return True

    def _serve(self, conn: _Connection, addr: object) -> None:
        try:
            if self.tls is not None:
                context = self.tls()  # per connection: rotated certificates apply to the next client
                with self._lock:  # wrapping detaches the plain socket: the reaper must see one or the other
                    conn.sock = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            _Handler(conn, addr, self)
        except Exception:
            self.handle_error(conn.sock, addr)
        finally:
            self._release(conn)

    def _release(self, conn: _Connection) -> None:
        # out of the table before the fd closes, so the reaper never shuts down a reused fd
        with self._lock:
            self._conns.pop(conn, None)
        if not conn.hung_up and conn.time_left() <= 0:
            # the thread's own write timed out at the deadline before the reaper came: the
            # same cut, so the same reset, or a slow reader is handed the send queue for seconds
            conn.hang_up()
        self.shutdown_request(conn.sock)

    def close_request(self, request: socket.socket) -> None:  # type: ignore[override]
        # socket.close() waits for every file object of the socket: one that outlives the
        # connection's thread (a traceback's frame still holding the handler's rfile) would
        # keep a cut connection open and its linger-0 reset unsent, and a slow reader
        # draining the send queue for seconds
        _close_copy(request)

    def service_actions(self) -> None:
        """The reaper: serve_forever calls this after every accept and every poll interval."""
        now = time.monotonic()
        with self._lock:
            for conn in self._conns:
                if not conn.hung_up and conn.deadline <= now:
                    conn.hang_up()

    def in_flight_limit(self, route: str) -> Optional[int]:
        """How many requests for ``route`` may be in flight at once (None: no limit). The
        metrics path is what the endpoint is for; every other path, pages added later
        included, shares a quarter of the connections."""
        return None if route == self.site.path else self.other_paths_limit

    @contextmanager
    def slot(self, route: str) -> Iterator[bool]:
        """A place for one request for ``route``; yields False when its share is taken."""
        limit = self.in_flight_limit(route)
        if limit is None:
            yield True
            return
        with self._lock:
            admitted = self._other_paths_in_flight < limit
            if admitted:
                self._other_paths_in_flight += 1
        try:
            yield admitted
        finally:
            if admitted:
                with self._lock:
                    self._other_paths_in_flight -= 1

    def server_close(self) -> None:
        """Stop listening, hang up every connection and wait (bounded) for their threads."""
        super().server_close()
        with self._lock:
            for conn in self._conns:
                conn.hang_up()
        deadline = time.monotonic() + _CLOSE_JOIN_S
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def drop_inherited(self) -> None:
        """In a forked child: close this process's copies of every socket. Close only:
        shutdown() would act on the sockets the parent still serves."""
        self._lock = threading.Lock()  # a thread that did not survive the fork may have held it
        for conn in list(self._conns):
            _close_copy(conn.sock)
        self._conns.clear()
        _close_copy(self.socket)

    def handle_error(self, request, client_address) -> None:  # noqa: D102 - quiet: clients misbehave
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gradmon"
    sys_version = ""
    default_request_version = "HTTP/1.0"  # so that refusing a garbage request line sends a status line
    disable_nagle_algorithm = True  # see _send
    server: _Server

    def __init__(self, conn: _Connection, addr: object, server: _Server) -> None:
        self.conn = conn
        self.target = ""
        super().__init__(conn.sock, addr, server)

    def _arm(self) -> float:
        """Bound each read and write from here on by what is left of the connection's
        deadline. The reaper enforces the deadline; this keeps one call from outlasting it."""
        left = self.conn.time_left()
        self.request.settimeout(max(left, 0.001))
        return left

    def setup(self) -> None:
        self._arm()
        super().setup()
        if self.server.tls is not None:
            self.request.do_handshake()

    def handle_one_request(self) -> None:
        self.conn.in_request = False  # waiting for a request: as evictable as a new client
        if self._arm() <= 0:
            self.close_connection = True
            return
        super().handle_one_request()

    def parse_request(self) -> bool:
        if len(self.raw_requestline.split()) == 2:
            # HTTP/0.9: http.server would wait for headers that never come, then answer with a
            # bare body and no status line. Nothing that scrapes speaks it.
            self.command, self.request_version, self.requestline = None, self.default_request_version, ""
            self.send_error(400, "HTTP/0.9 is not served")
            return False
        if not super().parse_request():
            return False
        self.conn.in_request = True
        # http.server rewrites a leading "//" in self.path; route on what the client sent
        self.target = self.requestline.split()[1]
        return True

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
              headers: Tuple[Tuple[str, str], ...] = (), close: bool = False) -> None:
        self.send_response(code)
        for k, v in (("Content-Type", ctype), *headers, ("Content-Length", str(len(body)))):
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")  # also makes http.server close it
        # Status line, headers and body in one write: in two, Nagle on this side and delayed
        # ACK on the client's held every keep-alive response back ~40 ms.
        self._headers_buffer.append(b"\r\n")
        if self.command != "HEAD":
            self._headers_buffer.append(body)
        self.flush_headers()

    def _has_body(self) -> bool:
        lengths = self.headers.get_all("Content-Length", [])
        return "Transfer-Encoding" in self.headers or any(v.strip() != "0" for v in lengths)

    def _dispatch(self) -> None:
        # A body is never read, so its connection cannot be reused: its bytes would be parsed
        # as the next request (request smuggling, with a Transfer-Encoding the parser ignores).
        has_body = self._has_body()
        if self.command not in ("GET", "HEAD"):
            return self._send(405, b"method not allowed\n", headers=(("Allow", "GET, HEAD"),), close=has_body)
        if has_body:
            return self._send(413, b"requests with a body are not accepted\n", close=True)
        route = self.target.split("?", 1)[0]
        with self.server.slot(route) as admitted:
            if not admitted:
                return self._send(503, b"busy: too many requests for paths other than "
                                  + self.server.site.path.encode() + b"\n", close=True)
            self._route(route)

    do_GET = do_HEAD = _dispatch
    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _dispatch  # 405, in one place

    def _route(self, route: str) -> None:
        site = self.server.site
        page = site.pages.get(route)  # None for the metrics path itself
        if page is None and route != site.path:
            return self._send(404, b"not found: gradmon serves " + site.path.encode() + b"\n")
        if (page is None or page.auth) and not self._authorized():
            return
        if page is None:
            return self._metrics()
        if not page.ui:
            return self._send(200, page.body(""), page.ctype)
        if not site.host_ok(self.headers.get("Host", "")):
            return self._send(421, b"this endpoint does not answer to that Host name (see ui_hosts)\n",
                              headers=UI_HEADERS)
        if page.etag is not None:
            return self._static(page)
        if not site.ui_buckets.take(str(self.client_address[0])):
            return self._send(429, b"too many requests: the live page refreshes every few seconds\n",
                              headers=(("Retry-After", "1"),) + UI_HEADERS)
        query = self.target.split("?", 1)[1] if "?" in self.target else ""
        self._send(200, page.body(query), page.ctype, UI_HEADERS)

    def _static(self, page: Page) -> None:
        """One of the page's files: 304 without a body when the client holds this version."""
        held = {tag.strip().replace("W/", "", 1) for tag in self.headers.get("If-None-Match", "").split(",")}
        headers = (("ETag", page.etag),) + STATIC_HEADERS
        if page.etag in held or "*" in held:
            return self._send(304, b"", page.ctype, headers)
        self._send(200, page.body(""), page.ctype, headers)

    def _authorized(self) -> bool:
        """True if the request may go on; otherwise it has been answered: 401, or 429 for a
        client over its rate of failed attempts, whose credential is then not even compared
        (a correct guess must not get through a throttle), so guessing goes at that rate."""
        site = self.server.site
        if not site.auth:
            return True
        peer = str(self.client_address[0])
        if not site.auth_failures.allows(peer, alone=peer in site.authenticated):
            self._send(429, b"too many failed authentications\n", headers=(("Retry-After", "1"),))
            return False
        # http.server decodes headers as Latin-1: encoding back gives the bytes sent
        sent = self.headers.get("Authorization", "").encode("latin-1", "replace")
        if any([hmac.compare_digest(sent, accepted) for accepted in site.auth]):  # all compared: constant time
            site.authenticated.add(peer)
            return True
        site.auth_failures.take(peer, alone=peer in site.authenticated)
        self._send(401, b"unauthorized\n", headers=(("WWW-Authenticate", 'Basic realm="gradmon", charset="UTF-8"'),))
        return False

    def _metrics(self) -> None:
        site = self.server.site
        scrape = self.command == "GET"  # a HEAD (a probe, a curl -I) is not a scrape
        gives_up = _scraper_gives_up(self.headers.get("X-Prometheus-Scrape-Timeout-Seconds"))
        token = None
        if scrape:
            # before rendering: a scrape that starts later renders newer state. The peer's
            # host, not its port: a scraper's connections come from changing ports.
            token = site.on_scrape_start(self.client_address[0])
        try:
            body = site.render()
        except Exception as exc:  # the collector isolates each model; this is the rest
            site.on_render_error(exc)
            return self._send(500, b"gradmon could not render the metrics; the training job's log says why\n")
        headers: List[Tuple[str, str]] = [("Vary", "Accept-Encoding")]
        if accepts_gzip(", ".join(self.headers.get_all("Accept-Encoding", []))):
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        self._send(200, body, CONTENT_TYPE_LATEST, tuple(headers))
        # after the last byte: the scraper has it, unless it gave up before (under load, a
        # Prometheus whose scrape_timeout passed drops what it gets and never sees the state)
        if scrape and time.monotonic() < gives_up:
            site.on_scrape(token)


def basic_auth_headers(user: str, password: str) -> Tuple[bytes, ...]:
    """The ``Authorization`` values that carry these credentials: UTF-8, as RFC 7617 says and
    curl, browsers and Prometheus send, and Latin-1 where that differs and exists (Python's
    requests encodes text credentials so)."""
    out: List[bytes] = []
    for codec in ("utf-8", "latin-1"):
        try:
            header = b"Basic " + base64.b64encode(f"{user}:{password}".encode(codec))
        except UnicodeEncodeError:
            continue
        if header not in out:
            out.append(header)
    return tuple(out)


def _scraper_gives_up(timeout_header: Optional[str]) -> float:
    """When the scraper stops waiting for this response (monotonic): Prometheus sends its
    scrape_timeout with every scrape. Nine tenths of it, for the time the request took
    to arrive; no header: never."""
    try:
        seconds = float(timeout_header) if timeout_header else float("inf")
    except ValueError:
        seconds = float("inf")
    return time.monotonic() + 0.9 * seconds if seconds > 0 else float("inf")


class MetricsServer:
    """One listening endpoint on a daemon thread. ``close()`` stops it and frees the port.

    ``tls`` is called once per accepted connection and returns the context to serve it
    with (so a rotated certificate applies from the next connection on); when it raises,
    that connection is closed. ``connection_timeout`` is the lifetime of any connection,
    and ``max_connections`` is further capped at a quarter of the open-file limit."""

    def __init__(self, render: Render, *, addr: str = "0.0.0.0", port: int = 9400, path: str = "/metrics",
                 tls: Optional[Callable[[], ssl.SSLContext]] = None,
                 basic_auth: Optional[Tuple[str, str]] = None,
                 connection_timeout: float = 10.0, max_connections: int = 64,
                 on_scrape: Callable[[object], None] = lambda token: None,
                 on_scrape_start: Callable[[str], object] = lambda peer: None,
                 pages: Optional[Dict[str, Page]] = None,
                 host_ok: Callable[[str], bool] = lambda host: True,
                 on_render_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        auth = basic_auth_headers(*basic_auth) if basic_auth is not None else ()
        index = b"gradmon: metrics at " + path.encode() + b"\n"
        served = {"/": Page(lambda query: index, auth=True), "/healthz": Page(lambda query: b"ok\n", auth=False)}
        served.update(pages or {})
        served.pop(path, None)  # the metrics path is never a page
        site = _Site(path, render, auth, on_scrape_start, on_scrape, served, host_ok,
                     on_render_error=on_render_error)
        self._httpd = _Server((addr, port), site, tls, connection_timeout, connection_cap(max_connections))
        self.addr = addr
        self.port = self._httpd.server_address[1]
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"gradmon-http-{self.port}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._thread.is_alive():  # not in a forked child: the loop's thread stayed in the parent
            self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


_SERVERS: "weakref.WeakSet[_Server]" = weakref.WeakSet()


def _drop_inherited_sockets() -> None:
    for server in list(_SERVERS):
        server.drop_inherited()


os.register_at_fork(after_in_child=_drop_inherited_sockets)
