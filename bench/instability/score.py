"""Score the shipped alert rules on the corpus (issue 22): per run and per split, at 1, 10 and 60 s
per step with a 15 s scrape.

    python bench/instability/score.py --docs               # both splits; rewrites the docs' table
    python bench/instability/score.py --split tune         # tune only (not logged)
    python bench/instability/score.py --runs gru-healthy-warmup-s0 --rates 10

Each recording (its sha256 checked against the manifest) is replayed through gradmon's in-process
code (``inprocess.py``: the publisher's fold, spike detectors and baselines fed with the recorded
packets), giving the exposition after every step, as gradmon with its default cadence exports it
(a recording of every statistic on every step is replayed at the defaults' cadence:
``inprocess.at_cadence``); the shipped rules are evaluated over it with promtool at each step rate
(``promreplay.py``), giving the alerts firing at every evaluation.
Labels come from the committed ``labels.json`` (its hash checked), never from the rules.

Definitions (issue 22; times are evaluation times, steps are what the evaluation's scrape saw):

- a *warning* is any alert of severity ``warning`` firing, a *page* any of severity ``critical``;
  a rising edge is an evaluation where one is firing and none was at the one before;
- healthy runs: pages (rising edges), warning rising edges per 1,000 steps, fraction of the
  run's evaluations (= of its time, = of its steps) with a warning firing;
- diverging runs (replayed to 100 steps past the divergence step d): *paged in time* if the
  first page fires no later than d x step + one scrape + one evaluation interval (30 s);
  *early warning* if the last warning rising edge before step d completes saw a step 20-300
  steps before d and a warning is still firing at the last evaluation before d completes
  (alerts of several names may hand over: "stays on or re-fires until it");
- recovering spikes: *warned* if a warning fires between the spike's first step and the step
  its trailing mean returned (+30 s), *not paged* if no page fires in the whole run;
- precision of warnings: over every run of the split, warning rising edges before the run's
  divergence (or anywhere, in runs without one) that are followed by the divergence within 300
  steps, over all such edges.

Every proportion carries a Wilson 95 % interval. A scoring that includes the test split is
appended to ``corpus/test-split-log.jsonl`` with the commit, so repeated peeking shows.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus_files as files  # noqa: E402
import inprocess  # noqa: E402
import label as labeler  # noqa: E402
import promreplay as pr  # noqa: E402
import replay  # noqa: E402

RATES = (1.0, 10.0, 60.0)  # seconds per step
LEAD_MIN, LEAD_MAX = 20, 300  # an early warning's last rising edge, steps before the divergence
PRECISION_STEPS = 300  # a warning edge is right if the divergence follows within this many steps
AFTER_DIVERGENCE = 100  # steps a diverging run is replayed past its divergence step
LATENCY = 2 * pr.SCRAPE_SECONDS  # one scrape + one evaluation interval
ROOT = Path(__file__).resolve().parents[2]


def wilson(k: int, n: int, z: float = 1.959964) -> Tuple[float, float]:
    """Wilson score 95 % interval of k successes in n trials; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class RunScore:
    """One run at one step rate."""

    name: str
    kind: str
    split: str
    rate: float
    steps: int  # steps replayed
    divergence: Optional[int]
    spikes: List[List[int]]
    firing: List[FrozenSet[pr.Alert]] = field(repr=False)

    def _step(self, k: int) -> int:
        return pr.Mapping(self.rate).seen_at(k * pr.SCRAPE_SECONDS)

    def on(self, severity: str) -> List[bool]:
        return [any(s == severity for _, s in f) for f in self.firing]

    def edges(self, severity: str) -> List[int]:
        """Evaluations where an alert of ``severity`` started firing (none was the one before)."""
        on = self.on(severity)
        return [k for k, x in enumerate(on) if x and (k == 0 or not on[k - 1])]

    def first(self, severity: str) -> Optional[int]:
        """The step seen by the first evaluation with ``severity`` firing."""
        on = self.on(severity)
        return next((self._step(k) for k, x in enumerate(on) if x), None)

    def names(self, severity: str) -> List[str]:
        """The alerts of ``severity`` that fired at all, sorted (a report reads the same every time)."""
        return sorted({name for f in self.firing for name, s in f if s == severity})

    def firing_fraction(self, severity: str) -> float:
        on = self.on(severity)
        return sum(on) / len(on) if on else 0.0

    def lead(self, severity: str) -> Optional[int]:
        f = self.first(severity)
        return None if f is None or self.divergence is None else self.divergence - f

    @property
    def paged_in_time(self) -> bool:
        if self.divergence is None:
            return False
        deadline = self.divergence * self.rate + LATENCY
        return any(x and k * pr.SCRAPE_SECONDS <= deadline for k, x in enumerate(self.on("critical")))

    def _before_divergence(self) -> int:
        """Evaluations strictly before the divergence step completes."""
        end = self.divergence * self.rate
        return sum(1 for k in range(len(self.firing)) if k * pr.SCRAPE_SECONDS < end)

    @property
    def early_warning_lead(self) -> Optional[int]:
        """The lead of the early warning (steps), or None if there is none."""
        if self.divergence is None:
            return None
        n = self._before_divergence()
        on = self.on("warning")[:n]
        if not on or not on[-1]:
            return None
        edge = max(k for k in range(n) if on[k] and (k == 0 or not on[k - 1]))
        lead = self.divergence - self._step(edge)
        return lead if LEAD_MIN <= lead <= LEAD_MAX else None

    @property
    def spike_warned(self) -> bool:
        on = self.on("warning")
        return any(on[k] for k in range(len(on)) for start, back in self.spikes
                   if start * self.rate <= k * pr.SCRAPE_SECONDS <= back * self.rate + LATENCY)

    def warning_edges_scored(self) -> Tuple[int, int]:
        """(warning rising edges counted for precision, of them followed by the divergence in time)."""
        edges = [self._step(k) for k in self.edges("warning")]
        if self.divergence is None:
            return len(edges), 0
        before = [e for e in edges if e <= self.divergence]
        return len(before), sum(1 for e in before if self.divergence - e <= PRECISION_STEPS)


def load_labels() -> Dict[str, dict]:
    doc = json.loads(files.LABELS.read_text())
    if labeler.digest(doc["labels"]) != doc["sha256"]:
        raise SystemExit("labels.json's labels do not match its sha256")
    return doc["labels"]


def check_recording(name: str, entry: dict) -> None:
    if files.sha256(files.path(name)) != entry["sha256"]:
        raise SystemExit(f"{name}: the recording's sha256 is not the manifest's")


def replay_steps(lab: dict, total: int) -> int:
    return min(total, lab["divergence"] + AFTER_DIVERGENCE) if lab["kind"] == labeler.DIVERGING else total


# -- summaries -----------------------------------------------------------------------------


def _prop(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{k}/{n} ({100 * lo:.0f}-{100 * hi:.0f} %)"


def summary(scores: Sequence[RunScore]) -> Dict[str, Tuple[int, int]]:
    """The issue's metrics as (successes, trials) over the runs of one split at one rate."""
    healthy = [s for s in scores if s.kind == labeler.HEALTHY]
    diverging = [s for s in scores if s.kind == labeler.DIVERGING]
    spikes = [s for s in scores if s.kind == labeler.SPIKE]
    h_steps = sum(s.steps for s in healthy)
    h_evals = sum(len(s.firing) for s in healthy)
    precision = [s.warning_edges_scored() for s in scores]
    return {
        "healthy runs with a page": (sum(bool(s.edges("critical")) for s in healthy), len(healthy)),
        "healthy warning rising edges (per step)": (sum(len(s.edges("warning")) for s in healthy), h_steps),
        "healthy time with a warning firing (evaluations)":
            (sum(sum(s.on("warning")) for s in healthy), h_evals),
        "diverging runs paged in time": (sum(s.paged_in_time for s in diverging), len(diverging)),
        "diverging runs with an early warning": (sum(s.early_warning_lead is not None for s in diverging),
                                                 len(diverging)),
        "recovering spikes warned and not paged": (sum(s.spike_warned and not s.edges("critical") for s in spikes),
                                                   len(spikes)),
        "warning edges followed by a divergence within 300 steps": (sum(t for _, t in precision),
                                                                    sum(n for n, _ in precision)),
    }


def _median(xs: List[int]) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def summary_table(by_split: Dict[str, List[RunScore]], rates: Sequence[float]) -> str:
    cols = [(split, rate) for split in by_split for rate in rates]
    head = "| metric | " + " | ".join(f"{split}, {rate:g} s/step" for split, rate in cols) + " |"
    rows = [head, "|---|" + "---:|" * len(cols)]
    per = {c: summary([s for s in by_split[c[0]] if s.rate == c[1]]) for c in cols}
    for metric in next(iter(per.values())):
        cells = []
        for c in cols:
            k, n = per[c][metric]
            if metric.startswith("healthy warning rising edges"):
                lo, hi = wilson(k, n)
                cells.append(f"{k} in {n} steps: {1000 * k / n if n else 0:.2f} / 1,000 "
                             f"({1000 * lo:.2f}-{1000 * hi:.2f})")
            else:
                cells.append(_prop(k, n))
        rows.append(f"| {metric} | " + " | ".join(cells) + " |")
    for what, fn in (("median lead of the first page (steps)", lambda s: s.lead("critical")),
                     ("median lead of the early warnings (steps)", lambda s: s.early_warning_lead)):
        cells = []
        for c in cols:
            leads = [fn(s) for s in by_split[c[0]] if s.rate == c[1] and s.kind == labeler.DIVERGING]
            m = _median([x for x in leads if x is not None])
            cells.append("-" if m is None else f"{m:g}")
        rows.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def alert_shares(scores: Sequence[RunScore]) -> Dict[str, Tuple[int, int, int]]:
    """Each warning that fired on a healthy run of ``scores`` (one split at one rate): (the
    healthy evaluations it fired at, those at which it fired alone, all healthy evaluations).
    Alone is what the healthy time with a warning would lose without it."""
    healthy = [s for s in scores if s.kind == labeler.HEALTHY]
    evals = sum(len(s.firing) for s in healthy)
    on: Dict[str, List[int]] = {}
    for s in healthy:
        for f in s.firing:
            warned = {name for name, severity in f if severity == "warning"}
            for name in warned:
                counts = on.setdefault(name, [0, 0])
                counts[0] += 1
                counts[1] += warned == {name}
    return {name: (k, alone, evals) for name, (k, alone) in sorted(on.items())}


def alert_table(by_split: Dict[str, List[RunScore]], rates: Sequence[float]) -> str:
    """:func:`alert_shares` of every split and rate, one row per warning."""
    cols = [(split, rate) for split in by_split for rate in rates]
    per = {c: alert_shares([s for s in by_split[c[0]] if s.rate == c[1]]) for c in cols}
    names = sorted({name for shares in per.values() for name in shares})
    if not names:
        return "No warning fired on a healthy run."
    rows = ["| warning | " + " | ".join(f"{split}, {rate:g} s/step" for split, rate in cols) + " |",
            "|---|" + "---:|" * len(cols)]
    for name in names:
        cells = []
        for c in cols:
            k, alone, evals = per[c].get(name, (0, 0, 0))
            cells.append(f"{100 * k / evals:.1f} % ({100 * alone / evals:.1f} % alone)" if k else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_table(scores: Sequence[RunScore]) -> str:
    def cell(v: Optional[int]) -> str:
        return "-" if v is None else str(v)

    rows = ["| run | split | label | s/step | divergence | first warning | warning lead | first page | page lead | "
            "early-warning lead | warning edges | warning firing | page edges | page firing | warnings | pages |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in scores:
        rows.append(f"| {s.name} | {s.split} | {s.kind} | {s.rate:g} | {cell(s.divergence)} | "
                    f"{cell(s.first('warning'))} | {cell(s.lead('warning'))} | "
                    f"{cell(s.first('critical'))} | {cell(s.lead('critical'))} | {cell(s.early_warning_lead)} | "
                    f"{len(s.edges('warning'))} | {100 * s.firing_fraction('warning'):.0f} % | "
                    f"{len(s.edges('critical'))} | {100 * s.firing_fraction('critical'):.0f} % | "
                    f"{', '.join(n[len('Gradmon'):] for n in s.names('warning')) or '-'} | "
                    f"{', '.join(n[len('Gradmon'):] for n in s.names('critical')) or '-'} |")
    return "\n".join(rows)


def failures(scores: Sequence[RunScore]) -> List[str]:
    """Every miss and every false page, one line each."""
    out = []
    for s in scores:
        at = f"{s.name} ({s.split}) at {s.rate:g} s/step"
        if s.kind in (labeler.HEALTHY, labeler.SPIKE) and s.edges("critical"):
            out.append(f"false page: {at}: {', '.join(s.names('critical'))} first at step {s.first('critical')}")
        if s.kind == labeler.DIVERGING and not s.paged_in_time:
            first = s.first("critical")
            out.append(f"late or missing page: {at}: divergence at step {s.divergence}, first page "
                       f"{'none' if first is None else f'at step {first}'}")
        if s.kind == labeler.DIVERGING and s.early_warning_lead is None:
            out.append(f"no early warning: {at}: divergence at step {s.divergence}, first warning "
                       f"{s.first('warning') if s.first('warning') is not None else 'none'}")
        if s.kind == labeler.SPIKE and not s.spike_warned:
            out.append(f"unwarned spike: {at}: spikes {s.spikes}")
    return out


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "gradmon", "bench/instability"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+uncommitted" if dirty else "")


def log_test_scoring(scores: Sequence[RunScore], rates: Sequence[float], at: str) -> None:
    test = [s for s in scores if s.split == "test"]
    if not test:
        return
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": at,
             "runs": sorted({s.name for s in test}),
             "summary": {f"{rate:g}": summary([s for s in test if s.rate == rate]) for rate in rates}}
    with files.TEST_LOG.open("a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


BATCH = 16  # most runs a promtool run evaluates at once: its per-evaluation share is paid once for all
# of them, and its memory grows with them


@dataclass(frozen=True)
class _Work:
    name: str
    lab: dict
    split: str
    steps: int  # replayed


def _replay_one(job: Tuple[_Work, dict]) -> Tuple[str, pr.Series, float]:
    work, rules = job
    t0 = time.monotonic()
    return (work.name, inprocess.expositions(work.name, replay.read_by(rules), work.steps, inprocess.DEFAULT_CADENCE),
            time.monotonic() - t0)


def batches(work: Sequence[_Work], rates: Sequence[float], jobs: int, batch: int) -> List[Tuple[float, List[_Work]]]:
    """The promtool runs: at each rate, the runs (longest first, so that a batch's runs end
    together and none idles in a long promtool run) cut into near-equal batches of at most
    ``batch``, and at least ``jobs`` of them where there are runs enough, so that every core has
    one; the costliest first (evaluations x steps replayed), so that the cores end together."""
    ordered = sorted(work, key=lambda w: (-w.steps, w.name))
    count = min(len(ordered), max(jobs, math.ceil(len(ordered) / max(1, batch)))) if ordered else 0
    cuts = [round(i * len(ordered) / count) for i in range(count + 1)]
    out = [(rate, ordered[a:b]) for rate in rates for a, b in zip(cuts, cuts[1:])]

    def cost(entry: Tuple[float, List[_Work]]) -> float:
        rate, runs = entry
        return pr.Mapping(rate).evaluations(runs[0].steps) * sum(w.steps for w in runs)

    return sorted(out, key=cost, reverse=True)


def first_steps(series: pr.Series, steps: int) -> pr.Series:
    """A longer replay's expositions cut to its first ``steps`` steps: what a replay of those steps
    gives (the replay only looks back), series that had no sample yet left out."""
    cut = {key: values[:steps + 1] for key, values in series.items()}
    return {key: values for key, values in cut.items() if any(v is not None for v in values)}


def score(names: Iterable[str], rates: Sequence[float], binary: str, jobs: int = 1, progress: bool = False,
          batch: int = BATCH, slow: bool = False, rules: Optional[dict] = None,
          replayed: Optional[Dict[str, pr.Series]] = None) -> List[RunScore]:
    """Score the runs: each replayed in process once for every rate (``jobs`` processes at a
    time), then evaluated with promtool in :func:`batches` (``jobs`` promtool runs at a time).
    ``slow``: the reference path, one promtool run per run and rate (:func:`promreplay.timeline`),
    which the batched path must equal. ``replayed``: replays already made, by run, of at least
    the steps scored and the families the rules read (the tests share theirs)."""
    rules = rules if rules is not None else pr.shipped_rules()
    jobs = max(1, jobs)
    manifest = files.manifest()["runs"]
    labels = load_labels()
    work = []
    for name in names:
        if labels[name]["kind"] == labeler.UNLABELLED:
            continue
        check_recording(name, manifest[name])
        work.append(_Work(name, labels[name], manifest[name]["split"],
                          replay_steps(labels[name], manifest[name]["steps"])))
    t0 = time.monotonic()
    # every replay first: they keep both cores busy, and then the promtool runs can go costliest
    # first (waiting on a batch's last replay would leave a core idle at the end instead)
    series = {w.name: first_steps(replayed[w.name], w.steps) for w in work if w.name in (replayed or {})}
    with (multiprocessing.get_context("spawn").Pool(jobs) if jobs > 1 else _Serial()) as pool:
        for name, expositions, seconds in pool.imap_unordered(_replay_one, [(w, rules) for w in work
                                                                            if w.name not in series]):
            series[name] = expositions
            if progress:
                print(f"  {name}: replayed in {seconds:.1f} s", file=sys.stderr, flush=True)

    def evaluate(rate: float, runs: List[_Work]) -> List[RunScore]:
        replayed = [(series[w.name], w.steps, pr.Mapping(rate)) for w in runs]
        firing = [pr.timeline(*r, binary, rules) for r in replayed] if slow else pr.timelines(replayed, binary, rules)
        if progress:
            print(f"  promtool at {rate:g} s/step: {', '.join(w.name for w in runs)} done at "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return [RunScore(w.name, w.lab["kind"], w.split, rate, w.steps, w.lab["divergence"], w.lab["spikes"], f)
                for w, f in zip(runs, firing)]

    with concurrent.futures.ThreadPoolExecutor(jobs) as promtool:
        plan = batches(work, rates, jobs, 1 if slow else batch)
        done = [promtool.submit(evaluate, rate, runs) for rate, runs in plan]
        return [s for future in done for s in future.result()]


class _Serial:
    """A pool of one: in this process, so that a failure's traceback is the replay's own."""

    def __enter__(self) -> "_Serial":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def imap_unordered(self, fn, items):
        return map(fn, items)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=("tune", "test", "both"), default="both")
    p.add_argument("--runs", nargs="*", help="only these runs")
    p.add_argument("--rates", nargs="*", type=float, default=list(RATES), help="seconds per step")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="replays and promtool runs at once (default: CPUs)")
    p.add_argument("--batch", type=int, default=BATCH, help="most runs one promtool run evaluates together")
    p.add_argument("--slow", action="store_true", help="the reference path: one promtool run per run and rate "
                                                       "(what the batched path is checked against)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")
    p.add_argument("--docs", type=Path, nargs="?", const=ROOT / "docs" / "alert-evaluation.md",
                   help="also write the report into this file's generated section (default: docs/alert-evaluation.md)")
    p.add_argument("--dir", type=Path, help="score the recordings in this directory instead of corpus/ (the "
                                            "independent set: every split its manifest declares; never logged "
                                            "to corpus/test-split-log.jsonl)")
    a = p.parse_args()
    if a.dir is not None:
        if a.docs is not None:
            p.error("--docs is the committed corpus's section; score another --dir without it")
        files.use(a.dir)
    binary = replay.promtool()
    if binary is None:
        sys.exit("promtool not found (Debian package prometheus)")
    manifest = files.manifest()["runs"]
    splits = ("tune", "test") if a.split == "both" else (a.split,)
    if a.dir is not None and a.split == "both":
        splits = tuple(sorted({e["split"] for e in manifest.values()}))
    names = [n for n in sorted(manifest) if manifest[n]["split"] in splits and (not a.runs or n in a.runs)]
    t0 = time.monotonic()
    at = commit()  # the code that scores is the code at the start
    scores = score(names, a.rates, binary, a.jobs, progress=not a.quiet, batch=a.batch, slow=a.slow)
    log_test_scoring(scores, a.rates, at)
    text = report(scores, splits, a.rates, len(names), time.monotonic() - t0, at)
    if a.dir is not None:
        text = f"Runs of {files.DIR} ({', '.join(splits)}), not the committed corpus.\n\n{text}"
    print(text)
    if a.docs is not None:
        write_docs(a.docs, text)


def report(scores: Sequence[RunScore], splits: Sequence[str], rates: Sequence[float], runs: int,
           seconds: float, at: str) -> str:
    """The summary table, the per-run table and every miss and false page (markdown)."""
    by_split = {split: [s for s in scores if s.split == split] for split in splits}
    ordered = sorted(scores, key=lambda s: (s.split, s.name, s.rate))
    return "\n".join([
        f"Scored at commit `{at}` on {time.strftime('%Y-%m-%d', time.gmtime())}: {runs} runs, "
        f"{', '.join(f'{r:g}' for r in rates)} s per step, 15 s scrape, {seconds:.0f} s.", "",
        summary_table(by_split, rates), "", "### Healthy time with each warning firing", "",
        "Each warning's share of the healthy runs' evaluations, and the share at which it was the only "
        "warning firing (what the healthy time with a warning would lose without it).", "",
        alert_table(by_split, rates), "", "### Misses and false pages", "",
        "\n".join(f"- {line}" for line in failures(ordered)) or "- none", "", "### Every run", "",
        run_table(ordered)])


BEGIN, END = "<!-- score.py:begin -->", "<!-- score.py:end -->"


def write_docs(path: Path, text: str) -> None:
    """Replace what lies between the markers in ``path`` (the docs' generated section)."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
