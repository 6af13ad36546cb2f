"""One GET from a peer that may be hostile: the client side of ``gradmon top``.

urllib is the wrong tool against such a peer: its ``timeout`` bounds each socket operation,
not the request (one byte a second keeps a read alive for ever), it reads a body of any
size, follows redirects with the ``Authorization`` header (to another host, or from https
to cleartext http), and hands credentials to whatever proxy the environment names. Here:

* one monotonic :class:`Deadline` covers the name lookup, the connects, the TLS handshake,
  the request, the headers and the body; every socket read waits at most the time left;
* the body is read in chunks up to ``max_bytes`` and refused beyond;
* a redirect is never followed: :class:`Redirected` carries the ``Location``;
* no proxy unless the caller names one (``proxy``); the environment is never read.

Errors are :class:`FetchError`, whose message is meant for a person (pass it through
:func:`gradmon.sanitize.clean` before showing it: the reason phrase is the peer's).
"""

from __future__ import annotations

import base64
import http.client
import io
import re
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Optional, Tuple

DEFAULT_TIMEOUT = 5.0
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
_CHUNK = 64 * 1024
_SHOWN_LOCATION = 300
"""A Location is shown up to this many characters: a header line may be 64 KB."""


class FetchError(Exception):
    """The URL could not be read; the message says why, for a person."""


class Redirected(FetchError):
    """The server answered with a redirect, which is never followed."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(f"HTTP {status}: redirected to {location}; redirects are not followed")
        self.status, self.location = status, location


class HTTPError(FetchError):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes


_USERINFO = re.compile(r"(?i)([a-z][a-z0-9+.-]*://)([^/?#\s:@]*):[^/?#\s]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it shown as ``***``."""
    return _USERINFO.sub(r"\1\2:***@", text)


class Deadline:
    """A point on the monotonic clock; :meth:`left` raises once it has passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise FetchError(self.message())
        return left

    def message(self) -> str:
        return f"no complete response within {self.seconds:g} s (connect, headers and body)"


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most the time left before the deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buffer)


class _Wire:
    """What :class:`http.client.HTTPResponse` asks of a socket: ``makefile``."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline))

    def send(self, data: bytes) -> None:
        self.sock.settimeout(self.deadline.left())
        self.sock.sendall(data)

    def response(self, method: str = "GET") -> http.client.HTTPResponse:
        response = http.client.HTTPResponse(self, method=method)  # type: ignore[arg-type]
        response.begin()
        return response


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _host_port(parts: urllib.parse.SplitResult) -> Tuple[str, int]:
    try:
        port = parts.port
    except ValueError:
        raise FetchError(f"the port in {mask_credentials(parts.geturl())} is not a number from 1 to 65535") from None
    if not parts.hostname:
        raise FetchError(f"no host in {mask_credentials(parts.geturl())}")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _authority(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == (443 if scheme == "https" else 80) else f"{shown}:{port}"


def _resolve(host: str, port: int, deadline: Deadline) -> list:
    """``getaddrinfo`` within the deadline: it takes no timeout, so it runs on a thread of its
    own that is left behind (a daemon) when the name server does not answer in time."""
    answer: list = []

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            answer.append(exc)

    thread = threading.Thread(target=lookup, name="top-resolve", daemon=True)
    thread.start()
    thread.join(deadline.left())
    if not answer:
        raise FetchError(deadline.message())
    if isinstance(answer[0], OSError):
        raise answer[0]
    return answer[0]


def _connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    """A TCP connection to the first address of ``host`` that answers before the deadline."""
    error: Optional[OSError] = None
    for family, kind, proto, _, address in _resolve(host, port, deadline):
        left = deadline.left()
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
            return sock
        except socket.timeout:
            sock.close()
            raise FetchError(deadline.message()) from None
        except OSError as exc:
            sock.close()
            error = exc
    raise FetchError(f"cannot connect to {_authority(host, port, 'http')}: {error}")


def get(url: str, *, authorization: Optional[str] = None, context: Optional[ssl.SSLContext] = None,
        timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES,
        proxy: Optional[str] = None) -> Response:
    """GET ``url`` (http or https, no ``user:password@``: pass ``authorization``) within
    ``timeout`` seconds all told; through ``proxy`` (``http://[user:password@]host:port``)
    only when given."""
    deadline = Deadline(timeout)
    parts = urllib.parse.urlsplit(url)
    host, port = _host_port(parts)
    target = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    target += f"?{urllib.parse.quote(parts.query, safe='=&%+')}" if parts.query else ""
    headers = {"Host": _authority(host, port, parts.scheme), "User-Agent": "gradmon-top",
               "Accept": "text/plain", "Accept-Encoding": "identity", "Connection": "close"}
    if authorization:
        headers["Authorization"] = authorization
    try:
        sock = _open(parts.scheme, host, port, proxy, deadline)
        try:
            if proxy and parts.scheme == "http":  # a forward proxy takes the absolute URL
                target = urllib.parse.urlunsplit(("http", headers["Host"], target, "", ""))
                headers.update(_proxy_auth(proxy))
            if parts.scheme == "https":
                sock = _tls(sock, host, context or ssl.create_default_context(), deadline)
            wire = _Wire(sock, deadline)
            wire.send(_head(f"GET {target}", headers))
            return _read(wire.response(), url, max_bytes)
        finally:
            sock.close()
    except socket.timeout:
        raise FetchError(deadline.message()) from None
    except ssl.SSLError as exc:
        raise FetchError(f"TLS: {exc}") from None
    except http.client.HTTPException as exc:
        raise FetchError(f"not an HTTP response ({type(exc).__name__}: {str(exc)[:200]})") from None
    except FetchError:
        raise
    except UnicodeError as exc:  # a host name or path that is neither ASCII nor IDNA
        raise FetchError(f"cannot write the request: {exc}") from None
    except OSError as exc:
        raise FetchError(f"cannot read {_authority(host, port, parts.scheme)}: {exc}") from None


def _open(scheme: str, host: str, port: int, proxy: Optional[str], deadline: Deadline) -> socket.socket:
    """A connection to the server, or to it through ``proxy`` (a CONNECT tunnel for https)."""
    if not proxy:
        return _connect(host, port, deadline)
    p = urllib.parse.urlsplit(proxy)
    sock = _connect(*_host_port(p), deadline)
    if scheme == "https":
        try:
            _tunnel(_Wire(sock, deadline), host, port, proxy)
        except BaseException:
            sock.close()
            raise
    return sock


def _tunnel(wire: "_Wire", host: str, port: int, proxy: str) -> None:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # CONNECT always names the port
    wire.send(_head(f"CONNECT {authority}", {"Host": authority, **_proxy_auth(proxy)}))
    answer = wire.response("CONNECT")  # the proxy sends nothing after its headers until the TLS hello
    if answer.status != 200:
        raise FetchError(f"the proxy refused the tunnel: HTTP {answer.status} {answer.reason[:200]}")


def _head(request_line: str, headers: dict) -> bytes:
    lines = [f"{request_line} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _proxy_auth(proxy: str) -> dict:
    p = urllib.parse.urlsplit(proxy)
    if p.username is None:
        return {}
    return {"Proxy-Authorization": _basic(urllib.parse.unquote(p.username), urllib.parse.unquote(p.password or ""))}


def _tls(sock: socket.socket, host: str, context: ssl.SSLContext, deadline: Deadline) -> ssl.SSLSocket:
    tls = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    tls.settimeout(deadline.left())  # the handshake as a whole, not each of its reads
    tls.do_handshake()
    return tls


def _read(response: http.client.HTTPResponse, url: str, max_bytes: int) -> Response:
    if 300 <= response.status < 400:
        location = response.getheader("Location")
        shown = mask_credentials(urllib.parse.urljoin(mask_credentials(url), location)) if location else "(no Location)"
        raise Redirected(response.status, shown[:_SHOWN_LOCATION] + ("..." if len(shown) > _SHOWN_LOCATION else ""))
    if response.status != 200:
        raise HTTPError(response.status, response.reason[:200])
    encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise FetchError(f"a body in Content-Encoding {encoding[:40]}, which was not asked for")
    too_large = f"the response is larger than {max_bytes:,} bytes (--max-bytes)"
    if response.length is not None and response.length > max_bytes:
        raise FetchError(too_large)
    body, size = [], 0
    while True:
        try:
            chunk = response.read(_CHUNK)
        except http.client.IncompleteRead:
            raise FetchError("the response ended before its declared length") from None
        if not chunk:
            break
        size += len(chunk)
        if size > max_bytes:
            raise FetchError(too_large)
        body.append(chunk)
    return Response(response.status, response.getheader("Content-Type") or "", b"".join(body))
