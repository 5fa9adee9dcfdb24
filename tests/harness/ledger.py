"""What clients were told while a daemon was killed, and what the restarted daemon must show.

Shared by tests/integration/test_crash.py (three `kill -9`s) and bench/stress/crash_rounds.py
(hundreds of them): client threads stream ADDs and DELs through a `Call` (the unix socket as the
plugins speak it, or the installed plugin), writing down every acknowledgement; after the restart
the daemon's
`/debug/ips` must agree with every reply a client got. Requests in flight at the kill (sent, never
answered) prove nothing either way: they are written down separately, and
`resolve_in_flight` finds out how each one went, then finishes it as a runtime would (retries it).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

ADD = "/v1/cni/add"
DEL = "/v1/cni/del"


class Call(Protocol):
    """One request to the daemon: (HTTP status, JSON body); OSError once it is unreachable."""

    def __call__(self, method: str, url: str, body: Any = None) -> tuple[int, Any]: ...


@dataclass
class Ledger:
    """What the clients were told; only replies count, in-flight calls prove nothing."""

    added: dict[str, str] = field(default_factory=dict)  # container -> address replied
    del_attempted: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    live: list[str] = field(default_factory=list)  # acknowledged ADDs with no DEL attempted yet
    in_flight: dict[str, str] = field(default_factory=dict)  # container -> ADD or DEL path
    refused: Counter[str] = field(default_factory=Counter)  # non-200 replies, by status and code
    lock: threading.Lock = field(default_factory=threading.Lock)


def constant_delete_share(live: int) -> float:
    return 0.45


def client(
    call: Call,
    name: str,
    ledger: Ledger,
    stop: threading.Event,
    *,
    seed: int,
    delete_share: Callable[[int], float] = constant_delete_share,
) -> None:
    """ADD new containers `<name>-<n>` and DEL random live ones (of any client) until `stop` or
    until the daemon is unreachable; `delete_share(live count)` is the chance of a DEL."""
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        with ledger.lock:
            deleting = bool(ledger.live) and rng.random() < delete_share(len(ledger.live))
            if deleting:
                container = ledger.live.pop(rng.randrange(len(ledger.live)))
                ledger.del_attempted.add(container)
            else:
                container = f"{name}-{n}"
                n += 1
            path = DEL if deleting else ADD
            ledger.in_flight[container] = path
        try:
            status, body = call("POST", path, {"containerID": container, "ifName": "eth0"})
        except OSError:
            return  # the daemon is gone; this request stays in flight
        with ledger.lock:
            del ledger.in_flight[container]
            if status != 200:
                code = body.get("code") if isinstance(body, dict) else None
                ledger.refused[f"{path.rsplit('/', 1)[1]} {status}/{code}"] += 1
            elif deleting:
                ledger.deleted.add(container)
            else:
                ledger.added[container] = body["ips"][0]["address"].split("/")[0]
                ledger.live.append(container)


def assignments(ips: list[dict[str, Any]]) -> dict[str, str]:
    """containerID -> address, from `/debug/ips`."""
    return {ip["owner"]["containerID"]: ip["address"] for ip in ips if ip["owner"]}


def violations(ips: list[dict[str, Any]], ledger: Ledger) -> dict[str, list[str]]:
    """Every way `/debug/ips` contradicts the ledger, by kind; empty lists when it agrees.

    `duplicate address` / `duplicate owner`: an address or a container twice in the pool;
    `lost`: an acknowledged ADD whose DEL was never attempted no longer holds its address;
    `resurrected`: a container whose DEL was acknowledged holds an address.
    """
    assigned = assignments(ips)
    addresses = Counter(ip["address"] for ip in ips)
    owners = Counter(ip["owner"]["containerID"] for ip in ips if ip["owner"])
    return {
        "duplicate address": sorted(a for a, count in addresses.items() if count > 1),
        "duplicate owner": sorted(o for o, count in owners.items() if count > 1),
        "lost": sorted(
            f"{container} lost {address} (holds {assigned.get(container)})"
            for container, address in ledger.added.items()
            if container not in ledger.del_attempted and assigned.get(container) != address
        ),
        "resurrected": sorted(
            f"{container} holds {assigned[container]} after its DEL"
            for container in ledger.deleted
            if container in assigned
        ),
    }


def retry(call: Call, path: str, container: str, attempts: int) -> tuple[Any, int]:
    """Send the request until it succeeds, as a runtime retries a failed ADD or DEL (an ADD may
    meet a pool still waiting for its control plane: 503, code 11). (reply, refusals)."""
    body: Any = None
    for attempt in range(attempts):
        status, body = call("POST", path, {"containerID": container, "ifName": "eth0"})
        if status == 200:
            return body, attempt
    raise RuntimeError(f"{path} for {container} refused {attempts} times: {body}")


def resolve_in_flight(
    call: Call, ips: list[dict[str, Any]], ledger: Ledger, attempts: int = 1
) -> Counter[str]:
    """How each request in flight at the kill went (from `/debug/ips` after the restart), then
    retry it as a runtime would (up to `attempts` times), so the ledger knows every container
    again.

    Returns counts of `add committed` / `add not committed` / `del applied` / `del not applied`,
    `retry refused` (attempts that got an error before one succeeded), and `add retried to
    another address` when a committed ADD's retry got a different address (the retry must be
    idempotent: that would be a lost assignment).
    """
    assigned = assignments(ips)
    outcome: Counter[str] = Counter()
    for container, path in sorted(ledger.in_flight.items()):
        body, refusals = retry(call, path, container, attempts)
        if refusals:
            outcome["retry refused"] += refusals
        if path == DEL:
            outcome["del applied" if container not in assigned else "del not applied"] += 1
            ledger.deleted.add(container)
            continue
        address = body["ips"][0]["address"].split("/")[0]
        if container in assigned:
            outcome["add committed"] += 1
            if assigned[container] != address:
                outcome["add retried to another address"] += 1
        else:
            outcome["add not committed"] += 1
        ledger.added[container] = address
        ledger.live.append(container)
    ledger.in_flight.clear()
    return outcome
