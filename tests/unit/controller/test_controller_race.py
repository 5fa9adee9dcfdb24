"""Several controllers that all believe they lead, on one store with Kubernetes' write rules.

This explores interleavings the real cluster test (tests/integration/test_controller_safety.py)
reaches only by luck: every controller runs the real `Controller.reconcile` with fencing switched
off (so only the allocation protocol stands between them and a duplicate), its caches lag the store
by a random amount per object, and every API call yields to the others a random number of times, so
writes land in any order. The store applies Kubernetes' rules: a replace or merge patch that carries
a resourceVersion fails with 409 unless it matches, an unchanged replace keeps the resourceVersion,
a create of an existing object fails with 409. Nodes play daemons: they change their requests,
release addresses and honour release requests; now and then a node's NNC is deleted under it while
its pods hold addresses (and the node, like the daemon, may re-create it asking for them), and a
node leaves for good (its Node object deleted) and another joins under its name. After every write
that lands, no address may be in two network containers, nor in one container while the pods of
another node that still exists hold it (`Store.held`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import ipaddress
import itertools
import json
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from cns.controller import recheck as recheck_module
from cns.controller import subnet_round as round_module
from cns.controller import writes as writes_module
from cns.controller.run import Controller
from cns.kube.client import KubeClient
from cns.kube.ipblock import block_entries, encode_entry
from cns.kube.nnc import nnc_subnet
from cns.kube.nnc_containers import network_containers
from cns.kube.watch import WatchedCollection

SUBNET = "race"
SECOND = "race-b"
NAMESPACE = "kube-system"


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


class Store:
    """Objects by (plural, name) with Kubernetes' concurrency rules and a duplicate check."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.revision = itertools.count(1)
        self.writes = 0
        self.conflicts = 0
        # Node -> the addresses its pods hold: every address its containers listed, until a
        # container of the same object stops listing it (a release); a deleted NNC's addresses
        # stay held, and only the Node's deletion ends them.
        self.held: dict[str, set[str]] = {}
        self._listed: dict[str, tuple[str, set[str]]] = {}  # NNC name -> (uid, addresses)
        # How often an NNC was deleted while its node's pods held addresses, and how many
        # record entries moved to another NNC object of their node.
        self.deleted_holding = 0
        self.moved = 0

    async def interleave(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = str(next(self.revision))
        self.writes += 1
        return obj

    def _conflict(self, status: int) -> ApiException:
        self.conflicts += 1
        return ApiException(status=status, reason="Conflict" if status == 409 else "NotFound")

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        before = self.objects.get((plural, obj["metadata"]["name"]))
        if plural == "ipblocks" and before is not None:
            old, new = block_entries(before), block_entries(obj)
            self.moved += sum(
                1
                for a, e in new.items()
                if a in old and (old[a].node, old[a].id) == (e.node, e.id) and old[a].uid != e.uid
            )
        obj = self._stamp(copy.deepcopy(obj))
        self.objects[(plural, obj["metadata"]["name"])] = obj
        if plural == "nodenetworkconfigs":
            self._hold(obj)
        self.check()
        return copy.deepcopy(obj)

    def _hold(self, nnc: dict[str, Any]) -> None:
        name, uid = nnc["metadata"]["name"], nnc["metadata"].get("uid", "")
        if ("nodes", name) not in self.objects:
            return  # an NNC left behind by a Node that is gone: no pods hold its addresses
        spec = nnc.get("spec") or {}
        entries = [spec, *(e for e in spec.get("subnets") or () if isinstance(e, dict))]
        given_up = {i for entry in entries for i in entry.get("ipsNotInUse") or ()}
        listed = set()
        for nc in network_containers(nnc):
            listed.update(nc.primary_ips)
            listed.update(c.address for c in nc.ip_configs if c.id not in given_up)
        held = self.held.setdefault(name, set())
        before_uid, before = self._listed.get(name, ("", set()))
        if before_uid == uid:
            held -= before - listed  # given up, or the container of the same object let them go
        held |= listed
        self._listed[name] = (uid, listed)

    def create(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        if (plural, body["metadata"]["name"]) in self.objects:
            raise self._conflict(409)
        body = copy.deepcopy(body)
        body["metadata"]["uid"] = f"uid-{next(self.revision)}"
        return self.put(plural, body)

    def delete(self, plural: str, name: str) -> None:
        self.objects.pop((plural, name), None)
        self.writes += 1
        if plural == "nodes":  # the node left: its pods are gone
            self.held.pop(name, None)
            self._listed.pop(name, None)
        elif plural == "nodenetworkconfigs" and self.held.get(name):
            self.deleted_holding += 1

    def replace(self, plural: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        current = self.objects.get((plural, name))
        if current is None:
            raise self._conflict(404)
        wanted = body["metadata"].get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise self._conflict(409)
        strip = {k: v for k, v in body.items() if k != "metadata"}
        if strip == {k: v for k, v in current.items() if k != "metadata"}:
            return copy.deepcopy(current)  # unchanged: no new resourceVersion
        merged = {**copy.deepcopy(body), "metadata": copy.deepcopy(current["metadata"])}
        return self.put(plural, merged)

    def patch(self, plural: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        current = self.objects.get((plural, name))
        if current is None:
            raise self._conflict(404)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise self._conflict(409)
        body = {k: v for k, v in patch.items() if k != "metadata"}
        labels = (patch.get("metadata") or {}).get("labels")
        if labels:  # the only metadata the controller patches
            body["metadata"] = {"labels": labels}
        merged = _merge(current, body)
        if plural == "nodenetworkconfigs":  # no write drops a network container
            before = {nc.subnet for nc in network_containers(current)}
            assert before <= {nc.subnet for nc in network_containers(merged)}, (name, patch)
        return self.put(plural, merged)

    def get(self, plural: str, name: str) -> dict[str, Any]:
        current = self.objects.get((plural, name))
        if current is None:
            raise self._conflict(404)
        return copy.deepcopy(current)

    def of(self, plural: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (p, _), o in sorted(self.objects.items()) if p == plural]

    def check(self) -> None:
        """No address in two network containers (of one NNC or two), nor in the container of
        one node while the pods of another hold it; an NNC has at most one container per
        subnet, each holding addresses of its own subnet only."""
        seen: dict[str, str] = {}
        holders = {a: node for node, held in self.held.items() for a in held}
        for node, held in self.held.items():
            for address in held:
                assert holders[address] == node, (
                    f"pods of {node} and {holders[address]} hold {address}"
                )
        for nnc in self.of("nodenetworkconfigs"):
            owner = nnc["metadata"]["name"]
            ncs = network_containers(nnc)
            subnets = [nc.subnet for nc in ncs]
            assert len(set(subnets)) == len(subnets), f"{owner} has two containers of a subnet"
            assert len({nc.id for nc in ncs}) == len(ncs), f"{owner} has two containers of an id"
            for nc in ncs:
                for address in (*nc.primary_ips, *(c.address for c in nc.ip_configs)):
                    assert address not in seen, f"{address} is in {seen[address]} and {owner}"
                    held_by = holders.get(address, owner)
                    assert held_by == owner, f"{address} is in {owner}, pods of {held_by} hold it"
                    seen[address] = owner
                    network = ipaddress.ip_network(nc.subnet)
                    assert ipaddress.ip_address(address) in network, (owner, address, nc.subnet)


class FakeCustomObjects:
    """The CustomObjectsApi calls the controller makes, against the Store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def _call(self, fn: Any, *args: Any) -> Any:
        await self.store.interleave()
        result = fn(*args)
        await self.store.interleave()
        return result

    async def create_cluster_custom_object(self, group: str, v: str, plural: str, body: Any) -> Any:
        return await self._call(self.store.create, plural, body)

    async def replace_cluster_custom_object(
        self, group: str, v: str, plural: str, name: str, body: Any
    ) -> Any:
        return await self._call(self.store.replace, plural, name, body)

    async def get_cluster_custom_object(self, group: str, v: str, plural: str, name: str) -> Any:
        return await self._call(self.store.get, plural, name)

    async def list_cluster_custom_object(self, group: str, v: str, plural: str) -> Any:
        return await self._call(lambda: {"items": self.store.of(plural)})

    async def patch_cluster_custom_object_status(
        self, group: str, v: str, plural: str, name: str, body: Any, **_: Any
    ) -> Any:
        return await self._call(self.store.patch, plural, name, body)

    async def create_namespaced_custom_object(
        self, group: str, v: str, ns: str, plural: str, body: Any
    ) -> Any:
        return await self._call(self.store.create, plural, body)

    async def get_namespaced_custom_object(
        self, group: str, v: str, ns: str, plural: str, name: str
    ) -> Any:
        return await self._call(self.store.get, plural, name)

    async def patch_namespaced_custom_object(
        self, group: str, v: str, ns: str, plural: str, name: str, body: Any, **_: Any
    ) -> Any:
        return await self._call(self.store.patch, plural, name, body)

    async def patch_namespaced_custom_object_status(
        self, group: str, v: str, ns: str, plural: str, name: str, body: Any, **_: Any
    ) -> Any:
        return await self._call(self.store.patch, plural, name, body)


class FakeResponse:
    """What `KubeClient._read_core` reads of a reply: its status and body."""

    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.status = 404 if obj is None else 200
        self.reason = "NotFound" if obj is None else "OK"
        self.body = json.dumps(obj or {}).encode()

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        return None


class FakeCore:
    """The CoreV1Api read the controller makes directly (a Node), against the Store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def read_node(self, name: str, **_: Any) -> FakeResponse:
        await self.store.interleave()
        found = self.store.objects.get(("nodes", name))
        await self.store.interleave()
        return FakeResponse(copy.deepcopy(found) if found is not None else None)


class NoFence:
    """Every controller believes it leads: only the allocation protocol keeps them apart."""

    def fence(self) -> None:
        return None


def make_controller(api: client.ApiClient, store: Store, index: int, seed: int) -> Controller:
    controller = Controller(KubeClient(api), namespace=NAMESPACE, identity=f"c{index}", seed=seed)
    controller.kube.custom = FakeCustomObjects(store)  # type: ignore[assignment]
    controller.kube.core = FakeCore(store)  # type: ignore[assignment]
    controller.elector = NoFence()  # type: ignore[assignment]
    return controller


PLURALS = {
    "nodes": "nodes",
    "nodenetworkconfigs": "nodenetworkconfigs",
    "clustersubnets": "clustersubnets",
    "clustersubnetstates": "clustersubnetstates",
    "ipblocks": "ipblocks",
}


def refresh(controller: Controller, store: Store, rng: random.Random, freshness: float) -> None:
    """Let each cached object catch up with the store with probability `freshness`."""
    for collection in controller._collections:
        live = {WatchedCollection.key(o): o for o in store.of(PLURALS[collection.name])}
        for key in set(live) | set(collection.objects):
            if rng.random() < freshness:
                if key in live:
                    collection.put(live[key])
                else:
                    collection.discard(key)


class Node:
    """A daemon, as far as the control plane can tell: spec writes from what its status says."""

    def __init__(self, name: str, store: Store, rng: random.Random) -> None:
        self.name = name
        self.store = store
        self.rng = rng
        self.joins = itertools.count(1)
        self.labels: dict[str, str] = {}

    async def step(self) -> None:
        await self.store.interleave()
        store, name = self.store, self.name
        present = ("nodes", name) in store.objects
        if not present:
            # Gone: the garbage collector deletes the NNC a stale controller may have created
            # for it meanwhile; now and then another node joins under the name.
            store.delete("nodenetworkconfigs", name)
            if self.rng.random() < 0.3:
                uid = f"uid-{name}-{next(self.joins)}"
                labels = self.labels  # the same pool: the same subnet
                store.put("nodes", {"metadata": {"name": name, "uid": uid, "labels": labels}})
            return
        roll = self.rng.random()
        if roll < 0.01:
            # The node leaves for good: its Node object is deleted, its pods with it, and the
            # garbage collector deletes its NNC; the addresses are freed.
            self.labels = store.objects[("nodes", name)]["metadata"].get("labels") or {}
            store.delete("nodes", name)
            store.delete("nodenetworkconfigs", name)
            return
        if roll < 0.1 and store.held.get(name):
            # `kubectl delete nnc` while its pods hold addresses: they stay its own, and come
            # back in the NNC that replaces it (created by a controller, or by the node).
            store.delete("nodenetworkconfigs", name)
            return
        try:
            nnc = store.get("nodenetworkconfigs", name)
        except ApiException:
            if roll < 0.5:
                self.recreate()
            return
        store.patch("nodenetworkconfigs", name, {"spec": self.spec(nnc)})

    def recreate(self) -> None:
        """The daemon re-creates its NNC, asking by name for the addresses its pods hold."""
        held = sorted(self.store.held.get(self.name, ()))
        node = self.store.objects[("nodes", self.name)]
        body = {
            "apiVersion": "acn.azure.com/v1alpha",
            "kind": "NodeNetworkConfig",
            "metadata": {
                "name": self.name,
                "namespace": NAMESPACE,
                "ownerReferences": [{"kind": "Node", "uid": node["metadata"]["uid"]}],
            },
            "spec": {"requestedIPCount": len(held), "requestedIPs": held},
        }
        with contextlib.suppress(ApiException):  # a controller was first
            self.store.create("nodenetworkconfigs", body)

    def spec(self, nnc: dict[str, Any]) -> dict[str, Any]:
        held = [c.id for nc in network_containers(nnc) for c in nc.ip_configs]
        return self.request(nnc.get("spec") or {}, held, nnc)

    def request(
        self, fields: dict[str, Any], held: list[str], nnc: dict[str, Any]
    ) -> dict[str, Any]:
        """A new request from one the node made (`fields`) for the IP names it `held`: the
        releases still pending, those asked for (`ipsToRelease`), some at random."""
        releasing = [i for i in fields.get("ipsNotInUse") or () if i in held]
        asked = [i for i in (nnc.get("status") or {}).get("ipsToRelease") or () if i in held]
        if self.rng.random() < 0.3 and held:
            releasing += self.rng.sample(held, self.rng.randrange(1, min(len(held), 6) + 1))
        request = self.rng.choice([0, 3, 8, 15, 31, 47])
        # What it asked for by name when it re-created its NNC is not asked for again.
        return {
            "requestedIPCount": request,
            "ipsNotInUse": sorted(set(releasing) | set(asked)),
            "requestedIPs": [],
        }


class TwoSubnetNode(Node):
    """A daemon that also takes addresses from the other subnet (`spec.subnets`): it requests,
    releases and honours release requests in each subnet separately, and at times also asks
    for a subnet that does not exist or names its primary one there (both get nothing)."""

    def spec(self, nnc: dict[str, Any]) -> dict[str, Any]:
        held = {
            nc["subnetName"]: [a["name"] for a in nc.get("ipAssignments") or ()]
            for nc in (nnc.get("status") or {}).get("networkContainers") or ()
        }
        spec = nnc.get("spec") or {}
        primary = nnc_subnet(nnc)
        other = SUBNET if primary == SECOND else SECOND
        entries = {e["name"]: e for e in spec.get("subnets") or ()}
        entry = self.request(entries.get(other, {}), held.get(other, []), nnc)
        subnets = [{"name": other, **entry}]
        if self.rng.random() < 0.1:
            subnets.append({"name": "ghost", "requestedIPCount": 4})
        if primary and self.rng.random() < 0.1:
            subnets.append({"name": primary, "requestedIPCount": 9})
        return {**self.request(spec, held.get(primary, []), nnc), "subnets": subnets}


def seed_cluster(store: Store, nodes: int, cidr: str, second_cidr: str = "") -> None:
    """`nodes` nodes and their NNCs (not yet placed in a subnet) and the ClusterSubnet SUBNET
    of `cidr`; with `second_cidr`, also the subnet SECOND of it, which serves the nodes
    labelled pool=b (every other one)."""
    subnets = [(SUBNET, cidr, {})]
    if second_cidr:
        subnets.append((SECOND, second_cidr, {"nodeSelector": {"matchLabels": {"pool": "b"}}}))
    for name, range_, extra in subnets:
        store.put(
            "clustersubnets",
            {
                "apiVersion": "acn.azure.com/v1alpha1",
                "kind": "ClusterSubnet",
                "metadata": {"name": name},
                "spec": {
                    "subnet": range_,
                    "exhaustion": {"upperPercent": 90, "lowerPercent": 50},
                    **extra,
                },
            },
        )
    for i in range(nodes):
        name = f"n{i}"
        labels = {"pool": "b"} if second_cidr and i % 2 else {}
        store.put("nodes", {"metadata": {"name": name, "uid": f"uid-{i}", "labels": labels}})
        store.create(
            "nodenetworkconfigs",
            {
                "apiVersion": "acn.azure.com/v1alpha",
                "kind": "NodeNetworkConfig",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"requestedIPCount": 0},
            },
        )


async def race(
    seed: int,
    *,
    controllers: int,
    nodes: int,
    steps: int,
    cidr: str,
    second_cidr: str = "",
    round_addresses: int = round_module.ROUND_ADDRESSES,
    node: type[Node] = Node,
) -> Store:
    """The race; a small `round_addresses` has rounds with room for every grant planned in
    slices of a node or two (`SubnetModel.take_slice`)."""
    rng = random.Random(seed)
    store = Store(rng)
    seed_cluster(store, nodes, cidr, second_cidr)
    members = [node(f"n{i}", store, rng) for i in range(nodes)]
    async with client.ApiClient() as api:
        leaders = [make_controller(api, store, i, seed + i) for i in range(controllers)]
        with mock.patch.object(round_module, "ROUND_ADDRESSES", round_addresses):
            await _race(store, rng, leaders, members, steps)
    return store


async def _race(
    store: Store, rng: random.Random, leaders: list[Controller], members: list[Node], steps: int
) -> None:
    async def lead(controller: Controller) -> None:
        for _ in range(steps):
            refresh(controller, store, rng, freshness=rng.choice([0.1, 0.5, 0.9, 1.0]))
            try:
                failures = await controller.reconcile()
            except ApiException as exc:
                failures = [("", exc)]
            for _, exc in failures:  # only refusals of stale writes
                assert isinstance(exc, ApiException) and exc.status in (404, 409), exc
            await store.interleave()

    async def churn() -> None:
        for step in range(steps * 2):
            if step == steps:
                # Once, whatever the draws so far: `kubectl delete nnc` while its node's pods
                # hold addresses (the nodes' own steps do it only now and then).
                holding = [m.name for m in members if store.held.get(m.name)]
                if holding:
                    store.delete("nodenetworkconfigs", rng.choice(holding))
            await rng.choice(members).step()
            for _ in range(rng.randrange(40)):  # the nodes change while the rounds go on
                await asyncio.sleep(0)

    await asyncio.gather(*(lead(c) for c in leaders), churn())


@pytest.mark.parametrize("seed", range(18))
async def test_stale_controllers_never_grant_one_address_twice(seed: int) -> None:
    if seed < 12:
        store = await race(seed, controllers=3, nodes=6, steps=40, cidr="10.70.0.0/26")
    else:  # room for every grant: rounds in slices
        store = await race(
            seed, controllers=3, nodes=6, steps=40, cidr="10.70.0.0/23", round_addresses=40
        )
    # The race really raced: writes were refused, and NNCs were deleted while their nodes'
    # pods held addresses.
    assert store.conflicts > 0
    assert store.deleted_holding > 0
    # Once the race is over (the garbage collector deletes the NNCs of Nodes that are gone,
    # every node asks for a few more), a controller with a fresh view serves every node, gives
    # each one that exists back what its pods hold, and keeps nothing for a node that is gone.
    for plural, name in list(store.objects):
        if plural == "nodenetworkconfigs" and ("nodes", name) not in store.objects:
            store.delete(plural, name)
    async with client.ApiClient() as api:
        settler = make_controller(api, store, 9, seed)
        for _ in range(4):
            for plural, name in list(store.objects):
                if plural == "nodenetworkconfigs":
                    held = len(store.held.get(name, ()))
                    request(store, name, held + 3)
            refresh(settler, store, random.Random(seed), freshness=1.0)
            assert await settler.reconcile() == []
    assert store.moved > 0, "no entry moved to the NNC that replaced its node's"
    recorded = {
        a: e.node for block in store.of("ipblocks") for a, e in block_entries(block).items()
    }
    for node, held in store.held.items():
        listed = {
            address
            for nc in network_containers(store.get("nodenetworkconfigs", node))
            for address in (*nc.primary_ips, *(c.address for c in nc.ip_configs))
        }
        assert held <= listed, (node, sorted(held - listed))
    granted = [
        c
        for nnc in store.of("nodenetworkconfigs")
        for nc in network_containers(nnc)
        for c in nc.ip_configs
    ]
    assert granted, "no address was ever granted"
    present = {name for plural, name in store.objects if plural == "nodes"}
    assert set(recorded.values()) <= present


@pytest.mark.parametrize("seed", range(6))
async def test_stale_controllers_serving_two_subnets_never_grant_one_address_twice(
    seed: int,
) -> None:
    """The same race with two subnets, each node placed in one by its labels: nodes get
    addresses of their own subnet only, and none twice."""
    store = await race(
        seed, controllers=3, nodes=6, steps=40, cidr="10.70.0.0/26", second_cidr="10.70.1.0/26"
    )
    ranges = {SUBNET: ipaddress.ip_network("10.70.0.0/26"),
              SECOND: ipaddress.ip_network("10.70.1.0/26")}  # fmt: skip

    def served(*, settled: bool) -> set[str]:
        """The subnets whose addresses the NNCs hold; each NNC placed and served rightly. In
        the racy end state, an NNC its node re-created in the race's last steps may not be
        placed yet (no label): it then holds nothing."""
        granted = set()
        for nnc in store.of("nodenetworkconfigs"):
            name = nnc["metadata"]["name"]
            wanted = SECOND if int(name[1:]) % 2 else SUBNET
            if not settled and "labels" not in nnc["metadata"]:
                assert network_containers(nnc) == (), name
                continue
            assert nnc["metadata"]["labels"] == {"acn.azure.com/subnet": wanted}
            for nc in network_containers(nnc):
                for config in nc.ip_configs:
                    assert ipaddress.ip_address(config.address) in ranges[wanted], (name, config)
                    granted.add(wanted)
        return granted

    served(settled=False)  # the racy end state
    # Liveness, once the race is over (where it ends depends on how threads were scheduled):
    # every node asks for addresses, and a controller with a fresh view serves both subnets.
    for nnc in store.of("nodenetworkconfigs"):
        spec = {"requestedIPCount": 3, "ipsNotInUse": [], "requestedIPs": []}
        store.patch("nodenetworkconfigs", nnc["metadata"]["name"], {"spec": spec})
    async with client.ApiClient() as api:
        settler = make_controller(api, store, 9, seed)
        for _ in range(4):
            refresh(settler, store, random.Random(seed), freshness=1.0)
            assert await settler.reconcile() == []
    store.check()
    assert served(settled=True) == {SUBNET, SECOND}, "both subnets granted addresses"


@pytest.mark.parametrize("seed", range(8))
async def test_nodes_taking_addresses_from_two_subnets_never_get_one_twice(seed: int) -> None:
    """The race with every node also asking for the other subnet by `spec.subnets` (half of
    them placed in each): two subnets' rounds write one NNC, each its own container, while
    stale controllers race. No address is ever in two containers, each container holds its own
    subnet's addresses, no write drops a container (`Store`); once the race is over, every node
    has its primary subnet's container first and the other one's after it."""
    second = "fd00:70::/120" if seed % 2 else "10.70.1.0/26"
    store = await race(
        seed,
        controllers=3,
        nodes=6,
        steps=40,
        cidr="10.70.0.0/26",
        second_cidr=second,
        round_addresses=40 if seed % 4 == 3 else round_module.ROUND_ADDRESSES,
        node=TwoSubnetNode,
    )
    assert store.conflicts > 0

    def ask(count: int, *, give_up: bool) -> None:
        """Every node asks `count` of each subnet, giving up all it holds or nothing."""
        for nnc in store.of("nodenetworkconfigs"):
            held = {
                nc["subnetName"]: [a["name"] for a in nc["ipAssignments"]]
                for nc in (nnc.get("status") or {}).get("networkContainers") or ()
            }
            primary = nnc_subnet(nnc)
            other = SUBNET if primary == SECOND else SECOND
            wants = {
                subnet: {
                    "requestedIPCount": count,
                    "ipsNotInUse": held.get(subnet, []) if give_up else [],
                }
                for subnet in (primary, other)
            }
            spec = {**wants[primary], "subnets": [{"name": other, **wants[other]}]}
            spec["requestedIPs"] = []
            store.patch("nodenetworkconfigs", nnc["metadata"]["name"], {"spec": spec})

    async with client.ApiClient() as api:
        settler = make_controller(api, store, 9, seed)
        # Giving up three times: a node whose NNC is deleted at the end of the race gets a new
        # one (in the first pass); what the old one held in the other subnet comes back once
        # the new one asks for that subnet (the second), and goes with the third.
        for count, give_up in ((0, True), (0, True), (0, True), (3, False)):
            ask(count, give_up=give_up)
            for _ in range(4):
                refresh(settler, store, random.Random(seed), freshness=1.0)
                assert await settler.reconcile() == []
    store.check()
    for nnc in store.of("nodenetworkconfigs"):
        primary = nnc["metadata"]["labels"]["acn.azure.com/subnet"]
        containers = nnc["status"]["networkContainers"]
        other = SUBNET if primary == SECOND else SECOND
        assert [nc["subnetName"] for nc in containers] == [primary, other]
        assert [len(nc["ipAssignments"]) for nc in containers] == [3, 3]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(0, 2**32),
    st.sampled_from(["10.71.0.0/27", "10.71.0.0/23", "fd00:71::/120"]),
    st.sampled_from([round_module.ROUND_ADDRESSES, 50, 1]),
)
def test_stale_controllers_property(seed: int, cidr: str, round_addresses: int) -> None:
    asyncio.run(
        race(seed, controllers=2, nodes=5, steps=20, cidr=cidr, round_addresses=round_addresses)
    )


def test_store_follows_kubernetes_rules() -> None:
    """The fake's rules are the ones the argument relies on."""
    store = Store(random.Random(0))
    first = store.create("ipblocks", {"metadata": {"name": "b"}, "spec": {"a": 1}})
    with pytest.raises(ApiException) as exists:
        store.create("ipblocks", {"metadata": {"name": "b"}, "spec": {}})
    assert exists.value.status == 409
    same = store.replace("ipblocks", "b", json.loads(json.dumps(first)))
    assert same["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    changed = store.replace("ipblocks", "b", {**first, "spec": {"a": 2}})
    assert changed["metadata"]["resourceVersion"] != first["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as stale:
        store.replace("ipblocks", "b", first)
    assert stale.value.status == 409


def refresh_one(controller: Controller, store: Store, plural: str, name: str) -> None:
    """Deliver one object's newest version to one controller's cache (its other objects lag)."""
    for collection in controller._collections:
        if collection.name == plural:
            collection.put(store.get(plural, name))


async def test_a_stale_record_cannot_complete_a_grant_that_was_released_meanwhile() -> None:
    """The reason an address added to a container needs its block written even when the record
    does not change: writer W still sees X granted to n, but X was released by n and has just
    been granted to m. W's container write for n is current (nothing wrote n's NNC since W read
    it) and W has not seen m's new container yet; only the block write, refused as stale, keeps
    W from putting X back on n."""
    store = Store(random.Random(0))
    seed_cluster(store, 2, "10.72.0.0/28")
    n, m = "n0", "n1"

    def spec(node: str, requested: int, releasing: list[str]) -> None:
        store.patch(
            "nodenetworkconfigs",
            node,
            {"spec": {"requestedIPCount": requested, "ipsNotInUse": releasing}},
        )

    def configs(node: str) -> dict[str, str]:
        nnc = store.get("nodenetworkconfigs", node)
        return {c.address: c.id for nc in network_containers(nnc) for c in nc.ip_configs}

    async with client.ApiClient() as api:
        a, w = make_controller(api, store, 0, 0), make_controller(api, store, 1, 1)

        async def round_of(controller: Controller) -> None:
            refresh(controller, store, random.Random(0), freshness=1.0)
            await controller.reconcile()

        await round_of(a)  # network containers with primary IPs
        spec(n, 1, [])
        await round_of(a)
        ((x, grant),) = configs(n).items()
        await round_of(w)  # W's caches are current: X belongs to n
        spec(n, 0, [grant])
        await round_of(a)  # marked releasing, removed from n
        assert x not in configs(n)
        spec(m, 1, [])
        await round_of(a)  # freed and granted again: the lowest free address is X
        assert x in configs(m)
        refresh_one(w, store, "nodenetworkconfigs", n)  # W's blocks and m's NNC stay stale
        await w.reconcile()
    assert x not in configs(n)
    assert store.conflicts > 0


async def test_a_lagging_nnc_cache_cannot_free_an_address_its_node_still_lists() -> None:
    """W's IPBlock cache is current: X is n's and `releasing` (n gave it up; the write that
    removes it from n's container has not landed). W's NNC cache lags: its copy of n's NNC
    predates the grant of X, so it does not list X either. The NNC and IPBlock watches are two
    streams, one can lag the other. W must not take "not listed" from that copy: freeing X
    there would let W grant it to m while n's container, hence n's pods, still have it."""
    store = Store(random.Random(0))
    seed_cluster(store, 2, "10.72.0.0/28")
    n, m = "n0", "n1"

    def configs(node: str) -> dict[str, str]:
        nnc = store.get("nodenetworkconfigs", node)
        return {c.address: c.id for nc in network_containers(nnc) for c in nc.ip_configs}

    async with client.ApiClient() as api:
        a, w = make_controller(api, store, 0, 0), make_controller(api, store, 1, 1)
        refresh(a, store, random.Random(0), freshness=1.0)
        await a.reconcile()  # network containers with primary IPs
        refresh(w, store, random.Random(0), freshness=1.0)  # W's last look at n's NNC
        request(store, n, 1)
        refresh(a, store, random.Random(0), freshness=1.0)
        await a.reconcile()
        ((x, grant),) = configs(n).items()
        # n gives X up; the record marks it releasing, the container write is yet to land.
        store.patch(
            "nodenetworkconfigs", n, {"spec": {"requestedIPCount": 0, "ipsNotInUse": [grant]}}
        )
        (block,) = store.of("ipblocks")
        entries = block_entries(block)
        entries[x] = dataclasses.replace(entries[x], releasing=True)
        allocations = {address: encode_entry(entry) for address, entry in entries.items()}
        store.patch("ipblocks", block["metadata"]["name"], {"spec": {"allocations": allocations}})
        request(store, m, 1)
        for plural in ("ipblocks", "clustersubnets", "clustersubnetstates"):
            for obj in store.of(plural):
                refresh_one(w, store, plural, obj["metadata"]["name"])
        refresh_one(w, store, "nodenetworkconfigs", m)  # only n's copy lags
        failures = await w.reconcile()
        assert failures == []
        assert configs(n) == {x: grant}
        assert x not in configs(m) and len(configs(m)) == 1
        assert block_entries(store.of("ipblocks")[0])[x].releasing
        # Once n's container no longer lists X, it is freed.
        refresh(a, store, random.Random(0), freshness=1.0)
        await a.reconcile()
        assert x not in configs(n)
        refresh(w, store, random.Random(0), freshness=1.0)
        await w.reconcile()
        assert x not in block_entries(store.of("ipblocks")[0])


def request(store: Store, node: str, count: int) -> None:
    store.patch(
        "nodenetworkconfigs", node, {"spec": {"requestedIPCount": count, "ipsNotInUse": []}}
    )


async def test_a_stale_leader_cannot_overwrite_the_subnet_status() -> None:
    """ClusterSubnet status writes carry the resourceVersion they were planned from: a replica
    whose cache predates another's status write is refused instead of writing over it."""
    store = Store(random.Random(0))
    seed_cluster(store, 2, "10.73.0.0/28")
    async with client.ApiClient() as api:
        stale, fresh = make_controller(api, store, 0, 0), make_controller(api, store, 1, 1)
        refresh(stale, store, random.Random(0), freshness=1.0)
        await stale.reconcile()  # writes the first status
        request(store, "n1", 2)
        refresh(stale, store, random.Random(0), freshness=1.0)  # its last look at the cluster
        request(store, "n0", 8)
        refresh(fresh, store, random.Random(0), freshness=1.0)
        await fresh.reconcile()  # grants both, writes a newer status
        written = store.get("clustersubnets", SUBNET)["status"]
        refused = store.conflicts
        await stale.reconcile()  # plans a different status from its older snapshot
    assert store.get("clustersubnets", SUBNET)["status"] == written
    assert store.conflicts > refused
    assert stale.counters.write_conflicts["clustersubnets"] >= 1


async def test_the_periodic_recheck_finds_the_incremental_state_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The safety net runs in every round here (checks every 0 s): with lagging caches,
    refused writes and nodes changing all the while, the incremental state always matches the
    caches it was synced with, object by object. A defect planted in it is found in the next
    round, and a state read from scratch takes over."""
    monkeypatch.setattr(recheck_module, "RECHECK_SECONDS", 0.0)
    rng = random.Random(7)
    store = Store(rng)
    seed_cluster(store, 6, "10.72.0.0/26")
    members = [Node(f"n{i}", store, rng) for i in range(6)]
    async with client.ApiClient() as api:
        leaders = [make_controller(api, store, i, 7 + i) for i in range(2)]
        await _race(store, rng, leaders, members, 40)
        assert all(leader.counters.rechecks > 5 for leader in leaders)
        assert [leader.counters.state_differences for leader in leaders] == [0, 0]
        leader = leaders[0]
        defective = leader.served[SUBNET].state
        assert defective is not None
        defective.model.reserved += 1
        refresh(leader, store, rng, freshness=1.0)
        assert await leader.reconcile() == []
        assert leader.counters.state_differences == 1
        assert leader.served[SUBNET].state is not defective
        assert await leader.reconcile() == []
        assert leader.counters.state_differences == 1


async def test_writes_are_taken_from_their_iterable_only_as_workers_free_up() -> None:
    """`bounded` runs at most WRITE_CONCURRENCY writes at once and builds the next only when a
    worker is free: 5,000 NNC patches built up front were the controller's memory peak."""
    limit = writes_module.WRITE_CONCURRENCY
    taken = finished = running = most = 0

    async def write() -> None:
        nonlocal finished, running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1
        finished += 1

    def writes() -> Iterator[Callable[[], Awaitable[None]]]:
        nonlocal taken
        for _ in range(10 * limit):
            assert taken - finished <= limit  # never more built than the workers hold
            taken += 1
            yield write

    await writes_module.bounded(writes())
    assert finished == 10 * limit
    assert most == limit


async def test_a_cancelled_recheck_returns_only_once_its_thread_is_done() -> None:
    """The re-check reads the planning state in a worker thread; a round cancelled meanwhile
    (leadership lost) must not let the standby's warm-up change that state under it."""
    release, done = threading.Event(), threading.Event()

    def check() -> None:
        release.wait(10)
        done.set()

    waiting = asyncio.create_task(recheck_module.to_thread_to_the_end(check))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.sleep(0.05)
    assert not waiting.done()  # still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert done.is_set()


async def test_a_round_cancelled_while_it_plans_ends_only_once_the_planning_thread_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planning reads (and builds on) the planning state in a worker thread: a round cancelled
    meanwhile (leadership lost) must not end, and let a standby's warm-up change that state,
    while the thread still runs (fails with a plain `asyncio.to_thread`)."""
    store = Store(random.Random(0))
    seed_cluster(store, 2, "10.75.0.0/28")
    release, planning, done = threading.Event(), threading.Event(), threading.Event()
    real_plan = round_module.plan_round

    def slow_plan(*args: Any, **kwargs: Any) -> Any:
        planning.set()
        release.wait(10)
        try:
            return real_plan(*args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(round_module, "plan_round", slow_plan)
    async with client.ApiClient() as api:
        controller = make_controller(api, store, 0, 0)
        refresh(controller, store, random.Random(0), freshness=1.0)
        round_ = asyncio.create_task(controller.reconcile())
        while not planning.is_set():
            await asyncio.sleep(0.01)
        round_.cancel()
        await asyncio.sleep(0.05)
        assert not round_.done()  # still waiting for the planning thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await round_
        assert done.is_set()


async def test_a_new_subnet_over_addresses_nodes_still_hold_is_not_served() -> None:
    """A ClusterSubnet deleted while its nodes hold its addresses, and a new one created over
    the same range: the new one has an empty record of its own and would grant those
    addresses again, so it is not served while any NNC holds addresses there."""
    store = Store(random.Random(0))
    seed_cluster(store, 2, "10.74.0.0/28", second_cidr="10.74.1.0/28")  # n1 is pool=b
    async with client.ApiClient() as api:
        controller = make_controller(api, store, 0, 0)

        async def round_() -> None:
            refresh(controller, store, random.Random(0), freshness=1.0)
            assert await controller.reconcile() == []

        await round_()
        request(store, "n1", 3)
        await round_()
        held = {c.address for nc in network_containers(store.get("nodenetworkconfigs", "n1"))
                for c in nc.ip_configs}  # fmt: skip
        assert len(held) == 3 and all(a.startswith("10.74.1.") for a in held)
        store.delete("clustersubnets", SECOND)
        cs = {
            "metadata": {"name": "race-c"},
            "spec": {"subnet": "10.74.1.0/28", "nodeSelector": {"matchLabels": {"pool": "b"}}},
        }
        store.put("clustersubnets", cs)  # fmt: skip
        store.put("nodes", {"metadata": {"name": "n2", "uid": "uid-n2", "labels": {"pool": "b"}}})
        await round_()
        request(store, "n2", 3)
        await round_()
    assert "race-c" not in controller.served
    n2 = store.get("nodenetworkconfigs", "n2")
    assert n2["metadata"]["labels"] == {"acn.azure.com/subnet": SUBNET}  # the default subnet
    granted = {c.address for nc in network_containers(n2) for c in nc.ip_configs}
    assert len(granted) == 3 and not granted & held


async def test_a_node_no_subnet_serves_is_said_once_not_every_round() -> None:
    store = Store(random.Random(0))
    seed_cluster(store, 1, "10.75.0.0/28")
    selector = {"nodeSelector": {"matchLabels": {"pool": "a"}}}
    cs = store.get("clustersubnets", SUBNET)
    store.put("clustersubnets", {**cs, "spec": {**cs["spec"], **selector}})
    store.put("nodes", {"metadata": {"name": "lonely", "uid": "uid-lonely"}})
    async with client.ApiClient() as api:
        controller = make_controller(api, store, 0, 0)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                refresh(controller, store, random.Random(0), freshness=1.0)
                assert await controller.reconcile() == []
    said = [entry["node"] for entry in logs if entry["event"] == "node_not_served"]
    assert sorted(said) == ["lonely", "n0"]  # n0 has no pool label either


class GatedCustomObjects(FakeCustomObjects):
    """One controller's calls, held at a chosen step until the test lets them go: before its
    IPBlock writes (`at="ipblocks"`) or before its NNC status writes (`at="nnc-status"`)."""

    def __init__(self, store: Store, at: str) -> None:
        super().__init__(store)
        self.at = at
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def _gate(self, step: str) -> None:
        if step == self.at and not self.go.is_set():
            self.reached.set()
            await self.go.wait()

    async def create_cluster_custom_object(self, group: str, v: str, plural: str, body: Any) -> Any:
        await self._gate(plural)
        return await super().create_cluster_custom_object(group, v, plural, body)

    async def replace_cluster_custom_object(
        self, group: str, v: str, plural: str, name: str, body: Any
    ) -> Any:
        await self._gate(plural)
        return await super().replace_cluster_custom_object(group, v, plural, name, body)

    async def patch_namespaced_custom_object_status(
        self, group: str, v: str, ns: str, plural: str, name: str, body: Any, **_: Any
    ) -> Any:
        await self._gate("nnc-status")
        return await super().patch_namespaced_custom_object_status(group, v, ns, plural, name, body)


def listing(store: Store, node: str) -> dict[str, str]:
    """Address -> name in the node's NNC (the container id for its primary IP); {} if none."""
    try:
        nnc = store.get("nodenetworkconfigs", node)
    except ApiException:
        return {}
    found = {}
    for nc in network_containers(nnc):
        found.update(dict.fromkeys(nc.primary_ips, nc.id))
        found.update({c.address: c.id for c in nc.ip_configs})
    return found


def recreate_nnc(store: Store, node: str) -> None:
    """The node's daemon re-creates its deleted NNC (no status: the controller writes that)."""
    store.create(
        "nodenetworkconfigs",
        {"metadata": {"name": node, "namespace": NAMESPACE}, "spec": {"requestedIPCount": 3}},
    )


async def held_by_n0(api: client.ApiClient, store: Store) -> dict[str, str]:
    """Two nodes on a small subnet; n0 holds a container and 3 addresses (returned with their
    names); n1 asks for more than is free, so anything let go would be granted to it."""
    seed_cluster(store, 2, "10.76.0.0/28")  # 13 usable
    a = make_controller(api, store, 0, 0)
    request(store, "n0", 3)
    for _ in range(3):
        refresh(a, store, random.Random(0), freshness=1.0)
        assert await a.reconcile() == []
    held = listing(store, "n0")
    assert len(held) == 4
    request(store, "n1", 12)
    refresh(a, store, random.Random(0), freshness=1.0)
    assert await a.reconcile() == []
    assert set(held) == set(listing(store, "n0"))
    return held


async def move_held_at(
    api: client.ApiClient, store: Store, at: str
) -> tuple[Controller, GatedCustomObjects, asyncio.Task[list[tuple[str, Exception]]]]:
    """`kubectl delete nnc n0`, the node re-creates it, and a writer's round that moves n0's
    entries to the new object is held at `at` (`GatedCustomObjects`) once it gets there."""
    store.delete("nodenetworkconfigs", "n0")
    recreate_nnc(store, "n0")
    w = make_controller(api, store, 1, 1)
    gated = GatedCustomObjects(store, at)
    w.kube.custom = gated  # type: ignore[assignment]
    refresh(w, store, random.Random(0), freshness=1.0)
    moving = asyncio.create_task(w.reconcile())
    await gated.reached.wait()
    return w, gated, moving


async def test_an_nnc_deleted_again_between_a_moves_block_write_and_its_nnc_write() -> None:
    """The worst moment for a move: its block write has landed (the entries carry the new
    object's uid) and the NNC is deleted before its NNC write. That write is refused, the
    entries name an object that is gone, and the next round moves them again, to the object the
    node has then. At no point can the short node get them; they come back under their names."""
    store = Store(random.Random(0))
    async with client.ApiClient() as api:
        held = await held_by_n0(api, store)
        _, gated, moving = await move_held_at(api, store, "nnc-status")
        moved = [e for b in store.of("ipblocks") for e in block_entries(b).values()]
        assert {e.uid for e in moved if e.node == "n0"} == {
            store.get("nodenetworkconfigs", "n0")["metadata"]["uid"]
        }
        store.delete("nodenetworkconfigs", "n0")  # between the block write and the NNC write
        recreate_nnc(store, "n0")
        gated.go.set()
        await moving
        assert listing(store, "n0") == {}  # the NNC write went nowhere
        a = make_controller(api, store, 2, 2)
        for _ in range(3):
            refresh(a, store, random.Random(0), freshness=1.0)
            assert await a.reconcile() == []
    assert listing(store, "n0") == held
    assert not set(held) & set(listing(store, "n1"))
    assert store.moved >= 2 * len(held)


async def test_a_node_deleted_while_a_move_is_in_flight_loses_its_addresses_to_no_one_twice() -> (
    None
):
    """A writer read the NNC (a new object) and the Node (there) and is about to write the move
    when the node leaves for good: its Node and NNC are deleted, another writer frees the
    addresses and grants them to the short node. The stale move's block write is refused (the
    block changed), its NNC write finds no object: the addresses are on one node only."""
    store = Store(random.Random(0))
    async with client.ApiClient() as api:
        held = await held_by_n0(api, store)
        w, gated, moving = await move_held_at(api, store, "ipblocks")
        store.delete("nodes", "n0")
        store.delete("nodenetworkconfigs", "n0")  # the garbage collector
        f = make_controller(api, store, 2, 2)
        for _ in range(3):
            refresh(f, store, random.Random(0), freshness=1.0)
            assert await f.reconcile() == []
        taken = set(held) & set(listing(store, "n1"))
        assert taken, "the gone node's addresses were not granted to the short node"
        gated.go.set()
        assert [type(e) for _, e in await moving] in ([], [ApiException])
    assert w.counters.write_conflicts["ipblock"] >= 1
    recorded = {a: e.node for b in store.of("ipblocks") for a, e in block_entries(b).items()}
    assert {recorded[a] for a in taken} == {"n1"}
    assert "n0" not in recorded.values()
