"""IP pressure on the real multi-node cluster (tests/harness/multinode.py): node A's pool full,
a Deployment that prefers A, and how long its pods wait; shared by
tests/e2e/test_cluster_network.py and bench/performance/ip_pressure.py.

The pressure comes from a small ClusterSubnet of its own (`maxIPCount` 4 in its `spec.scaler`:
a node holds its primary address and 3 pods' of it) drawn from by one namespace (annotation
`acn.azure.com/subnets`), so that the cluster's other subnets and tests are untouched. The
daemons' `ipPressure` is turned on (or off) by patching the ConfigMap `cns-config` and restarting
the DaemonSet's pods; `configured` puts the ConfigMap back as it was found.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import yaml

from cns.kube.node_pressure import CONDITION_TYPE, TAINT_KEY
from tests.harness.kube_api import CS_API, KUBE_SYSTEM
from tests.harness.kube_node import deployment
from tests.harness.multinode import ClusterNode, MultiNodeCluster

NAMESPACE = "pressure"
SUBNET = ipaddress.ip_network("10.125.0.0/28")  # off the LAN: pods of one node only
MAX_IP_COUNT = 4  # the primary address and 3 pods per node
FILLERS = MAX_IP_COUNT - 1
IP_PRESSURE = {"enabled": True, "enterAfterSeconds": 2, "leaveFreeIPs": 1, "leaveAfterSeconds": 5}
# A cluster's daemons with `ipPressure` on from the start (tests/e2e/conftest.py): a node at
# maxIPCount enters pressure at once (this scenario), but a lane of an exhausted subnet only after
# an hour, so that the exhaustion test on the same cluster never has a node tainted.
CLUSTER_IP_PRESSURE = {**IP_PRESSURE, "enterAfterSeconds": 3600}


@dataclass(frozen=True, slots=True)
class Outcome:
    """How long the Deployment's first pods waited (apply -> every one Running) and where they
    ran; where the pods of its scale-up ran once A had room again."""

    waited_seconds: float
    first_nodes: list[str]
    later_nodes: list[str]


def restart_daemons(cluster: MultiNodeCluster) -> None:
    cluster.kubectl("-n", KUBE_SYSTEM, "rollout", "restart", "daemonset", "cns")
    cluster.kubectl(
        "-n", KUBE_SYSTEM, "rollout", "status", "daemonset", "cns", "--timeout=300s", timeout=320
    )


@contextmanager
def configured(cluster: MultiNodeCluster, *, enabled: bool) -> Iterator[None]:
    """The daemons running with `ipPressure` on (or as found); the ConfigMap restored after."""
    found = cluster.kube.get("v1", "ConfigMap", "cns-config", KUBE_SYSTEM)["data"]["cns.yaml"]
    if not enabled:
        yield
        return
    settings = yaml.safe_load(found)
    settings["ipPressure"] = IP_PRESSURE
    data = {"data": {"cns.yaml": yaml.safe_dump(settings)}}
    cluster.kube.patch("v1", "ConfigMap", "cns-config", data, KUBE_SYSTEM)
    try:
        restart_daemons(cluster)
        yield
    finally:
        original = {"data": {"cns.yaml": found}}
        cluster.kube.patch("v1", "ConfigMap", "cns-config", original, KUBE_SYSTEM)
        restart_daemons(cluster)


def taint_keys(cluster: MultiNodeCluster, node: ClusterNode) -> list[str]:
    taints = cluster.kube.get("v1", "Node", node.name).get("spec", {}).get("taints") or []
    return [t["key"] for t in taints]


def pressure_condition(cluster: MultiNodeCluster, node: ClusterNode) -> dict[str, Any]:
    conditions = cluster.kube.get("v1", "Node", node.name)["status"].get("conditions") or []
    return next((c for c in conditions if c["type"] == CONDITION_TYPE), {})


def preferring(name: str, replicas: int, first: ClusterNode, second: ClusterNode) -> dict[str, Any]:
    """A Deployment on `first` or `second`, `first` preferred (weight 100)."""
    body = deployment(name, replicas, namespace=NAMESPACE)
    hostname = "kubernetes.io/hostname"
    body["spec"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": hostname, "operator": "In",
                                   "values": [first.name, second.name]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [
                {"key": hostname, "operator": "In", "values": [first.name]}]}}],
    }}  # fmt: skip
    return body


def pinned(name: str, replicas: int, node: ClusterNode) -> dict[str, Any]:
    body = deployment(name, replicas, namespace=NAMESPACE)
    body["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    return body


def nodes_of(cluster: MultiNodeCluster, selector: str) -> list[str]:
    return sorted(p["spec"].get("nodeName", "") for p in cluster.pods(selector, NAMESPACE))


def run(
    cluster: MultiNodeCluster, first: ClusterNode, second: ClusterNode, *, tainted: bool,
    hold_seconds: float, replicas: int = 2,
) -> Outcome:  # fmt: skip
    """Fill `first`'s pool, apply a Deployment of `replicas` pods preferring it, free `first`'s
    pool `hold_seconds` after the apply; when `tainted` (the first pods ran elsewhere), scale the
    Deployment up by `replicas` once `first` has room and its taint is gone."""
    cluster.kube.apply(
        {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": NAMESPACE},
         "spec": {"subnet": str(SUBNET), "gateway": str(SUBNET[1]),
                  "scaler": {"batchSize": 1, "maxIPCount": MAX_IP_COUNT}}}
    )  # fmt: skip
    cluster.kube.apply(
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NAMESPACE, "annotations": {"acn.azure.com/subnets": NAMESPACE}}}
    )  # fmt: skip
    try:
        cluster.kube.apply(pinned("filler", FILLERS, first))
        cluster.wait_running("app=filler", FILLERS, namespace=NAMESPACE)
        if tainted:
            cluster.wait(lambda: TAINT_KEY in taint_keys(cluster, first), "A's taint", 60)
            assert pressure_condition(cluster, first)["reason"] == "MaxIPCountReached"
        assert TAINT_KEY not in taint_keys(cluster, second)
        applied = time.monotonic()
        cluster.kube.apply(preferring("web", replicas, first, second))
        freed = False
        while True:
            pods = [p for p in cluster.pods("app=web", NAMESPACE)
                    if not p["metadata"].get("deletionTimestamp")]  # fmt: skip
            if len(pods) == replicas and all(
                p["status"].get("phase") == "Running" and p["status"].get("podIP") for p in pods
            ):
                waited = time.monotonic() - applied
                break
            if not freed and time.monotonic() - applied >= hold_seconds:
                cluster.kubectl("scale", "-n", NAMESPACE, "deployment", "filler", "--replicas=0")
                freed = True
            assert time.monotonic() - applied < hold_seconds + 300, "web never Running"
            time.sleep(0.2)
        first_nodes = nodes_of(cluster, "app=web")
        if not tainted:  # A holds the first pods: a scale-up would fill it again
            return Outcome(waited, first_nodes, [])
        if not freed:
            cluster.kubectl("scale", "-n", NAMESPACE, "deployment", "filler", "--replicas=0")
        cluster.wait_gone("app=filler", namespace=NAMESPACE)
        cluster.wait(lambda: TAINT_KEY not in taint_keys(cluster, first), "A's taint gone", 60)
        cluster.kubectl("scale", "-n", NAMESPACE, "deployment", "web", f"--replicas={2 * replicas}")
        cluster.wait_running("app=web", 2 * replicas, namespace=NAMESPACE, timeout=240)
        later = nodes_of(cluster, "app=web")
        for name in first_nodes:
            later.remove(name)
        return Outcome(waited, first_nodes, later)
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        cluster.wait_gone("", namespace=NAMESPACE)
        cluster.kubectl("delete", "clustersubnet", NAMESPACE)
