"""Beyond one Prometheus (issue 12, part 3): the shipped fleet configs pass promtool, and two
real Prometheus servers running the shipped shard relabelling split a fleet of simulated
ranks (real gradmon expositions, 8 ranks in each of 2 jobs) by job, each job's ranks whole
on one shard, so the cross-rank divergence alert still fires, once, for the divergent rank."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from string import Template
from typing import Dict, List

import yaml

from servers import Prometheus, binary, free_port_range

ROOT = Path(__file__).resolve().parents[1]
FLEET = ROOT / "deploy" / "prometheus" / "fleet"
RANKS = 8


def render_shard(shard: int, shards: int) -> str:
    """The shard config as docs/deployment.md says to render it (envsubst of SHARD and SHARDS)."""
    return Template((FLEET / "prometheus-shard.yml").read_text()).safe_substitute(SHARD=shard, SHARDS=shards)


def hashmod(value: str, modulus: int) -> int:
    """Prometheus' hashmod relabel action: the last 8 bytes of the MD5, big-endian, mod ``modulus``."""
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus


def test_fleet_configs_pass_promtool(tmp_path):
    promtool = binary("promtool")
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "gradmon.rules.yml").write_text((ROOT / "deploy/prometheus/rules/gradmon.rules.yml").read_text())
    for shard in range(2):
        cfg = tmp_path / f"shard-{shard}.yml"
        cfg.write_text(render_shard(shard, 2))
        r = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True)
        assert r.returncode == 0 and "rules found" in r.stdout, r.stdout + r.stderr
        relabel = yaml.safe_load(cfg.read_text())["scrape_configs"][0]["relabel_configs"]
        assert relabel[0]["source_labels"] == ["job"] and relabel[0]["modulus"] == 2 and relabel[1]["regex"] == str(shard)
    r = subprocess.run([promtool, "check", "config", "--agent", str(FLEET / "prometheus-agent.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    agent = yaml.safe_load((FLEET / "prometheus-agent.yml").read_text())
    assert "rule_files" not in agent and agent["remote_write"][0]["url"].endswith("/api/v1/push")
    # a normal Prometheus would refuse nothing here, an agent refuses rules: the flag was really checked
    bad = tmp_path / "agent-with-rules.yml"
    bad.write_text(yaml.safe_dump({**agent, "rule_files": ["rules/gradmon.rules.yml"]}))
    assert subprocess.run([promtool, "check", "config", "--agent", str(bad)], capture_output=True).returncode != 0


def _two_jobs_on_two_shards() -> List[str]:
    """Two job names the shipped relabelling puts on different shards of two."""
    names = [f"pretrain-{i}" for i in range(20)]
    first = names[0]
    return [first, next(n for n in names if hashmod(n, 2) != hashmod(first, 2))]


def test_two_shards_split_the_fleet_by_job_and_a_divergent_rank_fires_once(tmp_path):
    from gradmon import alerting
    jobs = _two_jobs_on_two_shards()
    diverging = {jobs[0]: 3}
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(alerting.rule_groups(
        replace(alerting.Thresholds(), warmup_steps=5), alerting.PRODUCTION.scaled(alerting.TEST_SCALE))))
    base = free_port_range(2 * RANKS)
    ports = {job: [base + j * RANKS + r for r in range(RANKS)] for j, job in enumerate(jobs)}
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{p}" for p in ports[job]], "labels": {"job": job}}
                                   for job in jobs]))
    shards: List[Prometheus] = []
    workers: List[subprocess.Popen] = []
    try:
        for shard in range(2):
            work = tmp_path / f"shard-{shard}"
            work.mkdir()
            relabel = yaml.safe_load(render_shard(shard, 2))["scrape_configs"][0]["relabel_configs"]
            shards.append(Prometheus(work, "1s", [rules], file_sd=targets, relabel_configs=relabel))
        for rank in range(RANKS):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK="0", PYTHONPATH=str(ROOT))
            workers.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("fleet_rank.py")),
                 json.dumps({job: ports[job][rank] for job in jobs}), json.dumps(diverging),
                 str(tmp_path / f"rank{rank}.ready")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 150
        firing: Dict[int, list] = {}
        while time.monotonic() < deadline:
            assert all(w.poll() is None for w in workers), "a simulated rank died"
            firing = {i: p.query('ALERTS{alertname="GradmonRankDivergence", alertstate="firing"}')
                      for i, p in enumerate(shards)}
            if any(firing.values()):
                time.sleep(3)  # long enough for a wrong second firing to show too
                firing = {i: p.query('ALERTS{alertname="GradmonRankDivergence", alertstate="firing"}')
                          for i, p in enumerate(shards)}
                break
            time.sleep(1)
        scraped = {i: sorted((s["metric"]["job"], s["metric"]["instance"]) for s in p.query("up == 1"))
                   for i, p in enumerate(shards)}
        ranks_seen = {i: {s["metric"]["rank"] for s in p.query("gradmon_local_grad_global_norm")}
                      for i, p in enumerate(shards)}
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(10)
        for p in shards:
            p.stop()
    owner = {job: hashmod(job, 2) for job in jobs}
    assert sorted(owner.values()) == [0, 1]
    for i in range(2):
        # each shard scrapes half of the 16 ranks: one whole job, every rank of it
        (job,) = [j for j in jobs if owner[j] == i]
        assert scraped[i] == sorted((job, f"127.0.0.1:{p}") for p in ports[job]), (i, scraped[i])
        assert ranks_seen[i] == {str(r) for r in range(RANKS)}
    alerts = [a["metric"] for a in firing[0] + firing[1]]
    assert [(a["job"], a["rank"]) for a in alerts] == [(jobs[0], "3")], firing
    assert firing[owner[jobs[0]]] and not firing[owner[jobs[1]]]
