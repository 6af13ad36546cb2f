"""How a run ends decides who gets paged: the last run state a scraper sees on each way out
of a real training process (issue 8). See gradmon/run_end.py for the table of paths."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch.multiprocessing as mp

import ddp_worker
from conftest import parse, value
from servers import free_port, free_port_range

HERE = Path(__file__).resolve().parent


class Scraper:
    """A periodic scraper (0.2 s) of each URL that keeps the last exposition it got, as
    Prometheus keeps the last sample of a target that disappears."""

    def __init__(self, urls: List[str]) -> None:
        self.last: Dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(urls,), daemon=True)
        self._thread.start()

    def _run(self, urls: List[str]) -> None:
        while not self._stop.wait(0.2):
            for url in urls:
                try:
                    self.last[url] = parse(urllib.request.urlopen(url, timeout=2).read().decode())
                except Exception:
                    pass  # not up yet, or gone

    def state(self, url: str) -> Optional[str]:
        samples = self.last.get(url, {})
        on = [dict(labels)["state"] for (name, labels), v in samples.items() if name == "gradmon_run_state" and v == 1]
        return on[0] if on else None

    def failure(self, url: str) -> Optional[str]:
        samples = self.last.get(url, {})
        names = [dict(labels)["exception"] for (name, labels), _ in samples.items() if name == "gradmon_run_failure_info"]
        return names[0] if names else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_script(how: str, seconds: float = 1.5, signal_after: Optional[float] = None):
    """Run tests/run_end_script.py under a Scraper; return (scraper, url, completed process)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-u", str(HERE / "run_end_script.py"), how, str(port), str(seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    scraper = Scraper([url])
    try:
        if signal_after is not None:
            deadline = time.monotonic() + 60
            while scraper.state(url) != "training" and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(signal_after)
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        scraper.stop()
    return scraper, url, proc.returncode, out


def test_a_script_that_just_ends_without_detach_finishes():
    scraper, url, rc, out = run_script("end")
    assert rc == 0, out
    assert scraper.state(url) == "finished"


def test_an_exception_leaving_with_fails_the_run_naming_its_type_not_its_message():
    scraper, url, rc, out = run_script("raise_in_with")
    assert rc == 1 and "secret message" in out
    assert scraper.state(url) == "failed"
    assert scraper.failure(url) == "ValueError"
    assert "secret" not in repr(scraper.last[url])


def test_an_uncaught_exception_fails_the_run_and_the_jobs_own_excepthook_still_runs():
    scraper, url, rc, out = run_script("raise")
    assert rc == 1
    assert "user excepthook saw ValueError" in out and "Traceback" in out
    assert scraper.state(url) == "failed"
    assert scraper.failure(url) == "ValueError"


def test_detach_in_a_finally_while_an_exception_is_in_flight_fails_the_run():
    scraper, url, rc, out = run_script("raise_detach_in_finally")
    assert rc == 1 and "secret message" in out
    assert scraper.state(url) == "failed"
    assert scraper.failure(url) == "ValueError"


def test_detach_in_the_except_stopiteration_that_ends_a_data_loop_finishes_the_run():
    scraper, url, rc, out = run_script("loader_end")
    assert rc == 0, out
    assert scraper.state(url) == "finished"


def test_sys_exit_with_a_non_zero_status_fails_the_run():
    scraper, url, rc, _ = run_script("exit3")
    assert rc == 3
    assert scraper.state(url) == "failed"
    assert scraper.failure(url) == "SystemExit"


def test_sys_exit_zero_finishes_the_run():
    scraper, url, rc, _ = run_script("exit0")
    assert rc == 0
    assert scraper.state(url) == "finished"


def test_ctrl_c_interrupts_the_run_without_failing_it():
    scraper, url, rc, out = run_script("ctrl_c")
    assert rc != 0 and "KeyboardInterrupt" in out
    assert scraper.state(url) == "interrupted"
    assert scraper.failure(url) is None


def test_sigterm_with_handle_sigterm_publishes_terminated_then_dies_of_the_signal():
    scraper, url, rc, _ = run_script("sigterm", seconds=0, signal_after=0.5)
    assert rc == -signal.SIGTERM  # the signal did what it would have done
    assert scraper.state(url) == "terminated"


def test_handle_sigterm_leaves_the_jobs_own_sigterm_handler_alone():
    scraper, url, rc, _ = run_script("sigterm_own", seconds=0, signal_after=0.5)
    assert rc == 0  # the job's handler ran: sys.exit(0)
    assert scraper.state(url) == "finished"


def test_a_trainer_callbacks_run_abandoned_by_a_caught_exception_fails_at_exit_not_finishes():
    scraper, url, rc, out = run_script("abandoned_callback")
    assert rc == 0, out
    assert scraper.state(url) == "failed"
    assert scraper.failure(url) is None  # caught where gradmon could not see it: no type to name


def test_keep_serving_serves_the_finished_run_until_the_process_exits():
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-u", str(HERE / "run_end_script.py"), "keep_serving", str(port), "0.5"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        while not lines or lines[-1] != "ended\n":
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        assert any("still serving it until the process exits" in line for line in lines), lines
        time.sleep(0.5)  # the run has been over for a while: the endpoint is still up
        samples = parse(urllib.request.urlopen(url, timeout=5).read().decode())
        assert value(samples, "gradmon_run_state", state="finished") == 1
        assert value(samples, "gradmon_steps_total") > 0
        assert urllib.request.urlopen(url[:-len("metrics")], timeout=5).status == 200
        out, _ = proc.communicate("\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_one_torchrun_rank_raising_fails_that_rank_naming_the_exception(tmp_path):
    base = free_port_range(2)
    urls = [f"http://127.0.0.1:{base + r}/metrics" for r in range(2)]
    ctx = mp.start_processes(ddp_worker.run_until_one_rank_raises, args=(2, free_port(), base, 3.0, 1),
                             nprocs=2, join=False, start_method="spawn")
    scraper = Scraper(urls)
    try:
        deadline = time.monotonic() + 120
        while ctx.processes[1].is_alive():
            assert time.monotonic() < deadline, "rank 1 did not end"
            time.sleep(0.1)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(10)
        scraper.stop()
    assert ctx.processes[1].exitcode == 1
    assert scraper.state(urls[1]) == "failed"
    assert scraper.failure(urls[1]) == "ValueError"
