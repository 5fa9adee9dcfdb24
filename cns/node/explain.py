"""Why an ADD waits, in words and figures: for `/debug/pod`, the CNI error of an ADD that timed
out, and CNI STATUS. Reads the node, changes nothing.

The node is seen through `Explained`, the few things an explanation reads.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cns.core.pool import Pool
from cns.core.requested import Misplaced
from cns.core.types import IPState, Owner
from cns.node.errors import AddressRefused, IPAMError, Unavailable, refused_error
from cns.node.lanes import Lanes, NodeLane
from cns.node.waiters import Waiter


@dataclass(frozen=True, slots=True)
class WaitReason:
    """Why an ADD finds no free IP now: a `code` for programs, a `message` for people, and the
    figures behind it."""

    # subnet-removed, no-network, world-check, cooldown, exhausted, max-ip-count,
    # allocation-pending
    code: str
    message: str
    figures: dict[str, float | int | str | None]


class Explained(Protocol):
    """What an explanation reads of the node."""

    @property
    def lanes(self) -> Lanes: ...
    @property
    def world_gate_open(self) -> bool: ...
    @property
    def world_wait_seconds(self) -> float: ...
    @property
    def cooldown_seconds(self) -> float: ...
    @property
    def add_timeout_seconds(self) -> float: ...
    def waiting_count(self, key: str = "") -> int: ...
    def can_serve(self, key: str, owner: Owner, promised: int = 0) -> bool: ...
    def placed_for(
        self, owner: Owner, keys: Sequence[str], addresses: Sequence[str]
    ) -> dict[str, str]: ...


def world_check_pending(node: Explained) -> str:
    return (
        "the start-up check of the state file against the runtime's sandboxes and the API's "
        "pods has not finished: no address is handed out before it (it waits at most "
        f"{node.world_wait_seconds:g} s for them)"
    )


def wait_reason(node: Explained, key: str = "") -> WaitReason:
    """Why an ADD would find no free IP of lane `key` now, most actionable cause first."""
    now = time.time()
    lanes = node.lanes
    lane = lanes.get(key) or NodeLane(Pool(subnet=key), name=key)
    pool, sent, scaler = lane.pool, lane.sent, lanes.scaler(lane)
    counts = pool.counts()
    figures: dict[str, float | int | str | None] = {
        "requestedIPCount": sent.requested_ip_count if sent else 0,
        "requestPublishedAt": utc_text(lane.published_at),
        "held": pool.held_count(),
        "available": counts[IPState.AVAILABLE],
        "assigned": counts[IPState.ASSIGNED],
        "cooldown": counts[IPState.COOLDOWN],
        "waiting": node.waiting_count(key),
        "maxIPCount": scaler.max_ip_count,
        "subnetExhausted": lane.exhausted,
        "subnetDraining": lane.draining,
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
    if lane.draining:
        return WaitReason(
            "subnet-draining",
            f"subnet {lanes.label(key) or key} is draining: its pods keep their IPs, no ADD gets "
            "a new one",
            figures,
        )
    if not lanes.serves(lane):
        return WaitReason(
            "no-network",
            f"the node has no network container of subnet {key} (its demand is published "
            "for the control plane to grant one)"
            if key
            else "no network container from the control plane yet",
            figures,
        )
    if not node.world_gate_open:
        return WaitReason("world-check", world_check_pending(node), figures)
    if cooling := pool.cooling_count():
        end = pool.next_cooldown_end() or now
        figures["nextCooldownEndsAt"] = utc_text(end)
        return WaitReason(
            "cooldown",
            f"{cooling} IPs in cooldown (ipCooldownSeconds={node.cooldown_seconds:g}), "
            f"the next free in {max(0.0, end - now):.1f} s",
            figures,
        )
    if lane.exhausted:
        return WaitReason(
            "exhausted", "subnet exhausted: the control plane has no IP for this node", figures
        )
    if pool.held_count() + pool.primary_ip_count >= scaler.max_ip_count:
        return WaitReason("max-ip-count", f"node at maxIPCount ({scaler.max_ip_count})", figures)
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


def lacking(node: Explained, waiter: Waiter) -> str:
    """The first subnet the ADD still lacks an IP of: the one to explain."""
    return next(
        (n for n in waiter.subnets if not node.can_serve(node.lanes.key(n), waiter.owner)),
        waiter.subnets[0],
    )


def no_ip_error(node: Explained, waiter: Waiter) -> IPAMError:
    """The CNI error of an ADD that waited its whole bound: the lane it lacks and why."""
    name = lacking(node, waiter)
    reason = wait_reason(node, node.lanes.key(name))
    details = " ".join(f"{k}={v}" for k, v in reason.figures.items() if v is not None)
    timeout = node.add_timeout_seconds
    if waiter.explicit:  # taken while it waited for another lane: say so, not the lane
        with contextlib.suppress(Misplaced):
            try:
                keys = [node.lanes.key(name) for name in waiter.subnets]
                node.placed_for(waiter.owner, keys, waiter.addresses)
            except AddressRefused as refused:
                return refused_error(refused)
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


def utc_text(at: float | None) -> str | None:
    """A wall-clock time as RFC 3339 UTC with milliseconds, for people and JSON."""
    if at is None:
        return None
    stamp = dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")
