"""The step guard under sharding (issue 29): FSDP1, FSDP2 and HSDP, four real processes on
gloo, one launch (tests/fsdp_guard_worker.py). A bad step is skipped by every rank, its
shards and optimizer state left bit for bit, the replicas still identical, later steps
applied and finite; also when only the ranks holding one unit's shard see the NaN."""

from __future__ import annotations

import json
import math

import pytest
import torch.multiprocessing as mp

import fsdp_guard_worker as worker
from gradmon import metrics as M
from servers import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    work = tmp_path_factory.mktemp("guard-sharded")
    mp.start_processes(worker.run, args=(str(work), free_port()), nprocs=worker.WORLD, join=True, start_method="spawn")
    return [json.loads((work / f"sharded.{rank}.json").read_text()) for rank in range(worker.WORLD)]


@pytest.mark.parametrize("run", worker.RUNS)
def test_every_rank_skips_the_step_a_nan_in_one_ranks_batch_spoils(ranks, run):
    for rank, results in enumerate(ranks):
        out = results[run]
        assert out["unchanged"][str(worker.NAN_STEP)], (run, rank)  # its shards and optimizer state, bit for bit
        assert out["skipped"] == {M.GUARD_NONFINITE: 2} and out["errors"] == 0, (run, rank, out["skipped"])
        assert all(math.isfinite(x) for shard in out["shards"] for x in _flat(shard)), (run, rank)


@pytest.mark.parametrize("run", worker.RUNS)
def test_ranks_whose_shards_hold_no_nan_skip_too(ranks, run):
    """Only the shards of one unit's gradient hold the NaN: the other ranks skip because the
    guard's all-reduce told them, not because they saw it."""
    poisoned = [results[run]["poisoned"] for results in ranks]
    assert any(poisoned) and not all(poisoned), poisoned  # the case the agreement is for
    for rank, results in enumerate(ranks):
        assert results[run]["unchanged"][str(worker.POISON_STEP)], (run, rank, poisoned)


def test_hsdp_replicas_stay_identical_after_the_skips(ranks):
    """A (replicate, shard) mesh [[0, 1], [2, 3]]: ranks 0 and 2 hold the same shard, 1 and 3 the other."""
    shards = [results["hsdp"]["shards"] for results in ranks]
    assert shards[0] == shards[2] and shards[1] == shards[3]
    assert shards[0] != shards[1]


def _flat(x):
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]
