"""config/prometheus/: what `kubectl kustomize` makes of it (kubectl 1.20's kustomize, v2.0.3, as
for config/) is the PodMonitors, the PrometheusRule and the dashboard's ConfigMap, and each
monitor scrapes a port the workload it selects names, on the address that workload binds."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from cns.config.daemon_config import parse
from tests.harness import REPO
from tests.harness.kube_cluster import binaries
from tests.harness.prometheus import DASHBOARD, PROMETHEUS


def kustomize(directory: str) -> dict[tuple[str, str], dict[str, Any]]:
    bin_dir = binaries()
    if bin_dir is None or not (bin_dir / "kubectl").exists():
        pytest.skip("kubectl is built with the node binaries (scripts/test.sh builds them)")
    rendered = subprocess.run(
        [str(bin_dir / "kubectl"), "kustomize", str(REPO / directory)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def test_the_component_is_monitors_rules_and_the_dashboard() -> None:
    docs = kustomize("config/prometheus")
    assert set(docs) == {
        ("PodMonitor", "cns"),
        ("PodMonitor", "cns-controller"),
        ("PrometheusRule", "cns"),
        ("ConfigMap", "cns-grafana-dashboard"),
    }
    for (kind, _), doc in docs.items():
        assert doc["metadata"]["namespace"] == "kube-system"
        if kind != "ConfigMap":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    dashboard = docs["ConfigMap", "cns-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["grafana-dashboard.json"]) == json.loads(
        DASHBOARD.read_text()
    )
    rules = docs["PrometheusRule", "cns"]["spec"]
    assert rules == yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["spec"]


@pytest.mark.parametrize(
    ("monitor", "workload"),
    [("cns", ("DaemonSet", "cns")), ("cns-controller", ("Deployment", "cns-controller"))],
)
def test_each_monitor_scrapes_the_metrics_port_of_the_pods_it_selects(
    monitor: str, workload: tuple[str, str]
) -> None:
    spec = kustomize("config/prometheus")["PodMonitor", monitor]["spec"]
    target = kustomize("config")[workload]
    template = target["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["namespaceSelector"]["matchNames"] == [target["metadata"]["namespace"]]
    assert spec["jobLabel"] in labels  # job="cns" / "cns-controller": the rules name it
    (endpoint,) = spec["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    # Host network: the Pod's IP is the node's, the address the metrics listener binds.
    assert template["spec"]["hostNetwork"] is True


def test_the_daemon_binds_its_metrics_listener_to_the_node_address_on_the_named_port() -> None:
    docs = kustomize("config")
    container = docs["DaemonSet", "cns"]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[command.index("--metrics-address") + 1] == "$(HOST_IP)"
    env = {e["name"]: e.get("valueFrom", {}) for e in container["env"]}
    assert env["HOST_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    config = parse(yaml.safe_load(docs["ConfigMap", "cns-config"]["data"]["cns.yaml"]), "cm")
    (port,) = container["ports"]
    assert port == {"name": "metrics", "containerPort": config.metrics.port}
    assert config.debug_host_port[0] == "127.0.0.1"  # the debug endpoint stays on loopback
