"""The publisher thread's units, each fed synthetic rows without an Aggregator around it:
the origin of a non-finite run, the global-norm histogram, coverage, the counters a later
monitor continues, one statistic's fold, the step scalars and the snapshot's per-layer parts."""

from __future__ import annotations

import math

import pytest

from gradmon import metrics as M
from gradmon import statistics as S
from gradmon.aggregate.counters import Counters
from gradmon.aggregate.coverage import CoverageTracker
from gradmon.aggregate.fold import Folded
from gradmon.aggregate.histogram import NormHistogram
from gradmon.aggregate.origin import NonFiniteIncident, Origin, OriginTracker
from gradmon.aggregate.scalars import LastStep, LearningRatePeaks
from gradmon.aggregate.snapshot import WorstNames, per_layer

NAMES = ("embed", "block.0", "block.1", "head")
GRAD, ACT, BLOCK = M.TENSOR_GRAD, M.TENSOR_ACTIVATION, M.TENSOR_BLOCK


def _tracker(**kw) -> OriginTracker:
    return OriginTracker("m", 0, NAMES, ("input", "blocks", "output"), **kw)


def _step(tracker: OriginTracker, step: int, bad_grads=(), forward=()) -> None:
    """One step: the layers whose gradients went non-finite, then (tensor, key, flags) of forward records."""
    tracker.start_step()
    for tensor, key, flags in forward:
        tracker.forward_values(tensor, key, flags)
    for layer in bad_grads:
        tracker.bad_gradient(GRAD, layer)
    tracker.end_step(bool(bad_grads) or any(flags for _, _, flags in forward), step)


# -- the origin of a non-finite run ---------------------------------------------------

def test_the_origin_of_a_gradient_is_the_first_layer_in_backward_order():
    tracker = _tracker()
    _step(tracker, 7, bad_grads=(1, 3, 2))
    assert tracker.origins() == (Origin(GRAD, "head", 7),)


def test_the_later_steps_of_a_run_keep_the_origin_of_its_first_step():
    tracker = _tracker()
    _step(tracker, 7, bad_grads=(1,))
    _step(tracker, 8, bad_grads=(0, 1, 2, 3))  # poisoned weights: everything is non-finite
    assert tracker.origins() == (Origin(GRAD, "block.0", 7),)


def test_a_finite_step_ends_the_run_and_the_next_run_has_its_own_origin():
    tracker = _tracker()
    _step(tracker, 7, bad_grads=(1,))
    _step(tracker, 8)
    _step(tracker, 9, bad_grads=(2,))
    assert tracker.origins() == (Origin(GRAD, "block.1", 9),)


def test_a_forward_kind_held_on_the_last_finite_step_is_no_origin():
    # a float mask's -Inf in block.0 on every step; the NaN that starts the run is in block.1
    mask, nan = (ACT, 1, S.NEG_INF_FLAG), (ACT, 2, S.NAN_FLAG)
    tracker = _tracker()
    _step(tracker, 1, forward=(mask, (ACT, 2, 0)))
    _step(tracker, 2, bad_grads=(3,), forward=(mask, nan))
    assert dict((o.tensor, o.layer) for o in tracker.origins()) == {GRAD: "head", ACT: "block.1"}


@pytest.mark.parametrize("at_once", [False, True], ids=["one by one", "all at once"])
def test_a_kind_is_forgotten_by_the_baseline_once_a_finite_step_records_its_key_finite(at_once):
    mask, nan = (ACT, 1, S.NEG_INF_FLAG), (ACT, 2, S.NAN_FLAG)
    tracker = _tracker()
    _step(tracker, 1, forward=(mask,))  # block.0 held -Inf on a finite step: its baseline
    tracker.start_step()  # a finite step whose block.0 is finite: the baseline forgets the -Inf
    if at_once:
        tracker.forward_finite(ACT, [0, 1, 2, 3])
    else:
        for key in (0, 1, 2, 3):
            tracker.forward_values(ACT, key, 0)
    tracker.end_step(False, 2)
    _step(tracker, 3, bad_grads=(3,), forward=(mask, nan))  # now block.0's -Inf is new: it comes first
    assert dict((o.tensor, o.layer) for o in tracker.origins()) == {GRAD: "head", ACT: "block.0"}


def test_a_key_flagged_in_one_forward_of_a_step_keeps_its_kind_in_the_baseline_whatever_the_others():
    mask, nan = (ACT, 1, S.NEG_INF_FLAG), (ACT, 2, S.NAN_FLAG)
    tracker = _tracker()
    tracker.start_step()  # two micro-batches: block.0 finite in one, -Inf in the other
    tracker.forward_finite(ACT, [0, 1, 2, 3])
    tracker.forward_values(*mask)
    tracker.forward_finite(ACT, [0, 1, 2, 3])
    tracker.end_step(True, 1)
    _step(tracker, 2, bad_grads=(3,), forward=(mask, nan))  # block.0's -Inf is the baseline's
    assert dict((o.tensor, o.layer) for o in tracker.origins()) == {GRAD: "head", ACT: "block.1"}


def test_a_block_origin_is_named_by_the_block_names():
    tracker = _tracker()
    _step(tracker, 4, bad_grads=(0,), forward=((BLOCK, 0, S.NAN_FLAG),))
    assert Origin(BLOCK, "input", 4) in tracker.origins()


def test_every_non_finite_step_is_an_incident_and_only_the_first_of_a_run_starts_one():
    seen = []
    tracker = _tracker(on_incident=lambda incident, starts: seen.append((incident, starts)))
    _step(tracker, 5, bad_grads=(2,))
    _step(tracker, 6, bad_grads=(1, 2))
    _step(tracker, 7)
    assert seen == [(NonFiniteIncident("m", 0, 5, "block.1", None, None, 5), True),
                    (NonFiniteIncident("m", 0, 6, "block.1", None, None, 5), False)]


# -- the global-norm histogram ----------------------------------------------------------

def test_a_norm_is_counted_in_the_first_bucket_whose_bound_holds_it_and_summed():
    hist = NormHistogram((1.0, 10.0))
    for norm in (0.5, 1.0, 3.0, 20.0):
        hist.observe(norm, overflow=False)
    assert hist.buckets() == ((1.0, 2), (10.0, 3), (math.inf, 4))
    assert (hist.sum, hist.count) == (24.5, 4)


def test_a_non_finite_norm_is_not_observed_and_an_overflow_is_counted_in_inf_without_its_sum():
    hist = NormHistogram((1.0,))
    hist.observe(math.nan, overflow=False)
    hist.observe(math.inf, overflow=True)
    assert hist.buckets() == ((1.0, 0), (math.inf, 1))
    assert (hist.sum, hist.count) == (0.0, 1)


def test_a_histogram_resumes_by_adding_what_an_earlier_one_saved():
    before, after = NormHistogram((1.0,)), NormHistogram((1.0,))
    before.observe(0.5, overflow=False)
    after.observe(2.0, overflow=False)
    after.resume(before.saved())
    assert (after.buckets(), after.sum, after.count) == (((1.0, 1), (math.inf, 2)), 2.5, 2)


# -- coverage ----------------------------------------------------------------------------

def _coverage(**kw) -> CoverageTracker:
    args = dict(model="m", layer_names=NAMES, statistics=(S.GRAD, S.ACTIVATION), grad_layers={0, 1, 2}, tied={})
    return CoverageTracker(**{**args, **kw})


def test_the_grad_family_is_judged_after_a_step_and_the_detail_families_after_a_detail_step():
    cover = _coverage()
    assert cover.uncovered(steps_total=0) == {M.FAMILY_ACTIVATION: 0}
    cover.saw(M.FAMILY_GRAD, {0, 1})
    assert cover.uncovered(steps_total=1) == {M.FAMILY_GRAD: 1, M.FAMILY_ACTIVATION: 0}
    cover.saw(M.FAMILY_ACTIVATION, {0, 1, 2})
    cover.detail_backward()
    assert cover.uncovered(steps_total=2) == {M.FAMILY_GRAD: 1, M.FAMILY_ACTIVATION: 1}


def test_a_layer_without_parameters_of_its_own_expects_no_gradient_and_is_named_tied():
    cover = _coverage(tied={"head": "embed"})
    cover.saw(M.FAMILY_GRAD, {0, 1, 2})
    coverage = cover.coverage()
    assert coverage.expected["head"] == {M.FAMILY_ACTIVATION}
    assert coverage.tied == {"head": "embed"}
    assert coverage.gaps() == {name: {M.FAMILY_ACTIVATION} for name in NAMES}


def test_a_limit_found_after_attach_is_in_the_coverage():
    cover = _coverage()
    cover.add_limit("ZeRO shards the gradients")
    assert cover.coverage().limits == ("ZeRO shards the gradients",)


# -- the counters a later monitor continues ---------------------------------------------

def test_counters_resume_by_layer_name_and_drop_a_layer_the_new_monitor_lacks():
    before = Counters((S.GRAD,), 3)
    before.steps_total, before.nonfinite_steps = 10, 2
    before.cells["grad"][1] = [4, 0]
    before.cells["grad"][2] = [0, 1]
    after = Counters((S.GRAD,), 2)
    after.steps_total = 1
    after.resume(before.saved(("a", "b", "c")), ("b", "a"))
    assert (after.steps_total, after.nonfinite_steps) == (11, 2)
    assert after.cells["grad"] == [[4, 0], [0, 0]]


def test_amp_skips_are_exported_once_a_scaler_is_given_or_a_step_was_skipped():
    counts = Counters((), 0)
    assert counts.amp_skipped() is None
    counts.skipped()
    assert counts.amp_skipped() == 1
    assert Counters((), 0, amp=True).amp_skipped() == 0


# -- one statistic's fold ---------------------------------------------------------------

def test_a_layers_parameter_norms_combine_as_the_root_of_their_summed_squares():
    f = Folded(S.GRAD, 2, {"norm_baseline": 8}, slots=(0, 0, 1))
    acc = None
    for row in ((3.0, 0.0, 0.0), (4.0, 0.0, 0.0)):
        acc = f.combine(acc, row, numel=10)
    assert f.columns(acc) == {"norm": 5.0, "nan": 0.0, "inf": 0.0, "numel": 20}
    assert f.norm_total({0: acc, 1: f.combine(None, (12.0, 0.0, 0.0), 1)}) == 13.0


def test_layer_norms_are_read_once_per_step():
    f = Folded(S.GRAD, 1, {"norm_baseline": 8}, slots=(0,))
    f.last = {0: f.combine(None, (2.0, 0.0, 0.0), 1)}
    assert f.layer_norms() == {0: 2.0}
    assert f.layer_norms() == {}


def test_baseline_ratios_settled_when_read_equal_those_settled_every_step(monkeypatch):
    """A layer's ratio to its baseline is worked out when a snapshot reads it, not every
    step: the same values as every step's, through NaN steps, steps without a layer, and
    restarts; and no median is taken while nobody reads."""
    import random
    rng = random.Random(3)
    every, late = (Folded(S.GRAD, 3, {"norm_baseline": 8}, slots=(0, 1, 2)) for _ in range(2))
    gauge = next(g for g in S.GRAD.gauges if g.baseline)
    medians = []
    baseline_median = S.baseline_median
    monkeypatch.setattr(S, "baseline_median", lambda w: medians.append(1) or baseline_median(w))
    seen = set()
    for step in range(80):
        acc = {layer: (rng.uniform(1, 2) if (step + layer) % 7 else math.nan, 0.0, 0.0)
               for layer in range(3) if (step * 5 + layer) % 4}
        for f in (every, late):
            if step % 17 == 16:
                f.restart()
            before = len(medians)
            f.update_gauges({layer: f.combine(None, row, 1) for layer, row in acc.items()})
            assert len(medians) == before  # nobody read: no median yet
        before = len(medians)
        every.settle()
        assert len(medians) - before == len(acc)
        seen.update(repr(r) for r in every.gauges[gauge])
        if step % 3 == 2:
            late.settle()
            assert repr(late.gauges[gauge]) == repr(every.gauges[gauge])
    assert {"None", "nan"} < seen and len(seen) > 10  # ratios before, with and after a NaN


# -- the step scalars -------------------------------------------------------------------

def test_the_running_minimum_of_the_loss_skips_a_non_finite_loss_and_a_step_without_one_keeps_the_last():
    last = LastStep()
    for loss in (2.0, 1.0, math.nan):
        last.observe_loss({S.SCALAR_LOSS: loss})
    assert math.isnan(last.loss) and last.loss_running_min == 1.0
    assert last.observe_loss({}) is None
    assert last.step_loss is None and math.isnan(last.loss)


def _ratios_through(rates, settle: int = 10):
    """Each step's (group, rate over its settled peak) pairs after that step's rates."""
    peaks = LearningRatePeaks(settle)
    out = []
    for step_rates in rates:
        peaks.step(step_rates)
        out.append(dict(peaks.ratios()))
    return out


def test_a_learning_rate_has_no_peak_through_a_warm_up_and_reads_one_once_it_holds():
    warm = [(float(i + 1),) for i in range(30)]  # a new high at every step
    held = [(30.0,)] * 12
    seen = _ratios_through(warm + held)
    assert all(r == {} for r in seen[:39])  # 30 rising steps, then 10 steps without a new high
    assert seen[39] == seen[41] == {0: 1.0}


def test_a_decay_and_a_restart_back_to_the_same_peak_stay_at_or_below_one():
    cosine = [(math.cos(i / 40 * math.pi / 2) + 0.01,) for i in range(40)]
    seen = _ratios_through([(1.01,)] * 11 + cosine + [(1.01,)] * 20 + cosine)
    assert all(r.get(0, 0.0) <= 1.0 for r in seen) and seen[-1]


def test_a_rise_past_the_settled_peak_reads_above_one_until_the_new_rate_holds():
    ramp = [(1.0 + 0.5 * i,) for i in range(1, 7)]  # 1.5x ... 4x the settled 1.0
    seen = _ratios_through([(1.0,)] * 11 + ramp + [(4.0,)] * 12)
    assert seen[10] == {0: 1.0}
    assert [seen[11 + i][0] for i in range(6)] == [r for (r,) in ramp]
    assert seen[17 + 8][0] == 4.0  # 9 steps without a new high: not settled yet
    assert seen[17 + 9][0] == 1.0  # 10: the new peak


def test_each_group_has_its_own_peak_and_a_nan_or_zero_rate_is_left_out():
    seen = _ratios_through([(1.0, 0.0)] * 11 + [(math.nan, 0.0), (2.0, 0.0)])
    assert seen[10] == {0: 1.0}  # group 1, at 0 all along, has none
    assert seen[11] == {0: 1.0}  # the NaN left the last rate and the count as they were
    assert seen[12] == {0: 2.0}


# -- the snapshot's per-layer parts -------------------------------------------------------

def test_per_layer_series_carry_each_layers_gauges_counters_and_the_ranks_sum():
    f = Folded(S.GRAD, 2, {"norm_baseline": 8}, slots=(0, 1))
    f.update_gauges({0: f.combine(None, (3.0, 0.0, 0.0), 1), 1: f.combine(None, (4.0, 0.0, 0.0), 1)})
    cells = {"grad": [[1, 0], [2, 3]]}
    parts = per_layer([f], cells, ("a", "b"), WorstNames())
    norms = next(series for series in parts.gauges if series.spec is M.GRAD_NORM)
    assert norms.values == (("a", 3.0), ("b", 4.0))
    assert parts.counters[0].values == (("a", "nan", 1), ("a", "inf", 0), ("b", "nan", 2), ("b", "inf", 3))
    assert [(r.kind, r.count) for r in parts.rank_nonfinite] == [("nan", 3), ("inf", 3)]


# -- the old flat names -------------------------------------------------------------------

def test_the_flat_module_names_are_the_aggregate_modules_themselves():
    import gradmon.aggregate
    import gradmon.aggregate.divergence
    import gradmon.aggregate.history
    import gradmon.aggregate.spikes
    import gradmon.divergence
    import gradmon.history
    import gradmon.snapshot
    import gradmon.spikes

    assert gradmon.snapshot is gradmon.aggregate
    assert gradmon.spikes is gradmon.aggregate.spikes
    assert gradmon.divergence is gradmon.aggregate.divergence
    assert gradmon.history is gradmon.aggregate.history
    assert {"Aggregator", "CarriedCounters", "Coverage", "NonFiniteIncident", "Publisher", "Snapshot"} <= set(
        vars(gradmon.snapshot))
