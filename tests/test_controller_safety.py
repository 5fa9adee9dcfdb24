"""Two `cns controller` replicas on a real kube-apiserver, with the timing made hostile on purpose.

The lease is short, planning is slowed down (the `controller.after_plan` fault pause of
cns/faults.py stretches a round past the renew deadline), and a chaos thread freezes one replica
or the other with SIGSTOP for longer than the lease, then lets it run on with whatever writes it
had in flight. Meanwhile a fleet of simulated daemons changes its NNC specs as real daemons do
(requests up and down, releases through ipsNotInUse, release requests honoured), and a checker
follows the NNC watch: after every event, no address may be in two network containers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
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
    """A ClusterSubnet and Node objects; everything the test made is removed afterwards."""
    made: dict[str, Any] = {"procs": [], "nodes": [], "subnet": ""}

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
