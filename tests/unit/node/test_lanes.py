"""Lanes: a node holding IPs of several subnets, a pod getting one IP of each in one ADD.

NodeIPAM with a MemorySource and a real SQLite store, as in tests/unit/node/test_node_service.py:
the primary subnet `v4pods` (10.1.0.0/24) and a further subnet `v6pods` (fd00::/64). The promise
under test: an ADD that names both gets both or neither (also when its commit fails), no IP is ever
held by two owners in any lane, and each lane plans its own request.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cns.commands.status import render_pool
from cns.core.pool import Pool
from cns.core.types import IPConfig, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.node.control_plane import FurtherSubnetState, MemorySource, SourceState
from cns.node.errors import IPAMError
from cns.node.service import AddResult, NodeIPAM
from cns.state.store import Store
from cns.web import views
from cns.web.api import add_reply, http_status
from cns.web.node_metrics import Metrics

HOUR = 3600.0
SURROGATE = "\ud800"  # text SQLite cannot store: the commit of its record is refused
BOTH = ("v4pods", "v6pods")


def v4(numbers: Iterable[int], version: int = 1) -> NetworkContainer:
    configs = tuple(IPConfig(f"ip-{n}", f"10.1.0.{n}", version) for n in numbers)
    return NetworkContainer(
        "nc4", ("10.1.0.2",), "10.1.0.0/24", "10.1.0.1", configs, version, version, "v4pods"
    )


def v6(numbers: Iterable[int], version: int = 1) -> NetworkContainer:
    configs = tuple(IPConfig(f"ip6-{n}", f"fd00::{n:x}", version) for n in numbers)
    return NetworkContainer(
        "nc6", ("fd00::2",), "fd00::/64", "fd00::1", configs, version, version, "v6pods"
    )


def state(four: NetworkContainer, six: NetworkContainer | None) -> SourceState:
    subnets = {"v6pods": FurtherSubnetState((six,))} if six is not None else {}
    return SourceState((four,), subnets=subnets)


def make(path: Path, st_: SourceState, timeout: float = HOUR) -> NodeIPAM:
    store = Store(path)
    store.open()
    ipam = NodeIPAM(Pool(), store, MemorySource(st_), Scaler(), timeout)
    ipam.on_state(st_)
    return ipam


def restarted(path: Path, st_: SourceState, timeout: float = HOUR) -> NodeIPAM:
    """A node started on an existing state file, as the daemon starts one."""
    store = Store(path)
    pool = Pool()
    for assignment in store.open():
        if not assignment.subnet:
            pool.restore(assignment)
    ipam = NodeIPAM(pool, store, MemorySource(st_), Scaler(), timeout)
    ipam.on_state(st_)
    return ipam


def in_memory(ipam: NodeIPAM) -> dict[str, tuple[str, str, str]]:
    return {
        a.ip_id: (a.owner.container_id, a.address, a.subnet)
        for lane in ipam.lanes.values()
        for a in lane.pool.assignments()
    }


def on_disk(ipam: NodeIPAM) -> dict[str, tuple[str, str, str]]:
    return {
        i: (a.owner.container_id, a.address, a.subnet) for i, a in ipam.store.assignments.items()
    }


async def turns_until(condition: object) -> None:
    for _ in range(1000):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_a_dual_add_gets_one_ip_of_each_subnet_in_one_commit(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    commits = ipam.store.commits
    result = await ipam.add(Owner("c1", "eth0", "web", "shop"), subnets=BOTH)
    assert [r.address for r, _ in result.ips] == ["10.1.0.10", "fd00::10"]
    assert [nc.subnet for _, nc in result.ips] == ["10.1.0.0/24", "fd00::/64"]
    assert ipam.store.commits == commits + 1
    assert (
        on_disk(ipam)
        == in_memory(ipam)
        == {
            "ip-10": ("c1", "10.1.0.10", ""),
            "ip6-16": ("c1", "fd00::10", "v6pods"),
        }
    )
    reply = add_reply(result)
    assert reply["ips"] == [
        {"address": "10.1.0.10/24", "gateway": "10.1.0.1"},
        {"address": "fd00::10/64", "gateway": "fd00::1"},
    ]
    assert reply["routes"] == [
        {"dst": "0.0.0.0/0", "gw": "10.1.0.1"},
        {"dst": "::/0", "gw": "fd00::1"},
    ]
    again = await ipam.add(Owner("c1", "eth0", "web", "shop"), subnets=BOTH)
    assert again.ips == result.ips  # idempotent
    assert [r.address for r in ipam.check(OwnerKey("c1", "eth0"), ["10.1.0.10", "fd00::10"])]
    with pytest.raises(IPAMError) as wrong:
        ipam.check(OwnerKey("c1", "eth0"), ["10.1.0.10"])
    assert wrong.value.code == 104 and "fd00::10" in wrong.value.msg
    # The primary subnet named or not named: the same lane.
    single = await ipam.add(Owner("c2", "eth0"))
    assert single.record.address == "10.1.0.11"
    released = await ipam.delete(OwnerKey("c1", "eth0"))
    assert released is not None and on_disk(ipam) == in_memory(ipam) == {
        "ip-11": ("c2", "10.1.0.11", "")
    }
    ipam.store.close()


async def test_a_dual_add_waits_without_holding_the_other_lanes_ip(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(())))
    add = asyncio.create_task(ipam.add(Owner("c1", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    assert ipam.pool.available_count() == 4 and in_memory(ipam) == {}
    assert (ipam.demand(""), ipam.demand("v6pods")) == (1, 1)
    # A v4-only ADD meanwhile is served from the free v4 IPs.
    assert (await ipam.add(Owner("c2", "eth0"))).record.address == "10.1.0.10"
    assert await ipam.reconcile_once() == PoolRequest(15)
    source = ipam.source
    assert isinstance(source, MemorySource)
    assert source.published_subnets[-1] == {"v6pods": PoolRequest(15)}
    ipam.on_state(state(v4(range(10, 14)), v6(range(16, 31))))
    result = await add
    assert [r.address for r, _ in result.ips] == ["10.1.0.11", "fd00::10"]
    assert await ipam.reconcile_once() is None  # nothing changed in any lane
    ipam.store.close()


async def test_an_add_for_a_subnet_the_node_has_not_got_publishes_its_demand_then_fails(
    tmp_path: Path,
) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), None), timeout=0.05)
    add = asyncio.create_task(ipam.add(Owner("c1", "eth0"), subnets=("v4pods", "v6extra")))
    await turns_until(lambda: ipam.waiting_count("v6extra") == 1)
    await ipam.reconcile_once()
    source = ipam.source
    assert isinstance(source, MemorySource)
    assert source.published_subnets[-1] == {"v6extra": PoolRequest(16)}
    with pytest.raises(IPAMError) as failed:
        await add
    assert (http_status(failed.value), failed.value.code) == (503, 11)
    assert "subnet v6extra" in failed.value.msg and "no network container" in failed.value.msg
    assert in_memory(ipam) == on_disk(ipam) == {}
    await ipam.reconcile_once()  # nobody wants it any more: no longer asked for
    assert source.published_subnets[-1] == {} and "v6extra" not in ipam.lanes
    ipam.store.close()


async def test_pods_choosing_a_subnet_the_node_has_not_got_ask_for_it_ahead_of_their_adds(
    tmp_path: Path,
) -> None:
    """The pod watch's demand of a further subnet (Kubernetes mode, the pods' annotations)
    comes as a FurtherSubnetState without containers: the node plans and publishes that lane before
    any ADD, keeps the demand of a held lane, and drops both once no pod chooses them."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    source = ipam.source
    assert isinstance(source, MemorySource)
    chosen = {"v6pods": FurtherSubnetState((v6(range(16, 20)),), pod_demand=20)}
    ipam.on_state(
        SourceState(
            (v4(range(10, 14)),), subnets={**chosen, "blue": FurtherSubnetState(pod_demand=5)}
        )
    )
    assert (ipam.demand("v6pods"), ipam.demand("blue")) == (20, 5)
    await ipam.reconcile_once()
    # B * ceil(mf + U/B) - P: v6pods 16 * 2 - 1 (its primary IP), blue 16 * 1 - 0 (no NC yet)
    assert source.published_subnets[-1] == {"v6pods": PoolRequest(31), "blue": PoolRequest(16)}
    ipam.on_state(state(v4(range(10, 14)), v6(range(16, 20))))  # the pods went away
    assert (ipam.demand("v6pods"), ipam.demand("blue")) == (0, 0)
    await ipam.reconcile_once()
    assert source.published_subnets[-1] == {"v6pods": PoolRequest(15)}
    assert "blue" not in ipam.lanes and "v6pods" in ipam.lanes
    ipam.store.close()


async def test_a_dual_add_whose_commit_is_refused_leaves_neither_ip(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    with pytest.raises(IPAMError) as refused:
        await ipam.add(Owner("c1", "eth0", SURROGATE, "shop"), subnets=BOTH)
    assert refused.value.code == 7
    assert in_memory(ipam) == on_disk(ipam) == {}
    assert (ipam.pool.available_count(), ipam.lanes["v6pods"].pool.available_count()) == (4, 4)
    ipam.store.close()


async def test_a_dual_add_whose_transaction_fails_leaves_neither_ip_and_storage_recovers(
    tmp_path: Path,
) -> None:
    """The state file cannot be written (its connection is gone): nothing of the ADD stays in
    memory; the next commit reopens the file and the same ADD gets both IPs."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    db = ipam.store._db
    assert db is not None
    db.close()
    ipam.store._db = None
    with pytest.raises(IPAMError) as failed:
        await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    assert (http_status(failed.value), failed.value.code) == (503, 5)
    assert in_memory(ipam) == on_disk(ipam) == {}
    result = await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    assert len(result.ips) == 2 and in_memory(ipam) == on_disk(ipam)
    ipam.store.close()


async def test_a_del_frees_the_ip_a_waiting_dual_add_lacks(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6([16])))
    await ipam.add(Owner("c1", "eth0"), subnets=("v6pods",))
    waiting = asyncio.create_task(ipam.add(Owner("c2", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    assert ipam.waiting_count("") == 1 and not waiting.done()
    await ipam.delete(OwnerKey("c1", "eth0"))
    result = await waiting
    assert [r.address for r, _ in result.ips] == ["10.1.0.10", "fd00::10"]
    assert in_memory(ipam) == on_disk(ipam)
    ipam.store.close()


async def test_gc_and_the_leak_inputs_cover_every_lane(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    await ipam.add(Owner("c2", "eth0"), subnets=("v6pods",))
    held, _ = ipam.leak_inputs()
    assert sorted(h.address for h in held) == ["10.1.0.10", "fd00::10", "fd00::11"]
    assert sorted(await ipam.gc({OwnerKey("c2", "eth0")})) == ["10.1.0.10", "fd00::10"]
    assert on_disk(ipam) == in_memory(ipam) == {"ip6-17": ("c2", "fd00::11", "v6pods")}
    ipam.store.close()


async def test_a_restart_restores_every_lane_from_the_state_file(tmp_path: Path) -> None:
    st_ = state(v4(range(10, 14)), v6(range(16, 20)))
    ipam = make(tmp_path / "s.db", st_)
    await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    ipam.store.close()
    again = restarted(tmp_path / "s.db", st_)
    assert in_memory(again) == on_disk(again) == in_memory(ipam)
    again.store.close()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["dual", "v4", "v6", "del", "bad-dual", "asked-dual"]),
        st.integers(min_value=0, max_value=5),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS)
# A DEL of an attachment whose ADD waits: that ADD used to end cancelled, with no CNI error.
@example(ops=[("dual", 0), ("dual", 2), ("dual", 3), ("dual", 1), ("del", 1)])
def test_no_ip_is_held_twice_and_a_dual_add_is_all_or_nothing(
    ops: list[tuple[str, int]],
) -> None:
    """Random ADDs (dual, single, with a record the store refuses, dual asking for an address
    of each family), DELs, run concurrently in small groups: memory always equals the disk, no
    address has two owners, an owner holds at most one IP per lane, and a dual ADD that
    succeeded holds both (the asked-for ones if it asked) while one that failed added
    nothing."""
    asyncio.run(_run_ops(ops))


async def _run_ops(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        ipam = make(Path(directory) / "s.db", state(v4(range(10, 14)), v6(range(16, 19))), 0.0)
        try:
            for start in range(0, len(ops), 3):
                group = ops[start : start + 3]
                before = in_memory(ipam)
                results = await asyncio.gather(
                    *(_op(ipam, kind, n) for kind, n in group), return_exceptions=True
                )
                await ipam.store.flush()
                memory = in_memory(ipam)
                assert memory == on_disk(ipam)
                addresses = [address for _, address, _ in memory.values()]
                assert len(addresses) == len(set(addresses))
                lanes = [(owner, lane) for owner, _, lane in memory.values()]
                assert len(lanes) == len(set(lanes))
                for (kind, n), result in zip(group, results, strict=True):
                    held = {lane for owner, _, lane in memory.values() if owner == f"c{n}"}
                    if kind == "dual" and not isinstance(result, BaseException):
                        assert held >= {"", "v6pods"} or any(k == "del" for k, _ in group)
                    alone = sum(1 for _, m in group if m == n) == 1
                    if kind == "asked-dual" and not isinstance(result, BaseException):
                        got = {a for owner, a, _ in memory.values() if owner == f"c{n}"}
                        assert got == set(_asked(n)) or any(k == "del" for k, _ in group)
                    if kind == "bad-dual":
                        assert isinstance(result, IPAMError)
                    if kind in ("bad-dual", "asked-dual") and isinstance(result, BaseException):
                        was = {lane for owner, _, lane in before.values() if owner == f"c{n}"}
                        assert held == was or not alone
                    if isinstance(result, BaseException):
                        assert isinstance(result, IPAMError), result
        finally:
            ipam.store.close()


async def _op(ipam: NodeIPAM, kind: str, n: int) -> object:
    if kind == "del":
        return await ipam.delete(OwnerKey(f"c{n}", "eth0"))
    pod = SURROGATE if kind == "bad-dual" else f"p{n}"
    subnets = {"dual": BOTH, "bad-dual": BOTH, "asked-dual": BOTH, "v4": (), "v6": ("v6pods",)}
    asked = ",".join(_asked(n)) if kind == "asked-dual" else ""
    return await ipam.add(Owner(f"c{n}", "eth0", pod, "ns"), asked, subnets[kind])


def _asked(n: int) -> tuple[str, str]:
    """The pair an `asked-dual` ADD of owner c{n} asks for (owners share some)."""
    return f"10.1.0.{10 + n % 4}", f"fd00::{16 + n % 3:x}"


async def test_debug_pool_metrics_and_status_show_every_lane(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    await ipam.add(Owner("c1", "eth0", "web", "shop"), subnets=BOTH)
    await ipam.reconcile_once()
    pool = views.pool_view(ipam)
    assert pool["subnet"] == "v4pods" and list(pool["subnets"]) == ["v6pods"]
    six = pool["subnets"]["v6pods"]
    assert (six["demand"], six["requestedIPCount"], six["ips"]["Assigned"]) == (1, 15, 1)
    assert six["networkContainers"][0]["subnet"] == "fd00::/64"
    rows = views.pod_view(ipam, "shop/web")["ips"]
    assert [(r["address"], r.get("subnet")) for r in rows] == [
        ("10.1.0.10", None),
        ("fd00::10", "v6pods"),
    ]
    metrics = Metrics()
    metrics.watch(ipam)
    samples = {
        (s.name, s.labels.get("subnet"), s.labels.get("state")): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    assert samples[("cns_demand", None, None)] == 1  # the primary's, unlabelled as before
    assert samples[("cns_lane_demand", "v4pods", None)] == 1
    assert samples[("cns_lane_requested_ip_count", "v6pods", None)] == 15
    assert samples[("cns_lane_pool_ips", "v6pods", "Assigned")] == 1
    assert samples[("cns_lane_pool_ips", "v6pods", "Available")] == 3
    text = render_pool(pool)
    assert "SUBNET" in text and "v6pods" in text and "v4pods" in text
    ipam.store.close()


async def test_a_release_request_of_the_control_plane_reaches_every_lane(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    held = await ipam.add(Owner("c1", "eth0"), subnets=("v6pods",))
    asked = replace(
        state(v4(range(10, 14)), v6(range(16, 20))), release_requests=("ip6-16", "ip6-17")
    )
    ipam.on_state(asked)
    six = ipam.lanes["v6pods"].pool
    assert held.record.id == "ip6-16" and six.records["ip6-16"].owner is not None  # in use: kept
    assert six.ips_not_in_use() == ("ip6-17",)
    assert ipam.inconsistencies_total == 1
    ipam.store.close()


async def test_each_lane_has_its_own_release_handshake(tmp_path: Path) -> None:
    """The IPv6 lane holds 40 free IPs and no pod: it asks for 15 and gives 25 back through its
    own ipsNotInUse, which the control plane drops; the primary lane is not touched."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 25)), v6(range(16, 56))))
    await ipam.reconcile_once()
    source = ipam.source
    assert isinstance(source, MemorySource)
    assert source.published[-1] == PoolRequest(15)
    six = source.published_subnets[-1]["v6pods"]
    assert six.requested_ip_count == 15 and len(six.ips_not_in_use) == 25
    kept = [n for n in range(16, 56) if f"ip6-{n}" not in six.ips_not_in_use]
    answered = SourceState(
        (v4(range(10, 25)),),
        request=source.published[-1],
        subnets={"v6pods": FurtherSubnetState((v6(kept, version=2),), request=six)},
    )
    ipam.on_state(answered)
    lane = ipam.lanes["v6pods"].pool
    assert (lane.held_count(), len(lane.records), lane.ips_not_in_use()) == (15, 15, ())
    assert ipam.pool.held_count() == 15
    await ipam.reconcile_once()
    assert source.published_subnets[-1]["v6pods"] == PoolRequest(15)
    assert await ipam.reconcile_once() is None  # settled: nothing more to say
    ipam.store.close()


async def test_the_pod_view_explains_the_subnet_a_waiting_dual_add_lacks(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(())))
    waiting = asyncio.create_task(ipam.add(Owner("c1", "eth0", "web", "shop"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    view = views.pod_view(ipam, "shop/web")
    assert view["state"] == "waiting"
    assert (view["reason"]["code"], view["reason"]["subnet"]) == ("allocation-pending", "v6pods")
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    ipam.store.close()


async def test_a_further_lanes_cooldown_ends_like_the_primarys(tmp_path: Path) -> None:
    """Cooldowns end in every lane: before, only the primary pool's were expired, so an IPv6
    address given back under `ipCooldownSeconds` never became free again."""
    store = Store(tmp_path / "s.db")
    store.open()
    st_ = state(v4(range(10, 12)), v6(range(16, 18)))
    ipam = NodeIPAM(Pool(), store, MemorySource(st_), Scaler(), HOUR, cooldown_seconds=0.05)
    ipam.on_state(st_)
    await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    await ipam.delete(OwnerKey("c1", "eth0"))
    six = ipam.lanes["v6pods"].pool
    assert (ipam.pool.cooling_count(), six.cooling_count()) == (1, 1)
    await asyncio.sleep(0.1)
    ipam.end_cooldowns()
    assert (ipam.pool.cooling_count(), six.cooling_count()) == (0, 0)
    assert (ipam.pool.available_count(), six.available_count()) == (2, 2)
    store.close()


# --------------------------------------------------------------------- requested addresses


def held(ipam: NodeIPAM) -> dict[str, tuple[str, str, str]]:
    """What the node holds, the same in memory and on disk."""
    memory = in_memory(ipam)
    assert memory == on_disk(ipam)
    return memory


async def test_a_dual_add_gets_the_requested_pair_in_one_commit(tmp_path: Path) -> None:
    """`requestedIP` with one address per family: each lane gives the one its subnet holds,
    in one commit; with one address, its lane gives it and the other any free IP."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    commits = ipam.store.commits
    result = await ipam.add(Owner("c1", "eth0"), "fd00::12,10.1.0.12", BOTH)
    assert [r.address for r, _ in result.ips] == ["10.1.0.12", "fd00::12"]
    assert ipam.store.commits == commits + 1
    again = await ipam.add(Owner("c1", "eth0"), "10.1.0.12,fd00::12", BOTH)
    assert again.ips == result.ips  # idempotent
    one = await ipam.add(Owner("c2", "eth0"), "fd00::13", BOTH)
    assert [r.address for r, _ in one.ips] == ["10.1.0.10", "fd00::13"]
    further = await ipam.add(Owner("c3", "eth0"), "fd00::11", ("v6pods",))
    assert [r.address for r, _ in further.ips] == ["fd00::11"]
    assert held(ipam) == {
        "ip-12": ("c1", "10.1.0.12", ""),
        "ip6-18": ("c1", "fd00::12", "v6pods"),
        "ip-10": ("c2", "10.1.0.10", ""),
        "ip6-19": ("c2", "fd00::13", "v6pods"),
        "ip6-17": ("c3", "fd00::11", "v6pods"),
    }
    ipam.store.close()


@pytest.mark.parametrize(
    ("requested", "subnets", "said"),
    [
        ("10.1.0.12,10.1.0.13", BOTH, "requestedIP: 10.1.0.12 and 10.1.0.13 are both IPv4"),
        ("10.1.0.12,fd00::12,fd00::13", BOTH, "requestedIP: more than two addresses"),
        ("10.1.0.12,banana", BOTH, "requestedIP: 'banana' is not an IP address"),
        ("10.1.0.12,", BOTH, "requestedIP: '' is not an IP address"),
        ("10.1.0.12,fd00::12", ("v6pods",), "requestedIP: 2 addresses (10.1.0.12, fd00::12)"),
        ("10.1.0.12,fd00::12", (), "for 1 subnet (the primary subnet)"),
        ("10.9.0.1,fd00::12", BOTH, "10.9.0.1 is in none of the subnets the ADD names"),
        (
            "10.1.0.12",
            ("v6pods",),
            "requestedIP: 10.1.0.12 is in subnet v4pods, which the ADD does not name "
            "(it names v6pods)",
        ),
        ("fd00::12", (), "fd00::12 is in subnet v6pods, which the ADD does not name"),
    ],
)
async def test_requested_addresses_that_do_not_fit_the_subnets_are_code_7(
    tmp_path: Path, requested: str, subnets: tuple[str, ...], said: str
) -> None:
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    with pytest.raises(IPAMError) as wrong:
        await ipam.add(Owner("c1", "eth0"), requested, subnets)
    assert (http_status(wrong.value), wrong.value.code) == (400, 7)
    assert said in wrong.value.msg, wrong.value.msg
    assert in_memory(ipam) == on_disk(ipam) == {} and not ipam.waiters
    ipam.store.close()


async def test_a_requested_address_not_to_be_had_takes_no_ip_of_any_lane(tmp_path: Path) -> None:
    """Code 11 naming the address and why, at once; the other lane's free IP is not taken."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    await ipam.add(Owner("c1", "eth0", "web-1", "shop"), "fd00::12", ("v6pods",))
    for requested, why in [
        ("10.1.0.12,fd00::12", "requested address fd00::12 cannot be assigned: fd00::12 is "
         "assigned to pod shop/web-1"),
        ("fd00::99", "requested address fd00::99 cannot be assigned: fd00::99 is not in this "
         "node's pool"),
    ]:  # fmt: skip
        with pytest.raises(IPAMError) as refused:
            await ipam.add(Owner("c2", "eth0"), requested, BOTH)
        assert (http_status(refused.value), refused.value.code) == (503, 11)
        assert refused.value.msg == why
    assert held(ipam) == {"ip6-18": ("c1", "fd00::12", "v6pods")}
    assert ipam.pool.available_count() == 4
    ipam.store.close()


async def test_a_requested_address_waits_only_for_the_other_lanes_free_ip(tmp_path: Path) -> None:
    """The requested IPv4 address is free, the IPv6 lane has none: the ADD waits holding
    neither, and gets both once an IPv6 address comes. Should its address be taken meanwhile,
    it fails with code 11 saying so (the runtime's address is not waited for) the next time
    the waiters are served, or at addTimeoutSeconds."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(())))
    first = asyncio.create_task(ipam.add(Owner("c1", "eth0"), "10.1.0.13", BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    assert in_memory(ipam) == {}
    ipam.on_state(state(v4(range(10, 14)), v6([16])))
    assert [r.address for r, _ in (await first).ips] == ["10.1.0.13", "fd00::10"]
    second = asyncio.create_task(ipam.add(Owner("c2", "eth0"), "10.1.0.12", BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    await ipam.add(Owner("c3", "eth0"), "10.1.0.12")
    ipam.on_state(state(v4(range(10, 14)), v6([16, 17])))
    with pytest.raises(IPAMError) as taken:
        await second
    assert taken.value.code == 11 and "10.1.0.12 is assigned to container c3" in taken.value.msg
    ipam.add_timeout_seconds = 0.05
    await ipam.add(Owner("c6", "eth0"), subnets=("v6pods",))  # the last free IPv6 address
    third = asyncio.create_task(ipam.add(Owner("c4", "eth0"), "10.1.0.11", BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    await ipam.add(Owner("c5", "eth0"), "10.1.0.11")
    with pytest.raises(IPAMError) as late:
        await third
    assert late.value.code == 11 and "10.1.0.11 is assigned to container c5" in late.value.msg
    assert not ipam.waiters
    assert held(ipam) == {
        "ip-13": ("c1", "10.1.0.13", ""),
        "ip6-16": ("c1", "fd00::10", "v6pods"),
        "ip-12": ("c3", "10.1.0.12", ""),
        "ip-11": ("c5", "10.1.0.11", ""),
        "ip6-17": ("c6", "fd00::11", "v6pods"),
    }
    ipam.store.close()


async def test_a_requested_address_of_a_lane_without_a_container_is_code_11(
    tmp_path: Path,
) -> None:
    """Which subnet holds the address is not known before the lane's container comes."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), None))
    with pytest.raises(IPAMError) as unknown:
        await ipam.add(Owner("c1", "eth0"), "fd00::12", ("v4pods", "v6extra"))
    assert unknown.value.code == 11
    assert unknown.value.msg == (
        "requested address fd00::12 cannot be assigned: the node has no network container of "
        "subnet v6extra yet, so which subnet fd00::12 is in is not known"
    )
    assert in_memory(ipam) == {}
    ipam.store.close()


async def test_an_annotated_pair_is_asked_of_each_lane_and_waited_for(tmp_path: Path) -> None:
    """Kubernetes mode: the pod's annotation asks for an IPv4 and an IPv6 address the node has
    not got. Each lane asks the control plane for its own (`requestedIPs` of the primary
    subnet and of the `v6pods` entry); the ADD waits holding nothing, and gets both when they
    come."""
    pair = {"db/db-0": "10.1.0.40,fd00::40"}
    ipam = make(tmp_path / "s.db", replace(state(v4(range(10, 14)), v6(range(16, 20))),
                                           pod_addresses=pair))  # fmt: skip
    source = ipam.source
    assert isinstance(source, MemorySource)
    add = asyncio.create_task(ipam.add(Owner("c1", "eth0", "db-0", "db"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    await ipam.reconcile_once()
    assert source.published[-1].requested_ips == ("10.1.0.40",)
    assert source.published_subnets[-1]["v6pods"].requested_ips == ("fd00::40",)
    assert in_memory(ipam) == {}
    brought = state(v4([*range(10, 14), 40]), v6([*range(16, 20), 64]))
    ipam.on_state(replace(brought, pod_addresses=pair))
    assert [r.address for r, _ in (await add).ips] == ["10.1.0.40", "fd00::40"]
    await ipam.reconcile_once()
    assert source.published[-1].requested_ips == ()
    assert source.published_subnets[-1]["v6pods"].requested_ips == ()
    ipam.store.close()


async def test_an_annotated_ipv6_address_is_not_asked_of_the_ipv4_subnet(tmp_path: Path) -> None:
    """Before the IPv6 lane's container comes, no lane's prefix holds the address: it is not
    asked of the primary (IPv4) subnet, and the ADD says why it waited."""
    pods = {"db/db-0": "fd00::40"}
    ipam = make(tmp_path / "s.db", replace(state(v4(range(10, 14)), None), pod_addresses=pods),
                timeout=0.05)  # fmt: skip
    source = ipam.source
    assert isinstance(source, MemorySource)
    with pytest.raises(IPAMError) as late:
        await ipam.add(Owner("c1", "eth0", "db-0", "db"), subnets=("v4pods", "v6extra"))
    assert late.value.code == 11
    assert "the address pod db/db-0 asks for in its annotation (fd00::40) did not come" in (
        late.value.msg
    )
    assert "no network container of subnet v6extra" in late.value.msg
    await ipam.reconcile_once()
    assert source.published[-1].requested_ips == ()
    ipam.store.close()


async def test_an_annotation_naming_a_subnet_the_add_does_not_is_code_7(tmp_path: Path) -> None:
    pods = {"db/db-0": "10.1.0.12,fd00::12"}
    ipam = make(tmp_path / "s.db", replace(state(v4(range(10, 14)), v6(range(16, 20))),
                                           pod_addresses=pods))  # fmt: skip
    with pytest.raises(IPAMError) as wrong:
        await ipam.add(Owner("c1", "eth0", "db-0", "db"), subnets=("v6pods",))
    assert wrong.value.code == 7
    assert wrong.value.msg.startswith("annotation acn.azure.com/ip-address of pod db/db-0: ")
    assert "2 addresses" in wrong.value.msg
    ipam.store.close()


async def test_a_del_of_an_attachment_whose_add_waits_fails_that_add_with_a_cni_error(
    tmp_path: Path,
) -> None:
    """The waiting ADD ends with a CNI error (code 11, saying why), not a CancelledError that
    the socket API cannot turn into one (the state machine below found it)."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(())))
    waiting = asyncio.create_task(ipam.add(Owner("c1", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    await ipam.delete(OwnerKey("c1", "eth0"))
    with pytest.raises(IPAMError) as given_up:
        await waiting
    assert (http_status(given_up.value), given_up.value.code) == (409, 11)
    assert given_up.value.msg == (
        "container c1 interface eth0 was released (cni-del) while its ADD waited for an IP"
    )
    assert in_memory(ipam) == on_disk(ipam) == {} and not ipam.waiters


async def test_a_dual_add_keeps_its_place_in_each_lanes_queue(tmp_path: Path) -> None:
    """Both lanes full, a dual ADD waits. The IPv4 address a DEL frees is kept for it: a later
    IPv4-only ADD waits behind it instead of taking it (before, every such ADD passed it and it
    starved). Another lane's ADDs are held up only by the one address the dual ADD needs."""
    ipam = make(tmp_path / "s.db", state(v4([10]), v6([16, 17, 18])))
    await ipam.add(Owner("h4", "eth0"))
    await ipam.add(Owner("h6", "eth0"), subnets=("v6pods",))
    await ipam.add(Owner("h6b", "eth0"), subnets=("v6pods",))
    dual = asyncio.create_task(ipam.add(Owner("d", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("") == 1)
    # One IPv6 address is free, and it is the dual ADD's: a v6-only ADD waits for another.
    six = asyncio.create_task(ipam.add(Owner("s6", "eth0"), subnets=("v6pods",)))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 2)
    await ipam.delete(OwnerKey("h4", "eth0"))
    await turns_until(dual.done)
    assert [r.address for r, _ in dual.result().ips] == ["10.1.0.10", "fd00::12"]
    assert not six.done()
    await ipam.delete(OwnerKey("h6", "eth0"))
    assert (await six).record.address == "fd00::10"

    # The dual ADD holds both lanes' last IPs; another dual ADD waits, then an IPv6 IP frees.
    later = asyncio.create_task(ipam.add(Owner("d2", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("") == 1)
    await ipam.delete(OwnerKey("h6b", "eth0"))
    four = asyncio.create_task(ipam.add(Owner("s4", "eth0")))
    await turns_until(lambda: ipam.waiting_count("") == 2)
    await ipam.delete(OwnerKey("d", "eth0"))  # frees one of each: the first in line gets them
    await turns_until(later.done)
    assert not four.done() and {a for _, a, _ in in_memory(ipam).values()} >= {"10.1.0.10"}
    assert in_memory(ipam) == on_disk(ipam)
    four.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await four
    ipam.store.close()


FAIR_OPS = st.lists(
    st.tuples(st.sampled_from(["dual", "v4", "v6", "del"]), st.integers(0, 20)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=FAIR_OPS)
def test_no_waiter_starves_while_addresses_keep_freeing(ops: list[tuple[str, int]]) -> None:
    """Two small full-ish lanes, ADDs of every kind arriving and DELs freeing addresses at
    random. A waiting ADD is served once, for each lane it lacks, more addresses of that lane
    have been freed since it queued than ADDs ahead of it were waiting for one: later ADDs
    never take what it waits for. No address is held twice, memory equals the disk, and an ADD
    is served all or nothing."""
    asyncio.run(_run_fair(ops))


async def _run_fair(ops: list[tuple[str, int]]) -> None:
    lanes_of = {"dual": ("", "v6pods"), "v4": ("",), "v6": ("v6pods",)}
    with tempfile.TemporaryDirectory() as directory:
        ipam = make(Path(directory) / "s.db", state(v4([10, 11]), v6([16, 17])))
        # Per pending ADD: its lanes, the ADDs ahead of it waiting for each, the frees since.
        pending: dict[str, tuple[asyncio.Task[object], tuple[str, ...], dict[str, int]]] = {}
        ahead: dict[str, dict[str, int]] = {}
        served: dict[str, tuple[str, ...]] = {}
        try:
            for step, (kind, n) in enumerate(ops):
                if kind == "del":
                    holders = sorted(served)
                    if not holders:
                        continue
                    name = holders[n % len(holders)]
                    await ipam.delete(OwnerKey(name, "eth0"))
                    for _, _, frees in pending.values():
                        for lane in served[name]:
                            frees[lane] = frees.get(lane, 0) + 1
                    del served[name]
                else:
                    name = f"a{step}"
                    subnets = tuple(
                        ("v4pods", "v6pods")[lanes_of["dual"].index(k)] for k in lanes_of[kind]
                    )
                    task = asyncio.create_task(ipam.add(Owner(name, "eth0"), subnets=subnets))
                    ahead[name] = {
                        lane: sum(1 for _, ls, _ in pending.values() if lane in ls)
                        for lane in lanes_of[kind]
                    }
                    pending[name] = (task, lanes_of[kind], {})
                for _ in range(20):
                    await asyncio.sleep(0)
                await ipam.store.flush()
                for waiter, (task, lanes, frees) in list(pending.items()):
                    if task.done():
                        result = task.result()
                        assert isinstance(result, AddResult) and len(result.ips) == len(lanes)
                        served[waiter] = lanes
                        del pending[waiter]
                        continue
                    due = all(frees.get(lane, 0) > ahead[waiter][lane] for lane in lanes)
                    assert not due, f"{waiter} ({lanes}) starves: {frees} vs {ahead[waiter]}"
                memory = in_memory(ipam)
                assert memory == on_disk(ipam)
                addresses = [address for _, address, _ in memory.values()]
                assert len(addresses) == len(set(addresses))
                held: dict[str, set[str]] = {}
                for owner, _, lane in memory.values():
                    assert lane not in held.setdefault(owner, set())
                    held[owner].add(lane)
                assert all(held.get(w) is None for w in pending)  # a waiter holds nothing
                assert all(held[w] == set(lanes) for w, lanes in served.items())
        finally:
            for task, _, _ in pending.values():
                task.cancel()
            await asyncio.gather(*(t for t, _, _ in pending.values()), return_exceptions=True)
            ipam.store.close()


async def test_a_subnet_no_longer_listed_drains_its_pods_keep_their_ips(tmp_path: Path) -> None:
    """The control plane stops listing the IPv6 subnet (its network container is gone) while a
    pod holds an address of it. Before, the lane kept its free IPs and went on handing them
    out. Now: the pod keeps both IPs until its DEL, the free ones are dropped, an ADD naming
    the subnet fails at once with code 11 naming it (so does one waiting for it), the subnet is
    no longer asked for, the views say it is removed, and it goes with its last IP."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6([16, 17])), timeout=5)
    await ipam.add(Owner("c1", "eth0", "web", "shop"), subnets=BOTH)
    await ipam.add(Owner("c2", "eth0"), subnets=("v6pods",))
    waiting = asyncio.create_task(ipam.add(Owner("c3", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    before = in_memory(ipam)
    ipam.on_state(state(v4(range(10, 14)), None))
    with pytest.raises(IPAMError) as failed:
        await waiting
    assert (http_status(failed.value), failed.value.code) == (503, 11)
    assert "subnet v6pods was removed" in failed.value.msg
    assert in_memory(ipam) == on_disk(ipam) == before  # nothing lost
    with pytest.raises(IPAMError) as refused:
        await ipam.add(Owner("c4", "eth0"), subnets=BOTH)
    assert refused.value.code == 11 and "v6pods" in refused.value.msg
    assert in_memory(ipam) == before
    assert (await ipam.add(Owner("c4", "eth0"))).record.address == "10.1.0.11"  # v4 serves
    await ipam.reconcile_once()
    source = ipam.source
    assert isinstance(source, MemorySource)
    assert source.published_subnets[-1] == {}  # no longer asked for
    pool = views.pool_view(ipam)
    six = pool["subnets"]["v6pods"]
    assert six["removed"] is True and six["ips"] == {**six["ips"], "Assigned": 2, "Available": 0}
    assert views.pod_view(ipam, "shop/web")["ips"][1]["address"] == "fd00::10"
    assert "v6pods (removed)" in render_pool(pool)
    metrics = Metrics()
    metrics.watch(ipam)
    text = generate_latest(metrics.registry).decode()
    assert 'cns_lane_removed{subnet="v6pods"} 1.0' in text
    assert ipam.check(OwnerKey("c1", "eth0"), ["10.1.0.10", "fd00::10"])
    released = ipam.release(OwnerKey("c1", "eth0"), reason="cni-del")
    assert [r.address for r in released] == ["10.1.0.10", "fd00::10"]
    assert sorted(await ipam.gc({OwnerKey("c4", "eth0")})) == ["fd00::11"]
    await ipam.store.flush()
    assert in_memory(ipam) == on_disk(ipam) == {"ip-11": ("c4", "10.1.0.11", "")}
    assert not ipam.lanes["v6pods"].pool.records  # released IPs of a removed subnet leave
    await ipam.reconcile_once()
    assert "v6pods" not in ipam.lanes and "subnets" not in views.pool_view(ipam)
    ipam.store.close()


async def test_a_restart_without_a_subnet_keeps_its_assignments_until_their_del(
    tmp_path: Path,
) -> None:
    """The state file holds IPs of a subnet the configuration no longer has: the node starts,
    the lane is removed at once (not waited for), and the DEL frees them."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6(range(16, 20))))
    await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    ipam.store.close()
    again = restarted(tmp_path / "s.db", state(v4(range(10, 14)), None), timeout=5)
    with pytest.raises(IPAMError) as refused:
        await again.add(Owner("c2", "eth0"), subnets=BOTH)
    assert refused.value.code == 11 and "subnet v6pods was removed" in refused.value.msg
    assert again.lanes["v6pods"].removed and in_memory(again) == on_disk(again) == in_memory(ipam)
    assert again.wait_reason("v6pods").code == "subnet-removed"
    await again.delete(OwnerKey("c1", "eth0"))
    assert in_memory(again) == on_disk(again) == {}
    again.store.close()


async def test_a_restart_publishes_nothing_the_control_plane_already_has(tmp_path: Path) -> None:
    """After a restart the control plane's state says what the node asked for in every lane:
    the node publishes nothing (before, it sent the same request again, because it did not
    count the further subnets' requests it found as heard)."""
    heard = PoolRequest(15)
    st_ = SourceState(
        (v4(range(10, 25)),),
        request=heard,
        subnets={"v6pods": FurtherSubnetState((v6(range(16, 31)),), request=heard)},
    )
    ipam = make(tmp_path / "s.db", st_)
    await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    assert await ipam.reconcile_once() is None
    ipam.store.close()
    again = restarted(tmp_path / "s.db", st_)
    assert await again.reconcile_once() is None
    source = again.source
    assert isinstance(source, MemorySource) and source.published == []
    assert again.publishes_total == 0
    again.store.close()


async def test_a_subnet_listed_without_its_container_is_removed_too(tmp_path: Path) -> None:
    """The control plane still names the subnet but lists no network container of it (as for
    a subnet wanted for its pods' demand alone): its container is gone all the same."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6([16, 17])), timeout=5)
    await ipam.add(Owner("c1", "eth0"), subnets=BOTH)
    ipam.on_state(replace(state(v4(range(10, 14)), None), subnets={"v6pods": FurtherSubnetState()}))
    assert ipam.lanes["v6pods"].removed and not ipam.lanes["v6pods"].pool.available_count()
    with pytest.raises(IPAMError) as refused:
        await ipam.add(Owner("c2", "eth0"), subnets=BOTH)
    assert refused.value.code == 11 and "subnet v6pods was removed" in refused.value.msg
    ipam.on_state(state(v4(range(10, 14)), v6([16, 17], version=2)))  # back: it serves again
    assert not ipam.lanes["v6pods"].removed
    assert len((await ipam.add(Owner("c2", "eth0"), subnets=BOTH)).ips) == 2
    ipam.store.close()


async def test_cni_status_names_a_further_lane_that_is_full_at_max_ip_count(
    tmp_path: Path,
) -> None:
    """CNI STATUS looks at every lane: with v6pods out of free IPs and at its maxIPCount (two
    held plus its network container's primary IP), a dual-stack ADD cannot be served, and
    STATUS says so and names the subnet (it said "ready" looking at the primary lane alone)."""
    full_at_three = Scaler(max_ip_count=3)
    ipam = make(
        tmp_path / "s.db",
        SourceState(
            (v4(range(10, 14)),),
            subnets={"v6pods": FurtherSubnetState((v6(range(16, 18)),), False, full_at_three)},
        ),
    )
    assert ipam.status() == (True, "ready")
    for n in (1, 2):
        await ipam.add(Owner(f"c{n}", "eth0"), subnets=BOTH)
    assert ipam.status() == (
        False,
        "no free IP of subnet v6pods and the node is at maxIPCount (3)",
    )
    await ipam.delete(OwnerKey("c1", "eth0"))
    assert ipam.status() == (True, "ready")
    ipam.store.close()


async def test_a_draining_subnet_hands_out_no_ip_and_gives_back_the_free_ones(
    tmp_path: Path,
) -> None:
    """The IPv6 subnet's ClusterSubnet is marked draining while a pod holds one of its IPs and
    an ADD waits for one. The pod keeps its IPs (a repeated ADD of it too); the waiting ADD and
    any new one naming the subnet fail at once with code 11 naming it; the lane asks only for
    what its pod holds, so its free IPs go back through ipsNotInUse; the views and metrics say
    it drains. Set back to not draining, it serves again."""
    ipam = make(tmp_path / "s.db", state(v4(range(10, 14)), v6([16, 17])), timeout=5)
    pod = Owner("c1", "eth0", "web", "shop")
    await ipam.add(pod, subnets=BOTH)
    await ipam.add(Owner("c2", "eth0"), subnets=("v6pods",))
    waiting = asyncio.create_task(ipam.add(Owner("c3", "eth0"), subnets=BOTH))
    await turns_until(lambda: ipam.waiting_count("v6pods") == 1)
    before = in_memory(ipam)
    draining = replace(
        state(v4(range(10, 14)), None),
        subnets={"v6pods": FurtherSubnetState((v6([16, 17]),), draining=True)},
    )
    ipam.on_state(draining)
    with pytest.raises(IPAMError) as failed:
        await waiting
    assert (http_status(failed.value), failed.value.code) == (503, 11)
    assert "subnet v6pods is draining" in failed.value.msg
    with pytest.raises(IPAMError) as refused:
        await ipam.add(Owner("c4", "eth0"), subnets=BOTH)
    assert refused.value.code == 11 and "subnet v6pods is draining" in refused.value.msg
    again = await ipam.add(pod, subnets=BOTH)  # the runtime repeats an ADD: same IPs
    assert [r.address for r, _ in again.ips] == ["10.1.0.10", "fd00::10"]
    assert in_memory(ipam) == on_disk(ipam) == before
    assert (await ipam.add(Owner("c4", "eth0"))).record.address == "10.1.0.11"  # v4 serves
    ipam.release(OwnerKey("c2", "eth0"), reason="cni-del")  # fd00::11 free: it goes back
    await ipam.reconcile_once()
    source = ipam.source
    assert isinstance(source, MemorySource)
    asked = source.published_subnets[-1]["v6pods"]
    assert asked.requested_ip_count == 1 and asked.ips_not_in_use == ("ip6-17",)
    pool = views.pool_view(ipam)
    six = pool["subnets"]["v6pods"]
    assert six["subnetDraining"] is True and six["targetIPCount"] == 1
    assert pool["subnetDraining"] is False
    assert "v6pods (draining)" in render_pool(pool)
    assert ipam.wait_reason("v6pods").code == "subnet-draining"
    metrics = Metrics()
    metrics.watch(ipam)
    text = generate_latest(metrics.registry).decode()
    assert 'cns_lane_subnet_draining{subnet="v6pods"} 1.0' in text
    assert "cns_subnet_draining 0.0" in text
    ipam.on_state(state(v4(range(10, 14)), v6([16, 17])))  # no longer draining
    ipam.release(pod.key, reason="cni-del")
    assert [r.address for r, _ in (await ipam.add(Owner("c5", "eth0"), subnets=BOTH)).ips][1:] == [
        "fd00::10"
    ]
    ipam.store.close()
