"""Without sample ids, an incident bundle names a row by the hashes of the root forward's
inputs, made on the device: the same hash the reference code in docs/incidents.md gives."""

from __future__ import annotations

from typing import List

import pytest
import torch

from gradmon.capture import records, rowhash
from gradmon.incidents import bundle as B

import incident_worker as W
from incident_worker import documented_row_hash

def hex_of(hashes: torch.Tensor) -> List[str]:
    return [format(v & 0xFFFFFFFFFFFFFFFF, "016x") for v in hashes.tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.int64, torch.int32,
                                   torch.uint8, torch.int8, torch.bool])
def test_the_device_hash_is_the_documented_one_for_each_dtype(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3, 7, generator=g) * 50).to(dtype)
    assert hex_of(rowhash.row_hash(x)) == documented_row_hash()(x.numpy())


def test_a_long_row_is_hashed_on_its_runs_as_documented():
    x = torch.randn(3, 3, 64, 65, generator=torch.Generator().manual_seed(4))  # 12,480 elements: runs 195 apart
    assert hex_of(rowhash.row_hash(x)) == documented_row_hash()(x.numpy())
    y = x.clone()
    y[1].view(-1)[195 * 7 + 3] += 1  # inside the 8th run
    assert (rowhash.row_hash(y) != rowhash.row_hash(x)).tolist() == [False, True, False]


def test_a_row_hashes_alike_whatever_its_strides_neighbours_or_integer_width():
    ids = torch.randint(0, 50_000, (4, 9), generator=torch.Generator().manual_seed(1))
    h = rowhash.row_hash(ids)
    assert torch.equal(rowhash.row_hash(ids.to(torch.int32)), h)
    assert torch.equal(rowhash.row_hash(ids.t().contiguous().t()), h)  # column-major storage
    assert torch.equal(rowhash.row_hash(ids[2:3]), h[2:3])
    changed = ids.clone()
    changed[1, 4] += 1
    assert (rowhash.row_hash(changed) != h).tolist() == [False, True, False, False]
    swapped = ids.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]  # the same values in another order
    assert rowhash.row_hash(swapped)[0] != h[0] or ids[0, 0] == ids[0, 1]


def test_the_root_inputs_are_named_by_argument_keyword_and_field():
    x, mask, ids = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.arange(6).reshape(2, 3)
    named = [name for name, _ in rowhash.hash_rows((x, {"input_ids": ids}), {"attention_mask": mask, "n": 3}, 2)]
    assert named == ["args[0]", "args[1].input_ids", "attention_mask"]
    assert rowhash.hash_rows((torch.zeros(5, 3),), {}, 2) == []  # not the batch's first dimension


@pytest.fixture(scope="module")
def without_ids(tmp_path_factory):
    """One run whose batch brings a NaN in row 5 at step 40 and gives no ids."""
    import gradmon
    out = tmp_path_factory.mktemp("rowhash")
    model = W.TinyTransformer()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, announce=False,
                         incident_dir=str(out))
    try:
        W.train(mon, model, W.STEP + 1, W.poison_input, ids=False)
        assert mon.flush()
    finally:
        mon.detach()
    (path,) = out.glob("*.npz")
    return path


def test_without_ids_the_bundle_names_each_row_by_the_documented_hash_of_its_input(without_ids):
    batch = B.load(str(without_ids)).meta["batch"]
    assert not batch["known"] and batch["hash"] == "gradmon.rowhash.1"
    # the user's side: the step's batch as their loader made it, hashed with the documented code
    assert batch["hashes"] == {"args[0]": documented_row_hash()(W.batch(W.STEP, poison=W.poison_input).numpy())}


def test_gradmon_incident_names_the_nan_row_by_its_hash(without_ids, tmp_path):
    expected = documented_row_hash()(W.batch(W.STEP, poison=W.poison_input).numpy())[W.ROW]
    assert f"rows: {W.ROW} (hash args[0] {expected}) at input" in W.summary(str(without_ids), tmp_path)


def test_once_the_job_gives_ids_no_row_is_hashed(attach, monkeypatch, tmp_path):
    calls = []
    real = rowhash.hash_rows
    monkeypatch.setattr(records.rowhash, "hash_rows", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer()
    mon = attach(model)
    W.train(mon, model, 3, None, ids=False)
    hashed_without = len(calls)
    W.train(mon, model, 3, None)  # observe(batch=ids) from its first step on
    assert hashed_without == 3 and len(calls) == 4  # the first forward ran before its ids were given
