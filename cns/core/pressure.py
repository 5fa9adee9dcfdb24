"""IP pressure: whether a node should tell the scheduler that it cannot give another pod an
address soon, decided with hysteresis so that the answer never flaps.

A lane (one subnet's share of the node) *starves* when it has no free address and cannot get one:
its subnet is exhausted (the control plane has none to grant), or the node holds `maxIPCount`
addresses. The node enters pressure at once when a lane starves at `maxIPCount` (nothing but a
DEL on this node can help it), or when some lane has starved continuously for
`enter_after_seconds` (an exhausted subnet may get addresses back from other nodes soon). It
leaves only when no lane is *short* (a cause and fewer than `leave_free` free addresses) and either
every lane has `leave_free` free addresses or no lane has been short for `leave_after_seconds`.

So the flag changes only when the input has crossed the whole band between the two edges since
the last change: a node whose free count moves inside 1..leave_free-1, or back and forth across
one edge, keeps its answer (tests/unit/core/test_pressure.py checks this on random sequences).
Pure and synchronous: the caller passes the time and the lanes' readings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum


class Cause(StrEnum):
    """Why a lane cannot get another address (the words of `/debug/pod`'s wait reasons)."""

    EXHAUSTED = "exhausted"
    MAX_IP_COUNT = "max-ip-count"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneReading:
    """One lane now: its free addresses and whether it could get more."""

    subnet: str
    free: int  # free now or at the end of their reuse cooldown
    exhausted: bool  # the control plane has no address of the subnet for this node
    at_max_ip_count: bool  # the node holds maxIPCount addresses of it

    @property
    def cause(self) -> Cause | None:
        if self.at_max_ip_count:
            return Cause.MAX_IP_COUNT
        return Cause.EXHAUSTED if self.exhausted else None

    @property
    def starving(self) -> bool:
        return self.cause is not None and self.free == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PressureSettings:
    """The two edges of the band (config `ipPressure`)."""

    enabled: bool = False
    enter_after_seconds: float = 10.0
    leave_free: int = 2
    leave_after_seconds: float = 30.0


@dataclass(frozen=True, slots=True)
class Pressure:
    """The decision and the two clocks it keeps: since when some lane starves (not pressed) or
    since when no lane is short (pressed); `lanes` and `cause` say why it was entered (None:
    found set at start, until a lane starves)."""

    pressed: bool = False
    starving_since: float | None = None
    calm_since: float | None = None
    lanes: tuple[str, ...] = ()
    cause: Cause | None = None


def step(
    state: Pressure, lanes: Sequence[LaneReading], *, now: float, settings: PressureSettings
) -> Pressure:
    """The decision after one reading of every lane at time `now` (monotonic seconds)."""
    starving = [lane for lane in lanes if lane.starving]
    at_max = [lane for lane in starving if lane.cause is Cause.MAX_IP_COUNT]
    cause = Cause.MAX_IP_COUNT if at_max else Cause.EXHAUSTED
    names = tuple(lane.subnet for lane in (at_max or starving))
    if not state.pressed:
        if not starving:
            return Pressure()
        since = now if state.starving_since is None else state.starving_since
        if at_max or now - since >= settings.enter_after_seconds:
            return Pressure(pressed=True, lanes=names, cause=cause)
        return replace(state, starving_since=since)
    if any(lane.cause is not None and lane.free < settings.leave_free for lane in lanes):
        if state.cause is None and starving:  # a decision found at start learns its cause
            return Pressure(pressed=True, lanes=names, cause=cause)
        return replace(state, calm_since=None)
    since = now if state.calm_since is None else state.calm_since
    roomy = all(lane.free >= settings.leave_free for lane in lanes)
    if roomy or now - since >= settings.leave_after_seconds:
        return Pressure()
    return replace(state, calm_since=since)


def describe(state: Pressure, settings: PressureSettings) -> str:
    """The condition's message: why the node is (or is not) under pressure, for people."""
    if not state.pressed:
        return "the node can give pods addresses"
    until = (
        f"cleared once {settings.leave_free} are free or the cause is gone for "
        f"{settings.leave_after_seconds:g} s"
    )
    if state.cause is None:
        return f"found set when the daemon started; {until}"
    subnets = ", ".join(name or "(the node's subnet)" for name in state.lanes)
    why = (
        "the node holds maxIPCount addresses"
        if state.cause is Cause.MAX_IP_COUNT
        else "the subnet is exhausted"
    )
    return f"no free pod address in subnet {subnets}: {why}; {until}"
