"""Rounds of the controller's plan run to completion on nodes that ask, for the tests of what a
plan never grants."""

from __future__ import annotations

import random
from collections.abc import Callable

from cns.core.allocation import Entry
from cns.core.subnet import Subnet
from cns.core.subnet_plan import NodeView, plan_subnet
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
