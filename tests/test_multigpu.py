"""Multi-rank jobs for real: two processes, gloo, DistributedDataParallel, on the CPU (issue 4)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml

import ddp_worker
from conftest import scrape, value
from servers import Prometheus, free_port, free_port_range, grafana_substitute

pytestmark = pytest.mark.slow
WORLD = 2


class Job:
    """Two DDP ranks driven phase by phase; each rank serves on base port + local rank."""

    def __init__(self, work: Path, plan: list, fail_rank: int = -1) -> None:
        self.work, self.plan = work, plan
        self.base = free_port_range(WORLD)
        self.ctx = mp.start_processes(ddp_worker.run, args=(WORLD, str(work), free_port(), self.base, plan, fail_rank),
                                      nprocs=WORLD, join=False, start_method="spawn")

    def reached(self, phase: str, timeout: float = 120, world: int = WORLD) -> list:
        deadline = time.monotonic() + timeout
        files = [self.work / f"{phase}.{r}.ready" for r in range(world)]
        while not all(f.exists() for f in files):
            assert time.monotonic() < deadline, f"ranks did not reach {phase}"
            assert all(p.is_alive() for p in self.ctx.processes), "a rank died"
            time.sleep(0.1)
        return [json.loads(f.read_text()) for f in files]

    def go(self, phase: str) -> None:
        (self.work / f"{phase}.go").write_text("")

    def finish(self, timeout: float = 60) -> None:
        for phase in self.plan:
            self.go(phase["name"])
        deadline = time.monotonic() + timeout
        while not self.ctx.join(1):  # returns as each rank exits; True once all have
            assert time.monotonic() < deadline, "ranks did not finish in time"


def reference_norms(steps: int):
    """Single process on the concatenated batch: the reduced gradient DDP must produce,
    and each rank's own gradient at the same weights."""
    model = ddp_worker.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def grads_for(ranks):
        model.zero_grad()
        for micro in range(2):
            x = torch.cat([ddp_worker.batch(r, step, micro) for r in ranks])
            (model(x).pow(2).mean() / 2).backward()
        return {str(i): math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model[i].parameters()))
                for i in (0, 2, 4)}

    for step in range(steps):
        local = {r: grads_for([r]) for r in range(WORLD)}
        reduced = grads_for(list(range(WORLD)))  # mean over the concatenated batch = DDP's average
        opt.step()
    return reduced, local


def test_ddp_reduced_and_local_views_match_single_process_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADMON_ALL_RANKS_PER_LAYER", "1")  # rank 1's own per-layer series too (spawn inherits it)
    job = Job(tmp_path, [{"name": "clean", "steps": 3}])
    try:
        ready = job.reached("clean")
        assert [r["url"].rsplit(":", 1)[1].split("/")[0] for r in ready] == [str(job.base), str(job.base + 1)]
        scraped = [scrape(r["url"]) for r in ready]
    finally:
        job.finish()
    reduced, local = reference_norms(3)
    for rank, s in enumerate(scraped):
        assert value(s, "gradmon_world_size") == 2
        assert value(s, "gradmon_steps_total") == 3  # two micro-batches, one sample per step
        assert math.isclose(value(s, "gradmon_grad_global_norm"), math.sqrt(sum(v * v for v in reduced.values())),
                            rel_tol=1e-5)
        for layer, want in reduced.items():
            if rank == 0:  # identical on every rank by construction: rank 0 carries the per-layer series
                assert math.isclose(value(s, "gradmon_grad_norm", layer=layer), want, rel_tol=1e-5), (rank, layer)
            else:
                assert not [k for k in s if k[0] == "gradmon_grad_norm"]
            assert math.isclose(value(s, "gradmon_local_grad_norm", layer=layer), local[rank][layer], rel_tol=1e-5), (rank, layer)
        assert local[0] != local[1]  # the local views really differ per rank
        # the reduced global norm's histogram is the same on every rank: rank 0 alone exports it
        histogram = [k for k in s if k[0].startswith("gradmon_grad_global_norm_distribution")]
        assert (value(s, "gradmon_grad_global_norm_distribution_count") == 3) if rank == 0 else not histogram
        # the reduced norm's spikes are counted once per job (rank 0), each rank's own on that rank
        signals = {dict(k[1])["signal"] for k in s if k[0] == "gradmon_spike_steps_total"}
        assert signals == ({"loss", "grad_norm", "local_grad_norm", "layer_grad_norm"} if rank == 0
                           else {"loss", "local_grad_norm"})


def series_count(s) -> int:
    return len(s)


def test_other_ranks_export_few_series_and_name_their_own_blow_up_and_nan_by_layer(tmp_path, monkeypatch):
    """At the defaults rank 1 exports no per-layer series; what only its own data shows (a
    blow-up, a NaN before the all-reduce averages it) is still named there, with the layer."""
    monkeypatch.setenv("GRADMON_BASELINE_WARMUP", "0")  # 12 calm steps make the baselines (the ranks inherit it)
    monkeypatch.setenv("GRADMON_ATTENTION_LAYERS", "0")  # the first Linear stands for a query projection
    job = Job(tmp_path, [{"name": "calm", "steps": 12, "lr": 0.0},  # one lr: a jump restarts the baselines
                         {"name": "blowup", "steps": 2, "input_scale_by_rank": {"1": 100.0},
                          "loss_scale_by_rank": {"1": 100.0}, "lr": 0.0},
                         {"name": "nan", "steps": 3, "nan_rank": 1, "nan_step": 15, "lr": 0.0}])
    try:
        calm = [scrape(r["url"]) for r in job.reached("calm")]
        job.go("calm")
        blowup = [scrape(r["url"]) for r in job.reached("blowup")]
        job.go("blowup")
        nan = [scrape(r["url"]) for r in job.reached("nan")]
    finally:
        job.finish()
    s0, s1 = calm
    assert series_count(s1) <= 100 < series_count(s0), (series_count(s0), series_count(s1))
    assert not [k for k in s1 if k[0] in ("gradmon_local_grad_norm", "gradmon_activation_abs_max",
                                          "gradmon_nonfinite_total", "gradmon_local_nonfinite_total")]
    for tensor in ("local_grad", "grad_flow", "activation"):  # at 0 from the start: increase() sees the first
        assert value(s1, "gradmon_rank_nonfinite_total", tensor=tensor, kind="nan") == 0
    assert not [k for k in s1 if k[0] == "gradmon_rank_nonfinite_total" and dict(k[1])["tensor"] == "grad"]
    # rank 1's data alone blew up: its own worst layer says so, rank 0's does not
    b0, b1 = blowup
    worst = {r: [(dict(k[1])["layer"], v) for k, v in s.items() if k[0] == "gradmon_activation_abs_max_worst"]
             for r, s in enumerate(blowup)}
    assert len(worst[0]) == len(worst[1]) == 1
    assert worst[1][0][1] > 10 * worst[0][0][1], worst
    # its projection grew there: the rank-level growth names it and its doubling counted there only
    growth = {r: [(dict(k[1])["layer"], v) for k, v in s.items() if k[0] == "gradmon_activation_growth_worst"]
              for r, s in enumerate(blowup)}
    assert growth[1][0][0] == "0" and growth[1][0][1] > 8 > growth[0][0][1], growth
    assert [value(s, "gradmon_spike_steps_total", signal="attention_growth") for s in blowup] == [0, 1]
    ratio = {r: [(dict(k[1])["layer"], v) for k, v in s.items() if k[0] == "gradmon_local_grad_norm_baseline_ratio_worst"]
             for r, s in enumerate(blowup)}
    assert ratio[1][0][1] > 10 and ratio[0][0][1] < 4, ratio
    assert ratio[1][0][0] in {"0", "2", "4"}
    # both blown-up steps counted on rank 1 as a run above its baseline, none on rank 0
    assert [value(s, "gradmon_local_grad_norm_above_baseline_steps") for s in blowup] == [0, 2]
    # a NaN in rank 1's data: counted there before the all-reduce, named by its origin layer
    n0, n1 = nan
    assert value(n1, "gradmon_rank_nonfinite_total", tensor="local_grad", kind="nan") > 0
    assert value(n0, "gradmon_rank_nonfinite_total", tensor="local_grad", kind="nan") == 0
    assert all(value(n0, "gradmon_local_nonfinite_total", layer=l, kind=k) == 0
               for l in ("0", "2", "4") for k in ("nan", "inf"))
    # after the all-reduce both ranks hold the NaN: rank 0 carries the reduced per-layer counters
    assert value(n0, "gradmon_nonfinite_total", layer="0", tensor="grad", kind="nan") > 0
    assert value(n1, "gradmon_nonfinite_origin_step", tensor="grad", layer="4") == 16  # last layer, first in backward
    assert series_count(n1) <= series_count(s1) + 50


def test_data_parallel_rank_0_of_each_stage_carries_the_per_layer_series(tmp_path):
    mp.start_processes(ddp_worker.run_stages, args=(4, str(tmp_path), free_port()), nprocs=4, join=True,
                       start_method="spawn")
    counts = {}
    for rank in range(4):
        text = (tmp_path / f"stages.{rank}.txt").read_text()
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        counts[rank] = (len(samples), any(line.startswith("gradmon_grad_norm{") for line in samples))
    # ranks 0 and 2 are rank 0 of their stage's DDP group: per-layer series; 1 and 3 a few rank-level ones
    assert counts[0][1] and counts[2][1] and not counts[1][1] and not counts[3][1], counts
    assert counts[1][0] <= 100 and counts[3][0] <= 100 and counts[0][0] > 100 and counts[2][0] > 100, counts


def test_gradmon_failing_on_one_rank_never_hangs_the_job(tmp_path):
    t0 = time.monotonic()
    job = Job(tmp_path, [{"name": "run", "steps": 5}], fail_rank=1)
    try:
        s0, s1 = (scrape(r["url"]) for r in job.reached("run"))
    finally:
        job.finish()
    assert time.monotonic() - t0 < 120
    assert value(s1, "gradmon_hook_errors_total", stage="backward") >= 5
    assert value(s1, "gradmon_steps_total") == 5 and value(s0, "gradmon_steps_total") == 5
    assert value(s0, "gradmon_hook_errors_total", stage="backward") == 0


def test_one_prometheus_scrapes_both_ranks_and_a_diverging_rank_fires_the_rule(tmp_path, monkeypatch):
    from gradmon import alerting
    monkeypatch.setenv("GRADMON_BASELINE_WARMUP", "5")  # the rules' warm-up below (the ranks inherit it)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(alerting.rule_groups(
        replace(alerting.Thresholds(), warmup_steps=5), alerting.PRODUCTION.scaled(alerting.TEST_SCALE))))
    prom = Prometheus(tmp_path, "1s", [rules])
    job = Job(tmp_path, [{"name": "diverge", "steps": 150, "delay": 0.05, "loss_scale_by_rank": {"1": 50.0}, "lr": 0.0}])
    try:
        prom.set_targets([{"targets": [f"127.0.0.1:{job.base}", f"127.0.0.1:{job.base + 1}"],
                           "labels": {"job": "ddp"}}])
        deadline = time.monotonic() + 90
        firing = []
        while time.monotonic() < deadline and not firing:
            firing = prom.query('ALERTS{alertname="GradmonRankDivergence", alertstate="firing"}')
            time.sleep(0.5)
        by_rank = {s["metric"]["rank"] for s in prom.query('gradmon_local_grad_global_norm{job="ddp"}')}
        panels = {}
        for board in ("ranks",):
            for panel in json.loads((Path(__file__).resolve().parents[1] / "dashboards" / f"{board}.json").read_text())["panels"]:
                if "local" in panel["title"].lower():
                    panels[panel["title"]] = prom.query(grafana_substitute(
                        panel["targets"][0]["expr"], job="(ddp)", model="(sequential)", rank="(0|1)"))
        job.reached("diverge")
    finally:
        job.finish()
        prom.stop()
    assert by_rank == {"0", "1"}
    assert [a["metric"]["rank"] for a in firing] == ["1"]
    assert len(panels) == 3 and all(panels.values()), panels  # the Ranks dashboard's multi-rank panels


def fsdp_job(work: Path, steps: int, fail_rank: int = -1, world: int = WORLD, replicas: int = 1,
             flavour: str = "fsdp2"):
    base = free_port_range(world)
    ctx = mp.start_processes(ddp_worker.run_fsdp,
                             args=(world, str(work), free_port(), base, steps, fail_rank, replicas, flavour),
                             nprocs=world, join=False, start_method="spawn")
    job = Job.__new__(Job)
    job.work, job.plan, job.base, job.ctx = work, [{"name": "fsdp"}], base, ctx
    return job


@pytest.mark.parametrize("world, replicas, flavour", [(2, 1, "fsdp2"), (4, 2, "fsdp2"), (2, 1, "fsdp1"),
                                                     (2, 1, "fsdp1-flat")],
                         ids=["fsdp2-uneven", "hsdp-2x2", "fsdp1-orig-params", "fsdp1-flat-params"])
def test_fsdp_per_layer_norms_equal_the_unsharded_gradient_with_uneven_shards(tmp_path, monkeypatch, world, replicas,
                                                                             flavour):
    """HSDP's replicate dimension holds copies: summing over it would double the norm. FSDP1
    shards each unit's flat parameter: a parameter may lie wholly on another rank, and its
    layer's norm still includes it; without use_orig_params the layers are the FSDP units
    (one Linear each here), named as in the unwrapped model and stated in coverage. The
    parameters' own norms (gradmon_param_norm, read at steps 0 and 2) combine the same way."""
    monkeypatch.setenv("GRADMON_OPTIMIZER_EVERY", "2")  # spawn inherits it
    job = fsdp_job(tmp_path, steps=3, world=world, replicas=replicas, flavour=flavour)
    try:
        ready = job.reached("fsdp", world=world)
        scraped = [scrape(r["url"]) for r in ready]
    finally:
        job.finish()
    assert ready[0]["layers"] == ["0", "2"]
    assert bool(ready[0]["limits"]) == (flavour == "fsdp1-flat"), ready[0]["limits"]
    model = ddp_worker.make_fsdp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        model.zero_grad()
        model(torch.cat([ddp_worker.fsdp_batch(r, step) for r in range(world)])).pow(2).mean().backward()
        want = {str(i): math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model[i].parameters())) for i in (0, 2)}
        opt.step()
    weights = {str(i): math.sqrt(sum(p.detach().double().pow(2).sum().item() for p in model[i].parameters()))
               for i in (0, 2)}
    for rank, s in enumerate(scraped):
        for layer, norm in want.items():
            if rank == 0:
                assert math.isclose(value(s, "gradmon_grad_norm", layer=layer), norm, rel_tol=1e-5), (rank, layer)
                assert math.isclose(value(s, "gradmon_param_norm", layer=layer), weights[layer], rel_tol=1e-5), layer
            else:
                assert not [k for k in s if k[0] == "gradmon_param_norm"]  # rank 0 alone exports reduced series
        assert math.isclose(value(s, "gradmon_grad_global_norm"), math.sqrt(sum(v * v for v in want.values())), rel_tol=1e-5)


def test_fsdp2_gradmon_failing_on_one_rank_still_joins_the_collective(tmp_path):
    t0 = time.monotonic()
    job = fsdp_job(tmp_path, steps=4, fail_rank=1)
    try:
        s0, s1 = (scrape(r["url"]) for r in job.reached("fsdp", timeout=60))
    finally:
        job.finish()
    assert time.monotonic() - t0 < 90  # nobody waited forever in an all-reduce
    assert value(s1, "gradmon_hook_errors_total", stage="backward") == 4
    assert value(s0, "gradmon_steps_total") == 4 and value(s1, "gradmon_steps_total") == 4
    assert math.isnan(value(s0, "gradmon_grad_global_norm"))  # rank 0 dropped values it could not complete


def test_only_shard_placements_are_summed_for_tensor_parallel_layouts():
    """(Shard, Replicate) as FSDP x TP lays a replicated TP parameter out: only mesh dim 0
    is summed. The multi-rank arithmetic itself is the HSDP test's; this pins the choice."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gradmon.capture import sharded

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        params = [distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Replicate()]),
                  distribute_tensor(torch.randn(4), mesh, [Replicate(), Replicate()]),
                  distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)]),
                  torch.randn(3)]
        groups = sharded.plan(params)
        assert sorted((g.dims, g.params) for g in groups) == [((0,), [0]), ((0, 1), [2])]
    finally:
        dist.destroy_process_group()
