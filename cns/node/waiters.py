"""The ADDs waiting for an IP, and who is served first.

First come, first served in each lane: a waiter that cannot be served yet keeps one free IP of
each lane it lacks for itself (`promised`), so a later waiter takes an IP of that lane only
beyond those. A dual-stack ADD waiting for its IPv6 address thus keeps the IPv4 address that
freed meanwhile, instead of losing it to every IPv4-only ADD behind it; waiters of other lanes
are not held up. An ADD that asks for particular addresses waits for those, never for a free IP.

Everything here runs on the event loop, synchronously: no lock, no await.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from cns.core.pool import IPRecord, OwnerConflict
from cns.core.requested import Misplaced
from cns.core.types import Owner, OwnerKey
from cns.node.errors import (
    AddressRefused,
    IPAMError,
    conflict_error,
    refused_error,
    wrong_request,
)
from cns.state.store import Batch

# The IPs an ADD was given (one per subnet, in its order) and the batch that records them (None
# if nothing had to be recorded).
Served = tuple[list[IPRecord], Batch | None]


@dataclass(slots=True)
class Waiter:
    owner: Owner
    subnets: tuple[str, ...] = ("",)  # the subnets it wants an IP of ("": the node's own)
    since: float = field(default_factory=time.time)  # wall clock, for people
    # The addresses it asks for (at most one per subnet) and where they come from: the runtime's
    # `requestedIP` (explicit: had at once or refused, never waited for) or its pod's annotation.
    addresses: tuple[str, ...] = ()
    explicit: bool = False
    asked_by: str = ""  # the field that asked for them, for errors
    why: str = ""  # why one of them could not be had, last time it was tried
    future: asyncio.Future[Served] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


NONE_PROMISED: Mapping[str, int] = MappingProxyType({})

# Give the waiter what it wants, with `promised` free IPs per lane kept for those before it;
# None, changing nothing, while it cannot be had.
Assign = Callable[[Waiter, Mapping[str, int]], Served | None]


class WaitQueue:
    """The waiting ADDs in arrival order."""

    def __init__(self) -> None:
        self._waiters: deque[Waiter] = deque()

    def __iter__(self) -> Iterator[Waiter]:
        return iter(self._waiters)

    def __len__(self) -> int:
        return len(self._waiters)

    def append(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def discard(self, waiter: Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def fail(self, waiters: list[Waiter], error: IPAMError) -> None:
        """Take these waiters out and end each ADD still waiting with `error`."""
        for waiter in waiters:
            self.discard(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def of_owner(self, key: OwnerKey) -> list[Waiter]:
        return [w for w in self._waiters if w.owner.key == key]

    def of_pod(self, pod: str) -> list[Waiter]:
        return [w for w in self._waiters if w.owner.pod == pod]

    def promised(self, lacks: Callable[[Waiter], list[str]]) -> Mapping[str, int]:
        """Per lane, the free IPs kept for the ADDs waiting now: one for each waiter that lacks
        an IP of that lane (`lacks`). A newcomer may take a lane's IP only beyond these."""
        if not self._waiters:
            return NONE_PROMISED
        promised: collections.Counter[str] = collections.Counter()
        for waiter in self._waiters:
            if not waiter.addresses and not waiter.future.done():
                promised.update(lacks(waiter))
        return promised

    def serve(
        self, assign: Assign, *, lacks: Callable[[Waiter], list[str]], any_free: Callable[[], bool]
    ) -> None:
        """Hand out what can be: first each awaited address that has come, then free IPs to
        the other waiters in arrival order (see the module's docstring)."""
        if not self._waiters:
            return
        for waiter in [w for w in self._waiters if w.addresses]:
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            try:
                served = assign(waiter, {})
            except AddressRefused as refused:
                waiter.why = refused.why
                if waiter.explicit:  # taken meanwhile: the runtime's address is not waited for
                    self._waiters.remove(waiter)
                    waiter.future.set_exception(refused_error(refused))
                continue
            except (Misplaced, OwnerConflict) as wrong:  # a container came that tells
                self._waiters.remove(waiter)
                waiter.future.set_exception(wrong_request(waiter.asked_by, wrong))
                continue
            if served is None:  # its addresses can be had; another subnet has no free IP
                waiter.why = ""
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(served)
        promised: collections.Counter[str] = collections.Counter()
        for waiter in [w for w in self._waiters if not w.addresses]:
            if not any_free():
                break
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            try:
                served = assign(waiter, promised)
            except OwnerConflict as conflict:  # refuse_conflict() keeps this from happening
                self._waiters.remove(waiter)
                waiter.future.set_exception(conflict_error(conflict))
                continue
            if served is None:
                promised.update(lacks(waiter))
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(served)
