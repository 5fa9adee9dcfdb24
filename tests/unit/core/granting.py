"""Rounds of the controller's plan run to completion on nodes that ask, for the tests of what a
plan never grants."""

from __future__ import annotations

import random
from collections.abc import Callable

from cns.core.allocation import Entry
from cns.core.subnet import Subnet
from cns.core.subnet_plan import NodeView, Plan, plan_subnet
from cns.core.types import PoolRequest, SubnetStatus


def ids() -> Callable[[], str]:
    counter = iter(range(1_000_000))
    return lambda: f"id{next(counter)}"


def granted_after_rounds(
    subnet: Subnet, requests: list[int], rounds: int = 3
) -> tuple[list[str], set[str]]:
    """The addresses the nodes (one per request) hold after `rounds` whole-subnet plans, each
    applied (a container first, then its grants), and those the allocation record holds."""
    record: dict[str, Entry] = {}
    views = [NodeView(f"n{i}", None, PoolRequest(asked)) for i, asked in enumerate(requests)]
    new_id = ids()
    for _ in range(rounds):
        plan = plan_subnet(subnet, views, record, SubnetStatus(), random.Random(0), new_id)
        for address, entry in plan.record.items():
            if entry is None:
                record.pop(address, None)
            else:
                record[address] = entry
        views = [NodeView(v.name, plan.changed.get(v.name, v.nc), v.request) for v in views]
    return [a for v in views if v.nc for a in _held(v)], set(record)


def _held(view: NodeView) -> tuple[str, ...]:
    assert view.nc is not None
    return (*view.nc.primary_ips, *(c.address for c in view.nc.ip_configs))


def planned_keeping_withdrawn(
    subnet: Subnet, view: NodeView, record: dict[str, Entry], *, address: str, ip_id: str
) -> Plan:
    """A round over a node listing withdrawn `address` (a node's own, or reserved) under
    `ip_id`: kept as it is (neither freed nor moved, no conflict), and asked back from its node,
    which gives it back once no pod of its own uses it."""
    plan = plan_subnet(subnet, [view], record, SubnetStatus(), random.Random(0), ids())
    assert address not in plan.record
    assert not plan.conflicts
    assert plan.release_requests == {view.name: (ip_id,)}
    return plan
