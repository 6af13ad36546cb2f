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
from gradmon import alerting
from gradmon.clients import top
from hostile_servers import RawServer, drip, exposition as hostile_exposition, redirect, respond
from servers import free_port, running_demo
from test_live_page import guard_steps


class Terminal:
    """A real terminal: a tmux server of its own (``-L``) running one command in one pane."""

    def __init__(self, name: str, command: str, width: int = 140, height: int = 45) -> None:
        path = shutil.which("tmux")
        if path is None:
            if os.environ.get("CI") == "true":
                pytest.fail("tmux not found (Debian package tmux; scripts/test installs it)")
            pytest.skip("tmux not found")
        self.tmux, self.name = [path, "-L", name], name
        # the pane's size is the terminal's: COLUMNS/LINES (set by pytest-xdist's workers) would override it
        env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
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
        # the live page's URL, as the demo prints it: top reads its /metrics
        term = Terminal(f"gradmon-top-{port}", f"{sys.executable} -m gradmon top http://127.0.0.1:{port}/")
        try:
            first = term.until(lambda s: "model demo" in s and "largest gradient norms" in s and "steps/s" in s)
            assert f"gradmon top  http://127.0.0.1:{port}/metrics" in first and "(q quits)" in first
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


def one_frame(*samples: str) -> str:
    """The frame top draws of one reading of ``samples`` (as :func:`exposition` takes them)."""
    view = top.View(Fixed([exposition("gradmon_steps_total 500", *samples)]), clock=lambda: 0.0)
    view.refresh()
    return "\n".join(top.render(view, width=300))


def test_a_layer_above_its_baseline_fires_only_once_its_run_of_steps_reaches_the_rules():
    th = alerting.Thresholds()
    def frame(run: int) -> str:
        return one_frame('gradmon_grad_norm_baseline_ratio{layer="embed"} 6',
                         f"gradmon_grad_norm_above_baseline_steps {run}")
    assert "GradmonGradNormAboveBaseline" not in frame(th.norm_ratio_steps - 1)
    assert "!! GradmonGradNormAboveBaseline: embed: norm / its baseline 6 > 4" in frame(th.norm_ratio_steps)


def test_a_learning_rate_past_its_settled_peak_fires_at_the_rules_bar():
    th = alerting.Thresholds()
    def frame(ratio: float) -> str:
        return one_frame('gradmon_learning_rate{group="1"} 0.003',
                         f'gradmon_learning_rate_over_peak{{group="1"}} {ratio}')
    assert "GradmonLearningRateAbovePeak" not in frame(th.lr_over_peak * 0.99)
    assert "!! GradmonLearningRateAbovePeak: group 1: lr 3x its settled peak >= 1.5" in frame(3.0)


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


def quits_within(term: Terminal, seconds: float) -> float:
    """Press q; how long the terminal's process took to end (fails after ``seconds``)."""
    began = time.monotonic()
    term.run("send-keys", "-t", term.name, "q")
    while term.alive():
        assert time.monotonic() - began < seconds, f"q did not quit within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - began


def test_q_quits_at_once_while_the_endpoint_drips():
    with RawServer(drip(every=0.5)) as server:
        term = Terminal(f"gradmon-top-drip-{server.port}",
                        f"{sys.executable} -m gradmon top {server.url} --timeout 60")
        try:
            term.until(lambda s: "reading the endpoint" in s, timeout=30)
            time.sleep(1.0)  # the read is now well inside its 60 s deadline
            assert server.requests and server.sent > 0
            quits_within(term, 3.0)
        finally:
            term.close()


def test_a_redirect_ends_the_screen_with_the_location_and_status_1(tmp_path):
    with RawServer(redirect("http://localhost:1/metrics")) as server:
        err = tmp_path / "stderr"
        term = Terminal(f"gradmon-top-redirect-{server.port}",
                        f"sh -c '{sys.executable} -m gradmon top {server.url} 2>{err}; echo exit=$?; sleep 60'")
        try:
            term.until(lambda s: "exit=" in s, timeout=30)
            assert "exit=1" in term.screen()
            assert "a redirect to http://localhost:1/metrics" in err.read_text()
        finally:
            term.close()


def test_escape_sequences_from_the_endpoint_do_not_reach_the_terminal():
    body = hostile_exposition(model="m\x1b]2;pwned\x07\x1b[2J", layer="fc\x1b]2;again\x071")
    with RawServer(respond(body=body)) as server:
        term = Terminal(f"gradmon-top-esc-{server.port}", f"{sys.executable} -m gradmon top {server.url}")
        try:
            screen = term.until(lambda s: "largest gradient norms" in s)
            assert "model m\\x1b]2;pwned\\x07\\x1b[2J  rank 0" in screen
            assert "fc\\x1b]2;again\\x071" in screen
            title = term.run("display-message", "-p", "-t", term.name, "#{pane_title}").stdout
            assert "pwned" not in title and "again" not in title
        finally:
            term.close()


# -- what the user meant, said plainly ---------------------------------------------------------

@pytest.mark.parametrize("typed, meant", [
    ("9400", "http://127.0.0.1:9400/metrics"),
    (":9400", "http://127.0.0.1:9400/metrics"),
    ("node1:9400", "http://node1:9400/metrics"),
    ("http://node1:9400/", "http://node1:9400/metrics"),
    ("https://node1:9400", "https://node1:9400/metrics"),
    ("http://node1:9400/metrics", "http://node1:9400/metrics"),
    ("http://[::1]:9400/", "http://[::1]:9400/metrics"),
])
def test_a_port_a_host_or_the_pages_url_means_its_metrics(typed, meant):
    assert top.metrics_url(typed) == meant


@pytest.mark.parametrize("typed", ["ftp://node1:9400/metrics", "http://node1:99999/", "70000", "http:///metrics"])
def test_a_url_top_cannot_read_is_refused_with_what_to_type(typed, capsys):
    with pytest.raises(SystemExit) as exit:
        top.main([typed, "--once"])
    assert exit.value.code == 2
    assert "e.g. gradmon top http://127.0.0.1:9400/metrics, or just gradmon top 9400" in capsys.readouterr().err


def test_the_pages_url_and_a_bare_port_read_a_real_endpoint():
    m = tiny()
    with gradmon.attach(m, port=0, addr="127.0.0.1", final_scrape_timeout=0) as mon:
        sgd_steps(m, 3)
        mon.flush()
        for typed in (mon.url[:-len("metrics")], str(mon.port)):
            out = io.StringIO()
            assert top.main([typed, "--once", "--interval", "0.1"], out=out) == 0, out.getvalue()
            assert "model sequential  rank 0" in out.getvalue()


def test_a_web_page_where_the_metrics_should_be_says_what_to_type():
    page = respond(headers=(b"Content-Type: text/html; charset=utf-8",), body=b"<html>a page</html>")
    with RawServer(page) as server:
        out = io.StringIO()
        assert top.main([server.url.replace("/metrics", "/index.html"), "--once"], out=out) == 1
    assert f"is a web page, not the metrics; run: gradmon top {server.url}" in out.getvalue()


def test_once_prints_no_quit_hint():
    with RawServer(respond(body=hostile_exposition())) as server:
        out = io.StringIO()
        assert top.main([server.url, "--once", "--interval", "0.1"], out=out) == 0
    assert "model m  rank 0" in out.getvalue() and "q quits" not in out.getvalue()


def frame(*texts: str, clock=None) -> str:
    """The frame after one refresh per exposition, a second apart (or at ``clock``'s times)."""
    times = iter(clock or range(len(texts)))
    view = top.View(Fixed(texts), clock=lambda: float(next(times)))
    for _ in texts:
        view.refresh()
    return "\n".join(top.render(view, width=300))


def test_steps_and_counts_print_as_integers():
    text = exposition("gradmon_steps_total 81234", "gradmon_step 81234", "gradmon_world_size 128",
                      'gradmon_rank_nonfinite_total{tensor="grad",kind="nan"} 1234567',
                      'gradmon_nonfinite_origin_step{tensor="grad",layer="fc"} 81230')
    shown = frame(text)
    assert "step 81234  steps 81234" in shown and "world 128" in shown
    assert "grad 1234567  (started in grad: fc at step 81230)" in shown


def test_a_late_start_with_nans_counted_says_not_enough_history_and_never_ok():
    text = exposition("gradmon_steps_total 900", 'gradmon_rank_nonfinite_total{tensor="grad",kind="nan"} 32',
                      'gradmon_nonfinite_origin_step{tensor="grad",layer="fc"} 400')
    shown = frame(text, text)
    assert "?? GradmonNonFiniteGradients: not enough history: 32 NaN/Inf elements counted, none new in the 1 s " \
           "watched (the rule looks back 5m)" in shown
    assert "ok:" not in shown


def test_nans_older_than_the_rules_window_are_not_called_ok():
    text = exposition("gradmon_steps_total 900", 'gradmon_rank_nonfinite_total{tensor="grad",kind="nan"} 32')
    shown = frame(text, text, clock=[0.0, top.NONFINITE_WINDOW + 1])
    assert f"none of the {len(top.CHECKS)} local checks fires now, but non-finite values are shown above" in shown
    assert "?? " not in shown and "ok:" not in shown


def test_a_nan_reading_without_counts_is_not_called_ok():
    shown = frame(exposition("gradmon_steps_total 900", "gradmon_grad_global_norm NaN"))
    assert "global norm nan" in shown
    assert f"none of the {len(top.CHECKS)} local checks fires now, but non-finite values are shown above" in shown
    assert "ok:" not in shown


def test_ok_is_never_printed_beside_a_firing_check():
    th = alerting.Thresholds()
    shown = frame(exposition("gradmon_steps_total 500", f"gradmon_grad_global_norm {th.explode_abs * 2}"))
    assert "!! GradmonGradientExplosion" in shown
    assert f"the other {len(top.CHECKS) - 1} local checks: nothing over their thresholds" in shown and "ok:" not in shown


def test_history_is_kept_only_for_the_models_the_endpoint_still_shows():
    texts = [exposition("gradmon_steps_total 1").replace('model="m"', f'model="m{i}"') for i in range(50)]
    view = top.View(Fixed(texts))
    for _ in texts:
        view.refresh()
    assert list(view.history) == [("m49", "3")]


def test_a_screen_renders_only_the_models_that_fit():
    many = "".join(exposition("gradmon_steps_total 1").replace('model="m"', f'model="m{i:05d}"') for i in range(2000))
    view = top.View(Fixed([many]))
    view.refresh()
    lines = top.render(view, width=100, height=30)
    assert len(lines) == 30 and "model m00000  rank 3" in lines[2]


def test_top_in_a_real_terminal_shows_the_guards_skips_by_reason_and_the_latest_step():
    m = tiny()
    with gradmon.attach(m, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite", incident_dir="") as mon:
        guard_steps(m, 9, bad_steps=(4, 7))
        mon.flush()
        term = Terminal(f"gradmon-top-guard-{mon.port}", f"{sys.executable} -m gradmon top {mon.port}")
        try:
            screen = term.until(lambda s: "model sequential" in s and "local checks" in s, timeout=30)
            assert "steps skipped by the guard: 2 (nonfinite 2), latest at step 7: nonfinite" in screen, screen
            assert "?? GradmonGuardSkippedStep: not enough history: 2 step(s) skipped by the guard counted" in screen
        finally:
            term.close()


def test_the_guards_line_is_absent_without_a_guard_and_escapes_what_the_endpoint_sent():
    assert "skipped by the guard" not in frame(exposition("gradmon_steps_total 9"))
    shown = frame(exposition("gradmon_steps_total 9", 'gradmon_guard_skipped_steps_total{reason="nonfinite"} 3',
                             'gradmon_guard_skipped_steps_total{reason="x\x1b[2J"} 1',
                             'gradmon_guard_last_skip_step{reason="x\x1b[2J"} 81234'))
    assert "steps skipped by the guard: 4 (nonfinite 3, x\\x1b[2J 1), latest at step 81234: x\\x1b[2J" in shown
    assert "\x1b" not in shown


def test_a_new_guard_skip_fires_its_check_and_one_older_than_top_says_not_enough_history():
    before = exposition("gradmon_steps_total 9", 'gradmon_guard_skipped_steps_total{reason="spike"} 0')
    after = exposition("gradmon_steps_total 10", 'gradmon_guard_skipped_steps_total{reason="spike"} 1',
                       'gradmon_guard_last_skip_step{reason="spike"} 10')
    shown = frame(before, after)
    assert "!! GradmonGuardSkippedStep: 1 optimizer step(s) skipped by the guard in the last 10m" in shown
    assert "ok:" not in shown
    late = frame(after)
    assert "?? GradmonGuardSkippedStep: not enough history: 1 step(s) skipped by the guard counted, none new in the " \
           "0 s watched (the rule looks back 10m)" in late
    assert "ok:" not in late
    quiet = frame(before, before)
    assert f"ok: all {len(top.CHECKS)} local checks pass" in quiet
