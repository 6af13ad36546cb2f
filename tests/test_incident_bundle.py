"""The incident bundle as a file: where and when it is written, what it holds, its
bounds, and a disk that refuses it. Real models and steps on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradmon
from gradmon.incidents import bundle as B
from gradmon.incidents import recorder as R

import incident_worker as W
from conftest import fresh, origins

HERE = Path(__file__).resolve().parent


def run(attach, monkeypatch, tmp_path, scenario="input", steps=W.STEP + 5, model=None, **options):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path / "incidents"))
    model = model or W.TinyTransformer()
    mon = attach(model, **options)
    W.train(mon, model, steps, W.SCENARIOS.get(scenario))
    assert mon.flush()
    return mon, sorted((tmp_path / "incidents").glob("*.npz")) if (tmp_path / "incidents").exists() else []


def test_the_first_nonfinite_step_writes_one_bundle_that_numpy_reads_without_pickle(attach, monkeypatch, tmp_path):
    _, files = run(attach, monkeypatch, tmp_path)
    assert len(files) == 1
    with np.load(files[0], allow_pickle=False) as z:
        meta = json.loads(z[B.JSON_MEMBER])
        assert meta["schema"] == B.SCHEMA and meta["schema_version"] == B.VERSION
        assert meta["incident"]["step"] == W.STEP and meta["incident"]["block"] == "input"
        assert list(z["history.step"])[-1] == W.STEP  # the incident's own step is in the history
        assert np.isnan(z["history.global_norm"][-1]) and np.isfinite(z["history.global_norm"][:-1]).all()
        assert z["history.layer_grad_norm"].shape == (len(z["history.step"]), len(meta["history"]["layers"]))


def test_the_bundle_holds_the_steps_before_the_incident_with_loss_and_learning_rate(attach, monkeypatch, tmp_path):
    _, files = run(attach, monkeypatch, tmp_path)
    meta, arrays = B.load(str(files[0])).meta, B.load(str(files[0])).arrays
    assert arrays["history.step"].tolist() == list(range(1, W.STEP + 1))
    assert torch.isfinite(arrays["history.loss"][:-1]).all() and arrays["history.loss"][-1].isnan()
    assert torch.allclose(arrays["history.lr"], torch.full((W.STEP,), 1e-3))
    assert meta["history"]["statistics"]["grad"]["key_is"] == "parameter"


def test_the_bundle_names_the_run_the_versions_and_the_options_without_secrets(attach, monkeypatch, tmp_path):
    _, files = run(attach, monkeypatch, tmp_path, basic_auth_user="ops", basic_auth_password="s3cret-pw")
    meta = B.load(str(files[0])).meta
    assert meta["run"]["rank"] == 0 and meta["run"]["model"] == "tinytransformer"
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["gradmon"] == gradmon.__version__
    assert meta["options"]["basic_auth_user"] == "ops" and "basic_auth_password" not in meta["options"]
    assert b"s3cret-pw" not in files[0].read_bytes()


def test_the_bundle_carries_the_torch_rng_state(attach, monkeypatch, tmp_path):
    _, files = run(attach, monkeypatch, tmp_path)
    state = B.load(str(files[0])).arrays["rng.torch_cpu"]
    assert state.dtype == torch.uint8 and state.shape == torch.get_rng_state().shape


def test_the_batch_ids_of_the_incident_step_are_in_the_bundle(attach, monkeypatch, tmp_path):
    _, files = run(attach, monkeypatch, tmp_path)
    batch = B.load(str(files[0])).meta["batch"]
    assert batch["known"] and batch["ids"] == W.ids_of(W.STEP)


def test_the_bundle_is_written_by_the_publisher_thread_not_the_training_thread(attach, monkeypatch, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="gradmon"):
        run(attach, monkeypatch, tmp_path)
    (record,) = [r for r in caplog.records if "incident bundle written" in r.getMessage()]
    assert record.threadName.startswith("gradmon-publisher-") and record.threadName != "MainThread"


def test_an_empty_incident_dir_writes_nothing(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", "")
    model = W.TinyTransformer()
    mon = attach(model)
    W.train(mon, model, W.STEP + 1, W.poison_input)
    assert mon.flush() and mon._black_box is None
    assert not any(tmp_path.rglob("*.npz"))


def test_bundles_never_exceed_incident_max_bytes_and_keep_the_newest_steps(attach, monkeypatch, tmp_path):
    bound = 2 ** 16
    _, files = run(attach, monkeypatch, tmp_path, steps=W.STEP + 1, incident_max_bytes=bound)
    assert len(files) == 1 and files[0].stat().st_size <= bound
    meta, arrays = B.load(str(files[0])).meta, B.load(str(files[0])).arrays
    assert 0 < meta["history"]["steps"] < W.STEP and meta["history"]["dropped_steps"] > 0
    assert arrays["history.step"].tolist()[-1] == W.STEP


def test_a_run_writes_at_most_three_bundles_within_its_bound(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer()
    mon = attach(model, incident_max_bytes=2 ** 20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(12):  # a NaN every other step: six incidents
        x = torch.randn(W.BATCH, W.TOKENS, W.WIDTH)
        if step % 2:
            x[0, 0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            torch.nan_to_num_(p.grad, nan=0.0)
        opt.step()
        opt.zero_grad()
    assert mon.flush()
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == R.MAX_INCIDENTS and sum(f.stat().st_size for f in files) <= 2 ** 20


def test_a_directory_that_refuses_the_bundle_is_logged_once_and_training_is_untouched(tmp_path):
    """A read-only incident_dir, for real: the run is another user's (as root), or the
    directory's mode (otherwise)."""
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    tmp_path.chmod(0o755)
    env = {**os.environ, "GRADMON_INCIDENT_DIR": str(target), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(HERE.parent)}
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    # six incidents, three of them bundles it tries to write
    code = ("import sys, torch; sys.path.insert(0, %r); import incident_worker as W, gradmon, json\n"
            "m = W.TinyTransformer(); mon = gradmon.attach(m, port=0, addr='127.0.0.1', final_scrape_timeout=0)\n"
            "opt = torch.optim.SGD(m.parameters(), lr=1e-3)\n"
            "for step in range(12):\n"
            "    x = torch.randn(W.BATCH, W.TOKENS, W.WIDTH)\n"
            "    if step %% 2: x[0, 0, 0] = float('nan')\n"
            "    m(x).pow(2).mean().backward()\n"
            "    [torch.nan_to_num_(p.grad, nan=0.0) for p in m.parameters()]\n"
            "    opt.step(); opt.zero_grad()\n"
            "mon.flush(); s = mon.snapshot()\n"
            "print(json.dumps({'steps': s.steps_total, 'nonfinite': s.nonfinite_steps, 'publish': mon._errors.counts()['publish']}))\n"
            "mon.detach()\n") % str(HERE)
    out = subprocess.run(prefix + [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"steps": 12, "nonfinite": 6, "publish": R.MAX_INCIDENTS}
    refusals = [line for line in out.stderr.splitlines() if "could not write the incident bundle" in line]
    assert len(refusals) == 1 and str(target) in refusals[0]
    assert "Traceback" not in out.stderr and not list(target.iterdir())


def test_incident_max_bytes_out_of_range_is_a_value_error_naming_the_option(attach):
    with pytest.raises(ValueError, match="incident_max_bytes"):
        attach(W.TinyTransformer(), incident_max_bytes=1000)


def test_GRADMON_INCIDENT_MAX_BYTES_sets_the_bound(attach, monkeypatch):
    monkeypatch.setenv("GRADMON_INCIDENT_MAX_BYTES", "131072")
    assert attach(W.TinyTransformer()).config.incident_max_bytes == 131072


@pytest.mark.parametrize("ids", [torch.randn(8), "abc", [1.5, 2.0], torch.zeros(2, 4, dtype=torch.long), 7])
def test_observe_batch_with_something_other_than_ids_is_a_type_error(attach, ids):
    mon = attach(W.TinyTransformer())
    with pytest.raises(TypeError, match=r"observe\(batch="):
        mon.observe(batch=ids)


@pytest.mark.parametrize("ids, kept", [((3, 4), [3, 4]), (np.array([7, 8]), [7, 8]), (["a", np.int64(2)], ["a", 2]),
                                       (range(2), [0, 1])])
def test_observe_batch_takes_ints_and_strings_from_lists_tuples_ranges_and_numpy(ids, kept):
    assert list(R.check_batch_ids(ids)) == kept


def test_observe_batch_takes_an_integer_tensor_copied_on_its_device(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer()
    mon = attach(model)
    ids = torch.arange(100, 100 + W.BATCH)
    x = torch.randn(W.BATCH, W.TOKENS, W.WIDTH)
    x[1, 0, 0] = float("nan")
    model(x).sum().backward()
    mon.observe(batch=ids)
    ids.zero_()  # the caller reuses its buffer: the copy keeps the step's ids
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    assert mon.flush()
    (path,) = tmp_path.glob("*.npz")
    assert B.load(str(path)).meta["batch"]["ids"] == list(range(100, 100 + W.BATCH))


def test_a_relative_incident_dir_is_where_the_job_was_when_it_attached(attach, monkeypatch, tmp_path):
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", "incidents")
    model = W.TinyTransformer()
    mon = attach(model)
    monkeypatch.chdir(tmp_path / "later")
    W.train(mon, model, W.STEP, W.poison_input)
    assert mon.flush()
    assert len(list((tmp_path / "incidents").glob("*.npz"))) == 1 and not list((tmp_path / "later").rglob("*.npz"))


def test_each_layers_gradient_norm_in_the_history_is_the_norm_torch_computes(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer()
    mon = attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    expected = []
    for step in range(6):
        x = torch.randn(W.BATCH, W.TOKENS, W.WIDTH)
        if step == 5:
            x[0, 0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        expected.append({name: math.sqrt(sum(float(p.grad.double().pow(2).sum())
                                             for p in model.get_submodule(name).parameters(recurse=False)))
                         for name in mon.layers})
        opt.step()
        opt.zero_grad()
    assert mon.flush()
    (path,) = tmp_path.glob("*.npz")
    b = B.load(str(path))
    heat, layers = b.arrays["history.layer_grad_norm"], b.meta["history"]["layers"]
    for i, want in enumerate(expected[:5]):
        for j, name in enumerate(layers):
            assert heat[i, j].item() == pytest.approx(want[name], rel=1e-5), (i, name)
        assert b.arrays["history.global_norm"][i].item() == pytest.approx(
            math.sqrt(sum(v * v for v in want.values())), rel=1e-5)
    assert heat[5].isnan().any()


def test_a_model_attached_again_never_writes_over_the_earlier_runs_bundle(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer()
    for _ in range(2):  # the same steps, the same NaN, twice in one process
        mon = attach(model)
        W.train(mon, model, W.STEP, W.poison_input)
        assert mon.flush()
        mon.detach()
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_the_block_check_by_batch_rows_gives_each_outputs_extremes_and_its_rows_in_one_call():
    from gradmon.capture import kernels as stats
    torch.manual_seed(0)
    small, other, large = torch.randn(4, 3, 5), torch.randn(3, 2), torch.randn(4, 2 ** 15)
    small[2, 1, 1], large[3, 7] = float("nan"), float("-inf")
    rows: list = []
    lo, hi, order = stats.extremes_many([small, other, large], torch.device("cpu"), 4, rows)
    want = [torch.aminmax(t) for t in (small, other, large)]
    got = {i: (lo[j, 0].item(), hi[j, 0].item()) for j, i in enumerate(order)}
    for i, (w_lo, w_hi) in enumerate(want):
        assert np.allclose(got[i], (w_lo.item(), w_hi.item()), equal_nan=True), (i, got[i])
    flagged = {i: (~torch.isfinite(block[start:start + 4])).any(dim=1).nonzero().reshape(-1).tolist()
               for indices, block, starts in rows for i, start in zip(indices, starts)}
    assert flagged == {0: [2], 2: [3]}  # `other` has 3 rows, not the batch's 4: no rows
    assert len(rows) == 2  # one entry for the small outputs' shared block, one for the large output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [4, None])
def test_outputs_of_one_shape_are_checked_by_one_stack_as_the_flat_copy_checks_them(monkeypatch, dtype, batch):
    """Blocks of a residual stream share one shape: stacked, with no per-tensor view in
    the copy; the extremes, rows and layout are the flat copy's (the reference here)."""
    from gradmon.capture import kernels as stats
    torch.manual_seed(0)
    outs = [torch.randn(4, 3, 5).to(dtype) for _ in range(6)]
    outs[1][2, 0, 3], outs[3][0, 2, 2], outs[5][3, 1, 0] = float("nan"), float("inf"), float("-inf")
    rows: list = []
    flats = []
    real_flat = stats._flat
    monkeypatch.setattr(stats, "_flat", lambda group: flats.append(len(group)) or real_flat(group))
    lo, hi, order = stats.extremes_many(outs, torch.device("cpu"), batch, rows)
    assert flats == [] and order == tuple(range(6))
    ref_rows: list = []
    # the flat copy, as for outputs of several shapes (which do not stack)
    ref_lo, ref_hi, ref_order = stats.extremes_many(outs, torch.device("cpu"), batch, ref_rows, stacked=False)
    assert flats == [6] and ref_order == order
    assert torch.equal(lo.isnan(), ref_lo.isnan()) and torch.equal(lo.nan_to_num(), ref_lo.nan_to_num())
    assert torch.equal(hi.isnan(), ref_hi.isnan()) and torch.equal(hi.nan_to_num(), ref_hi.nan_to_num())
    assert [(ix, st) for ix, _, st in rows] == [(ix, st) for ix, _, st in ref_rows]
    for (_, block, _), (_, ref, _) in zip(rows, ref_rows):
        assert torch.equal(block.nan_to_num(), ref.nan_to_num()) and torch.equal(block.isnan(), ref.isnan())
    assert len(rows) == (1 if batch else 0)
    for j, (w_lo, w_hi) in enumerate(torch.aminmax(t.float()) for t in outs):
        assert np.allclose((lo[j, 0].item(), hi[j, 0].item()), (w_lo.item(), w_hi.item()), equal_nan=True)


@pytest.mark.parametrize("batch", [4, None])
def test_outputs_of_several_shapes_are_checked_by_one_stack_per_shape_as_the_flat_copy_checks_them(monkeypatch, batch):
    """A transformer's top-level outputs (embeddings, blocks, head) have a few shapes: stacked
    by shape, the extremes, rows and order are the flat copy's (the reference here), and a
    layout kept from the forward before that no longer fits is made anew."""
    from gradmon.capture import kernels as stats
    torch.manual_seed(0)
    outs = [torch.randn(4, 3, 5) for _ in range(5)] + [torch.randn(3, 5), torch.randn(4, 3, 7)]
    outs.insert(2, outs.pop())  # the shapes interleaved: positions, not runs, make the stacks
    outs[1][2, 0, 3], outs[2][0, 2, 6], outs[5][3, 1, 0], outs[6][1, 1] = (
        float("nan"), float("inf"), float("-inf"), float("nan"))
    flats = []
    real_flat = stats._flat
    monkeypatch.setattr(stats, "_flat", lambda group: flats.append(len(group)) or real_flat(group))
    assert stats.stack_alike(outs) is None
    for last in (None, ((0, 1), (2, 3, 4, 5, 6, 7)), ((0, 1, 3, 4, 5), (2,), (6,))):
        stacked = stats.stack_by_shape(outs, last)
        assert stacked is not None and sorted(map(sorted, stacked.positions)) == [[0, 1, 3, 4, 5], [2], [6]]
        rows: list = []
        lo, hi, order = stats.extremes_many(outs, torch.device("cpu"), batch, rows, stacked)
        assert flats == [] and sorted(order) == list(range(len(outs)))
        ref_rows: list = []
        ref_lo, ref_hi, ref_order = stats.extremes_many(outs, torch.device("cpu"), batch, ref_rows, stacked=False)
        flats.clear()
        by_tensor = {i: (lo[j, 0].item(), hi[j, 0].item()) for j, i in enumerate(order)}
        ref = {i: (ref_lo[j, 0].item(), ref_hi[j, 0].item()) for j, i in enumerate(ref_order)}
        assert by_tensor.keys() == ref.keys()
        for i in ref:
            assert np.allclose(by_tensor[i], ref[i], equal_nan=True), i
        row_of = {i: block[st:st + 4] for ix, block, sts in rows for i, st in zip(ix, sts)}
        ref_row_of = {i: block[st:st + 4] for ix, block, sts in ref_rows for i, st in zip(ix, sts)}
        assert row_of.keys() == ref_row_of.keys() == ({0, 1, 2, 3, 4, 5} if batch else set())
        for i in ref_row_of:
            assert torch.equal(row_of[i].isnan(), ref_row_of[i].isnan())
            assert torch.equal(row_of[i].nan_to_num(), ref_row_of[i].nan_to_num())


def test_a_forward_whose_blocks_return_several_shapes_checks_them_by_stacks_from_the_second_forward_on(attach, monkeypatch):
    """The stacks' layout is learnt once: later forwards stack by it directly, with neither
    the flat copy nor a stack of all the outputs tried first."""
    from gradmon.capture import kernels as stats

    class Widen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), Widen(),
                                torch.nn.Linear(12, 8), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1000)
    calls = {"stacks": 0, "alike": 0}
    real_stacks, real_alike = stats._extremes_of_stacks, stats.stack_alike

    def alike(tensors, least=2):
        calls["alike"] += least == 2  # a stack of all the outputs tried
        return real_alike(tensors, least)

    def stacks(*args):
        calls["stacks"] += 1
        return real_stacks(*args)
    monkeypatch.setattr(stats, "_extremes_of_stacks", stacks)
    monkeypatch.setattr(stats, "stack_alike", alike)
    for step in range(7):
        if step == 3:
            calls.update(stacks=0, alike=0)
        if step == 5:
            with torch.no_grad():
                model[4].weight[0, 0] = float("nan")
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert calls == {"stacks": 4, "alike": 0}  # steps 3 to 6, one forward each
    found = origins(fresh(mon))
    assert found["block"][0] == "4", found


def test_a_forward_of_a_thousand_small_blocks_keeps_one_row_block_not_one_per_block(attach, tmp_path, monkeypatch):
    """The rows an incident may need are kept for a few steps: one Python object per block
    would be thousands of them, promoted by the collector and walked by its full passes."""
    from gradmon.capture.packet import RowBlock
    from gradmon.capture.records import BatchRows

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(1000)))
    x = torch.randn(4, 8)
    mon = attach(model, incident_dir=str(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):  # past the first (detail) step, and every block seen to wait for the end of the forward
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    taken = []
    take = BatchRows.take
    monkeypatch.setattr(BatchRows, "take", lambda self: taken.append(take(self)) or taken[-1])
    x[2, 3] = float("nan")  # every block's row 2 is NaN from the input on
    model(x).square().mean().backward()
    opt.step()
    kept = next(k for k, _ in taken if k)  # the step's (a reset takes nothing more)
    assert all(isinstance(r, RowBlock) for r in kept) and len(kept) <= 3, len(kept)
    assert {k for r in kept for k in r.keys} == set(range(1001))  # the input, 1,000 blocks (the root returns the last's)
    for key in (0, 1, 500, 1000):
        (values,) = [v for r in kept for v in r.of(key)]
        assert (~torch.isfinite(values)).any(dim=1).nonzero().reshape(-1).tolist() == [2], key


def test_a_finite_cpu_output_is_read_once_whole_and_by_rows_only_where_it_is_not_finite(monkeypatch):
    from gradmon.capture import kernels as stats
    by_row: list = []
    for name in ("amin", "amax"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name, **k: by_row.append(_name) or _real(self, *a, **k))
    torch.manual_seed(0)
    x = torch.randn(4, 2 ** 15)
    lo, hi, rows = stats.extremes(x, 4)
    assert (lo.item(), hi.item()) == (x.min().item(), x.max().item())
    assert rows.shape == (4, 2) and torch.isfinite(rows).all() and by_row == []
    x[3, 7] = float("nan")
    lo, hi, rows = stats.extremes(x, 4)
    assert math.isnan(lo.item()) and math.isnan(hi.item()) and by_row == ["amin", "amax"]
    assert (~torch.isfinite(rows)).any(dim=1).nonzero().reshape(-1).tolist() == [3]


@pytest.mark.parametrize("root, inputs, size", [
    (torch.nn.Linear(4, 4), (torch.zeros(6, 4),), 6),
    (torch.nn.GRU(4, 4), (torch.zeros(5, 6, 4),), None),
    (torch.nn.GRU(4, 4, batch_first=True), (torch.zeros(6, 5, 4),), 6),
    (torch.nn.GRU(4, 4, batch_first=True),
     (torch.nn.utils.rnn.pack_padded_sequence(torch.zeros(6, 5, 4), [5] * 6, batch_first=True),), None),
])
def test_the_batch_is_the_root_inputs_first_dimension_unless_sequence_first_or_packed(root, inputs, size):
    from gradmon.capture.records import batch_size
    assert batch_size(root, inputs, {}) == size


def _bundle_after_four_steps(mon, model: torch.nn.Module, tmp_path, backward_step) -> dict:
    """Train four SGD steps, each ``backward_step(step)`` (forward and backward), the gradients
    made finite before the update so only the incident step is non-finite; the bundle's JSON."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(1, 5):
        backward_step(step)
        for p in model.parameters():
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert mon.flush()
    (path,) = tmp_path.glob("*.npz")
    return B.load(str(path)).meta


def test_the_rows_of_micro_batches_count_on_from_the_first_as_their_ids_do(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer()
    mon = attach(model)

    def two_micro_batches(step: int) -> None:
        for micro in range(2):
            x = torch.randn(W.BATCH, W.TOKENS, W.WIDTH)
            if step == 4 and micro == 1:
                W.poison_input(x)
            mon.observe(batch=[f"s{step}-m{micro}-n{n}" for n in range(W.BATCH)])
            (model(x) - x).pow(2).mean().backward()

    meta = _bundle_after_four_steps(mon, model, tmp_path, two_micro_batches)
    assert meta["rows"] == {"known": True, "rows": [W.BATCH + W.ROW], "block": "input", "reason": None}
    assert meta["batch"]["ids"][W.BATCH + W.ROW] == f"s4-m1-n{W.ROW}"


class Transposed(torch.nn.Module):
    """A block whose output is sequence-first: its first dimension is not the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(10.0 + x.transpose(0, 1))


class SequenceFirstInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(W.WIDTH, W.WIDTH)
        self.log = Transposed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log(self.lin(x)).transpose(0, 1)


def test_an_origin_block_whose_output_is_not_batch_first_says_rows_unknown_with_a_reason(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = SequenceFirstInside()
    mon = attach(model)

    def step_with_a_bad_row_at_4(step: int) -> None:
        x = torch.rand(W.BATCH, W.TOKENS, W.WIDTH)
        if step == 4:
            x[W.ROW] = -1000.0
        model(x).pow(2).mean().backward()

    meta = _bundle_after_four_steps(mon, model, tmp_path, step_with_a_bad_row_at_4)
    assert meta["incident"]["block"] == "log"
    assert not meta["rows"]["known"] and meta["rows"]["rows"] == [] and "not the root input's batch" in meta["rows"][
        "reason"]


class WithMask(torch.nn.Module):
    """A model given a float causal mask with the batch: -Inf in every row of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = W.TinyTransformer()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.inner(x + 0.01 * torch.softmax(mask, dim=-1).sum(-1, keepdim=True))


def test_a_nan_beside_a_float_mask_names_the_nan_row_not_every_row_of_the_mask(attach, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = WithMask()
    mon = attach(model)
    causal = torch.full((W.TOKENS, W.TOKENS), float("-inf")).triu(1).expand(W.BATCH, -1, -1).contiguous()

    def step_with_the_mask(step: int) -> None:
        x = torch.randn(W.BATCH, W.TOKENS, W.WIDTH)
        if step == 4:
            W.poison_input(x)
        (model(x, causal) - x).pow(2).mean().backward()

    meta = _bundle_after_four_steps(mon, model, tmp_path, step_with_the_mask)
    assert meta["incident"]["block"] == "input"
    assert meta["rows"] == {"known": True, "rows": [W.ROW], "block": "input", "reason": None}
