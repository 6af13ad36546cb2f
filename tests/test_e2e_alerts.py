"""End to end: real training processes -> real Prometheus (gradmon's rules) -> real
Alertmanager -> a webhook on loopback; then every dashboard query against that Prometheus.

The rules are gradmon/alerting.py's, with every window and `for` scaled by 1/60 (a minute
becomes a second) and two thresholds shortened for a test that lasts a minute: warm-up of
20 steps, stall after 8 s. All scenarios run at once, each as its own scrape `job`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from gradmon import alerting
from servers import Alertmanager, Prometheus, Webhook, binary, free_port, grafana_substitute

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = replace(alerting.Thresholds(), warmup_steps=20, stall_seconds=8)
TIMING = alerting.PRODUCTION.scaled(alerting.TEST_SCALE)

# job -> (demo arguments, the alert it must raise with the labels it must carry, fault step)
SCENARIOS = {
    "healthy": ([], None, None),
    "finish": (["--steps", "250"], None, None),
    "nan": (["--fault", "nan@150:blocks.2.fc1"], ("GradmonNonFiniteGradients", {"layer": "blocks.2.fc1"}), 150),
    "explode": (["--fault", "explode@300:blocks.1.fc2"], ("GradmonGradientExplosion", {}), 300),
    "vanish": (["--fault", "vanish@300:blocks.0.fc1"], ("GradmonVanishingGradients", {"layer": "blocks.0.fc1"}), 300),
    "stall": (["--stall-at", "200"], ("GradmonTrainingStalled", {}), 200),
    "kill": ([], ("GradmonExporterDown", {}), None),
    # how a run ends (tests/run_end_script.py): a script that just ends, one that raises in `with`
    "noexit": (["script", "end", "12"], None, None),
    "raise": (["script", "raise_in_with", "12"], ("GradmonRunFailed", {"exception": "ValueError"}), None),
}
SCRIPT = Path(__file__).resolve().parent / "run_end_script.py"
KILL_AFTER_S = 20
RUN_S = 75


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e")
    rules = work / "rules.yml"
    rules.write_text(yaml.safe_dump(alerting.rule_groups(THRESHOLDS, TIMING)))
    hook = Webhook()
    am = Alertmanager(work, yaml.safe_dump(alerting.alertmanager_config(hook.url, "1s", "1s", "1h")))
    prom = Prometheus(work, "1s", [rules], f"127.0.0.1:{am.port}")
    demos: Dict[str, subprocess.Popen] = {}
    ports = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("GRADMON_FINAL_SCRAPE_TIMEOUT", None)
    try:
        for job, (args, _, _) in SCENARIOS.items():
            ports[job] = free_port()
            if args[:1] == ["script"]:
                command = [sys.executable, str(SCRIPT), args[1], str(ports[job]), args[2]]
            else:
                command = [sys.executable, "-m", "gradmon", "demo", "--port", str(ports[job]), "--addr", "127.0.0.1",
                           "--step-delay", "0.05", "--log-every", "0", "--steps", "100000", *args]
            demos[job] = subprocess.Popen(command, stdout=open(work / f"{job}.log", "w"), stderr=subprocess.STDOUT,
                                          env=env)
        prom.set_targets([{"targets": [f"127.0.0.1:{p}"], "labels": {"job": job}} for job, p in ports.items()])
        yield prom, hook, demos, work, am
    finally:
        for proc in demos.values():
            if proc.poll() is None:
                proc.kill()
        prom.stop()
        am.stop()
        hook.stop()


def first_time(prom: Prometheus, expr: str, start: float, end: float) -> float:
    for series in prom.query_range(expr, start, end, 1):
        return float(series["values"][0][0])
    raise AssertionError(f"never true: {expr}")


@pytest.fixture(scope="module")
def outcome(stack):
    prom, hook, demos, work, _ = stack
    start = time.time()
    wanted = {job: spec for job, (_, spec, _) in SCENARIOS.items() if spec}
    got: Dict[str, dict] = {}
    killed = None
    while time.time() - start < RUN_S + 60:
        # kill once Prometheus has seen that job train (a target that never reported is not
        # "a rank that stopped reporting"; on a loaded machine start-up can take a while)
        if killed is None and time.time() - start > KILL_AFTER_S and \
                prom.query('gradmon_steps_total{job="kill"} > 20'):
            demos["kill"].send_signal(signal.SIGKILL)
            killed = time.time()
        for a in hook.alerts():
            job = a["labels"].get("job")
            if job in wanted and job not in got and a["labels"]["alertname"] == wanted[job][0]:
                got[job] = a
        if len(got) == len(wanted) and time.time() - start > RUN_S:
            break
        time.sleep(0.5)
    latency = {}
    for job, alert in got.items():
        step = SCENARIOS[job][2]
        if job == "kill":
            t0 = killed
        elif job == "raise":
            t0 = first_time(prom, 'gradmon_run_state{job="raise", state="failed"} == 1', start - 5, time.time())
        elif job == "stall":  # the fault is the absence of steps: from the last step on
            t0 = first_time(prom, f'gradmon_steps_total{{job="stall"}} >= {step}', start - 5, time.time())
        else:
            t0 = first_time(prom, f'gradmon_steps_total{{job="{job}"}} >= {step}', start - 5, time.time())
        latency[job] = alert["received"] - t0
    (work / "latency.json").write_text(json.dumps(latency, indent=2))
    print("\nfault -> alert received at the webhook (s):", json.dumps({k: round(v, 1) for k, v in latency.items()}))
    return got, latency, hook.alerts()


@pytest.mark.parametrize("job", [j for j, (_, spec, _) in SCENARIOS.items() if spec])
def test_fault_reaches_the_webhook_through_alertmanager(outcome, job):
    got, latency, _ = outcome
    name, labels = SCENARIOS[job][1]
    assert job in got, f"{name} for job {job} never arrived; got {sorted({(a['labels']['alertname'], a['labels'].get('job')) for a in outcome[2]})}"
    alert = got[job]
    for key, value in labels.items():
        assert alert["labels"][key] == value
    assert alert["annotations"]["runbook_url"].endswith("#" + name.lower())
    assert job in alert["annotations"]["description"]
    assert latency[job] < 30


@pytest.mark.parametrize("job", ["healthy", "finish", "noexit"])
def test_healthy_and_finished_runs_never_page(outcome, job):
    _, _, received = outcome
    assert not [a["labels"]["alertname"] for a in received if a["labels"].get("job") == job]


@pytest.mark.parametrize("job", ["raise", "kill"])
def test_a_run_that_ends_badly_pages_only_its_own_alert(outcome, job):
    _, _, received = outcome
    assert {a["labels"]["alertname"] for a in received if a["labels"].get("job") == job} == {SCENARIOS[job][1][0]}


def test_a_failed_job_pages_once_and_silences_its_other_ranks(stack, outcome):
    """Through the real Alertmanager with gradmon's config: two ranks of one job failing are
    one notification; the ranks torchrun then kills (ExporterDown) page not at all."""
    _, hook, _, _, am = stack
    amtool = binary("amtool")
    for name, rank in (("GradmonRunFailed", "0"), ("GradmonRunFailed", "1"), ("GradmonExporterDown", "2"),
                       ("GradmonRanksMissing", "")):
        labels = [f"alertname={name}", "job=torchrun-job", "severity=critical"] + ([f"rank={rank}"] if rank else [])
        subprocess.run([amtool, "alert", "add", *labels, f"--alertmanager.url={am.url}"], check=True, capture_output=True)
    time.sleep(5)  # group_wait and group_interval are 1 s here
    mine = [n for n in hook.received if n.get("groupLabels", {}).get("job") == "torchrun-job"]
    assert [n["groupLabels"]["alertname"] for n in mine] == ["GradmonRunFailed"]
    assert {a["labels"]["rank"] for a in mine[0]["alerts"]} == {"0", "1"}


def test_nan_pages_once_per_job_not_once_per_layer(stack, outcome):
    _, hook, _, _, _ = stack
    notifications = [n for n in hook.received if n.get("groupLabels", {}).get("alertname") == "GradmonNonFiniteGradients"
                     and n["groupLabels"].get("job") == "nan"]
    assert notifications and all(len({a["fingerprint"] for a in n["alerts"]}) >= 1 for n in notifications)
    first = min(n["time"] for n in notifications)
    # grouping: every non-finite alert of the job arrives in one notification, not one each
    assert len([n for n in notifications if n["time"] - first < 1.0]) == 1


# -- every dashboard panel returns data ----------------------------------------------------------

JOBS = "(" + "|".join(SCENARIOS) + ")"
# panels that only a multi-rank DDP job can fill (local, pre-all-reduce norms)
NEEDS_MULTI_RANK = {("ranks", "Local (pre-all-reduce) norm by rank"),
                    ("ranks", "Spread across ranks (max / median of local norms)"),
                    ("ranks", "Worst layer's local norm over its baseline by rank")}
# panels whose families cannot exist in these runs: the demo trains an fp32 model on the CPU,
# and the fp16 families exist only for float16 layers (test_activation_signals.py checks them)
CANNOT_EXIST_HERE = {("layers", "fp16 range used"), ("layers", "fp16 gradient underflow fraction")}


def substitute(expr: str) -> str:
    """Grafana's substitution for 'All'-style multi-value selections."""
    return grafana_substitute(expr, job=JOBS, model="(demo)", rank="(0)", layer="(blocks.0.fc1|blocks.2.fc1|head)")


def panel_queries():
    for name in ("overview", "layers", "ranks"):
        board = json.loads((ROOT / "dashboards" / f"{name}.json").read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                yield pytest.param(name, panel["title"], target["expr"], id=f"{name}:{panel['title']}:{target['refId']}")


@pytest.mark.parametrize("board, title, expr", list(panel_queries()))
def test_every_dashboard_query_returns_data(stack, outcome, board, title, expr):
    prom = stack[0]
    if (board, title) in NEEDS_MULTI_RANK:
        pytest.skip("needs a multi-rank DDP job's gradmon_local_* series: checked in test_multigpu.py")
    if (board, title) in CANNOT_EXIST_HERE:
        pytest.skip("fp16 families: the end-to-end demo trains in fp32 on the CPU")
    result = prom.query(substitute(expr))
    assert result, f"{board} / {title}: {substitute(expr)} returned nothing"


def test_dashboard_variable_queries_return_values(stack, outcome):
    prom = stack[0]
    for name in ("overview", "layers", "ranks"):
        board = json.loads((ROOT / "dashboards" / f"{name}.json").read_text())
        for var in board["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.match(r"label_values\((.*), (\w+)\)$", var["query"]["query"])
            assert m, var["query"]
            selector = substitute(m.group(1))
            values = {s["metric"].get(m.group(2)) for s in prom.query(selector)}
            assert values - {None}, (name, var["name"])
