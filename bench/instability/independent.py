"""The independent set (issue 23): runs gradmon and its rules were never tuned on, recorded and
scored outside the repository, so that a detector fitted to the corpus shows.

The families and causes of ``corpus.py`` (``lstm`` and ``rnn`` since 2026-11-28), but seeds the corpus never used and settings
moved off the corpus's values: other learning rates, other warm-up lengths, the poison at
another step and for another number of steps, the schedule restart at another step with another
ramp and factor. What each run turned out to be is ``label.py``'s call, made from its loss alone,
like the corpus's.

    nice -n 10 python bench/instability/record_corpus.py --set independent --dir /work/independent-corpus
    python bench/instability/label.py --dir /work/independent-corpus
    python bench/instability/score.py --dir /work/independent-corpus

Its recordings stay out of the repository on purpose: a set that is in the checkout is a set
someone looks at while tuning.
"""

from __future__ import annotations

from typing import List, Tuple

from corpus import Run

SEEDS = (20, 21, 22, 23)  # the corpus's are 0-3
SPLIT = "independent"


def runs() -> Tuple[Run, ...]:
    """Every run of the independent set (its ``tag`` names what moved off the corpus's settings)."""
    out: List[Run] = []

    def add(family: str, cause: str, seed: int, tag: str, **kw) -> None:
        out.append(Run(family, cause, seed, tag=tag, **kw))

    # healthy, with and without warm-up: lrs between the corpus's healthy ones, shorter warm-ups
    add("lm", "healthy-warmup", 20, "lr2e-3-wu100", lr=2e-3, warmup=100)
    add("lm", "healthy-nowarmup", 21, "lr1.5e-3", lr=1.5e-3)
    add("cnn", "healthy-warmup", 22, "lr2e-3-wu100", lr=2e-3, warmup=100)
    add("cnn", "healthy-nowarmup", 23, "lr2e-3", lr=2e-3)
    add("gru", "healthy-warmup", 21, "lr2e-3-wu150", lr=2e-3, warmup=150)
    # lr too high, with and without warm-up (cnn survived 5e-2 in the corpus: here 1e-1)
    add("lm", "lr-high-nowarmup", 22, "lr4e-2", lr=4e-2)
    add("lm", "lr-high-warmup", 23, "lr4e-2-wu150", lr=4e-2, warmup=150)
    add("gru", "lr-high-nowarmup", 20, "lr4e-1", lr=4e-1)
    add("gru", "lr-high-warmup", 22, "lr2e-1-wu200", lr=2e-1, warmup=200)
    add("cnn", "lr-high-warmup", 20, "lr1e-1-wu200", lr=1e-1, warmup=200)
    # late collapse: the restart at another step, with another ramp and factor
    add("lm", "late-collapse", 21, "at1400-ramp50", lr=1e-3, warmup=200, boost=100.0, boost_at=1400, boost_ramp=50)
    add("cnn", "late-collapse", 23, "x60-at1000-ramp200", lr=3e-3, warmup=200, boost=60.0, boost_at=1000,
        boost_ramp=200)
    add("gru", "late-collapse", 23, "at1500-ramp80", lr=3e-3, warmup=150, boost=100.0, boost_at=1500, boost_ramp=80)
    # a poisoned shard at another step, for another number of steps
    add("lm", "poisoned-batch", 23, "at1300x5", lr=1e-3, warmup=200, poison=tuple(range(1300, 1305)))
    add("cnn", "poisoned-batch", 21, "at600x3", lr=3e-3, warmup=200, poison=tuple(range(600, 603)))
    add("gru", "poisoned-batch", 22, "at700x12", lr=3e-3, warmup=200, poison=tuple(range(700, 712)))
    # the two tune-only recurrent families (2026-11-28), each cause once, settings moved off theirs
    add("lstm", "healthy-warmup", 20, "lr2e-3-wu150", lr=2e-3, warmup=150)
    add("rnn", "healthy-nowarmup", 21, "lr2e-3", lr=2e-3)
    add("lstm", "lr-high-nowarmup", 22, "lr2e-1", lr=2e-1)
    add("rnn", "lr-high-warmup", 23, "lr2e-1-wu250", lr=2e-1, warmup=250)
    add("lstm", "late-collapse", 21, "x80-at1400-ramp60", lr=3e-3, warmup=200, boost=80.0, boost_at=1400,
        boost_ramp=60)
    add("rnn", "late-collapse", 22, "at1100-ramp150", lr=3e-3, warmup=200, boost=100.0, boost_at=1100,
        boost_ramp=150)
    add("lstm", "poisoned-batch", 23, "at800x5", lr=3e-3, warmup=200, poison=tuple(range(800, 805)))
    add("rnn", "poisoned-batch", 20, "at1200x10", lr=3e-3, warmup=200, poison=tuple(range(1200, 1210)))
    return tuple(out)
