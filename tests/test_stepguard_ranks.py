"""The step guard across ranks (issue 29): DDP, ranks stepping alone, FSDP1, FSDP2 and HSDP,
four real processes on gloo, one launch (tests/guard_worker.py). A bad step is skipped by
every rank, its parameters (or shards) and optimizer state left bit for bit, the replicas
still identical, later steps applied and finite; also when only some ranks see the NaN."""

from __future__ import annotations

import json
import math

import pytest
import torch.multiprocessing as mp

import guard_worker as worker
from gradmon import metrics as M
from servers import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    work = tmp_path_factory.mktemp("guard-ranks")
    mp.start_processes(worker.run, args=(str(work), free_port()), nprocs=worker.WORLD, join=True, start_method="spawn")
    return [json.loads((work / f"guard.{rank}.json").read_text()) for rank in range(worker.WORLD)]


@pytest.mark.parametrize("run", worker.RUNS)
def test_every_rank_skips_the_step_a_nan_in_one_ranks_batch_spoils(ranks, run):
    bad_steps = 1 if run in worker.REPLICATED else 2  # the sharded runs' poisoned step too
    for rank, results in enumerate(ranks):
        out = results[run]
        assert out["unchanged"][str(worker.NAN_STEP)], (run, rank)  # parameters and optimizer state, bit for bit
        assert out["skipped"] == {M.GUARD_NONFINITE: bad_steps} and out["errors"] == 0, (run, rank, out["skipped"])
        assert all(math.isfinite(x) for p in out["params"] for x in _flat(p)), (run, rank)  # later steps finite


@pytest.mark.parametrize("run", worker.SHARDED)
def test_ranks_whose_shards_hold_no_nan_skip_too(ranks, run):
    """Only the shards of one unit's gradient hold the NaN: the other ranks skip because the
    guard's all-reduce told them, not because they saw it."""
    poisoned = [results[run]["poisoned"] for results in ranks]
    assert any(poisoned) and not all(poisoned), poisoned  # the case the agreement is for
    for rank, results in enumerate(ranks):
        assert results[run]["unchanged"][str(worker.POISON_STEP)], (run, rank, poisoned)


@pytest.mark.parametrize("kept", ["params", "state"])
def test_the_replicas_stay_identical_after_the_skips(ranks, kept):
    """Parameters and optimizer state: every DDP rank's alike; HSDP's (replicate, shard) mesh
    [[0, 1], [2, 3]]: ranks 0 and 2 hold the same shard, 1 and 3 the other."""
    ddp = [results["ddp"][kept] for results in ranks]
    assert all(held == ddp[0] for held in ddp)
    hsdp = [results["hsdp"][kept] for results in ranks]
    assert hsdp[0] == hsdp[2] and hsdp[1] == hsdp[3] and hsdp[0] != hsdp[1]
    local = [results["local"][kept] for results in ranks]
    assert local[0] != local[1]  # ranks stepping alone on their own batches do differ: the check can fail


def _flat(x):
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]
