"""The real `cns controller` on a real kube-apiserver, serving a node from two subnets at once:
the IPv4 ClusterSubnet it is placed in and an IPv6 one it asks for by name (`spec.subnets`).

What the controller writes is checked as the API server stores it: one network container per
subnet, in the wire order, each with its own id, version and primary IP, addresses of its own
subnet only, claimed in that subnet's IPBlocks; the exhaustion of one subnet leaves the other's
container alone; a release through the entry's `ipsNotInUse` follows the handshake.
"""

from __future__ import annotations

import ipaddress
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.kube.resources import block_entries
from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import subnet_objects
from tests.harness.process import private_tmp

kube = pytest.fixture(scope="module")(kube_cluster_fixture)

V4, V6 = "10.90.0.0/26", "fd00:10::/112"


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    return kube


@pytest.fixture
def two_subnets(cluster: KubeCluster, tmp_path: Path) -> Iterator[tuple[str, str, list[str]]]:
    """An IPv4 ClusterSubnet every node is placed in, an IPv6 one no node is placed in (its
    selector matches none), two nodes and one controller serving every subnet; all removed
    afterwards."""
    tag = uuid.uuid4().hex[:6]
    v4, v6 = f"dual4-{tag}", f"dual6-{tag}"
    nodes = [f"dual-{tag}-n{i}" for i in range(2)]
    for name, cidr, selector in ((v4, V4, {}), (v6, V6, {"matchLabels": {"never": "true"}})):
        spec: dict[str, Any] = {"subnet": cidr, "exhaustion": {"upperPercent": 90}}
        if selector:
            spec["nodeSelector"] = selector
        cluster.create(
            {
                "apiVersion": CS_API,
                "kind": "ClusterSubnet",
                "metadata": {"name": name},
                "spec": spec,
            }
        )
    for name in nodes:
        cluster.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    command = controller_command(cluster, subnet="", identity=f"dual-{tag}", lease_seconds=5)
    with (tmp_path / "controller.log").open("ab") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=log, cwd=REPO, env=private_tmp(tmp_path)
        )
    try:
        yield v4, v6, nodes
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        leftovers = subnet_objects(cluster, v4, nodes) + subnet_objects(cluster, v6, [])
        leftovers.append(
            {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "cns-controller", "namespace": KUBE_SYSTEM}}
        )  # fmt: skip
        cluster.delete(leftovers, wait=False)


def _nnc(cluster: KubeCluster, node: str) -> dict[str, Any]:
    return cluster.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)


def _spec(cluster: KubeCluster, node: str, spec: dict[str, Any]) -> None:
    cluster.patch(NNC_API, "NodeNetworkConfig", node, {"spec": spec}, KUBE_SYSTEM)


def _containers(cluster: KubeCluster, node: str) -> list[dict[str, Any]]:
    return list((_nnc(cluster, node).get("status") or {}).get("networkContainers") or ())


def _claimed(cluster: KubeCluster, subnet: str) -> dict[str, str]:
    """Address -> node, from the subnet's IPBlocks."""
    blocks = cluster.get(
        CS_API, "IPBlock", params={"labelSelector": f"acn.azure.com/subnet={subnet}"}
    )
    return {a: e.node for b in blocks["items"] for a, e in block_entries(b).items()}


def _exhausted(cluster: KubeCluster, subnet: str) -> bool:
    state = (
        cluster.get(CS_API, "ClusterSubnetState", subnet)
        if cluster.exists(CS_API, "ClusterSubnetState", subnet)
        else {}
    )
    return bool((state.get("status") or {}).get("exhausted"))


@pytest.mark.slow
def test_a_node_takes_addresses_from_an_ipv4_and_an_ipv6_subnet(
    cluster: KubeCluster, two_subnets: tuple[str, str, list[str]]
) -> None:
    v4, v6, (node, other) = two_subnets
    cluster.wait_for(
        lambda: all(
            cluster.exists(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in (node, other)
        ),
        timeout=60,
        what="an NNC for each node",
    )
    _spec(
        cluster, node, {"requestedIPCount": 16, "subnets": [{"name": v6, "requestedIPCount": 16}]}
    )

    def both(counts: tuple[int, int]) -> list[dict[str, Any]] | None:
        containers = _containers(cluster, node)
        held = [len(nc.get("ipAssignments") or ()) for nc in containers]
        return containers if held == list(counts) else None

    first, second = cluster.wait_for(lambda: both((16, 16)), timeout=60, what="16 + 16")
    assert (first["subnetName"], second["subnetName"]) == (v4, v6)
    assert first["id"] != second["id"]
    for nc, cidr in ((first, V4), (second, V6)):
        network = ipaddress.ip_network(cidr)
        assert nc["subnetAddressSpace"] == cidr
        assert ipaddress.ip_address(nc["defaultGateway"]) in network
        assert ipaddress.ip_address(nc["primaryIP"]) in network
        assert all(ipaddress.ip_address(a["ip"]) in network for a in nc["ipAssignments"])
    nnc = _nnc(cluster, node)
    assert nnc["metadata"]["labels"]["acn.azure.com/subnet"] == v4
    assert nnc["status"]["assignedIPCount"] == 16  # the primary subnet's
    claimed6 = _claimed(cluster, v6)
    v6_addresses = {a["ip"] for a in second["ipAssignments"]} | {second["primaryIP"]}
    assert {a: claimed6.get(a) for a in v6_addresses} == dict.fromkeys(v6_addresses, node)
    assert not v6_addresses & set(_claimed(cluster, v4))

    # The IPv4 subnet exhausted by the other node: the IPv6 container is served as before.
    _spec(cluster, other, {"requestedIPCount": 40})
    cluster.wait_for(lambda: _exhausted(cluster, v4), timeout=60, what=f"{v4} exhausted")
    assert not _exhausted(cluster, v6)
    entry = {"name": v6, "requestedIPCount": 32}
    _spec(cluster, node, {"requestedIPCount": 16, "subnets": [entry]})
    first_now, second_now = cluster.wait_for(lambda: both((16, 32)), timeout=60, what="16 + 32")
    assert first_now["ipAssignments"] == first["ipAssignments"]
    assert first_now["version"] == first["version"]
    assert second_now["version"] > second["version"]
    assert {a["ip"] for a in second["ipAssignments"]} < {
        a["ip"] for a in second_now["ipAssignments"]
    }

    # A release through the entry's ipsNotInUse: the names leave the IPv6 container only.
    leaving = [a["name"] for a in second_now["ipAssignments"][:4]]
    entry = {"name": v6, "requestedIPCount": 28, "ipsNotInUse": leaving}
    _spec(cluster, node, {"requestedIPCount": 16, "subnets": [entry]})
    released = cluster.wait_for(lambda: both((16, 28)), timeout=60, what="the release")
    assert not {a["name"] for a in released[1]["ipAssignments"]} & set(leaving)
    assert released[0]["ipAssignments"] == first["ipAssignments"]
    gone = {a["ip"] for a in second_now["ipAssignments"][:4]}
    _spec(cluster, node, {"requestedIPCount": 16, "subnets": [{**entry, "ipsNotInUse": []}]})
    cluster.wait_for(
        lambda: not gone & set(_claimed(cluster, v6)), timeout=60, what="the released freed"
    )
    assert _containers(cluster, node) == released  # nothing else changed
