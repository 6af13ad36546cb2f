"""`gradmon demo` as a user runs it: a real subprocess, scraped over HTTP."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from conftest import scrape, value


OUTPUT: "dict[int, list]" = {}  # pid -> lines the demo printed, drained by a thread


def start_demo(*args: str) -> "tuple[subprocess.Popen, str]":
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradmon", "demo", "--port", "0", "--addr", "127.0.0.1",
         "--step-delay", "0", "--log-every", "50", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={"GRADMON_FINAL_SCRAPE_TIMEOUT": "0", "PATH": "/usr/bin:/bin"})
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
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr
