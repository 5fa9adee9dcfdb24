"""What Prometheus scrapes from a real daemon (its metrics listener) and a real controller (two
replicas) on a real API server: the per-ClusterSubnet figures agree with the status the leader
writes, and every metric the alert rules and the dashboard name is exported (issue 28, item 2).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API, KubeError
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import Scenario
from tests.harness.ports import free_port
from tests.harness.prometheus import (
    PROMETHEUS_SERIES,
    alerts,
    dashboard_queries,
    metric_names,
)

kube = pytest.fixture(scope="module")(kube_cluster_fixture)

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(port: int) -> Samples:
    """GET /metrics as Prometheus does, parsed by prometheus_client's text parser: sample
    name -> labels -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def subnet_value(samples: Samples, name: str, subnet: str) -> float | None:
    return samples.get(name, {}).get((("subnet", subnet),))


@pytest.fixture
def scenario(kube: KubeCluster, tmp_path: Path) -> Iterator[Scenario]:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    made = Scenario(kube, tmp_path, "prom-subnet", "10.67.0.0/24")
    yield made
    made.cleanup()


@pytest.mark.slow
def test_every_metric_the_alerts_and_the_dashboard_name_is_scraped(
    scenario: Scenario, kube: KubeCluster
) -> None:
    cluster, subnet = scenario.cluster, scenario.subnet
    for node in ("prom-n1", "prom-n2"):
        scenario.add_node(node)
    replica_ports = [free_port(), free_port()]
    for port in replica_ports:
        scenario.start_controller(metrics_port=port)
    metrics_port = free_port()
    daemon = scenario.start_daemon(
        "prom-n1", config={"metrics": {"address": "127.0.0.1", "port": metrics_port}}
    )
    for pod in range(5):
        status, body = daemon.call(
            "POST", "/v1/cni/add", {"containerID": f"prom-{pod}", "ifName": "eth0"}
        )
        assert status == 200, body

    def leader_and_standby() -> tuple[Samples, Samples] | None:
        scraped = [scrape(port) for port in replica_ports]
        leading = [s for s in scraped if s["cns_controller_leader"][()] == 1]
        if len(leading) != 1:
            return None
        (leader,) = leading
        (standby,) = [s for s in scraped if s is not leader]
        return leader, standby

    last: list[object] = []  # what the last look found, for the failure's message

    def settled() -> tuple[Samples, Samples, dict[str, Any]] | None:
        """The leader's figures once they agree with the status it wrote (the round after the
        daemon's request has been written and come back on the watches)."""
        replicas = leader_and_standby()
        if replicas is None:
            return None
        leader, standby = replicas
        status = (cluster.get(CS_API, "ClusterSubnet", subnet) or {}).get("status") or {}
        nncs = [cluster.get(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in scenario.nodes]
        assigned = sum(((nnc or {}).get("status") or {}).get("assignedIPCount", 0) for nnc in nncs)
        expected = {
            "cns_clustersubnet_capacity": status.get("capacity"),
            "cns_clustersubnet_reserved": status.get("reservedIPCount"),
            "cns_clustersubnet_nodes": status.get("nodeCount"),
            "cns_clustersubnet_batch_size": (status.get("scaler") or {}).get("batchSize"),
            "cns_clustersubnet_exhausted": int(bool(status.get("exhausted"))),
            "cns_clustersubnet_duplicate_addresses": status.get("duplicateIPCount"),
            "cns_clustersubnet_address_conflicts": status.get("conflictIPCount"),
            "cns_clustersubnet_assigned": assigned,
        }
        figures = {name: subnet_value(leader, name, subnet) for name in expected}
        last[:] = [figures, expected]
        if assigned < 5 or figures != expected:
            return None
        return leader, standby, status

    try:
        found = scenario.wait(settled, "the leader's figures to agree with its status", 90)
    except KubeError as exc:
        raise AssertionError(f"{exc}: found, expected: {last}") from None
    leader, standby, status = found
    capacity = status["capacity"]
    granted = subnet_value(leader, "cns_clustersubnet_granted", subnet)
    free = subnet_value(leader, "cns_clustersubnet_free", subnet)
    assert granted is not None and granted >= status["reservedIPCount"]
    # Each node's primary IP and its secondaries are recorded; nothing else is taken.
    assert free == capacity - granted
    requested = subnet_value(leader, "cns_clustersubnet_requested", subnet)
    assert requested == scenario.nnc("prom-n1")["spec"]["requestedIPCount"]
    for counter in ("cns_clustersubnet_rounds_total", "cns_clustersubnet_writes_total"):
        value = subnet_value(leader, counter, subnet)
        assert value is not None and value >= 1, counter
    assert subnet_value(leader, "cns_clustersubnet_write_refusals_total", subnet) is not None
    # The standby vouches for no subnet's figures: they would be counted twice.
    assert not any(name.startswith("cns_clustersubnet_") and values
                   for name, values in standby.items()
                   if not name.endswith("_total"))  # fmt: skip

    node = scrape(metrics_port)  # the daemon's metrics listener, as the PodMonitor scrapes it
    assert node["cns_ready"][()] == 1
    assert node["cns_pool_ips"][(("state", "Assigned"),)] == 5
    exported = set(node) | set(leader) | PROMETHEUS_SERIES
    expressions = {f"alert {name}": [expr] for name, expr in alerts().items()}
    expressions |= {f"panel {title}": exprs for title, exprs in dashboard_queries().items()}
    for where, exprs in expressions.items():
        for expr in exprs:
            names = metric_names(expr)
            assert names, f"{where}: no metric found in {expr!r}"
            assert names <= exported, f"{where}: {sorted(names - exported)} not exported"
