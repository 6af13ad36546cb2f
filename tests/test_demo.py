"""`gradmon demo` as a user runs it: a real subprocess, scraped over HTTP."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import scrape, value


OUTPUT: "dict[int, list]" = {}  # pid -> lines the demo printed, drained by a thread


def demo_env(**extra: str) -> "dict[str, str]":
    """A clean environment, keeping PYTHONPATH so the child runs the gradmon under test."""
    keep = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    return {"GRADMON_FINAL_SCRAPE_TIMEOUT": "0", "PATH": "/usr/bin:/bin", **keep, **extra}


def start_demo(*args: str, **env: str) -> "tuple[subprocess.Popen, str]":
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradmon", "demo", "--port", "0", "--addr", "127.0.0.1",
         "--step-delay", "0", "--log-every", "50", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=demo_env(**env))
    lines = OUTPUT[proc.pid] = []
    url = queue.Queue()

    def drain() -> None:  # never let a full pipe block the demo
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"metrics at (http://\S+)", line)
            if m and line.startswith("gradmon demo"):
                url.put(m.group(1))
        url.put(None)

    threading.Thread(target=drain, daemon=True).start()
    got = url.get(timeout=120)
    assert got, f"demo exited early with {proc.wait()}: {''.join(lines)[-2000:]}"
    return proc, got


def finish(proc: subprocess.Popen) -> str:
    proc.wait(timeout=60)
    time.sleep(0.2)  # the drain thread reads the last lines
    return "".join(OUTPUT[proc.pid])


def wait_steps(url: str, steps: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(url)
        seen = value(s, "gradmon_steps_total")
        if seen >= steps:
            return s
        assert time.monotonic() < deadline, f"demo reached only {seen} of {steps} steps in {timeout} s"
        time.sleep(0.2)


def test_nan_fault_counts_on_the_named_layer_and_every_step_is_counted():
    proc, url = start_demo("--steps", "120", "--hold", "30", "--fault", "nan@60:blocks.2.fc1")
    try:
        s = wait_steps(url, 120)
        assert value(s, "gradmon_steps_total") == 120
        assert value(s, "gradmon_nonfinite_total", layer="blocks.2.fc1", tensor="grad", kind="nan") > 0
        assert value(s, "gradmon_nonfinite_total", layer="blocks.0.fc1", tensor="grad", kind="nan") == 0
        assert value(s, "gradmon_nonfinite_steps_total") == 1  # the job's guard kept the weights finite
    finally:
        proc.terminate()
        out = finish(proc)
    assert "will inject nan into blocks.2.fc1 at step 60" in out


@pytest.mark.parametrize("kind, low, high", [("explode", 1e3, float("inf")), ("vanish", 0.0, 1e-3)])
def test_explode_and_vanish_move_the_faulted_layers_pre_clip_norm(kind, low, high):
    proc, url = start_demo("--steps", "150", "--hold", "30", "--fault", f"{kind}@100:blocks.0.fc2")
    try:
        s = wait_steps(url, 150)
    finally:
        proc.terminate()
        finish(proc)
    # blocks.1.fc2 is the same kind of layer, healthy: their ratio is ~1 without a fault
    ratio = value(s, "gradmon_grad_norm", layer="blocks.0.fc2") / value(s, "gradmon_grad_norm", layer="blocks.1.fc2")
    assert low < ratio < high


def test_demo_runs_to_completion_and_prints_progress():
    proc, url = start_demo("--steps", "100", "--fault", "vanish@50")
    out = finish(proc)
    assert proc.returncode == 0
    assert "step     50  loss" in out and "step    100  loss" in out
    assert "finished after 100 steps" in out


@pytest.mark.parametrize("spec, message", [
    ("boom@3", "KIND one of"), ("nan@x", "STEP must be a whole number"), ("nan@3:nope", "unknown layer 'nope'"),
    ("nan", "expected KIND@STEP"),
])
def test_bad_fault_specs_are_rejected_with_a_clear_message(spec, message):
    r = subprocess.run([sys.executable, "-m", "gradmon", "demo", "--fault", spec],
                       capture_output=True, text=True, timeout=60, env=demo_env())
    assert r.returncode == 2
    assert message in r.stderr


def run_demo(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradmon", "demo", "--addr", "127.0.0.1", "--step-delay", "0",
                           "--log-every", "0", *args], capture_output=True, text=True, timeout=120,
                          env=demo_env(**env))


def test_a_taken_port_falls_back_to_a_free_one_and_says_so_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, url = start_demo("--port", str(port), "--steps", "20", "--hold", "30")
        try:
            assert f":{port}/" not in url
            assert value(scrape(url), "gradmon_steps_total") >= 0
        finally:
            proc.terminate()
            out = finish(proc)
    assert f"port {port} is in use; serving on a free port instead" in out
    assert "Traceback" not in out and "Address already in use" not in out


def test_the_demo_says_what_to_do_next_with_its_real_url():
    proc, url = start_demo("--steps", "5")
    out = finish(proc)
    assert f"curl -s {url} | grep" in out
    assert f"open {url[:-len('metrics')]} in a browser (the live page, unless GRADMON_UI=0), or run: gradmon top {url}" in out
    assert f"the live page was at {url[:-len('metrics')]}" in out.splitlines()[-1]
    assert "--fault nan@" in out
    rules = re.search(r"alert rules: +(\S+)", out).group(1)
    dashboards = re.search(r"dashboards: +(\S+)/\*\.json", out).group(1)
    assert Path(rules).is_file() and list(Path(dashboards).glob("*.json"))


def test_the_summary_names_the_incidents_and_where_they_started():
    r = run_demo("--port", "0", "--steps", "30", "--fault", "nan@10:blocks.2.fc1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "finished after 30 steps; 1 non-finite step in 1 incident:" in r.stdout
    assert "step 10: gradient first non-finite in layer blocks.2.fc1" in r.stdout


def test_a_disabled_demo_says_monitoring_is_disabled_and_why():
    r = run_demo("--port", "0", "--steps", "5", GRADMON_DISABLE="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "monitoring is disabled: GRADMON_DISABLE=1 is set in the environment" in r.stdout
    assert "None" not in r.stdout and "metrics at" not in r.stdout
    assert "finished after 5 steps (monitoring was disabled)" in r.stdout


def test_a_bad_setting_in_the_environment_stops_the_demo_naming_the_variable():
    r = run_demo("--port", "0", "--steps", "5", GRADMON_EVERY="0")
    assert r.returncode == 2
    assert "GRADMON_EVERY=0: option 'every' must be a positive integer" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("arg", ["--help", "--version"])
def test_help_and_version_answer_at_once_without_importing_torch(arg):
    times = []
    for _ in range(3):  # the best of three: this machine is shared and loaded
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "gradmon", arg],
                           capture_output=True, text=True, timeout=60, env=demo_env())
        times.append(time.monotonic() - start)
        assert r.returncode == 0, r.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        assert "torch" not in imported and "numpy" not in imported
        assert "Warning" not in r.stdout + r.stderr.replace("import time:", "")
    assert min(times) < 1.0, times
    assert "gradmon demo" in r.stdout if arg == "--help" else r.stdout.strip() == __import__("gradmon").__version__


@pytest.mark.slow
def test_the_demo_trains_as_several_ranks_and_a_fault_can_target_one():
    from servers import free_port_range
    port = free_port_range(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradmon", "demo", "--ranks", "2", "--port", str(port), "--addr", "127.0.0.1",
         "--step-delay", "0", "--log-every", "0", "--steps", "40", "--fault", "nan@20:rank=1", "--hold", "15"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=demo_env())
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                ranks = [scrape(f"http://127.0.0.1:{port + r}/metrics") for r in range(2)]
                if all(value(s, "gradmon_steps_total") >= 40 for s in ranks):
                    break
            except (OSError, AssertionError):
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not train"
            time.sleep(0.3)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    s0, s1 = ranks
    assert value(s0, "gradmon_world_size") == value(s1, "gradmon_world_size") == 2
    # the NaN went into rank 1's own gradient only: its local counter, not rank 0's
    assert value(s1, "gradmon_rank_nonfinite_total", tensor="local_grad", kind="nan") > 0
    assert value(s0, "gradmon_rank_nonfinite_total", tensor="local_grad", kind="nan") == 0
    assert [k for k in s0 if k[0] == "gradmon_grad_norm"] and not [k for k in s1 if k[0] == "gradmon_grad_norm"]
    assert proc.returncode == 0, out
    assert "2 ranks (DistributedDataParallel, gloo)" in out
    assert "gradmon demo (rank 1): finished after 40 steps; 1 non-finite step in 1 incident" in out
