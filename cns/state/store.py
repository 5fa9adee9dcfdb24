"""Durable assignments: SQLite in WAL mode with `synchronous=FULL`.

An ADD's reply waits for the commit that contains its assignment, so a reply never says an IP is
taken before it is on disk. Concurrent requests share commits (group commit): the write is
scheduled with `call_soon`, so every request the event loop handles in the same pass joins one
transaction and one fsync. The commit runs on the loop thread: a WAL fsync takes ~0.2 ms here,
and handing it to a thread cost more in wake-ups than it saved (docs/benchmarks.md).

Each request's ops are one `Batch`, a SAVEPOINT inside the shared transaction: a batch the
database refuses (a conflicting owner, text SQLite cannot store) is rolled back alone and only
its request fails. A storage failure (disk full, read-only, permissions, I/O error) fails the
whole transaction and is reported (`failure`, for /healthz) until a commit succeeds again on a
freshly opened connection. After any failure `assignments`, what is committed, is the truth:
the resync listeners make the memory of the node follow it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from cns.core.pool import Assignment
from cns.core.types import Owner, OwnerKey
from cns.state.fsutil import describe_os_error, fsync_dir
from cns.state.wal import database_page_size, lost_commits

log = structlog.get_logger("cns.state.store")

SCHEMA_VERSION = 2
# The state file and SQLite's companions: they belong together (reset moves them all).
STATE_FILE_SUFFIXES = ("", "-wal", "-shm", "-journal")
RESET_HINT = (
    "restore it from a backup; or, only if no pod on this node holds an address (the node is "
    "drained), start once with `cns run --reset-state`, which keeps the old files renamed "
    "*.reset-<time>"
)
PROBE_BYTES = 16384
_CORRUPT = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
# Ids per `assigned_at` query (SQLite allows 32,766 parameters since 3.32; older ones 999).
_MAX_QUERY_IDS = 500
# SQLite reports its own codes, not the kernel's errno: the cause when the probe write works.
_SQLITE_ERRNO = {
    "SQLITE_FULL": errno.ENOSPC,
    "SQLITE_READONLY": errno.EROFS,
    "SQLITE_PERM": errno.EACCES,
    "SQLITE_IOERR": errno.EIO,
}

_ASSIGNMENTS = """(
    ip_id TEXT PRIMARY KEY,
    address TEXT NOT NULL UNIQUE,
    nc_id TEXT NOT NULL,
    container_id TEXT NOT NULL,
    ifname TEXT NOT NULL,
    pod_name TEXT NOT NULL,
    pod_namespace TEXT NOT NULL,
    assigned_at REAL NOT NULL,
    subnet TEXT NOT NULL DEFAULT '',
    UNIQUE (container_id, ifname, subnet)
)"""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS assignments {_ASSIGNMENTS};
CREATE TABLE IF NOT EXISTS cooldowns (
    ip_id TEXT PRIMARY KEY,
    ends_at REAL NOT NULL,
    pod TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS attachments (
    container_id TEXT NOT NULL,
    ifname TEXT NOT NULL,
    netns TEXT NOT NULL,
    host_ifname TEXT NOT NULL,
    PRIMARY KEY (container_id, ifname)
);
"""
# The owner may update the pod name and namespace it learnt later; anything else is a conflict,
# which leaves the row alone and changes no row (the caller checks `rowcount`).
_SAVE = """
INSERT INTO assignments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (ip_id) DO UPDATE SET pod_name=excluded.pod_name, pod_namespace=excluded.pod_namespace
WHERE address=excluded.address AND nc_id=excluded.nc_id
    AND container_id=excluded.container_id AND ifname=excluded.ifname AND subnet=excluded.subnet
"""
# Schema 1 -> 2: the lane (`subnet`, "" for the primary subnet, which every version-1 row is)
# joins the owner's uniqueness, so an owner may hold one IP per subnet. SQLite cannot change a
# table's constraints in place: the table is rebuilt, in the one transaction `_migrate` runs.
_V1_COLUMNS = "ip_id, address, nc_id, container_id, ifname, pod_name, pod_namespace, assigned_at"
_V1_TO_V2 = (
    f"CREATE TABLE assignments_v2 {_ASSIGNMENTS}",
    f"INSERT INTO assignments_v2 ({_V1_COLUMNS}) SELECT {_V1_COLUMNS} FROM assignments",
    "DROP TABLE assignments",
    "ALTER TABLE assignments_v2 RENAME TO assignments",
    "UPDATE meta SET value='2' WHERE key='schema_version'",
)


class StateError(Exception):
    """The state file cannot be used; the daemon must stop rather than start empty."""


class StoreError(Exception):
    """A batch was not committed: its request must not be acknowledged."""


class Rejected(StoreError):
    """The database refused this batch's own content; the rest of its transaction committed.

    `field` names the request field at fault (as the socket API spells it), or is None when the
    record conflicts with what is already recorded.
    """

    def __init__(self, msg: str, field: str | None = None) -> None:
        super().__init__(msg)
        self.field = field


class StorageFailure(StoreError):
    """Nothing of the transaction was committed: the state file cannot be written.

    `cause` is the errno's name (ENOSPC, EROFS, EACCES, EIO) when it could be found, else the
    SQLite error's name.
    """

    def __init__(self, path: Path, cause: str, detail: str) -> None:
        super().__init__(f"cannot commit state to {path}: {cause} ({detail})")
        self.cause = cause
        self.detail = detail


class _Corrupt(Exception):
    """The file opens but is not a state file this cns can trust."""


class _OwnerConflict(Exception):
    """A Save for an IP the state file records for another owner."""


_CONTENT_ERRORS = (
    sqlite3.IntegrityError,
    sqlite3.DataError,
    UnicodeEncodeError,
    OverflowError,
    _OwnerConflict,
)


@dataclass(frozen=True, slots=True)
class Save:
    """Persist (or update the pod name and namespace of) one assignment."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Forget:
    """Remove the assignment of one IP; with `cool_until`, record when its cooldown ends (the
    IP is not handed out again before then, also after a restart)."""

    ip_id: str
    cool_until: float = 0.0
    pod: str = ""  # namespace/name of the pod that gave it back, which may have it earlier


@dataclass(frozen=True, slots=True)
class SaveAttachment:
    """A pod interface made by cns-cni: where it lives, so it can be found after a restart."""

    key: OwnerKey
    netns: str
    host_ifname: str


@dataclass(frozen=True, slots=True)
class ForgetAttachment:
    key: OwnerKey


@dataclass(frozen=True, slots=True)
class Touch:
    """A durable write that changes nothing of the node's state: does committing work again?"""


Op = Save | Forget | SaveAttachment | ForgetAttachment | Touch


class Batch:
    """One request's ops: committed together, or not at all (`error` then says why).

    Waiting costs a future only for a batch still unsettled when waited for: a request answered
    after its commit, or a batch nobody waits for, costs none."""

    __slots__ = ("_waiters", "error", "ops", "settled")

    def __init__(self, ops: list[Op]) -> None:
        self.ops = ops
        self.error: StoreError | None = None
        self.settled = False
        self._waiters: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        """Return once committed or failed; cancelling one waiter leaves the others waiting."""
        if self.settled:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    async def durable(self) -> None:
        """Return once committed; raise the StoreError that kept it off the disk."""
        await self.wait()
        if self.error is not None:
            raise self.error

    def settle(self, error: StoreError | None) -> None:
        self.error = error
        self.settled = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()


class Store:
    """The assignments table plus the group-commit machinery around it."""

    def __init__(self, path: Path, on_commit: Callable[[float], None] | None = None) -> None:
        self.path = path
        self.on_commit = on_commit  # seconds per transaction, fsync included
        # Called after a batch failed: memory must take `assignments`/`attachments` again.
        self.resync_listeners: list[Callable[[], None]] = []
        self._db: sqlite3.Connection | None = None
        self._queue: list[Batch] = []
        self._writer: asyncio.Handle | None = None
        self.commits = 0
        # What is committed, kept in step with every successful batch.
        self.assignments: dict[str, Assignment] = {}
        self.attachments: dict[OwnerKey, tuple[str, str]] = {}
        # ip id -> (when its cooldown ends (wall clock), the pod that gave it back)
        self.cooldowns: dict[str, tuple[float, str]] = {}
        self.failure: StorageFailure | None = None
        self.failures: collections.Counter[str] = collections.Counter()
        self._failing_since = 0.0

    # -- opening -------------------------------------------------------------------------------

    def open(self) -> list[Assignment]:
        """Open (creating it if absent) and read every assignment; raise StateError if unusable.

        The message tells an access problem (read-only file system, permissions: fix it and
        start again) from corruption (restore it, or reset), and never starts empty. Nothing is
        opened while a state file is not a regular file or the log holds commits SQLite would
        drop: opening would replace the link or overwrite the evidence.
        """
        self._refuse_unsafe_files()
        try:
            if not os.path.lexists(self.path):
                self._create()
            self._db = self._connect()
        except _Corrupt as exc:
            raise StateError(
                f"state file {self.path} is corrupt ({exc}); refusing to start with empty "
                f"state: {RESET_HINT}"
            ) from exc
        except (OSError, sqlite3.Error) as exc:
            name = getattr(exc, "sqlite_errorname", "")
            if name.startswith(_CORRUPT):
                raise StateError(
                    f"state file {self.path} is corrupt ({name}: {exc}); refusing to start with "
                    f"empty state: {RESET_HINT}"
                ) from exc
            failure = self._storage_failure(exc)
            raise StateError(
                f"state file {self.path} cannot be opened for reading and writing: "
                f"{failure.cause} ({failure.detail}); this is an access problem, not corruption: "
                "make the file system writable or fix the permissions, and start again"
            ) from exc
        return list(self.assignments.values())

    def _refuse_unsafe_files(self) -> None:
        """Refuse, before SQLite opens anything, a state file that is not a regular file (a
        link SQLite would follow or replace) or a log whose commits SQLite would drop (opening
        replays the log and the next write overwrites what it dropped)."""
        refuse_irregular_state_file(self.path)
        wal = Path(f"{self.path}-wal")
        try:
            lost = lost_commits(wal.read_bytes(), database_page_size(self.path))
        except FileNotFoundError:
            lost = None
        except OSError as exc:
            raise StateError(
                f"state file {wal} cannot be read: {describe_os_error(exc)}; this is an access "
                "problem, not corruption: fix the permissions and start again"
            ) from exc
        if lost is not None:
            raise StateError(
                f"state file {wal} is damaged: {lost.describe()}, so acknowledged assignments "
                f"would be lost; refusing to start, the files are left as they are: {RESET_HINT}"
            )

    def _create(self) -> None:
        """Initialise a new state file under a temporary name, then rename it into place: a
        state file exists only complete, so an empty one is always a lost one
        (cns.state.statedir)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".new")
        for suffix in STATE_FILE_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{tmp}{suffix}")
        # Created here, 0600 whatever the umask: SQLite gives its -wal, -shm and -journal the
        # database file's mode.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        finally:
            db.close()
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        fsync_dir(self.path.parent)

    def _connect(self) -> sqlite3.Connection:
        """Open the existing state file (never creating one) and read what it records."""
        if self.path.stat().st_size == 0:
            raise _Corrupt("the file is empty (0 bytes)")
        db = sqlite3.connect(
            f"{self.path.absolute().as_uri()}?mode=rw", uri=True, isolation_level=None
        )
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            _check_integrity(db)
            row = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
            ).fetchone()
            version = (
                row and db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            )
            if not version:
                raise _Corrupt("it has no schema version")
            if version[0] == "1":
                self._migrate(db)
            elif version[0] != str(SCHEMA_VERSION):
                raise StateError(
                    f"state file {self.path} has schema version {version[0]}, "
                    f"this cns understands {SCHEMA_VERSION} (and migrates 1): a newer cns "
                    "wrote it; run that version, or restore a backup this one wrote"
                )
            db.executescript(_SCHEMA)
            db.execute("DELETE FROM cooldowns WHERE ends_at <= ?", (time.time(),))
            self.assignments, self.attachments, self.cooldowns = _read_checked(db)
        except BaseException:
            db.close()
            raise
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Rewrite a version-1 file as version 2 in one transaction: a crash or a failure
        before its commit leaves the version-1 file as it was, which the next start migrates
        again; the row count is checked before the commit, so no row is ever lost."""
        before = db.execute("SELECT count(*) FROM assignments").fetchone()[0]
        try:
            db.execute("BEGIN IMMEDIATE")
            for statement in _V1_TO_V2:
                db.execute(statement)
            after = db.execute("SELECT count(*) FROM assignments").fetchone()[0]
            if after != before:
                raise sqlite3.DatabaseError(f"{after} rows after the migration, {before} before")
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StateError(
                f"state file {self.path} cannot be migrated from schema version 1 to "
                f"{SCHEMA_VERSION} ({exc}); the file is unchanged (version 1): free space or "
                "fix the permissions and start again"
            ) from exc
        log.info("state_file_migrated", path=str(self.path), assignments=before, schema=2)

    # -- writing -------------------------------------------------------------------------------

    def enqueue(self, ops: Iterable[Op]) -> Batch:
        """Queue one request's ops for the next transaction, in the same step that changed the
        pool; the returned batch says whether they reached the disk.

        Queuing synchronously (rather than inside an awaited call) means a request that is
        cancelled after changing the pool cannot leave that change out of the log.
        """
        batch = Batch(list(ops))
        self._queue.append(batch)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().call_soon(self._write_queued)
        return batch

    async def flush(self) -> None:
        """Return once every batch queued so far is settled (each batch's error is its own)."""
        for batch in list(self._queue):
            await batch.wait()

    async def commit(self, ops: Iterable[Op]) -> None:
        await self.enqueue(ops).durable()

    async def probe(self) -> None:
        """One real durable write: while storage is failing, its success ends the failure."""
        await self.enqueue([Touch()]).wait()

    async def recover_forever(self, interval: float) -> None:
        """Probe while storage is failing, so health comes back without waiting for traffic."""
        while True:
            await asyncio.sleep(interval)
            if self.failure is not None:
                await self.probe()

    def assigned_at(self, ip_ids: Collection[str]) -> dict[str, float]:
        """When each of `ip_ids` was assigned to the owner holding it (wall clock, as committed;
        an ADD that found its IP already held keeps the first time). An id missing from the
        result is not committed. StorageFailure if the file cannot be read."""
        db = self._db
        if db is None:
            raise StorageFailure(self.path, "closed", "the state file is not open")
        ids = list(ip_ids)
        found: dict[str, float] = {}
        try:
            for start in range(0, len(ids), _MAX_QUERY_IDS):
                chunk = ids[start : start + _MAX_QUERY_IDS]
                found.update(
                    db.execute(
                        "SELECT ip_id, assigned_at FROM assignments "
                        f"WHERE ip_id IN ({','.join('?' * len(chunk))})",
                        chunk,
                    )
                )
        except sqlite3.Error as exc:
            raise self._storage_failure(exc) from exc
        return found

    def _write_queued(self) -> None:
        self._writer = None
        batches, self._queue = self._queue, []
        started = time.perf_counter()
        reopened = self.failure is not None
        try:
            if reopened:
                self._reopen()
            rejected = self._commit(batches)
        except StorageFailure as failure:
            self._fail(failure, batches)
            return
        self.commits += 1
        if self.on_commit is not None:
            self.on_commit(time.perf_counter() - started)
        self.failures["rejected"] += len(rejected)
        for batch in batches:
            if batch not in rejected:
                self._remember(batch.ops)
        if rejected:
            self._reread()  # a conflict means the disk knew something this process did not
        if self.failure is not None:
            log.warning(
                "state_storage_recovered",
                path=str(self.path),
                cause=self.failure.cause,
                failed_for_seconds=round(time.monotonic() - self._failing_since, 3),
            )
            self.failure = None
        for batch in batches:
            batch.settle(rejected.get(batch))
        if reopened or rejected:
            self._resync()

    def _commit(self, batches: list[Batch]) -> dict[Batch, Rejected]:
        """One transaction; returns the batches refused for content (their ops are not in it).

        A content error is rare (the disk knows something memory does not), so the batches are
        written first without a SAVEPOINT each; on one, the transaction is rolled back and
        written again with a SAVEPOINT per batch, which leaves out only the refused batches."""
        db = self._db
        if db is None:
            raise StorageFailure(self.path, "closed", "the state file is not open")
        now = time.time()
        try:
            db.execute("BEGIN IMMEDIATE")
            rejected = self._write_batches(db, batches, now, savepoints=False)
            if rejected:
                db.execute("ROLLBACK")
                db.execute("BEGIN IMMEDIATE")
                rejected = self._write_batches(db, batches, now, savepoints=True)
            db.execute("COMMIT")
        except Exception as exc:  # nothing was committed; every batch must hear why
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise self._storage_failure(exc) from exc
        return rejected

    def _write_batches(
        self, db: sqlite3.Connection, batches: list[Batch], now: float, *, savepoints: bool
    ) -> dict[Batch, Rejected]:
        """The batches' ops into the open transaction. Without `savepoints`, it stops at the
        first content error (the caller rolls back); with them, a refused batch is rolled back
        to its SAVEPOINT (and logged) and the others are kept."""
        rejected: dict[Batch, Rejected] = {}
        cooled_now: set[str] = set()
        for batch in batches:
            if savepoints:
                db.execute("SAVEPOINT batch")
            for op in batch.ops:
                try:
                    _execute(db, op, now, committed_cooldowns=self.cooldowns, cooled_now=cooled_now)
                except _CONTENT_ERRORS as exc:
                    rejected[batch] = _rejection(op, exc)
                    if not savepoints:
                        return rejected
                    db.execute("ROLLBACK TO batch")
                    log.warning("state_record_rejected", error=str(rejected[batch]))
                    break
            if savepoints:
                db.execute("RELEASE batch")
        return rejected

    def _fail(self, failure: StorageFailure, batches: list[Batch]) -> None:
        if self.failure is None:
            self._failing_since = time.monotonic()
        self.failure = failure
        self.failures[failure.cause] += 1
        log.error(
            "state_commit_failed",
            error=str(failure),
            errno=failure.cause,
            path=str(self.path),
            requests=len(batches),
        )
        for batch in batches:
            batch.settle(failure)
        self._resync()

    def _reopen(self) -> None:
        """A fresh connection and a fresh read of what is committed, after a storage failure:
        the old connection may be stuck read-only or on a file system that was replaced, and a
        commit that failed in its fsync may still have reached the disk."""
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        try:
            self._db = self._connect()
        except (OSError, sqlite3.Error, _Corrupt, StateError) as exc:
            raise self._storage_failure(exc) from exc

    def _reread(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.assignments, self.attachments, self.cooldowns = _read(self._db)

    def _remember(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Save):
                self.assignments[op.assignment.ip_id] = op.assignment
                self.cooldowns.pop(op.assignment.ip_id, None)
            elif isinstance(op, Forget):
                self.assignments.pop(op.ip_id, None)
                if op.cool_until:
                    self.cooldowns[op.ip_id] = (op.cool_until, op.pod)
            elif isinstance(op, SaveAttachment):
                self.attachments[op.key] = (op.netns, op.host_ifname)
            elif isinstance(op, ForgetAttachment):
                self.attachments.pop(op.key, None)

    def _resync(self) -> None:
        for listener in self.resync_listeners:
            listener()

    def _storage_failure(self, exc: BaseException) -> StorageFailure:
        """Name the cause: the kernel's errno from a probe write beside the state file, else
        the errno SQLite's code stands for, else SQLite's own code."""
        os_error = exc if isinstance(exc, OSError) else io_cause(self.path)
        if os_error is not None:
            detail = os_error.strerror or str(os_error)
            if os_error.filename and Path(os_error.filename) != self.path:
                detail += f": {os_error.filename}"
            return StorageFailure(
                self.path, errno.errorcode.get(os_error.errno or 0, "OSError"), detail
            )
        name = getattr(exc, "sqlite_errorname", "") or type(exc).__name__
        code = _SQLITE_ERRNO.get("_".join(name.split("_")[:2]))
        if code is not None:
            return StorageFailure(
                self.path, errno.errorcode[code], f"{os.strerror(code)}; SQLite: {exc}"
            )
        return StorageFailure(self.path, name, str(exc))

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def io_cause(path: Path) -> OSError | None:
    """The OSError the kernel gives for what a commit to `path` needs: opening the state file
    and its companions for writing, and a small durable write beside them."""
    for suffix in STATE_FILE_SUFFIXES:
        try:
            os.close(os.open(f"{path}{suffix}", os.O_RDWR | os.O_CLOEXEC))
        except FileNotFoundError:
            continue
        except OSError as exc:
            return exc
    probe = path.with_name(".cns-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, bytes(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def refuse_irregular_state_file(path: Path) -> None:
    """Raise StateError naming the state file (or companion) that is not a regular file."""
    irregular = irregular_state_file(path)
    if irregular is not None:
        raise StateError(
            f"{irregular}; refusing to start: a state file must be a regular file (a link "
            "may point into a volume that is not mounted): mount or restore what it should "
            f"be, or {RESET_HINT}"
        )


def irregular_state_file(path: Path) -> str | None:
    """What the state file or one of its companions is when it exists but is not a regular file
    (SQLite would follow a link, and creating the state file would replace it), else None."""
    for suffix in STATE_FILE_SUFFIXES:
        name = Path(f"{path}{suffix}")
        try:
            mode = name.lstat().st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISREG(mode):
            continue
        if stat.S_ISLNK(mode):
            target = os.readlink(name)
            state = "exists" if name.exists() else "does not exist"
            return f"state file {name} is a symbolic link to {target}, which {state}"
        return f"state file {name} is {_FILE_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}"
    return None


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
_INTEGRITY_LINES = 5


def _check_integrity(db: sqlite3.Connection) -> None:
    """`PRAGMA integrity_check`: unlike quick_check it also compares every index with its
    table, so a row edited behind an index's back (two rows, one address) is found."""
    found = [line for (line,) in db.execute(f"PRAGMA integrity_check({_INTEGRITY_LINES})")]
    if found != ["ok"]:
        raise _Corrupt(f"failed its integrity check: {'; '.join(found)}")


def _read_checked(
    db: sqlite3.Connection,
) -> tuple[dict[str, Assignment], dict[OwnerKey, tuple[str, str]], dict[str, tuple[float, str]]]:
    """`_read` at start-up: a row that is not UTF-8 text, or two rows sharing an IP id, an
    address or an owner, is corruption named by row and column, never one row silently kept.

    The rows are counted in the table itself (NOT INDEXED: an index may be what is damaged);
    only when the count or the distinct addresses or owners fall short are both rows looked up.
    """
    try:
        read = _read(db)
    except sqlite3.OperationalError as exc:
        if "decode" not in str(exc):
            raise
        raise _Corrupt(_undecodable(db) or str(exc)) from exc
    assignments = read[0].values()
    rows = db.execute("SELECT count(*) FROM assignments NOT INDEXED").fetchone()[0]
    if rows != len(assignments) or not (
        len({a.address for a in assignments})
        == len({(a.owner.container_id, a.owner.ifname, a.subnet) for a in assignments})
        == rows
    ):
        _refuse_duplicates(db)
        raise _Corrupt(f"table assignments has {rows} rows but {len(assignments)} distinct ones")
    return read


def _refuse_duplicates(db: sqlite3.Connection) -> None:
    """Name the first two rows that share an IP id, an address or an owner."""
    seen: dict[tuple[str, object], tuple[int, str]] = {}
    for rowid, ip_id, address, cid, ifname, subnet in db.execute(
        "SELECT rowid, ip_id, address, container_id, ifname, subnet FROM assignments NOT INDEXED"
    ):
        row = (rowid, ip_id)
        for key in (("IP id", ip_id), ("address", address), ("owner", (cid, ifname, subnet))):
            other = seen.setdefault(key, row)
            if other != row:
                raise _Corrupt(
                    f"rows {other[0]} (ip_id {other[1]!r}) and {rowid} (ip_id {ip_id!r}) of "
                    f"table assignments record the same {key[0]} {key[1]!r}: the file's content "
                    "is damaged (one of them was changed); neither is handed out"
                )


def _undecodable(db: sqlite3.Connection) -> str | None:
    """Which row and column of which table holds text that is not UTF-8."""
    tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    db.text_factory = bytes
    try:
        for table in tables:
            cursor = db.execute(f'SELECT rowid, * FROM "{table}"')
            columns = [column[0] for column in cursor.description][1:]
            for rowid, *values in cursor:
                for column, value in zip(columns, values, strict=True):
                    # a byte that is not UTF-8 decodes to a lone surrogate, which cannot encode
                    if isinstance(value, bytes) and not _encodable(
                        value.decode("utf-8", "surrogateescape")
                    ):
                        first = values[0]
                        if isinstance(first, bytes):
                            first = first.decode("utf-8", "replace")
                        return (
                            f"its content is damaged: row {rowid} of table {table} "
                            f"({columns[0]} {first!r}) has a {column} that is not UTF-8 text "
                            f"({value[:64]!r}); restore the file, or correct that row with "
                            "sqlite3 while cns is stopped"
                        )
    finally:
        db.text_factory = str
    return None


def _read(
    db: sqlite3.Connection,
) -> tuple[dict[str, Assignment], dict[OwnerKey, tuple[str, str]], dict[str, tuple[float, str]]]:
    assignments = {
        ip_id: Assignment(ip_id, address, nc_id, Owner(cid, ifname, pod, ns), subnet)
        for ip_id, address, nc_id, cid, ifname, pod, ns, subnet in db.execute(
            "SELECT ip_id, address, nc_id, container_id, ifname, pod_name, pod_namespace, "
            "subnet FROM assignments ORDER BY assigned_at"
        )
    }
    attachments = {
        OwnerKey(cid, ifname): (netns, host)
        for cid, ifname, netns, host in db.execute(
            "SELECT container_id, ifname, netns, host_ifname FROM attachments"
        )
    }
    cooldowns = {
        ip_id: (ends_at, pod)
        for ip_id, ends_at, pod in db.execute("SELECT ip_id, ends_at, pod FROM cooldowns")
    }
    return assignments, attachments, cooldowns


def _execute(
    db: sqlite3.Connection,
    op: Op,
    now: float,
    *,
    committed_cooldowns: Mapping[str, object],
    cooled_now: set[str],
) -> None:
    """One record. A Save clears the IP's cooldown row only where there may be one (committed
    before, or written earlier in this transaction): one statement less on every ADD."""
    if isinstance(op, Save):
        a = op.assignment
        owner = a.owner
        row = (a.ip_id, a.address, a.nc_id, owner.container_id, owner.ifname)
        cursor = db.execute(_SAVE, (*row, owner.pod_name, owner.pod_namespace, now, a.subnet))
        if cursor.rowcount == 0:
            raise _OwnerConflict("the state file records this IP for another owner")
        if a.ip_id in committed_cooldowns or a.ip_id in cooled_now:
            db.execute("DELETE FROM cooldowns WHERE ip_id=?", (a.ip_id,))
    elif isinstance(op, Forget):
        db.execute("DELETE FROM assignments WHERE ip_id=?", (op.ip_id,))
        if op.cool_until:
            db.execute(
                "INSERT OR REPLACE INTO cooldowns VALUES (?, ?, ?)",
                (op.ip_id, op.cool_until, op.pod),
            )
            cooled_now.add(op.ip_id)
    elif isinstance(op, SaveAttachment):
        db.execute(
            "INSERT OR REPLACE INTO attachments VALUES (?, ?, ?, ?)",
            (op.key.container_id, op.key.ifname, op.netns, op.host_ifname),
        )
    elif isinstance(op, ForgetAttachment):
        db.execute(
            "DELETE FROM attachments WHERE container_id=? AND ifname=?",
            (op.key.container_id, op.key.ifname),
        )
    else:
        db.execute(
            "INSERT INTO meta VALUES ('probed_at', ?) "
            "ON CONFLICT (key) DO UPDATE SET value=excluded.value",
            (str(now),),
        )


def _fields(op: Op) -> list[tuple[str, str]]:
    """The op's text as request fields, to name the one the database refused."""
    if isinstance(op, Save):
        a = op.assignment
        return [
            ("containerID", a.owner.container_id),
            ("ifName", a.owner.ifname),
            ("podName", a.owner.pod_name),
            ("podNamespace", a.owner.pod_namespace),
            ("ipConfigID", a.ip_id),
            ("address", a.address),
            ("nc", a.nc_id),
            ("subnets", a.subnet),
        ]
    if isinstance(op, SaveAttachment):
        key = op.key
        return [
            ("containerID", key.container_id),
            ("ifName", key.ifname),
            ("netns", op.netns),
            ("hostIfname", op.host_ifname),
        ]
    if isinstance(op, ForgetAttachment):
        return [("containerID", op.key.container_id), ("ifName", op.key.ifname)]
    if isinstance(op, Forget):
        return [("ipConfigID", op.ip_id)]
    return []


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _rejection(op: Op, exc: Exception) -> Rejected:
    fields = _fields(op)
    if isinstance(exc, UnicodeEncodeError):
        field = next((name for name, value in fields if not _encodable(value)), None)
        return Rejected(f"{field or 'a field'} cannot be stored: {exc.reason}", field)
    if isinstance(exc, sqlite3.DataError | OverflowError) and fields:
        field, value = max(fields, key=lambda item: len(item[1]))
        return Rejected(f"{field} is too long to store ({len(value)} characters): {exc}", field)
    identity = ("containerID", "ifName", "ipConfigID", "address")
    what = ", ".join(f"{name}={value!r}" for name, value in fields if name in identity)
    return Rejected(f"the record ({what}) conflicts with the state file: {exc}")
