"""The training thread's small units on their own, without a Recorder around them: the
parameter slots, the optimizers that own them, the loss mean, the optimizer reads, the
step's records and other values, backward passes, gradients, the forward hooks."""

from __future__ import annotations

import gc
import math
import logging
import weakref
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import needs_cuda, op_names

from gradmon import statistics as S
from gradmon.capture import optimizer
from gradmon.capture import params as params_unit
from gradmon.capture.forward import Forward, LayerHooks
from gradmon.capture.guard import Guards
from gradmon.capture.layers import Layer
from gradmon.capture.loss import LossMean
from gradmon.capture.owners import Owners
from gradmon.capture.params import ParamSlots
from gradmon.capture.values import StepValues
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


def test_whatever_a_module_s_parameter_dict_holds_is_read_at_once():
    """The slots read the modules' parameter dicts, so a parameter put there directly
    (as ``torch.func.functional_call`` does, bypassing ``register_parameter``), set to None
    or deleted is seen at the very next read."""
    lin = nn.Linear(2, 2)
    slots = slots_of(lin)
    assert slots.current() == [lin.weight, lin.bias]
    w = nn.Parameter(torch.zeros(2, 2))
    lin._parameters["weight"] = w
    assert slots.current()[0] is w
    del lin.bias
    assert slots.current() == [w, None]
    lin.weight = None
    assert slots.current() == [None, None]


def test_a_module_given_a_new_parameter_dict_is_read_within_a_few_dozen_reads():
    lin = nn.Linear(2, 2)
    slots = slots_of(lin)
    slots.current()
    w = nn.Parameter(torch.zeros(2, 2))
    lin._parameters = {"weight": w, "bias": lin.bias}
    reads = next((i for i in range(1, 1000) if slots.current()[0] is w), None)
    assert reads is not None and reads <= params_unit._REREAD


def test_a_model_deleted_while_monitored_frees_its_parameters():
    lin = nn.Linear(2, 2)
    slots, weight = slots_of(lin), weakref.ref(lin.weight)
    slots.current()  # holds the modules' parameter dicts from here on
    del lin
    gc.collect()
    assert weight() is None and slots.current() == [None, None]


def test_the_slots_keep_no_model_alive():
    lin = nn.Linear(2, 2)
    slots, gone = slots_of(lin), weakref.ref(lin)
    slots.sync(slots.current(), lambda i, p: None)
    slots.release()
    del lin
    gc.collect()
    assert gone() is None and slots.current() == [None, None]


def test_the_hooks_go_once_a_step_is_measured_at_the_end_of_a_backward_gradmon_saw():
    slots = slots_of(nn.Linear(2, 2))
    slots.measured(seen=True)
    slots.next_step(wanted=False)
    assert not slots.hooked


def test_a_step_not_measured_at_a_seen_backward_keeps_the_hooks():
    slots = slots_of(nn.Linear(2, 2))
    slots.measured(seen=True)
    slots.measured(seen=False)  # a later backward of the same step, unseen
    slots.next_step(wanted=False)
    assert slots.hooked


def test_a_step_measured_from_a_backward_gradmon_did_not_see_keeps_the_hooks_for_good():
    slots = slots_of(nn.Linear(2, 2))
    slots.measured_unseen()
    slots.next_step(wanted=False)
    slots.measured(seen=True)
    slots.next_step(wanted=False)
    assert slots.hooked


def test_wanted_hooks_stay_whatever_the_backwards_were():
    slots = slots_of(nn.Linear(2, 2))
    slots.measured(seen=True)
    slots.next_step(wanted=True)
    assert slots.hooked


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


# -- StepValues ---------------------------------------------------------------------------------

def stepped(*lrs, found_inf=None):
    """What the values read of an optimizer after its step: its groups' learning rates, its flag."""
    return SimpleNamespace(param_groups=[{"lr": lr} for lr in lrs], found_inf=found_inf)


def test_the_step_scalars_come_in_packet_order_with_the_tensor_learning_rates_last():
    values = StepValues()
    values.read_optimizer(stepped(0.1, torch.tensor(0.2), found_inf=torch.tensor([1.0])))
    values.loss.add(2.0)
    scale = torch.tensor(1024.0)
    names = [name for name, _ in values.scalars(scale)]
    assert names == [S.SCALAR_AMP_SCALE, S.SCALAR_AMP_FOUND_INF, S.SCALAR_LOSS, S.learning_rate_scalar(1)]
    assert values.host_learning_rates() == (0.1, None)


def test_the_overflow_flag_rides_as_a_0d_float_tensor_and_is_never_read():
    values = StepValues()
    values.read_optimizer(stepped(0.1, found_inf=torch.tensor([1], dtype=torch.int32)))
    assert values.found_inf.shape == () and values.found_inf.dtype == torch.float32


def test_without_a_scaler_there_is_no_loss_scale():
    values = StepValues(scaler=None)
    values.read_scale()
    assert values.scale is None


def test_rows_measured_again_replace_only_their_own_statistics():
    values, rows = StepValues(), (torch.zeros(1, 3), (0,), (4,))
    values.add({"grad": rows, "update_ratio": rows})
    values.drop((S.GRAD,))
    assert list(values.batched) == ["update_ratio"]


def test_a_closed_step_keeps_nothing_it_collected():
    values = StepValues()
    values.add({"grad": (torch.zeros(1, 3), (0,), (4,))})
    values.read_optimizer(stepped(torch.tensor(0.1), found_inf=torch.tensor(0.0)))
    values.loss.add(1.0)
    values.reset()
    assert (values.batched, values.learning_rates, values.found_inf, values.scale) == ({}, (), None, None)
    assert [t for _, t in values.scalars(None)] == [None, None, None]


# -- Forward ------------------------------------------------------------------------------------

class Backwards:
    """What the forward hooks tell the backward side: outputs a backward starts from, and
    gradient-flow hooks entering a backward."""

    def __init__(self) -> None:
        self.starts: list = []
        self.entered = 0

    def start(self, grad: torch.Tensor) -> None:
        self.starts.append(tuple(grad.shape))

    def enter(self) -> None:
        self.entered += 1


def forward_hooks(*statistics, errors=None):
    errors = errors or ErrorLog("m")
    rec, told = step_records(*statistics, errors=errors), Backwards()
    return Forward(statistics, rec, Guards(errors), errors, told.start, told.enter), rec, told


def hook_root(fwd: Forward, root: nn.Module) -> None:
    root.register_forward_pre_hook(fwd.on_root_forward_pre, with_kwargs=True)
    root.register_forward_hook(fwd.on_root_forward)
    root.register_forward_hook(fwd.on_root_exit, always_call=True)


def test_a_layers_output_is_recorded_on_a_detail_step_and_not_on_an_ordinary_one():
    fwd, rec, _ = forward_hooks(S.ACTIVATION)
    lin = nn.Sequential(nn.Linear(2, 2))
    hook_root(fwd, lin)
    lin[0].register_forward_hook(partial(fwd.on_forward, 1))
    lin(torch.ones(1, 2))
    detail = committed_keys(rec, "activation")
    rec.reset()
    fwd.next_step(detail=False)
    lin(torch.ones(1, 2))
    assert detail == [1] and committed_keys(rec, "activation") == []


def test_an_eval_forward_and_a_no_grad_forward_record_nothing():
    fwd, rec, _ = forward_hooks(S.ACTIVATION)
    lin = nn.Sequential(nn.Linear(2, 2))
    hook_root(fwd, lin)
    lin[0].register_forward_hook(partial(fwd.on_forward, 1))
    with torch.no_grad():
        lin(torch.ones(1, 2))
    lin.eval()
    lin(torch.ones(1, 2))
    assert committed_keys(rec, "activation") == []


def test_inactive_hooks_record_nothing_and_watch_no_backward():
    fwd, rec, told = forward_hooks(S.ACTIVATION)
    lin = nn.Sequential(nn.Linear(2, 2))
    hook_root(fwd, lin)
    lin[0].register_forward_hook(partial(fwd.on_forward, 1))
    fwd.active = False
    lin(torch.ones(1, 2)).sum().backward()
    assert committed_keys(rec, "activation") == [] and told.starts == []


def test_the_roots_output_marks_where_the_backward_starts():
    fwd, _, told = forward_hooks(S.GRAD)
    lin = nn.Linear(2, 3)
    hook_root(fwd, lin)
    lin(torch.ones(1, 2)).sum().backward()
    with torch.no_grad():
        lin(torch.ones(1, 2))
    assert told.starts == [(1, 3)]


def test_a_block_called_alone_marks_the_start_of_the_backward_and_inside_the_root_it_does_not():
    fwd, _, told = forward_hooks(S.BLOCK_FINITE)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
    hook_root(fwd, model)
    fwd.blocks = 2
    for key, block in enumerate(model, start=1):
        block.register_forward_hook(partial(fwd.on_block, key, None))
    model(torch.ones(1, 2)).sum().backward()
    model[0](torch.ones(1, 2)).sum().backward()
    assert told.starts == [(1, 4), (1, 3)]


def test_the_blocks_values_are_recorded_from_the_input_to_the_roots_output():
    fwd, rec, _ = forward_hooks(S.BLOCK_FINITE)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 4))
    hook_root(fwd, model)
    fwd.blocks = 1
    model[0].register_forward_hook(partial(fwd.on_block, 1, None))
    model(torch.ones(1, 2))
    assert committed_keys(rec, "block_finite") == [0, 1, 2]  # input, the block, the root's output


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_a_row_table_checks_each_output_by_row_in_one_kernel_and_all_their_extremes_at_the_end():
    """The accelerator's block check, run on the CPU tensors it is written for: one
    aminmax per output into its slot; finish() then gives every output's min and max,
    NaN kept and an Inf's sign kept; a second finish covers only the slots checked since."""
    from gradmon.capture.records import RowTable

    torch.manual_seed(0)
    outs = [torch.randn(6, 5, 7) for _ in range(3)]
    outs[1][4, 2, 3] = float("nan")
    outs[2][0, 0, 0] = float("-inf")
    table = RowTable(outs[0], 6)
    with op_names() as ops:
        made = [table.check(t) for t in outs[:2]]
    assert [n for n in ops.names if n.startswith(("aminmax", "amin", "amax", "min", "max"))] == ["aminmax"] * 2
    with op_names() as ops:
        table.finish()
    assert sorted(n for n in ops.names if n not in ("select", "slice")) == ["amax", "amin"]  # views: no kernel
    made.append(table.check(outs[2]))
    table.finish()
    for t, (lo, hi, rows) in zip(outs, made):
        by_row = t.reshape(6, -1)
        assert _same(rows, torch.stack(torch.aminmax(by_row, dim=1), dim=1))
        assert _same(lo, by_row.min()) and _same(hi, by_row.max())
    assert math.isnan(made[1][0]) and made[2][0] == float("-inf") and math.isfinite(made[2][1])
    assert [r for r in range(6) if math.isnan(made[1][2][r, 0])] == [4]


@needs_cuda
@pytest.mark.cuda
def test_on_cuda_an_ordinary_forward_checks_the_block_outputs_it_keeps_in_one_launch(attach, monkeypatch):
    """The four blocks' outputs, too large to copy, wait for the end of the forward (the
    forward keeps them: each next Linear saves its input) and are checked by batch row in
    one launch (``counting.row_extremes``); the input, in its hook, takes one aminmax, and
    one amin and one amax when the forward ends. Without Triton every output takes its own
    aminmax in its hook (where each took an aminmax, a min, a max and a stack before)."""
    from gradmon.capture import counting
    from gradmon.capture.records import DEFER_MAX

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))).cuda()
    x = torch.randn(8, 64, 64, device="cuda")
    assert x.numel() > DEFER_MAX
    mon = attach(model, incident_dir="")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):  # past the first (detail) step
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    launches = []
    real = counting.row_extremes
    monkeypatch.setattr(counting, "row_extremes", lambda groups, rows: launches.append(sum(map(len, groups))) or real(groups, rows))
    with op_names() as ops:
        model(x)
    reductions = [n for n in ops.names if n.startswith(("aminmax", "amin", "amax", "min", "max", "stack"))]
    if counting.available():
        assert sorted(reductions) == ["amax", "amin", "aminmax"] and launches == [4], (reductions, launches)
    else:
        assert sorted(reductions) == ["amax", "amin"] + ["aminmax"] * 5 and launches == [], reductions
    assert mon.flush()


def test_gradient_flow_enters_the_backward_then_records_the_gradient():
    fwd, rec, told = forward_hooks(S.ACTIVATION, S.GRAD_FLOW)
    lin = nn.Linear(2, 2)
    lin.register_forward_hook(partial(fwd.on_forward, 1))
    lin(torch.ones(1, 2)).sum().backward()
    rec.commit(rec.each(S.OUTPUT_GRAD), "grad_flow")
    assert told.entered == 1 and committed_keys(rec, "grad_flow") == [1]


def test_the_layer_hooks_are_registered_only_while_wanted():
    lin, calls = nn.Linear(2, 2), []
    hooks = LayerHooks([Layer(0, "lin", lin, tuple(lin.parameters()))], lambda module, *a: calls.append(module))
    hooks.want(True)
    hooks.want(True)  # already there: not twice
    lin(torch.ones(1, 2))
    hooks.want(False)
    lin(torch.ones(1, 2))
    assert calls == [lin]


def test_on_an_ordinary_step_the_layer_hooks_go_unless_every_step_reads_the_layers():
    lin, wanted = nn.Linear(2, 2), {}
    for statistics in ((S.ACTIVATION,), (S.ACTIVATION, S.LAYER_FINITE)):
        fwd, _, _ = forward_hooks(*statistics)
        fwd.layer_hooks = LayerHooks([Layer(0, "lin", lin, tuple(lin.parameters()))], fwd.layer_hook)
        fwd.layer_hooks.want(True)
        fwd.next_step(detail=False)
        fwd.want_layer_hooks()
        wanted[len(statistics)] = bool(fwd.layer_hooks._handles)
        fwd.layer_hooks.remove()
    assert wanted == {1: False, 2: True}


@pytest.mark.parametrize("shapes", [((8, 8), (8,)), ((8, 8), (64,))], ids=["weights-and-biases", "one-size-two-shapes"])
def test_many_small_gradients_are_normed_by_size_as_the_flat_copy_norms_them(monkeypatch, shapes):
    """A deep stack's small gradients come in a few sizes: stacked by size, with no view
    made per tensor; the norms are the flat copy's, non-finite and overflowing ones too. A
    size shared by two shapes (a transformer's wide and tall weights) cannot be stacked:
    they are stacked by shape, and from the next step on by shape at once."""
    from gradmon.capture import kernels as K
    torch.manual_seed(0)
    grads = [torch.randn(shapes[i % 2]) for i in range(400)]
    grads[5].view(-1)[3], grads[8].view(-1)[1], grads[10].view(-1)[0] = float("inf"), float("nan"), 3e38
    flats = []
    real_flat = K._flat
    monkeypatch.setattr(K, "_flat", lambda group, numels=None: flats.append(len(group)) or real_flat(group, numels))
    got = K._segment_norms(grads)
    assert flats == []
    flat, lengths = real_flat(grads)
    want = torch.segment_reduce((flat * flat).double(), "sum", lengths=lengths, unsafe=True).sqrt_()
    assert torch.allclose(got, want, rtol=1e-12, equal_nan=True)
    assert math.isinf(got[5]) and math.isnan(got[8]) and math.isinf(got[10])  # 3e38 squared overflows float32
    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked.append(len(ts)) or real_stack(ts, *a, **k))
    again = K._segment_norms(grads)  # the next step: a size of several shapes is not tried again
    monkeypatch.setattr(torch, "stack", real_stack)
    assert torch.allclose(again, want, rtol=1e-12, equal_nan=True)
    assert stacked == [200, 200], stacked  # a stack per size, or per shape: never all 400 at once again
    few = grads[:K.SIZE_PLAN_MIN - 1]
    flats.clear()
    assert torch.allclose(K._segment_norms(few), want[:len(few)], rtol=1e-12, equal_nan=True)
    assert flats == [len(few)]
