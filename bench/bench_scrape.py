"""Scrape load against a training job: does anyone scraping gradmon slow the training down?

    python bench/bench_scrape.py             # README figures: 20 scrapers at 1 Hz for 30 s, then 20 back-to-back
    python bench/bench_scrape.py --quick     # smoke run

A 500-layer model trains with gradmon attached (every family on). Scrapers run in another
process (so the GIL they would hold is not the trainer's). Training alternates between
windows with and without scrapers (interleaved, so drift hits both alike); the figure is
the median step time with scrapers over the median without. It also reports failed
scrapes, scrape latency, gradmon's own error counter and resident memory at start and end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import urllib.request
from typing import Dict, List, Optional

import psutil
import torch
from torch import nn


def scrapers(url: str, n: int, rate_hz: float, seconds: float, out: "mp.Queue") -> None:
    """n threads in this (separate) process, each scraping at rate_hz (0 = back-to-back)."""
    import threading
    latencies: List[float] = []
    failures: List[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def one() -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            try:
                body = urllib.request.urlopen(url, timeout=10).read()
                ok = b"gradmon_steps_total" in body
            except Exception as exc:  # noqa: BLE001 - every failure counts
                ok, body = False, repr(exc).encode()
            with lock:
                (latencies.append(time.monotonic() - t0) if ok else failures.append(body[:200].decode("replace")))
            if rate_hz:
                time.sleep(max(0.0, 1.0 / rate_hz - (time.monotonic() - t0)))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"scrapes": len(latencies), "failures": failures, "latencies": latencies})


def run(layers: int, window_s: float, windows: int, n_scrapers: int, rate: float) -> Dict[str, object]:
    import gradmon
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(32, 64)
    # every layer its own series (no grouping): the largest exposition a 500-layer model can make
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", detail_every=1, final_scrape_timeout=0,
                         series_budget=100_000)
    proc = psutil.Process()

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    rss_start = proc.memory_info().rss
    with_s: List[float] = []
    without_s: List[float] = []
    results = []
    ctx = mp.get_context("spawn")
    for w in range(windows):
        scraped = w % 2 == 1
        child = None
        if scraped:
            q = ctx.Queue()
            child = ctx.Process(target=scrapers, args=(mon.url, n_scrapers, rate, window_s, q))
            child.start()
            time.sleep(1.0)  # let the scrapers start before timing
        end = time.monotonic() + window_s - (1.0 if scraped else 0.0)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            step()
            (with_s if scraped else without_s).append(time.perf_counter() - t0)
        if child is not None:
            results.append(q.get(timeout=60))
            child.join(30)
    rss_end = proc.memory_info().rss
    errors = mon._errors.total()
    mon.detach()
    lat = [v for r in results for v in r["latencies"]]
    return {
        "layers": layers, "scrapers": n_scrapers, "rate_hz": rate or "back-to-back",
        "scrapes": sum(r["scrapes"] for r in results),
        "failed_scrapes": sum(len(r["failures"]) for r in results),
        "scrape_p50_ms": 1e3 * statistics.median(lat) if lat else float("nan"),
        "scrape_p99_ms": 1e3 * sorted(lat)[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
        "step_ratio_scraped_vs_not": statistics.median(with_s) / statistics.median(without_s),
        "gradmon_errors": errors,
        "rss_start_mb": rss_start / 2**20, "rss_end_mb": rss_end / 2**20,
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=500)
    p.add_argument("--seconds", type=float, default=30.0, help="scraping time per mode, in total")
    p.add_argument("--windows", type=int, default=6, help="alternating unscraped/scraped windows")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.seconds, args.windows = 50, 4.0, 2
    window = args.seconds / (args.windows // 2)
    out = [run(args.layers, window, args.windows, 20, 1.0), run(args.layers, window, args.windows, 20, 0.0)]
    for r in out:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
