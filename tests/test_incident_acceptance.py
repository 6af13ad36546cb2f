"""Issue 28's acceptance: real models and steps on the CPU, each breaking in its own way,
and what the bundle and ``gradmon incident`` say about it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gradmon.incidents import bundle as B

import incident_worker as W
from incident_worker import summary
from conftest import needs_cuda, scrape, value
from servers import free_port

ROOT = Path(__file__).resolve().parents[1]


def bundle_of(attach, monkeypatch, tmp_path, scenario: str, device: str = "cpu") -> B.Bundle:
    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    model = W.TinyTransformer().to(device)
    mon = attach(model)
    W.train(mon, model, W.STEP + 3, W.SCENARIOS[scenario], device=device)
    assert mon.flush()
    (path,) = tmp_path.glob("*.npz")
    return B.load(str(path))


def test_a_nan_from_torch_log_in_block_2_names_step_40_block_2_and_the_batch_ids(attach, monkeypatch, tmp_path):
    b = bundle_of(attach, monkeypatch, tmp_path, "log")
    assert b.meta["incident"]["step"] == W.STEP and b.meta["incident"]["block"] == "block2"
    assert b.meta["batch"]["ids"] == W.ids_of(W.STEP) and b.meta["batch"]["ids"][W.ROW] == f"r0-s{W.STEP}-n{W.ROW}"
    text = summary(b.path, tmp_path)
    assert f"non-finite at step {W.STEP}" in text and "origin: block block2 on this rank" in text


def test_a_nan_from_torch_log_in_block_2_names_the_row_that_carried_it_and_its_id(attach, monkeypatch, tmp_path):
    b = bundle_of(attach, monkeypatch, tmp_path, "log")
    assert b.meta["rows"] == {"known": True, "rows": [W.ROW], "block": "block2", "reason": None}
    assert f"rows: {W.ROW} (id r0-s{W.STEP}-n{W.ROW}) at block2" in summary(b.path, tmp_path)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("scenario,block", [("log", "block2"), ("exp", "block1"), ("input", "input")])
def test_on_cuda_the_step_the_block_and_the_row_are_named_as_on_the_cpu(attach, monkeypatch, tmp_path, scenario,
                                                                         block):
    """On an accelerator the rows come from the block checks' shared tables (one kernel per
    block output, every output's min and max reduced at the end of the forward)."""
    b = bundle_of(attach, monkeypatch, tmp_path, scenario, "cuda")
    assert b.meta["incident"]["step"] == W.STEP and b.meta["incident"]["block"] == block
    assert b.meta["rows"] == {"known": True, "rows": [W.ROW], "block": block, "reason": None}


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("scenario,block", [("log", "block2"), ("exp", "block1"), ("input", "input")])
def test_on_cuda_outputs_held_to_the_end_of_the_forward_name_the_step_the_block_and_the_row(
        attach, monkeypatch, tmp_path, scenario, block):
    """The block outputs counted large here (``DEFER_MAX`` lowered below theirs) wait for the
    end of the forward once one forward showed them alive there, and are checked by batch
    row in one launch (``counting.row_extremes``): the same names as every other path."""
    from gradmon.capture import counting, records
    monkeypatch.setattr(records, "DEFER_MAX", 64)
    launches = []
    real = counting.row_extremes
    monkeypatch.setattr(counting, "row_extremes", lambda groups, rows: launches.append(sum(map(len, groups))) or real(groups, rows))
    b = bundle_of(attach, monkeypatch, tmp_path, scenario, "cuda")
    assert b.meta["incident"]["step"] == W.STEP and b.meta["incident"]["block"] == block
    assert b.meta["rows"] == {"known": True, "rows": [W.ROW], "block": block, "reason": None}
    assert launches and max(launches) >= 4 and not counting._failed  # the blocks' outputs, at once


def test_a_nan_that_comes_with_the_batch_is_named_input(attach, monkeypatch, tmp_path):
    b = bundle_of(attach, monkeypatch, tmp_path, "input")
    assert b.meta["incident"]["block"] == "input" and b.meta["incident"]["step"] == W.STEP
    assert "origin: block input on this rank" in summary(b.path, tmp_path)


def test_a_nan_that_comes_with_the_batch_names_its_row(attach, monkeypatch, tmp_path):
    b = bundle_of(attach, monkeypatch, tmp_path, "input")
    assert b.meta["rows"] == {"known": True, "rows": [W.ROW], "block": "input", "reason": None}


def test_an_overflow_in_an_explicit_exp_is_named_at_its_block(attach, monkeypatch, tmp_path):
    b = bundle_of(attach, monkeypatch, tmp_path, "exp")
    assert b.meta["incident"]["block"] == "block1" and b.meta["incident"]["step"] == W.STEP
    assert "origin: block block1 on this rank" in summary(b.path, tmp_path)


def test_an_overflow_in_an_explicit_exp_names_its_row(attach, monkeypatch, tmp_path):
    b = bundle_of(attach, monkeypatch, tmp_path, "exp")
    assert b.meta["rows"] == {"known": True, "rows": [W.ROW], "block": "block1", "reason": None}


def test_in_a_two_rank_ddp_job_rank_1_names_its_batch_and_rank_0_points_at_rank_1(tmp_path):
    ctx = mp.start_processes(W.ddp_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=300):
        pass
    bundles = {B.load(str(p)).meta["run"]["rank"]: B.load(str(p)) for p in tmp_path.glob("*.npz")}
    assert set(bundles) == {0, 1}
    one, zero = bundles[1].meta, bundles[0].meta
    assert one["incident"]["origin_here"] and one["incident"]["block"] == "input" and one["full"]
    assert one["batch"]["ids"] == W.ids_of(W.STEP, rank=1)
    assert one["rows"] == {"known": True, "rows": [W.ROW], "block": "input", "reason": None}
    assert not zero["rows"]["known"] and zero["rows"]["reason"]
    assert not zero["incident"]["origin_here"] and zero["incident"]["step"] == W.STEP
    assert f"origin: rank 1, block input (its bundle: {bundles[1].path})" in summary(bundles[0].path, tmp_path)


def test_in_a_two_rank_ddp_job_a_rank_that_is_neither_origin_nor_rank_0_writes_a_small_record(tmp_path):
    ctx = mp.start_processes(W.ddp_rank, args=(2, free_port(), str(tmp_path), 0), nprocs=2, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=300):
        pass
    bundles = {B.load(str(p)).meta["run"]["rank"]: B.load(str(p)) for p in tmp_path.glob("*.npz")}
    assert bundles[0].meta["full"] and bundles[0].meta["incident"]["block"] == "input"
    one = bundles[1]
    assert not one.meta["full"] and not one.meta["history"]["present"] and "history.step" not in one.arrays
    assert Path(one.path).stat().st_size < Path(bundles[0].path).stat().st_size / 4
    text = summary(one.path, tmp_path)
    assert "history: none in this record" in text and "origin: rank 0, block input" in text


def test_a_job_killed_as_soon_as_metrics_shows_the_incident_leaves_a_complete_bundle(tmp_path):
    env = {**os.environ, "GRADMON_INCIDENT_DIR": str(tmp_path / "incidents"), "INCIDENT_STEP_DELAY": "0.02",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, W.__file__, "log", str(W.STEP + 200)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = json.loads(proc.stdout.readline())["url"]
        deadline = time.monotonic() + 120
        while value(scrape(url), "gradmon_nonfinite_steps_total") == 0:
            assert time.monotonic() < deadline and proc.poll() is None, "the incident never showed"
        proc.send_signal(signal.SIGKILL)  # at once: no detach, no flush, no exit handler
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (path,) = (tmp_path / "incidents").glob("*.npz")
    b = B.load(str(path))
    assert b.meta["incident"]["step"] == W.STEP and b.arrays["history.step"].tolist()[-1] == W.STEP
    assert not list((tmp_path / "incidents").glob(".tmp-*"))


def test_lightning_passes_the_ids_a_dict_batch_carries_into_the_bundle(monkeypatch, tmp_path):
    import lightning.pytorch as pl
    from gradmon.integrations.lightning import GradmonCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = W.TinyTransformer()

        def training_step(self, batch, batch_idx):
            return (self.net(batch["x"]) - batch["x"]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    def sample(n: int) -> dict:
        x = torch.randn(W.TOKENS, W.WIDTH)
        if n == 13:
            x[0, 0] = float("nan")
        return {"x": x, "idx": n}

    monkeypatch.setenv("GRADMON_INCIDENT_DIR", str(tmp_path))
    loader = torch.utils.data.DataLoader([sample(n) for n in range(4 * W.BATCH)], batch_size=W.BATCH)
    trainer = pl.Trainer(max_epochs=1, callbacks=[GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), loader)
    (path,) = tmp_path.glob("*.npz")
    meta = B.load(str(path)).meta
    # training_step calls self.net, not the module's own forward: the origin is its child net
    assert meta["incident"]["block"] == "net" and meta["batch"]["ids"] == list(range(8, 16))
