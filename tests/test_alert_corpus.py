"""Issue 22: the alert-evaluation corpus (bench/instability/corpus/), its labels, its split and the
scorer's parts. The full score is ``python bench/instability/score.py`` (minutes); here: the
committed files are what the code says, the labeler's rules one by one, the in-process replay
against what gradmon exported live, and the promtool timeline against an independent reading."""

from __future__ import annotations

import json
import lzma
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gradmon import metrics as M
from servers import binary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "instability"))
import corpus  # noqa: E402
import corpus_files as files  # noqa: E402
import inprocess  # noqa: E402
import label as labeler  # noqa: E402
import promreplay as pr  # noqa: E402
import record_corpus  # noqa: E402
import replay  # noqa: E402
import score  # noqa: E402

MANIFEST = files.manifest()
RUNS = MANIFEST["runs"]
# the CI subset: two runs a family through the in-process replay (the held-out family included:
# no alert is evaluated on it here), and promtool on four tune runs (two of them alone too)
FAST = ["lm-healthy-warmup-s0", "lm-lr-high-nowarmup-s0", "cnn-poisoned-batch-s0", "cnn-late-collapse-s0",
        "gru-healthy-nowarmup-s0", "gru-lr-high-nowarmup-s0"]
PROMTOOL = ["lm-lr-high-nowarmup-s1", "cnn-poisoned-batch-s0"]  # of TUNE_CASES: evaluated alone and together


# -- the committed corpus ------------------------------------------------------------------


def test_every_declared_run_is_recorded_with_the_manifests_checksum():
    assert set(RUNS) == {r.name for r in corpus.runs()}
    for name, entry in RUNS.items():
        assert entry["sha256"] == files.sha256(files.path(name)), name


def test_the_corpus_has_40_runs_of_2000_steps_from_3_families_every_statistic_every_step_within_its_size_limits():
    assert len(RUNS) >= 40
    assert len({e["family"] for e in RUNS.values()}) >= 3
    sizes = [files.path(n).stat().st_size for n in RUNS]
    assert max(sizes) <= 500_000 and sum(sizes) <= 25_000_000
    for name in RUNS:
        with np.load(files.path(name), allow_pickle=False) as z:  # no object arrays anywhere
            assert len(z["loss"]) >= 2000 and len(z["loss"]) == RUNS[name]["steps"]
            meta = files.meta({"meta": z["meta"]})
            assert meta["torch_version"] == RUNS[name]["torch_version"]
            assert {k: meta["options"].get(k) for k in record_corpus.EVERY_STEP} == record_corpus.EVERY_STEP, name


def test_every_step_of_a_recording_carries_gradmons_packet():
    for name in FAST:
        rec = files.load(name)
        assert sorted(set(rec["packet_step"])) == list(range(1, len(rec["loss"]) + 1))


def test_the_committed_labels_are_the_labelers_labels_of_the_recordings():
    committed = json.loads(files.LABELS.read_text())
    assert committed["labels"] == labeler.label_corpus()
    assert committed["sha256"] == labeler.digest(committed["labels"])


def test_the_split_is_one_whole_family_and_the_late_seeds_with_enough_of_each_label():
    labels = json.loads(files.LABELS.read_text())["labels"]
    test = [n for n, e in RUNS.items() if e["split"] == "test"]
    assert {n for n in RUNS if RUNS[n]["family"] == MANIFEST["test_family"]} <= set(test)
    assert all(RUNS[n]["seed"] >= MANIFEST["late_seed"] for n in test if RUNS[n]["family"] != MANIFEST["test_family"])
    assert all(RUNS[n]["seed"] < MANIFEST["late_seed"] for n in RUNS
               if n not in test and RUNS[n]["family"] != MANIFEST["test_family"])
    kinds = [labels[n]["kind"] for n in test]
    assert kinds.count(labeler.DIVERGING) >= 10
    assert kinds.count(labeler.HEALTHY) >= 8
    assert kinds.count(labeler.SPIKE) >= 5


# -- the labeler, rule by rule ---------------------------------------------------------------


def test_a_nonfinite_loss_is_a_divergence_at_its_step():
    losses = [1.0] * 300 + [math.nan] * 300
    assert labeler.label(losses, chance=3.0) == labeler.Label(labeler.DIVERGING, divergence=301, rule="a")


def test_chance_level_after_learning_is_a_divergence():
    losses = [3.0] * 100 + [0.5] * 200 + [3.2] * 300  # the mean fell below 1.5, then chance
    assert labeler.label(losses, chance=3.0) == labeler.Label(labeler.DIVERGING, divergence=301, rule="b")


def test_chance_level_before_learning_is_no_event():
    assert labeler.label([3.2, 2.9] * 300, chance=3.0).kind == labeler.HEALTHY


def test_a_sustained_doubling_of_the_trailing_mean_is_a_divergence_at_its_first_step():
    losses = [1.0] * 300 + [0.4] * 200 + [1.0] * 300
    lab = labeler.label(losses, chance=10.0)
    assert lab.kind == labeler.DIVERGING and lab.rule == "c"
    # the trailing mean first reaches 0.8 (2 x 0.4) at the 14th step of 1.0, and stays there
    assert lab.divergence == 500 + 14


def test_a_doubling_on_the_noise_floor_is_no_divergence():
    losses = [1.0] * 100 + [0.001] * 300 + [0.002] * 400  # 2x, but 0.001 nats
    assert labeler.label(losses, chance=10.0).kind == labeler.HEALTHY


def test_a_return_within_200_steps_is_a_recovering_spike():
    losses = [1.0] * 100 + [0.4] * 400 + [1.5] * 60 + [0.4] * 400
    lab = labeler.label(losses, chance=10.0)
    assert lab.kind == labeler.SPIKE and lab.divergence is None
    assert lab.spikes[0][0] <= 501 + 20 and 560 < lab.spikes[0][1] <= 560 + 20


def test_a_return_after_200_steps_is_a_divergence():
    losses = [1.0] * 100 + [0.4] * 400 + [1.5] * 260 + [0.4] * 400
    assert labeler.label(losses, chance=10.0).kind == labeler.DIVERGING


def test_an_event_without_200_steps_after_it_is_not_labelled():
    losses = [1.0] * 100 + [0.4] * 400 + [math.nan] * 150
    assert labeler.label(losses, chance=10.0) == labeler.Label(labeler.UNLABELLED, unlabelled_event=501)


# -- the recording's encoding ----------------------------------------------------------------


def test_the_encoding_keeps_counts_exact_and_values_within_8e_6():
    exact = np.array([0.0, 1.0, 3.0, 131071.0, 1e-30, 3.3e38, -2.5e-3, math.pi, math.nan, math.inf, -math.inf])
    back = files.decode(files.encode(exact)).astype(np.float64)
    finite = np.isfinite(exact)
    assert np.all(np.abs(back[finite] - exact[finite]) <= 8e-6 * np.abs(exact[finite]))
    assert list(back[:4]) == [0.0, 1.0, 3.0, 131071.0]
    assert math.isnan(back[8]) and back[9] == math.inf and back[10] == -math.inf


def test_the_encoding_refuses_a_finite_value_past_float32():
    with pytest.raises(ValueError, match="float32"):
        files.encode(np.array([1e39]))


def test_the_column_encoding_keeps_whole_numbers_exact_and_values_within_2_to_the_minus_8():
    # two layouts (widths 3 and 2; layout 1's last value a step scalar, the loss), packets
    # interleaved as a detail cadence makes them
    rows = {0: [[0.0, 1.5, 7.0], [0.0, 1.51, 2.0 ** 31 - 1], [3.0, math.nan, 5.0]],
            1: [[1e-30, math.pi], [math.inf, 3.3e38], [-math.inf, -2.5e-3]]}
    layout = np.array([0, 1, 0, 1, 0, 1], np.int16)
    exact = np.array([v for i, lay in enumerate(layout) for v in rows[lay][i // 2]])
    offset = np.array([0, 3, 5, 8, 10, 13, 15], np.int64)
    rec = {"packet_offset": offset, "packet_layout": layout,
           **files.encode_columns(exact, offset, layout, scalars=[0, 1])}
    back = files.values(rec)
    assert list(rec["packet_columns"]) == [0, 1, 0, 1, 2]  # whole numbers as numbers, the scalar as float32
    assert back[[0, 5, 7, 10, 12]].tolist() == [0.0, 0.0, 2.0 ** 31 - 1, 3.0, 5.0]
    assert back[[4, 9, 14]].tolist() == np.array([math.pi, 3.3e38, -2.5e-3], np.float32).tolist()
    finite = np.isfinite(exact)
    assert np.all(np.abs(back[finite] - exact[finite]) <= 2.0 ** -8 * np.abs(exact[finite]))
    assert math.isnan(back[11]) and back[8] == math.inf and back[13] == -math.inf
    assert files.values({"packet_values": files.encode(exact)}) == pytest.approx(exact, rel=8e-6, nan_ok=True)
    # the planes before they were compressed with LZMA (recordings of an earlier version) read the same
    planes = np.frombuffer(lzma.decompress(rec.pop("packet_codes_xz").tobytes()), np.uint8).reshape(8, -1)
    assert files.values({**rec, "packet_codes": planes}).tolist() == pytest.approx(back.tolist(), nan_ok=True)


# -- the in-process replay -------------------------------------------------------------------


@pytest.mark.parametrize("cadence", [None, record_corpus.EVERY_STEP], ids=["defaults", "every-step"])
def test_the_replay_of_a_recording_exports_what_gradmon_exported_live(tmp_path, cadence):
    """A short real run, recorded while its live exposition is kept after every step; the replay
    of its packets through a fresh monitor must give the same samples (the encoding's precision
    aside). A lost packet, a wrong step or a mis-rebuilt section fails."""
    run = replace(corpus.by_name()["gru-poisoned-batch-s0"], poison=(40, 41))
    registry = CollectorRegistry()
    live = []

    def keep(monitor, step):
        monitor.flush()
        live.append(inprocess._collect(registry, lambda name: True))

    arrays = record_corpus.record(run, steps=60, registry=registry, on_step=keep, cadence=cadence)
    assert ("packet_codes_xz" in arrays) == (cadence is not None)
    path = tmp_path / "run.npz"
    files.save(path, arrays)
    stored = files.read(path)
    assert stored.keys() == arrays.keys()
    assert all(np.array_equal(stored[k], arrays[k], equal_nan=stored[k].dtype.kind == "f") for k in arrays)
    replayed = inprocess.replay_recording(stored, run)
    assert len(live) == 60
    for step, scrape in enumerate(live, start=1):
        assert set(scrape) == {k for k, v in replayed.items() if v[step] is not None}, step
        for key, value in scrape.items():
            assert_encoded(replayed[key][step], value, columns=cadence is not None, step=step, key=key)


def assert_encoded(got: float, value: float, columns: bool, step: int, key: str) -> None:
    """``got`` is what a replay made of a value gradmon exported as ``value``: each encoded value
    is within 8e-6 (the column encoding: 2**-8), a ratio of two (a baseline ratio) within twice
    that, a ratio of ratios four times; a spike score divides log differences by a scale of at
    least spikes.LOG_FLOOR, where that becomes up to ~2e-4 of score (~0.04 in the column
    encoding; the counters of spikes stay exact)."""
    rel, score_abs = (4 * 2.0 ** -8, 0.1) if columns else (2e-5, 1e-3)
    close = pytest.approx(value, abs=score_abs) if key.startswith("gradmon_spike_score{") else \
        pytest.approx(value, rel=rel, abs=1e-30)
    assert got == close or (math.isnan(got) and math.isnan(value)), (step, key)


def test_a_recording_of_every_step_replayed_at_the_default_cadence_exports_what_the_defaults_did():
    """The same short run recorded twice in one process (gradmon reads the training, never
    changes it): with gradmon's defaults, and every statistic on every step. Replayed at the
    default cadence, the second must export after every step what the first does (the column
    encoding's precision aside): a section kept that the defaults would not have read, or one
    dropped that they read, changes a series or its presence."""
    run = replace(corpus.by_name()["gru-poisoned-batch-s0"], poison=(40, 41))
    defaults = record_corpus.record(run, steps=60)
    every = record_corpus.record(run, steps=60, cadence=record_corpus.EVERY_STEP)
    assert np.array_equal(defaults["loss"], every["loss"])  # the same training, else nothing to compare
    assert len(files.layouts(every)) < len(files.layouts(defaults))  # the defaults' packets differ by step
    want = inprocess.replay_recording(defaults, run)
    got = inprocess.replay_recording(every, run, cadence=inprocess.DEFAULT_CADENCE)
    as_recorded = inprocess.replay_recording(every, run)
    assert set(got) == set(want)
    assert set(as_recorded) != set(want) or any(as_recorded[k] != want[k] for k in want)  # the cadence shows
    for key in want:
        for step, (a, b) in enumerate(zip(got[key], want[key])):
            assert (a is None) == (b is None), (step, key)
            if b is not None:
                assert_encoded(a, b, columns=True, step=step, key=key)


def test_only_a_recording_of_every_step_replays_at_another_cadence():
    run = replace(corpus.by_name()["gru-poisoned-batch-s0"], poison=(40, 41))
    defaults = record_corpus.record(run, steps=3)
    assert inprocess.replay_recording(defaults, run, cadence=inprocess.DEFAULT_CADENCE) == \
        inprocess.replay_recording(defaults, run)
    with pytest.raises(ValueError, match="only a recording of every step"):
        inprocess.replay_recording(defaults, run, cadence={"detail_every": 5, "optimizer_every": 20})


class _Replays(dict):
    """Whole recordings replayed in process once for the module, on first use: the families the
    rules read and the loss (a replay is most of a test's time here)."""

    def __missing__(self, name: str) -> inprocess.Series:
        wanted = replay.read_by(pr.shipped_rules())
        self[name] = inprocess.expositions(name, lambda n: n == "gradmon_loss" or wanted(n),
                                           cadence=inprocess.DEFAULT_CADENCE)  # as score.py replays
        return self[name]


@pytest.fixture(scope="module")
def replays() -> _Replays:
    return _Replays()


@pytest.mark.parametrize("name", FAST)
def test_the_replay_steps_the_monitor_once_per_recorded_step_with_its_loss(replays, name):
    series = replays[name]
    steps = next(v for k, v in series.items() if k.startswith("gradmon_steps_total{"))
    loss = next(v for k, v in series.items() if k.startswith("gradmon_loss{"))
    recorded = files.losses(name)
    assert steps == [float(i) for i in range(len(recorded) + 1)]
    for mine, theirs in zip(recorded, loss[1:]):
        assert theirs == pytest.approx(mine, rel=1e-5) or (math.isnan(mine) and math.isnan(theirs))


# -- promtool ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", score.RATES)
def test_the_timeline_pages_a_nonfinite_gradient_at_the_first_evaluation_that_sees_it(rate):
    """An independent computation: step n completes at n x rate; the first 15 s evaluation at or
    after that sees it, and GradmonNonFiniteGradients has no ``for``."""
    steps, nan_at = 300, 201
    key = 'model="gru", rank="0"'
    series = {f"gradmon_steps_total{{{key}}}": [float(i) for i in range(steps + 1)],
              f'gradmon_nonfinite_total{{kind="nan", layer="gru", {key}, tensor="grad"}}':
                  [0.0 if i < nan_at else 1.0 for i in range(steps + 1)]}
    firing = pr.timeline(series, steps, pr.Mapping(rate), binary("promtool"))
    first = next(k for k, f in enumerate(firing) if ("GradmonNonFiniteGradients", "critical") in f)
    assert first * pr.SCRAPE_SECONDS == math.ceil(nan_at * rate / pr.SCRAPE_SECONDS) * pr.SCRAPE_SECONDS
    assert len(firing) == pr.Mapping(rate).evaluations(steps)


@pytest.fixture(scope="module")
def one_by_one(replays):
    """The PROMTOOL runs replayed in process (to the steps scored), and each evaluated alone at
    10 s/step (the reference path)."""
    labels = json.loads(files.LABELS.read_text())["labels"]
    rules = pr.shipped_rules()
    out = {}
    for name in PROMTOOL:
        steps = score.replay_steps(labels[name], RUNS[name]["steps"])
        series = score.first_steps(replays[name], steps)
        out[name] = (series, steps, pr.timeline(series, steps, pr.Mapping(10.0), binary("promtool"), rules))
    return out


def test_a_whole_replay_cut_to_its_first_steps_is_the_replay_of_those_steps(replays):
    """The scorer and these tests cut whole replays to the steps scored (``score.first_steps``):
    the same as replaying those steps only, so long as nothing in the replay looks ahead."""
    name, steps = "cnn-poisoned-batch-s0", 300
    wanted = replay.read_by(pr.shipped_rules())
    series = inprocess.expositions(name, wanted, steps, cadence=inprocess.DEFAULT_CADENCE)
    cut = {k: v for k, v in score.first_steps(replays[name], steps).items() if wanted(k.split("{")[0])}

    def exact(s: inprocess.Series) -> dict:
        return {k: [repr(x) for x in v] for k, v in s.items()}  # a NaN equals a NaN here

    assert exact(series) == exact(cut)


@pytest.mark.parametrize("name", PROMTOOL)
def test_the_timeline_agrees_with_promtools_own_first_firing_times(one_by_one, name):
    """On real recordings at 10 s/step: the per-evaluation timeline's first firing time and
    onsets per alert equal what replay.py's queries (min_over_time(timestamp(ALERTS)) and its
    rising edges) get from promtool for the same input."""
    series, steps, firing = one_by_one[name]
    fired = replay.fired_alerts({"series": series}, steps, binary("promtool"), pr.shipped_rules())
    mine = {}
    for k, now in enumerate(firing):
        before = firing[k - 1] if k else frozenset()
        for alert in now:
            first, onsets = mine.get(alert, (k * pr.SCRAPE_SECONDS, 0))
            mine[alert] = (first, onsets + (alert not in before))
    assert mine == {(f.alertname, f.severity): (f.first_s, f.onsets) for f in fired}


def test_rules_that_could_compare_two_jobs_are_named():
    rules = {"groups": [{"name": "g", "rules": [
        {"alert": "Shipped", "expr": "max by (job, model) (x) > on(job, model) group_left() y"},
        {"alert": "NoBy", "expr": "sum(x) > 1"}, {"alert": "ByModel", "expr": "max by (model) (x)"},
        {"record": "on:model", "expr": "x > on(model) y"}, {"alert": "Ignoring", "expr": "x unless ignoring(job) y"},
        {"alert": "Scalar", "expr": "x > scalar(y)"}, {"alert": "Relabel", "expr": 'label_replace(x, "job", "a", "", "")'},
        {"alert": "Tensor", "expr": 'label_replace(x, "tensor", "a", "", "") > 0 and y:min'}]}]}
    assert pr.mixes_runs(rules) == ["NoBy", "ByModel", "on:model", "Ignoring", "Scalar", "Relabel"]
    assert pr.mixes_runs(pr.shipped_rules()) == []


def _promql_names(expr: str) -> set:
    """The identifiers of a PromQL expression outside its string literals (metric names among them)."""
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)))


def test_promtool_is_handed_every_family_a_shipped_rule_reads():
    """The scorer loads promtool with the families the rules read only (``replay.read_by``, less
    the machine's families, plus the step timestamp the mapping writes): a family a rule names
    that the filter dropped would leave that rule silently unable to fire."""
    rules = pr.shipped_rules()
    wanted = replay.read_by(rules)
    handed = {n for spec in M.ALL_SPECS for n in M.exposed_names(spec) if wanted(n) and n not in inprocess.DROPPED}
    handed.add(M.LAST_STEP_TIMESTAMP.name)
    exported = {n for spec in M.ALL_SPECS for n in M.exposed_names(spec)}
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        read = _promql_names(rule["expr"]) & exported
        assert read <= handed, (rule.get("alert") or rule.get("record"), read - handed)
    # the filter does cut (promtool's time grows with its series): nothing no rule names
    named = set().union(*(_promql_names(r["expr"]) for g in rules["groups"] for r in g["rules"]))
    assert handed - {M.LAST_STEP_TIMESTAMP.name} <= named and len(handed) < len(exported)
    by_pattern = {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": '{__name__=~"gradmon_loss.*"} > 1'}]}]}
    assert replay.read_by(by_pattern)("gradmon_loss")  # a rule the names cannot tell: nothing dropped


# -- the shipped rules on tune runs (issue 23: the tune split's criteria may be a plain test) --

TUNE_CASES = {  # one run of each kind the criteria name, and the hardest tune negatives
    "lm-healthy-warmup-s0": "no page",
    # its seed 0 twin lost its early warning at 1 and 10 s/step to the spike bursts (docs/alert-evaluation.md)
    "lm-lr-high-nowarmup-s1": "paged in time, warned early",
    "cnn-poisoned-batch-s0": "warned, not paged",
    "lm-poisoned-batch-s0": "warned, not paged",
    "rnn-healthy-nowarmup-s1": "lone gradient spikes, no warning",
}


@pytest.fixture(scope="module")
def tune_scores(replays):
    """The scorer's own path (the in-process replays, then the four runs in one promtool run)."""
    assert all(RUNS[name]["split"] == "tune" for name in TUNE_CASES)
    return {s.name: s for s in score.score(list(TUNE_CASES), (10.0,), binary("promtool"), jobs=1,
                                           replayed={name: replays[name] for name in TUNE_CASES})}


def test_a_healthy_tune_run_never_pages_at_10_s_per_step(tune_scores):
    s = tune_scores["lm-healthy-warmup-s0"]
    assert s.kind == "healthy" and not s.edges("critical")


def test_a_diverging_tune_run_pages_in_time_after_an_early_warning(tune_scores):
    s = tune_scores["lm-lr-high-nowarmup-s1"]
    assert s.paged_in_time and s.early_warning_lead is not None


def test_a_healthy_recurrent_runs_lone_gradient_spikes_are_counted_and_not_warned(tune_scores, replays):
    """Once learned, this tanh RNN's gradient norm spikes alone now and then (a recurrent net
    meeting a steep wall of its loss) with the loss unmoved: every spike is counted, none is a
    burst, so nothing warns (each spike warned for 20 steps before the bursts)."""
    name = "rnn-healthy-nowarmup-s1"
    since = next(v for k, v in replays[name].items()
                 if k.startswith("gradmon_steps_since_spike{") and 'signal="grad_norm"' in k)
    assert sum(1 for x in since if x == 0) >= 10  # spike steps of the global norm
    s = tune_scores[name]
    assert s.kind == "healthy" and not s.edges("warning") and not s.edges("critical")


@pytest.mark.parametrize("name", ["cnn-poisoned-batch-s0", "lm-poisoned-batch-s0"])
def test_a_poisoned_batch_warns_and_does_not_page(tune_scores, name):
    s = tune_scores[name]
    assert s.kind == "recovering-spike" and s.spike_warned and not s.edges("critical")


@pytest.mark.parametrize("name", PROMTOOL)
def test_a_run_scored_with_others_fires_what_it_fires_alone(tune_scores, one_by_one, name):
    """The scorer evaluates runs of different lengths in one promtool run, a job each (the
    diverging run ends early and its series go stale amid the others'); each run's timeline
    must equal its own promtool run's. A rule or query that let one run's series reach
    another's alerts fails here."""
    alone = one_by_one[name][2]
    assert tune_scores[name].firing == alone and any(alone)


# -- the metrics -------------------------------------------------------------------------------


def test_the_promtool_batches_hold_every_run_once_a_rate_one_a_core_at_least_costliest_first():
    work = [score._Work(f"r{i}", {}, "tune", steps) for i, steps in enumerate([2000] * 20 + [300] * 5)]
    plan = score.batches(work, (1.0, 60.0), jobs=2, batch=16)
    for rate in (1.0, 60.0):
        sizes = [len(runs) for r, runs in plan if r == rate]
        assert sorted(sizes) == [12, 13]  # two cores: two near-equal batches, though 16 would fit 25 in two
        assert sorted(w.name for r, runs in plan if r == rate for w in runs) == sorted(w.name for w in work)
    assert [r for r, _ in plan] == [60.0, 60.0, 1.0, 1.0]
    assert [w.steps for w in plan[0][1]] == [2000] * 12  # the long runs together: none idles in a long run
    assert [len(runs) for _, runs in score.batches(work, (10.0,), jobs=2, batch=6)] == [5, 5, 5, 5, 5]
    assert [len(runs) for _, runs in score.batches(work[:1], (10.0,), jobs=2, batch=6)] == [1]


def test_wilson_intervals_of_known_proportions():
    assert score.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert score.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert score.wilson(0, 0) == (0.0, 1.0)


def _scored(kind, firing, divergence=None, spikes=(), rate=10.0):
    return score.RunScore("r", kind, "tune", rate, 1000, divergence, [list(s) for s in spikes],
                          [frozenset({("W", "warning")}) if x == "w" else frozenset({("P", "critical")}) if x == "p"
                           else frozenset() for x in firing])


def test_an_early_warning_is_the_last_edge_20_to_300_steps_before_and_held_until_the_divergence():
    # 10 s/step: evaluation k sees step floor(1.5 k); divergence at step 150 completes at 1500 s = k 100
    held = _scored(labeler.DIVERGING, "." * 60 + "w" * 40 + "." * 10, divergence=150)
    assert held.early_warning_lead == 150 - 90
    dropped = _scored(labeler.DIVERGING, "." * 60 + "w" * 30 + "." * 20, divergence=150)
    assert dropped.early_warning_lead is None
    too_late = _scored(labeler.DIVERGING, "." * 95 + "w" * 15, divergence=150)
    assert too_late.early_warning_lead is None


def test_a_page_in_time_fires_by_one_scrape_and_one_evaluation_after_the_divergence():
    # divergence at step 150: 1500 s; deadline 1530 s = evaluation 102
    assert _scored(labeler.DIVERGING, "." * 102 + "p", divergence=150).paged_in_time
    assert not _scored(labeler.DIVERGING, "." * 103 + "p", divergence=150).paged_in_time


def test_the_docs_section_is_replaced_between_its_markers_and_nothing_else(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# head\n{score.BEGIN}\nold table\n{score.END}\ntail\n")
    score.write_docs(doc, "new table")
    assert doc.read_text() == f"# head\n{score.BEGIN}\nnew table\n{score.END}\ntail\n"


# -- the independent set (issue 23): declared in the repository, recorded and scored outside it --

import subprocess  # noqa: E402

import independent  # noqa: E402


def test_the_independent_set_uses_no_seed_of_the_corpus():
    seeds = {r.seed for r in independent.runs()}
    assert len(independent.runs()) >= 12 and seeds.isdisjoint({r.seed for r in corpus.runs()})


def test_dir_sends_the_manifest_and_labels_there_and_leaves_the_committed_corpus_alone(tmp_path):
    committed = {p: p.read_bytes() for p in sorted(files.COMMITTED.iterdir())}
    here = ROOT / "bench" / "instability"
    for script, *args in (("record_corpus.py", "--set", "independent", "--manifest"), ("label.py",)):
        subprocess.run([sys.executable, str(here / script), *args, "--dir", str(tmp_path)], check=True,
                       capture_output=True)
    manifest = json.loads((tmp_path / "manifest.json").read_text())["runs"]
    assert set(manifest) == {r.name for r in independent.runs()}
    assert {e["split"] for e in manifest.values()} == {"independent"}
    assert (tmp_path / "labels.json").exists()
    assert {p: p.read_bytes() for p in sorted(files.COMMITTED.iterdir())} == committed


def test_the_independent_set_is_refused_inside_the_repository():
    missing = ROOT / "bench" / "instability" / "not-a-corpus"  # without the refusal: a traceback, nothing written
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "instability" / "record_corpus.py"),
                           "--set", "independent", "--manifest", "--dir", str(missing)], capture_output=True, text=True)
    assert done.returncode == 2 and "outside the repository" in done.stderr


def test_each_warnings_share_of_healthy_time_counts_it_firing_and_firing_alone():
    evals = [frozenset({("A", "warning")})] * 3 + [frozenset({("A", "warning"), ("B", "warning")})] \
        + [frozenset({("B", "warning"), ("P", "critical")})] + [frozenset()] * 5
    healthy = score.RunScore("h", labeler.HEALTHY, "tune", 10.0, 100, None, [], evals)
    diverging = score.RunScore("d", labeler.DIVERGING, "tune", 10.0, 100, 50, [], [frozenset({("C", "warning")})] * 4)
    assert score.alert_shares([healthy, diverging]) == {"A": (4, 3, 10), "B": (2, 1, 10)}
    table = score.alert_table({"tune": [healthy, diverging]}, [10.0])
    assert "| A | 40.0 % (30.0 % alone) |" in table and "| B | 20.0 % (10.0 % alone) |" in table
    assert "| C |" not in table  # a warning of a diverging run is not healthy time
