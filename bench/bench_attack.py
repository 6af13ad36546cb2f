"""Connection flood against a training job: what do hostile clients cost it, and do scrapes get through?

    python bench/bench_attack.py                                   # 500 connections for 20 s
    python bench/bench_attack.py --seconds 5 --connections 100     # smoke run

A 200-layer MLP trains in a thread with gradmon attached. Another process opens
``--connections`` hostile connections, a quarter each of: idle (connect, say nothing),
dripping (request headers, one byte a second), slow readers (a whole request, then the
response at 1 KB/s) and half TLS handshakes (a ClientHello, then silence); each one
reconnects as soon as the server drops it, as an attacker would. Meanwhile this process
scrapes every 0.2 s. Reported: the training process's threads, open fds and RSS (baseline,
high-water mark during the attack, 15 s after), scrape latency and failures during the
attack, and training steps/s before and during it.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List, Tuple

import psutil

KINDS = ("idle", "drip", "slow reader", "half TLS handshake")
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: slowloris\r\n"


def client_hello() -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def attack(port: int, n: int, seconds: float) -> int:
    """The hostile process: ``n`` connections, one tick a second, each reconnecting when dropped.
    Returns how many times the server dropped one."""
    hello = client_hello()
    sel = selectors.DefaultSelector()
    conns: Dict[socket.socket, Tuple[str, int]] = {}  # socket -> (kind, bytes sent)
    dropped = 0

    def connect(kind: str) -> None:
        s = socket.socket()
        if kind == "slow reader":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        if kind != "slow reader":  # slow readers read on their own schedule, below
            sel.register(s, selectors.EVENT_READ)
        conns[s] = (kind, 0)

    def drop(s: socket.socket) -> None:
        nonlocal dropped
        kind = conns.pop(s)[0]
        if kind != "slow reader":
            sel.unregister(s)
        s.close()
        dropped += 1
        connect(kind)

    def tick(s: socket.socket) -> None:
        kind, sent = conns[s]
        try:
            if kind == "drip":
                sent += s.send(REQUEST[sent:sent + 1] or b"a")
            elif kind == "half TLS handshake" and not sent:
                sent += s.send(hello)
            elif kind == "slow reader":
                if not sent:
                    sent += s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                elif s.recv(1024) == b"":
                    return drop(s)
            conns[s] = (kind, sent)
        except (BlockingIOError, InterruptedError):
            pass  # still connecting, or nothing to read yet
        except OSError:
            drop(s)

    for i in range(n):
        connect(KINDS[i % len(KINDS)])
    end = time.monotonic() + seconds
    next_tick = time.monotonic()
    while time.monotonic() < end:
        for key, _ in sel.select(max(0.0, min(next_tick, end) - time.monotonic())):
            try:
                gone = key.fileobj.recv(65536) == b""  # type: ignore[union-attr]
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                drop(key.fileobj)  # type: ignore[arg-type]
        if time.monotonic() >= next_tick:
            for s in list(conns):
                tick(s)
            next_tick = time.monotonic() + 1.0
    for s in conns:
        s.close()
    return dropped


class Census:
    """High-water marks of this process's threads, open fds and RSS, sampled every 20 ms."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> Tuple[int, int, float]:
        return self.proc.num_threads(), self.proc.num_fds(), self.proc.memory_info().rss / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = tuple(max(a, b) for a, b in zip(self.peak, self.now()))  # type: ignore[assignment]
            time.sleep(0.02)

    def start(self) -> None:
        self.peak = self.now()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def scrape_every(url: str, period: float, seconds: float) -> Tuple[List[float], List[str]]:
    latencies: List[float] = []
    failures: List[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            body = urllib.request.urlopen(url, timeout=10).read()
            if b"gradmon_steps_total" in body:
                latencies.append(time.monotonic() - t0)
            else:
                failures.append(f"{len(body)} bytes without gradmon_steps_total")
        except Exception as exc:  # noqa: BLE001 - every failure counts
            failures.append(repr(exc))
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
    return latencies, failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the attack is held")
    ap.add_argument("--connections", type=int, default=500, help="hostile connections")
    ap.add_argument("--layers", type=int, default=200, help="layers of the MLP (the exposition grows with them)")
    ap.add_argument("--attack-port", type=int, help=argparse.SUPPRESS)  # the attacker process
    args = ap.parse_args()
    if args.attack_port:
        print(attack(args.attack_port, args.connections, args.seconds))
        return

    import torch
    from torch import nn

    import gradmon
    from gradmon.server import connection_cap

    torch.set_num_threads(1)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(args.layers)])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    mon = gradmon.attach(net, port=0, addr="127.0.0.1", final_scrape_timeout=0)
    steps, stop = [0], threading.Event()

    def train() -> None:
        while not stop.is_set():
            net(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            steps[0] += 1

    trainer = threading.Thread(target=train, name="training", daemon=True)
    trainer.start()
    time.sleep(2.0)  # warm: hooks, first snapshot, torch's threads
    size = len(urllib.request.urlopen(mon.url, timeout=10).read())

    def steps_per_s(seconds: float) -> float:
        before = steps[0]
        time.sleep(seconds)
        return (steps[0] - before) / seconds

    base_rate = steps_per_s(2.0)
    census = Census()
    base = census.now()
    census.start()
    # another process, so that its sockets are not counted as the training job's fds
    attacker = subprocess.Popen([sys.executable, __file__, "--attack-port", str(mon.port), "--connections",
                                 str(args.connections), "--seconds", str(args.seconds + 1.0)],
                                stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the attacker's interpreter starts and connects
    before = steps[0]
    t_attack = time.monotonic()
    latencies, failures = scrape_every(mon.url, 0.2, args.seconds)
    attack_rate = (steps[0] - before) / (time.monotonic() - t_attack)
    dropped = int(attacker.communicate(timeout=60)[0])
    census.stop()
    peak = census.peak
    time.sleep(15.0)
    after = census.now()
    stop.set()
    trainer.join()
    mon.detach()

    lat = sorted(latencies)

    def ms(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    print(f"gradmon under a connection flood: {args.connections} hostile connections "
          f"({', '.join(KINDS)}; each reconnects when dropped) for {args.seconds:.0f} s")
    print(f"exposition {size / 1024:.0f} KiB ({args.layers}-layer MLP), connection cap "
          f"{connection_cap(mon.config.max_connections)}, connection_timeout {mon.config.connection_timeout:g} s")
    print(f"{'':18}{'baseline':>10}{'attack peak':>13}{'15 s after':>12}")
    for i, name in enumerate(("threads", "open fds", "RSS MiB")):
        print(f"{name:18}{base[i]:>10.0f}{peak[i]:>13.0f}{after[i]:>12.0f}")
    print(f"scrapes during the attack: {len(latencies)} ok, {len(failures)} failed; latency p50 {ms(0.5):.0f} ms, "
          f"p99 {ms(0.99):.0f} ms, max {ms(1.0):.0f} ms" + (f"; first failure {failures[0]}" if failures else ""))
    print(f"training: {base_rate:.1f} steps/s before, {attack_rate:.1f} during the attack "
          f"({attack_rate / base_rate:.0%})")
    print(f"attacker: the server dropped {dropped} hostile connections (deadline or eviction), "
          f"each reconnected at once")


if __name__ == "__main__":
    main()
