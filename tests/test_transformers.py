"""Hugging Face Trainer and Accelerate with gradmon (issue 11, part 3): real libraries, a tiny
randomly initialised GPT-2 (no download), on the CPU."""

from __future__ import annotations

import math
import os
import re

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

from conftest import fresh, scrape, value  # noqa: E402

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


class KeepParams(TrainerCallback):
    """A copy of the model's parameters at the end of each optimizer step."""

    def __init__(self, model) -> None:
        self.model, self.kept = model, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.kept[state.global_step] = [p.detach().clone() for p in self.model.parameters()]


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_the_trainer_callback_takes_the_step_guard_and_skips_the_poisoned_step(tmp_path, optim):
    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite", incident_dir="")
    model = tiny_gpt2()
    kept = KeepParams(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, optim=optim,
                             max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32), callbacks=[gm, kept, PoisonOneStep(model, at=3)])
    trainer.train()

    assert all(torch.equal(a, b) for a, b in zip(kept.kept[2], kept.kept[3]))  # step 3 applied nothing
    assert not all(torch.equal(a, b) for a, b in zip(kept.kept[3], kept.kept[4]))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    snap = gm.monitor.snapshot()
    assert dict(snap.guard_skipped_steps) == {"nonfinite": 1} and snap.steps_total == 5


def test_an_accelerate_loop_with_the_one_line_attach(tmp_path):
    """The Accelerate recipe of docs/integrations.md: attach to the prepared model, observe the loss, steps from the optimizer."""
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

    from gradmon.capture import sharded
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


# -- announced, checked at once, never leaked -------------------------------------------------

def trainer_args(tmp_path, steps: int = 3) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)


def test_the_trainer_callback_announces_its_endpoint_on_one_stderr_line(tmp_path, capfd):
    """A print, not an INFO record: the Trainer's default log level (WARNING) hides INFO."""
    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    capfd.readouterr()
    Trainer(model=Plain(), args=trainer_args(tmp_path), train_dataset=Tokens(32), callbacks=[gm]).train()
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("gradmon:")]
    assert len(said) == 1 and re.fullmatch(
        r"gradmon: monitoring 2 layers of plain, metrics at (http://127\.0\.0\.1:\d+/)metrics, live page at \1",
        said[0]), said


def test_a_process_that_is_not_the_trainers_main_process_does_not_announce(capfd, caplog):
    """The Trainer's own word (``state.is_world_process_zero``), not only the RANK variable."""
    import logging
    import types

    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="gradmon"):
        gm.on_train_begin(types.SimpleNamespace(world_size=1, deepspeed=None),
                          types.SimpleNamespace(is_world_process_zero=False), None, model=Plain())
    try:
        assert "gradmon:" not in capfd.readouterr().err
        assert [r.levelno for r in caplog.records if r.getMessage().startswith("gradmon: monitoring")] == [logging.DEBUG]
    finally:
        gm.on_train_end(None, None, None)


@pytest.mark.parametrize("options, error, option", [
    ({"prot": 1}, TypeError, "prot"),
    ({"port": "9400"}, TypeError, "port"),
    ({"every": 0}, ValueError, "every"),
    ({"guard": "nan"}, ValueError, "guard"),
])
def test_a_bad_option_fails_when_the_callback_is_made_not_at_train_begin(options, error, option):
    from gradmon.integrations.transformers import GradmonCallback

    with pytest.raises(error, match=repr(option)):
        GradmonCallback(**options)


class CrashesAt(Plain):
    """A trial that fails: its forward raises on the ``at``-th training forward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, input_ids, labels=None):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("a trial that diverged")
        return super().forward(input_ids, labels)


def publisher_threads() -> int:
    import threading
    return sum(t.name.startswith("gradmon-publisher") for t in threading.enumerate())


def live_monitors() -> int:
    from gradmon import monitor
    return len(monitor._live_monitors())


def hook_counts(model: torch.nn.Module):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] + [
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]


def crashed_trial(tmp_path, callback) -> CrashesAt:
    model = CrashesAt(at=3)
    clean = hook_counts(model)
    trainer = Trainer(model=model, args=trainer_args(tmp_path, steps=5), train_dataset=Tokens(32), callbacks=[callback])
    try:
        trainer.train()
    except RuntimeError:
        pass  # the sweep goes on to the next trial
    assert hook_counts(model) != clean  # the crashed run's hooks are still on until it is ended
    model.clean = clean
    return model


def refused(port: int) -> bool:
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_three_crashed_trials_with_one_callback_leave_one_live_run_and_close_ends_it(tmp_path):
    from servers import free_port

    from gradmon.integrations.transformers import GradmonCallback

    port = free_port()
    gm = GradmonCallback(port=port, addr="127.0.0.1", final_scrape_timeout=0)
    threads = publisher_threads()
    models, monitors = [], []
    for _ in range(3):
        models.append(crashed_trial(tmp_path, gm))
        monitors.append(gm.monitor)
        assert live_monitors() == 1 and publisher_threads() == threads + 1
    # each trial's train begin ended the crashed run before it: failed, its hooks gone
    for model, mon in zip(models[:-1], monitors[:-1]):
        assert (mon.state, mon._run_state, mon._failure) == ("detached", "failed", None)
        assert hook_counts(model) == model.clean
    assert value(fresh(gm.monitor), "gradmon_run_state", state="training") == 1  # the last one, until closed
    gm.close()
    assert (monitors[-1].state, monitors[-1]._run_state) == ("detached", "failed")
    assert live_monitors() == 0 and publisher_threads() == threads
    assert hook_counts(models[-1]) == models[-1].clean
    assert refused(port)


def test_a_callback_used_as_a_context_manager_ends_its_crashed_trial_at_the_end_of_the_block(tmp_path):
    from gradmon.integrations.transformers import GradmonCallback

    threads = publisher_threads()
    for _ in range(3):
        with GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0) as gm:
            model = crashed_trial(tmp_path, gm)
            port = gm.monitor.port
        assert (gm.monitor.state, gm.monitor._run_state) == ("detached", "failed")
        assert live_monitors() == 0 and publisher_threads() == threads
        assert hook_counts(model) == model.clean and refused(port)


def test_an_exception_leaving_the_with_block_names_its_type(tmp_path):
    from gradmon.integrations.transformers import GradmonCallback

    with pytest.raises(RuntimeError):
        with GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0) as gm:
            Trainer(model=CrashesAt(at=3), args=trainer_args(tmp_path, steps=5), train_dataset=Tokens(32),
                    callbacks=[gm]).train()
    assert (gm.monitor._run_state, gm.monitor._failure) == ("failed", "RuntimeError")


def test_a_forgotten_callback_of_a_crashed_trial_ends_its_run_when_it_is_collected(tmp_path):
    import gc

    from gradmon.integrations.transformers import GradmonCallback

    threads = publisher_threads()
    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0)
    model = crashed_trial(tmp_path, gm)
    mon = gm.monitor
    del gm
    gc.collect()
    assert (mon.state, mon._run_state) == ("detached", "failed")
    assert live_monitors() == 0 and publisher_threads() == threads and hook_counts(model) == model.clean


def test_keep_serving_leaves_the_finished_run_and_its_page_up_after_train(tmp_path):
    from gradmon import monitor as monitor_module
    from gradmon.integrations.transformers import GradmonCallback

    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0, keep_serving=True)
    Trainer(model=Plain(), args=trainer_args(tmp_path), train_dataset=Tokens(32), callbacks=[gm]).train()
    try:
        assert gm.monitor.state == "detached"
        samples = {k: v for k, v in scrape(gm.monitor.url).items() if dict(k[1]).get("model") == "plain"}
        assert value(samples, "gradmon_run_state", state="finished") == 1 and value(samples, "gradmon_step") == 3
        import urllib.request
        assert urllib.request.urlopen(gm.monitor.url[:-len("metrics")], timeout=5).status == 200
    finally:
        monitor_module._end_all("finished", None)  # what the interpreter's exit runs
    assert gm.monitor.url is None


def test_the_kill_switch_makes_the_callback_a_no_op_even_with_a_bad_option(tmp_path, monkeypatch):
    from gradmon.integrations.transformers import GradmonCallback

    monkeypatch.setenv("GRADMON_DISABLE", "1")
    gm = GradmonCallback(prot=1)  # as attach() under GRADMON_DISABLE: nothing is checked, nothing runs
    Trainer(model=Plain(), args=trainer_args(tmp_path, steps=1), train_dataset=Tokens(8), callbacks=[gm]).train()
    assert gm.monitor.state == "disabled" and gm.monitor.url is None


class IdTokens(Tokens):
    """Each sample carries its id (its index + 1000) in an ``id`` column."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "id": 1000 + i}


class NanInFirstBlock(TrainerCallback):
    """At optimizer step ``at``, row ``row`` of the first GPT-2 block's output becomes NaN (a
    forward hook: the job's own numerics going wrong in ``transformer``); the ``input_ids`` of
    that forward are kept, to look its samples up in the dataset."""

    def __init__(self, model, at: int, row: int) -> None:
        self.at, self.row, self.step, self.input_ids = at, row, 0, None
        model.transformer.h[0].register_forward_hook(self._poison)
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def _inputs(self, module, args, kwargs):
        if module.training and self.step == self.at:
            assert "id" not in kwargs  # the id column never reaches the model
            self.input_ids = kwargs["input_ids"].clone()

    def _poison(self, module, args, output):
        if module.training and self.step == self.at:
            output[self.row] = float("nan")


def _incident_bundle(tmp_path, dataset, **arguments) -> tuple:
    """A Trainer run whose step 3 goes NaN in row 1 of the first block; its bundle and the
    input_ids of that step's batch."""
    from gradmon.integrations.transformers import GradmonCallback
    gm = GradmonCallback(port=0, addr="127.0.0.1", final_scrape_timeout=0, incident_dir=str(tmp_path / "incidents"))
    model = tiny_gpt2()
    poison = NanInFirstBlock(model, at=3, row=1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, **arguments)
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[gm, poison]).train()
    (path,) = (tmp_path / "incidents").glob("*.npz")
    from gradmon.incidents import bundle as B
    return B.load(str(path)).meta, poison.input_ids


@pytest.mark.parametrize("keep", [dict(remove_unused_columns=False), dict(label_names=["labels", "id"])],
                         ids=["remove_unused_columns_false", "id_in_label_names"])
def test_the_trainer_callback_names_the_ids_of_the_rows_that_went_nonfinite(tmp_path, keep):
    """The Trainer drops a column the model's forward does not take; kept (either way), the
    callback takes the ids out of the model's inputs and gives them to observe(batch=...)."""
    data = IdTokens(32)
    meta, input_ids = _incident_bundle(tmp_path, data, **keep)
    expected = [1000 + next(i for i in range(len(data)) if torch.equal(data.ids[i], row)) for row in input_ids]
    assert meta["incident"]["step"] == 3 and meta["incident"]["block"] == "transformer"
    assert meta["rows"]["rows"] == [1] and meta["batch"]["ids"] == expected and meta["batch"]["hashes"] == {}


def test_without_an_id_column_the_trainer_callback_names_the_rows_by_their_input_ids_hash(tmp_path):
    from incident_worker import documented_row_hash
    meta, input_ids = _incident_bundle(tmp_path, Tokens(32))
    assert meta["rows"]["rows"] == [1] and not meta["batch"]["known"]
    assert meta["batch"]["hashes"]["input_ids"] == documented_row_hash()(input_ids.numpy())
