"""The reference control plane's decisions, as one pure function of what the API server holds.

Inputs: the subnet, every node's network container and request (its NodeNetworkConfig), and the
subnet's allocation record (`cns.core.allocation`). The record decides who holds an address; the
network containers follow it. A round:

- frees the addresses granted to a NodeNetworkConfig object that is gone: deleted, or replaced by
  a new object of the same name (the caller confirmed it by a direct read);
- audits every network container against the others and the record: an address listed by two
  containers is a duplicate, one listed against the record a conflict; both are reported and the
  nodes that list it are asked to give it up (`release_requests`), which a node does only for an
  address no pod of its own uses; an address listed by one node and absent from the record (a
  subnet handed out before the record existed) is adopted;
- releases what the nodes list in `ipsNotInUse`: the record entry is marked `releasing` and the
  address leaves the container; the entry is freed in a later round, once the container that
  listed it no longer does;
- creates missing network containers (a primary IP only, docs/design/subnet-scarcity.md, 2-1)
  and grants shortfalls from free addresses, dividing scarce ones in proportion to the shortfall
  with remainder inertia (`divide_capped`, docs/design/weighted-division.md);
- completes grants the record holds but a container does not list yet (a write that did not land).

Safety comes from the order in which the caller writes the result (see
docs/design/controller-safety.md): the record blocks first, each conditional on its
resourceVersion, then the network containers, each conditional on the resourceVersion it was read
at, keeping only the changes whose blocks were written (`NodeChange.container`). An address is
never added to a container unless its block write (a change or an unchanged re-write) succeeded
after that container was read.
"""

from __future__ import annotations

import ipaddress
import itertools
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from cns.core.allocation import Entry, Record
from cns.core.batch import next_batch
from cns.core.division import divide_capped
from cns.core.scaling import next_exhausted
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, SubnetStatus


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the API server has it: its NNC's network container and spec."""

    name: str
    nc: NetworkContainer | None
    request: PoolRequest
    uid: str = ""  # of the NodeNetworkConfig object


def _everything(_address: str) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class NodeChange:
    """How one node's network container changes, before the record writes are known to land.

    `removals` pairs each IP config to drop with whether that depends on its record write (an
    owner's release is marked `releasing` in the record first); `additions` always depend on
    theirs. `created` is the new container (primary IP only) when the node has none yet.
    """

    base: NetworkContainer | None
    created: NetworkContainer | None = None
    removals: tuple[tuple[IPConfig, bool], ...] = ()
    additions: tuple[IPConfig, ...] = ()

    def container(self, confirmed: Callable[[str], bool] = _everything) -> NetworkContainer | None:
        """The container to write when only the record writes of `confirmed` addresses landed;
        None when nothing is left to write."""
        configs: tuple[IPConfig, ...] = ()
        if self.base is None:
            if self.created is None or not confirmed(self.created.primary_ips[0]):
                return None
            nc = self.created
        else:
            nc, configs = self.base, self.base.ip_configs
        dropped = {
            config.id
            for config, needs_record in self.removals
            if not needs_record or confirmed(config.address)
        }
        kept = tuple(c for c in configs if c.id not in dropped)
        added = tuple(c for c in self.additions if confirmed(c.address))
        if self.base is not None and not added and len(kept) == len(configs):
            return None
        version = nc.version + 1 if self.base is not None else nc.version
        return replace(nc, ip_configs=kept + added, version=version, programmed_version=version)


@dataclass(slots=True)
class Plan:
    node_changes: dict[str, NodeChange] = field(default_factory=dict)
    # The record after this round, as changes: address -> entry, or None to free it.
    record: dict[str, Entry | None] = field(default_factory=dict)
    # Addresses this round adds to a container: their blocks must be written (even unchanged).
    additions: set[str] = field(default_factory=set)
    release_requests: dict[str, tuple[str, ...]] = field(default_factory=dict)
    duplicates: dict[str, tuple[str, ...]] = field(default_factory=dict)
    conflicts: dict[str, tuple[str, str]] = field(default_factory=dict)  # listed by, recorded for
    released: dict[str, int] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    status: SubnetStatus = field(default_factory=SubnetStatus)
    capacity: int = 0
    short_of: int = 0  # requested but not grantable this round

    @property
    def changed(self) -> dict[str, NetworkContainer]:
        """Every container that changes when all record writes land (a single writer's view)."""
        result = {}
        for name, change in self.node_changes.items():
            nc = change.container()
            if nc is not None:
                result[name] = nc
        return result

    @property
    def touched(self) -> set[str]:
        """Addresses whose blocks this round must write: record changes and additions."""
        return set(self.record) | self.additions


@dataclass(frozen=True, slots=True)
class _Listing:
    node: str
    id: str
    primary: bool


def _address_key(address: str) -> tuple[int, int]:
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


def _listings(nodes: list[NodeView]) -> dict[str, list[_Listing]]:
    listed: dict[str, list[_Listing]] = defaultdict(list)
    for node in nodes:
        if node.nc is None:
            continue
        for address in node.nc.primary_ips:
            listed[address].append(_Listing(node.name, node.nc.id, True))
        for config in node.nc.ip_configs:
            listed[config.address].append(_Listing(node.name, config.id, False))
    return listed


def plan_subnet(
    subnet: Subnet,
    nodes: list[NodeView],
    record: Record,
    previous: SubnetStatus,
    rng: random.Random,
    new_id: Callable[[], str],
    current_uids: Mapping[str, str | None] | None = None,
) -> Plan:
    """Decide this round's record changes, container changes and subnet status.

    Entries are live for a node when they carry the uid of the node's NodeNetworkConfig in the
    snapshot. For the others, `current_uids` holds what the caller read directly (not from a
    cache) for their nodes: the uid the object has now, or None if it is deleted. An entry
    granted to an object that no longer exists is freed: a write to that object cannot land,
    and no grant is ever completed into another object. Entries of nodes not confirmed yet are
    left as they are.
    """
    plan = Plan(capacity=subnet.capacity)
    entries = dict(record)

    def put(address: str, entry: Entry | None) -> None:
        if entry is None:
            entries.pop(address, None)
        else:
            entries[address] = entry
        plan.record[address] = entry

    uids = {node.name: node.uid for node in nodes}
    confirmed = current_uids or {}
    for address, entry in list(entries.items()):
        if entry.node in confirmed and entry.uid != confirmed[entry.node]:
            put(address, None)

    def live(entry: Entry | None, node: str) -> bool:
        return entry is not None and entry.node == node and entry.uid == uids.get(node)

    listed = _listings(nodes)
    asked: dict[str, set[str]] = defaultdict(set)
    for address, holders in listed.items():
        recorded = entries.get(address)
        if len(holders) > 1:
            plan.duplicates[address] = tuple(sorted({h.node for h in holders}))
            for holder in holders:
                if not holder.primary:
                    asked[holder.node].add(holder.id)
            continue
        holder = holders[0]
        if recorded is None and subnet.is_usable(address):
            put(address, Entry(holder.node, holder.id, holder.primary, uid=uids[holder.node]))
        elif recorded is None or (recorded.node, recorded.id) != (holder.node, holder.id):
            plan.conflicts[address] = (holder.node, recorded.node if recorded else "")
            if not holder.primary:
                asked[holder.node].add(holder.id)
    plan.release_requests = {node: tuple(sorted(ids)) for node, ids in sorted(asked.items())}

    removals: dict[str, list[tuple[IPConfig, bool]]] = defaultdict(list)
    for node in nodes:
        if node.nc is None:
            continue
        leaving = set(node.request.ips_not_in_use)
        for config in node.nc.ip_configs:
            held = entries.get(config.address)
            owned = held is not None and live(held, node.name) and held.id == config.id
            if config.id in leaving:
                marks = held is not None and owned and not held.releasing
                if held is not None and marks:
                    put(config.address, replace(held, releasing=True))
                removals[node.name].append((config, marks))
                plan.released[node.name] = plan.released.get(node.name, 0) + 1
            elif held is not None and owned and held.releasing:
                removals[node.name].append((config, False))  # an earlier removal did not land

    for address, entry in list(entries.items()):
        if entry.releasing and all(h.node != entry.node for h in listed.get(address, ())):
            put(address, None)

    in_use = set(entries) | set(listed)
    free = (address for address in subnet.usable() if address not in in_use)
    primaries = {e.node for e in entries.values() if e.primary and live(e, e.node)}
    for node in nodes:
        if node.nc is None and node.name not in primaries:
            primary = next(free, None)
            if primary is None:
                continue  # no room even for a primary IP; retried next round
            in_use.add(primary)
            put(primary, Entry(node.name, new_id(), primary=True, uid=node.uid))
            primaries.add(node.name)

    holding = Counter(
        e.node for e in entries.values() if not e.primary and not e.releasing and live(e, e.node)
    )
    shortfall = {
        node.name: max(0, node.request.requested_ip_count - holding[node.name])
        for node in nodes
        if node.name in primaries
    }
    free_count = subnet.capacity - sum(1 for address in in_use if subnet.is_usable(address))
    grants = divide_capped(max(0, free_count), shortfall, dict(holding), rng)
    plan.short_of = sum(shortfall.values()) - sum(grants.values())
    for name in sorted(grants):
        count = grants[name]
        if count <= 0:
            continue
        for address in itertools.islice(free, count):
            in_use.add(address)
            put(address, Entry(name, new_id(), uid=uids[name]))
        plan.granted[name] = count

    _changes(plan, nodes, entries, listed, removals, subnet)
    reserved = sum(1 for e in entries.values() if not e.releasing)
    exhausted = next_exhausted(
        previous.exhausted, reserved, subnet.capacity, subnet.upper_percent, subnet.lower_percent
    )
    batch = _batch(subnet, len(nodes), reserved, previous)
    changes = previous.batch_changes + (previous.batch > 0 and batch != previous.batch)
    plan.status = SubnetStatus(exhausted, reserved, batch, changes)
    return plan


def _changes(
    plan: Plan,
    nodes: list[NodeView],
    entries: dict[str, Entry],
    listed: dict[str, list[_Listing]],
    removals: dict[str, list[tuple[IPConfig, bool]]],
    subnet: Subnet,
) -> None:
    """Each node's container change: its releases, plus the record's entries it does not list
    yet (this round's grants, or an earlier grant whose write did not land), except an address
    another container lists: that one waits until the duplicate is resolved."""
    uids = {node.name: node.uid for node in nodes}
    recorded: dict[str, list[tuple[str, Entry]]] = defaultdict(list)
    for address, entry in entries.items():
        if not entry.releasing and entry.uid == uids.get(entry.node):
            recorded[entry.node].append((address, entry))
    for node in nodes:
        base = node.nc
        created = None
        if base is None:
            primary = next(((a, e) for a, e in recorded[node.name] if e.primary), None)
            if primary is None:
                continue
            created = NetworkContainer(
                id=primary[1].id,
                primary_ips=(primary[0],),
                subnet=str(subnet.network),
                gateway=subnet.gateway_address,
                version=1,
                programmed_version=1,
            )
        # Only what the container lacks is sorted: parsing every address a node holds, every
        # round, was most of a round's time for a large subnet.
        missing = [
            (address, entry)
            for address, entry in recorded[node.name]
            if not entry.primary and address not in listed
        ]
        missing.sort(key=lambda item: _address_key(item[0]))
        additions = tuple(IPConfig(entry.id, address) for address, entry in missing)
        if created is None and not additions and not removals[node.name]:
            continue
        plan.additions.update(config.address for config in additions)
        if created is not None:
            plan.additions.add(created.primary_ips[0])
        plan.node_changes[node.name] = NodeChange(
            base, created, tuple(removals[node.name]), additions
        )


def _batch(subnet: Subnet, node_count: int, reserved: int, previous: SubnetStatus) -> int:
    """The utilization-aware batch (docs/design/phase4.md), from the batch the last round
    published (a new or restarted leader reads it from the ClusterSubnet status); the largest
    allowed before any."""
    if subnet.capacity <= 0 or node_count == 0:
        return max(previous.batch, 1)
    return next_batch(
        capacity=subnet.capacity,
        nodes=node_count,
        reserved=reserved,
        previous_batch=previous.batch if previous.batch > 0 else subnet.max_batch,
        node_safety_factor=subnet.node_safety_factor,
        max_batch=subnet.max_batch,
        request_threshold_percent=subnet.request_threshold_percent,
        release_threshold_percent=subnet.release_threshold_percent,
    )
