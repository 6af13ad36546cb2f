"""What a fleet of gradmon ranks costs a real Prometheus (issue 12, part 2).

    python bench/prometheus_load.py --ranks 64 --layers 1000 --minutes 60     # the README sizing
    python bench/prometheus_load.py --quick                                   # a smoke run

Simulated ranks serve gradmon's real exposition: rank 0's and one other rank's are rendered
once by gradmon itself (``series_count.exposition``: a ``--layers`` model attached as that
rank of a ``--ranks`` job, every family on), every other rank serves the second with its own
``rank`` label. At every scrape the values move as a training run's do: gauges by a random
walk, counters and histogram buckets upwards, so Prometheus compresses them no better than
real ones. A real Prometheus scrapes every rank at ``--scrape-interval`` with gradmon's
rules loaded, and scrapes itself; every minute the script reads its head series, heap in
use, resident memory, CPU, ingestion rate and rule-evaluation time, and prints them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import series_count

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


class Template:
    """One rank's exposition, split into fixed text and the values that move."""

    def __init__(self, text: str, rank: int) -> None:
        types: Dict[str, str] = {}
        self.lines: List[Tuple[str, Optional[float], bool]] = []  # (prefix, value, monotonic)
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                types[name] = kind
            m = SAMPLE.match(line)
            if line.startswith("#") or not m:
                self.lines.append((line, None, False))
                continue
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            labels = re.sub(r'rank="\d+"', f'rank="{rank}"', labels)
            family = re.sub(r"(_total|_bucket|_count|_sum|_created)$", "", name)
            monotonic = types.get(family) in ("counter", "histogram") or types.get(name) == "counter"
            self.lines.append((f"{name}{labels} ", float(value), monotonic and not name.endswith("_created")))

    def render(self, rng: random.Random, step: int) -> bytes:
        out = []
        for prefix, value, monotonic in self.lines:
            if value is None:
                out.append(prefix)
            elif not math.isfinite(value):
                out.append(prefix + ("NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")))
            elif monotonic:
                out.append(prefix + repr(value + step * (1 if value else 0)))  # a counter that moves keeps moving
            else:
                out.append(prefix + repr(value * math.exp(rng.gauss(0.0, 0.05))))
        return ("\n".join(out) + "\n").encode()


def serve(template: Template, port: int, seed: int) -> ThreadingHTTPServer:
    rng = random.Random(seed)
    scrapes = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            scrapes[0] += 1
            body = template.render(rng, scrapes[0])
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def query(url: str, expr: str) -> float:
    body = urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=30).read()
    result = json.loads(body)["data"]["result"]
    return float(result[0]["value"][1]) if result else math.nan


READINGS = {
    "head_series": "prometheus_tsdb_head_series",
    "heap_inuse_mb": "go_memstats_heap_inuse_bytes / 2^20",
    "rss_mb": "process_resident_memory_bytes / 2^20",
    "cpu_cores": "rate(process_cpu_seconds_total[1m])",
    "samples_per_s": "rate(prometheus_tsdb_head_samples_appended_total[1m])",
    "rule_eval_s": "sum(prometheus_rule_group_last_duration_seconds)",
}


def run(ranks: int, layers: int, minutes: float, interval: str, every: float) -> List[Dict[str, float]]:
    from gradmon import alerting
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise SystemExit("prometheus not found (Debian package prometheus)")
    work = Path(tempfile.mkdtemp(prefix="gradmon-load-"))
    rank0 = series_count.exposition(layers, 0, ranks)
    other = series_count.exposition(layers, 1, ranks) if ranks > 1 else rank0
    # every simulated rank on a port the kernel picks: another run (or a test) may hold any range
    servers = [serve(Template(rank0 if r == 0 else other, r), 0, r) for r in range(ranks)]
    targets = [f"127.0.0.1:{server.server_address[1]}" for server in servers]
    (work / "rules.yml").write_text(json.dumps(alerting.rule_groups(alerting.Thresholds(), alerting.PRODUCTION)))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(work / "rules.yml")],
        "scrape_configs": [
            {"job_name": "training", "sample_limit": 3000, "static_configs": [{"targets": targets}]},
            {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))
    proc = subprocess.Popen([prometheus, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    rows: List[Dict[str, float]] = []
    try:
        start = time.monotonic()
        while time.monotonic() - start < minutes * 60:
            time.sleep(every)
            try:
                row = {"minute": round((time.monotonic() - start) / 60, 2)}
                row.update({name: query(url, expr) for name, expr in READINGS.items()})
            except OSError:
                continue  # not serving yet
            if math.isnan(row["head_series"]) or math.isnan(row["rss_mb"]):
                continue  # not scraped itself yet
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        for s in servers:
            s.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--layers", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--scrape-interval", default="15s")
    p.add_argument("--every", type=float, default=60, help="seconds between readings")
    p.add_argument("--quick", action="store_true", help="4 ranks of a 50-layer model for 24 s")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    if a.quick:
        a.ranks, a.layers, a.minutes, a.scrape_interval, a.every = 4, 50, 0.4, "1s", 4
    rows = run(a.ranks, a.layers, a.minutes, a.scrape_interval, a.every)
    if not rows:
        print("no reading: Prometheus never answered", file=sys.stderr)
        return 1
    last = rows[-1]
    peak = max(r["rss_mb"] for r in rows)
    per_series_kb = last["heap_inuse_mb"] * 1024 / last["head_series"]
    print(f"\n{a.ranks} ranks x {a.layers} layers, {a.minutes:g} min at {a.scrape_interval}: "
          f"{last['head_series']:.0f} head series, heap {last['heap_inuse_mb']:.0f} MB "
          f"({per_series_kb:.2f} KB per series), peak RSS {peak:.0f} MB, CPU {last['cpu_cores']:.2f} cores, "
          f"{last['samples_per_s']:.0f} samples/s, rule evaluation {last['rule_eval_s'] * 1000:.0f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"ranks": a.ranks, "layers": a.layers, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
