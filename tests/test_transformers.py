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


def test_the_trainer_callback_warns_where_per_layer_gradients_cannot_be_seen(caplog):
    import types
    from gradmon.integrations.transformers import _warn_unmeasurable

    class FlatParameter(torch.nn.Parameter):  # FSDP1's flattened parameters, by name
        pass

    model = torch.nn.Linear(2, 2)
    with caplog.at_level("WARNING", logger="gradmon"):
        _warn_unmeasurable(types.SimpleNamespace(deepspeed="ds_config.json"), model)
        _warn_unmeasurable(types.SimpleNamespace(deepspeed=None), model)
        model.weight = FlatParameter(torch.zeros(2, 2))
        _warn_unmeasurable(types.SimpleNamespace(deepspeed=None), model)
    text = [r.getMessage() for r in caplog.records]
    assert len(text) == 2 and "DeepSpeed ZeRO" in text[0] and "FSDP1 flat parameters" in text[1]


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
