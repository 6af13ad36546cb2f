"""Evaluate the shipped alert rules with ``promtool test rules`` over a replayed run, at a stated
step rate, and read back which alerts were firing at every rule evaluation.

Mapping (stated, not tuned): step n completes at n x ``step_seconds``; Prometheus scrapes and
evaluates the rules every 15 s (``deploy/prometheus/*.yml``); the scrape at t sees the exposition
gradmon made after the last step completed by t. ``gradmon_last_step_timestamp_seconds`` is that
step's completion time. The rules' groups are evaluated as one group (see ``replay.one_group``:
promtool orders groups at random; one group is the no-lag case). Only the families the rules read
are loaded (``replay.read_by``), and runs of equal values are written in promtool's ``v+0xN``
form, so a counter that never moves costs one token, not one per scrape.

One promtool run asks, at every evaluation time, ``count by (alertname, severity)
(ALERTS{alertstate="firing"})`` with no samples expected: promtool reports what it got for each
evaluation where something fired, and the parser reads that back; a sentinel query proves the
report was understood.

promtool's time is its rule evaluations, and a share of each is paid once per evaluation however
many series it covers: :func:`timelines` evaluates many runs (and step rates) in one promtool run,
each under a ``job`` label of its own, and asks ``count by (job, alertname, severity)``. That is
the same evaluation run by run as long as no rule compares series of two jobs (every aggregation
``by`` a list naming ``job``, every ``on(...)`` naming it); :func:`mixes_runs` checks the rules, and
rules that could mix runs are evaluated one run per promtool run, as :func:`timeline` does.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import replay  # bench/instability/replay.py: its rule helpers (one group, which families are read)
from gradmon import alerting
from gradmon import metrics as M

SCRAPE_SECONDS = replay.SCRAPE_SECONDS
FIRING = 'count by (alertname, severity) (ALERTS{alertstate="firing"})'
FIRING_BY_JOB = 'count by (job, alertname, severity) (ALERTS{alertstate="firing"})'
Alert = Tuple[str, str]  # (alertname, severity)
Series = Dict[str, List[Optional[float]]]  # inprocess.Series: "name{labels}" -> value after attach and each step


@dataclass(frozen=True)
class Mapping:
    step_seconds: float

    def seen_at(self, t: float) -> int:
        """The last step completed by time t: what a scrape at t sees."""
        return int(math.floor(t / self.step_seconds + 1e-9))

    def evaluations(self, steps: int) -> int:
        """Evaluations from t=0 until the first one that sees the last step."""
        return int(math.ceil(steps * self.step_seconds / SCRAPE_SECONDS)) + 1


def shipped_rules() -> dict:
    return replay.one_group(alerting.rule_groups(alerting.Thresholds(), alerting.PRODUCTION, annotations=False))


def _values(values: Sequence[Optional[float]]) -> str:
    """promtool's series notation, equal finite neighbours folded into ``v+0xN``."""
    out: List[str] = []
    i = 0
    while i < len(values):
        v = values[i]
        j = i
        if v is not None and math.isfinite(v):
            while j + 1 < len(values) and values[j + 1] == v:
                j += 1
        out.append(replay._value(v) if j == i else f"{replay._value(v)}+0x{j - i}")
        i = j + 1
    return " ".join(out)


def input_series(series: Series, steps: int, mapping: Mapping, wanted: Callable[[str], bool],
                 job: str = replay.TARGET["job"]) -> List[dict]:
    """What Prometheus would have scraped of the first ``steps`` steps: exposition index n (0 =
    after attach, n = after step n) at each scrape, and the last step's completion time; the
    target's labels with ``job`` as its job."""
    target = {**replay.TARGET, "job": job}
    seen = [min(mapping.seen_at(k * SCRAPE_SECONDS), steps) for k in range(mapping.evaluations(steps))]
    out = [{"series": replay._with_target(key, target), "values": _values([vals[n] for n in seen])}
           for key, vals in series.items() if wanted(key.split("{", 1)[0])]
    steps_key = next(k for k in series if k.startswith(M.exposed_names(M.STEPS)[0] + "{"))
    stamp = M.LAST_STEP_TIMESTAMP.name + steps_key[steps_key.index("{"):]
    out.append({"series": replay._with_target(stamp, target),
                "values": _values([n * mapping.step_seconds if n else None for n in seen])})
    return out


# promtool's garbage collector, less often than Go's default (at twice the live heap): a rule
# evaluation allocates much and keeps little, and the collections were a good share of its time;
# the memory limit bounds what that costs, a large batch's heap included
PROMTOOL_ENV = {"GOGC": "400", "GOMEMLIMIT": "2GiB"}

_DURATION = re.compile(r"(\d+)(ms|y|w|d|h|m|s)")
_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_BLOCK = re.compile(r'expr: ("(?:[^"\\]|\\.)*"), time: ([0-9a-z]+),(.*?)(?=\n\s*expr: |\Z)', re.S)
_GOT = re.compile(r'\{([^{}]*)\}\s+([-+0-9.eEinfaINF]+)')


def seconds(duration: str) -> float:
    return sum(int(n) * _UNIT[u] for n, u in _DURATION.findall(duration))


def reported(text: str) -> Dict[Tuple[str, float], List[Tuple[Dict[str, str], float]]]:
    """(query, evaluation time in s) -> the samples promtool got, from its failure report. A
    query whose result was empty passed (nothing was expected) and is absent."""
    out = {}
    for quoted, when, block in _BLOCK.findall(text):
        got = block.split("got:", 1)[1] if "got:" in block else ""
        out[(json.loads(quoted), seconds(when))] = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(v))
                                                    for labels, v in _GOT.findall(got)]
    return out


def _promtool(rules: dict, inputs: List[dict], queries: List[str], evaluations: int,
              binary: str) -> Dict[Tuple[str, float], List[Tuple[Dict[str, str], float]]]:
    """Evaluate ``rules`` over ``inputs`` with promtool, asking each query at evaluations 0 ..
    ``evaluations`` - 1; what promtool got (:func:`reported`), the sentinel checked."""
    tests = [{"expr": q, "eval_time": f"{k * SCRAPE_SECONDS}s", "exp_samples": []}
             for q in queries for k in range(evaluations)]
    tests.append({"expr": f"vector({replay.SENTINEL})", "eval_time": "0s", "exp_samples": []})
    with tempfile.TemporaryDirectory() as d:
        # JSON is YAML to promtool, and far faster to write than PyYAML's emitter
        (Path(d) / "rules.yml").write_text(json.dumps(rules))
        (Path(d) / "replay.yml").write_text(json.dumps({
            "rule_files": ["rules.yml"], "evaluation_interval": f"{SCRAPE_SECONDS}s",
            "tests": [{"interval": f"{SCRAPE_SECONDS}s", "input_series": inputs, "promql_expr_test": tests}]}))
        r = subprocess.run([binary, "test", "rules", "replay.yml"], cwd=d, capture_output=True, text=True,
                           env={**os.environ, **PROMTOOL_ENV})
    text = r.stdout + r.stderr
    if "err:" in text:  # a rule promtool could not evaluate (its sample limit, say): no timeline to trust
        raise RuntimeError("promtool could not evaluate a rule:\n" + text[text.index("err:") - 200:][:1000])
    got = reported(text)
    if got.get((f"vector({replay.SENTINEL})", 0.0)) != [({}, float(replay.SENTINEL))]:
        raise RuntimeError("promtool's report was not understood:\n" + text[-3000:])
    return got


def timeline(series: Series, steps: int, mapping: Mapping, binary: str,
             rules: Optional[dict] = None) -> List[FrozenSet[Alert]]:
    """The alerts firing at each evaluation k (time k x 15 s), k = 0 .. evaluations(steps) - 1:
    one run, one promtool run (the reference :func:`timelines` is checked against)."""
    rules = rules if rules is not None else shipped_rules()
    n = mapping.evaluations(steps)
    got = _promtool(rules, input_series(series, steps, mapping, replay.read_by(rules)), [FIRING], n, binary)
    return [frozenset((labels["alertname"], labels["severity"])
                      for labels, _ in got.get((FIRING, k * SCRAPE_SECONDS), ())) for k in range(n)]


Run = Tuple[Series, int, Mapping]  # a replayed run's expositions, the steps to evaluate, the step rate


def timelines(runs: Sequence[Run], binary: str, rules: Optional[dict] = None) -> List[List[FrozenSet[Alert]]]:
    """:func:`timeline` of each run, all in one promtool run (one ``job`` a run) when the rules
    keep jobs apart, else one promtool run each."""
    rules = rules if rules is not None else shipped_rules()
    if mixes_runs(rules):
        return [timeline(series, steps, mapping, binary, rules) for series, steps, mapping in runs]
    wanted = replay.read_by(rules)
    inputs = [s for i, (series, steps, mapping) in enumerate(runs)
              for s in input_series(series, steps, mapping, wanted, job=f"run{i}")]
    counts = [mapping.evaluations(steps) for _, steps, mapping in runs]
    got = _promtool(rules, inputs, [FIRING_BY_JOB], max(counts), binary)
    out: List[List[set]] = [[set() for _ in range(n)] for n in counts]
    for k in range(max(counts)):
        for labels, _ in got.get((FIRING_BY_JOB, k * SCRAPE_SECONDS), ()):
            i = int(labels["job"][len("run"):])
            if k < counts[i]:  # past its last step a run's series go stale: what fires then is not its
                out[i][k].add((labels["alertname"], labels["severity"]))
    return [[frozenset(f) for f in run] for run in out]


_AGGREGATION = re.compile(r"(?<![\w:])(sum|min|max|avg|group|stddev|stdvar|count|count_values|quantile|topk|bottomk)"
                          r"\s*(?:(by|without)\s*\(([^()]*)\)\s*)?\(")
_MATCHING = re.compile(r"\b(on|ignoring)\s*\(([^()]*)\)")
_ACROSS = re.compile(r"\b(absent|absent_over_time|scalar|label_replace|label_join)\s*\(")


def mixes_runs(rules: dict) -> List[str]:
    """The rule expressions that could compare series of two jobs (empty: runs can share a
    promtool run). Conservative: an aggregation without ``by (..., job, ...)``, a matching
    ``on`` without job or ``ignoring`` job, and functions that read across series or rewrite
    labels (``label_replace`` only when it writes ``job``) are reported."""
    out = []
    for r in (r for g in rules["groups"] for r in g["rules"]):
        expr = r["expr"]
        bad = any(by != "by" or "job" not in re.findall(r"\w+", names) for _, by, names in _AGGREGATION.findall(expr))
        bad |= any((kind == "on") != ("job" in re.findall(r"\w+", names)) for kind, names in _MATCHING.findall(expr))
        bad |= any(m.group(1) != "label_replace" or re.search(r'label_replace\s*\([^,]*,\s*"job"', expr)
                   for m in _ACROSS.finditer(expr))
        if bad:
            out.append(r.get("alert") or r.get("record"))
    return out
