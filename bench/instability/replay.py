"""Replay recorded runs through gradmon's alert rules with ``promtool test rules``.

    python bench/instability/replay.py          # the per-run table (markdown), for README

Mapping (stated, not tuned): a step takes 10 s (6 steps per minute) and Prometheus scrapes
and evaluates rules every 15 s, as deploy/prometheus/ configures it. The scrape at t sees
what gradmon exported after the last step completed by t (step n completes at n x 10 s):
only those samples are replayed; steps between two scrapes are never seen as gauges (their
counters still count them). Rules: ``alerting.rule_groups(Thresholds(), PRODUCTION)``,
whatever they are when the replay runs.

One promtool run per recording. promtool evaluates the rules at every 15 s over the replayed
series, storing ``ALERTS``; a final ``promql_expr_test`` then asks, per alert name (what
Alertmanager groups a notification by), for the first time it fired and how many times it
started firing. The expected samples are left empty on purpose: promtool prints what it got,
and the parser reads that back; a sentinel sample proves the output was understood.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from gradmon import alerting
from gradmon import metrics as M

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenario import divergence_point, trailing_mean  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "instability"
STEP_SECONDS = 10.0  # 6 steps per minute
SCRAPE_SECONDS = 15  # scrape_interval and evaluation_interval of deploy/prometheus/*.yml
LEAD_STEPS = 20  # a warning must come at least this many steps before the divergence point
AFTER_DIVERGENCE = 100  # steps an unstable run is replayed past its divergence points: the criteria end there
SENTINEL = 424242
TARGET = {"job": "instability", "instance": "trainer:9400"}


@dataclass(frozen=True)
class Fired:
    alertname: str
    severity: str
    first_s: float  # first evaluation (seconds from the first scrape) at which it was firing
    onsets: int  # times it started firing (Alertmanager would notify once per onset)


@dataclass
class Result:
    name: str
    unstable: bool
    steps: int
    replayed: int  # steps replayed: all, or, unstable, up to AFTER_DIVERGENCE past the later divergence point
    divergence: Optional[int]
    smoothed_divergence: Optional[int]  # of the 20-step trailing mean: shown, not judged
    fired: List[Fired] = field(default_factory=list)
    first_nonfinite_step: Optional[int] = None

    def first_s(self, severity: str) -> Optional[float]:
        return min((f.first_s for f in self.fired if f.severity == severity), default=None)

    def first(self, severity: str) -> Optional[int]:
        """The step the first alert of this severity fired at (the last one completed by then)."""
        t = self.first_s(severity)
        return None if t is None else step_seen_at(t)

    def count(self, severity: str) -> int:
        return sum(f.onsets for f in self.fired if f.severity == severity)

    @property
    def warns_per_1000(self) -> float:
        return 1000.0 * self.count("warning") / self.replayed

    @property
    def early_warning(self) -> bool:
        w = self.first("warning")
        return self.divergence is not None and w is not None and w <= self.divergence - LEAD_STEPS

    @property
    def timely_page(self) -> bool:
        p = self.first("critical")
        return self.divergence is not None and p is not None and p <= self.divergence


def step_seen_at(t: float) -> int:
    """The last step completed by time t: what a scrape at t sees."""
    return int(math.floor(t / STEP_SECONDS + 1e-9))


def first_scrape_seeing(step: int) -> float:
    return math.ceil(step * STEP_SECONDS / SCRAPE_SECONDS) * SCRAPE_SECONDS


def scrape_count(steps: int) -> int:
    """Scrapes from t=0 until the first one that sees the last step."""
    return int(math.ceil(steps * STEP_SECONDS / SCRAPE_SECONDS)) + 1


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _value(v: Optional[float]) -> str:
    if v is None:
        return "_"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    return repr(v)


def _with_target(key: str, target: Dict[str, str] = TARGET) -> str:
    name, rest = key.split("{", 1)
    extra = ", ".join(f'{k}="{v}"' for k, v in target.items())
    return f"{name}{{{extra}, {rest}" if rest != "}" else f"{name}{{{extra}}}"


def read_by(rules: dict) -> Callable[[str], bool]:
    """Whether the rules read a sample name: promtool's time goes into loading series, and the
    rules read a fraction of what gradmon exports. Derived from the rules, so a family that a
    new rule reads is replayed without a change here."""
    exprs = "\n".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    if "__name__" in exprs:  # a selector by a name pattern may read any family: keep them all
        return lambda name: True
    return lambda name: re.search(rf"\b{re.escape(name)}\b", exprs) is not None


def values_of(rec: dict, spec: M.MetricSpec) -> Optional[Tuple[str, List[Optional[float]]]]:
    """The recorded series of a label-less family (one model on one rank): its key and values."""
    name = M.exposed_names(spec)[0]
    return next(((k, v) for k, v in rec["series"].items() if k.startswith(name + "{")), None)


def input_series(rec: dict, steps: int, wanted: Callable[[str], bool] = lambda name: True) -> List[dict]:
    """What Prometheus would have scraped of the first ``steps`` steps: recorded index n (0 =
    after attach, n = after step n) at each scrape, plus the last step's timestamp from the
    mapping."""
    seen = [min(step_seen_at(k * SCRAPE_SECONDS), steps) for k in range(scrape_count(steps))]
    out = [{"series": _with_target(key), "values": " ".join(_value(vals[n]) for n in seen)}
           for key, vals in rec["series"].items() if wanted(key.split("{", 1)[0])]
    steps_key = values_of(rec, M.STEPS)[0]
    stamp = M.LAST_STEP_TIMESTAMP.name + steps_key[steps_key.index("{"):]
    out.append({"series": _with_target(stamp),
                "values": " ".join(_value(n * STEP_SECONDS if n else None) for n in seen)})
    return out


def _queries(end_s: int) -> List[str]:
    window = f"[{end_s + SCRAPE_SECONDS}s:{SCRAPE_SECONDS}s]"
    firing = 'max by (alertname, severity) (ALERTS{alertstate="firing"}%s)'
    now, before = firing % "", firing % f" offset {SCRAPE_SECONDS}s"
    return [f"min_over_time(timestamp({now}){window})",
            f"sum_over_time(({now} unless {before}){window})",
            f"vector({SENTINEL})"]


_GOT = re.compile(r'\{([^{}]*)\}\s+([-+0-9.eEinfaINF]+)')
_EXPR = re.compile(r'\n\s*expr: ("(?:[^"\\]|\\.)*")')


def _parse_got(text: str, queries: Sequence[str]) -> List[List[Tuple[Dict[str, str], float]]]:
    """The samples promtool got for each query, from its failure report. A query whose result
    was empty passes (its expected samples are empty too) and is not in the report."""
    got: Dict[str, List[Tuple[Dict[str, str], float]]] = {}
    parts = _EXPR.split(text)
    for quoted, block in zip(parts[1::2], parts[2::2]):
        after = block.split("got:", 1)[1] if "got:" in block else ""
        got[json.loads(quoted)] = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
                                   for labels, value in _GOT.findall(after)]
    return [got.get(q, []) for q in queries]


def promtool() -> Optional[str]:
    return shutil.which("promtool")


def one_group(rules: dict) -> dict:
    """The rules in one group, in their order. promtool evaluates groups in no fixed order, so an
    alert reading a recording rule of another group sees this evaluation's value or the last
    one's at random (a real Prometheus, too, lags by up to one interval). One group makes the
    replay deterministic: it measures the no-lag case."""
    groups = rules["groups"]
    return {"groups": [{"name": "gradmon.replay", "rules": [r for g in groups for r in g["rules"]]}]}


def fired_alerts(rec: dict, steps: int, binary: str, rules: dict) -> List[Fired]:
    end_s = (scrape_count(steps) - 1) * SCRAPE_SECONDS
    queries = _queries(end_s)
    with tempfile.TemporaryDirectory() as d:
        # JSON is YAML to promtool, and 200 times faster to write than PyYAML's emitter
        (Path(d) / "rules.yml").write_text(json.dumps(rules))
        (Path(d) / "replay.yml").write_text(json.dumps({
            "rule_files": ["rules.yml"], "evaluation_interval": f"{SCRAPE_SECONDS}s",
            "tests": [{"interval": f"{SCRAPE_SECONDS}s", "input_series": input_series(rec, steps, read_by(rules)),
                       "promql_expr_test": [{"expr": q, "eval_time": f"{end_s}s", "exp_samples": []}
                                            for q in queries]}]}))
        r = subprocess.run([binary, "test", "rules", "replay.yml"], cwd=d, capture_output=True, text=True)
    got = _parse_got(r.stdout + r.stderr, queries)
    if got[-1] != [({}, float(SENTINEL))]:
        raise RuntimeError("promtool's report was not understood:\n" + r.stdout + r.stderr)
    onsets = {(s["alertname"], s["severity"]): int(v) for s, v in got[1]}
    return sorted((Fired(s["alertname"], s["severity"], v, onsets.get((s["alertname"], s["severity"]), 0))
                   for s, v in got[0]), key=lambda f: f.first_s)


def evaluate(path: Path, binary: str, rules: Optional[dict] = None) -> Result:
    rec = load(path)
    rules = one_group(rules if rules is not None else
                      alerting.rule_groups(alerting.Thresholds(), alerting.PRODUCTION, annotations=False))
    steps = len(rec["losses"])
    nonfinite = values_of(rec, M.NONFINITE_STEPS)
    first_nan = next((n for n, v in enumerate(nonfinite[1]) if v), None) if nonfinite else None
    unstable = rec["run"]["warmup"] == 0
    diverged = divergence_point(rec["losses"])
    smoothed = divergence_point(trailing_mean(rec["losses"]))
    known = [d for d in (diverged, smoothed) if d is not None]
    replayed = min(steps, max(known) + AFTER_DIVERGENCE) if unstable and known else steps
    return Result(rec["run"]["name"], unstable, steps, replayed, diverged, smoothed,
                  fired_alerts(rec, replayed, binary, rules),
                  first_nan if first_nan is not None and first_nan <= replayed else None)


def evaluate_all(binary: str, paths: Optional[Iterable[Path]] = None) -> List[Result]:
    return [evaluate(p, binary) for p in sorted(paths or DATA.glob("*.json.gz"))]


def criteria(results: Sequence[Result]) -> Dict[str, bool]:
    """Issue 10 part 3's goal, on the replayed recordings."""
    unstable = [r for r in results if r.unstable]
    healthy = [r for r in results if not r.unstable]
    nan_runs = [r for r in results if r.first_nonfinite_step is not None]
    healthy_steps = sum(r.replayed for r in healthy)
    return {
        f"warning >= {LEAD_STEPS} steps before the divergence point in >= 4 of 5 unstable runs":
            sum(r.early_warning for r in unstable) >= 4,
        "page no later than the divergence point in >= 4 of 5 unstable runs": sum(r.timely_page for r in unstable) >= 4,
        f"a NaN pages at the first scrape that sees it ({len(nan_runs)} runs had one)":
            all(r.first_s("critical") is not None
                and r.first_s("critical") <= first_scrape_seeing(r.first_nonfinite_step) for r in nan_runs),
        "no page in any healthy run": bool(healthy) and all(r.count("critical") == 0 for r in healthy),
        "at most one warning per 1,000 healthy steps (all healthy runs together)":
            bool(healthy) and 1000.0 * sum(r.count("warning") for r in healthy) / healthy_steps <= 1.0,
    }


def table(results: Sequence[Result]) -> str:
    def cell(v: Optional[int]) -> str:
        return "-" if v is None else str(v)

    def names(severity: str, r: Result) -> str:
        return ", ".join(f"{f.alertname[len('Gradmon'):]} x{f.onsets}" for f in r.fired if f.severity == severity) or "-"

    rows = ["| run | steps replayed | divergence point | same, 20-step mean loss | first warning (step) | first page (step) | "
            "warnings / 1,000 steps | warnings | pages |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        rows.append(f"| {r.name} | {r.replayed} of {r.steps} | {cell(r.divergence)} | {cell(r.smoothed_divergence)} | "
                    f"{cell(r.first('warning'))} | "
                    f"{cell(r.first('critical'))} | {r.warns_per_1000:.2f} | {names('warning', r)} | "
                    f"{names('critical', r)} |")
    rows.append("")
    rows += [f"- [{'x' if ok else ' '}] {what}" for what, ok in criteria(results).items()]
    return "\n".join(rows)


def main() -> None:
    binary = promtool()
    if binary is None:
        sys.exit("promtool not found (Debian package prometheus)")
    print(table(evaluate_all(binary)))


if __name__ == "__main__":
    main()
