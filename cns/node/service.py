"""The node's IPAM service: one owner of the pool, driven by CNI verbs and control-plane updates.

Every change to the pool happens synchronously on the event loop and queues its durable record in
the same step; replies wait for the commit (cns/node/commits.py). `NodeIPAM` is the front of a few
collaborators, each one concern:

- cns/node/lanes.py: the lanes, one per subnet, the primary simply the first;
- cns/node/waiters.py: the ADDs waiting for an IP and who is served first;
- cns/node/publisher.py: the step `reconcile_once` (plan every lane with the pure planner, publish
  if it changed), which one small task runs after coalescing triggers;
- cns/node/releasing.py: DEL, GC, leak reclaim, the release queue and the reuse cooldown;
- cns/node/updates.py: control-plane updates applied to the lanes;
- cns/node/world.py: the start-up check's findings applied to the lanes;
- cns/node/explain.py: why an ADD waits (`/debug/pod`, the CNI error of a timed-out ADD).

Here: the CNI verbs (an ADD takes one IP of every lane it names, all or none) and the order in
which a control-plane update reaches the collaborators. What the node shows of all this (debug
endpoint, metrics) is rendered in cns/web/views.py. Everything runs on the event loop, and each
change is made in one synchronous step (no await inside it): no lock.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from cns.config.daemon_config import Coalescing
from cns.core.leaks import Held, LeakLedger, Suspect
from cns.core.overflow import overflow_target
from cns.core.pool import Assignment, IPRecord, OwnerConflict, Pool
from cns.core.requested import POD_ADDRESS_ANNOTATION, IPNetwork, Misplaced, parse_requested
from cns.core.types import IgnoredContainer, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.core.worldcheck import (
    Finding,
    PoolEntry,
    Sighting,
)
from cns.node import explain
from cns.node.commits import Commits
from cns.node.control_plane import NCSource, SourceState
from cns.node.errors import (
    AddressRefused,
    Conflict,
    InvalidRequest,
    IPAMError,
    NotFound,
    conflict_error,
    refused_error,
    stopping_error,
    wrong_request,
)
from cns.node.explain import WaitReason
from cns.node.lanes import Lanes, NodeLane, assignment, no_network
from cns.node.notes import NodeEvents
from cns.node.publisher import Publisher
from cns.node.releasing import ReleaseSide, log_ip
from cns.node.updates import LaneUpdates, refusal
from cns.node.waiters import Served, Waiter, WaitQueue
from cns.node.world import WorldFindings
from cns.state.store import Batch, Save, Store

log = structlog.get_logger("cns.node")

DEFAULT_COALESCING = Coalescing()
NO_EVENTS = NodeEvents()


@dataclass(frozen=True, slots=True)
class AddResult:
    """The IPs an ADD got, one per subnet it named (in its order), each with its network
    container."""

    ips: tuple[tuple[IPRecord, NetworkContainer], ...]
    waited_seconds: float

    @property
    def record(self) -> IPRecord:
        return self.ips[0][0]

    @property
    def network(self) -> NetworkContainer:
        return self.ips[0][1]


class Neighbours(Protocol):
    """What the LAN is told of the node's addresses (cns/node/flat_network.py)."""

    async def assigned(self, addresses: Sequence[str]) -> None:
        """Before an ADD that got `addresses` is answered; an IPAMError fails the ADD."""

    def pool_changed(self) -> None:
        """After the held addresses changed other than by an ADD: a release by any path, an
        undone commit, an address adopted by the start-up check."""


class NodeIPAM:
    """Assign, release and scale; the socket API and the debug endpoint are views onto it."""

    def __init__(
        self,
        pool: Pool,
        store: Store,
        source: NCSource,
        scaler: Scaler,
        add_timeout_seconds: float,
        on_add_waited: Callable[[float], None] | None = None,
        coalescing: Coalescing = DEFAULT_COALESCING,
        cooldown_seconds: float = 0.0,
        events: NodeEvents = NO_EVENTS,
    ) -> None:
        """`pool` is the primary lane's; the state file's assignments and cooldowns are
        restored into their lanes here, before any network container is known. `events` gets
        what operators see as Kubernetes Events (cns/node/notes.py)."""
        self.store = store
        self.events = events
        self.source = source
        self.add_timeout_seconds = add_timeout_seconds
        self.cooldown_seconds = cooldown_seconds
        self.lanes = Lanes(
            pool,
            config_scaler=scaler,
            cooldowns=store.cooldowns,
            cooldown_seconds=cooldown_seconds,
        )
        self.lanes.restore(store.assignments.values())
        self.waiters = WaitQueue()
        self.commits = Commits(store)
        self.publisher = Publisher(
            self.lanes,
            self.waiters,
            source,
            coalescing=coalescing,
            pod_addresses=lambda: self.pod_addresses,
        )
        self.releasing = ReleaseSide(
            self.lanes,
            self.waiters,
            self.commits,
            self.publisher,
            serve_waiters=self._serve_waiters,
            release=self.release,
            released=self._pool_changed,
            cooldown_seconds=cooldown_seconds,
            events=events,
        )
        self.updates = LaneUpdates(
            self.lanes, self.waiters, self.commits, self.publisher, events=events
        )
        self.pod_addresses: Mapping[str, str] = {}  # pod -> the address its annotation asks for
        self.ignored_containers: tuple[IgnoredContainer, ...] = ()  # shown, never used
        self._on_add_waited = on_add_waited
        store.resync_listeners.append(self._follow_disk)
        self.stopping = False
        # The start-up check against the world (cns/node/startup_check.py); while it runs, no ADD
        # gets an IP it does not hold already (`can_serve`, `placed_for`).
        self.world_findings = WorldFindings(self.lanes, self.commits, kick=self.kick)
        self.world = self.world_findings.ledger
        self.world_gate_open = True
        self.world_wait_seconds = 0.0  # the longest the check waits for the world
        self.neighbours: Neighbours | None = None  # the flat-network mode, when it is on
        self.overflows_total = 0  # ADDs of the primary subnet sent to an overflow subnet

    # -- the collaborators' figures, as the views read them ------------------------------------

    @property
    def primary(self) -> NodeLane:
        return self.lanes.primary

    @property
    def pool(self) -> Pool:
        """The primary lane's pool."""
        return self.lanes.primary.pool

    @property
    def has_network(self) -> asyncio.Event:
        return self.lanes.has_network

    @property
    def publishes_total(self) -> int:
        return self.publisher.publishes_total

    @property
    def releases(self) -> Mapping[str, int]:
        return self.releasing.releases

    @property
    def inconsistencies_total(self) -> int:
        return self.updates.inconsistencies_total

    @property
    def leaks(self) -> LeakLedger:
        return self.releasing.leaks

    def lane_scaler(self, lane: NodeLane) -> Scaler:
        return self.lanes.scaler(lane)

    def waiting_count(self, key: str = "") -> int:
        return self.publisher.waiting_count(key)

    def demand(self, key: str = "") -> int:
        return self.publisher.demand(key)

    def held_by(self, key: OwnerKey) -> list[IPRecord]:
        return self.lanes.held_by(key)

    def held_addresses(self) -> list[str]:
        """Every address a pod holds, in every lane."""
        return [a.address for lane in self.lanes.values() for a in lane.pool.assignments()]

    def pod_subnets(self) -> list[IPNetwork]:
        """The subnets of the network containers the node has, in every lane."""
        subnets = {
            ipaddress.ip_network(nc.subnet, strict=False)
            for lane in self.lanes.values()
            for nc in lane.pool.containers.values()
        }
        return sorted(subnets, key=lambda s: (s.version, s))

    # -- tasks and signals ---------------------------------------------------------------------

    def kick(self) -> None:
        """Ask the reconcile task to recompute the request (coalesced)."""
        self.publisher.kick()

    def refresh(self) -> None:
        """Recompute the request and drain the release queue now (SIGHUP)."""
        self.releasing.drain_requested.set()
        self.kick()

    async def reconcile_forever(self) -> None:
        await self.publisher.reconcile_forever()

    async def reconcile_once(self) -> PoolRequest | None:
        return await self.publisher.reconcile_once()

    async def tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.kick()

    async def end_cooldowns_forever(self) -> None:
        await self.releasing.end_cooldowns_forever()

    def end_cooldowns(self) -> None:
        self.releasing.end_cooldowns()

    async def drain_release_queue(self, directory: Path) -> int:
        return await self.releasing.drain_release_queue(directory)

    async def drain_release_queue_forever(self, directory: Path, interval: float) -> None:
        await self.releasing.drain_release_queue_forever(directory, interval)

    def stop_serving(self) -> None:
        """Shutdown: refuse ADDs from now on, and answer the ones waiting for an IP at once."""
        self.stopping = True
        self.waiters.fail(list(self.waiters), stopping_error())

    # -- control plane -------------------------------------------------------------------------

    def on_state(self, state: SourceState) -> None:
        """Apply a control-plane snapshot: network containers, exhaustion, scaler, of the
        primary subnet and of each further one (cns/node/updates.py), then serve what came."""
        self.updates.apply(state)
        self._send_waiters_on()
        self.pod_addresses = state.pod_addresses
        self.ignored_containers = state.ignored
        if state.containers:
            self.lanes.has_network.set()
        if self.world.remembered:  # an address a live pod holds may have come: it is adopted
            self.apply_world(self.world_findings.remembered(), again=True)
        self.releasing.cooling_started.set()  # IPs the containers brought back may be cooling down
        self._serve_waiters()
        self.kick()

    # -- serving -------------------------------------------------------------------------------

    def can_serve(self, key: str, owner: Owner, promised: int = 0) -> bool:
        """Whether lane `key` can give `owner` an IP now (or it holds one there already), with
        `promised` of its free IPs kept for ADDs that queued before it (cns/node/waiters.py)."""
        lane = self.lanes.get(key)
        return (
            lane is not None
            and self.lanes.serves(lane)
            and (
                lane.pool.lookup(owner.key) is not None
                or (self.world_gate_open and lane.pool.available_count() > promised)
            )
        )

    def _lacks(self, waiter: Waiter) -> list[str]:
        """The lanes (keys) the waiter names in which its owner holds no IP yet."""
        keys = dict.fromkeys(map(self.lanes.key, waiter.subnets))
        lanes = self.lanes
        return [k for k in keys if k not in lanes or lanes[k].pool.lookup(waiter.owner.key) is None]

    def _serve_waiters(self) -> None:
        self.waiters.serve(
            self._assign_waiter,
            lacks=self._lacks,
            any_free=lambda: any(lane.pool.available_count() for lane in self.lanes.values()),
        )

    def _assign_waiter(self, waiter: Waiter, promised: Mapping[str, int]) -> Served | None:
        got = self._assign_all(waiter.owner, waiter.subnets, promised, waiter.addresses)
        return None if got is None else got[:2]

    def _assign_all(
        self,
        owner: Owner,
        subnets: Sequence[str],
        promised: Mapping[str, int],
        addresses: Sequence[str] = (),
    ) -> tuple[list[IPRecord], Batch | None, bool] | None:
        """Give `owner` an IP in the lane of every subnet named, in one synchronous step, and
        queue their record as ONE batch (all of them commit, or none); None, changing nothing,
        while any of those lanes has no free IP beyond the `promised` ones (or no network
        container yet). Each of `addresses` is given by the named lane that holds it, the other
        lanes give any free IP. Returns the IPs, their batch, and whether anything changed.
        Raises, changing nothing: OwnerConflict when a lane's holder names another pod;
        AddressRefused when a requested address cannot be had now; Misplaced when one does not
        fit the subnets named."""
        keys = [self.lanes.key(name) for name in subnets]
        placed = self.placed_for(owner, keys, addresses) if addresses else {}
        if not all(
            self.can_serve(key, owner, promised.get(key, 0)) for key in keys if key not in placed
        ):
            return None
        for held in self.lanes.held_by_container(owner.container_id):
            if held.owner is not None and held.owner.conflicts_with(owner):
                raise OwnerConflict(held.owner, owner)
        records, ops = [], []
        for key in keys:
            pool = self.lanes[key].pool
            if key in placed:
                record, changed = pool.assign_address(owner, placed[key])
            else:
                got, changed = pool.assign(owner)
                assert got is not None
                record = got
            records.append(record)
            if changed:
                ops.append(Save(assignment(record, pool.subnet)))
        if ops:
            return records, self.commits.record(owner.key, ops), True
        return records, self.commits.pending(owner.key), False

    def placed_for(
        self, owner: Owner, keys: Sequence[str], addresses: Sequence[str]
    ) -> dict[str, str]:
        """Lane key -> the requested address it gives (`Lanes.place`), each checked:
        AddressRefused for one its lane cannot give `owner` now."""
        placed = self.lanes.place(keys, addresses)
        for key, address in placed.items():
            lane = self.lanes.get(key)
            if lane is None or not self.lanes.serves(lane):
                raise AddressRefused(address, no_network(key))
            problem = lane.pool.address_problem(owner, address)
            if problem is None and not self.world_gate_open and lane.pool.lookup(owner.key) is None:
                problem = explain.world_check_pending(self)
            if problem is not None:
                raise AddressRefused(address, problem)
        return placed

    # -- CNI verbs -----------------------------------------------------------------------------

    def _result(self, records: Iterable[IPRecord], waited: float) -> AddResult:
        return AddResult(tuple((r, self.lanes.network_of(r)) for r in records), waited)

    def refuse_conflict(self, owner: Owner) -> None:
        """Raise Conflict (code 4) when the container (on any interface) holds IPs for, or is
        being added for, another pod: one container is one pod."""
        holders = [r.owner for r in self.lanes.held_by_container(owner.container_id) if r.owner]
        holders += [w.owner for w in self.waiters if w.owner.container_id == owner.container_id]
        for holder in holders:
            if holder.conflicts_with(owner):
                raise conflict_error(OwnerConflict(holder, owner))

    async def add(
        self, owner: Owner, requested: str = "", subnets: Sequence[str] = ()
    ) -> AddResult:
        """Assign an IP to `owner`, waiting (bounded) for the pool to grow if none is free.

        With `subnets` (names; none: the primary subnet only), one IP of each, all at once or
        none: the ADD waits while any of them has no free IP, and counts in the demand of each,
        also of a subnet the node has not got (its demand is published, so that the control
        plane can grant it).

        With `requested` (`10.240.0.9` or `10.240.0.9,fd00::9`: at most one per family, one
        per subnet named), each address is given by the named subnet that holds it, in the same
        step as the others' free IPs; if one cannot be had now, code 11 saying why (a pod that
        asks for an address wants that one, not whichever frees up first). A pod whose
        annotation asks for addresses (Kubernetes mode) waits, bounded, for the control plane
        to bring them (`PoolRequest.requested_ips` of each one's subnet)."""
        if self.stopping:
            raise stopping_error()
        names = tuple(subnets) or ("",)
        self.refuse_conflict(owner)
        self.releasing.added_at[owner.key] = time.time()
        started = time.monotonic()
        asked = requested or self.pod_addresses.get(owner.pod, "")
        # The waiter it would be; made here only for addresses asked for (they are checked
        # first), else only if the ADD has to wait.
        try:
            waiter = self._asking(owner, names, asked, explicit=bool(requested)) if asked else None
        except InvalidRequest as invalid:
            raise self._refused(owner, invalid) from None
        if waiter is None:
            names = self._overflowing(owner, names)
        for name in names:
            key = self.lanes.key(name)
            lane = self.lanes.lane(key)
            # Removed: planned from now on, even before an NC. Draining: a repeat keeps its IP.
            if lane.removed or (lane.draining and lane.pool.lookup(owner.key) is None):
                raise refusal(self.lanes.label(key), lane)
        try:
            got = self._assign_all(
                owner, names, self._promised(), waiter.addresses if waiter else ()
            )
        except AddressRefused as refused:
            assert waiter is not None  # only an address asked for is refused
            if waiter.explicit:
                raise self._refused(owner, refused_error(refused)) from None
            waiter.why, got = refused.why, None
        except Misplaced as wrong:
            error = wrong_request(waiter.asked_by if waiter else "", wrong)
            raise self._refused(owner, error) from None
        except OwnerConflict as wrong:
            raise wrong_request(waiter.asked_by if waiter else "", wrong) from None
        self.kick()
        if got is None:
            return await self._wait(waiter or Waiter(owner, names), started)
        records, batch, changed = got
        await self.commits.durable(batch)
        if changed:
            for record in records:
                log_ip("ip_assigned", record, owner.key, owner, waited_seconds=0.0)
        await self._tell_neighbours(owner.key, records, fresh=changed)
        return self._result(records, 0.0)

    async def _tell_neighbours(
        self, key: OwnerKey, records: Sequence[IPRecord], *, fresh: bool
    ) -> None:
        """The flat-network mode answers for the addresses before the ADD is; if it cannot,
        the ADD fails and addresses it assigned (`fresh`) go back at once."""
        if self.neighbours is None:
            return
        try:
            await self.neighbours.assigned([r.address for r in records])
        except IPAMError:
            if fresh:
                self.release(key, reason="flat-network-failed")
                await self.commits.durable_for([key])
            raise

    def _overflowing(self, owner: Owner, names: tuple[str, ...]) -> tuple[str, ...]:
        """The subnets an ADD draws from, the primary replaced by the overflow subnet that
        takes its pods now (cns/core/overflow.py): one the attachment holds an address of
        already (a repeated ADD keeps it), else the first with room while the primary's subnet
        is exhausted or draining and the node has none of its addresses free for this ADD. An
        ADD asking for addresses is never sent on (they are placed in the subnets named)."""
        lanes = self.lanes
        primary = lanes.primary
        keys = [lanes.key(name) for name in names]
        if "" not in keys or primary.pool.lookup(owner.key) is not None:
            return names
        target = lanes.sent_on(owner.key, keys)
        if target is None:
            if not lanes.overflow:
                return names
            free = primary.pool.available_count() if lanes.serves(primary) else 0
            target = overflow_target(
                primary_exhausted=primary.exhausted,
                primary_draining=primary.draining,
                primary_free=free - self._promised().get("", 0),
                candidates=lanes.overflow_candidates(),
            )
            if target is None or target in names:
                return names
            self.overflows_total += 1
            log.info(
                "pod_overflowed",
                pod=owner.pod or None,
                container_id=owner.container_id,
                subnet=target,
                primary=lanes.label("") or None,
                exhausted=primary.exhausted,
                draining=primary.draining,
            )
        return tuple(target if lanes.key(name) == "" else name for name in names)

    def _send_waiters_on(self) -> None:
        """ADDs that queued for the primary before its subnet sent pods on (the exhaustion
        came after them) wait for the overflow subnet that takes them instead."""
        if not self.lanes.overflow or not self.lanes.overflow_open():
            return
        for waiter in self.waiters:
            if not waiter.addresses:
                waiter.subnets = self._overflowing(waiter.owner, waiter.subnets)

    def _refused(self, owner: Owner, error: IPAMError) -> IPAMError:
        """`error`, told to the pod as an Event too: the address it asks for cannot be had."""
        self.events.address_refused(owner, error.msg)
        return error

    def _promised(self) -> Mapping[str, int]:
        return self.waiters.promised(self._lacks)

    def _asking(
        self, owner: Owner, names: tuple[str, ...], asked: str, *, explicit: bool
    ) -> Waiter:
        """The waiter of an ADD for the addresses `asked` (the runtime's if `explicit`, else
        the annotation's): code 7 naming the field when they cannot fit the subnets named."""
        field = (
            "requestedIP" if explicit else f"annotation {POD_ADDRESS_ANNOTATION} of pod {owner.pod}"
        )
        try:
            addresses = parse_requested(asked)
        except ValueError as exc:
            raise InvalidRequest(7, f"{field}: {exc}") from None
        if len(addresses) > len(names):
            raise InvalidRequest(
                7,
                f"{field}: {len(addresses)} addresses ({', '.join(addresses)}) for "
                f"{len(names)} subnet ({', '.join(n or 'the primary subnet' for n in names)}): "
                "at most one address per subnet the ADD names",
            )
        return Waiter(owner, names, addresses=addresses, explicit=explicit, asked_by=field)

    async def _wait(self, waiter: Waiter, started: float) -> AddResult:
        """Queue the ADD until what it wants comes (bounded by addTimeoutSeconds)."""
        owner = waiter.owner
        self.waiters.append(waiter)
        self._serve_waiters()  # the address may have come while the ADD was on its way
        self.kick()
        if not waiter.future.done():
            self._tell_waiting(waiter)
        try:
            records, batch = await asyncio.wait_for(
                asyncio.shield(waiter.future), self.add_timeout_seconds
            )
        except TimeoutError:
            self.waiters.discard(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
                self.kick()
                raise explain.no_ip_error(self, waiter) from None
            records, batch = waiter.future.result()
        finally:
            waited = time.monotonic() - started
            if self._on_add_waited is not None:
                self._on_add_waited(waited)
        await self.commits.durable(batch)
        for record in records:
            log_ip("ip_assigned", record, owner.key, owner, waited_seconds=round(waited, 3))
        await self._tell_neighbours(owner.key, records, fresh=True)
        return self._result(records, waited)

    def _tell_waiting(self, waiter: Waiter) -> None:
        """The pod's Event that its ADD waits, saying why as `/debug/pod` does."""
        if not waiter.owner.pod_name:
            return
        if waiter.addresses and waiter.why:
            self.events.waiting(
                waiter.owner,
                code="requested-address",
                message=f"{', '.join(waiter.addresses)} ({waiter.asked_by}): {waiter.why}",
            )
            return
        reason = self.wait_reason(self.lanes.key(explain.lacking(self, waiter)))
        self.events.waiting(waiter.owner, code=reason.code, message=reason.message)

    async def durable(self, *batches: Batch | None) -> None:
        """Return once these batches are committed; else raise the caller's IPAMError."""
        await self.commits.durable(*batches)

    def _follow_disk(self) -> None:
        """After a failed or refused commit, the pool takes the committed assignments again:
        what was not committed is undone, what a failed release gave away is taken back."""
        undone: list[Assignment] = []
        retaken: list[Assignment] = []
        for lane in self.lanes.values():
            lane_undone, lane_retaken = lane.pool.follow(self.store.assignments)
            undone += lane_undone
            retaken += lane_retaken
        for event, assignments in (
            ("ip_assignment_undone", undone),
            ("ip_release_undone", retaken),
        ):
            for a in assignments:
                log.warning(
                    event,
                    ip=a.address,
                    container_id=a.owner.container_id,
                    ifname=a.owner.ifname,
                    reason="state commit failed",
                )
        if undone or retaken:
            self._pool_changed()
            self._serve_waiters()
            self.kick()

    def _pool_changed(self) -> None:
        if self.neighbours is not None:
            self.neighbours.pool_changed()

    async def delete(self, key: OwnerKey, reason: str = "cni-del") -> IPRecord | None:
        """Release the owner's IPs; an unknown owner is a success."""
        released = self.release(key, reason=reason)
        await self.commits.durable_for([key])
        return released[0] if released else None

    def release(self, key: OwnerKey, reason: str) -> list[IPRecord]:
        """Take back every IP the owner holds, one in each lane, recorded in one batch."""
        return self.releasing.take_back(key, reason)

    def check(self, key: OwnerKey, addresses: Iterable[str]) -> list[IPRecord]:
        """The attachment's IPs (primary lane first); each must be among `addresses` when the
        runtime names some."""
        records = self.lanes.held_by(key)
        if not records:
            raise NotFound(
                3, f"no IP allocated to container {key.container_id} interface {key.ifname}"
            )
        given = [a.split("/")[0] for a in addresses]
        if given and (missing := [r.address for r in records if r.address not in given]):
            raise Conflict(
                104,
                f"container {key.container_id} holds {', '.join(missing)}, not {', '.join(given)}",
            )
        return records

    async def gc(self, valid: set[OwnerKey]) -> list[str]:
        """Release every attachment the runtime no longer knows (CNI GC), all its IPs."""
        return await self.releasing.gc(valid)

    async def reclaim(self, leaks: Iterable[Suspect], *, now_wall: float) -> list[IPRecord]:
        """Release leaked IPs, each only if the same attachment still holds the same IP."""
        return await self.releasing.reclaim(leaks, now_wall=now_wall)

    def status(self) -> tuple[bool, str]:
        """Whether an ADD can be served now or soon (CNI STATUS): some lane has a free IP or
        room to grow."""
        if self.stopping:
            return False, "cns is shutting down"
        if not self.has_network.is_set():
            return False, "no network container from the control plane yet"
        if self.store.failure is not None:
            return False, str(self.store.failure)
        for key, lane in self.lanes.items():
            pool, max_ip_count = lane.pool, self.lanes.scaler(lane).max_ip_count
            if lane.removed or lane.draining or not self.lanes.serves(lane):
                continue  # hands nothing out: says nothing of the others
            if pool.available_count():
                continue
            if pool.held_count() + pool.primary_ip_count >= max_ip_count:
                of = f" of subnet {key}" if key else ""
                return False, f"no free IP{of} and the node is at maxIPCount ({max_ip_count})"
        return True, "ready"

    # -- explanations --------------------------------------------------------------------------

    def wait_reason(self, key: str = "") -> WaitReason:
        """Why an ADD would find no free IP of lane `key` now (cns/node/explain.py)."""
        return explain.wait_reason(self, key)

    def waiters_of(self, pod: str) -> list[tuple[Owner, float]]:
        """The ADDs of pod `namespace/name` waiting for an IP, with when each began."""
        return [(w.owner, w.since) for w in self.waiters.of_pod(pod)]

    def pod_wait_reason(self, pod: str) -> WaitReason:
        """Why pod `namespace/name` waits (its first ADD's first subnet without an IP for it),
        or would wait if its ADD came now (the primary subnet's reason)."""
        waiting = self.waiters.of_pod(pod)
        if not waiting:
            return self.wait_reason("")
        return self.wait_reason(self.lanes.key(explain.lacking(self, waiting[0])))

    # -- the start-up check and the leak check -------------------------------------------------

    def leak_inputs(self) -> tuple[list[Held], list[tuple[str, OwnerKey]]]:
        """The assigned IPs and the ADDs waiting for one (pod, key): what the leak check reads."""
        held = []
        for lane in self.lanes.values():
            for key in lane.pool.owners():
                record = lane.pool.lookup(key)
                if record is not None and record.owner is not None:
                    held.append(Held(key, record.id, record.address, record.owner.pod))
        return held, [(w.owner.pod, w.owner.key) for w in self.waiters]

    def world_pool(self) -> dict[str, PoolEntry]:
        return self.world_findings.pool()

    def apply_world(
        self, sightings: Iterable[Sighting], *, again: bool = False
    ) -> tuple[list[Finding], Batch | None]:
        applied = self.world_findings.apply(sightings, again=again)
        self._pool_changed()  # an address a live pod holds may have been adopted
        return applied

    def open_world_gate(self) -> None:
        """The start-up check is over (or gave up waiting): ADDs get free IPs again."""
        self.world_gate_open = True
        self._serve_waiters()
        self.kick()
