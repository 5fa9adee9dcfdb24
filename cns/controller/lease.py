"""Leader election on a `coordination.k8s.io/v1` Lease, so two controller replicas are safe.

Same contract as client-go's leaderelection: take the lease when it is free or expired, renew it
well inside its duration, and stop leading (the caller exits) when a renewal cannot be made
before the renew deadline. Every write carries the lease's resourceVersion, so two candidates
racing for it cannot both win.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

log = structlog.get_logger("cns.controller.lease")


class LostLeadership(Exception):
    """The lease could not be renewed in time; another replica may lead now."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaderElector:
    def __init__(
        self,
        api: client.ApiClient,
        name: str,
        namespace: str,
        identity: str,
        lease_seconds: int = 15,
        renew_deadline_seconds: float = 10,
        retry_seconds: float = 2,
    ) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.name = name
        self.namespace = namespace
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_deadline_seconds = renew_deadline_seconds
        self.retry_seconds = retry_seconds
        self.leading = False

    async def _try(self) -> bool:
        """One attempt to take or renew the lease; True when we hold it afterwards."""
        now = _now()
        try:
            lease = await self.coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
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
            try:
                await self.coordination.create_namespaced_lease(self.namespace, body)
            except ApiException as create_exc:
                if create_exc.status == 409:
                    return False
                raise
            return True
        spec = lease.spec or client.V1LeaseSpec()
        holder = spec.holder_identity or ""
        renewed = spec.renew_time or spec.acquire_time
        duration = spec.lease_duration_seconds or self.lease_seconds
        expired = renewed is None or renewed + dt.timedelta(seconds=duration) < now
        if holder != self.identity and holder and not expired:
            return False
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = self.lease_seconds
        lease.spec = spec
        try:
            await self.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

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

    async def hold(self) -> None:
        """Renew until a renewal fails past the deadline; then raise LostLeadership."""
        last = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.retry_seconds)
            try:
                renewed = await self._try()
            except Exception as exc:
                log.warning("lease_renew_failed", lease=self.name, error=repr(exc))
                renewed = False
            now = asyncio.get_running_loop().time()
            if renewed:
                last = now
            elif now - last > self.renew_deadline_seconds:
                self.leading = False
                raise LostLeadership(f"could not renew lease {self.namespace}/{self.name}")
