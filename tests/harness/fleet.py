"""Simulated daemons, a subnet-wide duplicate check and chaos for controller replicas.

Shared by tests/integration/test_controller_safety.py and bench/stress/controller_chaos.py: a fleet
of nodes that write their NodeNetworkConfig specs as real daemons do, a watch that checks the whole
subnet for an address in two network containers after every NNC event, and a chaos loop that freezes
controller replicas with SIGSTOP for longer than their lease.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.harness.kube_api import KUBE_SYSTEM, LEASE_API, MERGE_PATCH, NNC_API, ApiError
from tests.harness.kube_cluster import KubeCluster


def nnc_path(cluster: KubeCluster, name: str = "") -> str:
    return cluster.path_for(NNC_API, "NodeNetworkConfig", name or None, KUBE_SYSTEM)


def addresses(nnc: dict[str, Any]) -> list[str]:
    found = []
    for nc in (nnc.get("status") or {}).get("networkContainers") or []:
        if nc.get("primaryIP"):
            found.append(nc["primaryIP"])
        found.extend(a["ip"] for a in nc.get("ipAssignments") or [])
    return found


class NNCWatch(threading.Thread):
    """Follows every NNC event from a list of them all: `_seen` for each object listed, added or
    changed, `_deleted` for each one deleted."""

    def __init__(self, cluster: KubeCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.events = 0
        self.stop = threading.Event()
        listing = cluster.request("GET", nnc_path(cluster)).raise_for_status().json
        for item in listing["items"]:
            self._seen(item)
        self.version = listing["metadata"]["resourceVersion"]

    def _seen(self, nnc: dict[str, Any]) -> None:
        raise NotImplementedError

    def _deleted(self, nnc: dict[str, Any]) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self.stop.is_set():
            params = {"resourceVersion": self.version, "timeoutSeconds": 5}
            for event in self.cluster.watch(nnc_path(self.cluster), params, timeout=30):
                obj = event["object"]
                if event["type"] == "ERROR":
                    raise AssertionError(f"watch error: {obj}")
                self.version = obj["metadata"]["resourceVersion"]
                if event["type"] == "DELETED":
                    self._deleted(obj)
                else:
                    self._seen(obj)
                self.events += 1


class DuplicateWatch(NNCWatch):
    """Checks the whole subnet after each NNC event: no address in two network containers."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.held: dict[str, list[str]] = {}
        self.duplicates: list[str] = []
        super().__init__(cluster)

    def _seen(self, nnc: dict[str, Any]) -> None:
        self.held[nnc["metadata"]["name"]] = addresses(nnc)
        owners: dict[str, str] = {}
        for node, held in self.held.items():
            for address in held:
                if address in owners:
                    self.duplicates.append(f"{address} on {owners[address]} and {node}")
                owners[address] = node

    def _deleted(self, nnc: dict[str, Any]) -> None:
        self.held.pop(nnc["metadata"]["name"], None)


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
        self.cluster.request("PATCH", nnc_path(self.cluster, node), patch, MERGE_PATCH)
        self.writes += 1

    def unfulfilled(self, request: int) -> list[str]:
        """Nodes whose container does not hold `request` secondary IPs (plus the primary) yet,
        or which still have a release in flight."""
        waiting = []
        listing = self.cluster.get(NNC_API, "NodeNetworkConfig", namespace=KUBE_SYSTEM)["items"]
        for nnc in listing:
            if nnc["metadata"]["name"] not in self.nodes:
                continue
            spec = nnc.get("spec") or {}
            if len(addresses(nnc)) != request + 1 or spec.get("ipsNotInUse"):
                waiting.append(nnc["metadata"]["name"])
        return waiting

    def settle(self, request: int, timeout: float) -> float | None:
        """Every node asks for `request` and releases nothing more, as daemons would once their
        pods stop changing; returns the seconds until all are fulfilled, None after `timeout`."""
        started = time.monotonic()
        waiting = self.nodes
        while waiting:
            for node in waiting:  # a daemon clears finished releases, trims what is extra
                with contextlib.suppress(ApiError, OSError):
                    self.step(node, request=request, release=False)
            if time.monotonic() - started > timeout:
                return None
            time.sleep(0.5)
            waiting = self.unfulfilled(request)
        return time.monotonic() - started

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(ApiError, OSError):
                self.step(self.rng.choice(self.nodes))
            time.sleep(self.rng.uniform(0.0, 0.05))


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
            holder = cluster.get(LEASE_API, "Lease", lease, KUBE_SYSTEM)["spec"].get(
                "holderIdentity"
            )
            if holder and rng.random() < 0.8:
                proc = procs[int(holder.rsplit("-", 1)[1])]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(2.0, 4.5))
        proc.send_signal(signal.SIGCONT)
        freezes += 1
        time.sleep(rng.uniform(0.3, 2.0))
    return freezes


def _names(nnc: dict[str, Any]) -> dict[str, str]:
    """Address -> the name its NNC lists it under (the container id for a primary IP)."""
    found = {}
    for nc in (nnc.get("status") or {}).get("networkContainers") or []:
        if nc.get("primaryIP"):
            found[nc["primaryIP"]] = nc.get("id", "")
        found.update({a["ip"]: a["name"] for a in nc.get("ipAssignments") or []})
    return found


class HoldingWatch(NNCWatch):
    """Follows every NNC event, as `DuplicateWatch`, for nodes whose pods keep every address
    they were given: a node's pods hold each address its NNCs ever listed, also after its NNC is
    deleted, until its Node object is deleted (`node_gone`). After each event: no address is
    listed by an NNC while the pods of another node hold it, and an address comes back to its
    node only under the name it had (`renamed`)."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, dict[str, str]] = {}  # node -> address -> its name
        self.listed: dict[str, dict[str, str]] = {}  # NNC -> what it lists now
        self.violations: list[str] = []
        self.renamed: list[str] = []
        super().__init__(cluster)

    def node_gone(self, node: str) -> None:
        """The node left (its Node object deleted): its pods are gone."""
        with self.lock:
            self.held.pop(node, None)

    def _seen(self, nnc: dict[str, Any]) -> None:
        name = nnc["metadata"]["name"]
        with self.lock:
            self.listed[name] = _names(nnc)
            held = self.held.setdefault(name, {})
            for address, ip_name in self.listed[name].items():
                if held.setdefault(address, ip_name) != ip_name:
                    self.renamed.append(f"{address} on {name}: {held[address]} -> {ip_name}")
            owners = {a: node for node, addresses in self.held.items() for a in addresses}
            for node, names in self.listed.items():
                for address in names:
                    if owners.get(address, node) != node:
                        self.violations.append(
                            f"{address} listed by {node} while pods of {owners[address]} hold it"
                        )

    def _deleted(self, nnc: dict[str, Any]) -> None:
        with self.lock:
            self.listed.pop(nnc["metadata"]["name"], None)
