"""The control plane's data is input (issue 25, cases 1 to 3) on a real kube-apiserver: a
standalone `cns run` daemon (the cns service account, config/rbac.yaml) follows a
NodeNetworkConfig whose status this test writes as a control plane would (a broken or hostile
one), and ADDs go through the daemon's real socket. The pure parts are in
tests/unit/node/test_nnc_input.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.kube.objects import SUBNET_LABEL
from cns.state.store import Store
from tests.harness import azure
from tests.harness.daemon import Daemon
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import Scenario, installed, object_ref

kube = pytest.fixture(scope="module")(kube_cluster_fixture)
pytestmark = pytest.mark.slow

NC_A = "7a0c5e10-0000-4000-8000-00000000000a"
NC_B = "7a0c5e10-0000-4000-8000-00000000000b"
NC_C = "7a0c5e10-0000-4000-8000-00000000000c"
NODE = "nncin-n1"
CIDR = "10.70.0.0/24"


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    return installed(kube)


@pytest.fixture
def scenario(cluster: KubeCluster, tmp_path: Path) -> Iterator[Scenario]:
    """One node; no cns controller: the test writes the NNC's status."""
    scenario = Scenario(cluster, tmp_path, "nncin-unused", "10.99.0.0/24")
    scenario.add_node(NODE)
    yield scenario
    scenario.cleanup()
    cluster.delete(object_ref(CS_API, "ClusterSubnetState", azure.SUBNET_NAME))


def create_nnc(cluster: KubeCluster, containers: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's NNC as the controller makes it (owned by its Node, labelled with its
    subnet), its status then written as `containers`."""
    node = cluster.get("v1", "Node", NODE)
    obj = azure.nnc(NODE, containers)
    obj["metadata"]["labels"] = {SUBNET_LABEL: azure.SUBNET_NAME}
    obj["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node["metadata"]["uid"]}
    ]
    cluster.create(obj)
    write_status(cluster, obj)
    cluster.create(azure.subnet_state(azure.SUBNET_NAME, exhausted=False))
    return obj


def write_status(cluster: KubeCluster, obj: dict[str, Any]) -> None:
    cluster.patch(
        NNC_API,
        "NodeNetworkConfig",
        NODE,
        {"status": obj["status"]},
        KUBE_SYSTEM,
        subresource="status",
    )


def start(scenario: Scenario) -> Daemon:
    return scenario.start_daemon(NODE, subnet_name="", config={"addTimeoutSeconds": 3})


def add(daemon: Daemon, container: str) -> tuple[int, dict[str, Any]]:
    status, body = daemon.call("POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"})
    return status, body


def hold(daemon: Daemon, prefix: str, count: int) -> dict[str, str]:
    """`count` ADDs that must succeed: container -> the address it got."""
    held = {}
    for i in range(count):
        status, body = add(daemon, f"{prefix}{i}")
        assert status == 200, body
        held[f"{prefix}{i}"] = address_of(body)
    return held


def address_of(body: dict[str, Any]) -> str:
    return str(body["ips"][0]["address"].split("/")[0])


def events(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in daemon.log().splitlines() if f'"event": "{event}"' in line]


def held_by(daemon: Daemon) -> dict[str, tuple[str, str]]:
    """Container -> (address, NC id) of every assigned IP, from `/debug/ips`."""
    return {
        row["owner"]["containerID"]: (row["address"], row["nc"])
        for row in daemon.ips()
        if row["state"] == "Assigned"
    }


def on_disk(daemon: Daemon) -> dict[str, tuple[str, str]]:
    """Container -> (address, NC id) as the stopped daemon's state file records them."""
    store = Store(daemon.state_dir / "state.db")
    try:
        store.open()
        return {a.owner.container_id: (a.address, a.nc_id) for a in store.assignments.values()}
    finally:
        store.close()


BAD_IPS = {
    "garbage": "not an address",
    "10.70.0.999": "not an address",
    "10.70.0.30/32": "not an address",
    "10.71.0.9": "outside the subnet",
    "10.70.0.0": "the subnet's network address",
    "10.70.0.255": "the subnet's broadcast address",
    "10.70.0.4": "the container's primary IP",
    "10.70.0.1": "the container's gateway",
}


def test_invalid_nnc_values_reach_no_pod_and_cause_no_5xx(
    cluster: KubeCluster, scenario: Scenario
) -> None:
    """Case 3: the CRD's format checks let these through. Before: `garbage/24` and the other
    values handed to pods, `/debug/ips` 500, and a subnet with host bits made every ADD a 500
    (code 102). Now: each is left out with its reason, said once, counted, and shown."""
    vnet = azure.vnet_nc(NC_A, CIDR, 3)
    good = {a["ip"] for a in vnet["ipAssignments"]}
    vnet["ipAssignments"] += [{"name": azure.ip_name(NC_A, ip), "ip": ip} for ip in BAD_IPS]
    obj = create_nnc(cluster, [vnet])
    daemon = start(scenario)
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 3, "the 3 valid IPs")

    given = list(hold(daemon, "bad", 3).values())
    assert sorted(given) == sorted(good)
    status, body = add(daemon, "bad3")  # nothing else is handed out
    assert (status, body["code"]) == (503, 11), body

    answer = daemon.get("/debug/ips")  # 200, or urlopen raises
    assert {row["address"] for row in answer["ips"]} == good
    rejected = {e["value"]: e["reason"] for e in answer["ignored"]}
    assert rejected == BAD_IPS
    assert {e["field"] for e in answer["ignored"]} == {"ipAssignments.ip"}
    pool = daemon.pool()
    assert {e["value"] for e in pool["ignoredNetworkContainers"]} == set(BAD_IPS)
    metrics = daemon.metrics()
    key = 'cns_ip_assignments_ignored{field="ipAssignments.ip",reason="%s"}'
    assert metrics[key % "not an address"] == 3
    assert metrics[key % "outside the subnet"] == 1

    write_status(cluster, obj)  # the same again: said once
    obj["status"]["assignedIPCount"] = 11
    write_status(cluster, obj)
    said = events(daemon, "ip_assignment_ignored")
    assert sorted(e["value"] for e in said) == sorted(BAD_IPS)

    # A subnet with host bits: the whole container is left out (withdrawn), never a 500.
    obj["status"]["networkContainers"] = [{**vnet, "subnetAddressSpace": "10.70.0.5/24"}]
    write_status(cluster, obj)
    daemon.wait_pool(
        lambda p: any(e["field"] == "subnetAddressSpace" for e in p["ignoredNetworkContainers"]),
        "the container left out",
    )
    status, body = add(daemon, "bad4")
    assert (status, body["code"]) == (503, 11), body
    status, body = add(daemon, "bad0")  # a pod that holds its address keeps it
    assert status == 200 and address_of(body) == given[0], body
    answer = daemon.get("/debug/ips")
    assert len(answer["ips"]) == 3 and all(r["state"] == "Assigned" for r in answer["ips"])
    (whole,) = [e for e in answer["ignored"] if e["field"] == "subnetAddressSpace"]
    assert whole["reason"] == "has host bits set (not the subnet's own address)"
    assert {e["code"] for e in events(daemon, "cni_request_failed")} == {11}  # never 102
    assert "Traceback" not in daemon.log()


def test_a_container_whose_id_changes_hands_out_none_of_the_old_ones(
    cluster: KubeCluster, scenario: Scenario
) -> None:
    """Case 2: the same addresses under a new container id (and new IP names, as Azure names
    them after the container). Before: the old container's free IPs stayed Available beside
    the new ones, and most ADDs failed 409/11. Now: the old container is withdrawn, the held
    IPs are re-homed to the new one (state file included), and every free one serves once."""
    obj = create_nnc(cluster, [azure.vnet_nc(NC_A, CIDR, 8)])
    daemon = start(scenario)
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 8, "the NC's 8 IPs")
    held = hold(daemon, "id", 3)

    obj["status"]["networkContainers"] = [azure.vnet_nc(NC_B, CIDR, 8)]
    write_status(cluster, obj)
    daemon.wait_pool(
        lambda p: [nc["id"] for nc in p["networkContainers"]] == [NC_B], "the new container"
    )
    assert held_by(daemon) == {c: (a, NC_B) for c, a in held.items()}
    given = set()
    for i in range(3, 8):
        status, body = add(daemon, f"id{i}")
        assert status == 200, body
        given.add(address_of(body))
    assert len(given) == 5 and given.isdisjoint(held.values())
    status, body = add(daemon, "id8")
    assert (status, body["code"]) == (503, 11), body
    assert {nc for _, nc in held_by(daemon).values()} == {NC_B}
    assert len(events(daemon, "ip_rehomed")) == 3
    assert [e["nc"] for e in events(daemon, "network_container_withdrawn")] == [NC_A]
    daemon.stop()
    recorded = on_disk(daemon)
    assert {c: recorded[c] for c in held} == {c: (a, NC_B) for c, a in held.items()}


@pytest.mark.parametrize("same_ids", [True, False], ids=["same-ids", "new-ids"])
def test_a_deleted_nnc_is_recreated_asking_for_the_held_addresses(
    cluster: KubeCluster, scenario: Scenario, same_ids: bool
) -> None:
    """Case 1, the node: the NNC is deleted while pods hold addresses. Before: the node went
    on handing out the gone container's free addresses and said nothing. Now: it says so,
    hands out nothing it does not see listed, re-creates its NNC (labels and owner kept) whose
    `requestedIPs` are exactly the held addresses, and once that NNC lists them again (under
    the same container id and IP names, as `cns controller` re-grants a gone NNC's entries, or
    under new ones, as a control plane granting them anew) the pods keep them."""
    obj = create_nnc(cluster, [azure.vnet_nc(NC_A, CIDR, 6)])
    before = scenario.nnc(NODE)
    daemon = start(scenario)
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 6, "the NC's 6 IPs")
    held = hold(daemon, "gone", 3)

    cluster.delete(object_ref(NNC_API, "NodeNetworkConfig", NODE, KUBE_SYSTEM))
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 0, "the container withdrawn")
    for i in range(3, 5):
        status, body = add(daemon, f"gone{i}")
        assert (status, body["code"]) == (503, 11), body
    recreated = scenario.wait(
        lambda: (
            cluster.exists(NNC_API, "NodeNetworkConfig", NODE, KUBE_SYSTEM) and scenario.nnc(NODE)
        ),
        "the NNC re-created",
    )
    assert recreated["metadata"]["uid"] != before["metadata"]["uid"]
    assert recreated["metadata"]["labels"] == before["metadata"]["labels"]
    assert recreated["metadata"]["ownerReferences"] == before["metadata"]["ownerReferences"]
    assert sorted(recreated["spec"]["requestedIPs"]) == sorted(held.values())
    assert recreated["spec"]["requestedIPCount"] >= len(held)
    assert len(events(daemon, "nnc_deleted")) == 1
    assert events(daemon, "nnc_deleted")[0]["level"] == "warning"
    assert held_by(daemon) == {c: (a, NC_A) for c, a in held.items()}

    # The control plane grants them back (and two more).
    listed_as = NC_A if same_ids else NC_C
    granted = azure.vnet_nc(listed_as, CIDR, 6)
    granted["ipAssignments"] = [a for a in granted["ipAssignments"] if a["ip"] in held.values()] + [
        a for a in granted["ipAssignments"] if a["ip"] not in held.values()
    ][:2]
    obj["status"]["networkContainers"] = [granted]
    write_status(cluster, obj)
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 2, "the NNC listing them again")
    assert held_by(daemon) == {c: (a, listed_as) for c, a in held.items()}
    status, body = add(daemon, "gone0")
    assert status == 200 and address_of(body) == held["gone0"], body
    status, body = add(daemon, "gone5")
    assert status == 200 and address_of(body) not in held.values(), body
    scenario.wait(
        lambda: not scenario.nnc(NODE)["spec"].get("requestedIPs"), "nothing more asked for"
    )
    daemon.stop()
    recorded = on_disk(daemon)
    assert {c: recorded[c] for c in held} == {c: (a, listed_as) for c, a in held.items()}
