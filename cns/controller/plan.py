"""The reference control plane's decisions, as one pure function of what the API server holds.

Given the subnet and every node's network container and request, decide which network containers
change: released IPs leave, missing NCs are created with a primary IP only (seed phase 2-1),
shortfalls are granted from free addresses, and scarce addresses are divided among the nodes in
proportion to their shortfall with remainder inertia (`weighted-replica-division.md`).

Safety: an address is granted only if no network container lists it now, and an address released
in this round is not granted until the next round, after the release has been written. So a
partial failure while writing can never leave one address in two nodes' containers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

from cns.core.batch import next_batch
from cns.core.division import divide_capped
from cns.core.scaling import next_exhausted
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the API server has it: its NNC's network container and spec."""

    name: str
    nc: NetworkContainer | None
    request: PoolRequest


@dataclass(frozen=True, slots=True)
class SubnetStatus:
    """What the controller computed last time (ClusterSubnet status, ClusterSubnetState)."""

    exhausted: bool = False
    reserved: int = 0
    batch: int = 0
    batch_changes: int = 0


@dataclass(slots=True)
class Plan:
    changed: dict[str, NetworkContainer] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    status: SubnetStatus = field(default_factory=SubnetStatus)
    capacity: int = 0
    short_of: int = 0  # requested but not grantable this round


def plan_subnet(
    subnet: Subnet,
    nodes: list[NodeView],
    previous: SubnetStatus,
    rng: random.Random,
    new_id: Callable[[], str],
) -> Plan:
    """Decide this round's changes to every node's network container and the subnet status."""
    plan = Plan(capacity=subnet.capacity)
    in_use: set[str] = set()
    for node in nodes:
        if node.nc is not None:
            in_use.update(node.nc.primary_ips)
            in_use.update(c.address for c in node.nc.ip_configs)

    kept: dict[str, NetworkContainer] = {}
    for node in nodes:
        nc = node.nc
        if nc is None:
            continue
        releasing = set(node.request.ips_not_in_use)
        remaining = tuple(c for c in nc.ip_configs if c.id not in releasing)
        if len(remaining) != len(nc.ip_configs):
            plan.released[node.name] = len(nc.ip_configs) - len(remaining)
            nc = _next_version(nc, remaining)
            plan.changed[node.name] = nc
        kept[node.name] = nc

    free = (address for address in subnet.usable() if address not in in_use)
    for node in nodes:
        if node.nc is None:
            primary = next(free, None)
            if primary is None:
                continue  # no room even for a primary IP; retried next round
            in_use.add(primary)
            nc = NetworkContainer(
                id=new_id(),
                primary_ips=(primary,),
                subnet=str(subnet.network),
                gateway=subnet.gateway_address,
                version=1,
                programmed_version=1,
            )
            kept[node.name] = plan.changed[node.name] = nc

    shortfall = {
        name: max(0, request - len(kept[name].ip_configs))
        for name, request in (
            (node.name, node.request.requested_ip_count) for node in nodes if node.name in kept
        )
    }
    free_addresses = [a for a in subnet.usable() if a not in in_use]
    holding = {name: len(nc.ip_configs) for name, nc in kept.items()}
    grants = divide_capped(len(free_addresses), shortfall, holding, rng)
    plan.short_of = sum(shortfall.values()) - sum(grants.values())
    cursor = 0
    for name in sorted(grants):
        count = grants[name]
        if count <= 0:
            continue
        added = tuple(
            IPConfig(new_id(), address) for address in free_addresses[cursor : cursor + count]
        )
        cursor += count
        nc = kept[name]
        if name in plan.changed:  # already a new version this round
            nc = replace(nc, ip_configs=nc.ip_configs + added)
        else:
            nc = _next_version(nc, nc.ip_configs + added)
        kept[name] = plan.changed[name] = nc
        plan.granted[name] = count

    reserved = sum(len(nc.primary_ips) + len(nc.ip_configs) for nc in kept.values())
    exhausted = next_exhausted(
        previous.exhausted, reserved, subnet.capacity, subnet.upper_percent, subnet.lower_percent
    )
    batch = _batch(subnet, len(nodes), reserved, previous)
    changes = previous.batch_changes + (previous.batch > 0 and batch != previous.batch)
    plan.status = SubnetStatus(exhausted, reserved, batch, changes)
    return plan


def _next_version(nc: NetworkContainer, configs: tuple[IPConfig, ...]) -> NetworkContainer:
    version = nc.version + 1
    return replace(nc, ip_configs=configs, version=version, programmed_version=version)


def _batch(subnet: Subnet, node_count: int, reserved: int, previous: SubnetStatus) -> int:
    """The utilization-aware batch (phase 4); the static level before any history exists."""
    if subnet.capacity <= 0 or node_count == 0:
        return max(previous.batch, 1)
    previous_batch = previous.batch if previous.batch > 0 else subnet.max_batch
    return next_batch(
        subnet.capacity,
        node_count,
        reserved,
        previous.reserved,
        previous_batch,
        subnet.node_safety_factor,
        subnet.max_batch,
        Fraction(subnet.request_threshold_percent, 100),
    )
