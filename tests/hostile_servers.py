"""Hostile HTTP servers on 127.0.0.1, for `gradmon top`'s tests.

Each is a real listening socket whose connections are served on threads of their own, in
raw bytes, so that it can misbehave the way an attacker's server does: a body without end,
one byte at a time, a redirect elsewhere, escape sequences where names go. Every request
head it receives is recorded, so a test can say who got the credentials.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from typing import Callable, List, Optional, Sequence

Handler = Callable[["RawServer", socket.socket], None]


class RawServer:
    """Serves ``handle(server, connection)`` after reading each request head; over TLS when
    given a server context. Use as a context manager, or call :meth:`close`."""

    def __init__(self, handle: Handler, tls: Optional[ssl.SSLContext] = None) -> None:
        self.handle, self.tls = handle, tls
        self.requests: List[bytes] = []
        self.sent = 0
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/metrics"
        self._thread = threading.Thread(target=self._accept, name=f"hostile-{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name=f"hostile-{self.port}-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            conn.settimeout(10)
            head = read_head(conn)
            with self._lock:
                self.requests.append(head)
            self.handle(self, conn)
        except (OSError, ssl.SSLError):
            pass  # the client went away (what these servers mostly want)
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        with self._lock:
            self.sent += len(data)

    def close(self) -> None:
        self.closed.set()
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> "RawServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_head(conn: socket.socket, limit: int = 65536) -> bytes:
    """A request's line and headers, up to the blank line."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) < limit:
        data = conn.recv(4096)
        if not data:
            break
        head += data
    return head


def header(head: bytes, name: str) -> Optional[str]:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def respond(status: bytes = b"200 OK", headers: Sequence[bytes] = (b"Content-Type: text/plain; version=0.0.4",),
            body: bytes = b"") -> Handler:
    """One fixed response, in the server's own bytes (reason phrase included), then close."""
    def handle(server: RawServer, conn: socket.socket) -> None:
        server.send(conn, b"HTTP/1.1 " + status + b"\r\n" + b"".join(h + b"\r\n" for h in headers)
                    + b"Connection: close\r\n\r\n" + body)
    return handle


def endless(line: bytes = b"# " + b"x" * 1021 + b"\n", cap: int = 1 << 30) -> Handler:
    """A 200 without a length whose body is ``line`` again and again (up to ``cap`` bytes, so
    a client that never stops fails its test instead of running for ever)."""
    def handle(server: RawServer, conn: socket.socket) -> None:
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        block = line * max(1, 65536 // len(line))
        while server.sent < cap and not server.closed.is_set():
            server.send(conn, block)
    return handle


def drip(every: float = 0.2) -> Handler:
    """A valid response, status line first, one byte every ``every`` seconds for ever: each
    read finishes quickly, the response never does."""
    def handle(server: RawServer, conn: socket.socket) -> None:
        data = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"# drip\n" * 100000
        for i in range(len(data)):
            if server.closed.wait(every):
                return
            server.send(conn, data[i:i + 1])
    return handle


def redirect(location: str, status: int = 302) -> Handler:
    return respond(f"{status} Found".encode(), (f"Location: {location}".encode(), b"Content-Length: 0"))


def forward_proxy() -> Handler:
    """A plain HTTP proxy: an absolute-URL GET is passed on in origin form, a CONNECT becomes
    a byte tunnel. What it was asked is in the server's ``requests``."""
    def handle(server: RawServer, conn: socket.socket) -> None:
        head = server.requests[-1]
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            upstream = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
            server.send(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
            _pipe(conn, upstream)
            return
        rest = target.split("://", 1)[1]
        authority, _, path = rest.partition("/")
        host, _, port = authority.rpartition(":")
        upstream = socket.create_connection((host.strip("[]"), int(port or 80)), timeout=10)
        lines = head.split(b"\r\n")
        upstream.sendall(b" ".join([method.encode(), b"/" + path.encode(), b"HTTP/1.1"]) + b"\r\n"
                         + b"\r\n".join(line for line in lines[1:] if not line.lower().startswith(b"proxy-")))
        _pipe(conn, upstream)
    return handle


def _pipe(a: socket.socket, b: socket.socket, idle: float = 10.0) -> None:
    """Copy bytes both ways until either side closes or nothing moves for ``idle`` seconds."""
    with b:
        deadline = time.monotonic() + idle
        while time.monotonic() < deadline:
            ready, _, _ = select.select([a, b], [], [], 0.1)
            for src in ready:
                data = src.recv(65536)
                if not data:
                    return
                (b if src is a else a).sendall(data)
                deadline = time.monotonic() + idle


def exposition(model: str = "m", layer: str = "blocks.0.fc1", steps: int = 5, nonfinite: int = 0) -> bytes:
    """A small gradmon exposition; ``model`` and ``layer`` go into label values as given
    (escaped only as the text format requires: backslash, quote, newline); ``nonfinite``
    NaN elements counted in the gradient."""
    def quote(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    target = f'model="{quote(model)}",rank="0"'
    return (f"gradmon_steps_total{{{target}}} {steps}\n"
            f'gradmon_run_state{{{target},state="training"}} 1\n'
            f"gradmon_grad_global_norm{{{target}}} 1.5\n"
            f'gradmon_grad_norm{{{target},layer="{quote(layer)}"}} 0.5\n'
            f'gradmon_rank_nonfinite_total{{{target},tensor="grad",kind="nan"}} {nonfinite}\n').encode()
