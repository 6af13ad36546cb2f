"""One bad value never takes the endpoint down (issue 21, part 3): a name that is not
UTF-8, a tensor gradmon cannot measure, a model whose series fail, a wrong step number,
and the counters carried for monitors that come and go.

Real models, real training steps, real scrapes over HTTP (and a real Prometheus where
that is what the behaviour is for)."""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Callable, Dict

import pytest
import torch
from torch import nn

from gradmon.serve import collector
from conftest import Key, fresh, scrape, value
from servers import Prometheus

POISON = "blk\udcff"  # a lone surrogate: what bytes that are not UTF-8 become in a str


def poisoned_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model.add_module(POISON, nn.Linear(4, 2))  # add_module takes any str
    return model


def train(model: nn.Module, steps: int, nan_at: int = -1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        x = torch.randn(3, 4)
        if i == nan_at:
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def models_in(samples: Dict[Key, float]) -> Dict[str, float]:
    return {dict(labels)["model"]: v for (name, labels), v in samples.items() if name == "gradmon_steps_total"}


# --- names that are not UTF-8 --------------------------------------------------------------

def test_a_module_name_that_is_not_utf8_is_escaped_and_every_model_on_the_endpoint_is_served(attach):
    healthy = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    first = attach(healthy, name="healthy")
    model = poisoned_model()
    poisoned = attach(model, name="poisoned")
    assert poisoned.url == first.url  # port=0 twice: one shared endpoint
    assert poisoned.layers == ("0", "blk\\udcff")
    train(healthy, 2)
    train(model, 3)
    assert first.flush() and poisoned.flush()
    samples = scrape(first.url)
    assert models_in(samples) == {"healthy": 2, "poisoned": 3}
    assert value(samples, "gradmon_grad_norm", model="poisoned", layer="blk\\udcff") > 0


def test_prometheus_scrapes_a_shared_endpoint_with_a_poisoned_module_name(attach, tmp_path):
    healthy = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    first = attach(healthy, name="healthy")
    model = poisoned_model()
    attach(model, name="poisoned")
    train(healthy, 2)
    train(model, 2)
    prom = Prometheus(tmp_path, "1s")
    try:
        prom.set_targets([{"targets": [f"127.0.0.1:{first.port}"]}])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            up = prom.query("up")
            if up and up[0]["value"][1] == "1" and len(prom.query("gradmon_steps_total")) == 2:
                break
            time.sleep(0.5)
        assert [r["value"][1] for r in prom.query("up")] == ["1"]
        layers = {r["metric"]["layer"] for r in prom.query('gradmon_grad_norm{model="poisoned"}')}
        assert layers == {"0", "blk\\udcff"}
        assert {r["metric"]["model"] for r in prom.query("gradmon_steps_total")} == {"healthy", "poisoned"}
    finally:
        prom.stop()


def test_a_model_whose_series_fail_is_left_out_alone_and_its_failures_are_counted_in_the_same_scrape(
        attach, monkeypatch, caplog):
    good = attach(nn.Sequential(nn.Linear(4, 2)), name="good")
    bad = attach(nn.Sequential(nn.Linear(4, 2)), name="bad")
    real = collector.add_view

    def failing_for_bad(fam, view):
        real(fam, view)  # every family is under way when it fails: none of it may be served
        if view.labels["model"] == "bad":
            raise RuntimeError("injected")

    monkeypatch.setattr(collector, "add_view", failing_for_bad)
    with caplog.at_level(logging.ERROR, logger="gradmon"):
        for scrapes in (1, 2, 3):
            samples = scrape(good.url)
            assert value(samples, "gradmon_hook_errors_total", model="bad", stage="collect") == scrapes
            assert value(samples, "gradmon_steps_total", model="good") == 0
            assert not [k for k in samples if dict(k[1]).get("model") == "bad"
                        and k[0] != "gradmon_hook_errors_total"]
    assert caplog.text.count("error in collect stage") == 1
    assert bad.state == "running"


def test_a_retired_model_whose_series_fail_is_counted_too(attach, monkeypatch):
    good = attach(nn.Sequential(nn.Linear(4, 2)), name="good")
    gone = attach(nn.Sequential(nn.Linear(4, 2)), name="gone")
    gone.detach()  # its final view stays served while "good" uses the endpoint
    real = collector.add_view

    def failing_for_gone(fam, view):
        if view.labels["model"] == "gone":
            raise RuntimeError("injected")
        real(fam, view)

    monkeypatch.setattr(collector, "add_view", failing_for_gone)
    scrape(good.url)
    samples = scrape(good.url)
    assert value(samples, "gradmon_hook_errors_total", model="gone", stage="collect") == 2
    assert value(samples, "gradmon_steps_total", model="good") == 0


def test_an_exposition_that_cannot_be_rendered_at_all_is_a_500_not_a_dropped_connection(attach, monkeypatch):
    import urllib.error
    mon = attach(nn.Sequential(nn.Linear(4, 2)))

    def broken(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(collector.GradmonCollector, "collect", broken)
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape(mon.url)
    assert err.value.code == 500
    monkeypatch.undo()
    assert value(scrape(mon.url), "gradmon_hook_errors_total", stage="collect") == 1


# --- tensors gradmon cannot measure ----------------------------------------------------------

def _fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return torch.randn(4)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])


def _jagged() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)


EXTRAS: Dict[str, Callable[[], torch.Tensor]] = {
    "meta": lambda: torch.empty(4, device="meta"),
    "fake": _fake,
    "nested": _nested,
    "jagged": _jagged,
    "sparse": lambda: torch.randn(4, 4).to_sparse(),
    "int": lambda: torch.arange(4),
    "complex": lambda: torch.randn(4, dtype=torch.cfloat),
}


class TupleLayer(nn.Module):
    """A layer (it owns its weight) and a top-level block, whose output is a tuple of its
    value and a tensor gradmon cannot measure: both hook kinds see the odd tensor."""

    def __init__(self, extra: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) / 2)
        self.extra = extra

    def forward(self, x: torch.Tensor):
        return torch.tanh(x @ self.weight), self.extra


class Net(nn.Module):
    def __init__(self, extra: torch.Tensor) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.odd = TupleLayer(extra)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.odd(x)
        return self.head(y)


def global_norm(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


def check_every_step_is_exported_exactly(mon, model: nn.Module, steps: int = 4, nan_at: int = 3) -> Dict[Key, float]:
    """Each step: flushed, scraped, and its global norm and non-finite count exact (the NaN
    comes last: it makes the weights NaN). Returns the scrape of the last finite step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nonfinite = 0
    for i in range(steps):
        x = torch.randn(3, 4)
        if i == nan_at:
            x[0, 0] = float("nan")
            nonfinite += 1
        model(x).pow(2).mean().backward()
        expected = global_norm(model)
        opt.step()
        opt.zero_grad()
        samples = fresh(mon)
        assert value(samples, "gradmon_steps_total") == i + 1
        assert value(samples, "gradmon_nonfinite_steps_total") == nonfinite, f"step {i}"
        norm = value(samples, "gradmon_grad_global_norm")
        assert math.isnan(norm) if i == nan_at else norm == pytest.approx(expected, rel=1e-6), f"step {i}"
        assert value(samples, "gradmon_hook_errors_total", stage="step") == 0
        if i == nan_at - 1:
            finite = samples
    assert value(samples, "gradmon_grad_global_norm_distribution_count") == steps - nonfinite  # finite norms
    return finite


@pytest.mark.parametrize("kind", list(EXTRAS))
def test_an_unmeasurable_tensor_among_a_layers_outputs_costs_only_its_own_record(attach, kind, caplog):
    model = Net(EXTRAS[kind]())
    mon = attach(model, detail_every=1)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        samples = check_every_step_is_exported_exactly(mon, model)
    # the layer's own value (a tanh) is still measured, and nothing of the odd tensor
    assert 0 < value(samples, "gradmon_activation_abs_max", layer="odd") <= 1
    assert value(samples, "gradmon_hook_errors_total", stage="forward") == 0
    if kind in ("meta", "fake", "nested"):  # kinds that look measurable are named once
        assert caplog.text.count("which has no values gradmon can reduce") == 1


def test_a_dtensor_that_is_not_replicated_costs_only_its_own_record_and_a_replicated_one_is_measured(attach):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from servers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sevens = torch.full((4, 4), -7.0)
        model = Net(distribute_tensor(sevens, mesh, [Shard(0)]))
        mon = attach(model, detail_every=1, name="sharded")
        samples = check_every_step_is_exported_exactly(mon, model)
        assert value(samples, "gradmon_activation_abs_max", layer="odd") <= 1  # the shard is not read
        model = Net(distribute_tensor(sevens, mesh, [Replicate()]))
        mon = attach(model, detail_every=1, name="replicated")
        samples = check_every_step_is_exported_exactly(mon, model)
        assert value(samples, "gradmon_activation_abs_max", layer="odd") == 7.0  # its local copy is
    finally:
        dist.destroy_process_group()


# --- step numbers -----------------------------------------------------------------------------

@pytest.mark.parametrize("wrong", ["abc", 3.0, True, torch.tensor(3)], ids=["str", "float", "bool", "tensor"])
def test_a_step_number_that_is_not_an_integer_is_a_type_error_at_the_call_naming_the_argument(attach, wrong):
    mon = attach(nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(TypeError, match=r"Monitor.step\(global_step=\.\.\.\) takes an integer"):
        mon.step(wrong)


def test_a_numpy_integer_is_a_step_number(attach):
    np = pytest.importorskip("numpy")
    model = nn.Sequential(nn.Linear(4, 2))
    mon = attach(model)
    train(model, 1)
    mon.step(np.int64(500))
    assert value(fresh(mon), "gradmon_step") == 500


# --- counters carried for detached monitors ---------------------------------------------------

def test_carried_counters_are_bounded_and_a_dropped_series_ends_rather_than_restarting_at_zero(attach, monkeypatch):
    from gradmon import monitor
    from gradmon.aggregate import CarriedCounters
    monkeypatch.setattr(monitor, "_CARRIED", CarriedCounters(most=3))
    model = nn.Sequential(nn.Linear(4, 2))
    for run in range(5):  # a sweep: each trial under its own label
        mon = attach(model, labels={"trial": str(run)})
        train(model, run + 1)
        mon.flush()
        mon.detach()
    assert len(monitor._CARRIED) == 3  # trials 2, 3, 4
    again = attach(model, labels={"trial": "4"})  # kept: continues
    assert again.name == "sequential"
    assert value(fresh(again), "gradmon_steps_total") == 5
    again.detach()
    dropped = attach(model, labels={"trial": "0"})  # dropped: a new series, never 0 under the old labels
    assert dropped.name == "sequential-2"
    assert value(fresh(dropped), "gradmon_steps_total") == 0


class Aloof(torch.Tensor):
    """A tensor subclass whose values reduce like any tensor's but refuse to be stacked
    with plain tensors (as a subclass's own dispatch may)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.stack and not all(type(t) is cls for t in args[0]):
            raise RuntimeError("Aloof values are stacked only with their own kind")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_records_of_a_tensor_subclass_that_cannot_join_the_others_cost_only_themselves(attach):
    model = Net(torch.full((4,), 5.0).as_subclass(Aloof))
    mon = attach(model, detail_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 3):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        expected = global_norm(model)
        opt.step()
        opt.zero_grad()
        samples = fresh(mon)
        assert value(samples, "gradmon_grad_global_norm") == pytest.approx(expected, rel=1e-6)
        assert 0 < value(samples, "gradmon_activation_abs_max", layer="odd") <= 1  # the plain output
        assert value(samples, "gradmon_steps_total") == step
        assert value(samples, "gradmon_hook_errors_total", stage="step") >= step  # the dropped records
