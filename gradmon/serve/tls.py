"""The endpoint's TLS context: built and checked at ``attach()``, reloaded when the files rotate.

Every mistake in the certificate, key or client CA is a ``ValueError`` at attach that
names the option and the file, never a dead endpoint discovered hours later. Loading
never prompts: OpenSSL asks on the terminal for the pass phrase of an encrypted key
when no password callback is given, which would hang a training job at attach.

Multi-week jobs outlive their certificates (cert-manager rotates the files in place),
so :class:`ReloadingContext` re-reads the files when their stat changes, checked at most
once a second from the connection path. A broken new file keeps the old context and is
reported once per change through ``on_error``.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

log = logging.getLogger("gradmon")

_CHECK_INTERVAL = 1.0  # seconds between stat() checks of the files


@dataclass(frozen=True)
class TLSFiles:
    certfile: str
    keyfile: Optional[str] = None
    client_cafile: Optional[str] = None
    key_password: Optional[str] = None

    def paths(self) -> Tuple[str, ...]:
        return tuple(p for p in (self.certfile, self.keyfile, self.client_cafile) if p)


class _NoPassword(Exception):
    pass


def _password(files: TLSFiles) -> Callable[[], str]:
    def cb() -> str:
        if files.key_password is None:
            raise _NoPassword()
        return files.key_password
    return cb


def build(files: TLSFiles) -> ssl.SSLContext:
    """A server context for ``files``; ValueError naming the option and file on any problem."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key_option = "tls_keyfile" if files.keyfile else "tls_certfile"
    key_path = files.keyfile or files.certfile
    try:
        ctx.load_cert_chain(files.certfile, files.keyfile, password=_password(files))
    except _NoPassword:
        raise ValueError(f"gradmon: option {key_option!r}: the private key in {key_path!r} is encrypted; "
                         "set tls_key_password (GRADMON_TLS_KEY_PASSWORD) or use an unencrypted key") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(_explain_chain_error(files, key_option, key_path, exc)) from None
    if files.client_cafile:
        try:
            ctx.load_verify_locations(files.client_cafile)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"gradmon: option 'tls_client_cafile': {files.client_cafile!r} is not a readable "
                             f"PEM CA bundle ({exc})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _explain_chain_error(files: TLSFiles, key_option: str, key_path: str, exc: BaseException) -> str:
    """Which file is wrong: OpenSSL's "[SSL] PEM lib" alone does not say."""
    text = str(exc)
    if "KEY_VALUES_MISMATCH" in text or "key values mismatch" in text:
        return (f"gradmon: option {key_option!r}: the private key in {key_path!r} does not match the "
                f"certificate in {files.certfile!r}")
    if files.key_password is not None and _is_encrypted(key_path):
        return f"gradmon: option 'tls_key_password' does not decrypt the private key in {key_path!r}"
    probe = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        probe.load_verify_locations(files.certfile)  # parses the certificate alone
    except (ssl.SSLError, OSError):
        return f"gradmon: option 'tls_certfile': {files.certfile!r} holds no readable PEM certificate ({text})"
    return f"gradmon: option {key_option!r}: {key_path!r} holds no readable PEM private key ({text})"


def _is_encrypted(path: str) -> bool:
    """PKCS#8 ("BEGIN ENCRYPTED PRIVATE KEY") and legacy ("Proc-Type: 4,ENCRYPTED") PEM keys."""
    try:
        with open(path, "rb") as f:
            return b"ENCRYPTED" in f.read(1 << 20)
    except OSError:
        return False


def not_after(certfile: str) -> Optional[float]:
    """The certificate's expiry (epoch seconds), or None where it cannot be read."""
    try:
        info = ssl._ssl._test_decode_cert(certfile)  # type: ignore[attr-defined]
        return float(ssl.cert_time_to_seconds(info["notAfter"]))
    except Exception:
        return None


def warn_if_expired(certfile: str) -> None:
    expiry = not_after(certfile)
    if expiry is not None and expiry < time.time():
        log.warning("gradmon: the TLS certificate %s expired on %s; scrapers that verify it will fail",
                    certfile, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expiry)))


def _stat_key(paths: Tuple[str, ...]) -> Tuple[object, ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class ReloadingContext:
    """Callable returning the current context; the endpoint calls it once per connection."""

    def __init__(self, files: TLSFiles, on_error: Callable[[BaseException], None]) -> None:
        self.files = files
        self._on_error = on_error
        self._lock = threading.Lock()
        self._ctx = build(files)
        self._key = _stat_key(files.paths())
        self._checked = time.monotonic()
        self.reloads = 0

    def __call__(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked < _CHECK_INTERVAL:
            return self._ctx
        with self._lock:
            if now - self._checked >= _CHECK_INTERVAL:
                self._checked = now
                self._maybe_reload()
        return self._ctx

    def _maybe_reload(self) -> None:
        key = _stat_key(self.files.paths())
        if key == self._key:
            return
        self._key = key  # a broken file is reported once per change, not once a second
        try:
            self._ctx = build(self.files)
        except ValueError as exc:
            log.error("gradmon: TLS files changed but could not be loaded; still serving the previous "
                      "certificate: %s", exc)
            self._on_error(exc)
            return
        self.reloads += 1
        log.info("gradmon: TLS certificate reloaded from %s", self.files.certfile)
        warn_if_expired(self.files.certfile)
