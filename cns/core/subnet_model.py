"""What the planner knows about one subnet, kept up to date change by change.

A node is in the model of each subnet it takes addresses from (its primary one, and those its
NNC asks for in `spec.subnets`), under its name: its view there is its container of that subnet
and its request of it (`cns.controller.state.node_view`), so "node" below means the node as a
member of this subnet.

Rebuilding everything from every NodeNetworkConfig and every IPBlock each round, then walking
the subnet's addresses for free ones, would cost seconds of CPU on a /12 for a change on one
node. So the model is built once per leadership term and then told what changed (`set_node`,
`remove_node`, `set_entry`); every derived structure is updated for just the addresses that change:

- the record (address -> entry) and, per node, the addresses recorded for it;
- the listings (address -> which containers list it) and the free space
  (`cns.core.freespace`): an address is in use when it is recorded or listed. Nearly every
  address is listed once, as recorded: its listing is then the record's `Entry` itself (it
  carries the same node, id and primary flag), not a `Listing` in a one-element tuple, which
  cost ~25 MiB at 5,000 nodes (docs/benchmarks.md, "Controller memory at 5,000 nodes");
- the audit: the listed addresses that are not clean (listed twice, listed against the record,
  or listed and not recorded), re-classified whenever their listing or entry changes;
- the count of reserved (recorded, not releasing) addresses, for the subnet's status;
- the addresses the nodes will hold once exhaustion clears (`reserved_once_cleared`), summed
  at the batch of the last round and updated node by node, so that deciding whether the
  exhaustion may clear does not walk every node each round;
- which nodes changed since the last round (`take_changed`) and which still need a round after
  it (`settle`): a node with no container, a release pending, a grant that is short or that its
  container does not list yet. Every other node's outcome of a round is "nothing", so the
  planner (`cns.core.subnet_plan.plan_round`) looks only at the nodes these two sets name.
  A round that could grant more than a limit plans them in slices (`take_slice`), unless the
  subnet is short.

The model is a cache, not a source of truth: now and then the controller checks it against the
objects it was built from (`PlanningState.differences`, `inconsistencies`) as a safety net;
`differences` compares two models (the tests compare one kept up to date with one built fresh).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cns.core.allocation import Entry
from cns.core.freespace import FreeSpace
from cns.core.scaling import reserved_once_cleared
from cns.core.subnet import Subnet
from cns.core.types import NetworkContainer, PoolRequest


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the API server has it: its NNC's network container and spec."""

    name: str
    nc: NetworkContainer | None
    request: PoolRequest
    uid: str = ""  # of the NodeNetworkConfig object


@dataclass(frozen=True, slots=True)
class Listing:
    node: str
    id: str
    primary: bool


# How a container lists an address: a `Listing`, or the record's entry for the address when it
# says the same (node, id, primary); both answer `.node`, `.id` and `.primary`.
Holder = Listing | Entry


def _same(a: Holder, b: Holder) -> bool:
    return a.node == b.node and a.id == b.id and a.primary == b.primary


def _key(holder: Holder) -> tuple[str, str, bool]:
    return holder.node, holder.id, holder.primary


def listings_of(view: NodeView) -> list[tuple[str, Listing]]:
    """The addresses a node's container lists, with how it lists each."""
    if view.nc is None:
        return []
    result = [(address, Listing(view.name, view.nc.id, True)) for address in view.nc.primary_ips]
    result += [(c.address, Listing(view.name, c.id, False)) for c in view.nc.ip_configs]
    return result


def address_int(address: str, version: int) -> int | None:
    """The address as an integer, None unless it is an address of that IP version in its
    canonical spelling.

    IPv4 goes through `inet_pton`, which accepts exactly what `ipaddress` accepts for IPv4
    (four decimal octets, no leading zeros) at a fraction of the cost: building a model of a
    /12 parses hundreds of thousands of addresses."""
    if version == 4:
        try:
            return int.from_bytes(socket.inet_pton(socket.AF_INET, address), "big")
        except (OSError, ValueError, TypeError):
            return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    # One spelling per address: `FD00::3` or `fd00:0::3` would otherwise be the integer of
    # `fd00::3` under another string key, and freeing it could free an address held by another.
    if ip.version != version or str(ip) != address:
        return None
    return int(ip)


class SubnetModel:
    """The incremental state of one subnet's allocation (see the module docstring)."""

    def __init__(self, subnet: Subnet) -> None:
        self.subnet = subnet
        self.nodes: dict[str, NodeView] = {}
        self.entries: dict[str, Entry] = {}
        self.by_node: dict[str, set[str]] = {}
        # address -> its one holder, or a tuple of two or more (`holders`).
        self.listed: dict[str, Holder | tuple[Holder, ...]] = {}
        self.free = FreeSpace.of(subnet)
        self.reserved = 0
        self.releasing: set[str] = set()
        self.unclean: set[str] = set()  # listed addresses the audit reports or adopts
        self.changed: set[str] = set()
        self.attention: set[str] = set()
        self.waiting: set[str] = set()  # left out of the last round by `take_slice`
        self._stale: set[str] = set()
        self._version = subnet.network.version
        # The sum of `_once_cleared` over the nodes, at `_cleared_batch` (0: not computed).
        self._cleared_batch = 0
        self._cleared_scaler = subnet.node_scaler(1)
        self._cleared_sum = 0

    @classmethod
    def build(
        cls, subnet: Subnet, nodes: Iterable[NodeView], record: Mapping[str, Entry]
    ) -> SubnetModel:
        """The model of a snapshot; every node counts as changed. The same result as telling
        an empty model every entry and node, in one pass over each."""
        model = cls(subnet)
        model.entries = dict(record)
        for address, entry in model.entries.items():
            model.by_node.setdefault(entry.node, set()).add(address)
            if entry.releasing:
                model.releasing.add(address)
        model.reserved = len(model.entries) - len(model.releasing)
        for view in nodes:
            model.nodes[view.name] = view
            for address, listing in listings_of(view):
                model._set_holders(address, (*model.holders(address), listing))
        free = model.free
        for address in model.entries.keys() | model.listed.keys():
            value = model.to_int(address)
            if value is not None and free.is_usable(value):
                free.take(value)
        for address in model.listed:
            model._audit(address)
        model.changed = set(model.nodes) | set(model.by_node)
        return model

    # -- what the planner reads ------------------------------------------------------------

    def to_int(self, address: str) -> int | None:
        return address_int(address, self._version)

    def holders(self, address: str) -> tuple[Holder, ...]:
        """How the containers list `address`: empty when none does."""
        held = self.listed.get(address)
        if held is None:
            return ()
        return held if isinstance(held, tuple) else (held,)

    def is_usable(self, address: str) -> bool:
        """`Subnet.is_usable`, answered from the free space's unusable masks."""
        value = self.to_int(address)
        return value is not None and self.free.is_usable(value)

    def live(self, entry: Entry | None, node: str) -> bool:
        """Whether `entry` is held by `node`'s current NodeNetworkConfig object."""
        view = self.nodes.get(node)
        if entry is None or view is None:
            return False
        return entry.node == node and entry.uid == view.uid

    def reserved_once_cleared(self, batch: int) -> int:
        """What the nodes will hold, primary IPs included, once exhaustion clears and they
        scale at `batch` again (`cns.core.scaling.reserved_once_cleared`, summed). Kept up to
        date by `set_node` and `remove_node`; computed over every node only when the batch is
        not the one of the last call, which the phase-4 rule changes a few times a term."""
        if batch != self._cleared_batch:
            self._cleared_batch = batch
            self._cleared_scaler = self.subnet.node_scaler(batch)
            self._cleared_sum = sum(map(self._once_cleared, self.nodes.values()))
        return self._cleared_sum

    def _once_cleared(self, view: NodeView) -> int:
        # A node without a container yet gets one with a primary IP (phase 2-1).
        primaries = len(view.nc.primary_ips) if view.nc is not None else 1
        requested = view.request.requested_ip_count
        return reserved_once_cleared(self._cleared_scaler, requested, primaries)

    def _recount(self, old: NodeView | None, new: NodeView | None) -> None:
        if self._cleared_batch:
            self._cleared_sum += (0 if new is None else self._once_cleared(new)) - (
                0 if old is None else self._once_cleared(old)
            )

    def stale_owners(self) -> set[str]:
        """Nodes holding entries of another NNC object than the one the model has (or none):
        the caller confirms by a direct read whether that object is gone. Up to date for the
        nodes changed before the last `take_changed`."""
        return set(self._stale)

    def node_addresses_held(self) -> dict[str, tuple[str, ...]]:
        """The nodes' own addresses (`Subnet.node_ips`) that the record or a container still
        gives to a node's pods, with the nodes that hold each: granted before a node took the
        address. Never taken away here (a pod may use it: the audit asks its holder to give it
        up, which a node does only if none does); the caller reports each one."""
        held: dict[str, tuple[str, ...]] = {}
        for address in sorted(self.subnet.node_ips):
            entry = self.entries.get(address)
            nodes = {holder.node for holder in self.holders(address)}
            if entry is not None:
                nodes.add(entry.node)
            if nodes:
                held[address] = tuple(sorted(nodes))
        return held

    def reserved_addresses_held(self) -> dict[str, tuple[str, ...]]:
        """The reserved addresses (`Subnet.reservations`) that containers still list, with the
        nodes that list each: granted before the reservation was added. Never taken away here,
        as a node's own address (`node_addresses_held`): the audit asks them back, and they are
        never granted again. Read from `unclean`, where every listed withdrawn address is."""
        reservations = self.subnet.reservations
        held: dict[str, tuple[str, ...]] = {}
        if not reservations.firsts:
            return held
        for address in sorted(self.unclean):
            value = self.to_int(address)
            if value is not None and reservations.holds(value):
                held[address] = tuple(sorted({holder.node for holder in self.holders(address)}))
        return held

    def is_withdrawn(self, address: str) -> bool:
        """Whether `address` is one a node may still hold but that is never granted again: a
        node's own, or reserved (a reservation may be added over addresses pods hold)."""
        if address in self.subnet.node_ips:
            return True
        reservations = self.subnet.reservations
        if not reservations.firsts:  # no integer to compute: a model's build asks every address
            return False
        value = self.to_int(address)
        return value is not None and reservations.holds(value)

    def _is_stale(self, node: str) -> bool:
        view = self.nodes.get(node)
        uid = view.uid if view is not None else None
        return any(self.entries[a].uid != uid for a in self.by_node.get(node, ()))

    def needs_attention(self, name: str) -> bool:
        """Whether a round would do anything for this node (see the module docstring)."""
        view = self.nodes.get(name)
        if view is None:
            return False
        if view.nc is None:
            return True
        leaving = set(view.request.ips_not_in_use)
        if leaving and any(c.id in leaving for c in view.nc.ip_configs):
            return True
        holding = 0
        held = self.by_node.get(name, set())
        for address in held:
            entry = self.entries[address]
            if entry.releasing:
                return True
            if entry.primary or entry.uid != view.uid:
                continue
            holding += 1
            if address not in self.listed:
                return True  # a grant its container does not list yet
        if any(address not in held for address in view.request.requested_ips):
            return True  # an address asked for by name, not had yet
        return view.request.requested_ip_count > holding

    # -- what changes it -------------------------------------------------------------------

    def set_node(self, view: NodeView) -> None:
        old = self.nodes.get(view.name)
        if old == view:
            return
        self._relist(view.name, old, view)
        self._recount(old, view)
        self.nodes[view.name] = view
        self.changed.add(view.name)

    def remove_node(self, name: str) -> None:
        old = self.nodes.pop(name, None)
        if old is not None:
            self._relist(name, old, None)
            self._recount(old, None)
            self.changed.add(name)

    def set_entry(self, address: str, entry: Entry | None) -> None:
        old = self.entries.get(address)
        if old == entry:
            return
        if old is not None:
            self.by_node[old.node].discard(address)
            if not self.by_node[old.node]:
                del self.by_node[old.node]
            self.reserved -= not old.releasing
            self.releasing.discard(address)
            self.changed.add(old.node)
            del self.entries[address]
        if entry is not None:
            self.entries[address] = entry
            self.by_node.setdefault(entry.node, set()).add(address)
            self.reserved += not entry.releasing
            if entry.releasing:
                self.releasing.add(address)
            self.changed.add(entry.node)
            held = self.listed.get(address)
            if held is not None and not isinstance(held, tuple) and _same(held, entry):
                self.listed[address] = entry  # the entry stands for its listing (see above)
        self._in_use_changed(address)
        self._audit(address)

    def apply(self, changes: Mapping[str, Entry | None]) -> None:
        for address, entry in changes.items():
            self.set_entry(address, entry)

    def take_changed(self) -> set[str]:
        """The nodes a round must look at: changed since the last round, or still needing one."""
        changed, self.changed = self.changed, set()
        for node in changed:
            if self._is_stale(node):
                self._stale.add(node)
            else:
                self._stale.discard(node)
        return changed | self.attention

    def take_slice(self, changed: set[str], limit: int) -> set[str]:
        """The nodes of `changed` (`take_changed`) a round plans now; the others stay changed
        and go first in the next round.

        A round that grants thousands of nodes at once (a cluster's start) held every new
        address in its plan and in the writes' replies together: the leader's memory peak, and
        the interpreter keeps the memory once freed. So a round plans nodes that together could
        be granted at most `limit` addresses (`demand`; at least one node). Not when the subnet
        is short, when those nodes could together be granted more than is free: the scarce
        addresses are then divided among all of them in one round, as before
        (`divide_capped`), so that no node is left out of the division because of its place in
        the order. With room for every grant, each node gets its whole shortfall whichever
        round plans it: slicing changes when a node is granted, never what."""
        demands = {name: self.demand(name) for name in changed}
        total = sum(demands.values())
        if total <= limit or total > self.subnet.capacity - self.free.taken:
            self.waiting = set()
            return changed
        planned: set[str] = set()
        granted = 0
        for name in sorted(changed, key=lambda name: (name not in self.waiting, name)):
            if planned and granted + demands[name] > limit:
                break
            planned.add(name)
            granted += demands[name]
        self.waiting = changed - planned
        self.changed |= self.waiting
        return planned

    def demand(self, name: str) -> int:
        """At most how many free addresses a round could grant the node: a primary IP when it
        has no container, the addresses it asks for by name and its shortfall, counting the
        addresses it gives back as not held (a round's releases only free addresses)."""
        view = self.nodes.get(name)
        if view is None:
            return 0
        request = view.request
        leaving = set(request.ips_not_in_use)
        holding = 0
        for address in self.by_node.get(name, ()):
            entry = self.entries[address]
            live = entry.uid == view.uid and entry.id not in leaving
            holding += live and not entry.primary and not entry.releasing
        shortfall = max(0, request.requested_ip_count - holding)
        return (view.nc is None) + len(request.requested_ips) + shortfall

    def settle(self, planned: Iterable[str]) -> None:
        """After a round over `planned` (and whatever of it the caller applied): keep the nodes
        that still need a round."""
        planned = set(planned)
        self.attention -= planned
        self.attention.update(name for name in planned if self.needs_attention(name))

    # -- internals ---------------------------------------------------------------------------

    def _relist(self, name: str, old: NodeView | None, new: NodeView | None) -> None:
        before = listings_of(old) if old is not None else []
        after = listings_of(new) if new is not None else []
        if before == after:
            return
        affected = set()
        for address, _ in before:
            self._set_holders(address, tuple(h for h in self.holders(address) if h.node != name))
            affected.add(address)
        for address, listing in after:
            self._set_holders(address, (*self.holders(address), listing))
            affected.add(address)
        for address in affected:
            self._in_use_changed(address)
            self._audit(address)
            entry = self.entries.get(address)
            if entry is not None:
                self.changed.add(entry.node)

    def _set_holders(self, address: str, holders: tuple[Holder, ...]) -> None:
        """Keep `holders` as the address's listing: one alone as the record's entry when that
        says the same, else as it is."""
        if len(holders) > 1:
            self.listed[address] = holders
        elif holders:
            entry = self.entries.get(address)
            self.listed[address] = (
                entry if entry is not None and _same(entry, holders[0]) else holders[0]
            )
        else:
            self.listed.pop(address, None)

    def _in_use_changed(self, address: str) -> None:
        value = self.to_int(address)
        if value is None or not self.free.is_usable(value):
            return
        if address in self.entries or address in self.listed:
            self.free.take(value)
        else:
            self.free.give_back(value)

    def _is_unclean(self, address: str) -> bool:
        """Listed, and not exactly once by the container of the node its entry names, or
        withdrawn: a node's own address or a reserved one (the audit asks it back)."""
        held = self.listed.get(address)
        if held is None:
            return False
        if isinstance(held, tuple) or self.is_withdrawn(address):
            return True  # listed twice or more, or withdrawn
        recorded = self.entries.get(address)
        if recorded is held:
            return False
        return recorded is None or (recorded.node, recorded.id) != (held.node, held.id)

    def _audit(self, address: str) -> None:
        if self._is_unclean(address):
            self.unclean.add(address)
        else:
            self.unclean.discard(address)

    def inconsistencies(self) -> list[str]:
        """Which derived structures disagree with the model's own nodes and entries (see the
        module docstring): empty when the incremental updates kept them right. Checked address
        by address, building nothing the size of the model: with `PlanningState.differences`,
        the periodic safety net, without a second model to compare with."""
        found = []
        entries = self.entries
        filed = sum(address in self.by_node.get(e.node, ()) for address, e in entries.items())
        if filed != len(entries) or sum(map(len, self.by_node.values())) != len(entries):
            found.append("by_node")
        releasing = [address for address, entry in entries.items() if entry.releasing]
        if len(releasing) != len(self.releasing) or not self.releasing.issuperset(releasing):
            found.append("releasing")
        if self.reserved != len(entries) - len(releasing):
            found.append("reserved")
        if self._cleared_batch and self._cleared_sum != sum(
            map(self._once_cleared, self.nodes.values())
        ):
            found.append("once_cleared")
        listings = 0
        for view in self.nodes.values():
            for address, listing in listings_of(view):
                listings += 1
                if not any(_same(listing, h) for h in self.holders(address)):
                    listings = -1
                    break
            if listings < 0:
                break
        held = (len(h) if isinstance(h, tuple) else 1 for h in self.listed.values())
        if listings != sum(held):
            found.append("listed")
        unclean = 0
        for address in self.listed:
            if self._is_unclean(address) != (address in self.unclean):
                unclean = -1
                break
            unclean += address in self.unclean
        if unclean != len(self.unclean):
            found.append("unclean")
        taken = 0
        free = self.free
        for addresses in (self.entries, (a for a in self.listed if a not in self.entries)):
            for address in addresses:
                value = self.to_int(address)
                if value is not None and free.is_usable(value):
                    taken += 1
                    if free.is_free(value):
                        taken = -1
                        break
            if taken < 0:
                break
        if taken != free.taken:
            found.append("free")
        return found

    def differences(self, other: SubnetModel) -> list[str]:
        """What differs from `other` (one built from scratch): empty when the model is right."""
        found = []
        for what, mine, theirs in (
            ("nodes", self.nodes, other.nodes),
            ("entries", self.entries, other.entries),
            ("by_node", self.by_node, other.by_node),
            ("listed", _sorted_listings(self), _sorted_listings(other)),
            ("reserved", self.reserved, other.reserved),
            ("releasing", self.releasing, other.releasing),
            ("unclean", self.unclean, other.unclean),
            ("free", self.free, other.free),
        ):
            if mine != theirs:
                found.append(what)
        return found


def _sorted_listings(model: SubnetModel) -> dict[str, list[tuple[str, str, bool]]]:
    """The listings by what they say, whichever object says it."""
    return {a: sorted(map(_key, model.holders(a))) for a in model.listed}
