"""Thousands of simulated node daemons in one asyncio process, timed against one NNC watch.

What a node does is what `cns.node.kube_source.KubeSource` does on the wire: it merge-patches its
NodeNetworkConfig's `spec.requestedIPCount` (a multiple of the batch the controller published in
`status.scaler.batchSize`) and `spec.ipsNotInUse` (the IP names it gives back, including any the
controller asked for in `status.ipsToRelease`), and clears `ipsNotInUse` once the controller has
removed those addresses from the status. Nothing polls: one watch on every NNC feeds the nodes'
state, the fulfilment timers and a subnet-wide duplicate check (`OwnershipCheck`).

A change is timed from the moment its spec patch is acknowledged to the watch event that shows
it fulfilled: the container holds exactly the requested count, none of the addresses given back,
and the controller asks for no release. Used by bench/performance/controller_scale.py.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.harness.async_kube import AsyncKube
from tests.harness.fleet import addresses
from tests.harness.kube_api import KUBE_SYSTEM, MERGE_PATCH, ApiError

NNC_PATH = f"/apis/acn.azure.com/v1alpha/namespaces/{KUBE_SYSTEM}/nodenetworkconfigs"
DEFAULT_BATCH = 16


class OwnershipCheck:
    """Which node's network container lists each address, kept up to date event by event.

    After every event the whole subnet is checked, incrementally: `shared` is the set of
    addresses listed more than once right now (by two nodes, or twice by one), so an event
    "shows a duplicate" exactly when it is not empty afterwards."""

    def __init__(self) -> None:
        self.held: dict[str, list[str]] = {}
        self.owners: dict[str, list[str]] = {}
        self.shared: set[str] = set()
        self.events = 0
        self.events_with_duplicate = 0
        self.duplicated: set[str] = set()  # every address ever seen listed twice
        self.examples: list[str] = []

    def _drop(self, node: str) -> None:
        for address in self.held.pop(node, ()):
            owners = self.owners[address]
            owners.remove(node)
            if not owners:
                del self.owners[address]
            elif len(owners) == 1:
                self.shared.discard(address)

    def update(self, node: str, listed: Iterable[str]) -> None:
        """`node`'s NNC now lists `listed` (primary and secondary addresses)."""
        self._drop(node)
        listed = list(listed)
        self.held[node] = listed
        for address in listed:
            owners = self.owners.setdefault(address, [])
            owners.append(node)
            if len(owners) > 1:
                self.shared.add(address)
        self._checked()

    def remove(self, node: str) -> None:
        self._drop(node)
        self._checked()

    def _checked(self) -> None:
        self.events += 1
        if self.shared:
            self.events_with_duplicate += 1
            for address in sorted(self.shared - self.duplicated)[:5]:
                if len(self.examples) < 20:
                    self.examples.append(f"{address} listed by {sorted(self.owners[address])}")
            self.duplicated |= self.shared


def held_names(nnc: dict[str, Any]) -> set[str]:
    """The IP names (ids) of the secondary addresses in an NNC's containers."""
    return {
        str(a["name"])
        for nc in (nnc.get("status") or {}).get("networkContainers") or []
        for a in nc.get("ipAssignments") or []
    }


def batch_of(nnc: dict[str, Any]) -> int:
    batch = ((nnc.get("status") or {}).get("scaler") or {}).get("batchSize")
    return batch if isinstance(batch, int) and batch > 0 else DEFAULT_BATCH


def request_choices(*, batch: int, low: int, high: int) -> list[int]:
    """Requests a daemon whose pods need between `low` and `high` addresses makes: the demand
    rounded up to a multiple of the batch."""
    return sorted({math.ceil(demand / batch) * batch for demand in range(low, high + 1)})


def pick_request(nnc: dict[str, Any], rng: random.Random, *, low: int = 32, high: int = 64) -> int:
    """A new request for the node, different from its current one (so that a change always
    asks the controller for something)."""
    current = int((nnc.get("spec") or {}).get("requestedIPCount") or 0)
    batch = batch_of(nnc)
    choices = [r for r in request_choices(batch=batch, low=low, high=high) if r != current]
    return rng.choice(choices) if choices else current + batch


def releases_for(nnc: dict[str, Any], *, request: int, rng: random.Random) -> list[str]:
    """The IP names the node gives back with `request`: whatever the controller asks for, and
    random ones of those it holds beyond the request (pods gone, any of their addresses)."""
    held = held_names(nnc)
    asked = {str(i) for i in (nnc.get("status") or {}).get("ipsToRelease") or ()} & held
    kept = sorted(held - asked)
    surplus = max(0, len(kept) - request)
    return sorted(asked | set(rng.sample(kept, surplus)))


def fulfilled(nnc: dict[str, Any], *, request: int, releasing: Iterable[str]) -> bool:
    """The container holds `request` secondary addresses, none of those given back, and the
    controller asks for no release."""
    status = nnc.get("status") or {}
    if not status.get("networkContainers") or status.get("ipsToRelease"):
        return False
    held = held_names(nnc)
    return len(held) == request and held.isdisjoint(releasing)


def resource_version(obj: dict[str, Any]) -> int:
    """An object's resourceVersion as a number: opaque in the API's contract, etcd's revision in
    practice, and only this harness compares them (the event after an acknowledged write)."""
    return int(obj["metadata"]["resourceVersion"])


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile (`fraction` 0.5 for p50); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


@dataclass
class Change:
    """One spec change of one node and when it was acknowledged and fulfilled (monotonic)."""

    node: str
    request: int
    releasing: list[str]
    acked_at: float = 0.0
    acked_version: int = 0
    fulfilled_at: float | None = None
    error: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.fulfilled_at is None else max(0.0, self.fulfilled_at - self.acked_at)


@dataclass
class _Node:
    nnc: dict[str, Any] | None = None
    seen_at: float = 0.0
    waiting: Change | None = None
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    busy: bool = False


class ScaleFleet:
    """The simulated nodes, their NNC watch and the duplicate check.

    `run_watch()` runs for the life of the fleet; `change(node)` makes one node ask for
    something new and returns when the watch shows it fulfilled (or `timeout` passed)."""

    def __init__(self, kube: AsyncKube, nodes: Iterable[str], *, seed: int, timeout: float):
        self.kube = kube
        self.nodes = {name: _Node() for name in nodes}
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.check = OwnershipCheck()
        self.appeared = asyncio.Event()  # every node's NNC has been seen
        self.writes = 0
        self.watch_restarts = 0

    # ------------------------------------------------------------------ the watch

    async def run_watch(self) -> None:
        """List, then watch every NNC from the list's version; list again on 410 Gone."""
        while True:
            listing = await self.kube.request("GET", NNC_PATH)
            self.check = _relisted(self.check, listing["items"])
            for item in listing["items"]:
                self._seen(item)
            version = listing["metadata"]["resourceVersion"]
            gone = False
            while not gone:
                async for event in self.kube.watch(NNC_PATH, resource_version=version):
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        gone = True
                        break
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] == "BOOKMARK":
                        continue
                    if event["type"] == "DELETED":
                        self.check.remove(obj["metadata"]["name"])
                    else:
                        self.check.update(obj["metadata"]["name"], addresses(obj))
                        self._seen(obj)
                self.watch_restarts += 1

    def _seen(self, nnc: dict[str, Any]) -> None:
        node = self.nodes.get(nnc["metadata"]["name"])
        if node is None:
            return
        node.nnc, node.seen_at = nnc, time.monotonic()
        if not self.appeared.is_set() and all(n.nnc is not None for n in self.nodes.values()):
            self.appeared.set()
        node.woken.set()
        self._resolve(node)

    @staticmethod
    def _resolve(node: _Node) -> None:
        change, nnc = node.waiting, node.nnc
        if change is None or nnc is None or not change.acked_version:
            return
        if resource_version(nnc) > change.acked_version and fulfilled(
            nnc, request=change.request, releasing=change.releasing
        ):
            change.fulfilled_at = max(node.seen_at, change.acked_at)
            node.waiting = None

    # ------------------------------------------------------------------ the nodes

    def idle(self) -> list[str]:
        return [name for name, node in self.nodes.items() if not node.busy]

    async def appear(self, name: str) -> Change:
        """What a new node's daemon does: wait for its NNC, then ask for 32 to 64 addresses."""
        node = self.nodes[name]
        while node.nnc is None:
            node.woken.clear()
            await node.woken.wait()
        return await self.change(name)

    async def change(self, name: str, request: int | None = None) -> Change:
        """Ask for a new request (releasing the surplus), wait for its fulfilment, then clear
        `ipsNotInUse` as a daemon does once the addresses are gone from the status."""
        node = self.nodes[name]
        if node.busy or node.nnc is None:
            raise RuntimeError(f"node {name} is busy or has no NNC yet")
        node.busy = True
        try:
            nnc = node.nnc
            request = pick_request(nnc, self.rng) if request is None else request
            change = Change(name, request, releases_for(nnc, request=request, rng=self.rng))
            try:
                await self._patch(name, request, change.releasing, change)
                await self._wait(node, change)
                if change.fulfilled_at is not None and change.releasing:
                    await self._patch(name, request, [], None)
            except (ApiError, OSError, TimeoutError) as exc:
                change.error = f"{type(exc).__name__}: {exc}"[:300]
            return change
        finally:
            node.waiting = None
            node.busy = False

    async def _patch(
        self, name: str, request: int, releasing: list[str], change: Change | None
    ) -> None:
        node = self.nodes[name]
        spec = {"spec": {"requestedIPCount": request, "ipsNotInUse": releasing}}
        if change is not None:
            node.waiting = change
        written = await self.kube.request("PATCH", f"{NNC_PATH}/{name}", spec, MERGE_PATCH)
        self.writes += 1
        if change is not None:
            change.acked_at, change.acked_version = time.monotonic(), resource_version(written)
            self._resolve(node)  # the watch may have shown it fulfilled already

    async def _wait(self, node: _Node, change: Change) -> None:
        deadline = change.acked_at + self.timeout
        while change.fulfilled_at is None:
            node.woken.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                change.error = f"not fulfilled within {self.timeout:g} s"
                return
            try:
                await asyncio.wait_for(node.woken.wait(), remaining)
            except TimeoutError:
                continue


def _relisted(old: OwnershipCheck, items: list[dict[str, Any]]) -> OwnershipCheck:
    """The check after a (re)list: the current state from the list, the counts carried on."""
    check = OwnershipCheck()
    check.events, check.events_with_duplicate = old.events, old.events_with_duplicate
    check.duplicated, check.examples = old.duplicated, old.examples
    for item in items:
        check.update(item["metadata"]["name"], addresses(item))
    return check
