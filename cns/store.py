"""Durable assignments: SQLite in WAL mode with `synchronous=FULL`.

An ADD's reply waits for the commit that contains its assignment, so a reply never says an IP is
taken before it is on disk. Concurrent requests share commits (group commit): the write is
scheduled with `call_soon`, so every request the event loop handles in the same pass joins one
transaction and one fsync. The commit runs on the loop thread: a WAL fsync takes ~0.2 ms here,
and handing it to a thread cost more in wake-ups than it saved (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cns.core.pool import Assignment
from cns.core.types import Owner, OwnerKey

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS assignments (
    ip_id TEXT PRIMARY KEY,
    address TEXT NOT NULL UNIQUE,
    nc_id TEXT NOT NULL,
    container_id TEXT NOT NULL,
    ifname TEXT NOT NULL,
    pod_name TEXT NOT NULL,
    pod_namespace TEXT NOT NULL,
    assigned_at REAL NOT NULL,
    UNIQUE (container_id, ifname)
);
CREATE TABLE IF NOT EXISTS attachments (
    container_id TEXT NOT NULL,
    ifname TEXT NOT NULL,
    netns TEXT NOT NULL,
    host_ifname TEXT NOT NULL,
    PRIMARY KEY (container_id, ifname)
);
"""


class StateError(Exception):
    """The state file cannot be used; the daemon must stop rather than start empty."""


@dataclass(frozen=True, slots=True)
class Save:
    """Persist (or update the owner details of) one assignment."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Forget:
    """Remove the assignment of one IP."""

    ip_id: str


@dataclass(frozen=True, slots=True)
class SaveAttachment:
    """A pod interface made by cns-cni: where it lives, so it can be found after a restart."""

    key: OwnerKey
    netns: str
    host_ifname: str


@dataclass(frozen=True, slots=True)
class ForgetAttachment:
    key: OwnerKey


Op = Save | Forget | SaveAttachment | ForgetAttachment


class Store:
    """The assignments table plus the group-commit machinery around it."""

    def __init__(self, path: Path, on_commit: Callable[[float], None] | None = None) -> None:
        self.path = path
        self.on_commit = on_commit  # seconds per transaction, fsync included
        self._db: sqlite3.Connection | None = None
        self._queued_ops: list[Op] = []
        self._queued_waiters: list[asyncio.Future[None]] = []
        self._writer: asyncio.Handle | None = None
        self.commits = 0
        self.attachments: dict[OwnerKey, tuple[str, str]] = {}

    def open(self) -> list[Assignment]:
        """Open (creating if absent) and read every assignment; raise StateError if unusable."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            db = sqlite3.connect(self.path, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise StateError(f"cannot open state file {self.path}: {exc}") from exc
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise StateError(f"state file {self.path} failed its integrity check: {check}")
            db.executescript(_SCHEMA)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                raise StateError(
                    f"state file {self.path} has schema version {row[0]}, "
                    f"this cns understands {SCHEMA_VERSION}"
                )
            rows = db.execute(
                "SELECT ip_id, address, nc_id, container_id, ifname, pod_name, pod_namespace "
                "FROM assignments ORDER BY assigned_at"
            ).fetchall()
            self.attachments = {
                OwnerKey(cid, ifname): (netns, host)
                for cid, ifname, netns, host in db.execute(
                    "SELECT container_id, ifname, netns, host_ifname FROM attachments"
                )
            }
        except sqlite3.Error as exc:
            db.close()
            raise StateError(
                f"state file {self.path} is unreadable ({exc}); refusing to start with empty "
                "state: restore it or move it away"
            ) from exc
        except StateError:
            db.close()
            raise
        self._db = db
        return [
            Assignment(ip_id, address, nc_id, Owner(cid, ifname, pod, ns))
            for ip_id, address, nc_id, cid, ifname, pod, ns in rows
        ]

    def enqueue(self, ops: Iterable[Op]) -> None:
        """Queue ops for the next transaction, in the same step that changed the pool.

        Queuing synchronously (rather than inside an awaited call) means a request that is
        cancelled after changing the pool cannot leave that change out of the log.
        """
        self._queued_ops.extend(ops)

    async def flush(self) -> None:
        """Return once everything queued so far is on disk (at once when nothing is queued)."""
        if not self._queued_ops and self._writer is None:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._queued_waiters.append(waiter)
        if self._writer is None:
            self._writer = loop.call_soon(self._write_queued)
        await waiter

    async def commit(self, ops: Iterable[Op]) -> None:
        self.enqueue(ops)
        await self.flush()

    def _write_queued(self) -> None:
        self._writer = None
        ops, self._queued_ops = self._queued_ops, []
        waiters, self._queued_waiters = self._queued_waiters, []
        try:
            if ops:
                self._write(ops)
        except Exception as exc:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _write(self, ops: list[Op]) -> None:
        db = self._db
        if db is None:
            raise StateError(f"state file {self.path} is not open")
        now = time.time()
        started = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        try:
            for op in ops:
                if isinstance(op, Save):
                    a = op.assignment
                    db.execute(
                        "INSERT INTO assignments VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                        "ON CONFLICT (ip_id) DO UPDATE SET pod_name=excluded.pod_name, "
                        "pod_namespace=excluded.pod_namespace",
                        (
                            a.ip_id,
                            a.address,
                            a.nc_id,
                            a.owner.container_id,
                            a.owner.ifname,
                            a.owner.pod_name,
                            a.owner.pod_namespace,
                            now,
                        ),
                    )
                elif isinstance(op, Forget):
                    db.execute("DELETE FROM assignments WHERE ip_id=?", (op.ip_id,))
                elif isinstance(op, SaveAttachment):
                    db.execute(
                        "INSERT OR REPLACE INTO attachments VALUES (?, ?, ?, ?)",
                        (op.key.container_id, op.key.ifname, op.netns, op.host_ifname),
                    )
                else:
                    db.execute(
                        "DELETE FROM attachments WHERE container_id=? AND ifname=?",
                        (op.key.container_id, op.key.ifname),
                    )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.commits += 1
        if self.on_commit is not None:
            self.on_commit(time.perf_counter() - started)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
