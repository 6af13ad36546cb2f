"""The divergence watch's cost per step on the publisher thread: ``DivergenceWatch.step`` fed the
recorded losses of every corpus run, timed per call; with ``--baseline FILE`` (another version of
``gradmon/aggregate/divergence.py``, e.g. ``git show REV:gradmon/aggregate/divergence.py``) both
are timed in one process, round by round in turn.

    python bench/bench_divergence.py --baseline /tmp/divergence_before.py --rounds 9
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent / "instability"))
import corpus_files as files  # noqa: E402

from gradmon.aggregate import divergence  # noqa: E402


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("divergence_baseline", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  (dataclasses look their module up)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def per_step(module: ModuleType, runs: List[List[float]]) -> float:
    """Seconds per call over every run, a fresh watch per run, as a monitor has."""
    calls, spent = 0, 0.0
    for losses in runs:
        watch = module.DivergenceWatch()
        t = time.perf_counter()
        for loss in losses:
            watch.step(loss)
        spent += time.perf_counter() - t
        calls += len(losses)
    return spent / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="another divergence.py to time beside this one")
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    runs = [[float(x) for x in files.losses(name)] for name in sorted(files.manifest()["runs"])]
    versions = {"this": divergence, **({"baseline": load(a.baseline)} if a.baseline else {})}
    times = {name: [] for name in versions}
    for _ in range(a.rounds):
        for name, module in versions.items():
            times[name].append(per_step(module, runs))
    steps = sum(len(r) for r in runs)
    for name, ts in times.items():
        print(f"{name}: {1e6 * statistics.median(ts):.2f} us per step (median of {a.rounds} rounds of {steps} steps)")
    if a.baseline:
        print(f"ratio this/baseline: {statistics.median(times['this']) / statistics.median(times['baseline']):.2f}")


if __name__ == "__main__":
    main()
