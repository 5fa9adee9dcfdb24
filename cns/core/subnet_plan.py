"""The reference control plane's decisions, as one pure function of what the API server holds.

Inputs: the subnet, every node's network container and request (its NodeNetworkConfig), and the
subnet's allocation record (`cns.core.allocation`). The record decides who holds an address; the
network containers follow it. A round:

- keeps with their node the addresses granted to a NodeNetworkConfig object that is gone (deleted,
  or replaced by a new object of the same name) while the node's Node object exists: they move to
  the node's current NodeNetworkConfig object under the same ids and are completed into it; they
  are freed only once the Node object is gone too (the caller confirmed both by direct reads);
- audits every network container against the others and the record: an address listed by two
  containers is a duplicate, one listed against the record a conflict; both are reported and the
  nodes that list it are asked to give it up (`release_requests`), which a node does only for an
  address no pod of its own uses; an address listed by one node and absent from the record (a
  subnet handed out before the record existed) is adopted; a withdrawn address a container
  lists (a node's own, granted before the node took it; a reserved one, granted before the
  reservation) is asked back the same way, and never granted again;
- releases what the nodes list in `ipsNotInUse`: the record entry is marked `releasing` and the
  address leaves the container; the entry is freed in a later round, once the container that
  listed it no longer does, together with another change to its block (or when the round needs
  the room, or, a few blocks at a time, in a round that writes no block otherwise): a free
  alone would cost a block write of its own;
- creates missing network containers (a primary IP only, docs/design/subnet-scarcity.md, 2-1)
  and grants shortfalls from free addresses, dividing scarce ones in proportion to the shortfall
  with remainder inertia (`divide_capped`, docs/design/weighted-division.md);
- completes grants the record holds but a container does not list yet (a write that did not land).

A round looks only at the nodes that changed or still need something (`plan_round` over a
`SubnetModel`, cns/core/subnet_model.py): every other node's outcome is "nothing", so the result
is the same as planning every node (`plan_subnet`), at a cost that follows the changes rather
than the subnet's size. The audit covers the addresses the model found unclean, the releases the
entries the model knows are releasing, and the free addresses come from its free space, so no
step walks every address or every node. Free addresses are granted from the blocks the round
writes anyway first, then from as few other blocks as hold them (`FreeSpace.fitting_block`),
each block lowest first.

Safety comes from the order in which the caller writes the result (see
docs/design/controller-safety.md): the record blocks first, each conditional on its
resourceVersion, then the network containers, each conditional on the resourceVersion it was read
at, keeping only the changes whose blocks were written (`NodeChange.container`). An address is
never added to a container unless its block write (a change or an unchanged re-write) succeeded
after that container was read.
"""

from __future__ import annotations

import ipaddress
import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field, replace
from sys import intern

from cns.core.allocation import Entry, Record, is_record_word
from cns.core.batch import next_batch
from cns.core.division import divide_capped
from cns.core.scaling import exhaustion_after
from cns.core.subnet import Subnet
from cns.core.subnet_model import NodeView, SubnetModel
from cns.core.types import IPConfig, NetworkContainer, SubnetStatus

__all__ = ["NodeChange", "NodeView", "Plan", "plan_round", "plan_subnet"]


# How many blocks' waiting frees a round that writes no block otherwise makes (see
# `plan_round`): the controller's concurrent writes (`cns.controller.writes.WRITE_CONCURRENCY`).
QUIET_FREE_BLOCKS = 16


def _everything(_address: str) -> bool:
    return True


def _block_order(block: int | None) -> tuple[bool, int]:
    return block is None, block or 0


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
    # Entries of a gone NNC object, node -> how many: moved to the node's current object, kept
    # while the node has none, freed because the Node is gone too.
    moved: dict[str, int] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    status: SubnetStatus = field(default_factory=SubnetStatus)
    capacity: int = 0
    short_of: int = 0  # requested but not grantable this round
    deferred: int = 0  # released entries left to free in a later round (see `plan_round`)
    # A draining subnet's: node -> addresses it still holds for pods (`held_for_pods`).
    drain_left: dict[str, int] | None = None

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


def plan_subnet(
    subnet: Subnet,
    nodes: list[NodeView],
    record: Record,
    previous: SubnetStatus,
    rng: random.Random,
    new_id: Callable[[], str],
    current_uids: Mapping[str, str | None] | None = None,
    nodes_gone: Set[str] = frozenset(),
    released_unlisted: Set[str] | None = None,
) -> Plan:
    """The whole-subnet round: a model built from scratch, every node planned. The controller
    runs it at the start of a term and now and then as a safety net; tests compare it with the
    incremental rounds."""
    model = SubnetModel.build(subnet, nodes, record)
    return plan_round(
        model,
        changed=model.take_changed(),
        previous=previous,
        rng=rng,
        new_id=new_id,
        current_uids=current_uids,
        nodes_gone=nodes_gone,
        released_unlisted=released_unlisted,
    )


def plan_round(
    model: SubnetModel,
    *,
    changed: Set[str],
    previous: SubnetStatus,
    rng: random.Random,
    new_id: Callable[[], str],
    current_uids: Mapping[str, str | None] | None = None,
    nodes_gone: Set[str] = frozenset(),
    released_unlisted: Set[str] | None = None,
) -> Plan:
    """Decide this round's record changes, container changes and subnet status; the model is
    only read. `changed` names the nodes to look at (`SubnetModel.take_changed`): any other
    node's outcome would be "nothing", so the result is the whole-subnet plan's.

    Entries are live for a node when they carry the uid of the node's NodeNetworkConfig in the
    model. For the others, `current_uids` holds what the caller read directly (not from a
    cache) for their nodes: the uid the object has now, or None if it is deleted; and
    `nodes_gone` the nodes whose Node object a direct read found deleted. An entry granted to an
    object that no longer exists belongs to its node, not to that object: its node's pods may
    still use the address. While the Node exists, the entry is kept, and moved (the same id, the
    uid of the node's current object) to the node's current object when there is one, to be
    completed into it like any grant: after the block write that records the move. Only once
    the Node is gone too is the entry freed: no write to the old object can land, and the node's
    pods are gone with it. An entry is never completed into an object whose uid it does not
    carry. Entries of nodes not confirmed yet are left as they are. Nodes are planned in name
    order.

    A draining subnet (`Subnet.draining`) grants nothing: no container, no address by name or
    by count (their requests count in `short_of`); releases and audits go on as ever, and
    `drain_left` says what each node still holds for its pods.

    A releasing entry is freed once its node's container no longer lists it. With
    `released_unlisted`, only the addresses named there count as no longer listed (the caller
    read the nodes' NNCs directly: a cached copy older than the grant would not list the
    address either); without it, the model's view is taken as current (a single writer with a
    complete view, as in `cns simulate`).
    """
    planner = _RoundPlanner(model, new_id)
    audit = planner.follow_gone_objects(current_uids or {}, nodes_gone)
    planner.choose_nodes(changed)
    planner.audit(audit)
    removals = planner.mark_releases()
    planner.choose_frees(released_unlisted)
    named = planner.set_aside_named()
    primaries = planner.create_containers()
    planner.grant_named(named, primaries)
    planner.divide_shortfalls(primaries, rng)
    planner.change_containers(removals)
    planner.make_waiting_frees()
    planner.plan.status = planner.status(previous)
    if model.subnet.draining:
        planner.plan.drain_left = planner.held_for_pods()
    return planner.plan


class _RoundPlanner:
    """The steps of `plan_round`, in the order it takes them, over what they share: the plan
    being made, the record as this round changes it, and the free space as it grants."""

    __slots__ = (
        "asked",
        "changes",
        "free",
        "listed",
        "mine",
        "model",
        "need",
        "new_id",
        "opened",
        "plan",
        "subnet",
        "taken_before",
        "uids",
        "views",
        "waiting",
    )

    def __init__(self, model: SubnetModel, new_id: Callable[[], str]) -> None:
        self.model = model
        self.new_id = new_id
        self.subnet = model.subnet
        self.plan = Plan(capacity=model.subnet.capacity)
        self.changes = self.plan.record
        self.mine: dict[str, set[str]] = defaultdict(set)  # node -> addresses recorded for it
        self.listed = model.listed
        self.asked: dict[str, set[str]] = defaultdict(set)  # node -> ids it is asked to release
        self.free = model.free.copy()
        self.views: list[NodeView] = []  # the nodes planned, by name
        self.uids: dict[str, str] = {}
        self.waiting: dict[int | None, list[str]] = defaultdict(list)  # block -> frees not made
        self.opened: list[int] = []  # blocks grants come from first (`take_next`)
        self.taken_before = 0
        self.need = 0  # addresses the planned nodes are short of

    def get(self, address: str) -> Entry | None:
        changes = self.changes
        return changes[address] if address in changes else self.model.entries.get(address)

    def put(self, address: str, entry: Entry | None) -> None:
        self.changes[address] = entry
        if entry is not None:
            self.mine[entry.node].add(address)

    def held_by(self, node: str) -> list[tuple[str, Entry]]:
        result = []
        for address in self.model.by_node.get(node, set()) | self.mine.get(node, set()):
            entry = self.get(address)
            if entry is not None and entry.node == node:
                result.append((address, entry))
        return result

    def live(self, entry: Entry | None, node: str) -> bool:
        return entry is not None and self.model.live(entry, node)

    def block_of(self, address: str) -> int | None:
        value = self.model.to_int(address)
        return None if value is None else self.free.block_of(value)

    def holding_of(self, name: str) -> int:
        return sum(
            1
            for _, e in self.held_by(name)
            if not e.primary and not e.releasing and self.live(e, name)
        )

    def follow_gone_objects(
        self, confirmed: Mapping[str, str | None], nodes_gone: Set[str]
    ) -> set[str]:
        """Move, keep or free the entries of NNC objects that are gone (`current_uids`); the
        addresses the audit looks at: the model's unclean ones and those freed here."""
        model, plan = self.model, self.plan
        audit = set(model.unclean)
        for owner, uid in confirmed.items():
            for address in model.by_node.get(owner, ()):
                orphan = model.entries[address]
                if orphan.uid == uid:
                    continue
                if owner in nodes_gone:
                    self.put(address, None)
                    audit.add(address)
                    counts = plan.left
                elif uid is None:
                    counts = plan.kept
                else:
                    self.put(address, replace(orphan, uid=uid))
                    counts = plan.moved
                counts[owner] = counts.get(owner, 0) + 1
        return audit

    def choose_nodes(self, changed: Set[str]) -> None:
        """The nodes planned: those changed, and those whose entries move here (even when
        nothing of their own changed: the moved entries are completed into their container,
        as a whole-subnet round would)."""
        model = self.model
        names = sorted(name for name in {*changed, *self.plan.moved} if name in model.nodes)
        self.views = [model.nodes[name] for name in names]
        self.uids = {view.name: view.uid for view in self.views}

    def audit(self, audit: set[str]) -> None:
        """Report an address two containers list (a duplicate) or one listed against the
        record (a conflict), asking its holders to give it up; adopt one listed by one node and
        absent from the record."""
        model, plan, asked = self.model, self.plan, self.asked
        for address in sorted(audit):
            holders = model.holders(address)
            if not holders:
                continue
            recorded = self.get(address)
            if len(holders) > 1:
                plan.duplicates[address] = tuple(sorted({h.node for h in holders}))
                for holder in holders:
                    if not holder.primary:
                        asked[holder.node].add(holder.id)
                continue
            holder = holders[0]
            if recorded is None and model.is_usable(address) and is_record_word(holder.id):
                node_uid = model.nodes[holder.node].uid
                self.put(address, Entry(holder.node, holder.id, holder.primary, uid=node_uid))
            elif recorded is None or (recorded.node, recorded.id) != (holder.node, holder.id):
                plan.conflicts[address] = (holder.node, recorded.node if recorded else "")
                if not holder.primary:
                    asked[holder.node].add(holder.id)
            elif model.is_withdrawn(address) and not holder.primary:
                asked[holder.node].add(holder.id)  # withdrawn: back once no pod uses it

    def mark_releases(self) -> dict[str, list[tuple[IPConfig, bool]]]:
        """Mark `releasing` what each planned node lists in `ipsNotInUse`; the removals from
        each container, with whether each waits for its record write."""
        plan = self.plan
        removals: dict[str, list[tuple[IPConfig, bool]]] = defaultdict(list)
        for node in self.views:
            if node.nc is None:
                continue
            leaving = set(node.request.ips_not_in_use)
            for config in node.nc.ip_configs:
                held = self.get(config.address)
                owned = held is not None and self.live(held, node.name) and held.id == config.id
                if config.id in leaving:
                    marks = held is not None and owned and not held.releasing
                    if held is not None and marks:
                        self.put(config.address, replace(held, releasing=True))
                    removals[node.name].append((config, marks))
                    plan.released[node.name] = plan.released.get(node.name, 0) + 1
                elif held is not None and owned and held.releasing:
                    removals[node.name].append((config, False))  # an earlier one did not land
        return removals

    def choose_frees(self, released_unlisted: Set[str] | None) -> None:
        """Free the released entries their container no longer lists, or let them wait.

        They are freed when their block is written anyway (this round's other changes, or its
        grants), when this round needs the room, or in a round that writes no block otherwise;
        the others wait (`plan.deferred`). A free alone costs a whole IPBlock write at the API
        server, and during a burst that write was the round after each release: the blocks of
        the nodes that released were written twice. Waiting only keeps an address out of use a
        little longer."""
        model, free, views = self.model, self.free, self.views
        get, block_of = self.get, self.block_of
        freeable = sorted(
            address
            for address in model.releasing
            if (entry := get(address)) is not None
            and entry.releasing
            and (released_unlisted is None or address in released_unlisted)
            and all(h.node != entry.node for h in model.holders(address))
        )
        writing = {block for address in self.changes if (block := block_of(address)) is not None}
        named_wanted = {address for node in views for address in node.request.requested_ips}
        self.need = sum(
            max(0, node.request.requested_ip_count - self.holding_of(node.name)) + (node.nc is None)
            for node in views
        )
        roomy = self.subnet.capacity - free.taken >= self.need
        for address in freeable:
            block = block_of(address)
            if not roomy or block in writing or address in named_wanted:
                self.put(address, None)
            else:
                self.waiting[block].append(address)
        for address, entry in self.changes.items():
            if entry is None:
                self.give_back(address)
        # Grants come first from the blocks the round writes anyway, then from the block that
        # fits what is left (`FreeSpace.fitting_block`), each block filled lowest first: a round
        # writes few blocks, whatever its grants.
        self.opened = sorted(writing)
        self.taken_before = free.taken

    def give_back(self, address: str) -> None:
        """An address the round frees is free for its grants, unless a container lists it."""
        value = self.model.to_int(address)
        if address not in self.listed and value is not None:
            self.free.give_back(value)

    def free_waiting(self, block: int) -> None:
        """Make the frees that wait in a block the round now writes."""
        for address in self.waiting.pop(block, ()):
            self.put(address, None)
            self.give_back(address)

    def take_next(self) -> str | None:
        """The next address to grant (see `choose_frees`), taken; None when none is free."""
        free, opened = self.free, self.opened
        while opened:
            value = free.lowest_in(opened[0])
            if value is not None:
                break
            opened.pop(0)
        else:
            block = free.fitting_block(max(1, self.need - (free.taken - self.taken_before)))
            if block is None:
                return None
            self.free_waiting(block)
            value = free.lowest_in(block)
            assert value is not None  # the block has room (`fitting_block`)
            opened.append(block)
        free.take(value)
        # Interned, as the caches intern theirs: the replies to the round's writes then hold
        # this very string, not a copy of it, while the plan lives.
        return intern(str(ipaddress.ip_address(value)))

    def set_aside_named(self) -> dict[str, list[str]]:
        """Set aside the addresses a node asks for by name (its pods' annotations), before
        anything else is granted, each for the first node (by name) asking; one that another
        node holds unused is asked back from it (it gives it up only if no pod of its own uses
        it). Then every release request of the round is known."""
        model, free, asked = self.model, self.free, self.asked
        named: dict[str, list[str]] = defaultdict(list)
        for node in self.views:
            for address in node.request.requested_ips:
                value = model.to_int(address)
                entry = self.get(address)
                if value is None or (entry is not None and entry.node == node.name):
                    continue
                if entry is not None:
                    if not entry.primary and not entry.releasing and self.live(entry, entry.node):
                        asked[entry.node].add(entry.id)
                elif (
                    not self.subnet.draining and address not in self.listed and free.is_free(value)
                ):
                    free.take(value)
                    named[node.name].append(address)
        self.plan.release_requests = {
            node: tuple(sorted(ids)) for node, ids in sorted(asked.items())
        }
        return named

    def create_containers(self) -> set[str]:
        """Give a node without a network container one with a primary IP; the nodes that have
        a live primary entry after this."""
        views, held_by, live = self.views, self.held_by, self.live
        primaries = {
            node.name
            for node in views
            if any(e.primary and live(e, node.name) for _, e in held_by(node.name))
        }
        # A node whose primary entry is of another NNC object (gone, or not confirmed gone yet)
        # gets its container back from that entry once it moves (the same id and primary IP):
        # until then it gets no new one, nor grants.
        returning = {
            node.name for node in views if any(e.primary for _, e in held_by(node.name))
        } - primaries
        if self.subnet.draining:
            return primaries  # no new container either: a node placed in it waits
        for node in views:
            if node.nc is None and node.name not in primaries | returning:
                first = self.take_next()
                if first is None:
                    continue  # no room even for a primary IP; retried next round
                self.put(first, Entry(node.name, self.new_id(), primary=True, uid=node.uid))
                primaries.add(node.name)
        return primaries

    def grant_named(self, named: dict[str, list[str]], primaries: set[str]) -> None:
        """Grant the addresses set aside by name to the nodes with a container; the others
        get them back into the free space (next round)."""
        for name, addresses in sorted(named.items()):
            if name not in primaries:  # no container to put them in yet: next round
                for address in addresses:
                    value = self.model.to_int(address)
                    assert value is not None
                    self.free.give_back(value)
                continue
            for address in addresses:
                self.put(address, Entry(name, self.new_id(), uid=self.uids[name]))
            self.plan.granted[name] = len(addresses)

    def divide_shortfalls(self, primaries: set[str], rng: random.Random) -> None:
        """Grant each node with a container what it is short of, dividing scarce addresses in
        proportion to the shortfall (`divide_capped`)."""
        views, plan = self.views, self.plan
        holding = {node.name: self.holding_of(node.name) for node in views}
        # Only nodes short of addresses weigh in the division: the zero-weight ones get nothing
        # and draw nothing from `rng`, so leaving the unchanged nodes out changes no grant.
        shortfall = {
            node.name: node.request.requested_ip_count - holding[node.name]
            for node in views
            if node.name in primaries and node.request.requested_ip_count > holding[node.name]
        }
        free_count = 0 if self.subnet.draining else self.subnet.capacity - self.free.taken
        grants = divide_capped(max(0, free_count), shortfall, holding, rng)
        plan.short_of = sum(shortfall.values()) - sum(grants.values())
        for name in sorted(grants):
            count = grants[name]
            if count <= 0:
                continue
            for _ in range(count):
                granted = self.take_next()
                if granted is None:
                    break
                self.put(granted, Entry(name, self.new_id(), uid=self.uids[name]))
            plan.granted[name] = plan.granted.get(name, 0) + count

    def change_containers(self, removals: dict[str, list[tuple[IPConfig, bool]]]) -> None:
        """Each planned node's container change (`_node_change`)."""
        for node in self.views:
            _node_change(
                self.plan,
                node,
                self.held_by(node.name),
                self.listed,
                removals[node.name],
                self.subnet,
            )

    def make_waiting_frees(self) -> None:
        """Make the waiting frees of the blocks the round writes; count the others deferred.
        A round that writes no block otherwise frees in a few blocks only, one wave of the
        controller's concurrent writes: changes arriving meanwhile wait for no more."""
        plan = self.plan
        written = {self.block_of(address) for address in plan.touched}
        if not written:
            written = set(sorted(self.waiting, key=_block_order)[:QUIET_FREE_BLOCKS])
        for block, addresses in self.waiting.items():
            if block in written:
                for address in addresses:
                    self.put(address, None)
            else:
                plan.deferred += len(addresses)

    def held_for_pods(self) -> dict[str, int]:
        """Node -> the addresses it holds after the round that are neither its primary IP nor
        being released (those its pods may use), for the nodes holding any."""
        model, changes = self.model, self.changes
        held: dict[str, int] = {}
        for node, addresses in model.by_node.items():
            count = sum(
                1
                for address in addresses
                if (entry := changes.get(address, model.entries.get(address))) is not None
                and entry.node == node
                and not entry.primary
                and not entry.releasing
            )
            if count:
                held[node] = count
        return held

    def status(self, previous: SubnetStatus) -> SubnetStatus:
        """The subnet's status after the round: reserved count, batch, exhaustion."""
        model, subnet = self.model, self.subnet
        reserved = model.reserved
        for address, entry in self.changes.items():
            old = model.entries.get(address)
            reserved += (entry is not None and not entry.releasing) - (
                old is not None and not old.releasing
            )
        batch = _batch(subnet, len(model.nodes), reserved, previous)
        # The nodes scale at this batch, or the operator's, once the exhaustion clears
        # (docs/design/subnet-scarcity.md, 1-2: it clears only if what they take back then
        # keeps it cleared).
        exhausted = exhaustion_after(
            previous.exhausted,
            reserved=reserved,
            once_cleared=model.reserved_once_cleared(subnet.pinned_batch or batch),
            capacity=subnet.capacity,
            upper_percent=subnet.upper_percent,
            lower_percent=subnet.lower_percent,
        )
        batch_changes = previous.batch_changes + (previous.batch > 0 and batch != previous.batch)
        return SubnetStatus(exhausted, reserved, batch, batch_changes)


def _node_change(
    plan: Plan,
    node: NodeView,
    held: list[tuple[str, Entry]],
    listed: Mapping[str, object],
    removals: list[tuple[IPConfig, bool]],
    subnet: Subnet,
) -> None:
    """The node's container change: its releases, plus the record's entries it does not list
    yet (this round's grants, or an earlier grant whose write did not land), except an address
    another container lists: that one waits until the duplicate is resolved."""
    recorded = [(a, e) for a, e in held if not e.releasing and e.uid == node.uid]
    base = node.nc
    created = None
    if base is None:
        primary = min(((a, e) for a, e in recorded if e.primary), default=None, key=_first)
        if primary is None:
            return
        created = NetworkContainer(
            id=primary[1].id,
            primary_ips=(primary[0],),
            subnet=str(subnet.network),
            gateway=subnet.gateway_address,
            version=1,
            programmed_version=1,
        )
    missing = [(a, e) for a, e in recorded if not e.primary and a not in listed]
    missing.sort(key=lambda item: _address_key(item[0]))
    additions = tuple(IPConfig(entry.id, address) for address, entry in missing)
    if created is None and not additions and not removals:
        return
    plan.additions.update(config.address for config in additions)
    if created is not None:
        plan.additions.add(created.primary_ips[0])
    plan.node_changes[node.name] = NodeChange(base, created, tuple(removals), additions)


def _first(item: tuple[str, Entry]) -> tuple[int, int]:
    return _address_key(item[0])


def _address_key(address: str) -> tuple[int, int]:
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


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
        min_ip_count=subnet.min_ip_count,
    )
