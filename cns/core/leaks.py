"""Which assigned IPs have leaked, and when one may be taken back: a pure decision.

An IP leaks when its DEL never reached cns: the runtime removed the sandbox while the daemon was
down and the queued DEL was lost, or re-created a pod's sandbox without tearing the old one
down. cns keeps every assignment durably, so a restart never frees such an IP; this check does.

The sandbox's own runtime is the only authority on whether it still exists (CRI
`ListPodSandbox` lists every sandbox, running or stopped, until it is removed), so an IP whose
sandbox the runtime still lists is never a leak, whatever else is true. An IP whose sandbox is
not listed becomes a *suspect*, and is reclaimed only once it has stayed one for the grace
period: the runtime lists a sandbox only after its CNI ADD has returned, so a sandbox being
created is missing from the list for a moment. Where the pods of the node are known
(Kubernetes), a missing sandbox is not enough: the pod must be gone or ended, or run in another
sandbox that holds (or waits for) its own IP. A pod still there with no other sandbox is left
alone: its sandbox is being re-created, and the IP is wanted.

Without an answer from the runtime (unreachable, not configured) nothing is reclaimed, and the
suspects keep their age (they are neither cleared nor confirmed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from cns.core.types import OwnerKey


class LeakReason(StrEnum):
    """Why an assigned IP is thought to be leaked; its sandbox is gone in every case."""

    SANDBOX_GONE = "sandbox-gone"  # the pods are not known (standalone): the runtime alone
    POD_GONE = "pod-gone"  # no such pod on the node any more
    POD_ENDED = "pod-ended"  # the pod finished (Succeeded/Failed) or is being deleted
    SANDBOX_REPLACED = "sandbox-replaced"  # the pod runs in another sandbox, with its own IP


@dataclass(frozen=True, slots=True)
class Held:
    """An assigned IP as the leak check sees it."""

    key: OwnerKey
    ip_id: str
    address: str
    pod: str  # namespace/name, "" when the runtime named no pod


@dataclass(frozen=True, slots=True)
class Suspect:
    """An assigned IP whose sandbox the runtime has not listed since `since` (monotonic
    seconds; `since_wall` is the same moment for people)."""

    held: Held
    reason: LeakReason
    since: float
    since_wall: float


@dataclass(frozen=True, slots=True)
class LeakVerdict:
    suspects: dict[OwnerKey, Suspect]  # to remember until the next check
    leaks: list[Suspect]  # to release now


def _reason(
    held: Held, pods: Mapping[str, bool] | None, elsewhere: Mapping[tuple[str, str], set[OwnerKey]]
) -> LeakReason | None:
    """Why `held`, whose sandbox the runtime does not list, is a leak; None: it is not one."""
    if pods is None or not held.pod:
        return LeakReason.SANDBOX_GONE
    if held.pod not in pods:
        return LeakReason.POD_GONE
    if not pods[held.pod]:
        return LeakReason.POD_ENDED
    if elsewhere.get((held.pod, held.key.ifname), set()) - {held.key}:
        return LeakReason.SANDBOX_REPLACED
    return None


def find_leaks(
    held: Iterable[Held],
    *,
    sandboxes: frozenset[str] | None,
    pods: Mapping[str, bool] | None,
    waiting: Iterable[tuple[str, OwnerKey]],
    suspects: Mapping[OwnerKey, Suspect],
    now: float,
    now_wall: float,
    grace_seconds: float,
) -> LeakVerdict:
    """One check: the suspects after it and the leaks to release now.

    `sandboxes`: every sandbox id the runtime lists (None: no answer, nothing is decided);
    `pods`: the pods on the node, namespace/name -> whether it may still use an IP (None: not
    known); `waiting`: (pod, key) of the ADDs waiting for an IP, each in a sandbox of its own.
    A suspect keeps its `since` across checks while it stays one for the same IP.
    """
    held = list(held)
    if sandboxes is None:
        still_held = {h.key: h for h in held}
        kept = {k: s for k, s in suspects.items() if still_held.get(k) == s.held}
        return LeakVerdict(kept, [])
    # (pod, interface) -> the attachments serving it in a live sandbox or waiting for an IP
    elsewhere: dict[tuple[str, str], set[OwnerKey]] = {}
    live = ((h.pod, h.key) for h in held if h.key.container_id in sandboxes)
    for pod, key in (*live, *waiting):
        if pod:
            elsewhere.setdefault((pod, key.ifname), set()).add(key)
    found: dict[OwnerKey, Suspect] = {}
    leaks = []
    for one in held:
        if one.key.container_id in sandboxes:
            continue
        reason = _reason(one, pods, elsewhere)
        if reason is None:
            continue
        previous = suspects.get(one.key)
        if previous is not None and previous.held == one:
            suspect = Suspect(one, reason, previous.since, previous.since_wall)
        else:
            suspect = Suspect(one, reason, now, now_wall)
        found[one.key] = suspect
        if now - suspect.since >= grace_seconds:
            leaks.append(suspect)
    return LeakVerdict(found, leaks)


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """An IP taken back from a leaked attachment (`at_wall`: when, for people)."""

    held: Held
    reason: LeakReason
    suspected_seconds: float
    at_wall: float


@dataclass(slots=True)
class LeakLedger:
    """What the leak check knows, for the debug views and the metrics."""

    enabled: bool = False
    suspects: dict[OwnerKey, Suspect] = field(default_factory=dict)
    # IP id -> its most recent reclaim, the newest last; at most KEEP_RECLAIMED of them
    reclaimed: dict[str, Reclaimed] = field(default_factory=dict)
    reclaimed_total: Counter[str] = field(default_factory=Counter)
    runtime_error: str | None = None  # why the last check had no answer from the runtime
    checks: int = 0

    KEEP_RECLAIMED: ClassVar[int] = 1024

    def record(self, reclaimed: Reclaimed) -> None:
        self.reclaimed.pop(reclaimed.held.ip_id, None)
        self.reclaimed[reclaimed.held.ip_id] = reclaimed
        self.reclaimed_total[reclaimed.reason.value] += 1
        while len(self.reclaimed) > self.KEEP_RECLAIMED:
            del self.reclaimed[next(iter(self.reclaimed))]
