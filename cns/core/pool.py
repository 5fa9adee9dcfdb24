"""The node's IP pool: records, their states and the transitions between them.

Pure and synchronous: the daemon owns one `Pool`, calls these methods from its event loop, and
persists what they return. The invariants the property tests prove:
- an IP has at most one owner, and an owner at most one IP per interface;
- an `Assigned` IP is never released, dropped or changed by the control plane's updates;
- a `PendingRelease` IP is never handed to a pod;
- an IP a pod gave back is not handed out again before its cooldown ends (`Cooldown`);
- an IP no network container lists now (`withdraw`, or left out of its container's listing)
  is never handed out: a pod that holds one keeps it, and its release drops it.

Cooldown ends are wall-clock seconds (`time.time()`), since they are kept across restarts; the
caller passes "now" in, and the pool never reads a clock.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field

from cns.core.scaling import next_request
from cns.core.types import IPConfig, IPState, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler


@dataclass(slots=True)
class IPRecord:
    """One secondary IP in the pool."""

    id: str
    address: str
    nc_id: str
    state: IPState
    owner: Owner | None = None
    version: int = 0


@dataclass(frozen=True, slots=True)
class Assignment:
    """A durable fact: this owner holds this IP. The store persists exactly these."""

    ip_id: str
    address: str
    nc_id: str
    owner: Owner
    # The lane the IP belongs to: "" for the primary subnet, else the further subnet's name.
    # An owner holds at most one IP per lane.
    subnet: str = ""


@dataclass(frozen=True, slots=True)
class NCChange:
    """What applying a network container did, for logs and metrics."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    programmed: tuple[str, ...] = ()
    inconsistencies: tuple[str, ...] = ()
    stale: bool = False  # older than the version already applied: ignored
    # (old IP id, new IP id): assigned IPs no container listed, listed again by this one under
    # a new id; the holder keeps the address, recorded under the new id and container.
    rehomed: tuple[tuple[str, str], ...] = ()
    # IP id -> (end, pod): cooldowns of a withdrawn container's IPs, carried over by address
    # to the IP ids this container lists them under (for the caller to persist).
    cooldowns_moved: tuple[tuple[str, float, str], ...] = ()


class AddressUnavailable(Exception):
    """A pod asked for an address the pool cannot give it now; the message says why."""


class OwnerConflict(Exception):
    """An assignment for an attachment that another pod already holds (see `Owner.conflicts_with`).

    Relabelling would hand a running pod's IP to whichever pod asked last under the same
    container ID and interface; the caller reports the conflict instead, and nothing changes.
    """

    def __init__(self, holder: Owner, asked: Owner) -> None:
        super().__init__(f"{holder.key} belongs to pod {holder.pod}, not {asked.pod}")
        self.holder = holder
        self.asked = asked


@dataclass(slots=True)
class Pool:
    """All secondary IPs of the node, indexed for O(1) assign and release."""

    records: dict[str, IPRecord] = field(default_factory=dict)
    containers: dict[str, NetworkContainer] = field(default_factory=dict)
    _by_owner: dict[OwnerKey, str] = field(default_factory=dict)
    # Container ID -> interface -> IP id: one container is one pod, whichever interface it asks.
    _by_container: dict[str, dict[str, str]] = field(default_factory=dict)
    # Insertion-ordered set of Available ids: assign takes the IP freed longest ago, so a
    # just-released IP is not reused at once (stale ARP/conntrack entries die first).
    _available: dict[str, None] = field(default_factory=dict)
    _pending_release: set[str] = field(default_factory=set)
    # IPs the control plane asks back that a pod held when asked (`ask_back`): released by
    # their pod, they go straight to `PendingRelease`, never to the next pod here.
    _asked_back: set[str] = field(default_factory=set)
    # IP id -> when its cooldown ends, also for ids not (yet) in `records` (restored at start),
    # and the pod (namespace/name) that gave it back, which may have it again at once.
    _cooling: dict[str, float] = field(default_factory=dict)
    _cooled_pod: dict[str, str] = field(default_factory=dict)
    # The lane this pool is (Assignment.subnet): "" for the primary subnet.
    subnet: str = ""
    # Containers the control plane no longer lists whose IPs pods still hold, by id (what an
    # ADD's result names for those IPs); each goes with its last IP.
    withdrawn: dict[str, NetworkContainer] = field(default_factory=dict)
    # Assigned IPs that no listed container lists now: never made available again.
    _unlisted: set[str] = field(default_factory=set)
    # Address -> (end, pod): the cooldown of an IP whose container was withdrawn, for the IP
    # id a container lists that address under next.
    _withdrawn_cooling: dict[str, tuple[float, str]] = field(default_factory=dict)

    # -- queries -------------------------------------------------------------------------------

    @property
    def primary_ip_count(self) -> int:
        return sum(len(nc.primary_ips) for nc in self.containers.values())

    def counts(self) -> dict[IPState, int]:
        result = dict.fromkeys(IPState, 0)
        for record in self.records.values():
            result[record.state] += 1
        return result

    def assigned_count(self) -> int:
        return len(self._by_owner)

    def available_count(self) -> int:
        return len(self._available)

    def cooling_count(self) -> int:
        return sum(1 for ip_id in self._cooling if self._is_cooling(ip_id))

    def cooldown_end(self, ip_id: str) -> float | None:
        """When the IP's cooldown ends; None when it is not cooling down."""
        return self._cooling[ip_id] if self._is_cooling(ip_id) else None

    def next_cooldown_end(self) -> float | None:
        """The earliest end of a cooldown in progress; None when no IP cools down."""
        return min((t for i, t in self._cooling.items() if self._is_cooling(i)), default=None)

    def _is_cooling(self, ip_id: str) -> bool:
        record = self.records.get(ip_id)
        return record is not None and record.state is IPState.COOLDOWN

    def held_for_pods(self) -> int:
        """Secondary IPs pods hold or gave back less than a cooldown ago: what a draining
        subnet's lane keeps (`plan`)."""
        return self.assigned_count() + self.cooling_count()

    def held_count(self) -> int:
        """Secondary IPs the node keeps going forward (everything not being released)."""
        return len(self.records) - len(self._pending_release)

    def ips_not_in_use(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending_release))

    def lookup(self, key: OwnerKey) -> IPRecord | None:
        ip_id = self._by_owner.get(key)
        return None if ip_id is None else self.records[ip_id]

    def held_by_container(self, container_id: str) -> list[IPRecord]:
        """The IPs held by any interface of the container."""
        interfaces = self._by_container.get(container_id, {})
        return [self.records[ip_id] for ip_id in interfaces.values()]

    def owners(self) -> Iterator[OwnerKey]:
        return iter(list(self._by_owner))

    def network_container(self, nc_id: str) -> NetworkContainer | None:
        """A listed container, or a withdrawn one whose IPs pods still hold."""
        return self.containers.get(nc_id) or self.withdrawn.get(nc_id)

    def unlisted(self) -> tuple[IPRecord, ...]:
        """The assigned IPs no listed container lists now (their pods keep them until DEL)."""
        return tuple(self.records[ip_id] for ip_id in sorted(self._unlisted))

    # -- pod verbs -----------------------------------------------------------------------------

    def assign(self, owner: Owner) -> tuple[IPRecord | None, bool]:
        """Give `owner` an IP. Returns (record, changed); (None, False) when none is free.

        Idempotent: an owner that already holds an IP gets the same one back; pod name and
        namespace learnt later are recorded (and reported as a change to persist). Raises
        OwnerConflict, changing nothing, when the holder names a different pod.
        """
        existing = self.lookup(owner.key)
        if existing is not None:
            holder = existing.owner
            assert holder is not None
            if holder.conflicts_with(owner):
                raise OwnerConflict(holder, owner)
            if holder != owner and owner.pod_name:
                existing.owner = owner
                return existing, True
            return existing, False
        if not self._available:
            return None, False
        return self._give(next(iter(self._available)), owner), True

    def assign_address(self, owner: Owner, address: str) -> tuple[IPRecord, bool]:
        """Give `owner` the IP with this `address` (the CNI `ips` capability, `IP=` in
        CNI_ARGS). Returns (record, changed). Idempotent like `assign`. Raises
        AddressUnavailable saying why when it cannot be had now (`address_problem`);
        OwnerConflict as `assign` does."""
        problem = self.address_problem(owner, address)
        if problem is not None:
            raise AddressUnavailable(problem)
        if self.lookup(owner.key) is not None:
            kept, changed = self.assign(owner)
            assert kept is not None
            return kept, changed
        record = next(r for r in self.records.values() if r.address == address)
        if record.state is IPState.COOLDOWN:
            self._forget_cooldown(record.id)
        self._available.pop(record.id, None)
        return self._give(record.id, owner), True

    def adopt(self, ip_id: str, owner: Owner) -> IPRecord:
        """Give `owner` an IP no pod holds, whatever its state: a live pod uses it (the world
        says so, cns/core/worldcheck.py), so a cooldown, a release or a programming in progress
        no longer applies. The caller has checked that no pod holds it and that `owner` holds
        no IP of this pool."""
        record = self.records[ip_id]
        assert record.state is not IPState.ASSIGNED and owner.key not in self._by_owner
        self._forget_cooldown(ip_id)
        self._pending_release.discard(ip_id)
        return self._give(ip_id, owner)

    def address_problem(self, owner: Owner, address: str) -> str | None:
        """Why `assign_address` cannot give `owner` this address now, or None (changing
        nothing, so that an ADD of several subnets checks every lane before it takes any):
        not in the pool, held by another pod, being released, not programmed yet, or in
        cooldown (unless this same pod gave it back: the cooldown protects other pods from its
        traffic, not the pod itself)."""
        existing = self.lookup(owner.key)
        if existing is not None:
            if existing.address == address:
                return None
            return (
                f"container {owner.container_id} interface {owner.ifname} already holds "
                f"{existing.address}, not {address}"
            )
        record = next((r for r in self.records.values() if r.address == address), None)
        if record is None:
            return f"{address} is not in this node's pool"
        if record.state is IPState.ASSIGNED:
            holder = record.owner
            assert holder is not None
            who = f"pod {holder.pod}" if holder.pod else f"container {holder.container_id}"
            return f"{address} is assigned to {who}"
        if record.state is IPState.PENDING_RELEASE:
            return f"{address} is being given back to the control plane"
        if record.state is IPState.PENDING_PROGRAMMING:
            return f"{address} is not programmed yet; try again shortly"
        if record.state is IPState.COOLDOWN and (
            not owner.pod or self._cooled_pod.get(record.id) != owner.pod
        ):
            return (
                f"{address} is in cooldown until {self._cooling[record.id]:.3f} (epoch "
                "seconds): another pod gave it back; only that pod may have it earlier"
            )
        return None

    def _give(self, ip_id: str, owner: Owner) -> IPRecord:
        self._available.pop(ip_id, None)
        record = self.records[ip_id]
        record.state = IPState.ASSIGNED
        record.owner = owner
        self._index(owner.key, ip_id)
        return record

    def _index(self, key: OwnerKey, ip_id: str) -> None:
        self._by_owner[key] = ip_id
        self._by_container.setdefault(key.container_id, {})[key.ifname] = ip_id

    def _unindex(self, key: OwnerKey) -> str | None:
        ip_id = self._by_owner.pop(key, None)
        if ip_id is not None:
            interfaces = self._by_container[key.container_id]
            del interfaces[key.ifname]
            if not interfaces:
                del self._by_container[key.container_id]
        return ip_id

    def release(self, key: OwnerKey, *, cool_until: float = 0.0) -> IPRecord | None:
        """Take back the owner's IP; with `cool_until`, it is not handed out again before then
        (`Cooldown`). Idempotent: an unknown owner releases nothing."""
        ip_id = self._unindex(key)
        if ip_id is None:
            return None
        record = self.records[ip_id]
        owner, record.owner = record.owner, None
        if ip_id in self._unlisted:  # no container lists it: it leaves the pool
            self._drop(ip_id)
            self._forget_withdrawn()
            return record
        if cool_until:
            self._cooling[ip_id] = cool_until
            if owner is not None and owner.pod:
                self._cooled_pod[ip_id] = owner.pod
        nc = self.containers.get(record.nc_id)
        if nc is not None and record.version > nc.programmed_version:
            record.state = IPState.PENDING_PROGRAMMING
        else:
            self._make_available(record)
        return record

    def _forget_cooldown(self, ip_id: str) -> None:
        self._cooling.pop(ip_id, None)
        self._cooled_pod.pop(ip_id, None)

    def _make_available(self, record: IPRecord) -> None:
        """An IP no pod holds becomes `Available`, or `Cooldown` until its cooldown ends; one
        the control plane asked back (`ask_back`) becomes `PendingRelease`."""
        if record.id in self._asked_back:
            self._asked_back.discard(record.id)
            self._forget_cooldown(record.id)
            record.state = IPState.PENDING_RELEASE
            self._pending_release.add(record.id)
        elif record.id in self._cooling:
            record.state = IPState.COOLDOWN
        else:
            record.state = IPState.AVAILABLE
            self._available[record.id] = None

    def cooled_pod(self, ip_id: str) -> str:
        """The pod that gave back an IP in cooldown ("" if none was named)."""
        return self._cooled_pod.get(ip_id, "")

    def restore_cooldowns(
        self, ends: Mapping[str, tuple[float, str]], *, now: float, longest: float
    ) -> None:
        """Cooldowns read from durable state (end, pod that gave the IP back), before any
        network container is known. One that ends more than `longest` seconds from `now` (the
        wall clock went back) ends then."""
        for ip_id, (end, pod) in ends.items():
            if end > now:
                self._cooling[ip_id] = min(end, now + longest)
                if pod:
                    self._cooled_pod[ip_id] = pod

    def expire_cooldowns(self, *, now: float, longest: float) -> tuple[str, ...]:
        """End the cooldowns due at `now` (and any more than `longest` seconds away: the clock
        went back); their IPs become `Available`. Returns their ids."""
        due = [i for i, end in self._cooling.items() if end <= now or end > now + longest]
        for address, (end, _) in list(self._withdrawn_cooling.items()):
            if end <= now or end > now + longest:
                del self._withdrawn_cooling[address]
        ended = []
        for ip_id in due:
            self._forget_cooldown(ip_id)
            record = self.records.get(ip_id)
            if record is not None and record.state is IPState.COOLDOWN:
                self._make_available(record)
                ended.append(ip_id)
        return tuple(ended)

    def restore(self, assignment: Assignment) -> None:
        """Re-create an assignment read from durable state, before any network container is known.

        The record is unlisted until an `apply_nc` lists it: released before, it is dropped.
        """
        assert assignment.subnet == self.subnet, f"{assignment} is not of lane {self.subnet!r}"
        record = IPRecord(
            id=assignment.ip_id,
            address=assignment.address,
            nc_id=assignment.nc_id,
            state=IPState.ASSIGNED,
            owner=assignment.owner,
        )
        self.records[record.id] = record
        self._index(assignment.owner.key, record.id)
        if assignment.nc_id not in self.containers:
            self._unlisted.add(record.id)

    def follow(
        self, durable: Mapping[str, Assignment]
    ) -> tuple[list[Assignment], list[Assignment]]:
        """Make the assignments exactly `durable`'s of this lane (what the state file records,
        by IP id).

        After a commit failed, memory must not keep what the disk refused (an assignment is
        undone) nor lose what it still holds (a failed release is taken back). Returns (undone,
        retaken). An IP the pool no longer lists is restored provisionally, as at start-up.
        """
        durable = {i: a for i, a in durable.items() if a.subnet == self.subnet}
        undone = [a for a in self.assignments() if durable.get(a.ip_id) != a]
        for assignment in undone:
            self.release(assignment.owner.key)
        retaken = []
        for assignment in durable.values():
            record = self.records.get(assignment.ip_id)
            if record is None:
                self._drop_free_address(assignment.address)  # re-homed under another id
                self.restore(assignment)
            elif record.state is IPState.ASSIGNED:
                continue  # every assignment left after the undo is a durable one
            else:
                self._available.pop(record.id, None)
                self._pending_release.discard(record.id)
                self._forget_cooldown(record.id)
                record.state = IPState.ASSIGNED
                record.owner = assignment.owner
                self._index(assignment.owner.key, record.id)
            retaken.append(assignment)
        return undone, retaken

    def _drop_free_address(self, address: str) -> None:
        """Drop the IP no pod holds that has `address`, if there is one."""
        for record in list(self.records.values()):
            if record.address == address and record.state is not IPState.ASSIGNED:
                self._drop(record.id)

    # -- control-plane updates -----------------------------------------------------------------

    def apply_nc(self, nc: NetworkContainer) -> NCChange:
        """Bring the pool in line with the control plane's view of one network container.

        New IPs are added (`PendingProgramming` until their version is programmed); IPs the
        control plane dropped leave the pool, which completes the release handshake for
        `PendingRelease` ones. An `Assigned` IP is never dropped or changed: that would take a
        running pod's address, so it is kept and reported as an inconsistency.

        A version older than the one applied is ignored: updates can arrive out of order (a
        watch event and an API reply race), and going back would drop IPs that are in use.
        """
        current = self.containers.get(nc.id)
        if current is not None and nc.version < current.version:
            return NCChange(stale=True)
        self.withdrawn.pop(nc.id, None)  # listed again
        added: list[str] = []
        programmed: list[str] = []
        problems: list[str] = []
        wanted: dict[str, IPConfig] = {}
        seen_addresses: dict[str, str] = {}
        for config in nc.ip_configs:
            other = seen_addresses.get(config.address)
            if other is not None:
                problems.append(f"address {config.address} listed twice ({other}, {config.id})")
                continue
            seen_addresses[config.address] = config.id
            wanted[config.id] = config

        removed: list[str] = []
        for record in [r for r in self.records.values() if r.nc_id == nc.id]:
            listed = wanted.get(record.id)
            if listed is None or listed.address != record.address:
                if record.state is IPState.ASSIGNED:
                    if record.id not in self._unlisted:
                        problems.append(
                            f"assigned IP {record.address} ({record.id}) "
                            + ("missing from" if listed is None else "readdressed in")
                            + f" network container {nc.id} version {nc.version}; kept until "
                            "its release"
                        )
                    self._unlisted.add(record.id)
                    wanted.pop(record.id, None)
                    continue
                self._drop(record.id)
                removed.append(record.id)
            else:
                self._unlisted.discard(record.id)

        owned_addresses = {
            r.address: r.id for r in self.records.values() if r.state is IPState.ASSIGNED
        }
        rehomed: list[tuple[str, str]] = []
        moved: list[tuple[str, float, str]] = []
        for config in wanted.values():
            known = self.records.get(config.id)
            carried = self._withdrawn_cooling.pop(config.address, None)
            if known is None and carried is not None and config.id not in self._cooling:
                end, pod = carried
                self._cooling[config.id] = end
                if pod:
                    self._cooled_pod[config.id] = pod
                moved.append((config.id, end, pod))
            if known is None:
                holder = owned_addresses.get(config.address)
                if holder is not None and holder in self._unlisted:
                    self._rehome(self.records[holder], config, nc)
                    rehomed.append((holder, config.id))
                    continue
                if holder is not None and holder != config.id:
                    problems.append(
                        f"address {config.address} ({config.id}) is assigned as {holder}; skipped"
                    )
                    continue
                record = IPRecord(
                    config.id,
                    config.address,
                    nc.id,
                    IPState.PENDING_PROGRAMMING,
                    version=config.version,
                )
                self.records[config.id] = record
                if config.version <= nc.programmed_version:
                    self._make_available(record)
                added.append(config.id)
                continue
            if known.id in self._unlisted and known.address == config.address:
                self._rehome(known, config, nc)  # the same IP id, in another container
                rehomed.append((known.id, known.id))
                continue
            known.version = config.version
            if (
                known.state is IPState.PENDING_PROGRAMMING
                and config.version <= nc.programmed_version
            ):
                self._make_available(known)
                programmed.append(known.id)
        self.containers[nc.id] = nc
        self._forget_withdrawn()
        return NCChange(
            tuple(added),
            tuple(removed),
            tuple(programmed),
            tuple(problems),
            rehomed=tuple(rehomed),
            cooldowns_moved=tuple(moved),
        )

    def _rehome(self, record: IPRecord, config: IPConfig, nc: NetworkContainer) -> None:
        """An assigned IP no container listed, listed again as `config` of `nc`: the same
        address, now under the new id and container (its holder keeps it)."""
        assert record.owner is not None
        del self.records[record.id]
        self._unlisted.discard(record.id)
        self._forget_cooldown(record.id)
        record.id, record.nc_id, record.version = config.id, nc.id, config.version
        self.records[record.id] = record
        self._index(record.owner.key, record.id)

    def withdraw(self, nc_id: str) -> tuple[str, ...]:
        """The control plane no longer lists network container `nc_id` (its NNC deleted, its
        id changed, it left the list): its IPs no pod holds leave the pool at once (their ids
        are returned), the assigned ones stay with their pods, unlisted, until released. The
        cooldown of one that cools down stays with its address, should it be listed again."""
        nc = self.containers.pop(nc_id, None)
        if nc is None:
            return ()
        dropped = []
        for record in [r for r in self.records.values() if r.nc_id == nc_id]:
            if record.state is IPState.ASSIGNED:
                self._unlisted.add(record.id)
                self.withdrawn[nc_id] = nc
                continue
            if record.state is IPState.COOLDOWN:
                cooling = (self._cooling[record.id], self._cooled_pod.get(record.id, ""))
                self._withdrawn_cooling[record.address] = cooling
            self._drop(record.id)
            dropped.append(record.id)
        return tuple(dropped)

    def _forget_withdrawn(self) -> None:
        """Forget the withdrawn containers none of whose IPs a pod holds any more."""
        if self.withdrawn:
            held = {r.nc_id for r in self.records.values()}
            for nc_id in [i for i in self.withdrawn if i not in held]:
                del self.withdrawn[nc_id]

    def _drop(self, ip_id: str) -> None:
        self.records.pop(ip_id)
        self._available.pop(ip_id, None)
        self._pending_release.discard(ip_id)
        self._unlisted.discard(ip_id)
        self._forget_cooldown(ip_id)

    def withdraw_free(self) -> tuple[str, ...]:
        """Drop every IP no pod holds (its subnet is gone from the node); returns their ids.
        The assigned ones stay until released."""
        free = [r.id for r in self.records.values() if r.state is not IPState.ASSIGNED]
        for ip_id in free:
            self._drop(ip_id)
        return tuple(free)

    def mark_pending_release(self, count: int, keep: Set[str] = frozenset()) -> tuple[str, ...]:
        """Mark `count` unassigned IPs `PendingRelease`: `PendingProgramming` first, then
        `Available`, highest address first, so the choice is deterministic and low addresses
        stay. Never touches `Assigned` IPs, nor the addresses in `keep` (a pod here asked for
        them); marks fewer when fewer are free.
        """
        if count <= 0:
            return ()
        candidates = sorted(
            (
                r
                for r in self.records.values()
                if r.state in (IPState.PENDING_PROGRAMMING, IPState.AVAILABLE)
                and r.address not in keep
            ),
            key=lambda r: (
                r.state is not IPState.PENDING_PROGRAMMING,
                -int(ipaddress.ip_address(r.address)),
            ),
        )
        chosen = candidates[:count]
        for record in chosen:
            record.state = IPState.PENDING_RELEASE
            self._available.pop(record.id, None)
            self._pending_release.add(record.id)
        return tuple(r.id for r in chosen)

    def ask_back(self, ip_ids: Iterable[str]) -> tuple[str, ...]:
        """What the control plane asks the node to give up now (an address on two nodes, a
        node's own, a reserved one): `honour_release` for the free ones; the assigned ones,
        returned, follow once their pod releases them. Each call replaces the last one's asks."""
        assigned = self.honour_release(ip_ids)
        self._asked_back = set(assigned)
        return assigned

    def honour_release(self, ip_ids: Iterable[str]) -> tuple[str, ...]:
        """Mark IPs the control plane already holds as `ipsNotInUse` `PendingRelease` again.

        After a restart the pool is rebuilt from the network container, which still lists IPs
        whose release is in flight; the control plane may hand them to another node at any
        moment, so they must never become assignable here. Returns assigned ones, which would be
        an inconsistency (they are kept).
        """
        assigned = []
        for ip_id in ip_ids:
            record = self.records.get(ip_id)
            if record is None or record.state is IPState.PENDING_RELEASE:
                continue
            if record.state is IPState.ASSIGNED:
                assigned.append(ip_id)
                continue
            record.state = IPState.PENDING_RELEASE
            self._available.pop(ip_id, None)
            self._forget_cooldown(ip_id)
            self._pending_release.add(ip_id)
        return tuple(assigned)

    def plan(
        self,
        scaler: Scaler,
        exhausted: bool,
        demand: int,
        current: PoolRequest | None,
        wanted: Set[str] = frozenset(),
        *,
        draining: bool = False,
    ) -> PoolRequest:
        """Recompute the request in one step and mark the excess for release.

        `demand` is U: assigned IPs plus ADDs waiting for one (and, in a cluster, pods scheduled
        on the node that have not asked yet), so the pool grows at once for a burst. IPs in
        cooldown count as used too: they cannot be handed out, so the free IPs the scaler keeps
        must come on top of them. `current` is the request last sent (None before the first).
        `wanted` are addresses pods here ask for: those the pool lacks are asked for by name
        (`requested_ips`), those it has are never given back. So are the addresses pods here
        hold that no container lists now (`withdraw`): the control plane is told they are
        in use, and lists them again. `draining`: the subnet grants nothing more, so the request
        is what pods hold (assigned and cooling, no spare, no demand still to come) and every
        other IP goes back.
        """
        held = self.held_count()
        sent = held if current is None else current.requested_ip_count
        if draining:
            requested = self.held_for_pods()
        else:
            requested = next_request(
                scaler,
                current=sent,
                demand=demand + self.cooling_count(),
                primary_ip_count=self.primary_ip_count,
                exhausted=exhausted,
            )
        if held > requested:
            self.mark_pending_release(held - requested, keep=wanted)
        unlisted = {self.records[ip_id].address for ip_id in self._unlisted}
        present = {r.address for r in self.records.values()} - unlisted
        asked = (wanted | unlisted) - present
        return PoolRequest(requested, self.ips_not_in_use(), tuple(sorted(asked)))

    def assignments(self) -> Iterable[Assignment]:
        for key, ip_id in self._by_owner.items():
            record = self.records[ip_id]
            assert record.owner is not None and record.owner.key == key
            yield Assignment(record.id, record.address, record.nc_id, record.owner, self.subnet)
