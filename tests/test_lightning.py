"""Lightning (issue 8, part 0): the norms gradmon reports are the accumulated, pre-clip
gradient that Lightning itself sees in ``on_before_optimizer_step``, whichever forward
``training_step`` calls.

Lightning's automatic optimization runs forward and backward inside the closure it
passes to ``optimizer.step``, so the optimizer's pre-step hook runs *before* that
step's backward: a monitor measuring there reports the previous step's clipped gradient
(or, under accumulation, only the micro-batches outside the closure). ``training_step``
calling ``self.net(x)`` never runs the LightningModule's own forward, which is what
makes this easy to get wrong.

The reference is ``lightning.pytorch.utilities.grad_norm`` in the hook Lightning calls
after the closure and before clipping; gradmon's side is a real scrape of its endpoint
after every optimizer step.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn

from conftest import fresh, value

STEPS = 6
CLIP = 0.05
REL = 1e-6


class Regressor(pl.LightningModule):
    def __init__(self, call: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.call = call
        self.lightning_norms: List[Dict[str, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x) if self.call == "self" else self.net(x)
        return (out - y).pow(2).mean()

    def on_before_optimizer_step(self, optimizer) -> None:
        # Lightning calls this after the closure's backward and before gradient_clip_val
        self.lightning_norms.append({k: v.item() for k, v in grad_norm(self, norm_type=2).items()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ScrapeAfterEachStep(pl.Callback):
    """After each optimizer step: what gradmon's endpoint says, and the gradient the
    optimizer actually used (after clipping)."""

    def __init__(self, monitor) -> None:
        self.monitor = monitor
        self.scrapes: List[Dict] = []
        self.clipped: List[float] = []
        self._steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._steps:
            return  # an accumulation micro-batch: no optimizer step yet
        self._steps = trainer.global_step
        self.scrapes.append(fresh(self.monitor))
        grads = [p.grad.double().norm() for p in pl_module.parameters() if p.grad is not None]
        self.clipped.append(torch.stack(grads).norm().item())


def lightning_layer_norms(norms: Dict[str, float], layers) -> Dict[str, float]:
    """Lightning reports one norm per parameter (``grad_2.0_norm/net.0.weight``); a
    gradmon layer's norm is the root of its parameters' summed squares."""
    out = {}
    for layer in layers:
        squares = [v * v for k, v in norms.items() if k.rpartition("/")[2].rpartition(".")[0] == layer]
        out[layer] = math.sqrt(sum(squares))
    return out


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("call", ["net", "self"])
def test_norms_equal_lightnings_pre_clip_grad_norm_at_every_step(attach, call, accumulate):
    torch.manual_seed(8)
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS * accumulate, 8), 3 * torch.randn(8 * STEPS * accumulate, 4))
    module = Regressor(call)
    mon = attach(module)
    seen = ScrapeAfterEachStep(mon)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate,
                         gradient_clip_val=CLIP, callbacks=[seen], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))

    assert mon.layers == ("net.0", "net.2", "net.4")
    assert len(module.lightning_norms) == len(seen.scrapes) == STEPS
    for step, (want, s, clipped) in enumerate(zip(module.lightning_norms, seen.scrapes, seen.clipped)):
        total = want["grad_2.0_norm_total"]
        assert total > 4 * CLIP and math.isclose(clipped, CLIP, rel_tol=1e-3), \
            f"step {step}: gradient_clip_val must really clip for this test to mean anything ({total} -> {clipped})"
        assert value(s, "gradmon_steps_total") == step + 1
        got = value(s, "gradmon_grad_global_norm")
        assert math.isclose(got, total, rel_tol=REL), f"step {step}: gradmon says {got}, Lightning's grad_norm {total}"
        for layer, layer_want in lightning_layer_norms(want, mon.layers).items():
            layer_got = value(s, "gradmon_grad_norm", layer=layer)
            assert math.isclose(layer_got, layer_want, rel_tol=REL), \
                f"step {step}, layer {layer}: gradmon says {layer_got}, Lightning's grad_norm {layer_want}"
    assert all(v == 0 for (name, _), v in seen.scrapes[-1].items() if name == "gradmon_hook_errors_total")
    assert mon.coverage().measured_at_step == 0  # every step measured at the end of its backward


class Recording(Regressor):
    """Records each micro-batch's loss; raises in training_step at ``fail_at`` (a global batch index)."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__("net")
        self.losses: List[float] = []
        self.fail_at = fail_at
        self.batches = 0

    def training_step(self, batch, batch_idx):
        if self.batches == self.fail_at:
            raise ValueError("a bad batch")
        self.batches += 1
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


class ScrapeEachStep(pl.Callback):
    def __init__(self, gradmon_callback) -> None:
        self.gm, self.seen, self._step = gradmon_callback, [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.seen.append((trainer.global_step, fresh(self.gm.monitor)))


def test_the_lightning_callback_attaches_observes_the_loss_numbers_steps_and_finishes():
    from gradmon.integrations.lightning import GradmonCallback

    torch.manual_seed(8)
    accumulate = 2
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS * accumulate, 8), 3 * torch.randn(8 * STEPS * accumulate, 4))
    module = Recording()
    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    seen = ScrapeEachStep(gm)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate,
                         gradient_clip_val=CLIP, callbacks=[gm, seen], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))

    assert [step for step, _ in seen.seen] == list(range(1, STEPS + 1))
    for k, (step, s) in enumerate(seen.seen):
        assert value(s, "gradmon_step") == step == trainer.global_step - (STEPS - 1 - k)
        assert value(s, "gradmon_steps_total") == k + 1
        micro = module.losses[accumulate * k:accumulate * (k + 1)]
        assert math.isclose(value(s, "gradmon_loss"), sum(micro) / accumulate, rel_tol=1e-6), (k, micro)
        # pre-clip, accumulated: what Lightning's own grad_norm saw before gradient_clip_val
        want = module.lightning_norms[k]["grad_2.0_norm_total"]
        assert want > 4 * CLIP and math.isclose(value(s, "gradmon_grad_global_norm"), want, rel_tol=REL)
    assert gm.monitor.state == "detached" and gm.monitor._run_state == "finished"


class PoisonedAt(Recording):
    """An infinite loss at global step ``at``: the 16-mixed GradScaler skips that step."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.inf if self.trainer.global_step == self.at else loss


def test_the_lightning_callback_counts_a_step_the_16_mixed_scaler_skipped():
    """precision="16-mixed" as on a GPU, with the plugin given a real CPU GradScaler: the
    callback hands it to gradmon, so the overflow step is a skip (not a non-finite page),
    numbered as Lightning numbers it, with the norm gauges held at the last applied step."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from gradmon.integrations.lightning import GradmonCallback

    torch.manual_seed(8)
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS, 8), 3 * torch.randn(8 * STEPS, 4))
    module = PoisonedAt(2)
    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    seen = ScrapeEachStep(gm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[gm, seen],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))

    norms = [n["grad_2.0_norm_total"] for n in module.lightning_norms]
    assert math.isnan(norms[2]) and scaler.get_scale() < 2.0 ** 10  # Lightning saw the overflow; the scaler skipped
    assert [step for step, _ in seen.seen] == list(range(1, STEPS + 1))
    for step, s in seen.seen:
        assert value(s, "gradmon_step") == step
        assert value(s, "gradmon_amp_skipped_steps_total") == (step >= 3)
        assert value(s, "gradmon_steps_total") == step - (step >= 3)
        assert value(s, "gradmon_nonfinite_steps_total") == 0
        held = norms[1] if step == 3 else norms[step - 1]
        assert math.isclose(value(s, "gradmon_grad_global_norm"), held, rel_tol=1e-5), (step, held)


class NanBatchAt(Recording):
    """A NaN in the batch at global step ``at``; AdamW, fused or not."""

    def __init__(self, at: int, fused: bool) -> None:
        super().__init__()
        self.at, self.fused = at, fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step == self.at:
            x = x.clone()
            x[0, 0] = math.nan
        return super().training_step((x, y), batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.fused)


class AroundStep(pl.Callback):
    """The parameters and optimizer state just before global step ``at`` and just after it."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, {}

    def _copy(self, trainer, module):
        state = [(k, v.clone() if isinstance(v, torch.Tensor) else v)
                 for s in trainer.optimizers[0].state.values() for k, v in sorted(s.items())]
        return [p.detach().clone() for p in module.parameters()], state

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.seen["before"] = self._copy(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at + 1:
            self.seen["after"] = self._copy(trainer, pl_module)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        (x[0] == y[0] and _same([x[1]], [y[1]])) if isinstance(x, tuple) else
        (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y) for x, y in zip(a, b))


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_the_lightning_callback_with_the_guard_skips_a_nan_batch_of_a_real_fit(fused, tmp_path):
    """Lightning steps with a closure that runs the backward inside ``optimizer.step``: the
    guard judges that backward's gradients, before the optimizer updates anything."""
    from gradmon.integrations.lightning import GradmonCallback

    torch.manual_seed(8)
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS, 8), 3 * torch.randn(8 * STEPS, 4))
    module = NanBatchAt(3, fused)
    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                         incident_dir=str(tmp_path), name=f"guarded-{fused}")
    seen, around = ScrapeEachStep(gm), AroundStep(3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[gm, seen, around], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))

    (params_before, state_before), (params_after, state_after) = around.seen["before"], around.seen["after"]
    assert all(torch.equal(a, b) for a, b in zip(params_before, params_after))
    assert _same(state_before, state_after)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(params_after, module.parameters()))  # later steps applied
    skipped = [value(s, "gradmon_guard_skipped_steps_total", reason="nonfinite") for _, s in seen.seen]
    assert skipped == [0, 0, 0, 1, 1, 1]
    assert [json.loads(line)["reason"] for line in (tmp_path / "exclude.jsonl").read_text().splitlines()] == \
        ["nonfinite"]


def test_the_lightning_callback_ends_a_crashed_fit_as_failed_with_the_exception_type():
    from gradmon.integrations.lightning import GradmonCallback

    torch.manual_seed(8)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[gm], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="a bad batch"):
        trainer.fit(Recording(fail_at=3), torch.utils.data.DataLoader(data, batch_size=8))
    assert gm.monitor.state == "detached"
    assert (gm.monitor._run_state, gm.monitor._failure) == ("failed", "ValueError")


def test_importing_gradmon_imports_no_trainer_library():
    import subprocess
    import sys
    code = "import sys, gradmon; print(sorted(m for m in ('lightning', 'transformers', 'accelerate') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- announced, checked at once, never leaked -------------------------------------------------

def quiet_trainer(gm, steps: int = STEPS) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[gm], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def loader() -> torch.utils.data.DataLoader:
    torch.manual_seed(8)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    return torch.utils.data.DataLoader(data, batch_size=8)


def test_the_lightning_callback_announces_its_endpoint_on_one_stderr_line(capfd):
    import re

    from gradmon.integrations.lightning import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    capfd.readouterr()
    quiet_trainer(gm, steps=2).fit(Recording(), loader())
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("gradmon:")]
    assert len(said) == 1 and re.fullmatch(
        r"gradmon: monitoring 3 layers of recording, metrics at (http://127\.0\.0\.1:\d+/)metrics, live page at \1",
        said[0]), said


def test_a_process_that_is_not_lightnings_global_zero_does_not_announce(capfd):
    import types

    from gradmon.integrations.lightning import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    capfd.readouterr()
    gm.on_train_start(types.SimpleNamespace(world_size=1, is_global_zero=False, global_step=0), Recording())
    try:
        assert gm.monitor.state == "running" and "gradmon:" not in capfd.readouterr().err
    finally:
        gm.on_train_end(None, None)


@pytest.mark.parametrize("options, error, option", [
    ({"prot": 1}, TypeError, "prot"),
    ({"port": "9400"}, TypeError, "port"),
    ({"every": 0}, ValueError, "every"),
    ({"guard_on_persist": "stop"}, ValueError, "guard_on_persist"),
])
def test_a_bad_option_fails_when_the_lightning_callback_is_made(options, error, option):
    from gradmon.integrations.lightning import GradmonCallback

    with pytest.raises(error, match=repr(option)):
        GradmonCallback(**options)


def test_three_caught_fit_crashes_leave_no_live_run_thread_hook_or_port():
    import socket
    import threading

    from gradmon import monitor
    from servers import free_port

    from gradmon.integrations.lightning import GradmonCallback

    def publishers() -> int:
        return sum(t.name.startswith("gradmon-publisher") for t in threading.enumerate())

    port = free_port()
    gm = GradmonCallback(port=port, addr="127.0.0.1", final_scrape_timeout=0)
    threads = publishers()
    for _ in range(3):
        module = Recording(fail_at=3)
        clean = [len(m._forward_hooks) for m in module.modules()]
        try:
            quiet_trainer(gm).fit(module, loader())
        except ValueError:
            pass
        assert (gm.monitor._run_state, gm.monitor._failure) == ("failed", "ValueError")
        assert monitor._live_monitors() == [] and publishers() == threads
        assert [len(m._forward_hooks) for m in module.modules()] == clean
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
