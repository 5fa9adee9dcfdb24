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
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from cns import release_queue
from cns.config import Coalescing
from cns.core.leaks import Held, LeakLedger, Reclaimed, Suspect
from cns.core.pool import AddressUnavailable, Assignment, IPRecord, OwnerConflict, Pool
from cns.core.scaling import effective_batch
from cns.core.types import IPState, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.source import IgnoredContainer, NCSource, SourceState
from cns.store import Batch, Forget, Rejected, Save, Store, StoreError

log = structlog.get_logger("cns.node")

PUBLISH_RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)
DEFAULT_COALESCING = Coalescing()


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
    record: IPRecord
    network: NetworkContainer
    waited_seconds: float


@dataclass(frozen=True, slots=True)
class WaitReason:
    """Why an ADD finds no free IP now: a `code` for programs, a `message` for people, and the
    figures behind it."""

    code: str  # no-network, cooldown, exhausted, max-ip-count or allocation-pending
    message: str
    figures: dict[str, float | int | str | None]


@dataclass(slots=True)
class _Waiter:
    owner: Owner
    since: float = field(default_factory=time.time)  # wall clock, for people
    address: str = ""  # the one address it waits for (its pod's annotation), if any
    why: str = ""  # why that address could not be had, last time it was tried
    # The IP it was given and the batch that records it (None if nothing had to be recorded).
    future: asyncio.Future[tuple[IPRecord, Batch | None]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


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
        self.pool = pool
        self.store = store
        self.source = source
        self.config_scaler = scaler
        self.add_timeout_seconds = add_timeout_seconds
        self.cooldown_seconds = cooldown_seconds
        self._cooling_started = asyncio.Event()  # wakes `end_cooldowns_forever`
        # Triggers come in bursts (a scheduler binding pods, a rollout's ADDs): see _until_quiet.
        self.coalescing = coalescing
        self.exhausted = False
        self.source_scaler: Scaler | None = None
        self.pod_demand = 0
        self.pod_addresses: Mapping[str, str] = {}  # pod -> the address its annotation asks for
        self.ignored_containers: tuple[IgnoredContainer, ...] = ()  # shown, never used
        self.sent: PoolRequest | None = None
        self.published_at: float | None = None  # wall clock of the last publish
        # `sent` came from a snapshot file written ahead of a publish that may never have landed.
        self._sent_unconfirmed = False
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
        self.stopping = False
        self.leaks = LeakLedger()  # filled by cns/leaks.py when the leak check runs

    # -- derived state -------------------------------------------------------------------------

    @property
    def scaler(self) -> Scaler:
        """The control plane's scaler when it sends one, else the configured one."""
        return self.source_scaler or self.config_scaler

    def waiting_count(self) -> int:
        return len({w.owner.key for w in self._waiters})

    def demand(self) -> int:
        """U: assigned plus waiting, or the pods scheduled here if the cluster says more."""
        return max(self.pool.assigned_count() + self.waiting_count(), self.pod_demand)

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
        """Apply a control-plane snapshot: network containers, exhaustion, scaler."""
        for nc in state.containers:
            change = self.pool.apply_nc(nc)
            if change.stale:
                applied = self.pool.network_container(nc.id)
                log.warning(
                    "network_container_stale_ignored",
                    nc=nc.id,
                    version=nc.version,
                    applied_version=applied.version if applied else None,
                )
            for problem in change.inconsistencies:
                self.inconsistencies_total += 1
                log.error("pool_inconsistency", nc=nc.id, problem=problem)
            if change.added or change.removed or change.programmed:
                log.info(
                    "network_container_applied",
                    nc=nc.id,
                    version=nc.version,
                    added=len(change.added),
                    removed=len(change.removed),
                    programmed=len(change.programmed),
                    ips=len(self.pool.records),
                )
        if state.request is not None:
            for ip_id in self.pool.honour_release(state.request.ips_not_in_use):
                self.inconsistencies_total += 1
                log.error("pool_inconsistency", problem=f"assigned IP {ip_id} is in ipsNotInUse")
        self._honour_release_requests(state.release_requests)
        if state.exhausted != self.exhausted:
            log.warning("subnet_exhaustion_changed", exhausted=state.exhausted)
        self.exhausted = state.exhausted
        self.source_scaler = state.scaler
        self.pod_demand = state.pod_demand
        self.pod_addresses = state.pod_addresses
        self.ignored_containers = state.ignored
        if self.sent is None or self._sent_unconfirmed:
            # Until the control plane's own view arrives, the snapshot's request stands in for
            # what was published; then the control plane's spec is what it heard, and the next
            # plan is compared with that (a request written ahead of a crash is sent again).
            self.sent = state.request
            self._sent_unconfirmed = state.from_snapshot
        if state.containers:
            self.has_network.set()
        self._cooling_started.set()  # IPs the containers brought back may be cooling down
        self._serve_waiters()
        self.kick()

    def _honour_release_requests(self, ip_ids: tuple[str, ...]) -> None:
        """Give up what the control plane asks for, except an IP a pod here uses: that one is
        kept and reported once (the control plane then reclaims the address elsewhere)."""
        kept = set(self.pool.honour_release(ip_ids))
        for ip_id in ip_ids:
            if ip_id in self._release_requested:
                continue
            record = self.pool.records.get(ip_id)
            address = record.address if record else None
            if ip_id in kept:
                self.inconsistencies_total += 1
                log.error("ip_release_refused", ip_id=ip_id, ip=address, reason="a pod uses it")
            else:
                log.warning("ip_release_requested", ip_id=ip_id, ip=address)
        self._release_requested = set(ip_ids)

    def _serve_waiters(self) -> None:
        """Hand out what can be: first each awaited address that has come, then free IPs to
        the other waiters in arrival order."""
        for waiter in [w for w in self._waiters if w.address]:
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            try:
                record, changed = self.pool.assign_address(waiter.owner, waiter.address)
            except AddressUnavailable as why:
                waiter.why = str(why)
                continue
            except OwnerConflict as conflict:
                self._waiters.remove(waiter)
                waiter.future.set_exception(conflict_error(conflict))
                continue
            self._waiters.remove(waiter)
            self._hand_over(waiter, record, changed)
        while self.pool.available_count():
            next_one = next((w for w in self._waiters if not w.address), None)
            if next_one is None:
                break
            self._waiters.remove(next_one)
            if next_one.future.done():
                continue
            try:
                served, changed = self.pool.assign(next_one.owner)
            except OwnerConflict as conflict:  # refuse_conflict() keeps this from happening
                next_one.future.set_exception(conflict_error(conflict))
                continue
            assert served is not None
            self._hand_over(next_one, served, changed)

    def _hand_over(self, waiter: _Waiter, record: IPRecord, changed: bool) -> None:
        key = waiter.owner.key
        batch = self._pending(key)
        if changed:
            batch = self._record(key, Save(self._assignment(record)))
        waiter.future.set_result((record, batch))

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
        container yet, or the plan is what the control plane already has). A failed publish
        raises PublishFailed and leaves `sent` as it was, so the next call sends the request
        again. Planning marks the excess `PendingRelease` (they go out in ipsNotInUse).
        """
        if not self.has_network.is_set():
            return None
        request = self.pool.plan(
            self.scaler,
            self.exhausted,
            self.demand(),
            self.sent,
            wanted=frozenset(self.pod_addresses.values()),
        )
        if request == self.sent:
            return None
        try:
            await self.source.publish(request)
        except Exception as exc:
            raise PublishFailed(str(exc)) from exc
        self.publishes_total += 1
        self.published_at = time.time()
        log.info(
            "pool_request_published",
            requested_ip_count=request.requested_ip_count,
            ips_not_in_use=len(request.ips_not_in_use),
            demand=self.demand(),
            batch=effective_batch(self.scaler, self.exhausted),
            exhausted=self.exhausted,
        )
        self.sent = request
        self._sent_unconfirmed = False
        return request

    def _plan_inputs(self) -> tuple[object, ...]:
        return (
            self.demand(),
            self.exhausted,
            self.scaler,
            self.pool.held_count(),
            frozenset(self.pod_addresses.values()),
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
        """End each cooldown when it is due: its IP becomes Available, a waiting ADD gets it."""
        while True:
            self._cooling_started.clear()
            end = self.pool.next_cooldown_end()
            timeout = None if end is None else max(0.0, end - time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cooling_started.wait(), timeout)
            self.end_cooldowns()

    def end_cooldowns(self) -> None:
        ended = self.pool.expire_cooldowns(now=time.time(), longest=self.cooldown_seconds)
        if ended:
            log.info("ip_cooldown_ended", ips=len(ended), still_cooling=self.pool.cooling_count())
            self._serve_waiters()
            self.kick()

    async def tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.kick()

    # -- CNI verbs -----------------------------------------------------------------------------

    def _assignment(self, record: IPRecord) -> Assignment:
        assert record.owner is not None
        return Assignment(record.id, record.address, record.nc_id, record.owner)

    def _network_of(self, record: IPRecord) -> NetworkContainer:
        nc = self.pool.network_container(record.nc_id)
        if nc is None:
            raise InternalError(102, f"IP {record.address} belongs to unknown NC {record.nc_id}")
        return nc

    def refuse_conflict(self, owner: Owner) -> None:
        """Raise Conflict (code 4) when the attachment is held by, or being added for, another
        pod."""
        record = self.pool.lookup(owner.key)
        holders = [record.owner] if record is not None and record.owner is not None else []
        holders += [w.owner for w in self._waiters if w.owner.key == owner.key]
        for holder in holders:
            if holder.conflicts_with(owner):
                raise conflict_error(OwnerConflict(holder, owner))

    async def add(self, owner: Owner, requested: str = "") -> AddResult:
        """Assign an IP to `owner`, waiting (bounded) for the pool to grow if none is free;
        with `requested`, that address if the pool can give it now (code 11 saying why not:
        a pod that asks for one address wants that one, not whichever frees up first). A pod
        whose annotation asks for an address (Kubernetes mode) waits, bounded, for the control
        plane to bring it (`PoolRequest.requested_ips`)."""
        if self.stopping:
            raise _stopping_error()
        self.refuse_conflict(owner)
        started = time.monotonic()
        record, changed = (None, False)
        annotated = "" if requested else self.pod_addresses.get(owner.pod, "")
        if requested:
            record, changed = self._assign_requested(owner, requested)
        elif annotated:
            with contextlib.suppress(AddressUnavailable):
                if self.has_network.is_set():
                    record, changed = self.pool.assign_address(owner, annotated)
        elif self.has_network.is_set():
            record, changed = self.pool.assign(owner)
        if record is not None:
            batch = self._pending(owner.key)
            if changed:
                batch = self._record(owner.key, Save(self._assignment(record)))
                self.kick()
            await self.durable(batch)
            if changed:
                _log_ip("ip_assigned", record, owner.key, owner, waited_seconds=0.0)
            return AddResult(record, self._network_of(record), 0.0)
        waiter = _Waiter(owner, address=annotated)
        self._waiters.append(waiter)
        self._serve_waiters()  # the address may have come while the ADD was on its way
        self.kick()
        try:
            served, batch = await asyncio.wait_for(
                asyncio.shield(waiter.future), self.add_timeout_seconds
            )
        except TimeoutError:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
                self.kick()
                raise self._no_ip_error(waiter) from None
            served, batch = waiter.future.result()
        finally:
            waited = time.monotonic() - started
            if self._on_add_waited is not None:
                self._on_add_waited(waited)
        await self.durable(batch)
        _log_ip("ip_assigned", served, owner.key, owner, waited_seconds=round(waited, 3))
        return AddResult(served, self._network_of(served), waited)

    def _assign_requested(self, owner: Owner, address: str) -> tuple[IPRecord, bool]:
        if not self.has_network.is_set():
            raise Unavailable(
                11, f"requested address {address}: no network container from the control plane yet"
            )
        try:
            return self.pool.assign_address(owner, address)
        except AddressUnavailable as why:
            raise Unavailable(
                11, f"requested address {address} cannot be assigned: {why}"
            ) from None
        except OwnerConflict as conflict:
            raise conflict_error(conflict) from None

    def _record(self, key: OwnerKey, op: Save | Forget) -> Batch:
        """Queue the durable record of a change to `key`'s assignment made in this same step."""
        batch = self.store.enqueue([op])
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
        undone, retaken = self.pool.follow(self.store.assignments)
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

    def wait_reason(self) -> WaitReason:
        """Why an ADD would find no free IP now, most actionable cause first."""
        now = time.time()
        counts = self.pool.counts()
        figures: dict[str, float | int | str | None] = {
            "requestedIPCount": self.sent.requested_ip_count if self.sent else 0,
            "requestPublishedAt": utc_text(self.published_at),
            "held": self.pool.held_count(),
            "available": counts[IPState.AVAILABLE],
            "assigned": counts[IPState.ASSIGNED],
            "cooldown": counts[IPState.COOLDOWN],
            "waiting": self.waiting_count(),
            "maxIPCount": self.scaler.max_ip_count,
            "subnetExhausted": self.exhausted,
        }
        if not self.has_network.is_set():
            return WaitReason(
                "no-network", "no network container from the control plane yet", figures
            )
        if cooling := self.pool.cooling_count():
            end = self.pool.next_cooldown_end() or now
            figures["nextCooldownEndsAt"] = utc_text(end)
            return WaitReason(
                "cooldown",
                f"{cooling} IPs in cooldown (ipCooldownSeconds={self.cooldown_seconds:g}), "
                f"the next free in {max(0.0, end - now):.1f} s",
                figures,
            )
        if self.exhausted:
            return WaitReason(
                "exhausted", "subnet exhausted: the control plane has no IP for this node", figures
            )
        if self.pool.held_count() + self.pool.primary_ip_count >= self.scaler.max_ip_count:
            return WaitReason(
                "max-ip-count", f"node at maxIPCount ({self.scaler.max_ip_count})", figures
            )
        asked = ""
        if self.sent is not None and self.published_at is not None:
            asked = (
                f"; {self.sent.requested_ip_count} IPs requested "
                f"{max(0.0, now - self.published_at):.1f} s ago"
            )
        return WaitReason(
            "allocation-pending",
            f"allocation still pending: the control plane has not delivered the IPs yet{asked}",
            figures,
        )

    def waiters_of(self, pod: str) -> list[tuple[Owner, float]]:
        """The ADDs of pod `namespace/name` waiting for an IP, with when each began."""
        return [(w.owner, w.since) for w in self._waiters if w.owner.pod == pod]

    def _no_ip_error(self, waiter: _Waiter) -> IPAMError:
        reason = self.wait_reason()
        details = " ".join(f"{k}={v}" for k, v in reason.figures.items() if v is not None)
        timeout = self.add_timeout_seconds
        if waiter.address:
            why = waiter.why or f"{waiter.address} is not in this node's pool"
            return Unavailable(
                11,
                f"the address pod {waiter.owner.pod} asks for in its annotation did not "
                f"come within {timeout:g} s: {why}; the control plane grants it only once it "
                "is free in the subnet",
                details,
            )
        return Unavailable(11, f"no free IP within {timeout:g} s: {reason.message}", details)

    async def delete(self, key: OwnerKey, reason: str = "cni-del") -> IPRecord | None:
        """Release the owner's IP; an unknown owner is a success."""
        record = self.release(key, reason=reason)
        await self._durable_for([key])
        return record

    def release(self, key: OwnerKey, reason: str) -> IPRecord | None:
        for waiter in [w for w in self._waiters if w.owner.key == key]:
            self._waiters.remove(waiter)
            waiter.future.cancel()
        held = self.pool.lookup(key)
        owner = held.owner if held else None
        cool_until = time.time() + self.cooldown_seconds if self.cooldown_seconds else 0.0
        record = self.pool.release(key, cool_until=cool_until)
        if record is None:
            return None
        cooled_pod = owner.pod if owner is not None and cool_until else ""
        self._record(key, Forget(record.id, cool_until=cool_until, pod=cooled_pod))
        self.releases[reason.split(":")[0]] += 1
        _log_ip("ip_released", record, key, owner, reason=reason, cooldown_until=cool_until or None)
        if cool_until:
            self._cooling_started.set()
        self._serve_waiters()
        self.kick()
        return record

    def leak_inputs(self) -> tuple[list[Held], list[tuple[str, OwnerKey]]]:
        """The assigned IPs and the ADDs waiting for one (pod, key): what the leak check reads."""
        held = []
        for key in self.pool.owners():
            record = self.pool.lookup(key)
            if record is not None and record.owner is not None:
                held.append(Held(key, record.id, record.address, record.owner.pod))
        return held, [(w.owner.pod, w.owner.key) for w in self._waiters]

    async def reclaim(self, leaks: Iterable[Suspect], *, now_wall: float) -> list[IPRecord]:
        """Release leaked IPs (cns/core/leaks.py decided which), each only if the same
        attachment still holds the same IP; durable when this returns."""
        released = []
        keys = []
        for suspect in leaks:
            held = suspect.held
            record = self.pool.lookup(held.key)
            if record is None or record.id != held.ip_id:
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
            if self.release(held.key, reason=f"leak:{suspect.reason.value}") is not None:
                released.append(record)
                keys.append(held.key)
                self.leaks.record(Reclaimed(held, suspect.reason, suspected, now_wall))
        await self._durable_for(keys)
        return released

    def check(self, key: OwnerKey, addresses: Iterable[str]) -> IPRecord:
        record = self.pool.lookup(key)
        if record is None:
            raise NotFound(
                3, f"no IP allocated to container {key.container_id} interface {key.ifname}"
            )
        given = [a.split("/")[0] for a in addresses]
        if given and record.address not in given:
            raise Conflict(
                104,
                f"container {key.container_id} holds {record.address}, not {', '.join(given)}",
            )
        return record

    async def gc(self, valid: set[OwnerKey]) -> list[str]:
        """Release every attachment the runtime no longer knows (CNI GC)."""
        released = []
        stale = [key for key in self.pool.owners() if key not in valid]
        for key in stale:
            record = self.release(key, reason="cni-gc")
            if record is not None:
                released.append(record.address)
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

        The files are read in a worker thread (the directory is untrusted, see
        cns/release_queue.py); bad entries are quarantined there and logged here.
        """
        entries, bad = await asyncio.to_thread(release_queue.collect, directory)
        for rejected in bad:
            log.error(
                "release_queue_entry_invalid",
                file=str(directory / rejected.name),
                reason=rejected.reason,
                outcome=rejected.outcome,
            )
        for entry in entries:
            self.release(entry.key, reason="queued-del")
        await self._durable()
        await asyncio.to_thread(release_queue.remove, directory, entries)
        if entries:
            log.info("release_queue_drained", entries=len(entries))
        return len(entries)

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
