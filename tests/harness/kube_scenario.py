"""Kubernetes mode without kubelets: a ClusterSubnet, Node objects, `cns controller` processes
and `cns run` daemons on a `KubeCluster`, each process with the RBAC-limited credentials of
config/rbac.yaml. Shared by tests/integration/test_kube_mode.py, tests/integration/test_events.py
and bench/stress/crash_rounds.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.daemon import Daemon
from tests.harness.fleet import addresses
from tests.harness.kube_api import CS_API, DAEMON_USER, KUBE_SYSTEM, LEASE_API, NNC_API
from tests.harness.kube_cluster import KubeCluster
from tests.harness.process import private_tmp


def object_ref(api_version: str, kind: str, name: str, namespace: str = "") -> dict[str, Any]:
    """A manifest that only names an object: enough for `KubeApi.delete`."""
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": api_version, "kind": kind, "metadata": meta}


def subnet_objects(kube: KubeCluster, subnet: str, nodes: list[str]) -> list[dict[str, Any]]:
    """Everything a ClusterSubnet's test made or caused: the nodes and their NNCs, the subnet's
    IPBlocks, state and controller lease; for `kube.delete(...)` afterwards."""
    found = [object_ref(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in nodes]
    found += [object_ref("v1", "Node", n) for n in nodes]
    blocks = kube.get(CS_API, "IPBlock", params={"labelSelector": f"acn.azure.com/subnet={subnet}"})
    found += [object_ref(CS_API, "IPBlock", b["metadata"]["name"]) for b in blocks["items"]]
    return [
        *found,
        object_ref(CS_API, "ClusterSubnet", subnet),
        object_ref(CS_API, "ClusterSubnetState", subnet),
        object_ref(LEASE_API, "Lease", f"cns-controller-{subnet}", KUBE_SYSTEM),
    ]


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
        self.daemons: dict[str, Daemon] = {}
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

    def start_controller(
        self, lease_seconds: int = 3, metrics_port: int | None = None
    ) -> subprocess.Popen[bytes]:
        index = len(self.controllers)
        command = controller_command(
            self.cluster,
            subnet=self.subnet,
            identity=f"controller-{index}",
            lease_seconds=lease_seconds,
            metrics_port=metrics_port,
        )
        with (self.workdir / f"controller{index}.log").open("ab") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=log, cwd=REPO, env=private_tmp(self.workdir)
            )
        self.controllers.append(proc)
        return proc

    def controller_log(self, index: int) -> str:
        return (self.workdir / f"controller{index}.log").read_text()

    def start_daemon(
        self,
        node: str,
        wait: bool = True,
        subnet_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Daemon:
        """A `cns run` daemon of `node`, configured to follow the scenario's subnet (or
        `subnet_name`; "": the one its NNC names), with `config` laid over the rest."""
        workdir = self.workdir / node
        workdir.mkdir()
        daemon = Daemon(
            workdir,
            {
                "mode": "kubernetes",
                "nodeName": node,
                "addTimeoutSeconds": 15,
                # The tests check that a burst of pods becomes one request: on a loaded 2-core
                # machine the gaps between bindings outgrow the default 0.1 s quiet time.
                "requestCoalescing": {"quietSeconds": 1, "maxDelaySeconds": 10},
                # No runtime: the "pods" are ADDs the test makes (a host's containerd, if any,
                # must not be asked about them).
                "leakReclaim": {"criSocket": ""},
                "kubernetes": {
                    "kubeconfig": str(self.cluster.kubeconfig_for(DAEMON_USER)),
                    "subnetName": self.subnet if subnet_name is None else subnet_name,
                    "watchTimeoutSeconds": 5,
                },
                **(config or {}),
            },
        )
        self.daemons[node] = daemon
        daemon.start(wait=wait)
        return daemon

    def nnc(self, node: str) -> dict[str, Any]:
        return self.cluster.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)

    def all_nc_addresses_of(self, node: str) -> list[str]:
        return addresses(self.nnc(node))

    def all_nc_addresses(self) -> list[str]:
        return [address for node in self.nodes for address in self.all_nc_addresses_of(node)]

    def wait(self, condition: Any, what: str, timeout: float = 30) -> Any:
        return self.cluster.wait_for(condition, timeout=timeout, what=what, interval=0.1)

    def cleanup(self) -> None:
        for daemon in self.daemons.values():
            if daemon.proc is not None:
                daemon.proc.kill()
                daemon.proc.wait()
        for proc in self.controllers:
            proc.terminate()  # a clean stop releases the lease and removes its temporary files
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.cluster.delete(subnet_objects(self.cluster, self.subnet, self.nodes))


def installed(cluster: KubeCluster) -> KubeCluster:
    """The cluster with cns's CRDs and RBAC applied (a module fixture's body)."""
    cluster.apply(REPO / "config" / "crd")
    cluster.apply(REPO / "config" / "rbac.yaml")
    return cluster


def scenarios(cluster: KubeCluster, workdir: Path) -> Iterator[Callable[..., Scenario]]:
    """Generator for a fixture: a maker of Scenarios, each cleaned up afterwards."""
    made: list[Scenario] = []

    def make(subnet: str, cidr: str, scaler: dict[str, int] | None = None) -> Scenario:
        scenario = Scenario(cluster, workdir, subnet, cidr, scaler)
        made.append(scenario)
        return scenario

    yield make
    for scenario in made:
        scenario.cleanup()
