"""Labels from the loss alone (issue 22): where, if anywhere, a run diverged.

    python bench/instability/label.py            # (re)writes bench/instability/corpus/labels.json
    python bench/instability/label.py --check    # exit 1 if the committed labels differ
    python bench/instability/label.py --dir /work/independent-corpus   # another directory's runs

An **event** starts at the first step of the earliest of

(a) a non-finite loss;
(b) a loss at or above the run's chance level (the manifest's, ln C for C classes), once the
    20-step trailing mean of the loss has fallen below half of it;
(c) 20 consecutive steps whose 20-step trailing mean is at least twice the running minimum of that
    trailing mean *and* at least that minimum + 0.1 nats (a converged 0.002 against 0.001 is noise).

An event after which the trailing mean returns within 1.2x of its minimum before the event, within
200 steps, is a **recovering spike**: the scan goes on after the return. The first event that does
not return is the **divergence**; the scan stops there. An event needs 200 recorded steps after it
to be labelled at all: a later one marks the run ``unlabelled`` (not scored), since whether it would
have recovered is unknown.

A run is ``diverging`` (it has a divergence step), ``recovering-spike`` (spikes only), ``healthy``
(no event) or ``unlabelled``. The trailing mean of step t is the mean of the finite and non-finite
losses of steps t-19..t (fewer at the start); a non-finite loss makes it non-finite, which is never
"within 1.2x".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

WINDOW = 20  # steps of the trailing mean, and consecutive steps of rule (c)
RATIO = 2.0  # rule (c): trailing mean >= RATIO x its running minimum ...
FLOOR = 0.1  # ... and >= that minimum + FLOOR nats
RECOVER_RATIO = 1.2  # a spike returns within this factor of its prior minimum ...
RECOVER_STEPS = 200  # ... within this many steps
MIN_AFTER = 200  # recorded steps an event needs after it to be labelled

HEALTHY, DIVERGING, SPIKE, UNLABELLED = "healthy", "diverging", "recovering-spike", "unlabelled"


@dataclass(frozen=True)
class Label:
    """Steps are 1-based optimizer steps: step n's loss is ``losses[n - 1]``."""

    kind: str
    divergence: Optional[int] = None
    rule: Optional[str] = None  # which of (a), (b), (c) started the divergence
    spikes: List[List[int]] = field(default_factory=list)  # [start, step the trailing mean returned]
    unlabelled_event: Optional[int] = None


def trailing_mean(losses: Sequence[float], n: int = WINDOW) -> List[float]:
    out, total, bad = [], 0.0, 0
    for i, x in enumerate(losses):
        finite = math.isfinite(x)
        total += x if finite else 0.0
        bad += not finite
        if i >= n:
            old = losses[i - n]
            total -= old if math.isfinite(old) else 0.0
            bad -= not math.isfinite(old)
        out.append(math.inf if bad else total / min(i + 1, n))
    return out


def _first_event(losses: Sequence[float], mean: Sequence[float], start: int, chance: float) -> Optional[tuple]:
    """(0-based index where the earliest event from ``start`` begins, its rule, the running minimum
    of the trailing mean just before it), or None."""
    lo = min((m for m in mean[:start]), default=math.inf)
    fell_below_half = any(m < chance / 2 for m in mean[:start])
    run = 0
    for i in range(start, len(losses)):
        if not math.isfinite(losses[i]):
            return i, "a", lo
        if fell_below_half and losses[i] >= chance:
            return i, "b", lo
        m = mean[i]
        if m < chance / 2:
            fell_below_half = True
        prior = lo  # the running minimum up to the previous step: rule (c) compares against it
        lo = min(lo, m)
        run = run + 1 if (m >= RATIO * lo and m >= lo + FLOOR) else 0
        if run == WINDOW:
            first = i - WINDOW + 1
            return first, "c", min(mean[:first]) if first else prior
    return None


def label(losses: Sequence[float], chance: float) -> Label:
    mean = trailing_mean(losses)
    spikes: List[List[int]] = []
    start = 0
    while True:
        found = _first_event(losses, mean, start, chance)
        if found is None:
            return Label(SPIKE if spikes else HEALTHY, spikes=spikes)
        i, rule, lo = found
        if len(losses) - (i + 1) < MIN_AFTER:
            return Label(UNLABELLED, spikes=spikes, unlabelled_event=i + 1)
        back = next((j for j in range(i + 1, min(len(losses), i + 1 + RECOVER_STEPS))
                     if mean[j] <= RECOVER_RATIO * lo), None)
        if back is None:
            return Label(DIVERGING, divergence=i + 1, rule=rule, spikes=spikes)
        spikes.append([i + 1, back + 1])
        start = back + 1


def digest(labels: Dict[str, dict]) -> str:
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()


def label_corpus() -> Dict[str, dict]:
    """Every recorded run of the manifest, labelled from its loss."""
    import corpus_files  # noqa: E402  (bench/instability/corpus_files.py)
    manifest = corpus_files.manifest()
    return {name: asdict(label(corpus_files.losses(name), entry["chance"]))
            for name, entry in sorted(manifest["runs"].items()) if "file" in entry}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed labels.json")
    p.add_argument("--dir", type=Path, help="label the recordings in this directory instead of corpus/")
    a = p.parse_args()
    import corpus_files
    if a.dir is not None:
        corpus_files.use(a.dir)
    labels = label_corpus()
    doc = {"sha256": digest(labels), "labels": labels}
    if a.check:
        committed = json.loads(corpus_files.LABELS.read_text())
        sys.exit(0 if committed == doc else "labels.json differs from label.py's labels of the recordings")
    corpus_files.LABELS.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    counts: Dict[str, int] = {}
    for v in labels.values():
        counts[v["kind"]] = counts.get(v["kind"], 0) + 1
    print(f"{corpus_files.LABELS}: {len(labels)} runs: {counts}; sha256 {doc['sha256']}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
