"""Leader election on a `coordination.k8s.io/v1` Lease, with fencing of the leader's writes.

The contract is client-go's leaderelection. A candidate takes the lease when it is free, or when
the lease record has not changed for a whole lease duration *by the candidate's own clock*: the
expiry is measured from when the candidate first saw the current record, never from the holder's
`renewTime`, so clock skew between machines cannot make a live lease look expired. Every write of
the lease carries its resourceVersion, so two candidates racing for it cannot both win.

Fencing: the holder may write only while it can prove it still holds the lease. A renewal that
landed was sent at some monotonic instant `s`; no other candidate can take the lease before
`s + lease duration` (it must see the record unchanged for that long after the renewal landed),
so `can_write()` allows writes until `s + renew deadline`, leaving the rest of the duration
(a third by default) for a write sent just before the deadline to land and for clock-rate
drift. This keeps a stale leader's writes rare; it is not what makes them harmless: every write
that matters is also conditional on the resourceVersion it was planned from (see
docs/design/controller-safety.md).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable

import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from cns.kube.client import KubeClient
from cns.support import faults

log = structlog.get_logger("cns.controller.lease")


class LostLeadership(Exception):
    """The lease could not be renewed in time; another replica may lead now."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaderElector:
    def __init__(
        self,
        kube: KubeClient,
        *,
        name: str,
        namespace: str,
        identity: str,
        lease_seconds: int = 15,
        renew_deadline_seconds: float = 10,
        retry_seconds: float = 2,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not 0 < renew_deadline_seconds < lease_seconds:
            raise ValueError("the renew deadline must be shorter than the lease")
        self.coordination = kube.coordination
        self.name = name
        self.namespace = namespace
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_deadline_seconds = renew_deadline_seconds
        self.retry_seconds = retry_seconds
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self.leading = False
        self._renewed_at = float("-inf")  # when the last renewal that landed was sent
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0
        self._observed_duration = lease_seconds  # the lease duration the record gives

    def can_write(self) -> bool:
        """True while this replica leads and its last renewal is within the renew deadline."""
        return self.leading and self._clock() < self._renewed_at + self.renew_deadline_seconds

    def fence(self) -> None:
        """Raise LostLeadership unless a write may go out now."""
        if not self.can_write() and not faults.active("controller.skip_fencing"):
            self.leading = False
            raise LostLeadership(f"lease {self.namespace}/{self.name} not renewed in time")

    def _observe(self, spec: client.V1LeaseSpec, at: float) -> None:
        record = (
            spec.holder_identity,
            spec.renew_time,
            spec.acquire_time,
            spec.lease_transitions,
            spec.lease_duration_seconds,
        )
        if record != self._observed:
            self._observed, self._observed_at = record, at
            self._observed_duration = spec.lease_duration_seconds or self.lease_seconds

    async def _try(self) -> bool:
        """One attempt to take or renew the lease; True when we hold it afterwards."""
        try:
            lease = await self.coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return await self._create()
        spec = lease.spec or client.V1LeaseSpec()
        self._observe(spec, self._clock())
        holder = spec.holder_identity or ""
        expiry = self._observed_at + self._observed_duration
        if holder and holder != self.identity and self._clock() < expiry:
            return False  # held, and renewed within a duration as far as we have seen
        now = _now()
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = self.lease_seconds
        lease.spec = spec
        sent = self._clock()
        try:
            updated = await self.coordination.replace_namespaced_lease(
                self.name, self.namespace, lease
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._renewed(updated.spec or spec, sent)
        return True

    async def _create(self) -> bool:
        now = _now()
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=self.lease_seconds,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        sent = self._clock()
        try:
            created = await self.coordination.create_namespaced_lease(self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._renewed(created.spec or body.spec, sent)
        return True

    def _renewed(self, spec: client.V1LeaseSpec, sent: float) -> None:
        self._renewed_at = sent
        self._observe(spec, sent)

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        while True:
            try:
                if await self._try():
                    self.leading = True
                    log.info("leader_elected", lease=self.name, identity=self.identity)
                    return
            except Exception as exc:
                log.warning("lease_attempt_failed", lease=self.name, error=repr(exc))
                await asyncio.sleep(self.retry_seconds)
                continue
            await asyncio.sleep(self._next_attempt_in())

    def _next_attempt_in(self) -> float:
        """A candidate looks every half retry period (a renewal is seen at most that late, and
        the expiry is counted from when it is seen), and exactly when the record it watches
        would expire if that is sooner: a fail-over then takes the lease duration plus at
        most half a retry period, not plus up to two."""
        wait = self.retry_seconds / 2
        if self._observed is not None:
            wait = min(wait, self._observed_at + self._observed_duration - self._clock())
        return max(wait, 0.01)

    async def hold(self) -> None:
        """Renew until a renewal cannot be made within the deadline; then raise LostLeadership."""
        while True:
            await asyncio.sleep(self.retry_seconds)
            try:
                renewed = await self._try()
            except Exception as exc:
                log.warning("lease_renew_failed", lease=self.name, error=repr(exc))
                renewed = False
            if renewed:
                continue
            holder = self._observed[0] if self._observed is not None else None
            if holder not in (self.identity, None, ""):
                self.leading = False
                raise LostLeadership(f"lease {self.namespace}/{self.name} taken by {holder}")
            self.fence()

    async def release(self) -> None:
        """Give the lease up (on shutdown), so that a standby takes over at once rather than
        after a lease duration. Only a lease still held is released, with its resourceVersion."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.coordination.read_namespaced_lease(self.name, self.namespace)
            spec = lease.spec or client.V1LeaseSpec()
            if spec.holder_identity != self.identity:
                return
            spec.holder_identity = None  # type: ignore[assignment]
            spec.lease_duration_seconds = 1
            spec.renew_time = _now()
            lease.spec = spec
            await self.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
            log.info("lease_released", lease=self.name, identity=self.identity)
        except Exception as exc:  # the lease then simply expires
            log.warning("lease_release_failed", lease=self.name, error=repr(exc))
