"""Two `cns controller` replicas on a real kube-apiserver, with the timing made hostile on purpose.

The lease is short, planning is slowed down (the `controller.after_plan` fault pause of
cns/faults.py stretches a round past the renew deadline), and a chaos thread freezes one replica
or the other with SIGSTOP for longer than the lease, then lets it run on with whatever writes it
had in flight. Meanwhile a fleet of simulated daemons changes its NNC specs as real daemons do
(requests up and down, releases through ipsNotInUse, release requests honoured), and a checker
follows the NNC watch: after every event, no address may be in two network containers.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, free_port, private_tmp
from tests.kube import CONTROLLER_USER, ApiError, KubeCluster, kube_cluster_fixture

NNC_API = "acn.azure.com/v1alpha"
CS_API = "acn.azure.com/v1alpha1"
NS = "kube-system"
LEASE_API = "coordination.k8s.io/v1"

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    return kube


def nnc_path(cluster: KubeCluster, name: str = "") -> str:
    return cluster.path_for(NNC_API, "NodeNetworkConfig", name or None, NS)


def addresses(nnc: dict[str, Any]) -> list[str]:
    found = []
    for nc in (nnc.get("status") or {}).get("networkContainers") or []:
        if nc.get("primaryIP"):
            found.append(nc["primaryIP"])
        found.extend(a["ip"] for a in nc.get("ipAssignments") or [])
    return found


class DuplicateWatch(threading.Thread):
    """Follows every NNC event and checks the whole subnet after each one."""

    def __init__(self, cluster: KubeCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.held: dict[str, list[str]] = {}
        self.events = 0
        self.duplicates: list[str] = []
        self.stop = threading.Event()
        listing = cluster.request("GET", nnc_path(cluster)).raise_for_status().json
        for item in listing["items"]:
            self._seen(item)
        self.version = listing["metadata"]["resourceVersion"]

    def _seen(self, nnc: dict[str, Any]) -> None:
        self.held[nnc["metadata"]["name"]] = addresses(nnc)
        owners: dict[str, str] = {}
        for node, held in self.held.items():
            for address in held:
                if address in owners:
                    self.duplicates.append(f"{address} on {owners[address]} and {node}")
                owners[address] = node

    def run(self) -> None:
        while not self.stop.is_set():
            params = {"resourceVersion": self.version, "timeoutSeconds": 5}
            for event in self.cluster.watch(nnc_path(self.cluster), params, timeout=30):
                obj = event["object"]
                if event["type"] == "ERROR":
                    raise AssertionError(f"watch error: {obj}")
                self.version = obj["metadata"]["resourceVersion"]
                if event["type"] == "DELETED":
                    self.held.pop(obj["metadata"]["name"], None)
                else:
                    self._seen(obj)
                self.events += 1


class Fleet(threading.Thread):
    """Daemons as the control plane sees them: NNC spec writes driven by their status."""

    REQUESTS = (0, 15, 31, 47, 63)

    def __init__(self, cluster: KubeCluster, nodes: list[str], seed: int) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.nodes = nodes
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.writes = 0

    def step(self, node: str, request: int | None = None, release: bool = True) -> None:
        nnc = self.cluster.request("GET", nnc_path(self.cluster, node)).raise_for_status().json
        held = {
            a["name"]
            for nc in (nnc.get("status") or {}).get("networkContainers") or []
            for a in nc.get("ipAssignments") or []
        }
        spec = nnc.get("spec") or {}
        status = nnc.get("status") or {}
        releasing = {i for i in spec.get("ipsNotInUse") or () if i in held}
        releasing |= {i for i in status.get("ipsToRelease") or () if i in held}
        if release and held and self.rng.random() < 0.4:
            releasing |= set(
                self.rng.sample(sorted(held), self.rng.randrange(1, min(8, len(held)) + 1))
            )
        if request is None:
            request = self.rng.choice(self.REQUESTS)
        kept = sorted(held - releasing)
        releasing |= set(kept[request:])  # a daemon gives back what it holds beyond its request
        patch = {"spec": {"requestedIPCount": request, "ipsNotInUse": sorted(releasing)}}
        self.cluster.request(
            "PATCH", nnc_path(self.cluster, node), patch, "application/merge-patch+json"
        )
        self.writes += 1

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(ApiError, OSError):
                self.step(self.rng.choice(self.nodes))
            time.sleep(self.rng.uniform(0.0, 0.05))


def start_controller(
    cluster: KubeCluster, workdir: Path, subnet: str, index: int, faults: str, metrics_port: int
) -> subprocess.Popen[bytes]:
    log = (workdir / f"controller{index}.log").open("ab")
    env = {**private_tmp(workdir), "CNS_FAULTS": faults}
    return subprocess.Popen(
        [
            sys.executable, "-m", "cns.cli", "controller",
            "--subnet", subnet,
            "--kubeconfig", str(cluster.kubeconfig_for(CONTROLLER_USER)),
            "--identity", f"replica-{index}",
            "--lease-seconds", "2",
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--log-format", "json",
        ],
        stdout=log,
        stderr=log,
        cwd=REPO,
        env=env,
    )  # fmt: skip


def scrape(port: int) -> dict[str, float]:
    """A replica's /metrics, parsed as Prometheus text: sample name (with labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


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
    subnet = made["subnet"]
    doomed: list[dict[str, Any]] = []
    for name in made["nodes"]:
        doomed.append({"apiVersion": NNC_API, "kind": "NodeNetworkConfig",
                       "metadata": {"name": name, "namespace": NS}})  # fmt: skip
        doomed.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    if subnet:
        for block in cluster.request(
            "GET",
            cluster.path_for(CS_API, "IPBlock"),
            params={"labelSelector": f"acn.azure.com/subnet={subnet}"},
        ).json["items"]:
            doomed.append({"apiVersion": CS_API, "kind": "IPBlock",
                           "metadata": {"name": block["metadata"]["name"]}})  # fmt: skip
        doomed += [
            {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": subnet}},
            {"apiVersion": CS_API, "kind": "ClusterSubnetState", "metadata": {"name": subnet}},
            {"apiVersion": LEASE_API, "kind": "Lease",
             "metadata": {"name": f"cns-controller-{subnet}", "namespace": NS}},
        ]  # fmt: skip
    cluster.delete(doomed, wait=False)


def chaos(
    cluster: KubeCluster, lease: str, procs: list[subprocess.Popen[bytes]], until: float
) -> int:
    """Freeze the leader (now and then the standby) for longer than the lease, then let it go
    on with whatever it had in flight; returns how many times."""
    rng = random.Random(7)
    freezes = 0
    while time.monotonic() < until:
        proc = rng.choice(procs)
        with contextlib.suppress(ApiError, OSError, KeyError):
            holder = cluster.get(LEASE_API, "Lease", lease, NS)["spec"].get("holderIdentity")
            if holder and rng.random() < 0.8:
                proc = procs[int(holder.rsplit("-", 1)[1])]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(2.0, 4.5))
        proc.send_signal(signal.SIGCONT)
        freezes += 1
        time.sleep(rng.uniform(0.3, 2.0))
    return freezes


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
        lambda: all(cluster.exists(NNC_API, "NodeNetworkConfig", n, NS) for n in nodes),
        timeout=60,
        what="an NNC for every node",
    )
    checker = DuplicateWatch(cluster)
    checker.start()
    fleet = Fleet(cluster, nodes, seed=11)
    fleet.start()
    lease_name = f"cns-controller-{subnet}"
    freezes = chaos(cluster, lease_name, procs, time.monotonic() + 40)
    fleet.stop.set()
    fleet.join()

    # Settle: every node asks for 31 and releases nothing; both replicas run freely.
    for node in nodes:
        fleet.step(node, request=31, release=False)

    def fulfilled() -> bool:
        done = True
        for node in nodes:
            nnc = cluster.get(NNC_API, "NodeNetworkConfig", node, NS)
            held = addresses(nnc)
            if len(held) != 32 or (nnc.get("spec") or {}).get("ipsNotInUse"):
                fleet.step(node, request=31, release=False)  # a daemon clears finished releases
                done = False
        return done

    settle_started = time.monotonic()
    cluster.wait_for(fulfilled, timeout=120, interval=0.5, what="every node fulfilled")
    settled = time.monotonic() - settle_started
    time.sleep(2)
    checker.stop.set()
    checker.join(timeout=15)

    assert checker.duplicates == [], checker.duplicates[:10]
    assert checker.events > 500, checker.events  # the checker saw the churn, event by event
    lease = cluster.get(LEASE_API, "Lease", lease_name, NS)
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
        for address, entry in (block["spec"].get("allocations") or {}).items():
            claimed[address] = entry["node"]
    for node in nodes:
        for address in addresses(cluster.get(NNC_API, "NodeNetworkConfig", node, NS)):
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
