"""Kubernetes mode end to end: a real kube-apiserver + etcd, `cns controller` and three `cns run`
daemons as separate processes, each with the RBAC-limited credentials of config/rbac.yaml.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.bridge import BridgeNetwork, require_bridge
from tests.harness.controller import controller_command
from tests.harness.daemon import Daemon
from tests.harness.fleet import addresses, scrape
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, LEASE_API, NNC_API
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import (
    Scenario,
    installed,
    object_ref,
    scenarios,
    subnet_objects,
)
from tests.harness.ports import free_port
from tests.harness.process import private_tmp

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


def formula(demand: int, batch: int = 16) -> int:
    return batch * math.ceil(0.5 + demand / batch) - 1


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    return installed(kube)


@pytest.fixture
def scenario_factory(cluster: KubeCluster, tmp_path: Path) -> Iterator[Any]:
    yield from scenarios(cluster, tmp_path)


def add(daemon: Daemon, container: str) -> tuple[int, Any]:
    return daemon.call("POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"})


def pods(cluster: KubeCluster, node: str, name: str) -> None:
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        }
    )


def published(daemon: Daemon) -> list[int]:
    """Every requestedIPCount the daemon wrote to its NNC, in order."""
    return [
        json.loads(line)["requested_ip_count"]
        for line in daemon.log().splitlines()
        if '"pool_request_published"' in line
    ]


def create_pods_at_once(cluster: KubeCluster, node: str, count: int, prefix: str) -> list[str]:
    """Bind `count` pods to `node` concurrently, as a scheduler does in a burst."""
    names = [f"{prefix}-{i}" for i in range(count)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda name: pods(cluster, node, name), names))
    return names


@pytest.mark.slow
@pytest.mark.root
def test_controller_and_three_daemons(
    scenario_factory: Any, cluster: KubeCluster, plugin_dir: Path
) -> None:
    require_bridge()
    scenario: Scenario = scenario_factory("e2e-subnet", "10.61.0.0/24")
    for node in ("e2e-n1", "e2e-n2", "e2e-n3"):
        scenario.add_node(node)
    scenario.start_controller()
    for node in scenario.nodes:
        scenario.start_daemon(node)
    n1, n2, n3 = (scenario.daemons[n] for n in scenario.nodes)

    def no_ip_on_two_nodes() -> None:
        addresses = scenario.all_nc_addresses()
        assert len(addresses) == len(set(addresses)), "an address is in two network containers"

    # The controller created one NNC per node, each starting from an empty NC (phase 2-1).
    for node in scenario.nodes:
        assert scenario.nnc(node)["metadata"]["ownerReferences"][0]["name"] == node
    no_ip_on_two_nodes()

    # Pods on n1 get working networks from the reference bridge plugin with cns-ipam.
    bridge = BridgeNetwork(n1, plugin_dir, f"k{os.getpid() % 1000}")
    try:
        for pod in range(3):
            result = bridge.cni("ADD", pod)
            assert result.returncode == 0, result.stdout + result.stderr
            address = json.loads(result.stdout)["ips"][0]["address"]
            assert address.startswith("10.61.0.") and address.endswith("/24")
            ping = bridge.ping(pod, "10.61.0.1")
            assert ping.returncode == 0, ping.stdout + ping.stderr
            owner = {ip["owner"]["containerID"] for ip in n1.ips() if ip["owner"]}
            assert f"e2e-{pod}" in owner
        for pod in range(3):
            assert bridge.cni("DEL", pod).returncode == 0
    finally:
        bridge.cleanup()
    no_ip_on_two_nodes()

    replies = [add(n1, f"a{i}") for i in range(20)] + [add(n2, f"b{i}") for i in range(5)]
    assert all(status == 200 for status, _ in replies), replies
    assert len({body["ips"][0]["address"] for _, body in replies}) == 25
    scenario.wait(
        lambda: scenario.nnc("e2e-n1")["spec"]["requestedIPCount"] == formula(20),
        "n1 to request the formula's count",
    )
    assert scenario.nnc("e2e-n2")["spec"]["requestedIPCount"] == formula(5)
    no_ip_on_two_nodes()

    # A burst of 100 pods bound to n3 grows the pool in one step per coalesced batch of pod
    # events (15 -> 111), not one NNC update per batch of 16 IPs (7); they count as demand
    # before any of them asked for an IP (phase 3-1). The daemons here coalesce for at most 10 s
    # (1 s quiet); even so a very loaded machine can split the burst in two updates (seen with
    # the default 0.1 s / 1 s: 63, then 111). The controller is killed while it allocates, and a
    # new one finishes the job without duplicates.
    before = published(n3)
    names = create_pods_at_once(cluster, "e2e-n3", 100, "burst")
    scenario.wait(
        lambda: scenario.nnc("e2e-n3")["spec"]["requestedIPCount"] == formula(100),
        "n3 to ask for the whole burst",
    )
    scenario.controllers[0].send_signal(signal.SIGKILL)
    scenario.controllers[0].wait()
    scenario.start_controller()
    grown = published(n3)[len(before) :]
    assert grown[-1] == formula(100) and len(grown) <= 2, grown
    scenario.wait(lambda: n3.pool()["ips"]["Available"] == formula(100), "n3 to get its IPs", 60)
    no_ip_on_two_nodes()

    # etcd compacted and the API server restarted: watches resume from a compacted
    # resourceVersion, get 410 Gone and list again; ADD and DEL work all the while.
    cluster.compact_etcd()
    cluster.stop_apiserver()
    try:
        for i in range(5):
            assert add(n2, f"outage{i}")[0] == 200
        assert n2.call("POST", "/v1/cni/del", {"containerID": "b0", "ifName": "eth0"})[0] == 200
    finally:
        cluster.start_apiserver()
    scenario.wait(
        lambda: any("watch_expired_relisting" in d.log() for d in scenario.daemons.values()),
        "a daemon watch to recover through 410 Gone",
        timeout=60,
    )

    # The pods go away: n3 shrinks through the release handshake.
    for name in names:  # no kubelet here: delete at once rather than gracefully
        path = f"/api/v1/namespaces/default/pods/{name}"
        cluster.request("DELETE", path, params={"gracePeriodSeconds": "0"}).raise_for_status()
    scenario.wait(
        lambda: scenario.nnc("e2e-n3")["spec"]["requestedIPCount"] == formula(0),
        "n3 to shrink back to one batch",
        timeout=60,
    )
    scenario.wait(
        lambda: (
            n3.pool()["ips"]["PendingRelease"] == 0
            and n3.pool()["ips"]["Available"] == formula(0)
            and scenario.nnc("e2e-n3")["spec"].get("ipsNotInUse") == []
        ),
        "the release handshake to complete",
        timeout=60,
    )
    no_ip_on_two_nodes()
    assert n2.pool()["ips"]["Assigned"] == 9  # 5 + 5 during the outage - 1 deleted
    status = cluster.get(CS_API, "ClusterSubnet", "e2e-subnet")["status"]
    assert status["reservedIPCount"] == len(scenario.all_nc_addresses())
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
    replies = []
    for i in range(50):
        replies.append(add(n1, f"s{i}"))
        assert replies[-1][0] == 200, replies[-1]
        addresses = scenario.all_nc_addresses()  # subnet-wide, after every step
        assert len(addresses) == len(set(addresses)), f"an address is on two nodes at step {i}"
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
    # The daemon starts before its node is registered: no NNC yet, so it waits, not serving.
    early = scenario.start_daemon("le-n1", wait=False)
    time.sleep(2)
    assert early.proc is not None and early.proc.poll() is None
    assert not early.socket.exists()
    scenario.add_node("le-n1")
    first = scenario.start_controller(lease_seconds=3)
    scenario.wait(lambda: "leader_elected" in scenario.controller_log(0), "a leader")
    second = scenario.start_controller(lease_seconds=3)
    early.wait_ready()
    daemon = early
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


@pytest.mark.slow
def test_daemon_restart_with_a_release_in_flight(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    scenario: Scenario = scenario_factory("inflight-subnet", "10.64.0.0/24")
    scenario.add_node("if-n1")
    controller = scenario.start_controller()
    # The IPs given back cool down before the pool lets them go: briefly, here.
    daemon = scenario.start_daemon("if-n1", config={"ipCooldownSeconds": 1})
    assert all(add(daemon, f"f{i}")[0] == 200 for i in range(40))
    scenario.wait(lambda: daemon.pool()["ips"]["Available"] == formula(40) - 40, "the pool")

    # No control plane: the release the daemon asks for stays in flight in its NNC spec.
    controller.send_signal(signal.SIGKILL)
    controller.wait()
    for i in range(40):
        assert (
            daemon.call("POST", "/v1/cni/del", {"containerID": f"f{i}", "ifName": "eth0"})[0] == 200
        )
    in_flight = scenario.wait(
        lambda: scenario.nnc("if-n1")["spec"].get("ipsNotInUse"), "a release in flight"
    )
    assert len(in_flight) == formula(40) - formula(0)
    releasing = {ip["address"] for ip in daemon.ips() if ip["id"] in in_flight}

    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.start()
    pool = daemon.pool()
    assert pool["ips"]["PendingRelease"] == len(in_flight)
    assert pool["ips"]["Available"] == formula(0)
    given = {add(daemon, f"g{i}")[1]["ips"][0]["address"].split("/")[0] for i in range(10)}
    assert given.isdisjoint(releasing)  # never an IP the control plane may give away

    scenario.start_controller()
    scenario.wait(
        lambda: (
            daemon.pool()["ips"]["PendingRelease"] == 0
            and scenario.nnc("if-n1")["spec"].get("ipsNotInUse") == []
        ),
        "the handshake to complete after the restart",
        timeout=60,
    )


@pytest.mark.slow
def test_daemon_restarted_during_an_api_outage_serves_from_its_snapshot(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    scenario: Scenario = scenario_factory("outage-subnet", "10.65.0.0/24")
    scenario.add_node("ou-n1")
    scenario.start_controller()
    daemon = scenario.start_daemon("ou-n1")
    before = {i: add(daemon, f"o{i}")[1]["ips"][0]["address"] for i in range(5)}
    scenario.wait(lambda: daemon.pool()["ips"]["Available"] == formula(5) - 5, "the pool")

    cluster.stop_apiserver()
    try:
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        daemon.start()  # ready although the API server is down
        assert "kube_snapshot_loaded" in daemon.log()
        assert {i: add(daemon, f"o{i}")[1]["ips"][0]["address"] for i in range(5)} == before
        fresh = [add(daemon, f"n{i}") for i in range(5)]
        assert all(status == 200 for status, _ in fresh)
        assert len({b["ips"][0]["address"] for _, b in fresh} | set(before.values())) == 10
    finally:
        cluster.start_apiserver()
    scenario.wait(
        lambda: scenario.nnc("ou-n1")["spec"]["requestedIPCount"] == formula(10),
        "the daemon to catch up with the API server",
        timeout=60,
    )


@pytest.mark.slow
def test_an_address_found_on_two_nodes_is_reclaimed_from_the_one_not_using_it(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """Two nodes list the same addresses (as an older control plane or a hand edit could leave
    them): A is used by a pod on n1, B by nobody. The controller's audit asks both nodes to give
    both up; n1 keeps A (its pod uses it) and gives B back, n2 gives both back."""
    scenario: Scenario = scenario_factory("audit-subnet", "10.66.0.0/24")
    for node in ("au-n1", "au-n2"):
        scenario.add_node(node)
    controller = scenario.start_controller()
    n1, n2 = (scenario.start_daemon(node) for node in scenario.nodes)
    status, body = add(n1, "pod-a")
    assert status == 200, body
    used = body["ips"][0]["address"].split("/")[0]
    free = next(ip["address"] for ip in n1.ips() if ip["state"] == "Available")
    controller.send_signal(signal.SIGTERM)
    assert controller.wait(timeout=15) == 0
    # A clean stop: the lease is handed over and the client's CA file (its TMPDIR is the
    # scenario's directory) is gone.
    assert [p.name for p in scenario.workdir.iterdir() if p.name.startswith("tmp")] == []
    lease = cluster.get("coordination.k8s.io/v1", "Lease", "cns-controller-audit-subnet",
                        "kube-system")  # fmt: skip
    assert not lease["spec"].get("holderIdentity")

    nnc = scenario.nnc("au-n2")
    nc = nnc["status"]["networkContainers"][0]
    nc["ipAssignments"] += [{"name": "dup-used", "ip": used}, {"name": "dup-free", "ip": free}]
    nc["version"] += 1
    cluster.patch(NNC_API, "NodeNetworkConfig", "au-n2", {"status": nnc["status"]}, "kube-system",
                  subresource="status")  # fmt: skip
    scenario.wait(lambda: {"dup-used", "dup-free"} <= {ip["id"] for ip in n2.ips()}, "n2 to apply")
    addresses = scenario.all_nc_addresses()
    assert len(addresses) == len(set(addresses)) + 2  # the two duplicates are in place

    scenario.start_controller()

    def repaired() -> bool:
        held = {n: set(addr for addr in scenario.all_nc_addresses_of(n)) for n in scenario.nodes}
        return (
            used in held["au-n1"]
            and used not in held["au-n2"]
            and not (held["au-n1"] & held["au-n2"])
        )

    scenario.wait(repaired, "the duplicates to be reclaimed", timeout=60)
    assert next(ip for ip in n1.ips() if ip["address"] == used)["owner"]["containerID"] == "pod-a"
    addresses = scenario.all_nc_addresses()
    assert len(addresses) == len(set(addresses))
    scenario.wait(
        lambda: (
            cluster.get(CS_API, "ClusterSubnet", "audit-subnet")["status"].get("duplicateIPCount")
            == 0
        ),
        "the subnet status to show no duplicates",
    )
    log = scenario.controller_log(1)
    assert f'"address": "{used}"' in log and f'"address": "{free}"' in log
    assert '"duplicate_address"' in log
    assert '"ip_release_refused"' in n1.log()  # n1's pod uses it: kept
    assert '"ip_release_requested"' in n2.log()


@pytest.mark.slow
def test_a_request_written_ahead_but_never_published_is_published_after_a_restart(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """kube-snapshot.json is written before every publish (its ipsNotInUse must survive a crash),
    so a `kill -9` between that write and the NNC patch leaves a snapshot asking for more than
    the API server ever heard. The restarted daemon took the snapshot's request for what it had
    published; with few enough IPs free to keep that request (no shrink below the release
    threshold) it never sent it, and its ADDs waited for IPs nobody had been asked for (found
    by bench/stress/crash_rounds.py in Kubernetes mode)."""
    scenario: Scenario = scenario_factory("ahead-subnet", "10.67.0.0/24")
    scenario.add_node("ah-n1")
    scenario.start_controller()
    daemon = scenario.start_daemon("ah-n1")
    assert all(add(daemon, f"a{i}")[0] == 200 for i in range(8))
    scenario.wait(lambda: daemon.pool()["ips"]["Available"] == formula(8) - 8, "the pool")
    assert scenario.nnc("ah-n1")["spec"]["requestedIPCount"] == formula(8) == 15

    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    snapshot = daemon.state_dir / "kube-snapshot.json"
    data = json.loads(snapshot.read_text())
    data["nodenetworkconfig"]["spec"]["requestedIPCount"] = formula(16)  # written ahead: 31
    snapshot.write_text(json.dumps(data))
    daemon.start()

    replies = [add(daemon, f"b{i}") for i in range(8)]  # the 16th pod needs the 16th IP
    assert all(status == 200 for status, _ in replies), replies[-1]
    assert scenario.nnc("ah-n1")["spec"]["requestedIPCount"] == formula(16)


def start_controller(
    scenario: Scenario,
    identity: str,
    *,
    metrics_port: int | None = None,
    faults: str = "",
    subnet: str | None = None,
) -> subprocess.Popen[bytes]:
    """A controller of the scenario's subnet (or of `subnet`; "": every one), logging to
    `<identity>.log`, with its metrics endpoint and fault points (cns/support/faults.py) as given;
    the scenario stops it at the end."""
    command = controller_command(
        scenario.cluster,
        subnet=scenario.subnet if subnet is None else subnet,
        identity=identity,
        lease_seconds=3,
        metrics_port=metrics_port,
    )
    env = {**private_tmp(scenario.workdir), "CNS_FAULTS": faults}
    with (scenario.workdir / f"{identity}.log").open("ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, cwd=REPO, env=env)
    scenario.controllers.append(proc)
    return proc


@pytest.mark.slow
def test_sigterm_stops_a_round_in_flight_and_hands_the_lease_over(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """SIGTERM while a round is between planning and writing (held there by a fault pause far
    longer than the test waits): the process exits at once with 0, nothing of the round is
    written, and the lease is given up for a standby to take at once."""
    scenario: Scenario = scenario_factory("term-subnet", "10.64.0.0/24")
    scenario.add_node("term-n1")
    controller = start_controller(scenario, "term", faults="controller.after_plan=600-600")
    scenario.wait(
        lambda: cluster.exists(NNC_API, "NodeNetworkConfig", "term-n1", KUBE_SYSTEM),
        "the round's NNC for term-n1",
        timeout=60,
    )
    time.sleep(1)  # the round plans (milliseconds) and reaches the pause
    controller.send_signal(signal.SIGTERM)
    assert controller.wait(timeout=15) == 0
    log = (scenario.workdir / "term.log").read_text()
    assert '"lease_released"' in log and '"controller_stopped"' in log, log[-2000:]
    lease = cluster.get("coordination.k8s.io/v1", "Lease", "cns-controller-term-subnet",
                        "kube-system")  # fmt: skip
    assert not lease["spec"].get("holderIdentity")
    assert addresses(scenario.nnc("term-n1")) == []  # the planned container was never written


@pytest.mark.slow
def test_the_controller_is_not_woken_by_its_own_writes(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """Every status the controller writes comes back on its watches; none of those echoes may
    start a round. A node's spec change still does, at once."""
    scenario: Scenario = scenario_factory("quiet-subnet", "10.62.0.0/20")
    for node in ("quiet-n1", "quiet-n2", "quiet-n3"):
        scenario.add_node(node)
    port = free_port()
    start_controller(scenario, "quiet", metrics_port=port)

    def fulfilled(node: str, count: int) -> bool:
        nnc = scenario.nnc(node)
        return nnc["spec"].get("requestedIPCount") == count and len(addresses(nnc)) == count + 1

    def request(node: str, count: int) -> None:
        patch = {"spec": {"requestedIPCount": count}}
        cluster.patch(NNC_API, "NodeNetworkConfig", node, patch, KUBE_SYSTEM)

    for node in scenario.nodes:
        scenario.wait(
            lambda node=node: cluster.exists(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM),
            f"an NNC for {node}",
        )
        request(node, 16)
    for node in scenario.nodes:
        scenario.wait(lambda node=node: fulfilled(node, 16), f"{node} to get 16 IPs")

    def rounds() -> float:
        return scrape(port)["cns_controller_rounds_total"]

    # Settled: the writes of the last rounds (NNC statuses, blocks, subnet status) have all
    # come back on the watches by the time two scrapes a watch's round trip apart agree.
    def quiet() -> float | None:
        before = rounds()
        time.sleep(2)
        after = rounds()
        return after if after == before else None

    settled = scenario.wait(quiet, "the controller to go quiet", timeout=60)
    time.sleep(3)
    assert rounds() == settled, "a round ran with nothing changed"

    request("quiet-n2", 40)
    scenario.wait(lambda: fulfilled("quiet-n2", 40), "quiet-n2 to get 40 IPs")
    again = scenario.wait(quiet, "the controller to go quiet again", timeout=60)
    # One round for the change; the echoes of its writes start none.
    assert again - settled == 1, (settled, again)


@pytest.mark.slow
def test_one_controller_serves_every_subnet_and_each_daemon_follows_its_own(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """One controller, no --subnet, three ClusterSubnets that choose their nodes by label:
    each node gets addresses of its own subnet, and its daemon (no subnetName configured)
    follows the subnet its NNC names. A subnet overlapping an older one is not served; a node
    no subnet claims gets no NNC, until a label change places it, at once."""
    scenario: Scenario = scenario_factory("ms-a", "10.66.0.0/24")
    selector = {"spec": {"nodeSelector": {"matchLabels": {"pool": "a"}}}}
    cluster.patch(CS_API, "ClusterSubnet", "ms-a", selector)
    extra = []
    for name, cidr, pool in (("ms-b", "10.66.1.0/24", "b"), ("ms-c", "10.66.0.128/25", "c")):
        time.sleep(1.1)  # creationTimestamp has seconds: ms-c is strictly younger than ms-a
        cluster.create({
            "apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": name},
            "spec": {"subnet": cidr, "nodeSelector": {"matchLabels": {"pool": pool}}},
        })  # fmt: skip
        extra += subnet_objects(cluster, name, [])
    extra.append(object_ref(LEASE_API, "Lease", "cns-controller", KUBE_SYSTEM))
    try:
        for node, labels in (("ms-n1", {"pool": "a"}), ("ms-n2", {"pool": "b"}),
                             ("ms-n3", {"pool": "c"}), ("ms-n4", {})):  # fmt: skip
            cluster.create({"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": node, "labels": labels}})  # fmt: skip
            scenario.nodes.append(node)
        controller = start_controller(scenario, "all", subnet="")

        def placed(node: str) -> str | None:
            if not cluster.exists(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM):
                return None
            labels = scenario.nnc(node)["metadata"].get("labels") or {}
            return labels.get("acn.azure.com/subnet")

        scenario.wait(lambda: placed("ms-n1") == "ms-a", "ms-n1 placed in ms-a", timeout=60)
        scenario.wait(lambda: placed("ms-n2") == "ms-b", "ms-n2 placed in ms-b")
        log = scenario.wait(
            lambda: (text := (scenario.workdir / "all.log").read_text()).count(
                '"node_not_served"') >= 2 and text, "ms-n3 and ms-n4 said unserved")  # fmt: skip
        assert '"subnet_overlaps"' in log and '"older": "ms-a"' in log, log[-3000:]
        assert placed("ms-n3") is None and placed("ms-n4") is None

        # A label change places a waiting node at once (not at the 5-minute re-check), while
        # nothing else changes (no daemon runs yet).
        time.sleep(2)
        cluster.patch("v1", "Node", "ms-n4", {"metadata": {"labels": {"pool": "b"}}})
        scenario.wait(lambda: placed("ms-n4") == "ms-b", "ms-n4 placed in ms-b", timeout=20)

        n1 = scenario.start_daemon("ms-n1", subnet_name="")
        n2 = scenario.start_daemon("ms-n2", subnet_name="")
        (status1, body1), (status2, body2) = add(n1, "ms-pod1"), add(n2, "ms-pod2")
        assert (status1, status2) == (200, 200), (body1, body2)
        assert body1["ips"][0]["address"].startswith("10.66.0."), body1
        assert body2["ips"][0]["address"].startswith("10.66.1."), body2
        assert '"subnet_followed"' in n2.log() and '"subnet": "ms-b"' in n2.log()

        def node_counts() -> dict[str, Any]:
            return {
                name: (cluster.get(CS_API, "ClusterSubnet", name).get("status") or {}).get(
                    "nodeCount")
                for name in ("ms-a", "ms-b", "ms-c")
            }  # fmt: skip

        scenario.wait(lambda: node_counts() == {"ms-a": 1, "ms-b": 2, "ms-c": None},
                      "the subnets' node counts")  # fmt: skip
        assert not cluster.exists(CS_API, "ClusterSubnetState", "ms-c")
        assert controller.poll() is None
    finally:
        scenario.cleanup()
        cluster.delete(extra)


@pytest.mark.slow
def test_a_pod_keeps_its_annotated_address_when_it_moves_to_another_node(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """StatefulSet-style sticky addresses: a pod annotated `acn.azure.com/ip-address` gets that
    address on its node (the controller grants it by name), and again on another node after
    it moved: the controller asks the first node to give the address back (it does, since no
    pod of its own uses it), then grants it to the second."""
    scenario: Scenario = scenario_factory("sticky-subnet", "10.67.0.0/24")
    for node in ("st-n1", "st-n2"):
        scenario.add_node(node)
    scenario.start_controller()
    n1, n2 = scenario.start_daemon("st-n1"), scenario.start_daemon("st-n2")
    sticky = "10.67.0.200"

    def place(node: str, annotation: str) -> None:
        cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "db-0", "namespace": "default",
                         "annotations": {"acn.azure.com/ip-address": annotation}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        })  # fmt: skip

    def add_pod(daemon: Daemon, container: str) -> tuple[int, Any]:
        body = {"containerID": container, "ifName": "eth0", "netns": "/var/run/netns/x",
                "podName": "db-0", "podNamespace": "default"}  # fmt: skip
        return daemon.call("POST", "/v1/cni/add", body)

    def gone() -> None:  # at once: no kubelet here confirms a graceful deletion
        path = cluster.path_for("v1", "Pod", "db-0", "default")
        cluster.request("DELETE", path, {"gracePeriodSeconds": 0})
        scenario.wait(lambda: not cluster.exists("v1", "Pod", "db-0", "default"), "db-0 gone")

    try:
        place("st-n1", sticky)
        status, body = add_pod(n1, "s1")
        assert status == 200 and body["ips"][0]["address"] == f"{sticky}/24", body
        assert daemon_call_ok(n1, "/v1/cni/del", {"containerID": "s1", "ifName": "eth0"})
        gone()
        place("st-n2", sticky)
        status, body = add_pod(n2, "s2")
        assert status == 200 and body["ips"][0]["address"] == f"{sticky}/24", body
        assert sticky not in {ip["address"] for ip in n1.ips()}
        addresses = scenario.all_nc_addresses()
        assert len(addresses) == len(set(addresses))
        gone()
        place("st-n2", "not-an-address")
        scenario.wait(lambda: '"pod_address_annotation_invalid"' in n2.log(), "the bad one said")
    finally:
        with contextlib.suppress(Exception):
            gone()


@pytest.mark.slow
def test_a_dual_stack_pod_gets_the_pair_of_addresses_its_annotation_asks_for(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """`acn.azure.com/ip-address: <IPv4>,<IPv6>` on a pod whose ADD names an IPv4 and an IPv6
    ClusterSubnet: the daemon asks each subnet for its own address (the spec's `requestedIPs`,
    and the `spec.subnets` entry's once the IPv6 container tells which subnet holds it), each
    subnet's controller grants it, and the one ADD gets both."""
    scenario: Scenario = scenario_factory("pair-v4", "10.68.0.0/24")
    scenario.add_node("pair-n1")
    cluster.create({
        "apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": "pair-v6"},
        "spec": {"subnet": "fd00:68::/120", "nodeSelector": {"matchLabels": {"pool": "none"}}},
    })  # fmt: skip
    try:
        scenario.start_controller()
        start_controller(scenario, "pair-v6", subnet="pair-v6")
        daemon = scenario.start_daemon("pair-n1")
        asked = ("10.68.0.200", "fd00:68::c8")
        cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "pair-0", "namespace": "default",
                         "annotations": {"acn.azure.com/ip-address": ",".join(asked)}},
            "spec": {"nodeName": "pair-n1", "containers": [{"name": "c", "image": "busybox"}]},
        })  # fmt: skip
        body = {"containerID": "p1", "ifName": "eth0", "netns": "/var/run/netns/x",
                "podName": "pair-0", "podNamespace": "default",
                "subnets": ["pair-v4", "pair-v6"]}  # fmt: skip
        status, reply = daemon.call("POST", "/v1/cni/add", body)
        assert status == 200, reply
        assert [ip["address"] for ip in reply["ips"]] == ["10.68.0.200/24", "fd00:68::c8/120"]
        spec = scenario.nnc("pair-n1")["spec"]
        assert [entry["name"] for entry in spec["subnets"]] == ["pair-v6"]
    finally:
        with contextlib.suppress(Exception):  # at once: no kubelet confirms a graceful one
            path = cluster.path_for("v1", "Pod", "pair-0", "default")
            cluster.request("DELETE", path, {"gracePeriodSeconds": 0})
        scenario.cleanup()  # the controllers stop before the IPv6 subnet's objects go
        cluster.delete(subnet_objects(cluster, "pair-v6", []))


def daemon_call_ok(daemon: Daemon, path: str, body: dict[str, Any]) -> bool:
    return daemon.call("POST", path, body)[0] == 200


@pytest.mark.slow
def test_a_snapshot_of_the_wrong_shape_is_ignored_and_the_node_serves_from_the_api(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """`[]` or a count that is not a number in kube-snapshot.json made the daemon exit 1 at
    start (AttributeError, ValueError) without naming the file, again and again although the API
    server was up. The file is ignored, named in a warning, and the API server's state serves:
    the pod keeps its address and new pods get theirs."""
    scenario: Scenario = scenario_factory("snapshot-subnet", "10.69.0.0/24")
    scenario.add_node("sn-n1")
    scenario.start_controller()
    daemon = scenario.start_daemon("sn-n1")
    status, body = add(daemon, "kept")
    assert status == 200, body
    kept = body["ips"][0]["address"]
    snapshot = daemon.state_dir / "kube-snapshot.json"
    wrong_count = json.loads(snapshot.read_text())
    wrong_count["nodenetworkconfig"]["spec"]["requestedIPCount"] = "many"
    for n, content in enumerate([[], wrong_count]):
        assert daemon.stop() == 0
        snapshot.write_text(json.dumps(content))
        daemon.start()
        warnings = [
            json.loads(line)
            for line in daemon.log().splitlines()
            if '"kube_snapshot_ignored"' in line
        ]
        assert len(warnings) == n + 1 and warnings[-1]["file"] == str(snapshot), warnings
        status, again = add(daemon, "kept")
        assert status == 200 and again["ips"] == body["ips"], again
        status, fresh = add(daemon, f"new{n}")
        assert status == 200 and fresh["ips"][0]["address"] != kept, fresh
    assert json.loads(snapshot.read_text())["nodenetworkconfig"]["metadata"]["name"] == "sn-n1"


def pod_adds(plugin_dir: Path, daemon: Daemon, prefix: str, count: int) -> dict[str, str]:
    """`count` pods' ADDs through the real `cns-ipam` plugin, each of which must succeed:
    container -> its address."""
    held = {}
    for i in range(count):
        container = f"{prefix}{i}"
        done = daemon.ipam(plugin_dir, "ADD", container, netns=f"/var/run/netns/{container}")
        assert done.returncode == 0, done.stdout + done.stderr
        held[container] = json.loads(done.stdout)["ips"][0]["address"].split("/")[0]
    return held


def listed_names(nnc: dict[str, Any]) -> dict[str, str]:
    """Address -> the name the NNC lists it under (the container id for its primary IP)."""
    found = {}
    for nc in (nnc.get("status") or {}).get("networkContainers") or []:
        found[nc["primaryIP"]] = nc["id"]
        found.update({a["ip"]: a["name"] for a in nc.get("ipAssignments") or []})
    return found


@pytest.mark.slow
def test_a_deleted_nnc_puts_no_address_on_pods_of_two_nodes(
    scenario_factory: Any, cluster: KubeCluster, plugin_dir: Path
) -> None:
    """Issue 25, case 1, as it was reproduced: two nodes, the real controller, pods on both,
    `kubectl delete nnc` of one while its pods hold addresses, then more pods on both. Before:
    the node went on handing out the deleted container's free addresses, and the controller
    freed the deleted NNC's addresses and granted them to the other node, whose pods then used
    addresses the first node's pods held (6 in the issue's run). Now the node withdraws what
    its pods do not hold and re-creates its NNC asking for what they do, and the controller
    keeps a live node's addresses its own and moves them into the new NNC under the same names
    (docs/design/controller-safety.md, "A deleted NodeNetworkConfig")."""
    scenario: Scenario = scenario_factory("nncgone-e2e", "10.63.0.0/26")
    n1, n2 = "nncgone-e2e-n1", "nncgone-e2e-n2"
    for node in (n1, n2):
        scenario.add_node(node)
    scenario.start_controller()
    d1, d2 = scenario.start_daemon(n1), scenario.start_daemon(n2)
    on_n1 = pod_adds(plugin_dir, d1, "n1-a", 4)
    on_n2 = pod_adds(plugin_dir, d2, "n2-a", 4)
    before = scenario.nnc(n1)
    names = listed_names(before)
    assert set(on_n1.values()) <= set(names)

    cluster.delete([object_ref(NNC_API, "NodeNetworkConfig", n1, KUBE_SYSTEM)], wait=False)
    # Pods come on both nodes: n2 needs more addresses (a controller that let n1's go grants
    # it those first: the lowest free), n1's wait for its NNC to be back.
    on_n2.update(pod_adds(plugin_dir, d2, "n2-b", 12))
    on_n1.update(pod_adds(plugin_dir, d1, "n1-b", 4))
    both = set(on_n1.values()) & set(on_n2.values())
    assert not both, f"addresses held by pods of both nodes: {sorted(both)}"

    held = {c: a for c, a in on_n1.items() if c.startswith("n1-a")}
    back = scenario.wait(
        lambda: (
            cluster.exists(NNC_API, "NodeNetworkConfig", n1, KUBE_SYSTEM)
            and set(held.values()) <= set(addresses(nnc := scenario.nnc(n1)))
            and nnc
        ),
        "n1's held addresses listed in its re-created NNC",
        timeout=90,
    )
    assert back["metadata"]["uid"] != before["metadata"]["uid"]
    # The same container and the same names: moved, not granted anew.
    again = listed_names(back)
    assert {a: again[a] for a in held.values()} == {a: names[a] for a in held.values()}
    (container,) = before["status"]["networkContainers"]
    assert back["status"]["networkContainers"][0]["id"] == container["id"]
    on_n1.update(pod_adds(plugin_dir, d1, "n1-c", 2))
    on_n2.update(pod_adds(plugin_dir, d2, "n2-c", 2))

    both = set(on_n1.values()) & set(on_n2.values())
    assert not both, f"addresses held by pods of both nodes: {sorted(both)}"
    assert len(set(on_n1.values())) == len(on_n1) and len(set(on_n2.values())) == len(on_n2)
    listed = [*addresses(scenario.nnc(n1)), *addresses(scenario.nnc(n2))]
    assert len(listed) == len(set(listed)), "an address is in both NNCs"
    assert set(on_n1.values()) <= set(addresses(scenario.nnc(n1)))
    assert set(on_n2.values()) <= set(addresses(scenario.nnc(n2)))
    assert '"nnc_replaced_addresses_kept"' in scenario.controller_log(0)


@pytest.mark.slow
def test_an_address_the_state_file_lost_is_adopted_for_the_pod_the_api_says_holds_it(
    scenario_factory: Any, cluster: KubeCluster, tmp_path: Path
) -> None:
    """The state file lost a pod's row while the daemon was down (deleted with sqlite3); the API
    server still lists the pod on the node with that address in `status.podIPs`. At the next
    start the daemon adopts the address for the pod (durably, before any ADD gets an IP) and
    never hands it out."""
    scenario: Scenario = scenario_factory("world-subnet", "10.73.0.0/24")
    scenario.add_node("wo-n1")
    scenario.start_controller()
    daemon = scenario.start_daemon("wo-n1")
    pods(cluster, "wo-n1", "world-0")
    body = {"containerID": "sandbox-w0", "ifName": "eth0", "netns": "/var/run/netns/x",
            "podName": "world-0", "podNamespace": "default"}  # fmt: skip
    status, reply = daemon.call("POST", "/v1/cni/add", body)
    assert status == 200, reply
    lost = reply["ips"][0]["address"].split("/")[0]
    cluster.patch("v1", "Pod", "world-0", {"status": {"phase": "Running", "podIP": lost,
                  "podIPs": [{"ip": lost}]}}, "default", subresource="status")  # fmt: skip
    state_file = daemon.state_dir / "state.db"
    try:
        assert daemon.stop() == 0
        forget = f"DELETE FROM assignments WHERE address='{lost}'"
        subprocess.run(["sqlite3", str(state_file), forget], check=True, capture_output=True)
        daemon.start()

        fresh = [add(daemon, f"new-{i}") for i in range(4)]
        assert all(status == 200 for status, _ in fresh), fresh
        given = {b["ips"][0]["address"].split("/")[0] for _, b in fresh}
        assert lost not in given, (lost, given)
        (row,) = [ip for ip in daemon.ips() if ip["address"] == lost]
        uid = cluster.get("v1", "Pod", "world-0", "default")["metadata"]["uid"]
        assert row["owner"] == {"containerID": f"api:{uid}", "ifName": "eth0",
                                "podName": "world-0", "podNamespace": "default"}, row  # fmt: skip
        query = f"SELECT pod_name FROM assignments WHERE address='{lost}'"
        stored = subprocess.run(
            ["sqlite3", str(state_file), query], check=True, capture_output=True, text=True
        )
        assert stored.stdout.strip() == "world-0"  # durable
        world = daemon.pool()["worldCheck"]
        assert world["state"] == "done" and world["sources"] == {"api": "checked"}, world
        assert world["outcomes"] == {"adopted": 1}, world
        metrics = daemon.metrics()
        assert metrics['cns_state_world_check_addresses_total{outcome="adopted"}'] == 1
        adopted = [json.loads(line) for line in daemon.log().splitlines()
                   if '"event": "state_adopted"' in line]  # fmt: skip
        assert [(e["address"], e["source"], e["pod"]) for e in adopted] == [
            (lost, "api", "default/world-0")
        ]
    finally:
        with contextlib.suppress(Exception):  # at once: no kubelet confirms a graceful one
            path = cluster.path_for("v1", "Pod", "world-0", "default")
            cluster.request("DELETE", path, {"gracePeriodSeconds": 0})


@pytest.mark.slow
def test_a_draining_subnet_grants_nothing_its_node_gives_back_the_free_ips_and_status_counts(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """`spec.draining: true` set on a ClusterSubnet whose node has three pods: the node keeps
    their IPs and gives back the others (ipsNotInUse), its next ADD fails at once with code 11
    naming the subnet, a node added afterwards gets no network container, and the
    ClusterSubnet's status counts what is left by node until the last pod's DEL. Cleared, the
    subnet grants again, with no restart of the controller or the daemon."""
    scenario: Scenario = scenario_factory("drain-subnet", "10.63.0.0/24", {"batchSize": 8})
    scenario.add_node("dr-n1")
    scenario.start_controller()
    daemon = scenario.start_daemon("dr-n1", config={"ipCooldownSeconds": 1})
    for i in range(3):
        assert add(daemon, f"d{i}")[0] == 200
    scenario.wait(lambda: daemon.pool()["ips"]["Available"] >= 4, "a spare batch")

    def subnet_status() -> dict[str, Any]:
        return cluster.get(CS_API, "ClusterSubnet", "drain-subnet").get("status") or {}

    assert subnet_status()["draining"] is False and "drain" not in subnet_status()
    cluster.patch(CS_API, "ClusterSubnet", "drain-subnet", {"spec": {"draining": True}})
    scenario.wait(lambda: daemon.pool()["subnetDraining"], "the daemon to follow the drain")
    scenario.wait(
        lambda: len(scenario.all_nc_addresses_of("dr-n1")) == 1 + 3,
        "the free IPs back (the primary and the pods' stay)",
    )
    held = {"addressesHeld": 3, "nodes": [{"name": "dr-n1", "addressesHeld": 3}]}
    scenario.wait(lambda: subnet_status().get("drain") == held, "the drain's progress")
    assert subnet_status()["draining"] is True
    command = [sys.executable, "-m", "cns.commands.cli", "ipam", "show", "--kubeconfig",
               str(cluster.kubeconfig)]  # fmt: skip
    shown = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "drain-subnet (draining)" in shown.stdout, shown
    status, body = add(daemon, "d9")
    assert (status, body["code"]) == (503, 11) and "drain-subnet is draining" in body["msg"]
    assert add(daemon, "d0") == add(daemon, "d0")  # a repeated ADD keeps its IP
    scenario.add_node("dr-n2")  # the controller makes its NNC, and gives it no container
    scenario.wait(
        lambda: cluster.exists(NNC_API, "NodeNetworkConfig", "dr-n2", KUBE_SYSTEM),
        "the new node's NNC",
    )
    for i in range(3):
        reply = daemon.call("POST", "/v1/cni/del", {"containerID": f"d{i}", "ifName": "eth0"})
        assert reply[0] == 200, reply
    drained = {"addressesHeld": 0, "nodes": []}  # dr-n1 gone from the list (a merge patch)
    scenario.wait(lambda: subnet_status().get("drain") == drained, "drained", timeout=60)
    assert not (scenario.nnc("dr-n2").get("status") or {}).get("networkContainers")
    cluster.patch(CS_API, "ClusterSubnet", "drain-subnet", {"spec": {"draining": False}})
    scenario.wait(lambda: add(daemon, "d10")[0] == 200, "an ADD served again", timeout=60)
    scenario.wait(
        lambda: (scenario.nnc("dr-n2").get("status") or {}).get("networkContainers"),
        "the new node's network container",
    )
    assert "drain" not in subnet_status()
    addresses = scenario.all_nc_addresses()
    assert len(addresses) == len(set(addresses))


def pod_add(daemon: Daemon, name: str) -> tuple[int, Any]:
    """The ADD of pod default/`name` (its container named after it)."""
    body = {"containerID": name, "ifName": "eth0", "netns": f"/var/run/netns/{name}",
            "podName": name, "podNamespace": "default"}  # fmt: skip
    return daemon.call("POST", "/v1/cni/add", body)


def first_address(body: Any) -> str:
    return str(body["ips"][0]["address"]).split("/")[0]


@pytest.mark.slow
def test_pods_of_a_full_subnet_overflow_into_the_next_and_come_back_once_it_has_room(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    """A node whose primary subnet (a /28) fills with 20 pods scheduled on it. Without
    overflow, the pods beyond it wait and fail (code 11). `spec.overflow: [of-b]` set on the
    running ClusterSubnet (no restart): the node asks of-b for those pods ahead of their ADDs
    (spec.subnets) and their retries get of-b's addresses at once. Once the primary's pods end
    and its exhaustion clears (lowerPercent), a new pod gets a primary address again, the
    overflowed pods keep theirs, and of-b is asked only for what they hold. No address is
    ever on two pods."""
    scenario: Scenario = scenario_factory("of-a", "10.70.0.0/28", {"batchSize": 4})
    scenario.add_node("of-n1")
    cluster.create({
        "apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": "of-b"},
        "spec": {"subnet": "10.70.1.0/26", "nodeSelector": {"matchLabels": {"pool": "none"}}},
    })  # fmt: skip
    names = [f"of-{i}" for i in range(20)]
    try:
        scenario.start_controller()
        start_controller(scenario, "of-b", subnet="of-b")
        daemon = scenario.start_daemon("of-n1", config={"addTimeoutSeconds": 3})
        for name in names:
            pods(cluster, "of-n1", name)
        daemon.wait_pool(lambda p: p["podDemand"] == 20, "the pods counted")
        with ThreadPoolExecutor(len(names)) as pool:
            first = dict(zip(names, pool.map(lambda n: pod_add(daemon, n), names), strict=True))
        served = {n: first_address(b) for n, (status, b) in first.items() if status == 200}
        failed = sorted(n for n, (status, _) in first.items() if status != 200)
        assert failed and all(first[n][1]["code"] == 11 for n in failed), first
        assert all(a.startswith("10.70.0.") for a in served.values())
        assert daemon.pool()["subnetExhausted"] is True

        cluster.patch(CS_API, "ClusterSubnet", "of-a", {"spec": {"overflow": ["of-b"]}})
        daemon.wait_pool(lambda p: (p.get("overflow") or {}).get("target") == "of-b", "overflow")
        asked = scenario.wait(
            lambda: {e["name"]: e for e in scenario.nnc("of-n1")["spec"].get("subnets") or []},
            "of-b asked for ahead of the retried ADDs",
        )
        assert asked["of-b"]["requestedIPCount"] >= len(failed)
        for name in failed:
            status, body = pod_add(daemon, name)
            assert status == 200, body
            served[name] = first_address(body)
            assert served[name].startswith("10.70.1."), body
        assert len(set(served.values())) == len(served) == 20
        assert daemon.pool()["overflow"]["podsSentTotal"] == len(failed)

        primary_pods = sorted(n for n in names if served[n].startswith("10.70.0."))
        for name in primary_pods:
            assert daemon.call("POST", "/v1/cni/del", {"containerID": name, "ifName": "eth0"})[0]
            cluster.request("DELETE", cluster.path_for("v1", "Pod", name, "default"),
                            {"gracePeriodSeconds": 0})  # fmt: skip
        daemon.wait_pool(lambda p: not p["subnetExhausted"], "the exhaustion cleared", 60)
        pods(cluster, "of-n1", "of-back")
        status, body = pod_add(daemon, "of-back")
        assert status == 200 and first_address(body).startswith("10.70.0."), body
        for name in failed:  # a repeated ADD of an overflowed pod: the same address
            assert first_address(pod_add(daemon, name)[1]) == served[name]
        scenario.wait(
            lambda: {e["name"]: e["requestedIPCount"] for e in scenario.nnc("of-n1")["spec"]
                     ["subnets"]} == {"of-b": len(failed)},
            "of-b asked only for what the overflowed pods hold",
        )  # fmt: skip
        every = scenario.all_nc_addresses()
        assert len(every) == len(set(every))
    finally:
        for name in [*names, "of-back"]:
            with contextlib.suppress(Exception):
                path = cluster.path_for("v1", "Pod", name, "default")
                cluster.request("DELETE", path, {"gracePeriodSeconds": 0})
        scenario.cleanup()
        cluster.delete(subnet_objects(cluster, "of-b", []))
