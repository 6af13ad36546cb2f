"""Deployment files: every config checked with the real tools, manifests for kind and wiring."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from servers import binary

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def load(path: str):
    return list(yaml.safe_load_all((DEPLOY / path).read_text()))


def test_prometheus_configs_pass_promtool():
    promtool = binary("promtool")
    for cfg in ("prometheus/prometheus.yml", "prometheus/prometheus-baremetal.yml"):
        r = subprocess.run([promtool, "check", "config", str(DEPLOY / cfg)], capture_output=True, text=True,
                           cwd=DEPLOY / "prometheus")
        assert r.returncode == 0, r.stdout + r.stderr


def test_compose_mounts_exist_and_wire_rules_dashboards_and_the_host():
    compose = load("docker-compose.yml")[0]
    assert set(compose["services"]) == {"prometheus", "alertmanager", "grafana"}
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            assert (DEPLOY / host).exists(), f"{name} mounts missing {host}"
    assert "host.docker.internal:host-gateway" in compose["services"]["prometheus"]["extra_hosts"]
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in compose["services"]["prometheus"]["volumes"]
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert all(t.startswith("host.docker.internal:") for t in targets)
    grafana_env = compose["services"]["grafana"]["environment"]
    assert grafana_env["DS_PROMETHEUS"] == load("grafana/provisioning/datasources/prometheus.yml")[0]["datasources"][0]["uid"]


def test_grafana_provisioning_points_at_the_mounted_dashboards():
    provider = load("grafana/provisioning/dashboards/gradmon.yml")[0]["providers"][0]
    compose = load("docker-compose.yml")[0]
    mounted = [v.split(":")[1] for v in compose["services"]["grafana"]["volumes"] if v.startswith("../dashboards")]
    assert provider["options"]["path"] == mounted[0]


def test_kubernetes_manifests_have_valid_kinds_and_agree_on_ports_and_labels():
    docs = {d["kind"]: d for f in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for d in load(f"kubernetes/{f.name}")}
    assert set(docs) == {"PodMonitor", "PrometheusRule", "ConfigMap", "Pod"}
    for d in docs.values():
        assert d["apiVersion"] in ("v1", "monitoring.coreos.com/v1") and d["metadata"]["name"]
    pm, pod = docs["PodMonitor"], docs["Pod"]
    assert pm["spec"]["sampleLimit"] >= 1000
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    pod_ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in pod_ports and len(ep["port"]) <= 15
        # a restarted worker keeps its series: instance from the pod's name, never its IP
        (stable,) = [r for r in ep["relabelings"] if r["targetLabel"] == "instance"]
        assert stable["sourceLabels"] == ["__meta_kubernetes_pod_name", "__meta_kubernetes_pod_container_port_name"]
    assert sorted(pod_ports.values()) == [9400, 9401]  # GRADMON_PORT + local rank
    cm = docs["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    for name, text in cm["data"].items():
        board = json.loads(text)
        assert json.loads((ROOT / "dashboards" / name.replace("gradmon-", "")).read_text()) == board


def test_the_sample_limit_in_the_multi_gpu_docs_and_the_scrape_configs_agree_and_fit_every_rank():
    page = (ROOT / "docs" / "multi-gpu.md").read_text()
    section = page[page.index("| ranks | layers | series on rank 0"):]
    # rank 0, then each other rank in steady state and (in parentheses) during an incident
    per_rank = [int(n) for row in re.findall(r"^\| \d+ \| \d+ \| (\d+) \| ([-\d]+)(?: \((\d+)\))? \|", section, re.M)
                for n in row if n not in ("-", "")]
    said = {int(n) for n in re.findall(r"`sample_?[lL]imit: (\d+)`", section)}
    shipped = {load("kubernetes/podmonitor.yaml")[0]["spec"]["sampleLimit"],
               load("prometheus/prometheus-baremetal.yml")[0]["scrape_configs"][0]["sample_limit"]}
    assert len(per_rank) == 20 and len(said) == 1 and said == shipped
    # a target over its limit is dropped whole: the shipped limit must fit the largest rank with headroom
    assert shipped.pop() >= 1.5 * max(per_rank)
