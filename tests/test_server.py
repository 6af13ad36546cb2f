"""The /metrics server under misuse: TLS, client certificates, basic auth, wrong methods
and paths, slow and oversized clients, and many scrapers (issue 5, exporter security)."""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import threading
import time
import urllib.request

import pytest
import torch
from torch import nn

import gradmon
from conftest import parse, value
from gradmon.serve.server import CachedExposition, MetricsServer


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3))


def get(url: str, **kw) -> "tuple[int, bytes, dict]":
    try:
        with urllib.request.urlopen(urllib.request.Request(url, **kw), timeout=5) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_tls_serves_a_real_tls_client_and_refuses_plaintext(pki):
    with gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0,
                        tls_certfile=str(pki.dir / "server.pem"), tls_keyfile=str(pki.dir / "server.key")) as mon:
        assert mon.url.startswith("https://")
        body = urllib.request.urlopen(mon.url, timeout=5, context=pki.client_context(False)).read().decode()
        assert value(parse(body), "gradmon_steps_total") == 0
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(mon.url.replace("https", "http"), timeout=5).read()


def test_client_certificate_required_when_a_client_ca_is_set(pki):
    with gradmon.attach(model(), port=0, addr="127.0.0.1", final_scrape_timeout=0,
                        tls_certfile=str(pki.dir / "server.pem"), tls_keyfile=str(pki.dir / "server.key"),
                        tls_client_cafile=str(pki.dir / "ca.pem")) as mon:
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(mon.url, timeout=5, context=pki.client_context(False)).read()
        body = urllib.request.urlopen(mon.url, timeout=5, context=pki.client_context(True)).read()
        assert b"gradmon_steps_total" in body


def test_basic_auth_right_wrong_and_missing(attach):
    mon = attach(model(), basic_auth_user="prom", basic_auth_password="s3cret")
    ok = base64.b64encode(b"prom:s3cret").decode()
    bad = base64.b64encode(b"prom:guess").decode()
    status, body, _ = get(mon.url, headers={"Authorization": f"Basic {ok}"})
    assert status == 200 and b"gradmon_steps_total" in body
    for headers in ({"Authorization": f"Basic {bad}"}, {}):
        status, body, hdrs = get(mon.url, headers=headers)
        assert status == 401 and hdrs["WWW-Authenticate"].startswith("Basic")
        assert b"gradmon" not in body.replace(b'realm="gradmon"', b"")
    assert "s3cret" not in repr(mon.config)


def test_bad_tls_and_auth_options_fail_at_attach(tmp_path):
    with pytest.raises(ValueError, match="tls_certfile"):
        gradmon.attach(model(), tls_certfile=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="basic_auth_user"):
        gradmon.attach(model(), basic_auth_user="prom")


def test_only_get_and_head_of_the_metrics_path(attach):
    mon = attach(model())
    assert get(mon.url, method="POST", data=b"x")[0] == 405
    status, _, hdrs = get(mon.url, method="DELETE")
    assert status == 405 and hdrs["Allow"] == "GET, HEAD"
    assert get(mon.url.replace("/metrics", "/admin"), method="GET")[0] == 404
    status, body, _ = get(mon.url, method="HEAD")
    assert status == 200 and body == b""
    assert get(mon.url.replace("/metrics", "/healthz"))[0] == 200


def test_slow_and_idle_clients_do_not_block_the_next_scrape(attach):
    mon = attach(model(), connection_timeout=2)
    host, port = "127.0.0.1", mon.port
    hogs = []
    for _ in range(50):  # idle connections that never send a byte
        s = socket.create_connection((host, port))
        hogs.append(s)
    slow = socket.create_connection((host, port))
    slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a request, then silence
    t0 = time.monotonic()
    status, body, _ = get(mon.url)
    assert status == 200 and b"gradmon_steps_total" in body
    assert time.monotonic() - t0 < 2.0
    time.sleep(3)  # the per-connection deadline (2 s) closes the stalled ones
    slow.settimeout(2)
    assert slow.recv(100) == b""  # EOF: the server hung up on the half-sent request
    for s in hogs + [slow]:
        s.close()
    assert get(mon.url)[0] == 200


def test_huge_headers_are_refused_and_the_server_stays_healthy(attach):
    mon = attach(model())
    s = socket.create_connection(("127.0.0.1", mon.port))
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    s.settimeout(5)
    reply = s.recv(200)
    s.close()
    assert reply.split(b" ")[1] in (b"400", b"431")
    assert get(mon.url)[0] == 200


def test_twenty_back_to_back_scrapers_never_fail(attach):
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)])
    mon = attach(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    failures, done = [], threading.Event()

    def scraper():
        while not done.is_set():
            try:
                status, body, _ = get(mon.url)
                if status != 200 or b"gradmon_steps_total" not in body:
                    failures.append(status)
            except Exception as exc:  # noqa: BLE001 - any failure counts
                failures.append(repr(exc))

    threads = [threading.Thread(target=scraper) for _ in range(20)]
    for t in threads:
        t.start()
    for _ in range(30):
        net(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    time.sleep(1)
    done.set()
    for t in threads:
        t.join()
    assert not failures
    assert mon._errors.total() == 0


def test_exposition_is_rendered_once_per_snapshot_not_per_scrape():
    renders = []
    gen = [0]
    cache = CachedExposition(lambda: renders.append(1) or b"x 1\n", lambda: gen[0], max_age=60)
    server = MetricsServer(cache.get, addr="127.0.0.1", port=0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        for _ in range(10):
            assert get(url)[1] == b"x 1\n"
        gen[0] += 1
        for _ in range(10):
            get(url)
    finally:
        server.close()
    assert len(renders) == 2


def test_odd_module_names_are_escaped_and_parse(attach):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module('we"ird\\name', nn.Linear(2, 2))
            self.add_module("ünïcode[0]", nn.Linear(2, 2))

        def forward(self, x):
            return getattr(self, "ünïcode[0]")(getattr(self, 'we"ird\\name')(x))

    net = Odd()
    mon = attach(net)
    net(torch.randn(1, 2)).sum().backward()
    torch.optim.SGD(net.parameters(), lr=0.0).step()
    mon.flush()
    status, body, _ = get(mon.url)
    s = parse(body.decode())
    assert value(s, "gradmon_grad_norm", layer='we"ird\\name') > 0
    assert value(s, "gradmon_grad_norm", layer="ünïcode[0]") > 0
