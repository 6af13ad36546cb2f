"""Endpoint settings that must be right at attach() or stay right for weeks (issue 9, items
5, 6, 6b, 11): credentials, TLS files, shared ports, certificate rotation."""

from __future__ import annotations

import base64
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

import gradmon
from conftest import parse, scrape, value
from servers import free_port, free_port_range


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3))


def gradmon_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("gradmon") and t.is_alive()]


# -- credentials -------------------------------------------------------------------------

@pytest.mark.parametrize("user, password, option", [
    ("", "s3cret", "basic_auth_user"), ("prom", "", "basic_auth_password"), ("a:b", "s3cret", "basic_auth_user")])
def test_empty_or_malformed_basic_auth_credentials_are_refused_from_code(user, password, option):
    with pytest.raises(ValueError, match=f"'{option}'"):
        gradmon.attach(model(), port=0, basic_auth_user=user, basic_auth_password=password)


@pytest.mark.parametrize("user, password, option", [("", "s3cret", "basic_auth_user"),
                                                    ("prom", "", "basic_auth_password")])
def test_empty_basic_auth_credentials_are_refused_from_the_environment(monkeypatch, user, password, option):
    monkeypatch.setenv("GRADMON_BASIC_AUTH_USER", user)
    monkeypatch.setenv("GRADMON_BASIC_AUTH_PASSWORD", password)
    with pytest.raises(ValueError, match=f"'{option}'"):
        gradmon.attach(model(), port=0)
    assert not gradmon_threads()


def test_basic_auth_over_plain_http_on_a_network_address_warns(caplog):
    caplog.set_level(logging.WARNING, logger="gradmon")
    with gradmon.attach(model(), port=0, addr="0.0.0.0", final_scrape_timeout=0,
                        basic_auth_user="prom", basic_auth_password="s3cret"):
        pass
    assert any("plain HTTP" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0,
                        basic_auth_user="prom", basic_auth_password="s3cret"):
        pass
    assert not any("plain HTTP" in r.getMessage() for r in caplog.records)


# -- TLS files ---------------------------------------------------------------------------

def _attach_tls(**files):
    return gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0,
                          **{k: str(v) for k, v in files.items()})


def test_a_key_that_does_not_match_the_certificate_is_a_value_error_naming_both_files(pki):
    with pytest.raises(ValueError, match="'tls_keyfile'.*client.key.*does not match.*server.pem"):
        _attach_tls(tls_certfile=pki.dir / "server.pem", tls_keyfile=pki.dir / "client.key")
    assert not gradmon_threads()


def test_garbage_certificate_and_ca_files_are_value_errors_naming_the_file(pki, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="'tls_certfile'.*junk.pem"):
        _attach_tls(tls_certfile=junk, tls_keyfile=pki.dir / "server.key")
    with pytest.raises(ValueError, match="'tls_client_cafile'.*junk.pem"):
        _attach_tls(tls_certfile=pki.dir / "server.pem", tls_keyfile=pki.dir / "server.key", tls_client_cafile=junk)
    assert not gradmon_threads()


def test_an_encrypted_key_is_read_with_tls_key_password_and_refused_without_one(pki):
    pki.openssl("pkey", "-in", "server.key", "-aes256", "-passout", "pass:hunter2", "-out", "server-enc.key")
    with pytest.raises(ValueError, match="'tls_key_password'"):
        _attach_tls(tls_certfile=pki.dir / "server.pem", tls_keyfile=pki.dir / "server-enc.key",
                    tls_key_password="wrong")
    with _attach_tls(tls_certfile=pki.dir / "server.pem", tls_keyfile=pki.dir / "server-enc.key",
                     tls_key_password="hunter2") as mon:
        body = urllib.request.urlopen(mon.url, timeout=5, context=pki.client_context()).read().decode()
        assert value(parse(body), "gradmon_steps_total") == 0
    assert "hunter2" not in repr(mon.config)


def test_an_encrypted_key_without_a_password_never_prompts_on_a_terminal(pki):
    """With a controlling terminal OpenSSL would stop at "Enter PEM pass phrase:" and hang
    the job; the child below has one (a new session that opens a pty)."""
    import pty
    if not (pki.dir / "server-enc.key").exists():
        pki.openssl("pkey", "-in", "server.key", "-aes256", "-passout", "pass:hunter2", "-out", "server-enc.key")
    primary, secondary = pty.openpty()
    script = ("import os, sys\n"
              f"os.close(os.open({os.ttyname(secondary)!r}, os.O_RDWR))  # becomes the controlling terminal\n"
              "assert os.isatty(0) and open('/dev/tty', 'rb')\n"
              "import gradmon, torch\n"
              "try:\n"
              f"    gradmon.attach(torch.nn.Linear(2, 2), port=0, tls_certfile={str(pki.dir / 'server.pem')!r},"
              f" tls_keyfile={str(pki.dir / 'server-enc.key')!r})\n"
              "except ValueError as e:\n"
              "    print('REFUSED', e, file=sys.stderr, flush=True)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script], stdin=secondary, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=60, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail("attach() waited for a pass phrase on the terminal")
    finally:
        os.close(secondary)
        os.set_blocking(primary, False)
        try:
            typed = os.read(primary, 4096)
        except OSError:
            typed = b""
        os.close(primary)
    assert "REFUSED" in proc.stderr and "tls_key_password" in proc.stderr, proc.stdout + proc.stderr
    assert b"pass phrase" not in typed


def test_an_expired_server_certificate_warns_at_attach(pki, caplog):
    pki.issue("expired", "20200101000000Z", "20200102000000Z")
    caplog.set_level(logging.WARNING, logger="gradmon")
    with _attach_tls(tls_certfile=pki.dir / "expired.pem", tls_keyfile=pki.dir / "expired.key"):
        pass
    assert any("expired on 2020-01-02" in r.getMessage() for r in caplog.records)


# -- sharing one port ----------------------------------------------------------------------

def test_a_second_monitor_with_other_auth_or_tls_on_a_shared_port_is_refused(pki):
    port = free_port()
    first = gradmon.attach(model(), port=port, addr="127.0.0.1", final_scrape_timeout=0)
    try:
        other = model()
        with pytest.raises(ValueError, match="'basic_auth_user' differs"):
            gradmon.attach(other, port=port, addr="127.0.0.1", basic_auth_user="prom", basic_auth_password="pw")
        with pytest.raises(ValueError, match="'tls_certfile' differs"):
            gradmon.attach(other, port=port, addr="127.0.0.1", tls_certfile=str(pki.dir / "server.pem"),
                           tls_keyfile=str(pki.dir / "server.key"))
        assert all(not m._forward_hooks for m in other.modules())
        assert first.state == "running" and scrape(first.url)
    finally:
        first.detach()


def test_attach_with_the_bound_port_of_an_endpoint_joins_it():
    a = gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0, name="a")
    try:
        b = gradmon.attach(model(), port=a.port, addr="127.0.0.1", final_scrape_timeout=0, name="b")
        c = gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0, name="c")
        assert b.state == c.state == "running" and b.url == c.url == a.url
        s = scrape(a.url)
        assert {ls for (n, ls) in s if n == "gradmon_steps_total"} == {
            (("model", m),) for m in ("a", "b", "c")}
        b.detach()
        c.detach()
    finally:
        a.detach()


def test_the_port_before_the_rank_offset_joins_the_offset_endpoint(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    port = free_port_range(2)
    a = gradmon.attach(model(), port=port, addr="127.0.0.1", final_scrape_timeout=0, name="a")
    try:
        assert a.port == port + 1
        b = gradmon.attach(model(), port=port, addr="127.0.0.1", final_scrape_timeout=0, name="b")
        assert b.state == "running" and b.url == a.url
        b.detach()
    finally:
        a.detach()


# -- certificate rotation --------------------------------------------------------------------

def _served_serial(port: int, pki) -> str:
    ctx = pki.client_context()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert()["serialNumber"]


def _wait_for(predicate, seconds: float = 6.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_rotated_certificate_files_are_served_without_dropping_the_endpoint(pki, tmp_path):
    live_cert, live_key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.dir / "server.pem", live_cert)
    shutil.copy(pki.dir / "server.key", live_key)
    with _attach_tls(tls_certfile=live_cert, tls_keyfile=live_key) as mon:
        before = _served_serial(mon.port, pki)
        new_cert, new_key = pki.issue("rotated")
        shutil.copy(new_key, live_key)  # key first, as a rotation may land: a mismatch in between is survived
        shutil.copy(new_cert, live_cert)
        assert _wait_for(lambda: _served_serial(mon.port, pki) != before)
        rotated = _served_serial(mon.port, pki)

        live_cert.write_text("garbage\n")  # a broken rotation keeps the last good certificate
        time.sleep(1.5)
        assert _served_serial(mon.port, pki) == rotated
        body = urllib.request.urlopen(mon.url, timeout=5, context=pki.client_context()).read().decode()
        assert value(parse(body), "gradmon_hook_errors_total", stage="server") >= 1
        assert mon.state == "running"


# -- a failed attach leaves nothing ----------------------------------------------------------

def test_a_failed_attach_on_a_shared_port_keeps_the_other_monitor_and_leaves_no_hook(pki):
    first = gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0, name="first")
    try:
        net = model()
        with pytest.raises(ValueError):
            gradmon.attach(net, port=first.port, addr="127.0.0.1", basic_auth_user="u", basic_auth_password="p")
        from torch.optim import optimizer
        hooks = len(optimizer._global_optimizer_pre_hooks)
        net(torch.randn(1, 3)).sum().backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        assert len(optimizer._global_optimizer_pre_hooks) == hooks
        assert all(not p._post_accumulate_grad_hooks for p in net.parameters()
                   if getattr(p, "_post_accumulate_grad_hooks", None) is not None)
        # the name of the failed monitor is free again
        again = gradmon.attach(net, port=0, addr="127.0.0.1", final_scrape_timeout=0, name="second")
        assert again.name == "second"
        again.detach()
    finally:
        first.detach()


# -- who can delay the end of a run ------------------------------------------------------------

def _scrape_with(url: str, headers: dict) -> int:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _detach_seconds(mon) -> float:
    t0 = time.monotonic()
    mon.detach()
    return time.monotonic() - t0


AUTH = {"Authorization": "Basic " + base64.b64encode(b"prom:s3cret").decode()}


def test_with_basic_auth_a_client_that_fails_to_authenticate_never_delays_the_end_of_a_run():
    mon = gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=20,
                         basic_auth_user="prom", basic_auth_password="s3cret")
    for _ in range(3):  # "periodic", but never authenticated
        assert _scrape_with(mon.url, {}) == 401
        time.sleep(0.2)
    assert _detach_seconds(mon) < 2


def test_with_basic_auth_an_authenticated_periodic_scraper_is_waited_for():
    mon = gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=3,
                         basic_auth_user="prom", basic_auth_password="s3cret")
    for _ in range(3):
        assert _scrape_with(mon.url, AUTH) == 200
        time.sleep(0.2)
    assert _detach_seconds(mon) >= 2.5  # nobody scraped the final state: the whole timeout


def test_a_non_ascii_password_from_the_environment_works_with_utf8_credentials(monkeypatch):
    monkeypatch.setenv("GRADMON_BASIC_AUTH_USER", "prom")
    monkeypatch.setenv("GRADMON_BASIC_AUTH_PASSWORD", "pässwörd-密码")
    mon = gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0)
    try:
        utf8 = {"Authorization": "Basic " + base64.b64encode("prom:pässwörd-密码".encode()).decode()}
        assert _scrape_with(mon.url, utf8) == 200
        assert _scrape_with(mon.url, AUTH) == 401
    finally:
        mon.detach()
