"""A training script that ends the way its first argument says (tests of how a run ends).

    python run_end_script.py HOW PORT SECONDS

HOW: ``end`` (falls off the end, no detach), ``raise_in_with``, ``raise`` (uncaught, no
``with``), ``raise_detach_in_finally``, ``loader_end`` (``detach()`` in the ``except
StopIteration`` that ends a data loop), ``exit0``, ``exit3``, ``ctrl_c``, ``sigterm`` (handle_sigterm on, trains until
killed), ``sigterm_own`` (the script's own SIGTERM handler, installed first),
``keep_serving`` (detaches, prints "ended", then waits for a line on stdin) or
``abandoned_callback`` (a Trainer callback's run that never sees its train end, as when
``train()`` raised and the exception was caught; the script then ends normally). The script
installs its own ``sys.excepthook`` before attaching, as a framework would: gradmon must chain it.
"""

from __future__ import annotations

import signal
import sys
import time

import torch
from torch import nn

import gradmon

KEPT = []


def main(how: str, port: int, seconds: float) -> None:
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(until: float) -> None:
        while time.monotonic() < until:
            x = torch.randn(16, 4)
            (model(x) - x[:, :2]).pow(2).mean().backward()  # a steady, learnable task: no alert of its own
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)

    def user_hook(exc_type, exc, tb) -> None:
        print(f"user excepthook saw {exc_type.__name__}", flush=True)
        sys.__excepthook__(exc_type, exc, tb)

    sys.excepthook = user_hook
    if how == "sigterm_own":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    options = dict(port=port, addr="127.0.0.1", name="script", handle_sigterm=how.startswith("sigterm"))
    deadline = time.monotonic() + seconds
    if how == "raise_in_with":
        with gradmon.attach(model, **options):
            train(deadline)
            raise ValueError("secret message that must not be exported")
    if how == "raise_detach_in_finally":
        monitor = gradmon.attach(model, **options)
        try:
            train(deadline)
            raise ValueError("secret message that must not be exported")
        finally:
            monitor.detach()
    if how == "keep_serving":
        with gradmon.attach(model, keep_serving=True, **options):
            train(deadline)
        print("ended", flush=True)
        sys.stdin.readline()
        return
    if how == "abandoned_callback":
        from gradmon.integrations._run import CallbackRun
        run = CallbackRun(options)
        run.start(model, main_process=True)
        KEPT.append(run)  # alive at exit, as a global Trainer's callback is
        try:
            train(deadline)
            raise ValueError("caught by the sweep")
        except ValueError:
            pass
        return
    if how == "loader_end":
        monitor = gradmon.attach(model, **options)
        batches = iter(range(3))
        while True:
            try:
                next(batches)
            except StopIteration:
                monitor.detach()
                break
            train(time.monotonic() + seconds / 3)
        return
    gradmon.attach(model, **options)
    train(deadline if not how.startswith("sigterm") else float("inf"))
    if how == "raise":
        raise ValueError("secret message that must not be exported")
    if how == "exit0":
        sys.exit(0)
    if how == "exit3":
        sys.exit(3)
    if how == "ctrl_c":
        raise KeyboardInterrupt


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
