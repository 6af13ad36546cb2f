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
"""

from __future__ import annotations

import json
import math
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
Alert = Tuple[str, str]  # (alertname, severity)


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


def input_series(series: Dict[str, List[Optional[float]]], steps: int, mapping: Mapping,
                 wanted: Callable[[str], bool]) -> List[dict]:
    """What Prometheus would have scraped of the first ``steps`` steps: exposition index n (0 =
    after attach, n = after step n) at each scrape, and the last step's completion time."""
    seen = [min(mapping.seen_at(k * SCRAPE_SECONDS), steps) for k in range(mapping.evaluations(steps))]
    out = [{"series": replay._with_target(key), "values": _values([vals[n] for n in seen])}
           for key, vals in series.items() if wanted(key.split("{", 1)[0])]
    steps_key = next(k for k in series if k.startswith(M.exposed_names(M.STEPS)[0] + "{"))
    stamp = M.LAST_STEP_TIMESTAMP.name + steps_key[steps_key.index("{"):]
    out.append({"series": replay._with_target(stamp),
                "values": _values([n * mapping.step_seconds if n else None for n in seen])})
    return out


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


def timeline(series: Dict[str, List[Optional[float]]], steps: int, mapping: Mapping, binary: str,
             rules: Optional[dict] = None) -> List[FrozenSet[Alert]]:
    """The alerts firing at each evaluation k (time k x 15 s), k = 0 .. evaluations(steps) - 1."""
    rules = rules if rules is not None else shipped_rules()
    n = mapping.evaluations(steps)
    queries = [{"expr": FIRING, "eval_time": f"{k * SCRAPE_SECONDS}s", "exp_samples": []} for k in range(n)]
    queries.append({"expr": f"vector({replay.SENTINEL})", "eval_time": "0s", "exp_samples": []})
    with tempfile.TemporaryDirectory() as d:
        # JSON is YAML to promtool, and far faster to write than PyYAML's emitter
        (Path(d) / "rules.yml").write_text(json.dumps(rules))
        (Path(d) / "replay.yml").write_text(json.dumps({
            "rule_files": ["rules.yml"], "evaluation_interval": f"{SCRAPE_SECONDS}s",
            "tests": [{"interval": f"{SCRAPE_SECONDS}s",
                       "input_series": input_series(series, steps, mapping, replay.read_by(rules)),
                       "promql_expr_test": queries}]}))
        r = subprocess.run([binary, "test", "rules", "replay.yml"], cwd=d, capture_output=True, text=True)
    text = r.stdout + r.stderr
    if "err:" in text:  # a rule promtool could not evaluate (its sample limit, say): no timeline to trust
        raise RuntimeError("promtool could not evaluate a rule:\n" + text[text.index("err:") - 200:][:1000])
    got = reported(text)
    if got.get((f"vector({replay.SENTINEL})", 0.0)) != [({}, float(replay.SENTINEL))]:
        raise RuntimeError("promtool's report was not understood:\n" + text[-3000:])
    return [frozenset((labels["alertname"], labels["severity"])
                      for labels, _ in got.get((FIRING, k * SCRAPE_SECONDS), ())) for k in range(n)]
