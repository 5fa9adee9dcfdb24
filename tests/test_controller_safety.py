"""Two `cns controller` replicas on a real kube-apiserver, with the timing made hostile on purpose.

The lease is short, planning is slowed down (the `controller.after_plan` fault pause of
cns/faults.py stretches a round past the renew deadline), and a chaos thread freezes one replica
or the other with SIGSTOP for longer than the lease, then lets it run on with whatever writes it
had in flight. Meanwhile a fleet of simulated daemons changes its NNC specs as real daemons do
(requests up and down, releases through ipsNotInUse, release requests honoured), and a checker
follows the NNC watch: after every event, no address may be in two network containers.
"""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.kube.resources import block_entries
from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.fleet import DuplicateWatch, Fleet, addresses, chaos, scrape
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, LEASE_API, NNC_API
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import subnet_objects
from tests.harness.ports import free_port
from tests.harness.process import private_tmp

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    return kube


def start_controller(
    cluster: KubeCluster, workdir: Path, subnet: str, index: int, faults: str, metrics_port: int
) -> subprocess.Popen[bytes]:
    command = controller_command(
        cluster,
        subnet=subnet,
        identity=f"replica-{index}",
        lease_seconds=2,
        metrics_port=metrics_port,
    )
    env = {**private_tmp(workdir), "CNS_FAULTS": faults}
    with (workdir / f"controller{index}.log").open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=log, cwd=REPO, env=env)


@pytest.fixture
def fleet_cluster(cluster: KubeCluster, tmp_path: Path) -> Iterator[Any]:
    """A ClusterSubnet and Node objects; everything the test made is removed afterwards (also
    the subnets it lists in `made["also"]`, and the lease of a controller serving all)."""
    made: dict[str, Any] = {"procs": [], "nodes": [], "subnet": "", "also": []}

    def make(subnet: str, cidr: str, nodes: int) -> list[str]:
        cluster.create(
            {
                "apiVersion": CS_API,
                "kind": "ClusterSubnet",
                "metadata": {"name": subnet},
                "spec": {"subnet": cidr, "exhaustion": {"upperPercent": 90, "lowerPercent": 50}},
            }
        )
        made["subnet"] = subnet
        names = [f"{subnet}-n{i:03d}" for i in range(nodes)]
        for name in names:
            cluster.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        made["nodes"] = names
        return names

    yield make, made
    for proc in made["procs"]:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if made["subnet"]:
        cluster.delete(subnet_objects(cluster, made["subnet"], made["nodes"]), wait=False)
    lease = {"apiVersion": LEASE_API, "kind": "Lease",
             "metadata": {"name": "cns-controller", "namespace": KUBE_SYSTEM}}  # fmt: skip
    also = [o for subnet in made["also"] for o in subnet_objects(cluster, subnet, [])]
    cluster.delete([*also, lease], wait=False)


@pytest.mark.slow
@pytest.mark.parametrize("fencing", [True, False], ids=["fenced", "unfenced"])
def test_two_replicas_with_hostile_timing_never_grant_one_address_twice(
    cluster: KubeCluster, fleet_cluster: Any, tmp_path: Path, fencing: bool
) -> None:
    """With fencing, as deployed; without it, both replicas keep writing as if they led, and
    only the allocation protocol (conditional writes on the IPBlocks and NNCs) keeps them
    from handing one address to two nodes."""
    make, made = fleet_cluster
    subnet = "hostile" if fencing else "unfenced"
    # A /12, as in the field report: the old planner walked all of it every round (seconds).
    nodes = make(subnet, "10.80.0.0/12", 40)
    faults = "controller.after_plan=0-2.2,controller.before_nnc_write=0-0.3"
    if not fencing:
        faults += ",controller.skip_fencing=1"
    ports = [free_port(), free_port()]
    procs = [start_controller(cluster, tmp_path, subnet, i, faults, ports[i]) for i in range(2)]
    made["procs"] = procs
    cluster.wait_for(
        lambda: all(cluster.exists(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in nodes),
        timeout=60,
        what="an NNC for every node",
    )
    checker = DuplicateWatch(cluster)
    checker.start()
    fleet = Fleet(cluster, nodes, seed=11)
    fleet.start()
    lease_name = f"cns-controller-{subnet}"
    # Churn and freezes until the checker has followed enough of them, not for a fixed time: a
    # loaded machine gets through fewer events a second (481 in 40 s were seen at load 7).
    deadline, freezes = time.monotonic() + 300, 0
    while checker.events <= 500 or freezes < 10:
        assert time.monotonic() < deadline, f"{checker.events} events, {freezes} freezes in 300 s"
        freezes += chaos(cluster, lease_name, procs, time.monotonic() + 10)
    fleet.stop.set()
    fleet.join()

    settled = fleet.settle(request=31, timeout=120)
    assert settled is not None, "the nodes were not all fulfilled within 120 s"
    time.sleep(2)
    checker.stop.set()
    checker.join(timeout=15)

    assert checker.duplicates == [], checker.duplicates[:10]
    lease = cluster.get(LEASE_API, "Lease", lease_name, KUBE_SYSTEM)
    transitions = lease["spec"]["leaseTransitions"]
    assert transitions >= 5, f"only {transitions} lease changes in {freezes} freezes"
    logs = "".join((tmp_path / f"controller{i}.log").read_text() for i in range(2))
    refused = logs.count('"ipblock_write_refused"') + logs.count('"nnc_write_refused"')
    if fencing:  # stale leaders stepped down
        assert "not renewed in time" in logs
    else:  # stale writers wrote, and their conditional writes were refused
        assert refused > 0
    # The record agrees with the containers: every address a node holds is claimed for it.
    claimed: dict[str, str] = {}
    for block in cluster.request(
        "GET",
        cluster.path_for(CS_API, "IPBlock"),
        params={"labelSelector": f"acn.azure.com/subnet={subnet}"},
    ).json["items"]:
        for address, entry in block_entries(block).items():
            claimed[address] = entry.node
    for node in nodes:
        for address in addresses(cluster.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)):
            assert claimed.get(address) == node, (address, node, claimed.get(address))
    status = cluster.get(CS_API, "ClusterSubnet", subnet)["status"]
    assert status["duplicateIPCount"] == 0 and status["conflictIPCount"] == 0
    scraped = [scrape(port) for port in ports]
    assert all(s["cns_controller_duplicate_addresses_found_total"] == 0 for s in scraped)
    assert sum(s["cns_controller_leader"] for s in scraped) <= 1
    conflicts = sum(v for s in scraped for k, v in s.items() if "write_conflicts" in k)
    if not fencing:
        assert conflicts > 0
    print(json.dumps({"events": checker.events, "transitions": transitions, "freezes": freezes,
                      "fleet_writes": fleet.writes, "refused": refused,
                      "settled_seconds": round(settled, 1)}))  # fmt: skip


V4, V6 = "10.90.0.0/26", "fd00:10::/112"


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
    cluster: KubeCluster, fleet_cluster: Any, tmp_path: Path
) -> None:
    """The real controller serving a node from the IPv4 subnet it is placed in and an IPv6 one
    it asks for by name (`spec.subnets`), as the API server stores what it writes: one network
    container per subnet, in the wire order, each with its own id, version and primary IP and
    addresses of its own subnet only, claimed in that subnet's IPBlocks; the exhaustion of one
    subnet leaves the other's container alone; a release through the entry's `ipsNotInUse`
    follows the handshake."""
    make, made = fleet_cluster
    tag = uuid.uuid4().hex[:6]
    v4, v6 = f"dual4-{tag}", f"dual6-{tag}"
    node, other = make(v4, V4, 2)
    never = {"matchLabels": {"never": "true"}}  # no node is placed in it
    spec = {"subnet": V6, "exhaustion": {"upperPercent": 90}, "nodeSelector": never}
    cluster.create({"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": v6},
                    "spec": spec})  # fmt: skip
    made["also"] = [v6]
    made["procs"] = [start_controller(cluster, tmp_path, "", 0, "", free_port())]
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
