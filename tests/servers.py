"""Real Prometheus, Alertmanager and a webhook receiver on loopback, for the tests.

Binaries come from Debian's packages (`scripts/test` installs them). Without them a test
is skipped, except under CI=true, where a missing binary is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest


def binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    message = f"{names[0]} not found (Debian package prometheus / prometheus-alertmanager; scripts/test installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " -- required under CI=true")
    pytest.skip(message)


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel handed out (bind to
    0) is free only until the next outgoing connection takes it, and gloo's ranks in other
    tests open many; one reused that way failed a rendezvous with EADDRINUSE."""
    return free_port_range(1)


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive free ports, below the kernel's ephemeral range: ranks
    serve on base + local rank, and gloo's own connections take ephemeral ports, so a base
    picked by ``free_port()`` could find base + 1 taken by the time a rank binds it."""
    import random
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randrange(max(1024, low - 12000), low - n)
        try:
            held = []
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Process:
    def __init__(self, args: List[str], log: Path) -> None:
        self.log = log
        self._file = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self._file, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._file.close()


class Prometheus(Process):
    def __init__(self, workdir: Path, scrape_interval: str = "1s", rule_files: Optional[List[Path]] = None,
                 alertmanager: Optional[str] = None, file_sd: Optional[Path] = None,
                 relabel_configs: Optional[List[Dict[str, Any]]] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg: Dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                       "scrape_timeout": scrape_interval},
            "rule_files": [str(p) for p in rule_files or []],
            "scrape_configs": [{"job_name": "gradmon", "file_sd_configs": [
                {"files": [str(file_sd or workdir / "targets.json")], "refresh_interval": "1s"}]}],
        }
        if relabel_configs:
            cfg["scrape_configs"][0]["relabel_configs"] = relabel_configs
        if alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self.targets_file = Path(cfg["scrape_configs"][0]["file_sd_configs"][0]["files"][0])
        if not self.targets_file.exists():
            self.targets_file.write_text("[]")
        (workdir / "prometheus.yml").write_text(json.dumps(cfg))
        super().__init__([binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                          f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                         workdir / "prometheus.log")
        wait_http(self.url + "/-/ready")

    def set_targets(self, targets: List[Dict[str, Any]]) -> None:
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets))
        tmp.replace(self.targets_file)  # atomic: Prometheus never reads half a file

    def query(self, expr: str, at: Optional[float] = None) -> List[Dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        body = urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10).read()
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> List[Dict[str, Any]]:
        params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
        body = urllib.request.urlopen(f"{self.url}/api/v1/query_range?{urllib.parse.urlencode(params)}", timeout=10).read()
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]["result"]


class Webhook:
    """An Alertmanager webhook receiver: records every notification with its arrival time."""

    def __init__(self) -> None:
        self.received: List[Dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.received.append({"time": time.time(), **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def alerts(self) -> List[Dict[str, Any]]:
        """Every firing alert received, with the time its notification arrived."""
        return [{"received": n["time"], **a} for n in self.received for a in n.get("alerts", [])
                if a.get("status") == "firing"]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Alertmanager(Process):
    def __init__(self, workdir: Path, config_yaml: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "alertmanager.yml").write_text(config_yaml)
        super().__init__([binary("prometheus-alertmanager", "alertmanager"),
                          f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'am-data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}", f"--cluster.listen-address="],
                         workdir / "alertmanager.log")
        wait_http(self.url + "/-/ready")


def grafana_substitute(expr: str, **values: str) -> str:
    """A panel query as Grafana sends it: multi-value variables become regex alternations
    ``(a|b)``; ``$__rate_interval``/``$__interval`` fit a 1 s scrape interval."""
    out = expr.replace("$__rate_interval", "4s").replace("$__interval", "1s")
    for name in sorted(values, key=len, reverse=True):
        out = out.replace(f"${name}", values[name])
    return out


@contextlib.contextmanager
def running_demo(port: int, *args: str):
    """``gradmon demo`` in a subprocess on 127.0.0.1:``port`` until the block ends (stopped
    with SIGTERM, killed if it lingers); no final-scrape wait."""
    import sys
    demo = subprocess.Popen([sys.executable, "-m", "gradmon", "demo", "--port", str(port), "--addr", "127.0.0.1",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "GRADMON_FINAL_SCRAPE_TIMEOUT": "0"})
    try:
        yield demo
    finally:
        demo.terminate()
        try:
            demo.wait(30)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
