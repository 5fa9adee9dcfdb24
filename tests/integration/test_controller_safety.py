"""Two `cns controller` replicas on a real kube-apiserver, with the timing made hostile on purpose.

The lease is short, planning is slowed down (the `controller.after_plan` fault pause of
cns/support/faults.py stretches a round past the renew deadline), and a chaos thread freezes one
replica or the other with SIGSTOP for longer than the lease, then lets it run on with whatever
writes it had in flight. Meanwhile a fleet of simulated daemons changes its NNC specs as real
daemons do (requests up and down, releases through ipsNotInUse, release requests honoured), and a
checker follows the NNC watch: after every event, no address may be in two network containers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.kube.ipblock import block_entries
from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.fleet import (
    DuplicateWatch,
    Fleet,
    HoldingWatch,
    addresses,
    chaos,
    nnc_path,
    scrape,
)
from tests.harness.kube_api import (
    CS_API,
    KUBE_SYSTEM,
    LEASE_API,
    MERGE_PATCH,
    NNC_API,
    ApiError,
)
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import object_ref, subnet_objects
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


def start_replicas(
    cluster: KubeCluster,
    workdir: Path,
    subnet: str,
    faults: str,
    ports: list[int],
    nodes: list[str],
) -> list[subprocess.Popen[bytes]]:
    """A replica per metrics port; returns once they made an NNC for every node."""
    procs = [start_controller(cluster, workdir, subnet, i, faults, p) for i, p in enumerate(ports)]
    try:
        cluster.wait_for(
            lambda: all(
                cluster.exists(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in nodes
            ),
            timeout=60,
            what="an NNC for every node",
        )
    except Exception:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    return procs


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
    procs = start_replicas(cluster, tmp_path, subnet, faults, ports, nodes)
    made["procs"] = procs
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


class HoldingDaemons(threading.Thread):
    """Daemons whose pods keep every address they are given: each asks for `request`. A node
    whose NNC is gone re-creates it half of the times (the controller does otherwise), and a
    node asks by name (`requestedIPs`) for what its pods hold and its NNC does not list."""

    def __init__(
        self, cluster: KubeCluster, nodes: list[str], watch: HoldingWatch, request: int
    ) -> None:
        super().__init__(daemon=True)
        self.cluster, self.nodes, self.watch, self.request = cluster, nodes, watch, request
        self.rng = random.Random(5)
        self.stop = threading.Event()
        self.created = 0

    def step(self, node: str) -> None:
        with self.watch.lock:
            held = set(self.watch.held.get(node, {}))
        answer = self.cluster.request("GET", nnc_path(self.cluster, node))
        if answer.status == 404:
            if self.rng.random() < 0.5:
                owner = self.cluster.get("v1", "Node", node)["metadata"]
                ref = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": owner["uid"]}
                spec = {"requestedIPCount": self.request, "requestedIPs": sorted(held)}
                meta = {"name": node, "namespace": KUBE_SYSTEM, "ownerReferences": [ref]}
                body = {"apiVersion": NNC_API, "kind": "NodeNetworkConfig", "metadata": meta}
                if self.cluster.request("POST", nnc_path(self.cluster), {**body, "spec": spec}).ok:
                    self.created += 1
            return
        nnc = answer.raise_for_status().json
        wanted = {
            "requestedIPCount": self.request,
            "requestedIPs": sorted(held - set(addresses(nnc))),
        }
        spec = nnc.get("spec") or {}
        if {k: spec.get(k) or ([] if k == "requestedIPs" else 0) for k in wanted} != wanted:
            self.cluster.request(
                "PATCH", nnc_path(self.cluster, node), {"spec": wanted}, MERGE_PATCH
            )

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(ApiError, OSError):
                self.step(self.rng.choice(self.nodes))
            time.sleep(self.rng.uniform(0.0, 0.1))


class InFlightDeleter(threading.Thread):
    """`kubectl delete nnc` at the worst moments: follows the IPBlocks, and deletes the NNC of a
    node the moment the record shows it an address its NNC does not list yet (a grant or a move
    between its block write and its NNC write), at most once every few seconds a node; and,
    whenever nothing was deleted for a while, the NNC of a node that holds addresses."""

    def __init__(self, cluster: KubeCluster, subnet: str, nodes: list[str], watch: HoldingWatch):
        super().__init__(daemon=True)
        self.cluster, self.subnet, self.nodes, self.watch = cluster, subnet, nodes, watch
        self.stop = threading.Event()
        self.deleted: list[str] = []
        self.in_flight = 0  # deletions while a grant or a move was in flight
        self.last: dict[str, float] = {}
        self.rng = random.Random(3)

    def run(self) -> None:
        path = self.cluster.path_for(CS_API, "IPBlock")
        selector = {"labelSelector": f"acn.azure.com/subnet={self.subnet}"}
        version = ""
        while not self.stop.is_set():
            try:
                if not version:  # (again) after an error: the watch starts from a new list
                    listing = self.cluster.request("GET", path, params=selector)
                    version = listing.raise_for_status().json["metadata"]["resourceVersion"]
                params = {**selector, "resourceVersion": version, "timeoutSeconds": 1}
                for event in self.cluster.watch(path, params, timeout=10):
                    if event["type"] == "ERROR":
                        version = ""
                        break
                    block = event["object"]
                    version = block["metadata"]["resourceVersion"]
                    if event["type"] != "DELETED" and not self.stop.is_set():
                        self._seen(block)
                if not self.stop.is_set():
                    self._quiet()
            except (ApiError, OSError):
                version = ""
                time.sleep(0.2)

    def _seen(self, block: dict[str, Any]) -> None:
        for address, entry in block_entries(block).items():
            node = entry.node
            with self.watch.lock:
                listed = address in self.watch.listed.get(node, {})
            due = time.monotonic() - self.last.get(node, -10.0) >= 4.0
            if node in self.nodes and not listed and not entry.releasing and due:
                self.in_flight += self._delete_nnc(node)

    def _quiet(self) -> None:
        if time.monotonic() - max(self.last.values(), default=0.0) < 2.0:
            return
        with self.watch.lock:
            holding = sorted(n for n in self.nodes if self.watch.listed.get(n))
        if holding:
            self._delete_nnc(self.rng.choice(holding))

    def _delete_nnc(self, node: str) -> bool:
        self.last[node] = time.monotonic()
        if not self.cluster.request("DELETE", nnc_path(self.cluster, node)).ok:
            return False
        self.deleted.append(node)
        return True


@pytest.mark.slow
def test_nncs_deleted_while_their_nodes_hold_addresses_never_put_one_on_two_nodes(
    cluster: KubeCluster, fleet_cluster: Any, tmp_path: Path
) -> None:
    """`kubectl delete nnc` while the node's pods hold addresses, with two replicas writing as
    if both led (fencing off), planning slowed, one replica frozen for longer than the lease
    now and then (and resuming with stale caches), and each deletion timed for the moment a
    grant or a move is between its block write and its NNC write. The subnet is short, so an
    address the controller let go would be granted to another node at once. Never is an address
    listed by one node while another node's pods hold it; once the deletions stop, every node
    has back in its NNC all its pods hold, under the names they had; a node whose Node object is
    deleted afterwards loses its addresses to the others."""
    make, made = fleet_cluster
    subnet = "nncgone"
    nodes = make(subnet, "10.96.0.0/27", 5)  # 29 usable: 5 nodes asking 1 + 6 each are short
    faults = "controller.after_plan=0-1.5,controller.before_nnc_write=0.2-0.6"
    faults += ",controller.skip_fencing=1"
    ports = [free_port(), free_port()]
    procs = start_replicas(cluster, tmp_path, subnet, faults, ports, nodes)
    made["procs"] = procs
    watch = HoldingWatch(cluster)
    watch.start()
    daemons = HoldingDaemons(cluster, nodes, watch, request=6)
    daemons.start()
    deleter = InFlightDeleter(cluster, subnet, nodes, watch)
    deleter.start()
    deadline, freezes = time.monotonic() + 300, 0
    while len(deleter.deleted) < 12 or deleter.in_flight < 4 or freezes < 6:
        assert time.monotonic() < deadline, f"{deleter.deleted} deleted, {freezes} freezes"
        freezes += chaos(cluster, f"cns-controller-{subnet}", procs, time.monotonic() + 8)
        assert watch.violations == [], watch.violations[:10]
    deleter.stop.set()
    deleter.join(timeout=15)

    def returned() -> bool:
        with watch.lock:
            return all(set(watch.held.get(n, {})) <= set(watch.listed.get(n, {})) for n in nodes)

    cluster.wait_for(returned, timeout=120, what="every node's held addresses back in its NNC")
    # The node that leaves is one whose pods hold addresses: a node the short subnet left with
    # its primary IP only has nothing for the others to be granted.
    with watch.lock:
        gone = max(nodes, key=lambda n: (len(watch.held.get(n, {})), n))
        lost = set(watch.held[gone])
    others = [n for n in nodes if n != gone]
    watch.node_gone(gone)
    cluster.delete([object_ref("v1", "Node", gone)])
    cluster.delete([object_ref(NNC_API, "NodeNetworkConfig", gone, KUBE_SYSTEM)])  # the GC's
    cluster.wait_for(
        lambda: gone not in set(_claimed(cluster, subnet).values()),
        timeout=60,
        what=f"{gone}'s addresses freed",
    )

    def reused() -> bool:
        with watch.lock:
            return any(lost & set(watch.listed.get(n, {})) for n in others)

    cluster.wait_for(reused, timeout=60, what=f"{gone}'s addresses granted to the others")
    daemons.stop.set()
    daemons.join(timeout=15)
    time.sleep(1)
    watch.stop.set()
    watch.join(timeout=15)

    assert watch.violations == [], watch.violations[:10]
    assert watch.renamed == [], watch.renamed[:10]
    logs = "".join((tmp_path / f"controller{i}.log").read_text() for i in range(2))
    assert '"nnc_replaced_addresses_kept"' in logs
    assert '"node_gone_addresses_freed"' in logs
    claimed = _claimed(cluster, subnet)
    for node in others:
        for address in addresses(_nnc(cluster, node)):
            assert claimed.get(address) == node, (address, node, claimed.get(address))
    print(json.dumps({"events": watch.events, "deleted": len(deleter.deleted),
                      "deleted_in_flight": deleter.in_flight, "freezes": freezes,
                      "created_by_daemons": daemons.created}))  # fmt: skip
