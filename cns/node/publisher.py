"""The node's request to the control plane: plan every lane, merge, publish, retry.

One small task (`reconcile_forever`) runs the step `reconcile_once` after coalescing triggers
(an ADD waiting, a DEL, a network container update, exhaustion, the tick): a burst of triggers
becomes one request. Planning is the pure planner's (`Pool.plan`), lane by lane, each with its
own demand, batch, exhaustion and annotated addresses; the node's own subnet's request is the
top level of what is published, the others go by subnet name.

Runs on the event loop; only `reconcile_once` awaits (the publish itself).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from cns.config.daemon_config import Coalescing
from cns.core.overflow import overflow_demand, primary_demand, spill
from cns.core.scaling import effective_batch
from cns.core.types import PoolRequest
from cns.node.control_plane import NCSource
from cns.node.errors import PublishFailed
from cns.node.lanes import Lanes
from cns.node.waiters import WaitQueue

log = structlog.get_logger("cns.node")

PUBLISH_RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)


class Publisher:
    """Plans and publishes the lanes' requests; `kick()` asks for a new plan."""

    def __init__(
        self,
        lanes: Lanes,
        waiters: WaitQueue,
        source: NCSource,
        *,
        coalescing: Coalescing,
        pod_addresses: Callable[[], Mapping[str, str]],
    ) -> None:
        self.lanes = lanes
        self.waiters = waiters
        self.source = source
        self.coalescing = coalescing
        self._pod_addresses = pod_addresses
        self.dirty = asyncio.Event()
        self.publishes_total = 0
        # The further subnets the control plane has a request of (spec.subnets).
        self.published_subnets: frozenset[str] = frozenset()
        # The last state came from the snapshot file, not (yet) from the control plane.
        self.from_snapshot = False
        self._pause: _Pause | None = None  # while `until_quiet` waits

    def kick(self) -> None:
        """Ask the reconcile task to recompute the request (coalesced). During the pause, a
        change to what the plan depends on restarts it, and an ADD waiting ends it; the pause
        is told here rather than woken for every trigger."""
        self.dirty.set()
        pause = self._pause
        if pause is not None:
            if (inputs := self._plan_inputs()) != pause.inputs:
                pause.inputs, pause.quiet_from = inputs, pause.loop.time()
            if self.waiters and not pause.wake.done():
                pause.wake.set_result(False)

    def waiting_count(self, key: str = "") -> int:
        """ADDs waiting for an IP of lane `key` (each owner once, none that holds one there)."""
        if not self.waiters:
            return 0
        lane = self.lanes.get(key)
        pool = lane.pool if lane is not None else None
        return len(
            {
                w.owner.key
                for w in self.waiters
                if key in map(self.lanes.key, w.subnets)
                and (pool is None or pool.lookup(w.owner.key) is None)
            }
        )

    def demand(self, key: str = "") -> int:
        """U of lane `key`: assigned plus waiting, or the pods scheduled here if the cluster
        says more. With overflow subnets (cns/core/overflow.py), a pod of the primary that
        holds an overflow subnet's address counts there, not in the primary, and the pods the
        primary cannot serve count ahead in the subnet that takes them."""
        lanes = self.lanes
        lane = lanes[key]
        own = lane.pool.assigned_count() + self.waiting_count(key)
        if not key:
            overflowed = sum(lanes.overflowed(k) for k, _ in lanes.further())
            return max(own, primary_demand(lane.pod_demand, overflowed=overflowed))
        if key not in lanes.overflow_keys():
            return max(own, lane.pod_demand)
        spilled = self.spilled() if key == lanes.overflow_target() else 0
        return max(
            own,
            overflow_demand(lane.pod_demand, overflowed=lanes.overflowed(key), spilled=spilled),
        )

    def spilled(self) -> int:
        """The primary's pods its lane cannot serve with the addresses it holds, while its
        subnet sends them on (`spill`)."""
        primary = self.lanes.primary
        return spill(
            primary_exhausted=primary.exhausted,
            primary_draining=primary.draining,
            demand=self.demand(),
            holds=primary.pool.assigned_count() + primary.pool.available_count(),
        )

    def keeps_only_held(self, key: str) -> bool:
        """Whether lane `key` asks only for what its pods hold (assigned and cooling), no spare:
        its subnet is draining, or it is an overflow subnet no pod here chooses by name while
        the primary does not send its pods on."""
        lanes = self.lanes
        lane = lanes[key]
        return lane.draining or (
            key in lanes.overflow_keys() and not lane.pod_demand and not lanes.overflow_open()
        )

    async def reconcile_forever(self) -> None:
        """Whenever something changed and then settled, reconcile; retry a failed publish later."""
        failures = 0
        while True:
            await self.dirty.wait()
            await self.until_quiet()
            try:
                if await self.reconcile_once() is not None:
                    failures = 0
            except PublishFailed as exc:
                delay = PUBLISH_RETRY_SECONDS[min(failures, len(PUBLISH_RETRY_SECONDS) - 1)]
                failures += 1
                log.warning("pool_request_failed", error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                self.kick()

    def plan(self) -> dict[str, PoolRequest]:
        """Every lane's request for its demand now, by key (the primary "" first), after dropping
        the lanes nothing needs any more; a removed lane asks for nothing. Planning marks the excess
        `PendingRelease` (they go out in ipsNotInUse)."""
        lanes = self.lanes
        wanted = lanes.wanted(self._pod_addresses())
        if (target := lanes.overflow_target()) is not None and self.spilled():
            lanes.lane(target)  # asked for ahead of the ADDs it will serve
        lanes.drop_idle(self.demand)
        return {
            key: lane.pool.plan(
                lanes.scaler(lane),
                lane.exhausted,
                self.demand(key),
                lane.sent,
                wanted=wanted.get(key, frozenset()),
                draining=self.keeps_only_held(key),
            )
            for key, lane in lanes.items()
            if not lane.removed
        }

    async def reconcile_once(self) -> PoolRequest | None:
        """Plan the request for the demand now and publish it if it differs from the last one sent.

        Returns the node's own subnet's request published, or None when there was nothing to
        publish (no network container yet, the control plane's own state not seen yet, or the
        plan is what the control plane already has). Nothing is planned from the snapshot file a
        restart reads: it has no pods, so its demand can be far too low, and a plan from it gave
        IPs back that the pods scheduled here were about to take, then asked for them again. A
        failed publish raises PublishFailed and leaves `sent` as it was, so the next call sends
        the request again.
        """
        lanes = self.lanes
        if not lanes.has_network.is_set() or self.from_snapshot:
            return None
        plans = self.plan()
        subnets = {key: plan for key, plan in plans.items() if key}
        if self.published_subnets == frozenset(subnets) and all(
            plan == lanes[key].sent for key, plan in plans.items()
        ):
            return None
        request = plans[""]
        try:
            await self.source.publish(request, subnets)
        except Exception as exc:
            raise PublishFailed(str(exc)) from exc
        self.publishes_total += 1
        now = time.time()
        primary = lanes.primary
        log.info(
            "pool_request_published",
            requested_ip_count=request.requested_ip_count,
            ips_not_in_use=len(request.ips_not_in_use),
            demand=self.demand(),
            batch=effective_batch(lanes.scaler(primary), primary.exhausted),
            exhausted=primary.exhausted,
            **(
                {"subnets": {k: r.requested_ip_count for k, r in subnets.items()}}
                if subnets
                else {}
            ),
        )
        for key, sent in plans.items():
            lane = lanes[key]
            # The primary lane's request is the top level of every publish; a further lane's
            # counts as published when it changed.
            if lane is primary or lane.sent != sent:
                lane.published_at = now
            lane.sent, lane.sent_unconfirmed = sent, False
        self.published_subnets = frozenset(subnets)
        return request

    def _plan_inputs(self) -> tuple[object, ...]:
        return (
            frozenset(self._pod_addresses().values()),
            *(
                (key, self.demand(key), lane.exhausted, lane.source_scaler, lane.pool.held_count())
                for key, lane in self.lanes.items()
            ),
        )

    async def until_quiet(self) -> None:
        """Wait until what the plan depends on has stopped changing for the quiet time, at most
        the maximum delay (config `requestCoalescing`), so a burst becomes one request.

        Only a change restarts the pause. An ADD for a pod the pod watch already counted changes
        nothing, and in a burst those ADDs arrive every few milliseconds: letting them restart it
        held the request back for the whole maximum delay while later ADDs ran out of free IPs. An
        ADD already waiting for an IP ends the pause at once: a pod is blocked on this request.
        `kick` compares the inputs; the pause sleeps until the quiet time has passed since the
        last change, so a burst of triggers costs no wake-up each.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        pause = _Pause(
            loop,
            self._plan_inputs(),
            now,
            now + self.coalescing.max_delay_seconds,
            loop.create_future(),
        )
        self._pause = pause
        try:
            while True:
                self.dirty.clear()
                end = self._pause_end(pause)
                if end <= loop.time() or self.waiters:
                    return
                pause.wake = loop.create_future()
                timer = loop.call_at(end, _wake, pause.wake)
                try:
                    timed_out = await pause.wake
                finally:
                    timer.cancel()
                if timed_out and self._pause_end(pause) <= end:  # nothing changed since
                    self.dirty.clear()  # the triggers meanwhile are in the plan made now
                    return
        finally:
            self._pause = None

    def _pause_end(self, pause: _Pause) -> float:
        return min(pause.quiet_from + self.coalescing.quiet_seconds, pause.deadline)


@dataclass(slots=True)
class _Pause:
    """The coalescing pause in progress: what the plan depended on when it last changed, and
    since when."""

    loop: asyncio.AbstractEventLoop
    inputs: tuple[object, ...]
    quiet_from: float
    deadline: float
    wake: asyncio.Future[bool]  # True: the time is up; False: an ADD waits


def _wake(future: asyncio.Future[bool]) -> None:
    """The pause's time is up."""
    if not future.done():
        future.set_result(True)
