"""A node taking addresses from several subnets (`spec.subnets`): the wire helpers of
cns/kube/nnc.py, and the controller serving one network container per subnet per node,
on the store with Kubernetes' write rules of tests/unit/controller/test_controller_race.py.

A node is a member of its primary subnet and of each further one, in each subnet's own model
(the member is the pair NNC, subnet): the subnets' rounds must not interfere, in what they
grant or in what they write on the one NNC they share."""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import random
from typing import Any

import structlog.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client

from cns.controller.run import Controller
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, Scaler
from cns.kube.client import KubeClient
from cns.kube.nnc import (
    further_subnets,
    nnc_status_patch,
    request_patch,
    slim_nnc,
    subnet_request,
    subnet_requests,
)
from cns.kube.nnc_containers import network_containers
from cns.kube.scalers import scaler_to_wire
from tests.unit.controller.test_controller_race import (
    NAMESPACE,
    SECOND,
    SUBNET,
    FakeCustomObjects,
    NoFence,
    Store,
    _merge,
    make_controller,
    refresh,
    seed_cluster,
)

PRIMARY_WIRE = {
    "id": "nc-a", "primaryIP": "10.1.0.4", "subnetName": "a", "subnetAddressSpace": "10.1.0.0/24",
    "defaultGateway": "10.1.0.1", "nodeIP": "", "version": 3,
    "ipAssignments": [{"name": "a1", "ip": "10.1.0.5"}, {"name": "a2", "ip": "10.1.0.6"}],
}  # fmt: skip
C_WIRE = {
    "id": "nc-c", "primaryIP": "10.3.0.4", "subnetName": "c", "subnetAddressSpace": "10.3.0.0/24",
    "defaultGateway": "10.3.0.1", "nodeIP": "", "version": 1,
    "ipAssignments": [{"name": "c1", "ip": "10.3.0.5"}],
}  # fmt: skip
B_NC = NetworkContainer(
    id="nc-b", primary_ips=("fd00::4",), subnet="fd00::/120", gateway="fd00::1",
    ip_configs=(IPConfig("b1", "fd00::5"),), version=2, programmed_version=2,
)  # fmt: skip


def nnc(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "n", "resourceVersion": "7", "labels": {"acn.azure.com/subnet": "a"}},
        "spec": {
            "requestedIPCount": 4,
            "ipsNotInUse": ["a2"],
            "subnets": [
                {"name": "b", "requestedIPCount": 8, "requestedIPs": ["fd00::9"]},
                {"name": "c", "ipsNotInUse": ["c1"]},
                {"requestedIPCount": 3},  # no name: no request
                {"name": "b", "requestedIPCount": 99},  # a second entry: the first counts
            ],
        },
        "status": status,
    }


def test_the_requests_of_further_subnets_are_read_by_name_in_order() -> None:
    obj = nnc()
    assert subnet_requests(obj) == {
        "b": PoolRequest(8, (), ("fd00::9",)),
        "c": PoolRequest(0, ("c1",), ()),
    }
    assert subnet_request(obj, "a") == PoolRequest(4, ("a2",), ())  # the spec's own
    assert subnet_request(obj, "b") == PoolRequest(8, (), ("fd00::9",))
    assert subnet_request(obj, "z") == PoolRequest(0)
    assert subnet_requests({"spec": {"subnets": "junk"}}) == {}
    patch = request_patch(PoolRequest(4, ("a2",)), {"b": PoolRequest(8)})
    assert patch["spec"]["subnets"] == [
        {"name": "b", "requestedIPCount": 8, "ipsNotInUse": [], "requestedIPs": []}
    ]
    assert "subnets" not in request_patch(PoolRequest(4))["spec"]


def test_a_node_joins_further_subnets_once_it_holds_its_primary_container() -> None:
    assert further_subnets(nnc()) == ()  # no container yet: the primary one comes first
    assert further_subnets(nnc(networkContainers=[PRIMARY_WIRE])) == ("b", "c")
    # A container held for a subnet no longer asked for keeps the node a member of it.
    held = nnc(networkContainers=[PRIMARY_WIRE, {**C_WIRE, "subnetName": "d"}])
    assert further_subnets(held) == ("d", "b", "c")
    # An entry naming the primary subnet is no further subnet.
    primary_named = nnc(networkContainers=[PRIMARY_WIRE])
    primary_named["spec"]["subnets"] = [{"name": "a", "requestedIPCount": 5}]
    assert further_subnets(primary_named) == ()


def test_a_further_subnet_s_write_keeps_the_other_containers_and_the_primary_s_fields() -> None:
    """Its container goes in its place in the wire order (primary first, then spec.subnets'),
    the others as read, also when read from the slim cache; scaler, assignedIPCount and status
    stay the primary subnet's."""
    read = nnc(
        networkContainers=[PRIMARY_WIRE, C_WIRE],
        scaler={"batchSize": 16},
        assignedIPCount=2,
        status="Updated",
        ipsToRelease=["a1", "c1", "gone"],
    )
    for obj in (read, slim_nnc(copy.deepcopy(read))):
        patch = nnc_status_patch(
            obj, scaler=None, release=["b1"], nc=B_NC, subnet_name="b", subnet_full=True
        )
        assert patch is not None
        written = patch["status"]
        assert set(written) == {"networkContainers", "ipsToRelease"}
        containers = written["networkContainers"]
        assert [c["subnetName"] for c in containers] == ["a", "b", "c"]
        assert containers[0] == PRIMARY_WIRE
        assert containers[1]["id"] == "nc-b" and containers[1]["version"] == 2
        # The other subnets' release requests stay while their containers list them; a name
        # no container lists any more was given up.
        assert written["ipsToRelease"] == ["a1", "b1", "c1"]
        assert patch["metadata"]["resourceVersion"] == "7"


def test_the_primary_subnet_s_write_replaces_only_its_own_release_requests() -> None:
    scaler = Scaler(batch_size=16)
    read = nnc(
        networkContainers=[PRIMARY_WIRE, C_WIRE],
        scaler=scaler_to_wire(scaler),
        ipsToRelease=["a1", "c1"],
    )
    patch = nnc_status_patch(
        read, scaler=scaler, release=[], nc=None, subnet_name="a", subnet_full=False
    )
    assert patch is not None and patch["status"]["ipsToRelease"] == ["c1"]
    assert "networkContainers" not in patch["status"]
    same = nnc_status_patch(
        {**read, "status": {**read["status"], "ipsToRelease": ["c1"]}},
        scaler=scaler,
        release=[],
        nc=None,
        subnet_name="a",
        subnet_full=False,
    )
    assert same is None  # nothing to change


wire_containers = st.lists(
    st.sampled_from(["a", "b", "c", "d"]), unique=True, min_size=1, max_size=4
).map(
    lambda names: [
        {**C_WIRE, "id": f"nc-{n}", "subnetName": n,
         "ipAssignments": [{"name": f"{n}{i}", "ip": f"10.9.{ord(n)}.{i}"} for i in range(3)]}
        for n in names
    ]
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    containers=wire_containers,
    asked=st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), unique=True, max_size=4),
    subnet=st.sampled_from(["a", "b", "c", "d", "e"]),
    release=st.lists(st.sampled_from(["x1", "x2"]), unique=True),
    before=st.lists(st.sampled_from(["a1", "b1", "c2", "d0", "old"]), unique=True),
)
def test_a_write_for_one_subnet_changes_no_other_subnet_s_container_or_requests(
    containers: list[dict[str, Any]],
    asked: list[str],
    subnet: str,
    release: list[str],
    before: list[str],
) -> None:
    read = {
        "metadata": {"name": "n", "resourceVersion": "1"},
        "spec": {"subnets": [{"name": n} for n in asked]},
        "status": {"networkContainers": containers, "ipsToRelease": before},
    }
    nc = NetworkContainer(
        id="new", primary_ips=("10.8.0.4",), subnet="10.8.0.0/24", gateway="10.8.0.1",
        ip_configs=(IPConfig("x1", "10.8.0.5"),), version=9, programmed_version=9,
    )  # fmt: skip
    patch = nnc_status_patch(
        read, scaler=None, release=release, nc=nc, subnet_name=subnet, subnet_full=False
    )
    assert patch is not None
    after = _merge(read, patch)["status"]
    names = [c["subnetName"] for c in after["networkContainers"]]
    assert sorted(names) == sorted({*(c["subnetName"] for c in containers), subnet})
    assert names[0] == containers[0]["subnetName"] or containers[0]["subnetName"] == subnet
    for old in containers:
        if old["subnetName"] != subnet:
            assert old in after["networkContainers"]
    others = {
        a["name"] for c in containers if c["subnetName"] != subnet for a in c["ipAssignments"]
    }
    assert set(after["ipsToRelease"]) == ({*before} & others) | {*release}


# --------------------------------------------------------------------------- the controller


def ask(store: Store, node: str, primary: int, further: int) -> None:
    entry = {"name": SECOND, "requestedIPCount": further, "ipsNotInUse": []}
    spec = {"requestedIPCount": primary, "ipsNotInUse": [], "subnets": [entry]}
    store.patch("nodenetworkconfigs", node, {"spec": spec})


def containers(store: Store, node: str) -> dict[str, NetworkContainer]:
    """The node's containers by subnet name."""
    obj = store.get("nodenetworkconfigs", node)
    wire = (obj.get("status") or {}).get("networkContainers") or ()
    return dict(zip((c["subnetName"] for c in wire), network_containers(obj), strict=True))


async def rounds(controller: Any, store: Store, count: int) -> None:
    for _ in range(count):
        refresh(controller, store, random.Random(0), freshness=1.0)
        assert await controller.reconcile() == []


async def test_both_containers_are_made_in_one_round_with_no_write_refused() -> None:
    """The primary subnet's round creates the node's first container; the further subnet's
    round, later in the same pass, starts from the NNC as written and adds its own. With one
    snapshot for every subnet's round, its write was planned from the version before the
    first and refused (409), and the container waited for the next round."""
    store = Store(random.Random(0))
    seed_cluster(store, 1, "10.60.0.0/26", second_cidr="fd00:60::/120")
    async with client.ApiClient() as api:
        controller = make_controller(api, store, 0, 0)
        await rounds(controller, store, 1)  # places the node, and creates its container
        ask(store, "n0", 4, 6)
        await rounds(controller, store, 1)
        held = containers(store, "n0")
        assert list(held) == [SUBNET, SECOND]
        assert [len(nc.ip_configs) for nc in held.values()] == [4, 6]
        assert all(ipaddress.ip_address(c.address).version == 6 for c in held[SECOND].ip_configs)
        assert dict(controller.counters.write_conflicts) == {}


async def test_a_restarted_controller_holds_the_further_containers_addresses() -> None:
    """A new controller rebuilds from the IPBlocks and the NNCs' statuses: addresses in a
    further container are held (adopted from the container when the record lost them: an
    older cns), never granted to another node."""
    store = Store(random.Random(0))
    seed_cluster(store, 2, "10.61.0.0/26", second_cidr="10.61.1.0/28")
    async with client.ApiClient() as api:
        first = make_controller(api, store, 0, 0)
        await rounds(first, store, 1)
        ask(store, "n0", 1, 8)
        await rounds(first, store, 2)
        held = containers(store, "n0")[SECOND]
        taken = {*held.primary_ips, *(c.address for c in held.ip_configs)}
        assert len(taken) == 9
        for (plural, name), _ in list(store.objects.items()):
            if plural == "ipblocks" and name.startswith(f"{SECOND}-"):
                store.delete(plural, name)
        second = make_controller(api, store, 1, 1)
        store.patch("nodenetworkconfigs", "n1", {"spec": {"requestedIPCount": 5}})
        # n1 is placed in SECOND (pool=b): 13 usable, 9 held by n0
        await rounds(second, store, 3)
    n1 = containers(store, "n1")[SECOND]
    assert not taken & {*n1.primary_ips, *(c.address for c in n1.ip_configs)}
    assert len(n1.ip_configs) == 3  # what was left: 13 - 9 - its primary
    assert containers(store, "n0")[SECOND] == held
    store.check()


def further_grants(seed: int, steps: list[tuple[int, int, int]], exhaust: bool) -> Any:
    """The further subnet's containers after `steps` (n0's, n1's and n2's requests of it; n2
    asks its third of the primary subnet too), with the primary subnet exhausted by n2 or not
    (scarce there: its division draws at random)."""

    async def run() -> Any:
        store = Store(random.Random(seed))
        seed_cluster(store, 3, "10.62.0.0/26", second_cidr="10.62.1.0/27")
        # Every node in the primary subnet: no node has the pool=b label SECOND selects.
        store.put("nodes", {"metadata": {"name": "n1", "uid": "uid-1", "labels": {}}})
        async with client.ApiClient() as api:
            controller = make_controller(api, store, 0, seed)
            await rounds(controller, store, 1)
            for first, second, third in steps:
                ask(store, "n0", 1, first)
                ask(store, "n1", 1, second)
                ask(store, "n2", 70 if exhaust else third, third)
                await rounds(controller, store, 2)
            exhausted = store.get("clustersubnetstates", SUBNET)["status"]["exhausted"]
            assert exhausted == exhaust
        grants = {}
        for node in ("n0", "n1", "n2"):
            nc = containers(store, node).get(SECOND)
            if nc is not None:  # its addresses (the names are random)
                grants[node] = (nc.primary_ips, tuple(c.address for c in nc.ip_configs))
        return grants

    return asyncio.run(run())


@settings(max_examples=15, deadline=None)
@example(seed=3, steps=[(20, 20, 3)])  # a tie the further subnet's division draws for
@given(
    seed=st.integers(0, 2**16),
    steps=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 8)),
        min_size=1,
        max_size=3,
    ),
)
def test_exhaustion_of_one_subnet_never_changes_the_grants_of_another(
    seed: int, steps: list[tuple[int, int, int]]
) -> None:
    """The same requests of the further subnet, the primary subnet exhausted or not: the
    further subnet's containers come out the same, address for address (scarce addresses
    included: each subnet divides with its own random draws)."""
    assert further_grants(seed, steps, exhaust=True) == further_grants(seed, steps, exhaust=False)


async def test_an_entry_for_no_served_subnet_or_the_primary_one_is_said_once() -> None:
    """An entry naming a ClusterSubnet that does not exist gets nothing and is said once (and
    again once it exists); one naming the node's primary subnet is ignored, said once."""
    store = Store(random.Random(0))
    seed_cluster(store, 1, "10.63.0.0/26")
    spec = {
        "requestedIPCount": 2,
        "subnets": [
            {"name": "ghost", "requestedIPCount": 4},
            {"name": SUBNET, "requestedIPCount": 9},
        ],
    }
    async with client.ApiClient() as api:
        controller = make_controller(api, store, 0, 0)
        with structlog.testing.capture_logs() as logs:
            await rounds(controller, store, 1)
            store.patch("nodenetworkconfigs", "n0", {"spec": spec})
            await rounds(controller, store, 3)
            ghost = {"metadata": {"name": "ghost"}, "spec": {"subnet": "10.63.1.0/28"}}
            store.put("clustersubnets", ghost)
            await rounds(controller, store, 2)
    said = [(e["event"], e.get("subnet")) for e in logs if e["event"].startswith("nnc_subnet")]
    assert said == [
        ("nnc_subnet_unknown", "ghost"),
        ("nnc_subnet_entry_ignored", SUBNET),
        ("nnc_subnet_entry_resolved", "ghost"),
    ]
    held = containers(store, "n0")
    assert list(held) == [SUBNET, "ghost"]
    assert [len(nc.ip_configs) for nc in held.values()] == [2, 4]  # the spec's own count


async def test_a_shard_serves_its_subnet_s_container_of_nodes_another_shard_places() -> None:
    """Sharded, each subnet's controller writes its own container on the NNC, whichever shard
    placed the node; only the primary subnet's shard writes the scaler and assignedIPCount."""
    store = Store(random.Random(0))
    seed_cluster(store, 1, "10.64.0.0/26", second_cidr="10.64.1.0/26")
    async with client.ApiClient() as api:
        shards = []
        for index, subnet in enumerate((SUBNET, SECOND)):
            shard = Controller(KubeClient(api), subnet_name=subnet, namespace=NAMESPACE, seed=index)
            shard.kube.custom = FakeCustomObjects(store)  # type: ignore[assignment]
            shard.elector = NoFence()  # type: ignore[assignment]
            shards.append(shard)
        for shard in shards:
            await rounds(shard, store, 1)
        ask(store, "n0", 4, 6)
        seen = []
        for _ in range(2):  # the further subnet's shard first, then the primary one's
            for shard in reversed(shards):
                await rounds(shard, store, 1)
                seen.append([len(nc.ip_configs) for nc in containers(store, "n0").values()])
    assert seen == [[0, 6], [4, 6], [4, 6], [4, 6]]  # neither shard drops the other's
    held = containers(store, "n0")
    assert list(held) == [SUBNET, SECOND]
    assert [len(nc.ip_configs) for nc in held.values()] == [4, 6]
    status = store.get("nodenetworkconfigs", "n0")["status"]
    assert status["assignedIPCount"] == 4
    primary_scaler = store.get("clustersubnets", SUBNET)["status"]["scaler"]
    assert status["scaler"] == primary_scaler


async def test_an_address_asked_for_by_name_in_a_further_subnet_is_granted_there() -> None:
    """A pod's annotation asking for an IPv4 and an IPv6 address reaches the controller as the
    `requestedIPs` of the primary subnet and of the `spec.subnets` entry: each subnet's round
    grants its own by name (the IPv6 one is no lowest-first grant), within the count asked."""
    store = Store(random.Random(0))
    seed_cluster(store, 1, "10.65.0.0/26", second_cidr="fd00:65::/120")
    entry = {"name": SECOND, "requestedIPCount": 2, "requestedIPs": ["fd00:65::c8"]}
    spec = {"requestedIPCount": 2, "requestedIPs": ["10.65.0.40"], "subnets": [entry]}
    async with client.ApiClient() as api:
        controller = make_controller(api, store, 0, 0)
        await rounds(controller, store, 1)
        store.patch("nodenetworkconfigs", "n0", {"spec": spec})
        await rounds(controller, store, 1)
    held = containers(store, "n0")
    assert list(held) == [SUBNET, SECOND]
    four = [c.address for c in held[SUBNET].ip_configs]
    six = [c.address for c in held[SECOND].ip_configs]
    assert "10.65.0.40" in four and "fd00:65::c8" in six
    assert (len(four), len(six)) == (2, 2)  # the one asked for by name is within the count
    store.check()
