"""The publisher's fold of a step's records all at once (``Folded.accumulate`` and
``Aggregator._accumulate_table``, issue 26) gives what folding them record by record gives,
bit for bit: the same sums in the same order, extremes with NaN kept, the same counts and
the same origin flags."""

from __future__ import annotations

import math
import random
from typing import Dict, List, Sequence

import pytest
import torch

from gradmon import statistics as S
from gradmon.aggregate.aggregator import Aggregator
from gradmon.aggregate import fold as fold_unit
from gradmon.aggregate.fold import Folded


def _table(rng: random.Random, n: int, width: int, special: float) -> torch.Tensor:
    rows = []
    for _ in range(n):
        row = []
        for _ in range(width):
            x = rng.gauss(0.0, 1.0) * math.exp(rng.uniform(-20, 20))
            if rng.random() < special:
                x = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0])
            row.append(x)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def _by_record(f: Folded, keys: Sequence[int], numels: Sequence[int], rows: List[List[float]]) -> Dict[int, list]:
    acc: Dict[int, list] = {}
    for key, numel, row in zip(keys, numels, rows):
        layer = key if f.slots is None else f.slots[key]
        acc[layer] = f.combine(acc.get(layer), row, numel)
    return acc


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)) or a == b == 0


@pytest.mark.parametrize("stat", [S.GRAD, S.BLOCK_FINITE, S.ACTIVATION, S.GRAD_FLOW, S.UPDATE_RATIO],
                         ids=lambda st: st.name)
@pytest.mark.parametrize("records", ["one per layer", "several per layer, shuffled"])
def test_a_step_folded_at_once_equals_its_records_folded_one_by_one(stat, records):
    rng = random.Random(hash((stat.name, records)) & 0xFFFF)
    layers = 40
    if records == "one per layer":
        slots, keys = tuple(range(layers)), list(range(layers))
        rng.shuffle(keys)
    else:
        slots = tuple(rng.randrange(layers) for _ in range(300))  # many keys (parameters) per layer
        keys = list(range(300)) * 2
        rng.shuffle(keys)
    f = Folded(stat, layers, {g.baseline: 8 for g in stat.gauges if g.baseline}, slots)
    assert f.at_once
    for special in (0.0, 0.05):
        table = _table(rng, len(keys), len(stat.columns), special)
        numels = [rng.randrange(1, 10 ** 6) for _ in keys]
        want = _by_record(f, keys, numels, table.tolist())
        got = f.accumulate(f.plan(tuple(keys)), numels, table)
        assert list(got) == list(want)  # the layers in the same order: the total sums them in it
        for layer in want:
            assert len(got[layer]) == len(want[layer])
            assert all(_same(a, b) for a, b in zip(got[layer], want[layer])), (layer, got[layer], want[layer])
            assert type(got[layer][-1]) is int and got[layer][-1] == want[layer][-1]


def test_a_small_section_is_folded_record_by_record_and_a_large_one_at_once():
    f = Folded(S.GRAD, 4, {"norm_baseline": 8}, (0, 1, 2, 3))
    assert not f.folds_at_once(fold_unit.AT_ONCE_MIN - 1)
    assert f.folds_at_once(fold_unit.AT_ONCE_MIN)
    assert not Folded(S.ACTIVATION_KURTOSIS, 4, {}, (0, 1, 2, 3)).folds_at_once(10 ** 6)  # MOMENTS: in order


def test_counts_and_origin_flags_of_a_step_folded_at_once_equal_a_fold_record_by_record(monkeypatch):
    monkeypatch.setattr(fold_unit, "AT_ONCE_MIN", 0)  # this step's few records folded at once too
    names = [f"l{i}" for i in range(6)]
    blocks = ["input", *names, "output"]

    def fold(at_once: bool):
        agg = Aggregator(names, param_layer=(0, 0, 1, 2, 3, 4, 5), statistics=(S.GRAD, S.BLOCK_FINITE),
                         model="m", block_names=blocks)
        agg.origins.start_step()
        grads = torch.tensor([[1.0, 0, 0], [2.0, 3, 0], [4.0, 0, 0], [math.nan, 1, 2],
                              [5.0, 0, 0], [6.0, 0, 7], [1.5, 0, 0]], dtype=torch.float64)
        ends = torch.tensor([[-1.0, 1.0], [-2.0, math.inf], [math.nan, math.nan], [-math.inf, 3.0],
                             [0.0, 0.0], [-1.0, 2.0], [1.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
        bad = False
        for f, keys, table in ((agg.folded["grad"], tuple(range(7)), grads),
                               (agg.folded["block_finite"], tuple(range(8)), ends)):
            section = S.Section(f.stat, keys, (10,) * len(keys))
            f.at_once = at_once
            bad |= agg._fold(f, section, table, sampled=True)
        agg.origins.end_step(bad, 1)
        return (bad, agg.counts.cells["grad"], agg.origins._flags, agg.origins._step_origin,
                agg.folded["grad"].total, agg.folded["grad"].gauges)

    at_once, by_record = fold(True), fold(False)
    assert at_once[0] is True
    assert repr(at_once) == repr(by_record)


@pytest.mark.parametrize("stat", [st for st in S.STATISTICS if any(isinstance(g.value, S.ColumnValue) for g in st.gauges)],
                         ids=lambda st: st.name)
def test_a_gauge_of_one_column_reads_what_the_mapping_of_the_columns_gives(stat):
    """The fold reads a ``ColumnValue`` gauge straight from the accumulators: the same values,
    NaN, infinities and zeros included, as the gauge's function of each layer's columns."""
    rng = random.Random(7)
    f = Folded(stat, 30, {g.baseline: 8 for g in stat.gauges if g.baseline}, None)
    acc = {layer: f.combine(None, row, rng.randrange(1, 100))
           for layer, row in enumerate(_table(rng, 30, len(stat.columns), 0.3).tolist())}
    f.update_gauges(acc)
    for gauge in stat.gauges:
        if isinstance(gauge.value, S.ColumnValue):
            want = [gauge.value(f.columns(a)) for a in acc.values()]
            got = f._column(acc, f.names.index(gauge.value.column))
            assert all(_same(w, g) for w, g in zip(want, got)), gauge.spec.name
            if gauge.baseline is None and not gauge.since_first:
                assert all(_same(w, f.gauges[gauge][layer]) for layer, w in zip(acc, want)), gauge.spec.name
