"""A real three-node cluster on one machine (tests/harness/multinode.py, `make cluster-up
NODES=3`): every node a network and mount namespace of its own with its containerd, kubelet and
kube-proxy, on one bridge; cns installed as an operator installs it (the image imported into every
node's containerd, `kubectl apply -k` of config/). One cluster per plugin set-up (`cns-cni`, and
`ptp` + `cns-ipam`) serves every test of the module; its teardown checks the host is as found.

Pods on different nodes reach each other through the daemon's flat-network mode
(docs/networking.md), which answers ARP for a node's pods on its uplink: `FLAT_NETWORK` turns it on
where the daemon knows `flatNetwork`, and the cross-node test runs only then.
"""

from __future__ import annotations

import ipaddress
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.config import daemon_config
from tests.e2e.test_node_e2e import require_node
from tests.harness.host import short_tempdir
from tests.harness.install_node import build_image
from tests.harness.kube_api import KUBE_SYSTEM, NNC_API
from tests.harness.kube_node import deployment, host_state
from tests.harness.multinode import CNS, LAN, PLUGIN_SETUPS, ClusterNode, MultiNodeCluster
from tests.harness.requirements import require

NODES = 3
PODS = 9
# The daemon's flat-network mode, where this version of cns has it.
FLAT_NETWORK = hasattr(daemon_config, "FlatNetwork")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    require_node()
    require([tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None], "")
    archive = tmp_path_factory.mktemp("image") / "cns.tar"
    return build_image(archive), archive


@pytest.fixture(scope="module", params=PLUGIN_SETUPS)
def cluster(request: pytest.FixtureRequest, image: tuple[str, Path]) -> Iterator[MultiNodeCluster]:
    before = host_state()
    workdir = short_tempdir("cns-mn-")  # the nodes' containerd sockets live below it
    try:
        with MultiNodeCluster.start(
            workdir, nodes=NODES, image=image, plugin=request.param, flat_network=FLAT_NETWORK
        ) as cluster:
            print(f"cluster ({request.param}) up: {cluster.timings}")
            yield cluster
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert host_state() == before, "the cluster's teardown left the host changed"


def spread(name: str, replicas: int) -> dict[str, Any]:
    """`deployment` with its pods spread evenly over the nodes."""
    body = deployment(name, replicas)
    body["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": name}},
        }
    ]
    return body


def pods_by_node(pods: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """node -> pod name -> pod IP."""
    found: dict[str, dict[str, str]] = {}
    for pod in pods:
        found.setdefault(pod["spec"]["nodeName"], {})[pod["metadata"]["name"]] = pod["status"][
            "podIP"
        ]
    return found


def unreachable(node: ClusterNode, pod: str, targets: list[str]) -> list[str]:
    """The `targets` that `pod` (on `node`) cannot ping, two tries each."""
    script = (
        f"for ip in {' '.join(targets)}; do ping -c1 -W2 $ip >/dev/null || "
        "ping -c1 -W2 $ip >/dev/null || echo $ip; done; echo done"
    )
    said = node.in_pod(pod, "sh", "-c", script).stdout.split()
    assert said and said[-1] == "done", said
    return said[:-1]


def test_every_node_is_ready_with_a_cns_pod_of_its_own(cluster: MultiNodeCluster) -> None:
    nodes = cluster.kube.request("GET", "/api/v1/nodes").json["items"]
    addresses = {
        n["metadata"]["name"]: [
            a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"
        ]
        for n in nodes
    }
    assert addresses == {node.name: [node.address] for node in cluster.nodes}, addresses
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
    # Each node's NNC got addresses of the LAN, none of them a node's own.
    node_ips = {node.address for node in cluster.nodes} | {str(LAN.ip)}
    for node in cluster.nodes:
        nnc = cluster.kube.get(NNC_API, "NodeNetworkConfig", node.name, KUBE_SYSTEM)
        granted = [ipaddress.ip_address(ip) for ip in _granted(nnc)]
        assert granted and all(ip in LAN.network for ip in granted), nnc
        assert not node_ips & {str(ip) for ip in granted}, nnc


def _granted(nnc: dict[str, Any]) -> list[str]:
    status = nnc.get("status") or {}
    return [
        ip["ip"]
        for container in status.get("networkContainers") or []
        for ip in container.get("ipAssignments") or []
    ]


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


@pytest.mark.skipif(not FLAT_NETWORK, reason="needs the daemon's flat-network mode (flatNetwork)")
def test_pods_reach_pods_and_nodes_across_nodes_on_the_flat_network(
    cluster: MultiNodeCluster,
) -> None:
    cluster.kube.apply(spread("across", NODES * 2))
    try:
        pods = cluster.wait_running("app=across", NODES * 2, timeout=300)
        by_node = pods_by_node(pods)
        everyone = [p["status"]["podIP"] for p in pods] + [n.address for n in cluster.nodes]
        for name, on_node in by_node.items():
            node = cluster.node(name)
            first = sorted(on_node)[0]
            missed = unreachable(node, first, [ip for ip in everyone if ip != on_node[first]])
            assert not missed, f"{first} on {name} cannot reach {missed}"
            for pod in pods:
                ip = pod["status"]["podIP"]
                reply = node.host.run("ping", "-c1", "-W2", ip, check=False)
                assert reply.returncode == 0, f"{name} cannot reach {ip} on another node"
    finally:
        cluster.kubectl("delete", "deployment/across")
        cluster.wait_gone("app=across")
