"""Overflow on the node: a pod of the primary subnet sent to an overflow subnet (issue 29).

NodeIPAM with a MemorySource and a real SQLite store, as in tests/unit/node/test_lanes.py: the
primary subnet `v4pods` (10.1.0.0/24) names the overflow subnet `more` (10.2.0.0/24). The rule
(cns/core/overflow.py): only while the primary is exhausted (or draining) and the node has none
of its addresses free; a pod keeps what it got; it counts in one subnet's demand, never two.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cns.commands.status import render_pool
from cns.core.overflow import OverflowCandidate
from cns.core.pool import Pool
from cns.core.types import IPConfig, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.node.control_plane import FurtherSubnetState, MemorySource, SourceState
from cns.node.errors import IPAMError
from cns.node.service import NodeIPAM
from cns.state.store import Store
from cns.web import views
from cns.web.node_metrics import Metrics
from tests.unit.node.test_lanes import make, turns_until

HOUR = 3600.0
MORE = OverflowCandidate("more")
FULL = OverflowCandidate("full", exhausted=True)


def v4(numbers: Iterable[int]) -> NetworkContainer:
    configs = tuple(IPConfig(f"ip-{n}", f"10.1.0.{n}", 1) for n in numbers)
    return NetworkContainer(
        "nc4", ("10.1.0.2",), "10.1.0.0/24", "10.1.0.1", configs, 1, 1, "v4pods"
    )


def more(numbers: Iterable[int]) -> NetworkContainer:
    configs = tuple(IPConfig(f"m-{n}", f"10.2.0.{n}", 1) for n in numbers)
    return NetworkContainer("ncm", ("10.2.0.2",), "10.2.0.0/24", "10.2.0.1", configs, 1, 1, "more")


def state(
    primary: Iterable[int],
    overflow: Iterable[int] | None = None,
    *,
    exhausted: bool = True,
    candidates: tuple[OverflowCandidate, ...] = (MORE,),
    pods: Iterable[str] = (),
) -> SourceState:
    pods = frozenset(pods)
    subnets = {"more": FurtherSubnetState((more(overflow),))} if overflow is not None else {}
    return SourceState(
        (v4(primary),),
        exhausted=exhausted,
        overflow=candidates,
        subnets=subnets,
        pod_demand=len(pods),
        primary_pods=pods,
    )


def pod(n: int) -> Owner:
    return Owner(f"c{n}", "eth0", f"p{n}", "shop")


def pods(*numbers: int) -> list[str]:
    return [pod(n).pod for n in numbers]


def source_of(ipam: NodeIPAM) -> MemorySource:
    assert isinstance(ipam.source, MemorySource)
    return ipam.source


async def test_an_add_overflows_only_when_exhausted_and_no_primary_address_is_free(
    tmp_path: Path,
) -> None:
    """The primary's free address first, even exhausted; then the overflow subnet's; a repeated
    ADD keeps the subnet it got; once the primary has a free address again, it serves."""
    ipam = make(tmp_path / "s.db", state([10], [20, 21]))
    first = await ipam.add(pod(1))
    assert first.record.address == "10.1.0.10"
    second = await ipam.add(pod(2))
    assert second.record.address == "10.2.0.20" and second.network.subnet_name == "more"
    again = await ipam.add(pod(2))  # the runtime repeats the ADD: same address, same subnet
    assert again.record.address == "10.2.0.20" and ipam.overflows_total == 1
    ipam.release(pod(1).key, reason="cni-del")
    assert (await ipam.add(pod(3))).record.address == "10.1.0.10"
    assert {a.subnet for a in ipam.store.assignments.values()} == {"", "more"}
    ipam.store.close()


async def test_no_overflow_while_the_primary_is_not_exhausted(tmp_path: Path) -> None:
    """The primary full on this node but not exhausted: the control plane grants it more, so
    the ADD waits for the primary (its request asks for it), not for another subnet."""
    ipam = make(tmp_path / "s.db", state([10], [20, 21], exhausted=False), timeout=0.05)
    await ipam.add(pod(1))
    with pytest.raises(IPAMError) as waited:
        await ipam.add(pod(2))
    assert waited.value.code == 11 and ipam.overflows_total == 0
    assert [a.address for a in ipam.store.assignments.values()] == ["10.1.0.10"]
    ipam.store.close()


@pytest.mark.parametrize(
    "candidate",
    [
        OverflowCandidate("more", exhausted=True),
        OverflowCandidate("more", draining=True),
        OverflowCandidate("more", usable=False),
    ],
)
async def test_an_overflow_subnet_without_room_takes_no_pod(
    tmp_path: Path, candidate: OverflowCandidate
) -> None:
    st_ = state([10], [20, 21], candidates=(candidate,))
    ipam = make(tmp_path / "s.db", st_, timeout=0.05)
    await ipam.add(pod(1))
    with pytest.raises(IPAMError):
        await ipam.add(pod(2))
    assert ipam.overflows_total == 0 and len(ipam.store.assignments) == 1
    ipam.store.close()


async def test_the_first_overflow_subnet_with_room_in_order(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state([10], [20], candidates=(FULL, MORE)))
    await ipam.add(pod(1))
    assert (await ipam.add(pod(2))).record.address == "10.2.0.20"
    ipam.store.close()


async def test_a_draining_primary_sends_new_pods_to_its_overflow_subnet(tmp_path: Path) -> None:
    """Drain and migrate without annotating: a draining primary with an overflow subnet sends
    new pods there instead of failing them; a pod holding a primary address keeps it."""
    st_ = replace(state([10, 11], [20], exhausted=False), draining=True)
    ipam = make(tmp_path / "s.db", replace(st_, draining=False))
    kept = await ipam.add(pod(1))
    ipam.on_state(st_)
    assert (await ipam.add(pod(1))).record.address == kept.record.address == "10.1.0.10"
    assert (await ipam.add(pod(2))).record.address == "10.2.0.20"
    ipam.store.close()


async def test_an_add_that_queued_for_the_primary_is_sent_on_when_the_exhaustion_comes(
    tmp_path: Path,
) -> None:
    ipam = make(tmp_path / "s.db", state([10], [20], exhausted=False))
    await ipam.add(pod(1))
    waiting = asyncio.create_task(ipam.add(pod(2)))
    await turns_until(lambda: ipam.waiting_count("") == 1)
    ipam.on_state(state([10], [20]))
    assert (await waiting).record.address == "10.2.0.20"
    ipam.store.close()


async def test_a_pod_that_overflowed_counts_in_the_overflow_subnet_only(tmp_path: Path) -> None:
    """Pods p1..p3 draw from the primary (the pod watch counts 3); p2 holds an address of
    `more`: the primary's demand is 2, the overflow subnet's 1 plus the pods the primary cannot
    serve (p3: the primary holds one address, p1's), counted there before p3's ADD."""
    ipam = make(tmp_path / "s.db", state([10], [20, 21], pods=pods(1, 2, 3)))
    await ipam.add(pod(1))
    await ipam.add(pod(2))
    assert ipam.demand("") == 2
    assert ipam.demand("more") == 1 + 1
    await ipam.reconcile_once()
    asked = source_of(ipam).published_subnets[-1]["more"]
    assert asked.requested_ip_count == 16 - 1  # B * ceil(mf + 2/16) - its primary IP
    ipam.store.close()


async def test_the_overflow_subnet_is_asked_for_ahead_of_the_first_add(tmp_path: Path) -> None:
    """No address of `more` yet: once the primary is exhausted with more pods scheduled than
    it holds, the node asks for `more` before any ADD needs it."""
    ipam = make(tmp_path / "s.db", state([10, 11], pods=pods(1, 2, 3, 4, 5)))
    await ipam.reconcile_once()
    assert source_of(ipam).published_subnets[-1] == {"more": PoolRequest(16)}
    assert ipam.demand("more") == 3
    ipam.on_state(state([10, 11], pods=pods(1, 2)))  # the pods went: nothing asked for ahead
    await ipam.reconcile_once()
    assert source_of(ipam).published_subnets[-1] == {} and "more" not in ipam.lanes
    ipam.store.close()


async def test_once_the_exhaustion_clears_the_overflow_subnet_keeps_only_what_pods_hold(
    tmp_path: Path,
) -> None:
    """The hysteresis is the controller's (exhausted until lowerPercent); once it clears, new
    pods go to the primary again and the overflow subnet gives back its free addresses."""
    ipam = make(tmp_path / "s.db", state([10], [20, 21, 22], pods=pods(1, 2)))
    await ipam.add(pod(1))
    await ipam.add(pod(2))
    ipam.on_state(state([10, 11], [20, 21, 22], exhausted=False, pods=pods(1, 2, 3)))
    assert (await ipam.add(pod(3))).record.address == "10.1.0.11"
    await ipam.reconcile_once()
    asked = source_of(ipam).published_subnets[-1]["more"]
    assert asked.requested_ip_count == 1 and asked.ips_not_in_use == ("m-21", "m-22")
    assert ipam.demand("more") == 1 and ipam.demand("") == 2
    ipam.release(pod(2).key, reason="cni-del")
    await ipam.reconcile_once()
    assert source_of(ipam).published_subnets[-1]["more"].requested_ip_count == 0
    ipam.store.close()


async def test_an_add_asking_for_an_address_is_never_sent_on(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state([10], [20]), timeout=0.05)
    await ipam.add(pod(1))
    with pytest.raises(IPAMError) as refused:
        await ipam.add(pod(2), requested="10.1.0.10")
    assert refused.value.code == 11 and ipam.overflows_total == 0
    ipam.release(OwnerKey("c1", "eth0"), reason="cni-del")
    assert (await ipam.add(pod(2), requested="10.1.0.10")).record.address == "10.1.0.10"
    ipam.store.close()


async def test_the_views_metrics_and_status_say_where_pods_go(tmp_path: Path) -> None:
    ipam = make(tmp_path / "s.db", state([10], [20, 21], candidates=(FULL, MORE), pods=pods(1, 2)))
    await ipam.add(pod(1))
    await ipam.add(pod(2))
    overflow = views.pool_view(ipam)["overflow"]
    assert (overflow["open"], overflow["target"], overflow["podsSentTotal"]) == (True, "more", 1)
    assert [(s["name"], s["hasRoom"], s["overflowedPods"]) for s in overflow["subnets"]] == [
        ("full", False, 0),
        ("more", True, 1),
    ]
    assert "full (exhausted), more (taking pods); 1 pods sent" in render_pool(views.pool_view(ipam))
    metrics = Metrics()
    metrics.watch(ipam)
    families = {
        f.name: f
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
    }
    assert families["cns_overflow_adds"].samples[0].value == 1
    assert families["cns_overflow_open"].samples[0].value == 1
    ipam.on_state(state([10], [20, 21], exhausted=False, candidates=(FULL, MORE)))
    assert views.pool_view(ipam)["overflow"]["target"] is None
    assert "overflow" not in views.pool_view(make(tmp_path / "t.db", state([10], candidates=())))
    ipam.store.close()


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "add", "del", "flip", "grow"]), st.integers(0, 7)),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_an_overflowed_pod_is_one_pod_with_one_address_whatever_the_timing(
    ops: list[tuple[str, int]],
) -> None:
    """ADDs and DELs run concurrently in small groups while the primary's exhaustion flips
    and grants come to either subnet at any moment: memory equals the disk, no address has two
    owners, a pod holds one address in one subnet (never one of each), and a repeated ADD
    gets the address the pod holds."""
    asyncio.run(_run_ops(ops))


async def _run_ops(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        primary, overflow, exhausted = [10, 11], [20], True
        ipam = make(Path(directory) / "s.db", state(primary, overflow), timeout=0.0)
        try:
            for start in range(0, len(ops), 3):
                group = ops[start : start + 3]
                before = {a.owner.container_id: a.address for a in ipam.store.assignments.values()}
                tasks = []
                for kind, n in group:
                    if kind == "flip":
                        exhausted = not exhausted
                    elif kind == "grow":  # a grant of either subnet
                        grown = primary if n % 2 else overflow
                        grown.append(grown[-1] + 1)
                    if kind in ("flip", "grow"):
                        ipam.on_state(state(primary, overflow, exhausted=exhausted))
                    elif kind == "add":
                        tasks.append(ipam.add(pod(n)))
                    else:
                        tasks.append(ipam.delete(pod(n).key))
                results = await asyncio.gather(*tasks, return_exceptions=True)
                await ipam.store.flush()
                memory = {
                    (a.owner.container_id, a.address, a.subnet)
                    for lane in ipam.lanes.values()
                    for a in lane.pool.assignments()
                }
                disk = {
                    (a.owner.container_id, a.address, a.subnet)
                    for a in ipam.store.assignments.values()
                }
                assert memory == disk
                owners = [owner for owner, _, _ in memory]
                assert len(owners) == len(set(owners))  # one address per pod, in one subnet
                addresses = [address for _, address, _ in memory]
                assert len(addresses) == len(set(addresses))
                for result in results:
                    assert not isinstance(result, BaseException) or isinstance(result, IPAMError)
                for owner, address, _ in memory:
                    if owner in before and not any(
                        k == "del" and f"c{m}" == owner for k, m in group
                    ):
                        assert before[owner] == address  # kept for life
        finally:
            ipam.store.close()


async def test_after_a_restart_a_repeated_add_keeps_its_overflow_address_whatever_the_list(
    tmp_path: Path,
) -> None:
    """The state file alone says where a pod was sent: restarted on a control plane that no
    longer names the overflow subnet (spec.overflow edited meanwhile), a repeated ADD of the
    pod gets its overflow address back, not a second one of the primary, and the pod still
    counts in the overflow subnet only."""
    ipam = make(tmp_path / "s.db", state([10], [20], pods=pods(1, 2)))
    await ipam.add(pod(1))
    sent = await ipam.add(pod(2))
    ipam.store.close()
    store = Store(tmp_path / "s.db")
    pool = Pool()
    for row in store.open():
        if not row.subnet:
            pool.restore(row)
    after = state([10, 11], [20], exhausted=False, candidates=(), pods=pods(1, 2))
    again = NodeIPAM(pool, store, MemorySource(after), Scaler(), HOUR)
    again.on_state(after)
    repeated = await again.add(pod(2))
    assert repeated.record.address == sent.record.address == "10.2.0.20"
    assert sorted(a.address for a in store.assignments.values()) == ["10.1.0.10", "10.2.0.20"]
    assert (again.demand(""), again.demand("more")) == (1, 1)
    store.close()


async def test_a_draining_primary_sends_pods_to_an_exhausted_overflow_subnet_that_grants(
    tmp_path: Path,
) -> None:
    """No overflow subnet has room, but the primary is draining (it grants nothing): the pod
    goes to the first that still grants (`more`, exhausted) rather than fail."""
    exhausted = (OverflowCandidate("more", exhausted=True),)
    st_ = replace(state([10], [20], exhausted=False, candidates=exhausted), draining=True)
    ipam = make(tmp_path / "s.db", st_)
    assert (await ipam.add(pod(1))).record.address == "10.2.0.20"
    ipam.store.close()
