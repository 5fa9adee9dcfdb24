"""The reference control plane's pure planner: fulfilment, releases, scarcity, safety."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cns.controller.plan import NodeView, Plan, SubnetStatus, plan_subnet
from cns.core.allocation import Entry, apply_changes
from cns.core.subnet import Subnet
from cns.core.types import NetworkContainer, PoolRequest

SUBNET = Subnet("pods", "10.10.0.0/24", reserved_ips=frozenset({"10.10.0.250"}))


IDS = itertools.count()  # unique across rounds, as the controller's uuids are


def run(
    subnet: Subnet,
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]],
    previous: SubnetStatus | None = None,
    seed: int = 0,
    record: dict[str, Entry] | None = None,
) -> Plan:
    """One round as a single writer runs it: every record write lands, and `record` (when
    given) is brought up to date with the round's changes."""
    views = [NodeView(name, nc, request) for name, (nc, request) in sorted(nodes.items())]
    plan = plan_subnet(
        subnet,
        views,
        {} if record is None else record,
        previous or SubnetStatus(),
        random.Random(seed),
        lambda: f"id{next(IDS)}",
    )
    if record is not None:
        apply_changes(record, plan.record)
    return plan


def addresses(nc: NetworkContainer) -> set[str]:
    return {*nc.primary_ips, *(c.address for c in nc.ip_configs)}


def test_new_node_gets_an_empty_network_container_first() -> None:
    plan = run(SUBNET, {"n1": (None, PoolRequest(0))})
    nc = plan.changed["n1"]
    assert nc.primary_ips == ("10.10.0.2",) and nc.ip_configs == () and nc.version == 1
    assert nc.gateway == "10.10.0.1" and nc.subnet == "10.10.0.0/24"


def test_request_is_granted_in_one_round_and_version_bumps_once() -> None:
    first = run(SUBNET, {"n1": (None, PoolRequest(15))}).changed["n1"]
    assert len(first.ip_configs) == 15 and first.version == 1
    second = run(SUBNET, {"n1": (first, PoolRequest(31))}).changed["n1"]
    assert len(second.ip_configs) == 31 and second.version == 2
    assert second.ip_configs[:15] == first.ip_configs  # existing IPs untouched
    assert run(SUBNET, {"n1": (second, PoolRequest(31))}).changed == {}  # fixed point


def test_released_ips_leave_and_are_not_reused_in_the_same_round() -> None:
    nc = run(SUBNET, {"a": (None, PoolRequest(4))}).changed["a"]
    released = tuple(c.id for c in nc.ip_configs[:2])
    gone = {c.address for c in nc.ip_configs[:2]}
    plan = run(SUBNET, {"a": (nc, PoolRequest(2, released)), "b": (None, PoolRequest(250))})
    assert {c.id for c in plan.changed["a"].ip_configs}.isdisjoint(released)
    assert plan.changed["a"].version == nc.version + 1
    assert gone.isdisjoint(addresses(plan.changed["b"]))


def test_scarce_ips_are_divided_by_shortfall_and_never_over_granted() -> None:
    tiny = Subnet("tiny", "10.20.0.0/28")  # 14 hosts, gateway -> 13 usable
    plan = run(tiny, {n: (None, PoolRequest(r)) for n, r in (("a", 20), ("b", 10), ("c", 0))})
    primaries = 3
    granted = plan.granted
    assert sum(granted.values()) == 13 - primaries
    assert granted["a"] > granted["b"] > 0 and "c" not in granted
    assert plan.short_of == 30 - sum(granted.values())
    every = [addr for nc in plan.changed.values() for addr in addresses(nc)]
    assert len(every) == len(set(every)) == 13


def test_exhaustion_and_batch_follow_utilization_with_hysteresis() -> None:
    subnet = Subnet("s", "10.30.0.0/24", upper_percent=80, lower_percent=40)
    plan = run(subnet, {"a": (None, PoolRequest(230))})
    assert plan.status.exhausted and plan.status.reserved == 231
    nc = plan.changed["a"]
    keep = PoolRequest(150, tuple(c.id for c in nc.ip_configs[150:]))
    still = run(subnet, {"a": (nc, keep)}, plan.status)
    assert still.status.exhausted  # 151 of 253 is under 80 % but above 40 %
    nc = still.changed["a"]
    low = PoolRequest(50, tuple(c.id for c in nc.ip_configs[50:]))
    assert not run(subnet, {"a": (nc, low)}, still.status).status.exhausted
    assert 1 <= plan.status.batch <= subnet.max_batch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 60), st.booleans()), max_size=40))
def test_no_address_is_ever_in_two_containers(steps: list[tuple[int, int, bool]]) -> None:
    """Nodes change requests and release IPs in any order; the planner never double-books."""
    subnet = Subnet("s", "10.40.0.0/25", reserved_ips=frozenset({"10.40.0.100"}))
    rng = random.Random(1)
    state: dict[str, tuple[NetworkContainer | None, PoolRequest]] = {
        f"n{i}": (None, PoolRequest(0)) for i in range(5)
    }
    status = SubnetStatus()
    record: dict[str, Entry] = {}
    for node_index, request, release in steps:
        name = f"n{node_index}"
        nc, _ = state[name]
        held = nc.ip_configs if nc else ()
        releasing = tuple(c.id for c in held[request:]) if release else ()
        state[name] = (nc, PoolRequest(request, releasing))
        plan = run(subnet, state, status, seed=rng.randrange(1000), record=record)
        status = plan.status
        assert not plan.duplicates and not plan.conflicts and not plan.release_requests
        for changed, new_nc in plan.changed.items():
            state[changed] = (new_nc, PoolRequest(state[changed][1].requested_ip_count))
        every = [addr for nc, _ in state.values() if nc for addr in addresses(nc)]
        assert len(every) == len(set(every))
        usable = set(subnet.usable())
        assert set(every) <= usable
        assert status.reserved == len(every) <= subnet.capacity
        # With one writer the record and the containers agree, entry for entry.
        live = {a: e.node for a, e in record.items() if not e.releasing}
        assert live == {a: n for n, (nc, _) in state.items() if nc for a in addresses(nc)}
