"""The node's IPAM service: one owner of the pool, driven by CNI verbs and control-plane updates.

Every change to the pool happens synchronously on the event loop and queues its durable record in
the same step; replies wait for the commit. Scaling decisions are made by one step,
`reconcile_once` (plan with the pure planner, publish if it changed), which one small task runs
after coalescing triggers (ADD waiting, DEL, NC update, exhaustion, tick). What the node shows of
all this (debug endpoint, metrics) is rendered in cns/views.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import ipaddress
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog

from cns import release_queue
from cns.config import Coalescing
from cns.core.leaks import Held, LeakLedger, Reclaimed, Suspect
from cns.core.pool import Assignment, IPRecord, OwnerConflict, Pool
from cns.core.requested import (
    POD_ADDRESS_ANNOTATION,
    IPNetwork,
    Misplaced,
    parse_requested,
    place,
)
from cns.core.scaling import effective_batch
from cns.core.types import IPState, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.core.worldcheck import (
    Finding,
    Outcome,
    PoolEntry,
    Sighting,
    WorldLedger,
    canonical,
    check_world,
)
from cns.node.control_plane import IgnoredContainer, NCSource, SourceState, SubnetState
from cns.store import Batch, Forget, Rejected, Save, Store, StoreError

log = structlog.get_logger("cns.node")

PUBLISH_RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)
DEFAULT_COALESCING = Coalescing()
# Queue entries applied per turn of the event loop, and bad ones named in a drain's log line.
RELEASE_QUEUE_SLICE = 256
INVALID_ENTRY_EXAMPLES = 5


class IPAMError(Exception):
    """A request's failure as the CNI caller gets it: a CNI error code, a message and details.

    The subclass says what kind of failure it is; the socket API gives each kind its HTTP status
    (cns/api.py, HTTP_STATUS), so the service itself knows nothing of HTTP. The code alone cannot
    say it: code 4 is a malformed identifier (400) or another pod's attachment (409).
    """

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "msg": self.msg, "details": self.details}


class InvalidRequest(IPAMError):
    """The request itself is wrong: a field missing, malformed, or that the state file cannot
    hold."""


class NotFound(IPAMError):
    """The request names an attachment the node does not hold."""


class Conflict(IPAMError):
    """The request contradicts what the node holds: another pod's attachment, another address,
    the state file's record. Nothing changed."""


class Unavailable(IPAMError):
    """The node cannot serve the request now (no free IP in time, state not committable,
    shutting down); the same request may succeed later."""


class InternalError(IPAMError):
    """cns, or the host under it, failed on a request that was fine."""


def _stopping_error() -> IPAMError:
    return Unavailable(11, "cns is shutting down", "retry the ADD once cns is back")


def conflict_error(conflict: OwnerConflict) -> IPAMError:
    """Code 4: the runtime's CNI_CONTAINERID + CNI_IFNAME belong to another pod already."""
    key = conflict.holder.key
    return Conflict(
        4,
        f"container {key.container_id} interface {key.ifname} belongs to pod "
        f"{conflict.holder.pod}, not {conflict.asked.pod}",
        "an ADD never relabels an attachment; DEL it first",
    )


class PublishFailed(Exception):
    """The control plane did not take the pool request (the source's error is the cause).

    Only this is retried by the reconcile loop: any other failure of a reconcile is a bug and
    ends the task, which stops the daemon instead of looping on it.
    """


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


@dataclass(slots=True)
class Lane:
    """One subnet's share of the node: its own pool (the network containers of that subnet),
    exhaustion, scaler, pod demand, the request last sent and when. The primary lane is the
    node's first subnet (key "" in the state file); a further lane is keyed by its subnet's
    name. Each plans its own request and has its own release handshake."""

    pool: Pool
    name: str = ""  # the subnet's name (the primary's is learnt from its network containers)
    exhausted: bool = False
    source_scaler: Scaler | None = None
    pod_demand: int = 0
    sent: PoolRequest | None = None
    published_at: float | None = None  # wall clock of the last publish
    # `sent` came from a snapshot file written ahead of a publish that may never have landed.
    sent_unconfirmed: bool = False
    listed: bool = False  # the control plane lists this subnet for the node
    # Listed once (or holding IPs the state file restored) and no longer: its pods keep their
    # IPs until their DEL; it hands none out, asks for none, and goes with its last IP.
    removed: bool = False

    @property
    def has_network(self) -> bool:
        return bool(self.pool.containers)


@dataclass(frozen=True, slots=True)
class WaitReason:
    """Why an ADD finds no free IP now: a `code` for programs, a `message` for people, and the
    figures behind it."""

    # subnet-removed, no-network, world-check, cooldown, exhausted, max-ip-count,
    # allocation-pending
    code: str
    message: str
    figures: dict[str, float | int | str | None]


@dataclass(slots=True)
class _Waiter:
    owner: Owner
    subnets: tuple[str, ...] = ("",)  # the subnets it wants an IP of ("": the primary)
    since: float = field(default_factory=time.time)  # wall clock, for people
    # The addresses it asks for (at most one per subnet) and where they come from: the runtime's
    # `requestedIP` (explicit: had at once or refused, never waited for) or its pod's annotation.
    addresses: tuple[str, ...] = ()
    explicit: bool = False
    asked_by: str = ""  # the field that asked for them, for errors
    why: str = ""  # why one of them could not be had, last time it was tried
    # The IPs it was given (one per subnet, in its order) and the batch that records them (None
    # if nothing had to be recorded).
    future: asyncio.Future[tuple[list[IPRecord], Batch | None]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class _AddressRefused(Exception):
    """A requested address the node cannot give now: which one and why (nothing changed)."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(why)
        self.address = address
        self.why = why


def _refused_error(refused: _AddressRefused) -> IPAMError:
    """Code 11: a requested address the node cannot give now, and why."""
    return Unavailable(11, f"requested address {refused.address} cannot be assigned: {refused.why}")


def _wrong_request(field: str, wrong: Misplaced | OwnerConflict) -> IPAMError:
    """Code 7 for addresses that do not fit the subnets named; code 4 for another pod's
    attachment."""
    if isinstance(wrong, OwnerConflict):
        return conflict_error(wrong)
    return InvalidRequest(7, f"{field}: {wrong}")


def _error_for(exc: StoreError) -> IPAMError:
    """A storage failure is every waiting request's (CNI 5, I/O failure). A refused record is
    its own request's: a field the state file cannot hold (CNI 4 for the identifiers, 7 for the
    rest), or a conflict with what it records (CNI 11: memory now follows the disk, so a retry
    gets a consistent answer)."""
    if not isinstance(exc, Rejected):
        return Unavailable(5, str(exc))
    if exc.field is None:
        return Conflict(11, str(exc))
    return InvalidRequest(4 if exc.field in ("containerID", "ifName") else 7, str(exc))


_T = TypeVar("_T")


class _Primary(Generic[_T]):
    """A field of the primary lane, read and written on NodeIPAM under its pre-lane name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, node: NodeIPAM, owner: type | None = None) -> _T:
        value: _T = getattr(node.primary, self.name)
        return value

    def __set__(self, node: NodeIPAM, value: _T) -> None:
        setattr(node.primary, self.name, value)


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
    ) -> None:
        self.store = store
        self.source = source
        self.config_scaler = scaler
        self.add_timeout_seconds = add_timeout_seconds
        self.cooldown_seconds = cooldown_seconds
        self._cooling_started = asyncio.Event()  # wakes `end_cooldowns_forever`
        # Triggers come in bursts (a scheduler binding pods, a rollout's ADDs): see _until_quiet.
        self.coalescing = coalescing
        # The primary lane ("") first; further lanes by subnet name, made when the control plane
        # lists the subnet, an ADD asks for it, or the state file holds one of its IPs.
        self.primary = Lane(pool)
        self.lanes: dict[str, Lane] = {"": self.primary}
        # The further subnets the control plane has a request of (spec.subnets).
        self._published_subnets: frozenset[str] = frozenset()
        # The last state came from the snapshot file, not (yet) from the control plane.
        self._from_snapshot = False
        self.pod_addresses: Mapping[str, str] = {}  # pod -> the address its annotation asks for
        self.ignored_containers: tuple[IgnoredContainer, ...] = ()  # shown, never used
        self.has_network = asyncio.Event()
        self.inconsistencies_total = 0
        self.publishes_total = 0
        self.releases: collections.Counter[str] = collections.Counter()
        self._on_add_waited = on_add_waited
        self._waiters: deque[_Waiter] = deque()
        self._release_requested: set[str] = set()
        self._dirty = asyncio.Event()
        # Per owner, the newest batch recording a change to its assignment, until it settles: a
        # request that changed nothing itself still answers only once its owner's state is durable.
        self._unsettled: dict[OwnerKey, Batch] = {}
        store.resync_listeners.append(self._follow_disk)
        self._drain_requested = asyncio.Event()
        # When each attachment was last ADDed in this process (wall clock, like the queue's
        # `queuedAt`), until its release: a queued DEL older than that is not for it.
        self._added_at: dict[OwnerKey, float] = {}
        # Queue entries done with that could not be deleted: name -> queuedAt.
        self._spent_entries: dict[str, float] = {}
        self.stopping = False
        self.leaks = LeakLedger()  # filled by cns/node/leak_reclaim.py when the leak check runs
        # The start-up check against the world (cns/node/startup_check.py); while it runs, no ADD
        # gets an IP it does not hold already (`_can_serve`, `_placed_for`).
        self.world = WorldLedger()
        self.world_gate_open = True
        self.world_wait_seconds = 0.0  # the longest the check waits for the world
        for assignment in store.assignments.values():
            if assignment.subnet:
                self._lane(assignment.subnet).pool.restore(assignment)

    # -- lanes ---------------------------------------------------------------------------------

    def _lane(self, key: str) -> Lane:
        """The lane of state-file key `key`, made (empty, with the state file's cooldowns) if
        the node has none yet."""
        lane = self.lanes.get(key)
        if lane is None:
            pool = Pool(subnet=key)
            pool.restore_cooldowns(
                self.store.cooldowns, now=time.time(), longest=self.cooldown_seconds
            )
            lane = self.lanes[key] = Lane(pool, name=key)
        return lane

    def lane_key(self, name: str) -> str:
        """The state-file key of the lane of subnet `name`: "" for the primary subnet."""
        return "" if name in ("", self.primary.name) else name

    def _can_serve(self, key: str, owner: Owner, promised: int = 0) -> bool:
        """Whether lane `key` can give `owner` an IP now (or it holds one there already), with
        `promised` of its free IPs kept for ADDs that queued before it (`_promised`)."""
        lane = self.lanes.get(key)
        return (
            lane is not None
            and self._has_network(lane)
            and (
                lane.pool.lookup(owner.key) is not None
                or (self.world_gate_open and lane.pool.available_count() > promised)
            )
        )

    def _promised(self) -> collections.Counter[str]:
        """Per lane, the free IPs kept for the ADDs waiting now: one for each waiter that lacks
        an IP of that lane. A newcomer may take a lane's IP only beyond these, so a dual-stack
        ADD that waits for one lane keeps its place in the other's queue (`_serve_waiters`)."""
        promised: collections.Counter[str] = collections.Counter()
        for waiter in self._waiters:
            if not waiter.addresses and not waiter.future.done():
                promised.update(self._lacks(waiter))
        return promised

    def _lacks(self, waiter: _Waiter) -> list[str]:
        """The lanes (keys) the waiter names in which its owner holds no IP yet."""
        keys = dict.fromkeys(map(self.lane_key, waiter.subnets))
        lanes = self.lanes
        return [k for k in keys if k not in lanes or lanes[k].pool.lookup(waiter.owner.key) is None]

    def _has_network(self, lane: Lane) -> bool:
        return self.has_network.is_set() if lane is self.primary else lane.has_network

    def _further(self) -> list[tuple[str, Lane]]:
        return [(k, lane) for k, lane in self.lanes.items() if k]

    # -- derived state -------------------------------------------------------------------------
    # The primary lane's figures under their pre-lane names: the node's own subnet.

    @property
    def pool(self) -> Pool:
        return self.primary.pool

    exhausted: _Primary[bool] = _Primary()
    source_scaler: _Primary[Scaler | None] = _Primary()
    pod_demand: _Primary[int] = _Primary()
    sent: _Primary[PoolRequest | None] = _Primary()
    published_at: _Primary[float | None] = _Primary()

    @property
    def scaler(self) -> Scaler:
        """The control plane's scaler when it sends one, else the configured one."""
        return self.lane_scaler(self.primary)

    def lane_scaler(self, lane: Lane) -> Scaler:
        return lane.source_scaler or self.config_scaler

    def waiting_count(self, key: str = "") -> int:
        """ADDs waiting for an IP of lane `key` (each owner once, none that holds one there)."""
        pool = self.lanes[key].pool if key in self.lanes else None
        return len(
            {
                w.owner.key
                for w in self._waiters
                if key in map(self.lane_key, w.subnets)
                and (pool is None or pool.lookup(w.owner.key) is None)
            }
        )

    def demand(self, key: str = "") -> int:
        """U of lane `key`: assigned plus waiting, or the pods scheduled here if the cluster
        says more."""
        lane = self.lanes[key]
        return max(lane.pool.assigned_count() + self.waiting_count(key), lane.pod_demand)

    def kick(self) -> None:
        """Ask the reconcile task to recompute the request (coalesced)."""
        self._dirty.set()

    def refresh(self) -> None:
        """Recompute the request and drain the release queue now (SIGHUP)."""
        self._drain_requested.set()
        self.kick()

    def stop_serving(self) -> None:
        """Shutdown: refuse ADDs from now on, and answer the ones waiting for an IP at once."""
        self.stopping = True
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(_stopping_error())

    # -- control plane -------------------------------------------------------------------------

    def on_state(self, state: SourceState) -> None:
        """Apply a control-plane snapshot: network containers, exhaustion, scaler, of the
        primary subnet and of each further one."""
        primary = SubnetState(
            state.containers, state.exhausted, state.scaler, state.request, state.pod_demand
        )
        if state.gone:  # the control plane heard nothing of the node: its record is to be made
            for lane in self.lanes.values():
                lane.sent = None
            self._published_subnets = frozenset()
        self.primary.name = next(
            (nc.subnet_name for nc in state.containers if nc.subnet_name), self.primary.name
        )
        self._apply_lane(self.primary, primary, state.from_snapshot)
        for key, lane in self._further():
            if key not in state.subnets:
                lane.pod_demand = 0  # no pod here chooses its subnet any more
        for name, subnet in state.subnets.items():
            if not self.lane_key(name):
                continue  # the primary subnet's, which the top level holds
            lane = self._lane(name)
            # A subnet listed for its pods' demand alone is asked for while they want it.
            lane.listed = lane.listed or bool(subnet.containers)
            if lane.removed and subnet.containers:
                lane.removed = False
                log.warning("subnet_listed_again", subnet=name)
            self._apply_lane(lane, subnet, state.from_snapshot)
        # A subnet is the node's while the control plane lists a network container of it. When
        # the control plane lost the node's record whole (`gone`), its containers are withdrawn
        # but its subnets stay: the node asks for what its pods hold there.
        listed = {self.lane_key(n) for n, subnet in state.subnets.items() if subnet.containers}
        for key, lane in self._further():
            if key in listed:
                continue
            if state.gone:
                self._withdraw_unlisted(lane, ())
            elif lane.listed or lane.pool.records:
                self._remove_lane(key, lane)
        self._from_snapshot = state.from_snapshot
        if not state.from_snapshot:  # after a restart: what the control plane has heard
            self._published_subnets |= {k for k in listed if self.lanes[k].sent is not None}
        self._honour_release_requests(state.release_requests)
        self.pod_addresses = state.pod_addresses
        self.ignored_containers = state.ignored
        if state.containers:
            self.has_network.set()
        if self.world.remembered:  # an address a live pod holds may have come: it is adopted
            remembered = [s for f in self.world.remembered.values() for s in f.sightings]
            self.apply_world(remembered, again=True)
        self._cooling_started.set()  # IPs the containers brought back may be cooling down
        self._serve_waiters()
        self.kick()

    def _remove_lane(self, key: str, lane: Lane) -> None:
        """The control plane (standalone: the configuration) no longer lists subnet `key`.
        Nothing of its pods is dropped: each keeps its IPs until its DEL (GC, leak reclaim and
        the release queue free them as ever). Its free IPs are dropped, so no ADD gets one, and
        an ADD naming it fails at once (`_add_to_lanes`), as do those waiting for it."""
        lane.listed = False
        if lane.removed:
            return
        lane.removed = True
        dropped = lane.pool.withdraw_free()
        log.warning(
            "subnet_removed",
            subnet=key,
            assigned=lane.pool.assigned_count(),
            free_ips_dropped=len(dropped),
            meaning="its pods keep their IPs until their DEL; ADDs naming it fail",
        )
        for waiter in [w for w in self._waiters if key in map(self.lane_key, w.subnets)]:
            self._waiters.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(self._removed_error(key))

    def _removed_error(self, key: str) -> IPAMError:
        lane = self.lanes[key]
        return Unavailable(
            11,
            f"subnet {key} was removed from this node (the control plane or the configuration "
            "no longer lists it): no ADD gets an IP of it",
            f"subnet={key} assigned={lane.pool.assigned_count()} (kept until their DEL)",
        )

    def _withdraw_unlisted(self, lane: Lane, containers: Iterable[NetworkContainer]) -> None:
        """Withdraw the lane's network containers that are not among `containers` (what the
        control plane lists now): their free IPs leave at once, held ones stay with their pods
        until DEL and are then dropped (`Pool.withdraw`)."""
        listed = {nc.id for nc in containers}
        for nc_id in [i for i in lane.pool.containers if i not in listed]:
            dropped = lane.pool.withdraw(nc_id)
            held = [r for r in lane.pool.unlisted() if r.nc_id == nc_id]
            log.warning(
                "network_container_withdrawn",
                nc=nc_id,
                subnet=lane.name or None,
                free_ips_dropped=len(dropped),
                assigned_kept=len(held),
                meaning="no ADD gets its IPs; pods keep theirs until DEL, which drops them",
            )

    def _persist_rehomed(self, pool: Pool, rehomed: Iterable[tuple[str, str]]) -> None:
        """Record each IP re-homed to another IP id (and container): the old row goes, the new
        one comes, in one batch of its holder."""
        for old_id, new_id in rehomed:
            record = pool.records[new_id]
            assert record.owner is not None
            self._record(
                record.owner.key, [Forget(old_id), Save(self._assignment(record, pool.subnet))]
            )
            log.warning(
                "ip_rehomed",
                ip=record.address,
                old_ip_id=old_id,
                ip_id=new_id,
                nc=record.nc_id,
                pod=record.owner.pod or None,
                meaning="an address a pod holds, listed again by another container",
            )

    def _apply_lane(self, lane: Lane, state: SubnetState, from_snapshot: bool) -> None:
        pool = lane.pool
        self._withdraw_unlisted(lane, state.containers)
        for nc in state.containers:
            change = pool.apply_nc(nc)
            self._persist_rehomed(pool, change.rehomed)
            if change.cooldowns_moved:  # the cooldown rows of the ids the addresses came back as
                self.store.enqueue(
                    [
                        Forget(ip_id, cool_until=end, pod=pod)
                        for ip_id, end, pod in change.cooldowns_moved
                    ]
                )
            if change.stale:
                applied = pool.network_container(nc.id)
                log.warning(
                    "network_container_stale_ignored",
                    nc=nc.id,
                    version=nc.version,
                    applied_version=applied.version if applied else None,
                )
            for problem in change.inconsistencies:
                self.inconsistencies_total += 1
                log.error("pool_inconsistency", nc=nc.id, problem=problem)
            if change.added or change.removed or change.programmed or change.rehomed:
                log.info(
                    "network_container_applied",
                    nc=nc.id,
                    version=nc.version,
                    added=len(change.added),
                    removed=len(change.removed),
                    programmed=len(change.programmed),
                    rehomed=len(change.rehomed),
                    ips=len(pool.records),
                    subnet=lane.name or None,
                )
        if state.request is not None:
            for ip_id in pool.honour_release(state.request.ips_not_in_use):
                self.inconsistencies_total += 1
                log.error("pool_inconsistency", problem=f"assigned IP {ip_id} is in ipsNotInUse")
        if state.exhausted != lane.exhausted:
            log.warning(
                "subnet_exhaustion_changed", exhausted=state.exhausted, subnet=lane.name or None
            )
        lane.exhausted = state.exhausted
        lane.source_scaler = state.scaler
        lane.pod_demand = state.pod_demand
        if lane.sent is None or lane.sent_unconfirmed:
            # Until the control plane's own view arrives, the snapshot's request stands in for
            # what was published; then the control plane's spec is what it heard, and the next
            # plan is compared with that (a request written ahead of a crash is sent again).
            lane.sent = state.request
            lane.sent_unconfirmed = from_snapshot

    def _honour_release_requests(self, ip_ids: tuple[str, ...]) -> None:
        """Give up what the control plane asks for, except an IP a pod here uses: that one is
        kept and reported once (the control plane then reclaims the address elsewhere)."""
        pools = [lane.pool for lane in self.lanes.values()]
        kept = {ip_id for pool in pools for ip_id in pool.honour_release(ip_ids)}
        for ip_id in ip_ids:
            if ip_id in self._release_requested:
                continue
            record = next((p.records[ip_id] for p in pools if ip_id in p.records), None)
            address = record.address if record else None
            if ip_id in kept:
                self.inconsistencies_total += 1
                log.error("ip_release_refused", ip_id=ip_id, ip=address, reason="a pod uses it")
            else:
                log.warning("ip_release_requested", ip_id=ip_id, ip=address)
        self._release_requested = set(ip_ids)

    def _serve_waiters(self) -> None:
        """Hand out what can be: first each awaited address that has come, then free IPs to
        the other waiters in arrival order, first come first served in each lane: a waiter that
        cannot be served yet keeps one free IP of each lane it lacks for itself (`promised`),
        so a later waiter takes an IP of that lane only beyond those. A dual-stack ADD waiting
        for its IPv6 address thus keeps the IPv4 address that freed meanwhile, instead of
        losing it to every IPv4-only ADD behind it; waiters of other lanes are not held up."""
        for waiter in [w for w in self._waiters if w.addresses]:
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            try:
                served = self._assign_all(waiter.owner, waiter.subnets, {}, waiter.addresses)
            except _AddressRefused as refused:
                waiter.why = refused.why
                if waiter.explicit:  # taken meanwhile: the runtime's address is not waited for
                    self._waiters.remove(waiter)
                    waiter.future.set_exception(_refused_error(refused))
                continue
            except (Misplaced, OwnerConflict) as wrong:  # a container came that tells
                self._waiters.remove(waiter)
                waiter.future.set_exception(_wrong_request(waiter.asked_by, wrong))
                continue
            if served is None:  # its addresses can be had; another subnet has no free IP
                waiter.why = ""
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(served)
        promised: collections.Counter[str] = collections.Counter()
        for waiter in [w for w in self._waiters if not w.addresses]:
            if not any(lane.pool.available_count() for lane in self.lanes.values()):
                break
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            try:
                served = self._assign_all(waiter.owner, waiter.subnets, promised)
            except OwnerConflict as conflict:  # refuse_conflict() keeps this from happening
                self._waiters.remove(waiter)
                waiter.future.set_exception(conflict_error(conflict))
                continue
            if served is None:
                promised.update(self._lacks(waiter))
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(served)

    def _assign_all(
        self,
        owner: Owner,
        subnets: Sequence[str],
        promised: Mapping[str, int],
        addresses: Sequence[str] = (),
    ) -> tuple[list[IPRecord], Batch | None] | None:
        """Give `owner` an IP in the lane of every subnet named, in one synchronous step, and
        queue their record as ONE batch (all of them commit, or none); None, changing nothing,
        while any of those lanes has no free IP beyond the `promised` ones (or no network
        container yet). Each of `addresses` is given by the named lane that holds it (`_place`),
        the other lanes give any free IP. Raises, changing nothing: OwnerConflict when a lane's
        holder names another pod; _AddressRefused when a requested address cannot be had now;
        Misplaced when one does not fit the subnets named."""
        keys = [self.lane_key(name) for name in subnets]
        placed = self._placed_for(owner, keys, addresses) if addresses else {}
        if not all(
            self._can_serve(key, owner, promised.get(key, 0)) for key in keys if key not in placed
        ):
            return None
        lanes = [self.lanes[key] for key in keys]
        for held in self.held_by_container(owner.container_id):
            if held.owner is not None and held.owner.conflicts_with(owner):
                raise OwnerConflict(held.owner, owner)
        records, ops = [], []
        for key, lane in zip(keys, lanes, strict=True):
            if key in placed:
                record, changed = lane.pool.assign_address(owner, placed[key])
            else:
                got, changed = lane.pool.assign(owner)
                assert got is not None
                record = got
            records.append(record)
            if changed:
                ops.append(Save(self._assignment(record, lane.pool.subnet)))
        batch = self._record(owner.key, ops) if ops else self._pending(owner.key)
        return records, batch

    def _placed_for(
        self, owner: Owner, keys: Sequence[str], addresses: Sequence[str]
    ) -> dict[str, str]:
        """`_place`, each address checked: _AddressRefused for one its lane cannot give
        `owner` now."""
        placed = self._place(keys, addresses)
        for key, address in placed.items():
            lane = self.lanes.get(key)
            if lane is None or not self._has_network(lane):
                raise _AddressRefused(address, self._no_network(key))
            problem = lane.pool.address_problem(owner, address)
            if problem is None and not self.world_gate_open and lane.pool.lookup(owner.key) is None:
                problem = self._world_check_pending()
            if problem is not None:
                raise _AddressRefused(address, problem)
        return placed

    def _world_check_pending(self) -> str:
        return (
            "the start-up check of the state file against the runtime's sandboxes and the API's "
            "pods has not finished: no address is handed out before it (it waits at most "
            f"{self.world_wait_seconds:g} s for them)"
        )

    def _no_network(self, key: str) -> str:
        if not key:
            return "no network container from the control plane yet"
        return f"the node has no network container of subnet {key} yet"

    def _networks(self) -> dict[str, list[IPNetwork]]:
        """Every lane's prefixes (of its network containers), by the lane's subnet name (the
        primary's "" until the control plane names it)."""
        networks: dict[str, list[IPNetwork]] = {}
        for key, lane in self.lanes.items():
            nets = networks.setdefault(key or self.primary.name, [])
            for nc in lane.pool.containers.values():
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(nc.subnet, strict=False))
        return networks

    def _place(self, keys: Sequence[str], addresses: Sequence[str]) -> dict[str, str]:
        """Lane key -> the requested address that lane gives (cns/core/requested.py, `place`).
        Misplaced when one does not fit the lanes named; _AddressRefused for one no named lane
        can be told to hold yet, as some has no network container."""
        networks = self._networks()
        labels = [key or self.primary.name for key in keys]
        placed, unplaced = place(addresses, named=labels, networks=networks)
        if unplaced:
            lacking = next(k for k, label in zip(keys, labels, strict=True) if not networks[label])
            raise _AddressRefused(
                unplaced[0],
                f"{self._no_network(lacking)}, so which subnet {unplaced[0]} is in is not known",
            )
        key_of = dict(zip(labels, keys, strict=True))
        return {key_of[label]: address for label, address in placed.items()}

    def _wanted_by_lane(self) -> dict[str, frozenset[str]]:
        """Per lane (key), the addresses pods here ask for in their annotations that the lane is
        to ask the control plane for: those inside its network containers. One inside no lane's
        is the primary lane's, as before lanes, if it is of the primary's family (or that is not
        known): an IPv6 address waits for its lane's container rather than being asked of an
        IPv4 subnet."""
        if not self.pod_addresses:
            return {}
        networks = self._networks()
        primary = networks.get(self.primary.name, [])
        found: dict[str, set[str]] = collections.defaultdict(set)
        for value in self.pod_addresses.values():
            with contextlib.suppress(ValueError):
                for address in parse_requested(value):
                    ip = ipaddress.ip_address(address)
                    home = next(
                        (n for n, nets in networks.items() if any(ip in x for x in nets)), None
                    )
                    if home is None and all(net.version == ip.version for net in primary):
                        home = self.primary.name
                    if home is not None:
                        found[self.lane_key(home)].add(address)
        return {key: frozenset(addresses) for key, addresses in found.items()}

    async def reconcile_forever(self) -> None:
        """Whenever something changed and then settled, reconcile; retry a failed publish later."""
        failures = 0
        while True:
            await self._dirty.wait()
            await self._until_quiet()
            try:
                if await self.reconcile_once() is not None:
                    failures = 0
            except PublishFailed as exc:
                delay = PUBLISH_RETRY_SECONDS[min(failures, len(PUBLISH_RETRY_SECONDS) - 1)]
                failures += 1
                log.warning("pool_request_failed", error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                self.kick()

    async def reconcile_once(self) -> PoolRequest | None:
        """Plan the request for the demand now and publish it if it differs from the last one sent.

        Returns the request published, or None when there was nothing to publish (no network
        container yet, the control plane's own state not seen yet, or the plan is what the
        control plane already has). Nothing is planned from the snapshot file a restart reads:
        it has no pods, so its demand can be far too low, and a plan from it gave IPs back that
        the pods scheduled here were about to take, then asked for them again. A failed publish
        raises PublishFailed and leaves `sent` as it was, so the next call sends the request
        again. Planning marks the excess `PendingRelease` (they go out in ipsNotInUse).
        """
        if not self.has_network.is_set() or self._from_snapshot:
            return None
        wanted = self._wanted_by_lane()
        request = self.pool.plan(
            self.scaler,
            self.exhausted,
            self.demand(),
            self.sent,
            wanted=wanted.get("", frozenset()),
        )
        subnets = self._plan_further(wanted)
        if (
            request == self.sent
            and self._published_subnets == frozenset(subnets)
            and all(subnets[key] == self.lanes[key].sent for key in subnets)
        ):
            return None
        try:
            await self.source.publish(request, subnets)
        except Exception as exc:
            raise PublishFailed(str(exc)) from exc
        self.publishes_total += 1
        now = time.time()
        log.info(
            "pool_request_published",
            requested_ip_count=request.requested_ip_count,
            ips_not_in_use=len(request.ips_not_in_use),
            demand=self.demand(),
            batch=effective_batch(self.scaler, self.exhausted),
            exhausted=self.exhausted,
            **(
                {"subnets": {k: r.requested_ip_count for k, r in subnets.items()}}
                if subnets
                else {}
            ),
        )
        for key, sent in {"": request, **subnets}.items():
            lane = self.lanes[key]
            if not key or lane.sent != sent:
                lane.published_at = now
            lane.sent, lane.sent_unconfirmed = sent, False
        self._published_subnets = frozenset(subnets)
        return request

    def _plan_further(self, wanted: Mapping[str, frozenset[str]]) -> dict[str, PoolRequest]:
        """Each further lane's request, planned like the primary's with its own U, batch,
        exhaustion and annotated addresses (`wanted`, by lane key). A lane the control plane
        does not list that no pod holds an IP of nor waits for is dropped: its subnet is no
        longer asked for (an ADD named one the node did not get, and gave up). A removed lane
        is not asked for, and dropped with its last IP."""
        for key, lane in self._further():
            if lane.removed and not lane.pool.records:
                log.info("subnet_drained", subnet=key)
                del self.lanes[key]
            elif not lane.listed and not lane.pool.records and not self.demand(key):
                del self.lanes[key]
        return {
            key: lane.pool.plan(
                self.lane_scaler(lane),
                lane.exhausted,
                self.demand(key),
                lane.sent,
                wanted=wanted.get(key, frozenset()),
            )
            for key, lane in self._further()
            if not lane.removed
        }

    def _plan_inputs(self) -> tuple[object, ...]:
        return (
            self.demand(),
            self.exhausted,
            self.scaler,
            self.pool.held_count(),
            frozenset(self.pod_addresses.values()),
            *(
                (key, self.demand(key), lane.exhausted, lane.source_scaler, lane.pool.held_count())
                for key, lane in self._further()
            ),
        )

    async def _until_quiet(self) -> None:
        """Wait until what the plan depends on has stopped changing for the quiet time, at most
        the maximum delay (config `requestCoalescing`), so a burst becomes one request.

        Only a change restarts the pause. An ADD for a pod the pod watch already counted changes
        nothing, and in a burst those ADDs arrive every few milliseconds: letting them restart it
        held the request back for the whole maximum delay while later ADDs ran out of free IPs. An
        ADD already waiting for an IP ends the pause at once: a pod is blocked on this request.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.coalescing.max_delay_seconds
        inputs, quiet_from = self._plan_inputs(), loop.time()
        while True:
            self._dirty.clear()
            remaining = min(quiet_from + self.coalescing.quiet_seconds, deadline) - loop.time()
            if remaining <= 0 or self._waiters:
                return
            try:
                await asyncio.wait_for(self._dirty.wait(), remaining)
            except TimeoutError:
                return
            if (now := self._plan_inputs()) != inputs:
                inputs, quiet_from = now, loop.time()

    async def end_cooldowns_forever(self) -> None:
        """End each cooldown when it is due, in every lane: its IP becomes Available, a waiting
        ADD gets it."""
        while True:
            self._cooling_started.clear()
            ends = [lane.pool.next_cooldown_end() for lane in self.lanes.values()]
            end = min((e for e in ends if e is not None), default=None)
            timeout = None if end is None else max(0.0, end - time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cooling_started.wait(), timeout)
            self.end_cooldowns()

    def end_cooldowns(self) -> None:
        now, ended_any = time.time(), False
        for lane in self.lanes.values():
            pool = lane.pool
            ended = pool.expire_cooldowns(now=now, longest=self.cooldown_seconds)
            if ended:
                ended_any = True
                log.info(
                    "ip_cooldown_ended",
                    ips=len(ended),
                    still_cooling=pool.cooling_count(),
                    subnet=lane.name or None,
                )
        if ended_any:
            self._serve_waiters()
            self.kick()

    async def tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.kick()

    # -- CNI verbs -----------------------------------------------------------------------------

    def _assignment(self, record: IPRecord, subnet: str = "") -> Assignment:
        assert record.owner is not None
        return Assignment(record.id, record.address, record.nc_id, record.owner, subnet)

    def _network_of(self, record: IPRecord) -> NetworkContainer:
        for lane in self.lanes.values():
            nc = lane.pool.network_container(record.nc_id)
            if nc is not None:
                return nc
        raise InternalError(102, f"IP {record.address} belongs to unknown NC {record.nc_id}")

    def _result(self, records: Iterable[IPRecord], waited: float) -> AddResult:
        return AddResult(tuple((r, self._network_of(r)) for r in records), waited)

    def held_by(self, key: OwnerKey) -> list[IPRecord]:
        """The IPs the attachment holds, primary lane first."""
        return [r for lane in self.lanes.values() if (r := lane.pool.lookup(key)) is not None]

    def held_by_container(self, container_id: str) -> list[IPRecord]:
        """The IPs any interface of the container holds, in every lane."""
        return [
            r for lane in self.lanes.values() for r in lane.pool.held_by_container(container_id)
        ]

    def refuse_conflict(self, owner: Owner) -> None:
        """Raise Conflict (code 4) when the container (on any interface) holds IPs for, or is
        being added for, another pod: one container is one pod."""
        holders = [r.owner for r in self.held_by_container(owner.container_id) if r.owner]
        holders += [w.owner for w in self._waiters if w.owner.container_id == owner.container_id]
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
            raise _stopping_error()
        names = tuple(subnets) or ("",)
        self.refuse_conflict(owner)
        self._added_at[owner.key] = time.time()
        started = time.monotonic()
        asked = requested or self.pod_addresses.get(owner.pod, "")
        if asked:
            return await self._add_requested(owner, names, started, asked, explicit=bool(requested))
        if any(map(self.lane_key, names)):
            return await self._add_to_lanes(owner, names, started, _Waiter(owner, names))
        record, changed = (None, False)
        if self._can_serve("", owner, self._promised()[""]):
            record, changed = self.pool.assign(owner)
        if record is not None:
            batch = self._pending(owner.key)
            if changed:
                batch = self._record(owner.key, [Save(self._assignment(record))])
                self.kick()
            await self.durable(batch)
            if changed:
                _log_ip("ip_assigned", record, owner.key, owner, waited_seconds=0.0)
            return self._result([record], 0.0)
        return await self._wait(_Waiter(owner), started)

    async def _add_requested(
        self, owner: Owner, names: tuple[str, ...], started: float, asked: str, *, explicit: bool
    ) -> AddResult:
        """`add` of the addresses `asked` (the runtime's if `explicit`, else the annotation's):
        code 7 naming the field when they cannot fit the subnets named."""
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
        waiter = _Waiter(owner, names, addresses=addresses, explicit=explicit, asked_by=field)
        return await self._add_to_lanes(owner, names, started, waiter)

    async def _add_to_lanes(
        self, owner: Owner, names: tuple[str, ...], started: float, waiter: _Waiter
    ) -> AddResult:
        for name in names:
            lane = self._lane(self.lane_key(name))  # planned from now on, even before an NC
            if lane.removed:
                raise self._removed_error(self.lane_key(name))
        try:
            got = self._assign_all(owner, names, self._promised(), waiter.addresses)
        except _AddressRefused as refused:
            if waiter.explicit:
                raise _refused_error(refused) from None
            waiter.why, got = refused.why, None
        except (Misplaced, OwnerConflict) as wrong:
            raise _wrong_request(waiter.asked_by, wrong) from None
        if got is None:
            self.kick()
            return await self._wait(waiter, started)
        records, batch = got
        self.kick()
        await self.durable(batch)
        for record in records:
            _log_ip("ip_assigned", record, owner.key, owner, waited_seconds=0.0)
        return self._result(records, 0.0)

    async def _wait(self, waiter: _Waiter, started: float) -> AddResult:
        """Queue the ADD until what it wants comes (bounded by addTimeoutSeconds)."""
        owner = waiter.owner
        self._waiters.append(waiter)
        self._serve_waiters()  # the address may have come while the ADD was on its way
        self.kick()
        try:
            records, batch = await asyncio.wait_for(
                asyncio.shield(waiter.future), self.add_timeout_seconds
            )
        except TimeoutError:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
                self.kick()
                raise self._no_ip_error(waiter) from None
            records, batch = waiter.future.result()
        finally:
            waited = time.monotonic() - started
            if self._on_add_waited is not None:
                self._on_add_waited(waited)
        await self.durable(batch)
        for record in records:
            _log_ip("ip_assigned", record, owner.key, owner, waited_seconds=round(waited, 3))
        return self._result(records, waited)

    def _record(self, key: OwnerKey, ops: Sequence[Save | Forget]) -> Batch:
        """Queue the durable record of a change to `key`'s assignments made in this same step:
        one batch, so all of them commit or none."""
        batch = self.store.enqueue(ops)
        self._unsettled[key] = batch
        return batch

    async def durable(self, *batches: Batch | None) -> None:
        """Return once these batches are committed; else raise the caller's IPAMError.

        A failed batch has already been undone in memory (`_follow_disk`), so nothing the
        caller did not get acknowledged stays in the pool.
        """
        error: StoreError | None = None
        for batch in batches:
            if batch is not None:
                await batch.wait()
                error = error or batch.error
        self._unsettled = {k: b for k, b in self._unsettled.items() if not b.settled}
        if error is not None:
            raise _error_for(error) from error

    def _pending(self, key: OwnerKey) -> Batch | None:
        """The owner's last change, if not yet settled; a settled one is what memory shows
        (committed, or failed and undone)."""
        batch = self._unsettled.get(key)
        return batch if batch is not None and not batch.settled else None

    async def _durable_for(self, keys: Iterable[OwnerKey]) -> None:
        """Wait for what was queued for these owners."""
        await self.durable(*(self._pending(key) for key in keys))

    async def _durable(self) -> None:
        """Wait for everything queued so far."""
        await self._durable_for(list(self._unsettled))

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
            self._serve_waiters()
            self.kick()

    def wait_reason(self, key: str = "") -> WaitReason:
        """Why an ADD would find no free IP of lane `key` now, most actionable cause first."""
        now = time.time()
        lane = self.lanes.get(key) or Lane(Pool(subnet=key), name=key)
        pool, sent, scaler = lane.pool, lane.sent, self.lane_scaler(lane)
        counts = pool.counts()
        figures: dict[str, float | int | str | None] = {
            "requestedIPCount": sent.requested_ip_count if sent else 0,
            "requestPublishedAt": utc_text(lane.published_at),
            "held": pool.held_count(),
            "available": counts[IPState.AVAILABLE],
            "assigned": counts[IPState.ASSIGNED],
            "cooldown": counts[IPState.COOLDOWN],
            "waiting": self.waiting_count(key),
            "maxIPCount": scaler.max_ip_count,
            "subnetExhausted": lane.exhausted,
        }
        if key:
            figures = {"subnet": key, **figures}
        if lane.removed:
            return WaitReason(
                "subnet-removed",
                f"subnet {key} was removed from this node: its pods keep their IPs until their "
                "DEL, no ADD gets one",
                figures,
            )
        if not self._has_network(lane):
            return WaitReason(
                "no-network",
                f"the node has no network container of subnet {key} (its demand is published "
                "for the control plane to grant one)"
                if key
                else "no network container from the control plane yet",
                figures,
            )
        if not self.world_gate_open:
            return WaitReason("world-check", self._world_check_pending(), figures)
        if cooling := pool.cooling_count():
            end = pool.next_cooldown_end() or now
            figures["nextCooldownEndsAt"] = utc_text(end)
            return WaitReason(
                "cooldown",
                f"{cooling} IPs in cooldown (ipCooldownSeconds={self.cooldown_seconds:g}), "
                f"the next free in {max(0.0, end - now):.1f} s",
                figures,
            )
        if lane.exhausted:
            return WaitReason(
                "exhausted", "subnet exhausted: the control plane has no IP for this node", figures
            )
        if pool.held_count() + pool.primary_ip_count >= scaler.max_ip_count:
            return WaitReason(
                "max-ip-count", f"node at maxIPCount ({scaler.max_ip_count})", figures
            )
        asked = ""
        if sent is not None and lane.published_at is not None:
            asked = (
                f"; {sent.requested_ip_count} IPs requested "
                f"{max(0.0, now - lane.published_at):.1f} s ago"
            )
        return WaitReason(
            "allocation-pending",
            f"allocation still pending: the control plane has not delivered the IPs yet{asked}",
            figures,
        )

    def waiters_of(self, pod: str) -> list[tuple[Owner, float]]:
        """The ADDs of pod `namespace/name` waiting for an IP, with when each began."""
        return [(w.owner, w.since) for w in self._waiters if w.owner.pod == pod]

    def pod_wait_reason(self, pod: str) -> WaitReason:
        """Why pod `namespace/name` waits (its first ADD's first subnet without an IP for it),
        or would wait if its ADD came now (the primary subnet's reason)."""
        waiter = next((w for w in self._waiters if w.owner.pod == pod), None)
        return self.wait_reason(self.lane_key(self._lacking(waiter)) if waiter else "")

    def _lacking(self, waiter: _Waiter) -> str:
        """The first subnet the ADD still lacks an IP of: the one to explain."""
        return next(
            (n for n in waiter.subnets if not self._can_serve(self.lane_key(n), waiter.owner)),
            waiter.subnets[0],
        )

    def _no_ip_error(self, waiter: _Waiter) -> IPAMError:
        name = self._lacking(waiter)
        reason = self.wait_reason(self.lane_key(name))
        details = " ".join(f"{k}={v}" for k, v in reason.figures.items() if v is not None)
        timeout = self.add_timeout_seconds
        if waiter.explicit:  # taken while it waited for another lane: say so, not the lane
            with contextlib.suppress(Misplaced):
                try:
                    keys = [self.lane_key(name) for name in waiter.subnets]
                    self._placed_for(waiter.owner, keys, waiter.addresses)
                except _AddressRefused as refused:
                    return _refused_error(refused)
        if waiter.addresses and waiter.why:
            return Unavailable(
                11,
                f"the address{'es' if len(waiter.addresses) > 1 else ''} pod "
                f"{waiter.owner.pod} asks for in its annotation ({', '.join(waiter.addresses)}) "
                f"did not come within {timeout:g} s: {waiter.why}; the control plane grants "
                "an address only once it is free in the subnet",
                details,
            )
        if waiter.subnets == ("",):
            return Unavailable(11, f"no free IP within {timeout:g} s: {reason.message}", details)
        return Unavailable(
            11,
            f"no free IP of subnet {name} within {timeout:g} s "
            f"(the ADD asks for one of each of {', '.join(waiter.subnets)}, all or none): "
            f"{reason.message}",
            details,
        )

    async def delete(self, key: OwnerKey, reason: str = "cni-del") -> IPRecord | None:
        """Release the owner's IPs; an unknown owner is a success."""
        released = self.release(key, reason=reason)
        await self._durable_for([key])
        return released[0] if released else None

    def release(self, key: OwnerKey, reason: str) -> list[IPRecord]:
        """Take back every IP the owner holds, one in each lane, recorded in one batch."""
        self._added_at.pop(key, None)
        for waiter in [w for w in self._waiters if w.owner.key == key]:
            self._waiters.remove(waiter)
            if waiter.future.done():
                continue
            waiter.future.set_exception(  # a CNI error: a cancelled future ends the ADD uncaught
                Conflict(
                    11,
                    f"container {key.container_id} interface {key.ifname} was released "
                    f"({reason}) while its ADD waited for an IP",
                )
            )
        cool_until = time.time() + self.cooldown_seconds if self.cooldown_seconds else 0.0
        released: list[tuple[IPRecord, Owner | None]] = []
        for lane in self.lanes.values():
            held = lane.pool.lookup(key)
            owner = held.owner if held else None
            record = lane.pool.release(key, cool_until=cool_until)
            if record is not None:
                released.append((record, owner))
                if lane.removed:
                    lane.pool.withdraw_free()
        if not released:
            return []
        self._record(
            key,
            [
                Forget(
                    record.id,
                    cool_until=cool_until,
                    pod=owner.pod if owner is not None and cool_until else "",
                )
                for record, owner in released
            ],
        )
        self.releases[reason.split(":")[0]] += 1
        for record, owner in released:
            _log_ip(
                "ip_released", record, key, owner, reason=reason, cooldown_until=cool_until or None
            )
        if cool_until:
            self._cooling_started.set()
        self._serve_waiters()
        self.kick()
        return [record for record, _ in released]

    def leak_inputs(self) -> tuple[list[Held], list[tuple[str, OwnerKey]]]:
        """The assigned IPs and the ADDs waiting for one (pod, key): what the leak check reads."""
        held = []
        for lane in self.lanes.values():
            for key in lane.pool.owners():
                record = lane.pool.lookup(key)
                if record is not None and record.owner is not None:
                    held.append(Held(key, record.id, record.address, record.owner.pod))
        return held, [(w.owner.pod, w.owner.key) for w in self._waiters]

    def world_pool(self) -> dict[str, PoolEntry]:
        """Every address of every lane (canonical text) -> its lane, IP id and holder: what the
        start-up check compares the world with."""
        return {
            canonical(record.address) or record.address: PoolEntry(
                key, record.id, record.owner if record.state is IPState.ASSIGNED else None
            )
            for key, lane in self.lanes.items()
            for record in lane.pool.records.values()
        }

    def apply_world(
        self, sightings: Iterable[Sighting], *, again: bool = False
    ) -> tuple[list[Finding], Batch | None]:
        """Decide what the world's addresses mean (cns/core/worldcheck.py) and apply it in the
        same synchronous step: each adopted IP is assigned to the pod that holds it and queued
        for the state file (one batch, returned: durable once it settles), so nothing can take
        it meanwhile; every other outcome changes nothing. Each finding is logged and counted;
        with `again` (the remembered unknown addresses, after a control-plane update), only
        those decided now."""
        findings = check_world(self.world_pool(), sightings)
        ops: list[Save] = []
        for finding in findings:
            if finding.outcome is Outcome.UNKNOWN:
                if again:
                    continue
                self.world.remembered[finding.address] = finding
            else:
                self.world.remembered.pop(finding.address, None)
            if finding.outcome is Outcome.ADOPTED:
                assert finding.entry is not None
                pool = self.lanes[finding.entry.lane].pool
                record = pool.adopt(finding.entry.ip_id, finding.owner)
                ops.append(Save(self._assignment(record, pool.subnet)))
            self.world.record(finding)
            _log_finding(finding)
        if not ops:
            return findings, None
        batch = self.store.enqueue(ops)
        for op in ops:
            self._unsettled[op.assignment.owner.key] = batch
        self.kick()
        return findings, batch

    def open_world_gate(self) -> None:
        """The start-up check is over (or gave up waiting): ADDs get free IPs again."""
        self.world_gate_open = True
        self._serve_waiters()
        self.kick()

    async def reclaim(self, leaks: Iterable[Suspect], *, now_wall: float) -> list[IPRecord]:
        """Release leaked IPs (cns/core/leaks.py decided which), each only if the same
        attachment still holds the same IP; durable when this returns."""
        released = []
        keys = []
        for suspect in leaks:
            held = suspect.held
            record = next((r for r in self.held_by(held.key) if r.id == held.ip_id), None)
            if record is None:
                continue
            suspected = now_wall - suspect.since_wall
            log.warning(
                "ip_leak_reclaimed",
                reason=suspect.reason.value,
                address=held.address,
                ip_id=held.ip_id,
                container=held.key.container_id,
                ifname=held.key.ifname,
                pod=held.pod or None,
                suspected_seconds=round(suspected, 1),
            )
            if self.release(held.key, reason=f"leak:{suspect.reason.value}"):
                released.append(record)
                keys.append(held.key)
                self.leaks.record(Reclaimed(held, suspect.reason, suspected, now_wall))
        await self._durable_for(keys)
        return released

    def check(self, key: OwnerKey, addresses: Iterable[str]) -> list[IPRecord]:
        """The attachment's IPs (primary lane first); each must be among `addresses` when the
        runtime names some."""
        records = self.held_by(key)
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
        released = []
        stale = list(dict.fromkeys(k for lane in self.lanes.values() for k in lane.pool.owners()))
        stale = [key for key in stale if key not in valid]
        for key in stale:
            released += [r.address for r in self.release(key, reason="cni-gc")]
        await self._durable_for(stale)
        return released

    def status(self) -> tuple[bool, str]:
        """Whether an ADD can be served now or soon (CNI STATUS)."""
        if self.stopping:
            return False, "cns is shutting down"
        if not self.has_network.is_set():
            return False, "no network container from the control plane yet"
        if self.store.failure is not None:
            return False, str(self.store.failure)
        full = self.pool.held_count() + self.pool.primary_ip_count >= self.scaler.max_ip_count
        if self.pool.available_count() == 0 and full:
            return False, f"no free IP and the node is at maxIPCount ({self.scaler.max_ip_count})"
        return True, "ready"

    # -- release queue -------------------------------------------------------------------------

    async def drain_release_queue(self, directory: Path) -> int:
        """Apply DELs the plugin queued while the daemon was unreachable; then delete the files.

        The directory is untrusted (cns/release_queue.py): its files are read, quarantined and
        deleted in a worker thread, and the bad ones are summed up in one line per drain. An
        entry releases only the attachment it was written for, never one ADDed again after it
        was queued (`_added_after`); an entry that cannot be deleted is remembered here, so
        that it is applied once (and after a restart, `_added_after` keeps it from any later
        ADD of its attachment). Entries are applied RELEASE_QUEUE_SLICE at a time, the loop
        serving requests between slices. Returns the number of entries applied.
        """
        entries, bad = await asyncio.to_thread(release_queue.collect, directory)
        if bad:
            _log_invalid_entries(directory, bad)
        queued = {entry.name: entry.queued_at for entry in entries}
        self._spent_entries = {
            name: at for name, at in self._spent_entries.items() if queued.get(name) == at
        }
        fresh = [e for e in entries if self._spent_entries.get(e.name) != e.queued_at]
        applied: list[release_queue.Entry] = []
        outdated: list[release_queue.Entry] = []
        for start in range(0, len(fresh), RELEASE_QUEUE_SLICE):
            chunk = fresh[start : start + RELEASE_QUEUE_SLICE]
            newer = self._added_after(chunk)
            for entry in chunk:
                if entry.key in newer:
                    outdated.append(entry)
                else:
                    self.release(entry.key, reason="queued-del")
                    applied.append(entry)
            await asyncio.sleep(0)
        await self._durable()
        for entry in outdated:
            log.warning(
                "release_queue_entry_outdated",
                file=str(directory / entry.name),
                container_id=entry.key.container_id,
                ifname=entry.key.ifname,
                queued_at=utc_text(entry.queued_at),
                reason="the attachment was added again after this DEL was queued: kept",
            )
        done = applied + outdated
        for unremovable in await asyncio.to_thread(release_queue.remove, directory, done):
            entry = unremovable.entry
            self._spent_entries[entry.name] = entry.queued_at
            log.error(
                "release_queue_entry_not_removed",
                file=str(directory / entry.name),
                error=unremovable.error,
                outcome="done: not applied again while it stays as it is",
            )
        if done:
            log.info("release_queue_drained", entries=len(applied), outdated=len(outdated))
        return len(applied)

    def _added_after(self, entries: Sequence[release_queue.Entry]) -> set[OwnerKey]:
        """The attachments of `entries` ADDed after their entry was queued: ADDed since in this
        process, or holding an IP the state file records as assigned since (or not yet)."""
        held = {entry.key: [r.id for r in self.held_by(entry.key)] for entry in entries}
        try:
            assigned = self.store.assigned_at([ip_id for ids in held.values() for ip_id in ids])
        except StoreError as exc:
            raise _error_for(exc) from exc
        return {
            entry.key
            for entry in entries
            if self._added_at.get(entry.key, 0.0) > entry.queued_at
            or any(assigned.get(ip_id, math.inf) > entry.queued_at for ip_id in held[entry.key])
        }

    async def drain_release_queue_forever(self, directory: Path, interval: float) -> None:
        """Drain every `interval` seconds, and at once when `refresh()` asks for it."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain_requested.wait(), interval)
            self._drain_requested.clear()
            try:
                await self.drain_release_queue(directory)
            except Exception as exc:  # keep draining later; never kill the daemon over it
                log.error("release_queue_drain_failed", error=str(exc))


def _log_finding(finding: Finding) -> None:
    """One line per address the world named that the state file did not have as it says."""
    owner = finding.owner
    fields: dict[str, object] = {
        "address": finding.address,
        "source": ",".join(dict.fromkeys(s.source.value for s in finding.sightings)),
        "pod": owner.pod or None,
        "container_id": owner.container_id,
        "reason": finding.why,
    }
    entry = finding.entry
    if entry is not None:
        fields |= {"ip_id": entry.ip_id, "subnet": entry.lane or None}
    if finding.outcome is Outcome.ADOPTED:
        log.warning("state_adopted", ifname=owner.ifname, **fields)
    elif finding.outcome is Outcome.CONFLICT:
        holder = entry.holder if entry is not None else None
        log.error(
            "state_conflict",
            **fields,
            held_by_pod=holder.pod or None if holder else None,
            held_by_container=holder.container_id if holder else None,
            outcome="refused: nothing changes, no pod loses the address; a human must look",
        )
    elif finding.outcome is Outcome.UNKNOWN:
        log.warning(
            "state_address_unknown",
            **fields,
            outcome="remembered: adopted, not handed out, if the pool gets it",
        )


def _log_invalid_entries(directory: Path, bad: Sequence[release_queue.Quarantined]) -> None:
    """One line for a drain's bad queue files: counts by reason and outcome, and a few."""
    log.error(
        "release_queue_entries_invalid",
        directory=str(directory),
        count=len(bad),
        reasons=dict(collections.Counter(b.kind for b in bad)),
        outcomes=dict(collections.Counter(b.outcome.split(":")[0] for b in bad)),
        examples=[
            {"file": str(directory / b.name), "reason": b.reason, "outcome": b.outcome}
            for b in bad[:INVALID_ENTRY_EXAMPLES]
        ],
    )


def utc_text(at: float | None) -> str | None:
    """A wall-clock time as RFC 3339 UTC with milliseconds, for people and JSON."""
    if at is None:
        return None
    stamp = dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _log_ip(
    event: str, record: IPRecord, key: OwnerKey, owner: Owner | None, **fields: object
) -> None:
    """One line per IP handed out or taken back, naming the pod from the runtime's K8S_POD_*
    CNI args when it passed them."""
    log.info(
        event,
        ip=record.address,
        container_id=key.container_id,
        ifname=key.ifname,
        pod=owner.pod if owner else "",
        **fields,
    )
