"""One declaration per statistic: a statistic declared only here, in the table, is
recorded by the hooks, laid out in the packet, folded, exported and budgeted, with no
other change. And every gradmon_* name that a rule, a dashboard or a deploy file uses
exists."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import needs_cuda, op_names, scrape, value
from gradmon import alerting
from gradmon import metrics as M
from gradmon import statistics as S

ROOT = Path(__file__).resolve().parents[1]

OUTPUT_SUM = M.MetricSpec("gradmon_test_output_sum", "gauge", ("layer",), "Sum of the layer's output (test).")
OUTPUT_PEAK = M.MetricSpec("gradmon_test_output_peak", "gauge", ("layer",), "Max |x| of the output (test).")
GRAD_PEAK = M.MetricSpec("gradmon_test_grad_peak", "gauge", ("layer",), "Max |g| of the parameters (test).")
GRAD_ELEMENTS = M.MetricSpec("gradmon_test_grad_elements", "gauge", ("layer",), "Gradient elements (test).")


def _output_record(t: torch.Tensor):
    t = t.detach().double()
    return (torch.stack((t.sum(), t.abs().amax())),)


def _grad_rows(grads, home):
    return torch.stack([g.detach().abs().amax().double() for g in grads]).unsqueeze(1).to(home), tuple(range(len(grads)))


OUTPUT_STAT = S.Statistic(
    "test_output", None, S.OUTPUT, ((S.Column("sum", S.SUM), S.Column("peak", S.ABSMAX)),), _output_record,
    gauges=(S.LayerGauge(OUTPUT_SUM, lambda c: c["sum"]), S.LayerGauge(OUTPUT_PEAK, lambda c: c["peak"])),
    detail=True)
GRAD_STAT = S.Statistic(
    "test_grad", None, S.PARAM_GRAD, ((S.Column("peak", S.ABSMAX),),), _grad_rows,
    gauges=(S.LayerGauge(GRAD_PEAK, lambda c: c["peak"]), S.LayerGauge(GRAD_ELEMENTS, lambda c: c["numel"])),
    reduced=True)

WEIGHT_PEAK = M.MetricSpec("gradmon_test_weight_peak", "gauge", ("layer",), "Max |w| of the parameters (test).")
WEIGHT_STAT = S.Statistic(
    "test_weight", "optimizer_every", S.WEIGHT, ((S.Column("peak", S.ABSMAX),),), _grad_rows,
    gauges=(S.LayerGauge(WEIGHT_PEAK, lambda c: c["peak"]),), reduced=True)


def _cfg():
    from gradmon.config import Config
    return Config()


@pytest.fixture
def with_test_statistics(monkeypatch):
    monkeypatch.setattr(S, "STATISTICS", S.STATISTICS + (OUTPUT_STAT, GRAD_STAT, WEIGHT_STAT))


def test_a_statistic_declared_once_is_recorded_folded_and_exported(attach, with_test_statistics):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    mon = attach(model, detail_every=1)
    x = torch.randn(5, 4)
    outputs = {}
    model[0].register_forward_hook(lambda m, i, o: outputs.__setitem__("0", o.detach()))
    model[2].register_forward_hook(lambda m, i, o: outputs.__setitem__("2", o.detach()))
    model(x).square().sum().backward()
    grads = {name: [p.grad.clone() for p in model[int(name)].parameters()] for name in ("0", "2")}
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    s = scrape(mon.url)
    for layer in ("0", "2"):
        out = outputs[layer].double()
        assert math.isclose(value(s, "gradmon_test_output_sum", layer=layer), out.sum().item(), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(value(s, "gradmon_test_output_peak", layer=layer), out.abs().max().item(), rel_tol=1e-9)
        peak = max(g.abs().max().item() for g in grads[layer])
        assert math.isclose(value(s, "gradmon_test_grad_peak", layer=layer), peak, rel_tol=1e-6)
        assert value(s, "gradmon_test_grad_elements", layer=layer) == sum(g.numel() for g in grads[layer])
    # the statistics already there are unchanged beside it
    total = math.sqrt(sum(g.square().sum().item() for gs in grads.values() for g in gs))
    assert math.isclose(value(s, "gradmon_grad_global_norm"), total, rel_tol=1e-6)


def test_a_statistic_of_the_weights_is_read_after_the_step_on_the_optimizer_read_steps(attach, with_test_statistics):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    mon = attach(model, optimizer_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        mon.flush()
        peak = max(p.detach().abs().max().item() for p in model[2].parameters())
        seen.append((value(scrape(mon.url), "gradmon_test_weight_peak", layer="2"), peak))
    (first, after_first), (second, after_second), (third, after_third) = seen
    assert first == pytest.approx(after_first, rel=1e-6)  # the weights after the step
    assert second == first and after_second != after_first  # step 1 is not a read step
    assert third == pytest.approx(after_third, rel=1e-6)


def test_grouped_layers_fold_a_declared_statistic_by_its_columns(attach, with_test_statistics):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    per_layer = S.series_per_layer(S.enabled(_cfg(), local_view=False))
    mon = attach(model, detail_every=1, series_budget=2 * per_layer)  # 3 layers -> 2 groups: "0", "1"
    outputs = []
    for m in (model[0][0], model[0][1]):
        m.register_forward_hook(lambda mod, i, o: outputs.append(o.detach().double()))
    model(torch.randn(3, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    mon.flush()
    s = scrape(mon.url)
    assert mon.layers == ("0.0", "0.1", "1") and value(s, "gradmon_grouped_layers") == 1
    assert math.isclose(value(s, "gradmon_test_output_sum", layer="0"), sum(o.sum().item() for o in outputs),
                        rel_tol=1e-9, abs_tol=1e-12)  # SUM adds
    assert math.isclose(value(s, "gradmon_test_output_peak", layer="0"),
                        max(o.abs().max().item() for o in outputs), rel_tol=1e-9)  # ABSMAX takes the largest


def test_the_series_budget_counts_what_one_layer_exports(attach, with_test_statistics):
    """The budget's cost of a layer, added up from the declarations, is the number of series
    a layer really exports with every statistic on and every baseline filled: a gauge or
    counter pair left out of the sum (or counted but never exported) fails here."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mon = attach(model, detail_every=1, optimizer_every=1, baseline_warmup=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(S.MIN_BASELINE):  # the baseline ratios exist from their 8th value
        model(torch.randn(16, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    # rank-level gauges labelled with the layer that holds the worst value are not per-layer series,
    # nor are the gauges of a few layers in a role (the attention projections, the output layer)
    rank_level = {g.worst.name for st in S.STATISTICS for g in st.gauges if g.worst is not None}
    rank_level |= {g.spec.name for st in S.STATISTICS for g in st.gauges if g.role is not None}
    enabled = S.enabled(_cfg(), local_view=False, fp16_headroom=False)
    assert OUTPUT_STAT in enabled and GRAD_STAT in enabled
    for layer in ("0", "2"):
        series = [name for name, labels in s if ("layer", layer) in labels and name not in rank_level]
        assert len(series) == S.series_per_layer(enabled), sorted(series)


def test_switches_turn_statistics_off():
    from gradmon.config import Config
    names = [s.name for s in S.enabled(Config(activations=False, grad_flow=False, optimizer_every=0),
                                       local_view=True)]
    assert names == ["grad", "local", "block_finite"]


def test_the_packet_reader_walks_the_declared_parts_in_order():
    # activation: parts (norm, lo, hi) and (nan, inf); two records for layers 3 and 1
    values = [10.0, -1.0, 2.0, 20.0, -3.0, 4.0, 0.0, 1.0, 5.0, 0.0]
    (stat, section, rows), = S.read(values, [S.Section(S.ACTIVATION, (3, 1), (7, 8))])
    assert stat is S.ACTIVATION and section.keys == (3, 1)
    assert rows == [[10.0, -1.0, 2.0, 0.0, 1.0], [20.0, -3.0, 4.0, 5.0, 0.0]]


# -- names -----------------------------------------------------------------------------------

def _known_names() -> set:
    exported = {n for spec in M.ALL_SPECS for n in M.exposed_names(spec)}
    recorded = {r["record"] for r in alerting.recording_rules(alerting.Thresholds(), alerting.PRODUCTION)}
    return exported | recorded


def _shipped_files():
    for folder in ("deploy", "dashboards"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".yml", ".yaml", ".json"):
                yield path


def unknown_names(text: str, known: set) -> set:
    """Metric and recording-rule names in ``text`` that gradmon neither exports nor
    records. Label values and free text use the same characters, so a name is a token
    that starts with gradmon_ or is a recording rule (level:metric:operation)."""
    tokens = re.findall(r"(?<![\w:/.-])([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+|gradmon_[a-zA-Z0-9_]+)", text)
    return {t for t in tokens if (t.startswith("gradmon_") or t.count(":") >= 2) and t not in known}


def test_every_gradmon_name_in_rules_dashboards_and_deploy_files_exists():
    known = _known_names()
    unknown = {str(p.relative_to(ROOT)): unknown_names(p.read_text(), known) for p in _shipped_files()}
    assert not {k: v for k, v in unknown.items() if v}, unknown


def test_the_names_check_catches_a_renamed_metric_or_rule():
    known = _known_names()
    rule = ('expr: rate(gradmon_steps_total[1m]) > 0 and model_rank:gradmon_grad_global_norm:post_warmup\n'
            'expr: gradmon_grad_global_norms > 1 or model_rank:gradmon_grad_norm:median')
    assert unknown_names(rule, known) == {"gradmon_grad_global_norms", "model_rank:gradmon_grad_norm:median"}


def test_parameter_gradient_norms_are_exact_for_large_small_and_strided_tensors_in_order():
    from gradmon.capture import kernels as stats

    torch.manual_seed(0)
    grads = [torch.randn(300, 200), torch.randn(7), torch.randn(200, 300).t(), torch.randn(5, 4000).double(),
             torch.randn(64), torch.randn(4096, 8).half()]
    rows, order = stats.param_grad_stats(grads, torch.device("cpu"))
    for row, i in zip(rows, order):
        expected = torch.linalg.vector_norm(grads[i].double())
        assert float(row[0]) == pytest.approx(float(expected), rel=1e-5), i
    assert sorted(order) == list(range(len(grads)))
    grads[0][3, 4] = float("nan")
    rows, order = stats.param_grad_stats(grads, torch.device("cpu"))
    assert [float(r[1]) for r, i in zip(rows, order) if i == 0] == [1.0]


def test_large_cpu_gradients_take_one_root_for_the_group_and_the_same_norms_bit_for_bit():
    """The large float32 gradients of a CPU step: their dot products stacked and rooted in
    one kernel, equal to each one's own ``_l2``; a root per gradient would be back as
    one dispatch per parameter every step."""
    from gradmon.capture import kernels as stats

    torch.manual_seed(0)
    grads = [torch.randn(300, 200) * 10 ** k for k in range(-3, 4)]
    with op_names() as ops:
        norms = stats._norms(grads, torch.float32, small=False)
    assert [n for n in ops.names if n.startswith("sqrt")] == ["sqrt_"]
    assert ops.names.count("dot") == len(grads)
    assert torch.equal(norms, torch.stack([stats._l2(g) for g in grads]))


def test_a_finite_cpu_block_output_is_proved_finite_by_one_dot_and_a_non_finite_one_gets_exact_extremes():
    """The block check on the CPU: a finite float32 output costs one dot product (no
    aminmax) and carries bounds of its values; a NaN, an Inf of either sign, or squares
    that overflow get the exact extremes and, by batch row, which rows hold them;
    bfloat16 is read exactly as before."""
    from gradmon.capture import kernels as stats

    torch.manual_seed(0)
    x = torch.randn(8, 64, 48)
    with op_names() as ops:
        lo, hi, rows = stats.finite_check(x, 8)
    assert "dot" in ops.names and not [n for n in ops.names if n.startswith(("aminmax", "amin", "amax", "min", "max"))]
    norm = float(torch.linalg.vector_norm(x.double()))
    assert float(hi) == pytest.approx(norm, rel=1e-5) and float(lo) == -float(hi)
    assert float(lo) <= float(x.min()) and float(x.max()) <= float(hi)
    assert S.nonfinite_flags(float(lo), float(hi)) == 0 and torch.equal(rows, torch.zeros(8, 2))
    assert [float(v) for v in stats.finite_check(x)] == [float(lo), float(hi)]

    for row, value, flag in ((5, "nan", S.NAN_FLAG), (2, "inf", S.POS_INF_FLAG), (7, "-inf", S.NEG_INF_FLAG)):
        bad = x.clone()
        bad[row, 3, 4] = float(value)
        lo, hi, rows = stats.finite_check(bad, 8)
        assert S.nonfinite_flags(float(lo), float(hi)) == flag, value
        assert [r for r in range(8) if S.nonfinite_flags(float(rows[r, 0]), float(rows[r, 1]))] == [row]

    huge = x * 1e20  # finite, but its squares overflow float32: the exact extremes, not a false alarm
    lo, hi, rows = stats.finite_check(huge, 8)
    assert (float(lo), float(hi)) == (float(huge.min()), float(huge.max()))
    assert S.nonfinite_flags(float(lo), float(hi)) == 0

    low = x.bfloat16()
    with op_names() as ops:
        lo, hi = stats.finite_check(low)
    assert "dot" not in ops.names and (float(lo), float(hi)) == (float(low.min()), float(low.max()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])])
def test_nan_and_inf_counts_of_small_and_large_gradients_are_exact(device):
    """Small gradients are counted together by segment, large ones each (on CUDA with Triton:
    one launch per group, tests/test_counting.py); both exact, on the CPU (where only a
    non-finite norm is counted) and on a device (counted every step)."""
    from gradmon.capture import kernels as stats

    torch.manual_seed(0)
    grads = [torch.randn(n, device=device) for n in (3, 100, 5000, 7, 40000)]
    for i, j, v in ((1, 5, "nan"), (1, 7, "inf"), (3, 0, "-inf"), (3, 1, "nan"), (3, 2, "nan"), (4, 9, "nan"),
                    (4, 10, "inf")):
        grads[i][j] = float(v)
    rows, order = stats.param_grad_stats(grads, torch.device(device))
    got = {i: (float(r[1]), float(r[2])) for r, i in zip(rows.cpu(), order)}
    assert got == {i: (float(torch.isnan(g).sum()), float(torch.isinf(g).sum())) for i, g in enumerate(grads)}
    assert got[3] == (2.0, 1.0) and got[2] == (0.0, 0.0)


def test_padded_rows_match_pad_sequence():
    from gradmon.capture import kernels as stats

    pieces = [torch.randn(n) for n in (5, 1, 9, 9, 3)]
    block = stats.padded_rows(pieces, torch.float64)
    assert block.dtype == torch.float64
    assert torch.equal(block, torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True).double())


def test_a_worst_layer_gauge_keeps_its_name_through_near_ties_and_names_none_when_calm():
    from gradmon.aggregate.snapshot import WorstNames

    names = WorstNames()
    gauge = S.LayerGauge(M.ACTIVATION_ABS_MAX_WORST, lambda c: c["norm"], worst=M.ACTIVATION_ABS_MAX_WORST)
    assert names.pick(gauge, [1.0, 3.0, 2.9]) == (1, 3.0)
    assert names.pick(gauge, [1.0, 3.0, 3.5]) == (1, 3.5)  # b keeps the name; the value is the largest
    assert names.pick(gauge, [1.0, 3.0, 4.0]) == (2, 4.0)  # 4 > 1.25 x 3: c takes the name
    assert names.pick(gauge, [None, float("nan"), None]) is None
    floor = S.LayerGauge(M.LOCAL_GRAD_NORM_RATIO_WORST, lambda c: c["norm"], worst=M.LOCAL_GRAD_NORM_RATIO_WORST,
                         worst_floor=2.0)
    assert names.pick(floor, [1.1, 1.3, None]) == (None, 1.3)  # calm: no layer named
    assert names.pick(floor, [1.1, 5.0, None]) == (1, 5.0)
