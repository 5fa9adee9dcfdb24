"""A real three-node cluster on one machine (tests/harness/multinode.py, `make cluster-up
NODES=3`): every node a network and mount namespace of its own with its containerd, kubelet and
kube-proxy, on one bridge; cns installed as an operator installs it (the image imported into every
node's containerd, `kubectl apply -k` of config/). The tests run on both kinds of cluster
(tests/e2e/conftest.py): `ptp` + `cns-ipam` on an IPv4 LAN, and `cns-cni` on a dual-stack one
(IPv4 and IPv6, which checks IPv4 as an IPv4 one would); a cluster's stop checks the host is as
found.

Pods on different nodes reach each other through the daemon's flat-network mode
(docs/networking.md), which answers ARP (and, for IPv6, neighbour solicitations) for a node's pods
on its uplink.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from typing import Any

import pytest

from tests.harness.kube_api import KUBE_SYSTEM, NNC_API
from tests.harness.multinode import (
    CNS,
    KINDS,
    LAN,
    PLUGIN_SETUPS,
    MultiNodeCluster,
    neighbour_report,
    pod_ips,
    pods_by_node,
    spread,
    unreachable,
)

NODES = 3
PODS = 9


@pytest.mark.parametrize("cluster", KINDS, indirect=True)
def test_every_node_is_ready_with_a_cns_pod_of_its_own(cluster: MultiNodeCluster) -> None:
    nodes = cluster.kube.request("GET", "/api/v1/nodes").json["items"]
    addresses = {
        n["metadata"]["name"]: [
            a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"
        ]
        for n in nodes
    }
    # On the dual-stack cluster each node lists its IPv6 address too (`--node-ip` of both).
    assert addresses == {node.name: node.addresses for node in cluster.nodes}, addresses
    assert cluster.ready_nodes() == NODES
    daemons = cluster.pods(CNS, "kube-system")
    assert sorted(p["spec"]["nodeName"] for p in daemons) == [n.name for n in cluster.nodes]
    # Each DaemonSet pod reached the API server through the Service `kubernetes`, that is
    # through its node's kube-proxy (the overlay sets no API address).
    service = cluster.kube.get("v1", "Service", "kubernetes", "default")
    endpoints = cluster.kube.get("v1", "Endpoints", "kubernetes", "default")
    (subset,) = endpoints["subsets"]
    assert [a["ip"] for a in subset["addresses"]] == [str(LAN.ip)], endpoints
    env = daemons[0]["spec"]["containers"][0].get("env") or []
    assert "KUBERNETES_SERVICE_HOST" not in {e["name"] for e in env}, env
    assert service["spec"]["clusterIP"] == "10.0.0.1"
    # Each node's NNC got addresses of the LAN's subnets (its containers of the cluster's
    # ClusterSubnets; a test may have added a subnet of its own), none of them a node's own.
    node_ips = {ipaddress.ip_address(a) for n in cluster.nodes for a in n.addresses}
    node_ips |= {ipaddress.ip_address(gateway) for gateway in cluster.gateways}
    for node in cluster.nodes:
        nnc = cluster.kube.get(NNC_API, "NodeNetworkConfig", node.name, KUBE_SYSTEM)
        granted = [ipaddress.ip_address(ip) for ip in _granted(cluster, nnc)]
        assert granted and all(in_subnets(cluster, ip) for ip in granted), nnc
        assert not node_ips & set(granted), nnc


def in_subnets(
    cluster: MultiNodeCluster, ip: ipaddress.IPv4Address | ipaddress.IPv6Address
) -> bool:
    return any(ip in subnet for subnet in cluster.subnets.values())


def _granted(cluster: MultiNodeCluster, nnc: dict[str, Any]) -> list[str]:
    status = nnc.get("status") or {}
    return [
        ip["ip"]
        for container in status.get("networkContainers") or []
        if container.get("subnetName") in cluster.subnets
        for ip in container.get("ipAssignments") or []
    ]


@pytest.mark.parametrize("cluster", PLUGIN_SETUPS, indirect=True)
def test_a_deployment_spread_over_the_nodes_gets_unique_addresses_reachable_on_each_node(
    cluster: MultiNodeCluster,
) -> None:
    cluster.kube.apply(spread("web", PODS))
    try:
        pods = cluster.wait_running("app=web", PODS, timeout=300)
        ips = [p["status"]["podIP"] for p in pods]
        assert len(set(ips)) == PODS, Counter(ips)
        assert all(ipaddress.ip_address(ip) in LAN.network for ip in ips), ips
        assert not {n.address for n in cluster.nodes} & set(ips), ips
        by_node = pods_by_node(pods)
        assert sorted(len(on) for on in by_node.values()) == [PODS // NODES] * NODES, by_node
        for name, on_node in by_node.items():
            node = cluster.node(name)
            first, *others = sorted(on_node)
            missed = unreachable(node, first, [on_node[o] for o in others] + [node.address])
            assert not missed, f"{first} on {name} cannot reach {missed}"
            for pod, ip in on_node.items():
                reply = node.host.run("ping", "-c1", "-W2", ip, check=False)
                assert reply.returncode == 0, f"{name} cannot reach its pod {pod} at {ip}"
    finally:
        cluster.kubectl("delete", "deployment/web")
        cluster.wait_gone("app=web")


@pytest.mark.parametrize("cluster", KINDS, indirect=True)
def test_pods_reach_pods_and_nodes_across_nodes_on_the_flat_network(
    cluster: MultiNodeCluster,
) -> None:
    """Over every family of the cluster: on the dual-stack one each pod has an IPv4 and an IPv6
    address (`status.podIPs`), and both reach every pod and node."""
    cluster.kube.apply(spread("across", NODES * 2))
    try:
        pods = cluster.wait_running("app=across", NODES * 2, timeout=300)
        families = [subnet.version for subnet in cluster.subnets.values()]
        for pod in pods:
            assert [ipaddress.ip_address(ip).version for ip in pod_ips(pod)] == families, pod
        by_node = pods_by_node(pods)
        everyone = [ip for p in pods for ip in pod_ips(p)]
        everyone += [a for n in cluster.nodes for a in n.addresses]
        for name, on_node in by_node.items():
            node = cluster.node(name)
            first = sorted(on_node)[0]
            own = next(pod_ips(p) for p in pods if p["metadata"]["name"] == first)
            missed = unreachable(node, first, [ip for ip in everyone if ip not in own])
            assert not missed, f"{first} on {name}: {missed}\n{neighbour_report(cluster, missed)}"
            missed = unreachable(node, None, [ip for p in pods for ip in pod_ips(p)])
            assert not missed, f"{name}: {missed}\n{neighbour_report(cluster, missed)}"
    finally:
        cluster.kubectl("delete", "deployment/across")
        cluster.wait_gone("app=across")
