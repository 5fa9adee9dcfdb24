"""Kubernetes mode end to end: a real kube-apiserver + etcd, `cns controller` and three `cns run`
daemons as separate processes, each with the RBAC-limited credentials of config/rbac.yaml.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, DaemonProcess
from tests.kube import CONTROLLER_USER, DAEMON_USER, KubeCluster, kube_cluster_fixture

NNC_API = "acn.azure.com/v1alpha"
CS_API = "acn.azure.com/v1alpha1"

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


def obj(api_version: str, kind: str, name: str, namespace: str = "") -> dict[str, Any]:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": api_version, "kind": kind, "metadata": meta}


def formula(demand: int, batch: int = 16) -> int:
    return batch * math.ceil(0.5 + demand / batch) - 1


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    return kube


class Scenario:
    """Nodes, a ClusterSubnet, a controller and daemons; everything removed afterwards."""

    def __init__(
        self,
        cluster: KubeCluster,
        workdir: Path,
        subnet: str,
        cidr: str,
        scaler: dict[str, int] | None = None,
    ) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.subnet = subnet
        self.nodes: list[str] = []
        self.daemons: dict[str, DaemonProcess] = {}
        self.controllers: list[subprocess.Popen[bytes]] = []
        cluster.create(
            {
                "apiVersion": CS_API,
                "kind": "ClusterSubnet",
                "metadata": {"name": subnet},
                "spec": {
                    "subnet": cidr,
                    "exhaustion": {"upperPercent": 90, "lowerPercent": 50},
                    **({"scaler": scaler} if scaler else {}),
                },
            }
        )

    def add_node(self, name: str) -> None:
        self.cluster.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        self.nodes.append(name)

    def start_controller(self, lease_seconds: int = 3) -> subprocess.Popen[bytes]:
        index = len(self.controllers)
        log = (self.workdir / f"controller{index}.log").open("ab")
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "cns.cli", "controller",
                "--subnet", self.subnet,
                "--kubeconfig", str(self.cluster.kubeconfig_for(CONTROLLER_USER)),
                "--identity", f"controller-{index}",
                "--lease-seconds", str(lease_seconds),
                "--log-format", "json",
            ],
            stdout=log,
            stderr=log,
            cwd=REPO,
        )  # fmt: skip
        self.controllers.append(proc)
        return proc

    def controller_log(self, index: int) -> str:
        return (self.workdir / f"controller{index}.log").read_text()

    def start_daemon(self, node: str) -> DaemonProcess:
        workdir = self.workdir / node
        workdir.mkdir()
        daemon = DaemonProcess(
            workdir,
            {
                "mode": "kubernetes",
                "nodeName": node,
                "addTimeoutSeconds": 15,
                "kubernetes": {
                    "kubeconfig": str(self.cluster.kubeconfig_for(DAEMON_USER)),
                    "subnetName": self.subnet,
                    "watchTimeoutSeconds": 5,
                },
            },
        )
        daemon.start()
        self.daemons[node] = daemon
        return daemon

    def nnc(self, node: str) -> dict[str, Any]:
        return self.cluster.get(NNC_API, "NodeNetworkConfig", node, "kube-system")

    def all_nc_addresses(self) -> list[str]:
        found = []
        for node in self.nodes:
            for nc in (self.nnc(node).get("status") or {}).get("networkContainers") or []:
                found.append(nc["primaryIP"])
                found.extend(a["ip"] for a in nc.get("ipAssignments") or [])
        return found

    def wait(self, condition: Any, what: str, timeout: float = 30) -> Any:
        return self.cluster.wait_for(condition, timeout=timeout, what=what, interval=0.1)

    def cleanup(self) -> None:
        for daemon in self.daemons.values():
            if daemon.proc is not None:
                daemon.proc.kill()
                daemon.proc.wait()
        for proc in self.controllers:
            proc.kill()
            proc.wait()
        doomed = [obj(NNC_API, "NodeNetworkConfig", n, "kube-system") for n in self.nodes]
        doomed += [obj("v1", "Node", n) for n in self.nodes]
        doomed += [
            obj(CS_API, "ClusterSubnet", self.subnet),
            obj(CS_API, "ClusterSubnetState", self.subnet),
            obj("coordination.k8s.io/v1", "Lease", f"cns-controller-{self.subnet}", "kube-system"),
        ]
        self.cluster.delete(doomed)


@pytest.fixture
def scenario_factory(cluster: KubeCluster, tmp_path: Path) -> Iterator[Any]:
    made: list[Scenario] = []

    def make(subnet: str, cidr: str, scaler: dict[str, int] | None = None) -> Scenario:
        scenario = Scenario(cluster, tmp_path, subnet, cidr, scaler)
        made.append(scenario)
        return scenario

    yield make
    for scenario in made:
        scenario.cleanup()


def add(daemon: DaemonProcess, container: str) -> tuple[int, Any]:
    return daemon.call("POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"})


def pods(cluster: KubeCluster, node: str, count: int, prefix: str) -> list[str]:
    names = []
    for i in range(count):
        name = f"{prefix}-{i}"
        cluster.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
            }
        )
        names.append(name)
    return names


@pytest.mark.slow
def test_controller_and_three_daemons(scenario_factory: Any, cluster: KubeCluster) -> None:
    scenario: Scenario = scenario_factory("e2e-subnet", "10.61.0.0/24")
    for node in ("e2e-n1", "e2e-n2", "e2e-n3"):
        scenario.add_node(node)
    scenario.start_controller()
    for node in scenario.nodes:
        scenario.start_daemon(node)
    n1, n2, n3 = (scenario.daemons[n] for n in scenario.nodes)

    # The controller created one NNC per node, each starting from an empty NC (phase 2-1).
    for node in scenario.nodes:
        nnc = scenario.nnc(node)
        assert nnc["metadata"]["ownerReferences"][0]["name"] == node

    replies = [add(n1, f"a{i}") for i in range(20)] + [add(n2, f"b{i}") for i in range(5)]
    assert all(status == 200 for status, _ in replies), replies
    given = [body["ips"][0]["address"].split("/")[0] for _, body in replies]
    assert len(set(given)) == 25

    scenario.wait(
        lambda: scenario.nnc("e2e-n1")["spec"]["requestedIPCount"] == formula(20),
        "n1 to request the formula's count",
    )
    assert scenario.nnc("e2e-n2")["spec"]["requestedIPCount"] == formula(5)
    addresses = scenario.all_nc_addresses()
    assert len(addresses) == len(set(addresses)), "an address is in two network containers"

    # Pods scheduled on n3 count as demand before any of them asked for an IP (phase 3-1).
    names = pods(cluster, "e2e-n3", 30, "burst")
    scenario.wait(
        lambda: scenario.nnc("e2e-n3")["spec"]["requestedIPCount"] == formula(30),
        "n3 to grow for its scheduled pods in one step",
    )
    scenario.wait(lambda: n3.pool()["ips"]["Available"] == formula(30), "n3 to receive its IPs")

    # API server down: ADD and DEL keep working from the pool.
    cluster.stop_apiserver()
    try:
        for i in range(5):
            assert add(n2, f"outage{i}")[0] == 200
        assert n2.call("POST", "/v1/cni/del", {"containerID": "b0", "ifName": "eth0"})[0] == 200
    finally:
        cluster.start_apiserver()

    # After the outage the watches resume: the pods go away, n3 releases through the handshake.
    for name in names:  # no kubelet here: delete at once rather than gracefully
        path = f"/api/v1/namespaces/default/pods/{name}"
        cluster.request("DELETE", path, params={"gracePeriodSeconds": "0"}).raise_for_status()
    scenario.wait(
        lambda: scenario.nnc("e2e-n3")["spec"]["requestedIPCount"] == formula(0),
        "n3 to shrink back to one batch",
        timeout=60,
    )
    scenario.wait(
        lambda: n3.pool()["ips"]["PendingRelease"] == 0
        and n3.pool()["ips"]["Available"] == formula(0)
        and scenario.nnc("e2e-n3")["spec"].get("ipsNotInUse") == [],
        "the release handshake to complete",
        timeout=60,
    )
    addresses = scenario.all_nc_addresses()
    assert len(addresses) == len(set(addresses))
    status = cluster.get(CS_API, "ClusterSubnet", "e2e-subnet")["status"]
    assert status["reservedIPCount"] == len(addresses)
    assert status["scaler"]["batchSize"] >= 1


@pytest.mark.slow
def test_scarce_subnet_flips_exhaustion_and_reclaims_idle_ips(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    # /26: 62 hosts - gateway = 61 usable. Two nodes at batch 16 reserve 2 + 15 + 15 = 32.
    # The utilization-aware batch would pick 8 here; the operator pins 16 (spec.scaler wins).
    scenario: Scenario = scenario_factory("scarce-subnet", "10.62.0.0/26", {"batchSize": 16})
    for node in ("sc-n1", "sc-n2"):
        scenario.add_node(node)
    scenario.start_controller()
    n1 = scenario.start_daemon("sc-n1")
    n2 = scenario.start_daemon("sc-n2")
    scenario.wait(lambda: n2.pool()["ips"]["Available"] == 15, "n2 to hold an idle batch")
    status = cluster.get(CS_API, "ClusterSubnet", "scarce-subnet")["status"]
    assert status["scaler"]["batchSize"] == 8  # computed: 2^floor(log2(61 / (2 * 2)))
    assert scenario.nnc("sc-n2")["status"]["scaler"]["batchSize"] == 16  # the override wins

    # 50 pods on n1 cannot fit at batch 16 next to n2's idle batch; they fit at batch 1.
    replies = [add(n1, f"s{i}") for i in range(50)]
    failed = [body for status, body in replies if status != 200]
    assert not failed, failed[:2]
    assert len({body["ips"][0]["address"] for _, body in replies}) == 50
    state = cluster.get(CS_API, "ClusterSubnetState", "scarce-subnet")
    assert state["status"]["exhausted"] is True
    scenario.wait(lambda: n2.pool()["batchSize"] == 1, "n2 to switch to batch 1")
    scenario.wait(
        lambda: n2.pool()["ips"]["Available"] <= 2 and n2.pool()["ips"]["PendingRelease"] == 0,
        "n2 to give back its idle IPs through ipsNotInUse",
    )
    addresses = scenario.all_nc_addresses()
    assert len(addresses) == len(set(addresses))
    assert "subnet_exhaustion_changed" in scenario.controller_log(0)


@pytest.mark.slow
def test_leader_election_hands_over(scenario_factory: Any, cluster: KubeCluster) -> None:
    scenario: Scenario = scenario_factory("lease-subnet", "10.63.0.0/24")
    scenario.add_node("le-n1")
    first = scenario.start_controller(lease_seconds=3)
    scenario.wait(lambda: "leader_elected" in scenario.controller_log(0), "a leader")
    second = scenario.start_controller(lease_seconds=3)
    daemon = scenario.start_daemon("le-n1")
    time.sleep(1.5)
    assert "leader_elected" not in scenario.controller_log(1)  # one leader at a time

    first.send_signal(signal.SIGKILL)
    first.wait()
    scenario.wait(lambda: "leader_elected" in scenario.controller_log(1), "the standby to lead", 20)
    replies = [add(daemon, f"l{i}") for i in range(20)]  # needs the new leader to grow the pool
    assert all(status == 200 for status, _ in replies)
    assert second.poll() is None
    lease = cluster.get("coordination.k8s.io/v1", "Lease", "cns-controller-lease-subnet",
                        "kube-system")  # fmt: skip
    assert lease["spec"]["holderIdentity"] == "controller-1"
    assert lease["spec"]["leaseTransitions"] >= 1
