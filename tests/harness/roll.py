"""Watching a Deployment's pods while something else happens (a rolling upgrade of cns): what each
pod got and when, seen from the API server by polling, and a second thread that scales the
Deployment up and down meanwhile.

The ADD stall of a pod is the time from the poll that first sees it bound to the node to the poll
that first sees its podIP: the kubelet reports the IP once the sandbox exists, i.e. once a CNI ADD
succeeded, so the time covers every failed sandbox attempt (no daemon on the socket, no address in
the pool) and the kubelet's back-off between them. The polls are `interval` apart, which bounds
the error; a baseline measured the same way, without the upgrade, gives the ratio.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cns.kube.nnc_containers import network_containers
from tests.harness.kube_node import KubeNode

DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"


@dataclass
class PodTrack:
    """One pod as the polls saw it (times from time.monotonic())."""

    bound: float
    addressed: float | None = None
    ips: set[str] = field(default_factory=set)
    gone: bool = False


@dataclass
class Stall:
    """The ADD stalls of the pods bound in a window: the longest, and how many pods."""

    longest: float
    pods: int
    never_addressed: int

    def __str__(self) -> str:
        return (
            f"longest ADD stall {self.longest:.1f} s over {self.pods} pods "
            f"({self.never_addressed} deleted before they had an address)"
        )


def allocated(nnc: dict[str, Any]) -> int:
    """The addresses the controller has granted the node (status.networkContainers)."""
    return sum(len(nc.ip_configs) for nc in network_containers(nnc))


class PodWatch(threading.Thread):
    """Polls the pods of `selector` and the node's conflist every `interval` until `stop`.
    Records per pod its ADD stall and every podIP it ever showed, every poll in which two live
    pods (no deletionTimestamp) showed one address, and every poll that found no conflist."""

    def __init__(
        self, node: KubeNode, selector: str, conflist: Path, interval: float = 0.2
    ) -> None:
        super().__init__(name="pod-watch", daemon=True)
        self.node, self.selector, self.conflist, self.interval = node, selector, conflist, interval
        self.pods: dict[str, PodTrack] = {}
        self.doubles: list[dict[str, list[str]]] = []
        self.conflist_missing = 0
        self.polls = 0
        self.errors: list[str] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll()
            except Exception as exc:  # the API server under load: count, poll again
                self.errors.append(repr(exc))
            self._halt.wait(self.interval)

    def poll(self) -> None:
        pods = self.node.pods(self.selector)
        now = time.monotonic()
        holders: dict[str, list[str]] = {}
        with self._lock:
            self.polls += 1
            if not self.conflist.exists():
                self.conflist_missing += 1
            seen = set()
            for pod in pods:
                name, ip = pod["metadata"]["name"], pod["status"].get("podIP")
                seen.add(name)
                if not pod["spec"].get("nodeName"):
                    continue
                track = self.pods.setdefault(name, PodTrack(bound=now))
                if ip:
                    track.ips.add(ip)
                    if track.addressed is None:
                        track.addressed = now
                    if not pod["metadata"].get("deletionTimestamp"):
                        holders.setdefault(ip, []).append(name)
            for name, track in self.pods.items():
                track.gone = track.gone or name not in seen
            doubles = {ip: names for ip, names in holders.items() if len(names) > 1}
            if doubles:
                self.doubles.append(doubles)

    def stall(self, since: float, until: float) -> Stall:
        """The stalls of the pods first seen bound in [since, until]."""
        with self._lock:
            window = [t for t in self.pods.values() if since <= t.bound <= until]
            stalls = [t.addressed - t.bound for t in window if t.addressed is not None]
            never = sum(1 for t in window if t.addressed is None and t.gone)
        return Stall(max(stalls, default=0.0), len(stalls), never)

    def moved(self) -> dict[str, set[str]]:
        """Pods that showed more than one address: none may."""
        with self._lock:
            return {name: t.ips for name, t in self.pods.items() if len(t.ips) > 1}

    def stop(self) -> None:
        self._halt.set()
        self.join()


def scale(node: KubeNode, deployment: str, replicas: int) -> None:
    node.kube.request(
        "PATCH",
        f"{DEPLOYMENTS}/{deployment}/scale",
        {"spec": {"replicas": replicas}},
        "application/merge-patch+json",
    ).raise_for_status()


class Scaler(threading.Thread):
    """Scales `deployment` through `steps` in turn, `dwell` seconds each, until `stop` (and at
    least once through the steps); what it set is in `history`."""

    def __init__(
        self, node: KubeNode, deployment: str, steps: list[int], dwell: float = 3.0
    ) -> None:
        super().__init__(name="scaler", daemon=True)
        self.node, self.deployment, self.steps, self.dwell = node, deployment, steps, dwell
        self.history: Counter[int] = Counter()
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        done = 0
        while done < len(self.steps) or not self._halt.is_set():
            replicas = self.steps[done % len(self.steps)]
            try:
                scale(self.node, self.deployment, replicas)
                self.history[replicas] += 1
            except Exception as exc:
                self.errors.append(repr(exc))
            done += 1
            time.sleep(self.dwell)

    def stop(self) -> None:
        self._halt.set()
        self.join()
