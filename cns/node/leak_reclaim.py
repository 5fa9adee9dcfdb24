"""Leak reclamation: the periodic check that takes back IPs whose DEL never came.

Each check asks the runtime which sandboxes exist (cns/host/cri.py), reads the pods of the node when
the daemon follows a cluster, and lets cns/core/leaks.py decide; the node releases what it
decided (reason `leak:<why>`, through the reuse cooldown like any release). The first check runs
at start-up: it can only find suspects, which are reclaimed after the grace period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import structlog

from cns.core.leaks import find_leaks
from cns.core.pool import IPRecord
from cns.host.cri import RuntimeUnavailable
from cns.node.errors import IPAMError
from cns.node.service import NodeIPAM

log = structlog.get_logger("cns.leaks")


class SandboxLister(Protocol):
    async def list_sandbox_ids(self) -> frozenset[str]:
        """Every sandbox the runtime has; RuntimeUnavailable when it cannot say."""


PodsOnNode = Callable[[], Mapping[str, bool] | None]


class LeakReclaimer:
    def __init__(
        self,
        node: NodeIPAM,
        runtime: SandboxLister,
        pods: PodsOnNode | None,
        *,
        grace_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.runtime = runtime
        self.pods = pods
        self.grace_seconds = grace_seconds
        self.clock = clock
        self.wall_clock = wall_clock
        node.leaks.enabled = True
        self._waiting_for_pods = False

    async def check_once(self) -> list[IPRecord]:
        """Ask the runtime, decide, release; returns the IPs taken back."""
        ledger = self.node.leaks
        try:
            sandboxes: frozenset[str] | None = await self.runtime.list_sandbox_ids()
            error = None
        except RuntimeUnavailable as exc:
            sandboxes, error = None, str(exc)
        if error != ledger.runtime_error:
            if error is None:
                log.info("leak_check_runtime_answers", sandboxes=len(sandboxes or ()))
            else:
                log.error("leak_check_runtime_unavailable", error=error, reclaiming="paused")
        ledger.runtime_error = error
        pods = self.pods() if self.pods is not None else None
        waiting_for_pods = self.pods is not None and pods is None
        if waiting_for_pods:
            # The cluster's pods are not known yet (the API server may be down): the runtime
            # alone does not decide here, so nothing is, until they are.
            sandboxes = None
        if waiting_for_pods != self._waiting_for_pods:
            log.info("leak_check_pods", known=not waiting_for_pods)
            self._waiting_for_pods = waiting_for_pods
        held, waiting = self.node.leak_inputs()
        verdict = find_leaks(
            held,
            sandboxes=sandboxes,
            pods=pods,
            waiting=waiting,
            suspects=ledger.suspects,
            now=self.clock(),
            now_wall=self.wall_clock(),
            grace_seconds=self.grace_seconds,
        )
        for key, suspect in verdict.suspects.items():
            if key not in ledger.suspects:
                log.info(
                    "ip_leak_suspected",
                    reason=suspect.reason.value,
                    address=suspect.held.address,
                    container=key.container_id,
                    ifname=key.ifname,
                    pod=suspect.held.pod or None,
                    reclaim_after_seconds=self.grace_seconds,
                )
        for key in ledger.suspects.keys() - verdict.suspects.keys():
            if self.node.held_by(key):  # still held: no longer suspected
                log.info("ip_leak_cleared", container=key.container_id, ifname=key.ifname)
        ledger.suspects = verdict.suspects
        ledger.checks += 1
        for suspect in verdict.leaks:
            del ledger.suspects[suspect.held.key]
        return await self.node.reclaim(verdict.leaks, now_wall=self.wall_clock())

    async def run_forever(self, interval: float) -> None:
        while True:
            try:
                await self.check_once()
            except IPAMError as exc:  # the releases could not be committed; the next check retries
                log.error("leak_check_failed", error=exc.msg)
            await asyncio.sleep(interval)
