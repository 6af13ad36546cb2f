"""The step guard (``guard=``, issue 29): a bad optimizer step is skipped bit for bit, on
every rank alike, counted, listed in exclude.jsonl, and given up on after guard_max_skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

import gradmon
from gradmon import metrics as M
from conftest import needs_cuda
from test_no_host_sync import RaiseOnSync

NAN_STEP = 40
ROOT = Path(__file__).resolve().parents[1]

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
}


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)


def _batch(step: int, bad_steps=(), device: str = "cpu") -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    if step in bad_steps:
        x[3, 2] = float("nan")
    return x.to(device)


def _state(opt: torch.optim.Optimizer) -> list:
    """Every tensor and number of the optimizer's state, copied."""
    return [(k, v.clone() if isinstance(v, torch.Tensor) else v)
            for p in opt.state.values() for k, v in sorted(p.items())]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(
        ka == kb and (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb) for (ka, va), (kb, vb) in zip(a, b))


def _train(model, opt, mon, steps, bad_steps=(), at=None, ids=False, spike_steps=(), device="cpu"):
    """``steps`` steps; returns (parameters, optimizer state) just before step ``at`` and just
    after it. A step of ``spike_steps`` has a batch whose loss is 50 times the others'."""
    seen = {}
    for step in range(steps):
        if step == at:
            seen["before"] = ([p.detach().clone() for p in model.parameters()], _state(opt))
        if ids:
            mon.observe(batch=[10 * step, 10 * step + 1])
        loss = model(_batch(step, bad_steps, device)).pow(2).mean() * (50.0 if step in spike_steps else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == at:
            seen["after"] = ([p.detach().clone() for p in model.parameters()], _state(opt))
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_nan_step_is_skipped_bit_for_bit_and_training_goes_on(kind, device, tmp_path):
    model = _model(device)
    opt = OPTIMIZERS[kind](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        incident_dir=str(tmp_path), name=f"guard-{kind}") as mon:
        seen = _train(model, opt, mon, 50, bad_steps=(NAN_STEP,), at=NAN_STEP, device=device)
        assert mon.flush()
        snap = mon.snapshot()
        errors = sum(mon._errors.counts().values())
    params_before, state_before = seen["before"]
    params_after, state_after = seen["after"]
    assert all(torch.equal(a, b) for a, b in zip(params_before, params_after))
    assert _equal(state_before, state_after)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the later steps applied, finite
    assert dict(snap.guard_skipped_steps) == {M.GUARD_NONFINITE: 1}
    assert snap.nonfinite_steps == 1 and errors == 0
    lines = [json.loads(line) for line in (tmp_path / "exclude.jsonl").read_text().splitlines()]
    assert [(line["reason"], line["rank"]) for line in lines] == [(M.GUARD_NONFINITE, 0)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_step_with_a_closure_is_judged_on_the_closures_own_backward(kind, device):
    """``opt.step(closure)`` (as Lightning steps): the backward runs inside the step, after
    its pre-hook; the NaN it brings is still skipped, and the other steps applied."""
    model = _model(device)
    opt = OPTIMIZERS[kind](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        incident_dir="", name=f"closure-{kind}") as mon:
        for step in range(12):
            def closure():
                opt.zero_grad(set_to_none=True)
                loss = model(_batch(step, bad_steps=(8,), device=device)).pow(2).mean()
                loss.backward()
                return loss
            before = [p.detach().clone() for p in model.parameters()]
            opt.step(closure)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert unchanged == (step == 8), step
        assert mon.flush()
        assert dict(mon.snapshot().guard_skipped_steps) == {M.GUARD_NONFINITE: 1}
        assert sum(mon._errors.counts().values()) == 0
        assert mon._recorder.step_guard.syncs == (0 if kind.endswith("fused") else 12)  # one read a step, unfused


def test_without_the_guard_the_nan_step_is_applied(tmp_path):
    """The same run with the guard off: the NaN reaches the parameters (the test above can fail)."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, incident_dir="") as mon:
        _train(model, opt, mon, NAN_STEP + 1, bad_steps=(NAN_STEP,))
        assert mon.flush()
        assert mon.snapshot().guard_skipped_steps == ()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fused_optimizer_is_guarded_without_reading_the_device_and_others_with_one_read():
    model = _model()
    fused = OPTIMIZERS["adamw_fused"](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        incident_dir="") as mon:
        guard = mon._recorder.step_guard
        with RaiseOnSync():
            _train(model, fused, mon, 5, bad_steps=(3,))
        assert guard.syncs == 0
        plain = OPTIMIZERS["sgd"](model.parameters())
        _train(model, plain, mon, 4, bad_steps=(2,))
        assert guard.syncs == 4
        assert mon.flush()
        assert dict(mon.snapshot().guard_skipped_steps) == {M.GUARD_NONFINITE: 2}


def test_the_skips_are_exported_by_reason_with_the_ids_of_the_skipped_batches(tmp_path):
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())
    registry = CollectorRegistry()
    with gradmon.attach(model, registry=registry, guard="nonfinite", incident_dir=str(tmp_path),
                        final_scrape_timeout=0) as mon:
        _train(model, opt, mon, 12, bad_steps=(5, 9), ids=True)
        assert mon.flush()
        text = generate_latest(registry).decode()
    assert 'gradmon_guard_skipped_steps_total{model="sequential",rank="0",reason="nonfinite"} 2.0' in text
    lines = [json.loads(line) for line in (tmp_path / "exclude.jsonl").read_text().splitlines()]
    assert [line["ids"] for line in lines] == [[50, 51], [90, 91]]
    assert all(line["ids_known"] and line["model"] == "sequential" for line in lines)


def test_a_monitor_attached_again_goes_on_from_the_skips_and_the_latest_skip_of_the_one_before(tmp_path):
    """A notebook cell run twice, a Lightning fit after another: the counts carry on (a
    counter back at 0 reads as a reset) and so does the latest skip's step, until a skip of
    the new monitor's own replaces it."""
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())

    def last_skip(registry: CollectorRegistry):
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if line.startswith("gradmon_guard_last_skip_step{")]

    with gradmon.attach(model, registry=CollectorRegistry(), guard="nonfinite", incident_dir=str(tmp_path),
                        final_scrape_timeout=0) as mon:
        _train(model, opt, mon, 8, bad_steps=(5,))
        assert mon.flush()
        assert mon.snapshot().guard_last_skip == (M.GUARD_NONFINITE, 5)
    registry = CollectorRegistry()
    with gradmon.attach(model, registry=registry, guard="nonfinite", incident_dir=str(tmp_path),
                        final_scrape_timeout=0) as again:
        _train(model, opt, again, 3)
        assert again.flush()
        assert dict(again.snapshot().guard_skipped_steps) == {M.GUARD_NONFINITE: 1}
        assert again.snapshot().guard_last_skip == (M.GUARD_NONFINITE, 5)
        assert last_skip(registry) == [
            'gradmon_guard_last_skip_step{model="sequential",rank="0",reason="nonfinite"} 5.0']
        _train(model, opt, again, 3, bad_steps=(1,))
        assert again.flush()
        assert dict(again.snapshot().guard_skipped_steps) == {M.GUARD_NONFINITE: 2}
        assert again.snapshot().guard_last_skip == (M.GUARD_NONFINITE, 11)


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_past_guard_max_skips_the_step_is_applied_and_the_run_fails(kind):
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        guard_max_skips=3, incident_dir="", name=f"persist-{kind}") as mon:
        _train(model, opt, mon, 10, bad_steps=range(4, 10))
        assert mon.flush()
        assert dict(mon.snapshot().guard_skipped_steps) == {M.GUARD_NONFINITE: 3}
        assert (mon._run_state, mon._failure) == (M.STATE_FAILED, "GuardPersisted")
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the 4th bad step went through
    assert (mon._run_state, mon._failure) == (M.STATE_FAILED, "GuardPersisted")  # the end keeps it failed


def test_guard_on_persist_raise_stops_the_bad_step_from_optimizer_step():
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        guard_max_skips=2, guard_on_persist="raise", incident_dir="") as mon:
        with pytest.raises(gradmon.GuardPersisted, match="guard_max_skips=2"):
            _train(model, opt, mon, 10, bad_steps=range(4, 10))
        before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.isfinite(p).all() for p in before)


def test_the_gradscalers_own_overflow_skip_is_not_a_guard_skip():
    """A fused optimizer under a GradScaler: the scaler's flag wins and is counted as its
    skip; the guard counts nothing and its run of bad steps does not grow."""
    model = _model()
    opt = OPTIMIZERS["adamw_fused"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite",
                        guard_max_skips=1, scaler=scaler, incident_dir="") as mon:
        for step in range(8):
            scaler.scale(model(_batch(step, bad_steps=(3, 4))).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        assert mon.flush()
        snap = mon.snapshot()
    assert snap.amp_skipped_steps == 2
    assert dict(snap.guard_skipped_steps) == {M.GUARD_NONFINITE: 0}
    assert mon._run_state != M.STATE_FAILED
    assert not hasattr(opt, "found_inf")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("options, message", [
    (dict(guard="nan"), "guard"), (dict(guard="nonfinite", guard_max_skips=0), "guard_max_skips"),
    (dict(guard="nonfinite", guard_on_persist="stop"), "guard_on_persist")])
def test_bad_guard_options_are_refused_at_attach(options, message):
    with pytest.raises(ValueError, match=message):
        gradmon.attach(_model(), port=0, **options)


def test_gradmon_guard_turns_the_guard_on_from_the_environment(monkeypatch):
    monkeypatch.setenv("GRADMON_GUARD", "nonfinite")
    from gradmon.config import resolve
    assert resolve({}).guard == "nonfinite"
    monkeypatch.setenv("GRADMON_GUARD", "bogus")
    with pytest.raises(ValueError, match="GRADMON_GUARD=bogus"):
        resolve({})


SPIKE_STEP = 45


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_50x_loss_spike_batch_is_skipped_with_spike_and_counted_by_the_pages_too(kind, tmp_path):
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="nonfinite,spike",
                        spike_window=32, spike_min_steps=32, incident_dir=str(tmp_path), name=f"spike-{kind}") as mon:
        seen = _train(model, opt, mon, 50, at=SPIKE_STEP, spike_steps=(SPIKE_STEP,))
        assert mon.flush()
        snap = mon.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(seen["before"][0], seen["after"][0]))
    assert _equal(seen["before"][1], seen["after"][1])
    assert dict(snap.guard_skipped_steps) == {M.GUARD_NONFINITE: 0, M.GUARD_SPIKE: 1}
    assert dict(snap.spike_steps)[M.SIGNAL_LOSS] == 1  # the same score, on the publisher, for the pages
    from gradmon.incidents import bundle
    bundles = sorted(tmp_path.glob("gradmon-incident-*.npz"))
    assert len(bundles) == 1  # the first skip's
    assert bundle.load(str(bundles[0])).meta["kind"] == "guard"


def test_a_spike_skip_under_a_gradscaler_leaves_the_loss_scale_alone():
    model = _model()
    opt = OPTIMIZERS["adamw_fused"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    with gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, guard="spike", spike_window=32,
                        spike_min_steps=32, scaler=scaler, incident_dir="") as mon:
        for step in range(40):
            loss = model(_batch(step)).pow(2).mean() * (50.0 if step == 36 else 1.0)
            mon.observe(loss=loss)
            scaler.scale(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if step == 36:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert mon.flush()
        snap = mon.snapshot()
    assert dict(snap.guard_skipped_steps) == {M.GUARD_SPIKE: 1}
    assert snap.amp_skipped_steps == 0 and scaler.get_scale() == 2.0 ** 10


HEALTHY_TUNE = ["cnn-healthy-nowarmup-s0", "cnn-healthy-warmup-s0", "cnn-healthy-warmup-s1", "lm-healthy-nowarmup-s0",
                "lm-healthy-nowarmup-s1", "lm-healthy-warmup-lr3e-3-s0", "lm-healthy-warmup-s0", "lm-healthy-warmup-s1"]


def _healthy_series(name):
    """A recorded healthy run's loss and global gradient norm, step by step, as the guard scores them."""
    import sys
    sys.path.insert(0, str(ROOT / "bench" / "instability"))
    import corpus_files as files
    import inprocess
    from gradmon import statistics as S
    from gradmon.capture.stepguard import global_norm

    rec = files.load(name)
    assert files.manifest()["runs"][name]["split"] == "tune"
    packets = inprocess.Packets(rec)
    norms = []
    for i in range(len(packets)):
        packet = packets.packet(i)
        for stat, _, rows in (S.read(packet.data.tolist(), packet.sections) if packet.data is not None else ()):
            if stat is S.GRAD:
                norms.append(global_norm(torch.tensor(rows, dtype=torch.float64), None))
    return {M.SIGNAL_LOSS: torch.tensor(rec["loss"], dtype=torch.float64), M.SIGNAL_GRAD_NORM: torch.stack(norms)}


@pytest.mark.parametrize("name", HEALTHY_TUNE)
def test_the_guards_spike_score_skips_nothing_in_the_healthy_runs_of_the_alert_corpus(name):
    """Every step of each healthy tune-split run scored against its 128 steps before, as the
    device scores it at the defaults (guard_spike_z 6, spike_window 128): none is a spike."""
    from gradmon import robust
    for signal, values in _healthy_series(name).items():
        assert len(values) >= 1900 and bool(torch.isfinite(values).all() and (values > 0).all())
        logs = values.log()
        windows = logs.unfold(0, 128, 1)[:-1]  # the window before each step from step 128 on
        score, above = robust.score(windows, logs[128:])
        spikes = ((score > 6.0) & above).nonzero().flatten() + 128
        assert spikes.tolist() == [], (signal, score.max().item())


def _replay_guard(name, steps=None, spike_at=None):
    """``guard="nonfinite,spike"`` at its defaults, as attach builds it (its device windows,
    their restart on a learning-rate jump, the decision and its host read), fed each recorded
    step of ``name`` in order: the gradient rows, the loss (times 50 at ``spike_at``) and the
    learning rates. Returns the steps replayed and the global steps it skipped."""
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "bench" / "instability"))
    import corpus_files as files
    import inprocess
    from gradmon import statistics as S
    from gradmon.capture.stepguard import StepGuard, StepSignals, modes
    from gradmon.config import resolve

    cfg = resolve({"guard": "nonfinite,spike"})
    guard = StepGuard(modes(cfg.guard), cfg.guard_max_skips, cfg.guard_on_persist, (), cfg.guard_spike_z,
                      cfg.spike_window)
    rec = files.load(name)
    packets = inprocess.Packets(rec)
    values = SimpleNamespace(batched={}, loss=None, scale=None)
    signals = StepSignals([S.GRAD], values, False, lambda: [])
    opt = None
    replayed, skipped = 0, []
    for i in range(min(len(packets), steps or len(packets))):
        packet = packets.packet(i)
        rows = [rows for stat, _, rows in S.read(packet.data.tolist(), packet.sections) if stat is S.GRAD]
        if opt is None:
            opt = torch.optim.SGD([{"params": [torch.zeros(1)]} for _ in packet.learning_rates], lr=1.0)
        for group, lr in zip(opt.param_groups, packet.learning_rates):
            group["lr"] = lr
        values.batched = {S.GRAD.name: (torch.tensor(rows[0]),)}
        loss = float(rec["loss"][packet.global_step - 1]) * (50.0 if packet.global_step == spike_at else 1.0)
        values.loss = torch.tensor([loss])
        guard.measured(signals)
        guard.before_step(opt, signals)
        guard.after_step(opt)
        replayed += 1
        if guard.skipped_on_host:
            skipped.append(packet.global_step)
    return replayed, skipped


@pytest.mark.parametrize("name", ["cnn-healthy-nowarmup-s0", "lm-healthy-warmup-s0"])
def test_the_guard_replayed_over_a_healthy_corpus_run_skips_none_of_its_2000_steps(name):
    replayed, skipped = _replay_guard(name)
    assert replayed == 2000 and skipped == []
    assert _replay_guard(name, steps=300, spike_at=250) == (300, [250])  # the same replay sees a 50x loss


def test_spike_is_armed_only_once_the_window_is_full_and_again_after_a_restart():
    from gradmon.capture.stepguard import SpikeWindow

    def verdicts(window, n, spike_at):
        return [bool(window.push(torch.tensor(50.0 if i == spike_at else 1.0 + 0.01 * (i % 3)))) for i in range(n)]

    assert not any(verdicts(SpikeWindow(32, 6.0), 32, spike_at=31))  # the 32nd value: the window is not full yet
    assert verdicts(SpikeWindow(32, 6.0), 33, spike_at=32)[32]  # the 33rd: scored against 32, a spike
    window = SpikeWindow(32, 6.0)
    verdicts(window, 40, spike_at=None)
    window.restart()  # a learning-rate jump
    assert not any(verdicts(window, 32, spike_at=20))


def test_the_device_window_and_the_pages_detector_give_the_same_verdicts():
    """One definition: the guard's window on the device (SpikeWindow) and the publisher's
    detector score a recorded run's loss alike, step by step, once the window is full."""
    from gradmon.aggregate.spikes import SpikeDetector
    from gradmon.capture.stepguard import SpikeWindow

    loss = _healthy_series("lm-healthy-nowarmup-s0")[M.SIGNAL_LOSS][:220].clone()
    loss[150] *= 50  # one spike among them, for both to find
    window, detector = SpikeWindow(64, 6.0), SpikeDetector(64, 64, 6.0)
    device = [bool(window.push(v)) for v in loss]
    host = [bool(v is not None and v.spike) for v in map(detector.update, loss.tolist())]
    assert device == host and device.count(True) == 1 and device[150]
