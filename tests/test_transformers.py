"""Hugging Face Trainer and Accelerate with gradmon (issue 11, part 3): real libraries, a tiny
randomly initialised GPT-2 (no download), on the CPU."""

from __future__ import annotations

import math
import os

import pytest
import torch

try:
    import accelerate
    import transformers  # noqa: F401
except ImportError:  # the test extra installs both; under CI their absence is a failure
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("transformers/accelerate not installed (pip install -e '.[test]')", allow_module_level=True)

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from conftest import fresh, value  # noqa: E402

STEPS = 5
ACCUMULATE = 2
CLIP = 0.05


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ScrapeEachStep(TrainerCallback):
    def __init__(self, gm) -> None:
        self.gm, self.seen = gm, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append((state.global_step, fresh(self.gm.monitor)))


def test_the_trainer_callback_matches_the_trainers_own_loss_grad_norm_and_step(tmp_path):
    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    seen = ScrapeEachStep(gm)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                             gradient_accumulation_steps=ACCUMULATE, max_grad_norm=CLIP, logging_steps=1,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(64), callbacks=[gm, seen])
    trainer.train()

    logged = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    assert [h["step"] for h in logged] == [step for step, _ in seen.seen] == list(range(1, STEPS + 1))
    for h, (step, s) in zip(logged, seen.seen):
        assert value(s, "gradmon_step") == step
        # the Trainer's loss of the step (its micro-batches normalised by num_items_in_batch) on this rank
        assert math.isclose(value(s, "gradmon_loss"), h["loss"], rel_tol=1e-5), (step, h)
        # pre-clip: clip_grad_norm_'s return, which the Trainer logs, before max_grad_norm clipped it
        assert h["grad_norm"] > 4 * CLIP
        assert math.isclose(value(s, "gradmon_grad_global_norm"), h["grad_norm"], rel_tol=1e-5), (step, h)
        assert value(s, "gradmon_learning_rate", group="0") > 0
    assert "transformer.h.0.attn.c_attn" in gm.monitor.layers
    assert gm.monitor.state == "detached" and gm.monitor._run_state == "finished"


class PoisonOneStep(TrainerCallback):
    """Makes the loss of optimizer step ``at`` infinite (a forward hook on the model), so that
    the GradScaler finds Inf gradients and skips that step."""

    def __init__(self, model, at: int) -> None:
        self.at, self.step = at, 0
        model.register_forward_hook(self._poison)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def _poison(self, module, args, output):
        if module.training and self.step == self.at:
            output.loss = output.loss * math.inf


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_the_trainer_callback_counts_a_step_the_fp16_scaler_skipped(tmp_path, optim):
    """fp16 with a GradScaler, as the Trainer runs it on a GPU: Accelerate checks for a device
    with fp16 support, so the test gives the Trainer's accelerator a real CPU GradScaler.
    A fused optimizer is stepped even on overflow (the scaler hands it the flag and it applies
    nothing); an unfused one is not stepped at all. Either way the skipped step keeps the
    Trainer's numbering, is counted as skipped and not as a non-finite incident, and leaves
    the norm gauges at the last applied step's values."""
    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    seen = ScrapeEachStep(gm)
    model = tiny_gpt2()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, fp16=True,
                             optim=optim, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32),
                      callbacks=[gm, seen, PoisonOneStep(model, at=3)])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    trainer.accelerator.native_amp = True
    trainer.train()

    assert bool(trainer.optimizer.optimizer.defaults.get("fused")) == (optim == "adamw_torch_fused")
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    assert math.isnan(logged[3])  # the Trainer saw the overflow
    assert [step for step, _ in seen.seen] == [1, 2, 3, 4, 5]
    for step, s in seen.seen:
        assert value(s, "gradmon_step") == step
        assert value(s, "gradmon_amp_skipped_steps_total") == (step >= 3)
        assert value(s, "gradmon_steps_total") == step - (step >= 3)
        assert value(s, "gradmon_nonfinite_steps_total") == 0
        held = logged[2] if step == 3 else logged[step]
        assert math.isclose(value(s, "gradmon_grad_global_norm"), held, rel_tol=1e-4), (step, held)
    assert value(seen.seen[3][1], "gradmon_amp_loss_scale") == 2.0 ** 9  # halved after the overflow


def test_an_accelerate_loop_with_the_one_line_attach(tmp_path):
    """README's Accelerate recipe: attach to the prepared model, observe the loss, steps from the optimizer."""
    import gradmon

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(8 * ACCUMULATE * STEPS), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    monitor = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0)
    norms, losses = [], []
    with monitor:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                monitor.observe(loss=loss)
                losses.append(loss.item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                s = fresh(monitor)
                k = len(norms)
                assert value(s, "gradmon_steps_total") == k
                assert math.isclose(value(s, "gradmon_grad_global_norm"), norms[-1], rel_tol=1e-5)
                micro = losses[-ACCUMULATE:]
                assert math.isclose(value(s, "gradmon_loss"), sum(micro) / ACCUMULATE, rel_tol=1e-5)
    assert len(norms) == STEPS
    assert monitor._run_state == "finished"


def test_the_trainer_callback_states_what_deepspeed_hides_in_the_log_and_in_coverage(caplog):
    """The Trainer hands callbacks the model inside DeepSpeed's engine, where nothing shows
    that ZeRO keeps the gradients: the callback says so from the Trainer's arguments."""
    import types

    from gradmon import sharded
    from gradmon.integrations.transformers import GradmonCallback

    for deepspeed, want in (("ds_config.json", (sharded.DEEPSPEED,)), (None, ())):
        gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
        with caplog.at_level("WARNING", logger="gradmon"):
            caplog.clear()
            gm.on_train_begin(types.SimpleNamespace(deepspeed=deepspeed, world_size=1), None, None,
                              model=torch.nn.Linear(2, 2))
        try:
            assert gm.monitor.coverage().limits == want
            assert any("DeepSpeed ZeRO" in r.getMessage() for r in caplog.records) == bool(want)
        finally:
            gm.on_train_end(None, None, None)


class Plain(torch.nn.Module):
    """A model whose forward takes no loss kwargs: the Trainer divides each micro-batch's loss
    by the accumulation steps itself (no num_items_in_batch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def test_the_trainer_callback_averages_micro_batch_losses_for_a_model_without_loss_kwargs(tmp_path):
    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    seen = ScrapeEachStep(gm)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                             gradient_accumulation_steps=ACCUMULATE, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=Plain(), args=args, train_dataset=Tokens(32), callbacks=[gm, seen])
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    assert len(logged) == len(seen.seen) == 3
    for want, (step, s) in zip(logged, seen.seen):
        assert math.isclose(value(s, "gradmon_loss"), want, rel_tol=1e-5), (step, want)
