"""The full view under torch.compile (issue 27), on the CPU Inductor backend: the model
compiled whole with ``fullgraph=True`` and gradmon attached runs 100 steps without a graph
break or a recompile (the detail cadence flips every other step, and with it the gate of the
detail statistics' branch), and reports the same activation statistics and the same NaN
origin, on a detail step and on an ordinary one, as an eager twin fed the same batches; the
generated code makes the detail statistics only inside the gated branch.

Inductor compiles cost tens of seconds here, so the module compiles one model, once
(a module-scoped run), and the tests read what it saw.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import gradmon
from torch._inductor.utils import run_and_get_code
from conftest import needs_cuda, scrape

STEPS = 100


def model() -> nn.Module:
    """Top-level blocks ``inp``, ``body`` (a container: not a layer) and ``head``; four
    layers. Linear and ReLU only: Inductor and eager then compute bit-identical outputs,
    so max|x| can be compared exactly."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        inp=nn.Linear(6, 32),
        body=nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)),
        head=nn.Linear(32, 3)))


def train(forward, opt, batches, mon):
    for x in batches:
        loss = forward(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert mon.flush(120)  # a loaded machine: the publisher thread may be minutes behind


def family(samples, name, model):
    """Each layer's value of ``name`` for ``model`` (monitors of a process share one endpoint)."""
    return {dict(labels)["layer"]: v for (n, labels), v in samples.items()
            if n == name and dict(labels)["model"] == model}


@pytest.fixture(scope="module")
def runs():
    """One compiled and one eager monitor over twin models, the same batches, lr 0 (the
    twins stay equal), the code Inductor generated for the first step; then a NaN put in
    ``body``'s last weight of both on a detail step (100), the weights restored and two
    finite steps (the run ends), the NaN again on an ordinary step (103)."""
    torch._dynamo.reset()
    compiled_model, eager_model = model(), model()
    options = dict(port=0, addr="127.0.0.1", final_scrape_timeout=0, detail_every=2, incident_dir="")
    mon_c = gradmon.attach(compiled_model, name="compiled", **options)
    mon_e = gradmon.attach(eager_model, name="eager", **options)
    compiled = torch.compile(compiled_model, fullgraph=True)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.0)
    opt_e = torch.optim.SGD(eager_model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 6, generator=g) * (1 + i % 7) for i in range(STEPS)]
    counters.clear()
    try:
        # compiled here, not taken from the on-disk caches, so that the code is seen
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            _, code = run_and_get_code(train, compiled, opt_c, batches[:1], mon_c)
        with torch._dynamo.config.patch(error_on_recompile=True):
            train(compiled, opt_c, batches[1:], mon_c)
        seen = dict(graph_breaks=dict(counters["graph_break"]), graphs=counters["stats"]["unique_graphs"],
                    recompiles=dict(counters["recompiles"]), code=code)
        train(eager_model, opt_e, batches, mon_e)
        before = {"compiled": scrape(mon_c.url), "eager": scrape(mon_e.url),
                  "errors": (mon_c._errors.counts(), mon_e._errors.counts())}
        kept = [p.detach().clone() for p in eager_model.parameters()]
        nan = {}
        for step, finite_before in ((STEPS, 0), (STEPS + 3, 2)):  # a detail step, an ordinary one
            for net, forward, opt, mon in ((compiled_model, compiled, opt_c, mon_c),
                                           (eager_model, eager_model, opt_e, mon_e)):
                with torch.no_grad():  # lr 0 still spreads a NaN gradient to every weight
                    for p, k in zip(net.parameters(), kept):
                        p.copy_(k)
                with torch._dynamo.config.patch(error_on_recompile=True):
                    train(forward, opt, batches[:finite_before], mon)
                    with torch.no_grad():
                        net.body[3].weight[0, 0] = math.nan
                    train(forward, opt, batches[:1], mon)
            nan[step] = {"compiled": mon_c.snapshot(), "eager": mon_e.snapshot()}
        yield seen, before, nan
    finally:
        mon_c.detach()
        mon_e.detach()
        torch._dynamo.reset()


def test_fullgraph_compile_with_gradmon_attached_neither_breaks_nor_recompiles(runs):
    seen, before, _ = runs
    assert seen["graph_breaks"] == {} and seen["recompiles"] == {}
    assert seen["graphs"] == 1
    assert before["compiled"][("gradmon_steps_total", (("model", "compiled"),))] == STEPS
    assert before["errors"][0] == before["errors"][1] and sum(before["errors"][0].values()) == 0


def test_compiled_activation_statistics_equal_eager(runs):
    _, before, _ = runs
    compiled, eager = before["compiled"], before["eager"]
    for name, rel in (("gradmon_activation_abs_max", 0.0), ("gradmon_activation_rms", 1e-5),
                      ("gradmon_activation_kurtosis", 1e-5)):
        got, want = family(compiled, name, "compiled"), family(eager, name, "eager")
        assert set(got) == set(want) == {"inp", "body.1", "body.3", "head"}, name
        for layer, v in want.items():
            assert got[layer] == pytest.approx(v, rel=rel, abs=0.0), (name, layer)
    # the last step (99) was not a detail step: what is exported is step 98's, on both
    assert family(compiled, "gradmon_grad_norm", "compiled") == pytest.approx(
        family(eager, "gradmon_grad_norm", "eager"), rel=1e-5)


def test_compiled_nan_origin_names_the_same_block_on_the_step(runs):
    _, _, nan = runs
    for step, detail in ((STEPS, True), (STEPS + 3, False)):
        origin = {name: {o.tensor: (o.layer, o.step) for o in snap.nonfinite_origin}
                  for name, snap in nan[step].items()}
        assert origin["compiled"].get("block") == origin["eager"].get("block") == ("body", step + 1), step
        # the activation record, and its origin, only on a detail step
        assert origin["compiled"].get("activation") == (("body.3", step + 1) if detail else None), step
        assert origin["compiled"] == origin["eager"], step


def test_detail_statistics_are_computed_only_in_the_gated_branch(runs):
    """Outside a branch the compiled forward reduces each block's output (min/max, every
    step); the norms and counts of the layers' outputs are inside one branch per top-level
    block (``body``'s two layers share one, made where ``body`` returns), which the host's
    gate skips on ordinary steps."""
    seen = runs[0]
    forward = next(c for c in seen["code"] if "torch.ops.cond" in c)
    body = forward[forward.index("    def call(self, args):"):]
    top = [line.strip() for line in body.splitlines() if line.startswith(" " * 8 + "cpp_fused")]
    gated = [line for line in body.splitlines() if line.startswith(" " * 8 + "if ") and ".item():" in line]
    assert len(gated) == 3  # inp, body (body.1 and body.3), head
    assert any("aminmax" in k for k in top), top
    assert not [k for k in top if "vector_norm" in k or "isnan" in k or "isinf" in k], top
    assert not [k for k in top if "clone" in k], top  # the layers' outputs enter the branch uncopied
    assert "linalg_vector_norm" in forward and "isnan" in forward  # made, inside the branches
    # the branches not taken return tensors left unwritten: no kernel on an ordinary step
    blanks = [re.split(r"\n(?=\S)", part, maxsplit=1)[0] for part in forward.split("\ndef false_graph_")[1:]]
    assert blanks and not [b for b in blanks if "cpp_fused" in b], blanks


def test_attaching_after_the_first_compiled_call_compiles_again_with_gradmons_checks(attach, caplog):
    """torch.compile does not guard on hooks, but it does on a module's forward: the blocks'
    forwards gradmon sets at attach make code compiled before it stale, and the recompiled
    code runs every hook gradmon has by then (the layers' too), with no reset."""
    torch._dynamo.reset()
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 2))
    compiled = torch.compile(net, backend="eager")  # the hooks' story is dynamo's, not Inductor's
    compiled(torch.randn(2, 4))  # compiled with no hook
    mon = attach(net, name="late", detail_every=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        train(compiled, opt, [torch.randn(2, 4)] * 2, mon)
    assert "none of gradmon's forward hooks ran" not in caplog.text and "compiled before" not in caplog.text
    # a layer inside a block (0.0) and a block that is a layer (1)
    assert set(family(scrape(mon.url), "gradmon_activation_rms", "late")) == {"0.0", "1"}
    torch._dynamo.reset()


def test_a_twin_compiled_first_without_gradmon_does_not_serve_the_monitored_one(attach, caplog):
    """Two instances of one class: the unmonitored twin's code, compiled first, is not reused
    for the monitored one (its blocks' forwards differ), which gets code with gradmon's checks."""
    torch._dynamo.reset()
    plain, net = (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(2))
    torch.compile(plain, backend="eager")(torch.randn(2, 4))
    mon = attach(net, name="twin", detail_every=1)
    with caplog.at_level(logging.WARNING, logger="gradmon"):
        train(torch.compile(net, backend="eager"), torch.optim.SGD(net.parameters(), lr=0.01),
              [torch.randn(2, 4)], mon)
    assert "another instance of its class was compiled without gradmon" not in caplog.text
    assert set(family(scrape(mon.url), "gradmon_activation_rms", "twin")) == {"0", "2"}
    torch._dynamo.reset()


class TwoLayers(nn.Module):
    """A block of two layers, whose forward breaks the graph between them where ``broken``,
    and changes the first one's output in place where ``inplace``."""

    def __init__(self, broken: bool = False, inplace: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)
        self.broken, self.inplace = broken, inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        x = x.relu_() if self.inplace else torch.tanh(x)
        if self.broken:
            torch._dynamo.graph_break()
        return self.b(x)


def two_layers(broken: bool = False, inplace: bool = False, eval_mode: bool = False) -> nn.Module:
    """A ``TwoLayers`` block and a head; with ``eval_mode`` the model is in eval mode and the
    block's two layers train."""
    torch.manual_seed(0)
    net = nn.Sequential(TwoLayers(broken, inplace), nn.Linear(8, 2))
    if eval_mode:
        net.eval()
        net[0].a.train()
        net[0].b.train()
    return net


def origins_after_a_nan(attach, nets, forwards, poisoned, batch, **options):
    """Each of ``nets`` (run by its ``forwards``, monitored as ``options`` say) trained two
    finite steps, then one with a NaN put in the weight ``poisoned(net)`` names: the origin
    each monitor names, by tensor, as (layer, step)."""
    found = []
    for i, (net, forward) in enumerate(zip(nets, forwards)):
        mon = attach(net, name=f"net{i}", incident_dir="", **options)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        train(forward, opt, [torch.randn(*batch)] * 2, mon)
        with torch.no_grad():
            poisoned(net)[0, 0] = math.nan
        train(forward, opt, [torch.randn(*batch)], mon)
        found.append({o.tensor: (o.layer, o.step) for o in mon.snapshot().nonfinite_origin})
    return found


@pytest.mark.parametrize("where", ["blocks", "inplace", "block", "layer", "eval"])
def test_layers_whose_branch_waits_for_their_block_are_recorded_across_regions(attach, where):
    """A block's layers share one branch made where the block returns, also where each
    top-level block is compiled by itself (``blocks``, torchtitan's way), and a layer's
    output that the block then changes in place is recorded as the layer returned it
    (``inplace``, compiled by Inductor); the layers of a block split by a graph break
    (``block``), compiled apart from their block (``layer``), or training inside a block and
    a model in eval mode (``eval``: no block record comes, the host makes what waits) are
    still recorded on detail steps, as eager, and compiled once."""
    torch._dynamo.reset()

    net, twin = (two_layers(where == "block", where == "inplace", where == "eval") for _ in range(2))
    mon = attach(net, name="split", detail_every=2, incident_dir="")
    mon_e = attach(twin, name="plain", detail_every=2, incident_dir="")
    if where == "block":
        forward = torch.compile(net, backend="eager")
    elif where == "eval":
        forward = torch.compile(net, backend="eager", fullgraph=True)
    elif where == "inplace":
        forward = torch.compile(net, fullgraph=True)
    elif where == "blocks":
        for block in net:
            block.compile(backend="eager", fullgraph=True)
        forward = net
    else:
        for layer in (net[0].a, net[0].b):
            layer.compile(backend="eager")
        forward = net
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(3, 4, generator=g) * (1 + i) for i in range(7)]
    train(forward, torch.optim.SGD(net.parameters(), lr=0.0), batches[:2], mon)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        train(forward, torch.optim.SGD(net.parameters(), lr=0.0), batches[2:], mon)
    assert dict(counters["recompiles"]) == {}
    train(twin, torch.optim.SGD(twin.parameters(), lr=0.0), batches, mon_e)
    got, want = scrape(mon.url), scrape(mon_e.url)
    for name in ("gradmon_activation_rms", "gradmon_activation_abs_max"):
        assert set(family(got, name, "split")) == ({"0.a", "0.b"} if where == "eval" else {"0.a", "0.b", "1"}), name
        assert family(got, name, "split") == pytest.approx(family(want, name, "plain"), rel=1e-6), name
    assert sum(mon._errors.counts().values()) == 0
    torch._dynamo.reset()


def test_a_layer_left_waiting_at_a_regions_end_names_the_origin_on_an_ordinary_step(attach):
    """A model in eval mode whose block's layers train: no block record settles what the
    layers left waiting, and the host takes it. On an ordinary step the every-step layer
    records (``origin_per_layer``) still come, so the NaN's layer is named, as eager names it."""
    torch._dynamo.reset()
    nets = two_layers(eval_mode=True), two_layers(eval_mode=True)
    forwards = torch.compile(nets[0], backend="eager", fullgraph=True), nets[1]
    found = origins_after_a_nan(attach, nets, forwards, lambda net: net[0].b.weight, (3, 4),
                                detail_every=100, origin_per_layer=True)
    assert found[0].get("activation") == found[1].get("activation") == ("0.b", 3), found
    torch._dynamo.reset()


@pytest.mark.parametrize("poisoned", ["inp", "head"])
def test_a_block_that_is_also_a_layer_names_the_origin_under_compile(attach, poisoned):
    """A top-level block that is also a layer leaves two records a forward (the layer's and
    the block's, on one module): both come back from the compiled region, so a NaN made by
    such a block is blamed on it on the step, as eager blames it."""
    torch._dynamo.reset()
    nets = model(), model()
    forwards = torch.compile(nets[0], backend="eager", fullgraph=True), nets[1]
    found = origins_after_a_nan(attach, nets, forwards, lambda net: getattr(net, poisoned).weight, (8, 6),
                                detail_every=100)
    assert found[0].get("block") == found[1].get("block") == (poisoned, 3), found
    torch._dynamo.reset()


class KeepingBackend:
    """A dynamo backend that runs the graphs it is given as they are and keeps them; its
    ``config`` stands for the options Inductor's wrapper carries for a compile mode."""

    def __init__(self, config):
        self.config, self.graphs = config, []

    def get_compiler_config(self):  # as torch.compile's Inductor wrapper answers
        return self.config

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.mark.parametrize("config, gated", [({}, True), ({"triton.cudagraphs": True}, False)],
                         ids=["plain", "cuda-graphs"])
def test_where_the_region_is_replayed_as_cuda_graphs_the_detail_statistics_are_made_ungated(attach, config, gated):
    """Inductor replays no graph holding a ``torch.cond`` as a CUDA graph: under a mode that
    replays graphs (reduce-overhead, max-autotune) the detail statistics are made on every
    step, outside any branch, and what is exported is still the detail steps' own (batches
    of different scales show a leak of an ordinary step's records)."""
    torch._dynamo.reset()
    nets = [model(), model()]
    mons = [attach(net, name=name, detail_every=2) for net, name in zip(nets, ("compiled", "eager"))]
    backend = KeepingBackend(config)
    forwards = [torch.compile(nets[0], backend=backend, fullgraph=True), nets[1]]
    batches = [torch.randn(8, 6) * (1 + 3 * i) for i in range(4)]  # steps 0 and 2 are detail steps
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for forward, net, mon in zip(forwards, nets, mons):
                train(forward, torch.optim.SGD(net.parameters(), lr=0.0), batches, mon)
    finally:
        torch._dynamo.reset()
    assert len(backend.graphs) == 1
    ops = {node.target for node in backend.graphs[0].graph.nodes}
    assert (torch.ops.higher_order.cond in ops) is gated
    seen = [scrape(mon.url) for mon in mons]
    for name in ("gradmon_activation_abs_max", "gradmon_activation_rms"):
        got, want = family(seen[0], name, "compiled"), family(seen[1], name, "eager")
        assert set(got) == set(want) == {"inp", "body.1", "body.3", "head"}, name
        assert got == pytest.approx(want, rel=1e-6), name


@needs_cuda
@pytest.mark.cuda
def test_reduce_overhead_keeps_its_cuda_graphs_and_the_statistics_equal_eager():
    """``mode="reduce-overhead"`` replays the compiled forward and backward as CUDA graphs:
    gradmon's records are outputs of those graphs, in memory the next replay overwrites, so
    they must be taken before it, and nothing gradmon traces (the gate of the detail branch
    among them) may make Inductor skip the graphs, which would cost the job the mode's
    whole gain without a word."""
    torch._dynamo.reset()
    compiled_model, eager_model = model().cuda(), model().cuda()
    options = dict(port=0, addr="127.0.0.1", final_scrape_timeout=0, detail_every=2, incident_dir="")
    mon_c = gradmon.attach(compiled_model, name="compiled", **options)
    mon_e = gradmon.attach(eager_model, name="eager", **options)
    try:
        compiled = torch.compile(compiled_model, mode="reduce-overhead", fullgraph=True)
        opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.0)
        opt_e = torch.optim.SGD(eager_model.parameters(), lr=0.0)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 6, generator=g) * (1 + i % 7)).cuda() for i in range(20)]
        counters.clear()
        train(compiled, opt_c, batches[:1], mon_c)  # compiled, and recorded as graphs
        with torch._dynamo.config.patch(error_on_recompile=True):
            train(compiled, opt_c, batches[1:], mon_c)
        skips = dict(counters["inductor"])
        train(eager_model, opt_e, batches, mon_e)
        compiled_seen, eager_seen = scrape(mon_c.url), scrape(mon_e.url)
        errors = mon_c._errors.counts()
    finally:
        mon_c.detach()
        mon_e.detach()
        torch._dynamo.reset()
    assert skips.get("cudagraph_skips", 0) == 0, skips
    assert sum(errors.values()) == 0, errors
    for name in ("gradmon_activation_abs_max", "gradmon_activation_rms", "gradmon_grad_norm"):
        got, want = family(compiled_seen, name, "compiled"), family(eager_seen, name, "eager")
        assert set(got) == set(want) and want, name
        for layer, v in want.items():  # Inductor's GPU kernels round apart from eager's
            assert got[layer] == pytest.approx(v, rel=1e-4), (name, layer)
