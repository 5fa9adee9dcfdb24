"""The real `cns controller` on a real kube-apiserver never grants a node's own address, nor
a reserved one (`reservedIPs`: addresses, CIDRs, ranges), and reports either held by a pod.

Nodes list their InternalIP and ExternalIP in `status.addresses`; those inside a ClusterSubnet
are excluded like its `reservedIPs`. An entry that cannot be read is logged naming its field and
ignored. An address a node takes after it was granted to a pod stays with the pod and is
reported (log event and `cns_controller_node_address_conflicts`) and asked back from its node
(given up only once no pod uses it), never silently shared.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.kube.ipblock import block_entries
from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.fleet import addresses, scrape
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import subnet_objects
from tests.harness.ports import free_port
from tests.harness.process import ManagedProcess, private_tmp

kube = pytest.fixture(scope="module")(kube_cluster_fixture)

CIDR = "10.91.0.0/28"  # gateway .1; .2-.14 are hosts
NODE_ADDRESSES = [
    {"type": "InternalIP", "address": "10.91.0.2"},
    {"type": "ExternalIP", "address": "10.91.0.3"},
    {"type": "Hostname", "address": "node-a"},
    {"type": "InternalIP", "address": "10.91.0.999"},  # not an IP: logged, ignored
    {"type": "InternalIP", "address": "192.168.77.5"},  # outside the subnet
]


@pytest.fixture
def served(kube: KubeCluster, tmp_path: Path) -> Iterator[tuple[str, list[str], int, Path]]:
    """A ClusterSubnet, two Nodes (the first with addresses in the subnet) and a controller
    serving it; all removed afterwards."""
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    subnet = f"nodeaddr-{uuid.uuid4().hex[:6]}"
    nodes = [f"{subnet}-a", f"{subnet}-b"]
    kube.create({"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": subnet},
                 "spec": {"subnet": CIDR}})  # fmt: skip
    for name in nodes:
        kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    _set_addresses(kube, nodes[0], NODE_ADDRESSES)
    port, log_path = free_port(), tmp_path / "controller.log"
    command = controller_command(
        kube, subnet=subnet, identity="replica-0", lease_seconds=2, metrics_port=port
    )
    controller = ManagedProcess("controller", command, log_path, env=private_tmp(tmp_path))
    controller.spawn(REPO)
    try:
        yield subnet, nodes, port, log_path
    finally:
        controller.stop(timeout=15)
        kube.delete(subnet_objects(kube, subnet, nodes), wait=False)


def _set_addresses(kube: KubeCluster, node: str, listed: list[dict[str, str]]) -> None:
    kube.patch("v1", "Node", node, {"status": {"addresses": listed}}, subresource="status")


def _held(kube: KubeCluster, nodes: list[str]) -> dict[str, list[str]]:
    return {
        node: addresses(kube.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM))
        if kube.exists(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)
        else []
        for node in nodes
    }


def _claimed(kube: KubeCluster, subnet: str) -> dict[str, str]:
    blocks = kube.get(CS_API, "IPBlock", params={"labelSelector": f"acn.azure.com/subnet={subnet}"})
    return {a: e.node for b in blocks["items"] for a, e in block_entries(b).items()}


def _asked_back(kube: KubeCluster, node: str) -> list[str]:
    nnc = kube.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)
    return list((nnc.get("status") or {}).get("ipsToRelease") or ())


def _ip_name(kube: KubeCluster, node: str, address: str) -> str:
    """The name of the IP config that holds `address` in the node's NNC."""
    nnc = kube.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)
    for nc in nnc["status"]["networkContainers"]:
        for assignment in nc.get("ipAssignments") or ():
            if assignment["ip"] == address:
                return str(assignment["name"])
    raise AssertionError(f"{address} is not in {node}'s NNC")


def _every_address_granted(kube: KubeCluster, node_a: str, node_b: str) -> dict[str, list[str]]:
    """Once both nodes have an NNC, node B asks for 20: the subnet's 13 hosts less the gateway
    less node A's two addresses, 11, are all granted (A holds its primary IP, B the rest)."""
    kube.wait_for(
        lambda: all(
            kube.exists(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in (node_a, node_b)
        ),
        timeout=60,
        what="an NNC for each node",
    )
    kube.patch(
        NNC_API, "NodeNetworkConfig", node_b, {"spec": {"requestedIPCount": 20}}, KUBE_SYSTEM
    )
    held: dict[str, list[str]] = kube.wait_for(
        lambda: (h := _held(kube, [node_a, node_b])) and len([*h[node_a], *h[node_b]]) == 11 and h,
        timeout=60,
        what="the subnet's 11 usable addresses granted",
    )
    return held


def _events(log_path: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for line in log_path.read_text().splitlines():
        with_fields = json.loads(line) if line.startswith("{") else {}
        if with_fields.get("event") == event:
            found.append(with_fields)
    return found


def _kube_events(
    kube: KubeCluster, namespace: str, kind: str, name: str, reason: str
) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind={kind},involvedObject.name={name},reason={reason}"
    found = kube.get("v1", "Event", namespace=namespace, params={"fieldSelector": selector})
    return list(found["items"])


@pytest.mark.slow
def test_the_controller_never_grants_a_nodes_own_address_and_reports_one_a_pod_holds(
    kube: KubeCluster, served: tuple[str, list[str], int, Path]
) -> None:
    subnet, (node_a, node_b), port, log_path = served
    held = _every_address_granted(kube, node_a, node_b)
    usable = {f"10.91.0.{i}" for i in range(4, 15)}
    every = [*held[node_a], *held[node_b]]
    assert set(every) == usable and len(every) == len(set(every))
    assert not {"10.91.0.2", "10.91.0.3"} & set(_claimed(kube, subnet))
    status = kube.get(CS_API, "ClusterSubnet", subnet)["status"]
    assert status["capacity"] == 11
    invalid = _events(log_path, "node_address_invalid")
    assert [(e["node"], e["field"]) for e in invalid] == [(node_a, "status.addresses[3].address")]
    assert scrape(port)["cns_controller_node_address_conflicts"] == 0

    # Node A takes an address a pod of node B holds: reported, and left with the pod.
    taken = held[node_b][1]  # an address of a pod (the first is the primary IP)
    _set_addresses(kube, node_a, [*NODE_ADDRESSES, {"type": "InternalIP", "address": taken}])
    kube.wait_for(
        lambda: scrape(port)["cns_controller_node_address_conflicts"] == 1,
        timeout=60,
        what="the conflict counted",
    )
    (conflict,) = _events(log_path, "node_address_conflict")
    assert (conflict["address"], conflict["held_by"]) == (taken, [node_b])
    # And a Kubernetes Event, on the ClusterSubnet and on the NNC of the node whose pod holds it.
    on_subnet = kube.wait_for(
        lambda: _kube_events(kube, "default", "ClusterSubnet", subnet, "NodeAddressInUse"),
        timeout=30,
        what="the NodeAddressInUse Event on the ClusterSubnet",
    )
    on_nnc = kube.wait_for(
        lambda: _kube_events(kube, KUBE_SYSTEM, "NodeNetworkConfig", node_b, "NodeAddressInUse"),
        timeout=30,
        what="the NodeAddressInUse Event on the NNC",
    )
    for event in (*on_subnet, *on_nnc):
        assert event["type"] == "Warning" and taken in event["message"]
        assert event["source"] == {"component": "cns-controller", "host": "replica-0"}
    assert (
        on_nnc[0]["involvedObject"]["uid"]
        == (kube.get(NNC_API, "NodeNetworkConfig", node_b, KUBE_SYSTEM)["metadata"]["uid"])
    )
    assert taken in _held(kube, [node_b])[node_b]
    # Its node is asked to give it back, which it does only once no pod of its own uses it.
    kube.wait_for(
        lambda: _asked_back(kube, node_b) == [_ip_name(kube, node_b, taken)],
        timeout=60,
        what="the address asked back",
    )
    assert _claimed(kube, subnet)[taken] == node_b
    assert kube.get(CS_API, "ClusterSubnet", subnet)["status"]["capacity"] == 10

    # The node gives the address up again: the report is resolved.
    _set_addresses(kube, node_a, NODE_ADDRESSES)
    kube.wait_for(
        lambda: scrape(port)["cns_controller_node_address_conflicts"] == 0,
        timeout=60,
        what="the conflict resolved",
    )
    assert [e["address"] for e in _events(log_path, "node_address_conflict_resolved")] == [taken]
    kube.wait_for(
        lambda: _kube_events(kube, "default", "ClusterSubnet", subnet, "NodeAddressInUseResolved"),
        timeout=30,
        what="the NodeAddressInUseResolved Event",
    )
    kube.wait_for(lambda: _asked_back(kube, node_b) == [], timeout=60, what="the request withdrawn")


@pytest.mark.slow
def test_a_reservation_added_over_granted_addresses_reports_their_holders_and_never_regrants(
    kube: KubeCluster, served: tuple[str, list[str], int, Path]
) -> None:
    """`reservedIPs` with a CIDR and a range, added while the addresses are granted: taken
    from no one, each reported once (log, Event, `cns_controller_reserved_addresses_held`) and
    asked back; given back, never granted again. A bad entry stops the subnet's grants, with
    the entry named, until fixed. All while the controller runs: no restart."""
    subnet, (node_a, node_b), port, log_path = served
    _every_address_granted(kube, node_a, node_b)
    # Node A holds its primary IP only (it asks for nothing), B the rest: .10-.14 among them.
    reserved = {"10.91.0.10", "10.91.0.11", "10.91.0.12", "10.91.0.13", "10.91.0.14"}
    held = _held(kube, [node_a, node_b])
    assert len(held[node_a]) == 1 and reserved < set(held[node_b][1:]), held
    spec = {"reservedIPs": ["10.91.0.10/31", "10.91.0.12-10.91.0.14"]}
    kube.patch(CS_API, "ClusterSubnet", subnet, {"spec": spec})

    kube.wait_for(
        lambda: scrape(port)["cns_controller_reserved_addresses_held"] == 5,
        timeout=60,
        what="the reserved addresses held counted",
    )
    reports = {e["address"]: e["held_by"] for e in _events(log_path, "reserved_address_held")}
    assert reports == {address: [node_b] for address in reserved}
    on_nnc = kube.wait_for(
        lambda: _kube_events(
            kube, KUBE_SYSTEM, "NodeNetworkConfig", node_b, "ReservedAddressInUse"
        ),
        timeout=30,
        what="the ReservedAddressInUse Event on the NNC",
    )
    assert all("reserved" in event["message"] for event in on_nnc)
    assert reserved < set(_held(kube, [node_b])[node_b])  # taken from no one
    names = sorted(_ip_name(kube, node_b, address) for address in reserved)
    kube.wait_for(
        lambda: sorted(_asked_back(kube, node_b)) == names, timeout=60, what="them asked back"
    )
    assert kube.get(CS_API, "ClusterSubnet", subnet)["status"]["capacity"] == 11 - 5

    # Node B gives them back (no pod of its own uses them): gone for good, and its request of
    # 20 is not met from the range.
    kube.patch(NNC_API, "NodeNetworkConfig", node_b, {"spec": {"ipsNotInUse": names}}, KUBE_SYSTEM)
    kube.wait_for(
        lambda: not reserved & set(_held(kube, [node_b])[node_b]),
        timeout=60,
        what="the reserved addresses released",
    )
    kube.patch(NNC_API, "NodeNetworkConfig", node_b, {"spec": {"ipsNotInUse": []}}, KUBE_SYSTEM)
    kube.wait_for(
        lambda: scrape(port)["cns_controller_reserved_addresses_held"] == 0,
        timeout=60,
        what="the report resolved",
    )
    assert not reserved & set(_claimed(kube, subnet))
    assert [e["address"] for e in _events(log_path, "reserved_address_held_resolved")] == sorted(
        reserved
    )

    # A bad entry: the subnet is not served (nothing new granted) and the entry is named.
    kube.patch(CS_API, "ClusterSubnet", subnet, {"spec": {"reservedIPs": ["10.92.0.0/24"]}})
    invalid = kube.wait_for(
        lambda: _events(log_path, "subnet_invalid"), timeout=60, what="the subnet refused"
    )
    assert "'10.92.0.0/24': no address of the subnet 10.91.0.0/28" in invalid[0]["error"]
