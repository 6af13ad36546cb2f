"""`gradmon top`: driven in a real terminal (tmux) against a real demo, over basic auth and
mutual TLS against a real endpoint, and its local checks against the alert rules' thresholds."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time

import pytest

import gradmon
from conftest import sgd_steps, tiny
from gradmon import alerting, top
from servers import free_port, running_demo


class Terminal:
    """A real terminal: a tmux server of its own (``-L``) running one command in one pane."""

    def __init__(self, name: str, command: str, width: int = 140, height: int = 45) -> None:
        path = shutil.which("tmux")
        if path is None:
            if os.environ.get("CI") == "true":
                pytest.fail("tmux not found (Debian package tmux; scripts/test installs it)")
            pytest.skip("tmux not found")
        self.tmux, self.name = [path, "-L", name], name
        env = {**os.environ, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        self.run("new-session", "-d", "-s", name, "-x", str(width), "-y", str(height), command, env=env, check=True)

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*self.tmux, *args], capture_output=True, text=True, **kwargs)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.name).stdout

    def until(self, predicate, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            assert time.monotonic() < deadline, f"the screen never showed it:\n{screen}"
            time.sleep(0.3)

    def alive(self) -> bool:
        return self.run("has-session", "-t", self.name).returncode == 0

    def close(self) -> None:
        self.run("kill-server")


def field(screen: str, name: str) -> float:
    words = screen.split()
    return float(words[words.index(name) + 1])


def test_top_in_a_real_terminal_refreshes_names_the_nan_and_quits_on_q():
    port = free_port()
    with running_demo(port, "--steps", "0", "--step-delay", "0.03", "--fault", "nan@250"):
        term = Terminal(f"gradmon-top-{port}", f"{sys.executable} -m gradmon top http://127.0.0.1:{port}/metrics")
        try:
            first = term.until(lambda s: "model demo" in s and "largest gradient norms" in s and "steps/s" in s)
            later = term.until(lambda s: "model demo" in s and field(s, "steps") > field(first, "steps") + 20)
            assert "state training" in later and "ok: all" in later
            assert "blocks.0.fc1" in later  # a layer of the demo's model, by name
            # the demo's NaN at step 250: the local check fires and names where it started
            nan = term.until(lambda s: "!! GradmonNonFiniteGradients" in s, timeout=90)
            assert "started" in nan and "at step" in nan
            term.run("send-keys", "-t", term.name, "q")
            deadline = time.monotonic() + 10
            while term.alive():
                assert time.monotonic() < deadline, "q did not quit"
                time.sleep(0.2)
        finally:
            term.close()


def test_top_prints_one_plain_frame_over_basic_auth_and_mutual_tls(pki, tmp_path):
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    m = tiny()
    with gradmon.attach(m, port=0, addr="127.0.0.1", final_scrape_timeout=0, detail_every=1,
                        tls_certfile=str(pki.dir / "server.pem"), tls_keyfile=str(pki.dir / "server.key"),
                        tls_client_cafile=str(pki.dir / "ca.pem"),
                        basic_auth_user="prom", basic_auth_password="s3cret") as mon:
        sgd_steps(m, 5)
        mon.flush()
        tls = ["--cacert", str(pki.dir / "ca.pem"), "--cert", str(pki.dir / "client.pem"),
               "--key", str(pki.dir / "client.key"), "--interval", "0.1"]
        out = io.StringIO()
        assert top.main([mon.url, "--user", "prom", "--password-file", str(secret), *tls], out=out) == 0
        frame = out.getvalue()
        assert "model sequential  rank 0  state training" in frame and "steps 5" in frame
        assert "  0 " in frame and "  2 " in frame  # the two Linear layers, largest norms first
        assert "ok: all" in frame
        out = io.StringIO()
        secret.write_text("wrong\n")
        assert top.main([mon.url, "--user", "prom", "--password-file", str(secret), *tls], out=out) == 1
        assert "401" in out.getvalue()


def exposition(*samples: str) -> str:
    """A gradmon exposition of model "m" on rank 3: each sample as 'name{labels} value'."""
    out = []
    for sample in samples:
        name, _, rest = sample.partition("{")
        labels, _, value = rest.partition("} ") if rest else ("", "", sample.split()[1])
        out.append(f'{name.split()[0]}{{model="m",rank="3"{"," + labels if labels else ""}}} {value}')
    return "\n".join(out) + "\n"


class Fixed(top.Endpoint):
    def __init__(self, texts):
        super().__init__("http://example/metrics")
        object.__setattr__(self, "texts", list(texts))

    def fetch(self) -> str:
        return self.texts.pop(0)


def test_local_checks_name_real_alerts_and_fire_at_the_rules_thresholds():
    names = {a.name for a in alerting.alerts(alerting.Thresholds(), alerting.PRODUCTION)}
    assert {c.alert for c in top.CHECKS} <= names
    th = alerting.Thresholds()
    calm = exposition("gradmon_steps_total 500", f"gradmon_grad_global_norm {th.explode_abs / 2}",
                      'gradmon_activation_abs_max_worst{layer="blocks.5.attn"} 1.0',
                      'gradmon_rank_nonfinite_total{tensor="local_grad",kind="nan"} 0')
    bad = exposition("gradmon_steps_total 510", f"gradmon_grad_global_norm {th.explode_abs * 2}",
                     'gradmon_activation_abs_max_worst{layer="blocks.5.attn"} 40000',
                     'gradmon_rank_nonfinite_total{tensor="local_grad",kind="nan"} 7',
                     'gradmon_nonfinite_origin_step{tensor="grad",layer="blocks.5.attn"} 505')
    clock = iter([0.0, 1.0])
    view = top.View(Fixed([calm, bad]), clock=lambda: next(clock))
    view.refresh()
    assert "ok: all" in "\n".join(top.render(view, width=300))
    view.refresh()
    frame = "\n".join(top.render(view, width=300))
    assert "!! GradmonGradientExplosion: global norm 2e+03 > 1e+03" in frame
    assert "!! GradmonActivationBlowup: blocks.5.attn: max|x| 4e+04 > 3e+04" in frame
    assert "!! GradmonNonFiniteGradients: 7 new NaN/Inf elements (started: grad blocks.5.attn at step 505)" in frame
    assert "steps/s 10" in frame
    assert "not exported here" in frame  # a rank without per-layer series says so


def test_sparkline_is_log_scaled_and_marks_non_finite_values():
    assert top.sparkline([1, 10, 100]) == "▁▅█"
    assert top.sparkline([1, float("nan"), 1000, None]) == "▁!█ "
    assert top.sparkline([5, 5]) == "▁▁"


def test_top_reads_an_ipv6_endpoint_with_credentials_in_the_url():
    import socket
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    m = tiny()
    try:
        mon = gradmon.attach(m, port=0, addr="::1", final_scrape_timeout=0, basic_auth_user="prom",
                             basic_auth_password="s3cret")
    except OSError:
        pytest.skip("cannot bind ::1 here")
    try:
        sgd_steps(m, 2)
        mon.flush()
        url = mon.url.replace("http://", "http://prom:s3cret@")
        out = io.StringIO()
        assert top.main([url, "--once", "--interval", "0.1"], out=out) == 0, out.getvalue()
        assert "model sequential  rank 0" in out.getvalue()
    finally:
        mon.detach()
