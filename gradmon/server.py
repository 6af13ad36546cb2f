"""The /metrics HTTP server: TLS, client certificates, basic auth, and nothing else served.

It knows nothing about where numbers come from: it serves what ``render()`` returns.
Why not prometheus_client's ``start_http_server``: it has no authentication, answers
any method on any path, and gives a connection unlimited time to send its headers, so
one slow client holds a thread forever. Here:

* only GET and HEAD of the metrics path (405 with ``Allow`` for other methods, 404 for
  other paths, ``/healthz`` for liveness probes);
* every connection has a deadline (``timeout`` seconds) for its request, TLS handshake
  included, and the handshake runs in the connection's own thread, so a slowloris
  client never blocks the accept loop or the next scrape; header lines over 64 KiB or
  over 100 headers are refused by http.server (431/400);
* HTTP basic auth compared with ``hmac.compare_digest`` (constant time); a wrong or
  missing credential gets 401 and not a byte of the exposition;
* the exposition is rendered once per new snapshot (``CachedExposition``), not once per
  scrape: twenty dashboards scraping at 1 Hz cost one render per training step at most.
"""

from __future__ import annotations

import base64
import gzip
import hmac
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Hashable, Optional, Tuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST

Render = Callable[[], bytes]


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr: Tuple[str, int], handler: type, tls: Optional[ssl.SSLContext]) -> None:
        self.tls = tls
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.address_family = family
        super().__init__(addr, handler)

    def get_request(self):  # type: ignore[override]
        sock, addr = super().get_request()
        if self.tls is not None:
            # handshake later, in the connection's thread, under its deadline
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request, client_address) -> None:  # noqa: D102 - quiet: clients misbehave
        pass


class MetricsServer:
    """One listening endpoint on a daemon thread. ``close()`` stops it and frees the port."""

    def __init__(self, render: Render, *, addr: str = "0.0.0.0", port: int = 9400, path: str = "/metrics",
                 certfile: Optional[str] = None, keyfile: Optional[str] = None,
                 client_cafile: Optional[str] = None, basic_auth: Optional[Tuple[str, str]] = None,
                 timeout: float = 5.0, on_scrape: Callable[[], None] = lambda: None) -> None:
        tls = None
        if certfile:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(certfile, keyfile)
            if client_cafile:
                tls.load_verify_locations(client_cafile)
                tls.verify_mode = ssl.CERT_REQUIRED
        expected = None
        if basic_auth is not None:
            expected = b"Basic " + base64.b64encode(f"{basic_auth[0]}:{basic_auth[1]}".encode())

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "gradmon"
            sys_version = ""

            def setup(self) -> None:
                self.request.settimeout(timeout)
                if tls is not None:
                    self.request.do_handshake()
                super().setup()

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                      headers: Tuple[Tuple[str, str], ...] = ()) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self) -> None:
                route = self.path.split("?", 1)[0]
                if route == "/healthz":
                    return self._send(200, b"ok\n")
                if route not in (path, "/"):
                    return self._send(404, b"not found: gradmon serves " + path.encode() + b"\n")
                if expected is not None and not hmac.compare_digest(
                        self.headers.get("Authorization", "").encode(), expected):
                    return self._send(401, b"unauthorized\n", headers=(("WWW-Authenticate", 'Basic realm="gradmon"'),))
                if route == "/":
                    return self._send(200, b"gradmon: metrics at " + path.encode() + b"\n")
                body = render()
                headers: Tuple[Tuple[str, str], ...] = ()
                if "gzip" in self.headers.get("Accept-Encoding", ""):
                    body, headers = gzip.compress(body, compresslevel=1), (("Content-Encoding", "gzip"),)
                self._send(200, body, CONTENT_TYPE_LATEST, headers)
                on_scrape()

            do_GET = do_HEAD = _serve

            def _not_allowed(self) -> None:
                self._send(405, b"method not allowed\n", headers=(("Allow", "GET, HEAD"),))

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

        self._httpd = _Server((addr, port), Handler, tls)
        self.addr = addr
        self.port = self._httpd.server_address[1]
        self.scheme = "https" if tls else "http"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"gradmon-http-{self.port}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
