"""Durable state: the SQLite store's commits, cooldowns, refusals and schema migrations."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cns.state.store
from cns.core.pool import Assignment
from cns.core.types import Owner
from cns.state.store import Forget, Rejected, Save, StateError, Store
from tests.harness import REPO


def assignment(n: int) -> Assignment:
    return Assignment(f"ip-{n}", f"10.0.0.{n}", "nc", Owner(f"c{n}", "eth0", f"pod{n}", "ns"))


async def test_commits_survive_reopen_and_group(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = Store(path)
    assert store.open() == []
    await asyncio.gather(*(store.commit([Save(assignment(n))]) for n in range(1, 51)))
    assert store.commits < 50  # concurrent commits were grouped
    await store.commit([Forget("ip-7")])
    store.close()
    reopened = Store(path)
    restored = reopened.open()
    reopened.close()
    assert {a.ip_id for a in restored} == {f"ip-{n}" for n in range(1, 51)} - {"ip-7"}
    assert assignment(3) in restored


async def test_cooldowns_are_kept_with_their_release_and_dropped_when_due(tmp_path: Path) -> None:
    """A release's cooldown (end and pod) is committed with it and read back after a reopen;
    assigning the IP again clears it, and one already over is dropped when the file opens."""
    path = tmp_path / "state.db"
    store = Store(path)
    store.open()
    await store.commit([Save(assignment(n)) for n in (1, 2, 3)])
    later = time.time() + 600
    await store.commit([Forget("ip-1", cool_until=later, pod="ns/pod1")])
    await store.commit([Forget("ip-2", cool_until=later), Forget("ip-3", cool_until=1.0)])
    await store.commit([Save(assignment(2))])  # taken again: its cooldown is over
    assert store.cooldowns == {"ip-1": (later, "ns/pod1"), "ip-3": (1.0, "")}
    store.close()
    reopened = Store(path)
    reopened.open()
    reopened.close()
    assert reopened.cooldowns == {"ip-1": (later, "ns/pod1")}  # ip-3's ended long ago


async def test_an_ip_released_and_taken_again_in_one_transaction_keeps_no_cooldown(
    tmp_path: Path,
) -> None:
    """A Save clears a cooldown row only where there may be one: also one written earlier in the
    same transaction (the pod that gave the IP back takes it again at once)."""
    path = tmp_path / "state.db"
    store = Store(path)
    store.open()
    await store.commit([Save(assignment(1))])
    later = time.time() + 600
    await store.commit([Forget("ip-1", cool_until=later, pod="ns/pod1"), Save(assignment(1))])
    store.close()
    reopened = Store(path)
    reopened.open()
    reopened.close()
    assert reopened.cooldowns == {}
    assert set(reopened.assignments) == {"ip-1"}


async def test_flush_without_pending_work_returns_at_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.open()
    await store.flush()
    assert store.commits == 0
    store.close()


async def test_a_second_owner_for_one_address_is_refused_by_the_database(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.open()
    await store.commit([Save(assignment(1))])
    clash = Assignment("ip-other", "10.0.0.1", "nc", Owner("c9", "eth0"))
    with pytest.raises(Rejected, match=r"UNIQUE constraint failed: assignments\.address"):
        await store.commit([Save(clash)])
    store.close()


def test_corrupt_state_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StateError, match=str(path)):
        Store(path).open()
    assert path.read_bytes().startswith(b"this is not")  # never reset


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = Store(path)
    store.open()
    store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StateError, match="schema version 99"):
        Store(path).open()


# The state file as cns wrote it before lanes (schema version 1): what a migration starts from.
_V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE assignments (
    ip_id TEXT PRIMARY KEY, address TEXT NOT NULL UNIQUE, nc_id TEXT NOT NULL,
    container_id TEXT NOT NULL, ifname TEXT NOT NULL, pod_name TEXT NOT NULL,
    pod_namespace TEXT NOT NULL, assigned_at REAL NOT NULL, UNIQUE (container_id, ifname)
);
CREATE TABLE cooldowns (ip_id TEXT PRIMARY KEY, ends_at REAL NOT NULL, pod TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
"""


def _version_1_file(path: Path, rows: int) -> None:
    db = sqlite3.connect(path)
    db.executescript(_V1_SCHEMA)
    db.executemany(
        "INSERT INTO assignments VALUES (?, ?, 'nc', ?, 'eth0', ?, 'ns', ?)",
        [(f"ip-{n}", f"10.0.0.{n}", f"c{n}", f"pod{n}", float(n)) for n in range(1, rows + 1)],
    )
    db.commit()
    db.close()


def _raw(path: Path) -> tuple[str, int]:
    """The schema version and the row count, read without cns."""
    db = sqlite3.connect(path)
    try:
        version = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        return version, db.execute("SELECT count(*) FROM assignments").fetchone()[0]
    finally:
        db.close()


async def test_a_version_1_file_is_migrated_keeping_every_row_in_the_primary_lane(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    _version_1_file(path, 5)
    store = Store(path)
    restored = store.open()
    assert restored == [assignment(n) for n in range(1, 6)]
    assert {a.subnet for a in restored} == {""}
    assert _raw(path) == ("2", 5)
    # Now one owner may hold an IP in each lane, but still one per lane.
    v6 = Assignment("ip-v6", "fd00::1", "nc6", assignment(1).owner, "v6pods")
    await store.commit([Save(v6)])
    with pytest.raises(Rejected, match="UNIQUE constraint failed"):
        await store.commit([Save(Assignment("ip-x", "fd00::2", "nc6", v6.owner, "v6pods"))])
    store.close()
    reopened = Store(path)
    assert len(reopened.open()) == 6
    reopened.close()
    assert reopened.assignments["ip-v6"] == v6


def test_a_migration_that_fails_leaves_the_version_1_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.db"
    _version_1_file(path, 3)
    monkeypatch.setattr(
        cns.state.store, "_V1_TO_V2", (*cns.state.store._V1_TO_V2, "SELECT no_such()")
    )
    with pytest.raises(StateError, match=r"cannot be migrated.*unchanged"):
        Store(path).open()
    assert _raw(path) == ("1", 3)
    monkeypatch.undo()
    store = Store(path)
    assert len(store.open()) == 3
    store.close()
    assert _raw(path) == ("2", 3)


_KILLED_MID_MIGRATION = """
import os, signal, sqlite3, sys
from pathlib import Path
import cns.state.store

real = sqlite3.connect
def connect(*args, **kwargs):
    db = real(*args, **kwargs)
    db.create_function("die", 0, lambda: os.kill(os.getpid(), signal.SIGKILL))
    return db
sqlite3.connect = connect
cns.state.store._V1_TO_V2 = (*cns.state.store._V1_TO_V2, "SELECT die()")
cns.state.store.Store(Path(sys.argv[1])).open()
"""


def test_kill_9_mid_migration_leaves_a_readable_version_1_file(tmp_path: Path) -> None:
    """The process dies after every statement of the migration but before its commit."""
    path = tmp_path / "state.db"
    _version_1_file(path, 4)
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_MIGRATION, str(path)], cwd=REPO, check=False
    )
    assert done.returncode == -9
    assert _raw(path) == ("1", 4)
    store = Store(path)
    assert [a.ip_id for a in store.open()] == [f"ip-{n}" for n in range(1, 5)]
    store.close()
    assert _raw(path) == ("2", 4)
