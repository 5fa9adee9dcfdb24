"""The node's release side: IPs given back by DEL, GC, leak reclaim and the plugin's release
queue, and the cooldown that keeps a freed address from the next pod for a while.

Every release takes back all the IPs an attachment holds, one in each lane, in one synchronous
step recorded as one batch; the callers wait for that batch before they answer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import structlog

from cns.core.leaks import LeakLedger, Reclaimed, Suspect
from cns.core.pool import IPRecord
from cns.core.types import Owner, OwnerKey
from cns.node.commits import Commits
from cns.node.errors import Conflict, store_error
from cns.node.explain import utc_text
from cns.node.lanes import Lanes
from cns.node.notes import NodeEvents
from cns.node.publisher import Publisher
from cns.node.waiters import WaitQueue
from cns.state import release_queue_reader
from cns.state.store import Forget, StoreError

log = structlog.get_logger("cns.node")

# Queue entries applied per turn of the event loop, and bad ones named in a drain's log line.
RELEASE_QUEUE_SLICE = 256
INVALID_ENTRY_EXAMPLES = 5


class ReleaseSide:
    """Releases, cooldowns, GC, leak reclaim and the release queue of one node."""

    def __init__(
        self,
        lanes: Lanes,
        waiters: WaitQueue,
        commits: Commits,
        publisher: Publisher,
        *,
        serve_waiters: Callable[[], None],
        release: Callable[[OwnerKey, str], list[IPRecord]],
        released: Callable[[], None],
        cooldown_seconds: float,
        events: NodeEvents,
    ) -> None:
        """`release` is the node's release verb: GC, leak reclaim and the queue release through
        it (it takes the IPs back with `take_back`); `released` is told after each release."""
        self.lanes = lanes
        self.waiters = waiters
        self.commits = commits
        self.publisher = publisher
        self._serve_waiters = serve_waiters
        self._release = release
        self._released = released
        self.cooldown_seconds = cooldown_seconds
        self.events = events
        self.cooling_started = asyncio.Event()  # wakes `end_cooldowns_forever`
        self.drain_requested = asyncio.Event()
        self.releases: collections.Counter[str] = collections.Counter()
        self.leaks = LeakLedger()  # filled by cns/node/leak_reclaim.py when the leak check runs
        # When each attachment was last ADDed in this process (wall clock, like the queue's
        # `queuedAt`), until its release: a queued DEL older than that is not for it.
        self.added_at: dict[OwnerKey, float] = {}
        # Queue entries done with that could not be deleted: name -> queuedAt.
        self._spent_entries: dict[str, float] = {}

    def take_back(self, key: OwnerKey, reason: str) -> list[IPRecord]:
        """Take back every IP the owner holds, one in each lane, recorded in one batch."""
        self.added_at.pop(key, None)
        for waiter in self.waiters.of_owner(key):
            # A CNI error: a cancelled future ends the ADD uncaught.
            self.waiters.fail(
                [waiter],
                Conflict(
                    11,
                    f"container {key.container_id} interface {key.ifname} was released "
                    f"({reason}) while its ADD waited for an IP",
                ),
            )
        cool_until = time.time() + self.cooldown_seconds if self.cooldown_seconds else 0.0
        released: list[tuple[IPRecord, Owner | None]] = []
        for lane in self.lanes.values():
            held = lane.pool.lookup(key)
            owner = held.owner if held else None
            record = lane.pool.release(key, cool_until=cool_until)
            if record is not None:
                released.append((record, owner))
                if lane.removed:
                    lane.pool.withdraw_free()
        if not released:
            return []
        self.commits.record(
            key,
            [
                Forget(
                    record.id,
                    cool_until=cool_until,
                    pod=owner.pod if owner is not None and cool_until else "",
                )
                for record, owner in released
            ],
        )
        self.releases[reason.split(":")[0]] += 1
        for record, owner in released:
            log_ip(
                "ip_released", record, key, owner, reason=reason, cooldown_until=cool_until or None
            )
        if cool_until:
            self.cooling_started.set()
        self._released()
        self._serve_waiters()
        self.publisher.kick()
        return [record for record, _ in released]

    # -- cooldowns -----------------------------------------------------------------------------

    async def end_cooldowns_forever(self) -> None:
        """End each cooldown when it is due, in every lane: its IP becomes Available, a waiting
        ADD gets it."""
        while True:
            self.cooling_started.clear()
            ends = [lane.pool.next_cooldown_end() for lane in self.lanes.values()]
            end = min((e for e in ends if e is not None), default=None)
            timeout = None if end is None else max(0.0, end - time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cooling_started.wait(), timeout)
            self.end_cooldowns()

    def end_cooldowns(self) -> None:
        now, ended_any = time.time(), False
        for lane in self.lanes.values():
            pool = lane.pool
            ended = pool.expire_cooldowns(now=now, longest=self.cooldown_seconds)
            if ended:
                ended_any = True
                log.info(
                    "ip_cooldown_ended",
                    ips=len(ended),
                    still_cooling=pool.cooling_count(),
                    subnet=lane.name or None,
                )
        if ended_any:
            self._serve_waiters()
            self.publisher.kick()

    # -- GC and leaks --------------------------------------------------------------------------

    async def gc(self, valid: set[OwnerKey]) -> list[str]:
        """Release every attachment the runtime no longer knows (CNI GC), all its IPs."""
        released = []
        stale = list(dict.fromkeys(k for lane in self.lanes.values() for k in lane.pool.owners()))
        stale = [key for key in stale if key not in valid]
        for key in stale:
            released += [r.address for r in self._release(key, "cni-gc")]
        await self.commits.durable_for(stale)
        return released

    async def reclaim(self, leaks: Iterable[Suspect], *, now_wall: float) -> list[IPRecord]:
        """Release leaked IPs (cns/core/leaks.py decided which), each only if the same
        attachment still holds the same IP; durable when this returns."""
        released = []
        keys = []
        for suspect in leaks:
            held = suspect.held
            record = next((r for r in self.lanes.held_by(held.key) if r.id == held.ip_id), None)
            if record is None:
                continue
            suspected = now_wall - suspect.since_wall
            log.warning(
                "ip_leak_reclaimed",
                reason=suspect.reason.value,
                address=held.address,
                ip_id=held.ip_id,
                container=held.key.container_id,
                ifname=held.key.ifname,
                pod=held.pod or None,
                suspected_seconds=round(suspected, 1),
            )
            if self._release(held.key, f"leak:{suspect.reason.value}"):
                released.append(record)
                keys.append(held.key)
                self.leaks.record(Reclaimed(held, suspect.reason, suspected, now_wall))
                self.events.leak_reclaimed(
                    address=held.address, pod=held.pod, why=suspect.reason.value
                )
        await self.commits.durable_for(keys)
        return released

    # -- release queue -------------------------------------------------------------------------

    async def drain_release_queue(self, directory: Path) -> int:
        """Apply DELs the plugin queued while the daemon was unreachable; then delete the files.

        The directory is untrusted (cns/state/release_queue_reader.py): its files are read,
        quarantined and deleted in a worker thread, and the bad ones are summed up in one line
        per drain. An entry releases only the attachment it was written for, never one ADDed
        again after it was queued (`_added_after`); an entry that cannot be deleted is
        remembered here, so that it is applied once (and after a restart, `_added_after` keeps
        it from any later ADD of its attachment). Entries are applied RELEASE_QUEUE_SLICE at a
        time, the loop serving requests between slices. Returns the number of entries applied.
        """
        entries, bad = await asyncio.to_thread(release_queue_reader.collect, directory)
        if bad:
            _log_invalid_entries(directory, bad)
        queued = {entry.name: entry.queued_at for entry in entries}
        self._spent_entries = {
            name: at for name, at in self._spent_entries.items() if queued.get(name) == at
        }
        fresh = [e for e in entries if self._spent_entries.get(e.name) != e.queued_at]
        applied: list[release_queue_reader.Entry] = []
        outdated: list[release_queue_reader.Entry] = []
        for start in range(0, len(fresh), RELEASE_QUEUE_SLICE):
            chunk = fresh[start : start + RELEASE_QUEUE_SLICE]
            newer = self._added_after(chunk)
            for entry in chunk:
                if entry.key in newer:
                    outdated.append(entry)
                else:
                    self._release(entry.key, "queued-del")
                    applied.append(entry)
            await asyncio.sleep(0)
        await self.commits.durable_all()
        for entry in outdated:
            log.warning(
                "release_queue_entry_outdated",
                file=str(directory / entry.name),
                container_id=entry.key.container_id,
                ifname=entry.key.ifname,
                queued_at=utc_text(entry.queued_at),
                reason="the attachment was added again after this DEL was queued: kept",
            )
        done = applied + outdated
        for unremovable in await asyncio.to_thread(release_queue_reader.remove, directory, done):
            entry = unremovable.entry
            self._spent_entries[entry.name] = entry.queued_at
            log.error(
                "release_queue_entry_not_removed",
                file=str(directory / entry.name),
                error=unremovable.error,
                outcome="done: not applied again while it stays as it is",
            )
        if done:
            log.info("release_queue_drained", entries=len(applied), outdated=len(outdated))
        return len(applied)

    def _added_after(self, entries: Sequence[release_queue_reader.Entry]) -> set[OwnerKey]:
        """The attachments of `entries` ADDed after their entry was queued: ADDed since in this
        process, or holding an IP the state file records as assigned since (or not yet)."""
        held = {entry.key: [r.id for r in self.lanes.held_by(entry.key)] for entry in entries}
        try:
            assigned = self.commits.store.assigned_at(
                [ip_id for ids in held.values() for ip_id in ids]
            )
        except StoreError as exc:
            raise store_error(exc) from exc
        return {
            entry.key
            for entry in entries
            if self.added_at.get(entry.key, 0.0) > entry.queued_at
            or any(assigned.get(ip_id, math.inf) > entry.queued_at for ip_id in held[entry.key])
        }

    async def drain_release_queue_forever(self, directory: Path, interval: float) -> None:
        """Drain every `interval` seconds, and at once when asked (`drain_requested`)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drain_requested.wait(), interval)
            self.drain_requested.clear()
            try:
                await self.drain_release_queue(directory)
            except Exception as exc:  # keep draining later; never kill the daemon over it
                log.error("release_queue_drain_failed", error=str(exc))


def _log_invalid_entries(directory: Path, bad: Sequence[release_queue_reader.Quarantined]) -> None:
    """One line for a drain's bad queue files: counts by reason and outcome, and a few."""
    log.error(
        "release_queue_entries_invalid",
        directory=str(directory),
        count=len(bad),
        reasons=dict(collections.Counter(b.kind for b in bad)),
        outcomes=dict(collections.Counter(b.outcome.split(":")[0] for b in bad)),
        examples=[
            {"file": str(directory / b.name), "reason": b.reason, "outcome": b.outcome}
            for b in bad[:INVALID_ENTRY_EXAMPLES]
        ],
    )


def log_ip(
    event: str, record: IPRecord, key: OwnerKey, owner: Owner | None, **fields: object
) -> None:
    """One line per IP handed out or taken back, naming the pod from the runtime's K8S_POD_*
    CNI args when it passed them."""
    log.info(
        event,
        ip=record.address,
        container_id=key.container_id,
        ifname=key.ifname,
        pod=owner.pod if owner else "",
        **fields,
    )
