"""The training thread's small units on their own, without a Recorder around them: the
parameter slots, the optimizers that own them, the loss mean, the optimizer reads."""

from __future__ import annotations

import gc
import math
import logging
import weakref

import pytest
import torch
from torch import nn

from gradmon import statistics as S
from gradmon.capture import optimizer
from gradmon.capture.layers import Layer
from gradmon.capture.loss import LossMean
from gradmon.capture.owners import Owners
from gradmon.capture.params import ParamSlots
from gradmon.errors import ErrorLog


def slots_of(model: nn.Module) -> ParamSlots:
    return ParamSlots([Layer(i, name, m, tuple(m.parameters(recurse=False)))
                       for i, (name, m) in enumerate(model.named_modules()) if list(m.parameters(recurse=False))])


# -- ParamSlots ---------------------------------------------------------------------------------

def test_a_replaced_parameter_is_read_in_place_of_the_old_one():
    lin = nn.Linear(2, 2)
    slots = slots_of(lin)
    slots.sync(slots.current(), lambda i, p: None)
    lin.weight = nn.Parameter(torch.zeros(2, 2))
    assert slots.current()[0] is lin.weight and slots.sync(slots.current(), lambda i, p: None)


def test_a_frozen_parameter_reads_as_none():
    lin = nn.Linear(2, 2)
    slots = slots_of(lin)
    lin.bias.requires_grad_(False)
    assert slots.current() == [lin.weight, None]


def test_each_parameter_is_hooked_once_while_hooked_and_not_after():
    lin = nn.Linear(2, 2)
    slots, seen = slots_of(lin), []
    slots.sync(slots.current(), lambda i, p: seen.append(i))
    slots.sync(slots.current(), lambda i, p: seen.append(i))  # unchanged: not hooked twice
    lin(torch.ones(1, 2)).sum().backward()
    slots.hooked = False
    slots.sync(slots.current(), lambda i, p: seen.append(i))
    lin(torch.ones(1, 2)).sum().backward()
    assert sorted(seen) == [0, 1]


def test_the_slots_keep_no_model_alive():
    lin = nn.Linear(2, 2)
    slots, gone = slots_of(lin), weakref.ref(lin)
    slots.sync(slots.current(), lambda i, p: None)
    slots.release()
    del lin
    gc.collect()
    assert gone() is None and slots.current() == [None, None]


# -- Owners -------------------------------------------------------------------------------------

def test_an_optimizer_over_other_parameters_is_no_owner():
    mine, other = nn.Linear(2, 2), nn.Linear(2, 2)
    owners = Owners(lambda: list(mine.parameters()))
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    assert not owners.owns(opt) and not owners.primary(opt)


def test_the_first_owning_optimizer_measures_and_a_second_does_not():
    model = nn.Linear(2, 2)
    owners = Owners(lambda: list(model.parameters()))
    first, second = (torch.optim.SGD([p], lr=0.1) for p in model.parameters())
    assert owners.owns(first) and owners.owns(second)
    assert owners.primary(first) and not owners.primary(second)


def test_an_unhashable_optimizer_is_owned():
    class Unhashable(torch.optim.SGD):
        def __eq__(self, other):
            return self is other
        __hash__ = None

    model = nn.Linear(2, 2)
    opt = Unhashable(model.parameters(), lr=0.1)
    assert Owners(lambda: list(model.parameters())).owns(opt)


def test_after_forget_the_optimizer_over_the_new_parameters_is_asked_again():
    model = nn.Linear(2, 2)
    owners = Owners(lambda: list(model.parameters()))
    old = torch.optim.SGD(model.parameters(), lr=0.1)
    owners.owns(old)
    model.weight, model.bias = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    new = torch.optim.SGD(model.parameters(), lr=0.1)
    owners.forget()
    assert not owners.owns(old) and owners.owns(new) and owners.primary(new)


# -- LossMean -----------------------------------------------------------------------------------

def test_the_mean_of_the_losses_since_the_last_reset():
    loss = LossMean()
    for x in (1.0, 2.0, torch.tensor(6.0)):
        loss.add(x)
    assert loss.mean().item() == 3.0
    loss.reset()
    assert loss.mean() is None


def test_a_loss_tensor_reused_in_place_keeps_the_value_it_had():
    loss, t = LossMean(), torch.tensor(2.0)
    loss.add(t)
    t.fill_(100.0)
    assert loss.mean().item() == 2.0


def test_losses_given_as_numbers_stay_on_the_host_in_float64():
    loss = LossMean()
    loss.add(0.1)
    loss.add(3)
    assert loss.mean().device.type == "cpu" and loss.mean().dtype == torch.float64


@pytest.mark.parametrize("bad, error, says", [(torch.ones(3), ValueError, "scalar loss"),
                                              (True, TypeError, "tensor or a number"),
                                              ("0.5", TypeError, "tensor or a number")])
def test_a_loss_that_is_no_scalar_is_refused_naming_observe(bad, error, says):
    with pytest.raises(error, match=f"observe\\(loss=...\\).*{says}"):
        LossMean().add(bad)


# -- optimizer reads ----------------------------------------------------------------------------

def test_the_step_count_is_read_from_the_optimizers_state_without_a_device_value():
    model = nn.Linear(2, 2)
    adam, sgd = torch.optim.Adam(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
    assert optimizer.step_count(adam) is None
    model(torch.ones(1, 2)).sum().backward()
    adam.step()
    sgd.step()
    assert optimizer.step_count(adam) == 1 and optimizer.step_count(sgd) is None


def test_an_optimizer_gradmon_cannot_read_is_said_once_and_reads_nothing(caplog):
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    reads, opt = optimizer.Reads(0), torch.optim.Adagrad(model.parameters())
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        assert reads.rows(opt, list(model.parameters()), False, S.STATISTICS) == {}
        assert reads.rows(opt, list(model.parameters()), False, S.STATISTICS) == {}
    assert caplog.text.count("cannot read the update of Adagrad") == 1


def test_the_update_of_each_parameter_with_a_gradient_is_read_by_its_slot():
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    wanted = [st for st in S.STATISTICS if st.at == S.OPTIMIZER]
    rows = optimizer.Reads(0).rows(opt, [None, model.bias], False, wanted)
    assert rows and all(keys == (1,) and numels == (2,) for _, keys, numels in rows.values())


# -- StepRecords --------------------------------------------------------------------------------

def step_records(*statistics, errors=None):
    from gradmon.capture.records import StepRecords
    return StepRecords(statistics, ["first", "second"], errors or ErrorLog("m"), keep_scratch=False)


def committed_keys(rec, name):
    return [key for key, _, _ in rec.by_name[name].committed()]


def test_records_commit_only_when_their_pass_completed():
    rec = step_records(S.ACTIVATION)
    rec.record_values(S.OUTPUT, 0, torch.ones(2, 2))
    rec.drop_pending(S.OUTPUT)  # the forward raised
    rec.record_values(S.OUTPUT, 1, torch.ones(2, 2))
    rec.commit(rec.each(*S.FORWARD), "forward")
    assert committed_keys(rec, "activation") == [1]


def test_a_tensor_recorded_again_unchanged_is_measured_once(monkeypatch):
    from gradmon.capture import kernels
    calls, real = [], kernels.activation_record
    monkeypatch.setattr(kernels, "activation_record", lambda t, *a: calls.append(1) or real(t, *a))
    rec, t = step_records(S.ACTIVATION), torch.ones(2, 2)
    rec.record_values(S.OUTPUT, 0, t)
    rec.record_values(S.OUTPUT, 1, t)
    t.add_(1)  # changed in place: measured again
    rec.record_values(S.OUTPUT, 1, t)
    rec.commit(rec.each(S.OUTPUT), "forward")
    assert len(calls) == 2 and committed_keys(rec, "activation") == [0, 1, 1]


def test_a_statistic_that_fails_on_a_tensor_misses_that_record_alone(monkeypatch):
    from gradmon.capture import kernels
    monkeypatch.setattr(kernels, "activation_record", lambda *a: 1 / 0)
    errors = ErrorLog("m")
    rec = step_records(S.ACTIVATION, S.LAYER_FINITE, errors=errors)
    rec.record_values(S.OUTPUT, 0, torch.ones(2))
    rec.record_values(S.LAYER, 0, torch.ones(2))
    rec.commit(rec.each(*S.FORWARD), "forward")
    assert committed_keys(rec, "activation") == [] and committed_keys(rec, "layer_finite") == [0]
    assert errors.counts()["forward"] == 1


def test_a_tensor_without_values_is_skipped_and_said_once_per_kind(caplog):
    rec = step_records(S.ACTIVATION)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        for key in (0, 1):
            rec.record_values(S.OUTPUT, key, torch.ones(2, device="meta"))
    rec.commit(rec.each(S.OUTPUT), "forward")
    assert committed_keys(rec, "activation") == [] and caplog.text.count("is a meta tensor") == 1
    assert "layer 'first'" in caplog.text


def test_gradient_flow_is_hooked_on_each_output_that_requires_grad():
    rec, seen = step_records(S.ACTIVATION), []
    x = torch.ones(2, requires_grad=True)
    out = (x * 2, torch.ones(2))
    rec.record_values(S.OUTPUT, 1, out, lambda key, grad: seen.append(key))
    out[0].sum().backward()
    assert seen == [1]


# -- BackwardPasses -----------------------------------------------------------------------------

def passes_over(model: nn.Module):
    from gradmon.capture.passes import BackwardPasses
    return BackwardPasses(lambda: list(model.parameters()))


def test_each_backward_pass_has_one_first_hook():
    model = nn.Linear(2, 2)
    passes, firsts = passes_over(model), []
    for _ in range(2):
        out = model(torch.ones(1, 2))
        twice = out * 2
        for t in (out, twice):
            t.register_hook(lambda g: firsts.append(passes.first_hook()))
        (out + twice).sum().backward()
    assert firsts == [True, False, True, False]


def test_a_backward_into_the_parameters_accumulates_and_autograd_grad_does_not():
    model = nn.Linear(2, 2)
    passes, x = passes_over(model), torch.ones(1, 2, requires_grad=True)
    out = model(x)
    out.register_hook(lambda g: passes.through_watched_output())
    torch.autograd.grad(out.sum(), x)
    grad_only = passes.accumulated
    out = model(x)
    out.register_hook(lambda g: passes.through_watched_output())
    out.sum().backward(inputs=[x])
    other_inputs = passes.accumulated
    out = model(x)
    out.register_hook(lambda g: passes.through_watched_output())
    out.sum().backward()
    assert (grad_only, other_inputs, passes.accumulated) == (False, False, True)


def test_a_pass_is_seen_only_while_it_runs_through_a_watched_output():
    model = nn.Linear(2, 2)
    passes, during = passes_over(model), []
    out = model(torch.ones(1, 2))
    def hook(grad):
        passes.through_watched_output()
        during.append(passes.seen())
    out.register_hook(hook)
    out.sum().backward()
    assert during == [True] and not passes.seen()


# -- ParamGradients -----------------------------------------------------------------------------

def test_the_gradients_present_are_measured_by_their_parameters_slot():
    from gradmon.capture.grads import ParamGradients
    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    a.grad, c.grad = torch.full((2,), 3.0), torch.full((4,), float("nan"))
    grads = ParamGradients((S.GRAD,), [a, b, c])
    rows, keys, numels = grads.measure([a, b, c])["grad"]
    by_key = {k: (n, r) for k, n, r in zip(keys, numels, rows.tolist())}
    assert sorted(by_key) == [0, 2] and by_key[0][0] == 2 and by_key[2][0] == 4
    assert math.isclose(by_key[0][1][0], math.sqrt(18)) and by_key[2][1][1] == 4  # norm; NaN count


def test_nothing_is_measured_without_a_gradient_and_nothing_reduced_without_shards():
    from gradmon.capture.grads import ParamGradients
    p = nn.Parameter(torch.zeros(2))
    grads, batched = ParamGradients((S.GRAD,), [p]), {}
    assert grads.measure([p, None]) == {} and not grads.sharded
    grads.reduce(batched, failed=False, errors=ErrorLog("m"))
    assert batched == {}
