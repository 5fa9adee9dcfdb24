"""IP pressure of the node, shown to the scheduler (config `ipPressure`, docs/kubernetes.md, "IP
pressure"): every second the lanes are read, the pure decision (cns/core/pressure.py) steps, and
a change is written to the Node as the condition `PodIPPressure` and the taint
`acn.azure.com/pod-ip-pressure:NoSchedule` (cns/kube/node_pressure.py).

At start a taint left by a daemon that crashed is the starting decision, which the readings then
keep or clear with the same hysteresis (no clear-and-set again across a restart); a daemon that
stops cleanly removes both; a daemon with `ipPressure` off removes what an earlier one left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.core.pressure import Cause, LaneReading, Pressure, PressureSettings, describe, step
from cns.kube.node_pressure import TAINT_KEY, Mark, NodeGone, NodeMarks
from cns.node.lanes import Lanes

log = structlog.get_logger("cns.node.ip_pressure")

READ_INTERVAL_SECONDS = 1.0
STOP_SECONDS = 5.0  # the most a clean stop waits to remove the taint
# What the API may answer or the connection do: logged and tried again, never a daemon stop.
WRITE_ERRORS = (ApiException, NodeGone, OSError, TimeoutError, aiohttp.ClientError)


def readings(lanes: Lanes) -> list[LaneReading]:
    """Every lane that hands out addresses: its free addresses (now or at the end of their
    cooldown), whether its subnet is exhausted and whether it is at maxIPCount."""
    found = []
    for key, lane in lanes.items():
        if lane.removed or not lanes.serves(lane):
            continue
        pool = lane.pool
        held = pool.held_count() + pool.primary_ip_count
        found.append(
            LaneReading(
                subnet=lanes.label(key),
                free=pool.available_count() + pool.cooling_count(),
                exhausted=lane.exhausted,
                at_max_ip_count=held >= lanes.scaler(lane).max_ip_count,
            )
        )
    return found


REASONS = {
    Cause.MAX_IP_COUNT: "MaxIPCountReached",
    Cause.EXHAUSTED: "SubnetExhausted",
    None: "SetBeforeRestart",
}


def mark_of(state: Pressure, settings: PressureSettings) -> Mark:
    """The condition (CamelCase reasons, as the kubelet's) and the taint of a decision."""
    message = describe(state, settings)
    if state.pressed:
        return Mark(status="True", reason=REASONS[state.cause], message=message)
    return Mark(status="False", reason="PodIPsAvailable", message=message)


class PressureReporter:
    """Steps the decision on the lanes' readings and writes each change to the Node.

    `on_change` is called with the old and the new decision on every change, before it is
    written: where a Kubernetes Event about the node is recorded (issue 28, item 1)."""

    def __init__(
        self,
        lanes: Lanes,
        marks: NodeMarks,
        settings: PressureSettings,
        *,
        on_change: Callable[[Pressure, Pressure], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lanes = lanes
        self.marks = marks
        self.settings = settings
        self.on_change = on_change
        self.clock = clock
        self.state = Pressure()
        self.shown: Mark | None = None  # what the Node shows, as last written (None: unknown)
        self.write_failures = 0

    async def start(self) -> None:
        """A taint on the node now was left by a daemon that did not stop cleanly: it is the
        starting decision, kept until the readings clear it."""
        try:
            stale = await self.marks.tainted()
        except WRITE_ERRORS as exc:
            log.warning("ip_pressure_read_failed", error=repr(exc))
            return
        if stale:
            self.state = Pressure(pressed=True)
            log.info("ip_pressure_taint_found", key=TAINT_KEY)

    async def run_forever(self) -> None:
        await self.start()
        while True:
            await self.check()
            await asyncio.sleep(READ_INTERVAL_SECONDS)

    async def check(self) -> None:
        """One reading: step the decision, write it when the Node does not show it yet."""
        before = self.state
        self.state = step(before, readings(self.lanes), now=self.clock(), settings=self.settings)
        if self.state.pressed != before.pressed:
            log.info(
                "ip_pressure_changed",
                pressed=self.state.pressed,
                cause=self.state.cause,
                subnets=list(self.state.lanes),
            )
            if self.on_change is not None:
                self.on_change(before, self.state)
        mark = mark_of(self.state, self.settings)
        if self.shown == mark:
            return
        try:
            await self.marks.show(mark)
        except WRITE_ERRORS as exc:  # tried again at the next reading
            self.write_failures += 1
            log.warning("ip_pressure_write_failed", error=repr(exc), pressed=self.state.pressed)
            return
        self.shown = mark

    async def stop(self) -> None:
        """Remove the taint and the condition: a stopped daemon says nothing about the node."""
        await clear(self.marks)


async def clear(marks: NodeMarks) -> None:
    """No taint, no condition of ours on the node; bounded, a failure only logged."""
    try:
        await asyncio.wait_for(marks.clear(), STOP_SECONDS)
    except WRITE_ERRORS as exc:
        log.warning("ip_pressure_clear_failed", error=repr(exc))
        return
    log.info("ip_pressure_cleared", node=marks.node_name)
