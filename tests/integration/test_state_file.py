"""The state file is input too (issue 25): a link where the file should be, a damaged log, a row
edited behind its index, text that is not UTF-8, and modes any local user could read.

Each test damages real SQLite files written by a real daemon (or by the store), as an accident or
an operator would, and starts a real daemon on them: it must refuse, naming the file and what is
wrong, and leave the evidence as it found it; or start with every acknowledged assignment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import stat
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cns.state.store
from cns.state.store import StateError, Store
from cns.state.wal import FRAME_HEADER_BYTES, WAL_HEADER_BYTES, lost_commits
from tests.integration.test_daemon import add, cns_cli

UMASK_022 = ("sh", "-c", 'umask 022 && exec "$@"', "sh")


def used_state_dir(make_daemon: Any, adds: int = 1) -> Any:
    """A daemon that acknowledged `adds` ADDs and stopped cleanly."""
    daemon = make_daemon()
    for n in range(1, adds + 1):
        assert add(daemon, n)[0] == 200
    assert daemon.stop() == 0
    return daemon


def refused(daemon: Any, *args: str) -> str:
    """Start `cns run` on the daemon's config; it must exit 1 without a traceback."""
    result = cns_cli("run", "--config", str(daemon.config_path), *args)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def snapshot(directory: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry of the state directory: its mode and content (or link target)."""
    result: dict[str, tuple[int, bytes | str]] = {}
    for entry in sorted(directory.iterdir()):
        info = entry.lstat()
        if stat.S_ISLNK(info.st_mode):
            result[entry.name] = (info.st_mode, os.readlink(entry))
        elif stat.S_ISREG(info.st_mode) and entry.name != "cns.lock":
            result[entry.name] = (info.st_mode, entry.read_bytes())
        else:
            result[entry.name] = (info.st_mode, "")
    return result


# -- case 4: a state file that is not a regular file ------------------------------------------


@pytest.mark.parametrize("kind", ["dangling link", "link", "directory", "fifo", "wal link"])
def test_a_state_file_that_is_not_a_regular_file_is_refused_and_kept(
    make_daemon: Any, tmp_path: Path, kind: str
) -> None:
    """A volume that did not mount leaves `state.db` a link to nothing: starting empty would
    replace the link with a new database and hand out every held address again."""
    daemon = used_state_dir(make_daemon)
    state = daemon.state_dir / "state.db"
    volume = tmp_path / "volume"
    expected = {
        "dangling link": f"state file {state} is a symbolic link to {volume}/state.db, which "
        "does not exist",
        "link": f"state file {state} is a symbolic link to {volume}/state.db, which exists",
        "directory": f"state file {state} is a directory",
        "fifo": f"state file {state} is a FIFO (named pipe)",
        "wal link": f"state file {state}-wal is a symbolic link to {volume}/state.db-wal",
    }[kind]
    if kind in ("dangling link", "link"):
        if kind == "link":
            volume.mkdir()
            shutil.move(state, volume / "state.db")
        else:
            state.unlink()
        state.symlink_to(volume / "state.db")
    elif kind == "directory":
        state.unlink()
        state.mkdir()
    elif kind == "fifo":
        state.unlink()
        os.mkfifo(state)
    else:
        state.with_name("state.db-wal").symlink_to(volume / "state.db-wal")
    before = snapshot(daemon.state_dir)
    message = refused(daemon)
    assert expected in message, message
    assert "must be a regular file" in message and "--reset-state" in message
    assert snapshot(daemon.state_dir) == before  # nothing followed, replaced or created
    if kind == "dangling link":
        assert not volume.exists()
        # The operator's explicit reset moves the link itself aside and starts empty.
        daemon.start(extra_args=("--reset-state",))
        assert daemon.pool()["ips"]["Assigned"] == 0
        kept = [p for p in daemon.state_dir.glob("state.db.reset-*")]
        assert len(kept) == 1 and os.readlink(kept[0]) == str(volume / "state.db")


def test_a_dangling_link_on_a_fresh_node_is_refused_too(make_daemon: Any, tmp_path: Path) -> None:
    """No other state to show the node was used: a link still means a volume is expected."""
    daemon = make_daemon(start=False)
    daemon.state_dir.mkdir()
    (daemon.state_dir / "state.db").symlink_to(tmp_path / "missing" / "state.db")
    assert "is a symbolic link to" in refused(daemon)
    assert (daemon.state_dir / "state.db").is_symlink()


def test_a_linked_state_directory_is_the_operators_choice_and_a_dangling_one_is_refused(
    make_daemon: Any, tmp_path: Path
) -> None:
    daemon = make_daemon(start=False)
    disk = tmp_path / "disk" / "cns"
    disk.mkdir(parents=True)
    daemon.state_dir.symlink_to(disk)
    daemon.start()
    assert add(daemon, 1)[0] == 200
    assert daemon.stop() == 0
    assert (disk / "state.db").stat().st_size > 0
    shutil.move(disk, tmp_path / "elsewhere")  # the disk did not mount
    message = refused(daemon)
    assert f"state directory {daemon.state_dir} is a symbolic link to {disk}" in message
    assert daemon.state_dir.is_symlink() and not disk.exists()


# -- case 5: a damaged frame in the write-ahead log -------------------------------------------


def wal_frame_offset(wal: Path, frame: int) -> int:
    """Where frame `frame` (1-based) of the log starts."""
    page_size = struct.unpack(">I", wal.read_bytes()[8:12])[0]
    return WAL_HEADER_BYTES + (frame - 1) * (FRAME_HEADER_BYTES + page_size)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def killed_after_adds(make_daemon: Any, adds: int) -> tuple[Any, dict[str, str]]:
    """A daemon that acknowledged `adds` ADDs, then kill -9: its log still holds them all (the
    store checkpoints only at SQLite's default of 1,000 pages, and on a clean close)."""
    daemon = make_daemon()
    acknowledged = {}
    for n in range(1, adds + 1):
        status, body = add(daemon, n)
        assert status == 200
        acknowledged[f"c{n}"] = body["ips"][0]["address"].split("/")[0]
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.proc = None
    return daemon, acknowledged


def held(daemon: Any) -> dict[str, str]:
    return {ip["owner"]["containerID"]: ip["address"] for ip in daemon.ips() if ip.get("owner")}


def test_kill_9_then_a_flipped_byte_in_an_early_wal_frame_is_refused(make_daemon: Any) -> None:
    daemon, _ = killed_after_adds(make_daemon, 40)
    wal = daemon.state_dir / "state.db-wal"
    frame_bytes = wal_frame_offset(wal, 2) - wal_frame_offset(wal, 1)
    frames = (wal.stat().st_size - WAL_HEADER_BYTES) // frame_bytes
    assert frames > 40  # every ADD's commit is still in the log, none checkpointed
    flip(wal, wal_frame_offset(wal, 3) + FRAME_HEADER_BYTES + 100)
    before = snapshot(daemon.state_dir)
    message = refused(daemon)
    assert f"state file {wal} is damaged: frame 3 (byte offset " in message, message
    assert "committed transaction(s) after it would be dropped" in message
    assert "--reset-state" in message
    assert snapshot(daemon.state_dir) == before  # the evidence is kept as it was


def test_kill_9_with_an_intact_wal_starts_with_every_acknowledged_add(make_daemon: Any) -> None:
    daemon, acknowledged = killed_after_adds(make_daemon, 40)
    assert (daemon.state_dir / "state.db-wal").stat().st_size > 0
    daemon.start()
    assert held(daemon) == acknowledged


def run_transactions(path: Path, sizes: list[int]) -> None:
    """One row per transaction (of `sizes[i]` bytes, so some span several pages), left in the
    log: the connection stays open while the files are copied, as kill -9 would leave them."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t (n INTEGER PRIMARY KEY, blob BLOB)")
    for n, size in enumerate(sizes):
        db.execute("INSERT INTO t VALUES (?, ?)", (n, os.urandom(size)))
    crashed = path.with_name("crashed")
    crashed.mkdir()
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{path}{suffix}", crashed / f"state.db{suffix}")
    db.close()


def rows_sqlite_keeps(path: Path) -> int:
    db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM t").fetchone()[0])
    except sqlite3.OperationalError:  # the CREATE TABLE was dropped too
        return -1
    finally:
        db.close()


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=9000), min_size=1, max_size=12),
    where=st.floats(min_value=0, max_value=1, exclude_max=True),
    bit=st.integers(min_value=0, max_value=7),
    region=st.sampled_from(["page", "anywhere", "header"]),
)
def test_the_validator_reports_exactly_the_commits_sqlite_drops_after_the_damaged_one(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    where: float,
    bit: int,
    region: str,
) -> None:
    """Real SQLite logs, one bit flipped: SQLite's own replay is the truth. Every transaction
    SQLite drops but the one holding the damage is reported, nothing when SQLite drops at most
    that one; an undamaged log and every torn tail are never reported."""
    directory = tmp_path_factory.mktemp("wal")
    run_transactions(directory / "live.db", sizes)
    wal = directory / "crashed" / "state.db-wal"
    data = wal.read_bytes()
    assert lost_commits(data, 4096) is None
    for cut in (len(data) - 1, len(data) - 4096, (len(data) + WAL_HEADER_BYTES) // 2):
        assert lost_commits(data[:cut], 4096) is None  # a torn tail
    transactions = len(sizes) + 1  # the CREATE TABLE too
    frame_bytes = struct.unpack(">I", data[8:12])[0] + FRAME_HEADER_BYTES
    if region == "header":
        offset = int(where * WAL_HEADER_BYTES)
    else:
        offset = WAL_HEADER_BYTES + int(where * (len(data) - WAL_HEADER_BYTES))
        if region == "page" and (offset - WAL_HEADER_BYTES) % frame_bytes < FRAME_HEADER_BYTES:
            offset += FRAME_HEADER_BYTES  # into the page images: most of the file
    damaged = bytearray(data)
    damaged[offset] ^= 1 << bit
    wal.write_bytes(bytes(damaged))
    report = lost_commits(bytes(damaged), 4096)
    dropped = transactions - (rows_sqlite_keeps(wal.with_name("state.db")) + 1)
    reported = report.commits if report else 0
    in_frame_header = (
        offset >= WAL_HEADER_BYTES
        and (offset - WAL_HEADER_BYTES) % frame_bytes < FRAME_HEADER_BYTES
    )
    if in_frame_header:  # the frame's own fields: its transaction's end is read at face value
        assert max(dropped - 2, 0) <= reported <= dropped, (offset, dropped, report)
    else:
        assert reported == max(dropped - 1, 0), (offset, dropped, report)
    if report is not None:
        assert dropped >= 1
        assert (report.frame == 0) == (offset < WAL_HEADER_BYTES)


# -- case 6: two rows, one address ------------------------------------------------------------


def point_row_at(state: Path, *, victim: str, address: str) -> None:
    """Rewrite `victim`'s address in the table's page only, its index left as it was: what an
    edit of the file's bytes does (an UPDATE through SQLite would be refused by the index)."""
    db = sqlite3.connect(state)
    old = db.execute("SELECT address FROM assignments WHERE container_id=?", (victim,)).fetchone()
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name='assignments'").fetchone()
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    assert len(old[0]) == len(address)
    data = bytearray(state.read_bytes())
    start = (root[0] - 1) * page_size
    table_page = bytes(data[start : start + page_size])
    assert table_page.count(old[0].encode()) == 1
    at = start + table_page.index(old[0].encode())
    data[at : at + len(address)] = address.encode()
    state.write_bytes(bytes(data))


def test_a_row_changed_to_another_held_address_is_refused_at_start(make_daemon: Any) -> None:
    daemon = make_daemon()
    addresses = {n: add(daemon, n)[1]["ips"][0]["address"].split("/")[0] for n in (1, 2, 3)}
    assert daemon.stop() == 0
    state = daemon.state_dir / "state.db"
    point_row_at(state, victim="c2", address=addresses[1])
    before = snapshot(daemon.state_dir)
    message = refused(daemon)
    assert f"state file {state} is corrupt (failed its integrity check:" in message, message
    assert "missing from index" in message and "--reset-state" in message
    assert snapshot(daemon.state_dir) == before


def test_two_rows_of_one_address_are_refused_whatever_the_integrity_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_daemon: Any
) -> None:
    """The restore itself never keeps two holders of one address, should a damage slip past
    SQLite's check: both rows are named."""
    daemon = make_daemon()
    addresses = {n: add(daemon, n)[1]["ips"][0]["address"].split("/")[0] for n in (1, 2)}
    assert daemon.stop() == 0
    state = daemon.state_dir / "state.db"
    point_row_at(state, victim="c2", address=addresses[1])
    monkeypatch.setattr(cns.state.store, "_check_integrity", lambda db: None, raising=False)
    with pytest.raises(StateError) as refusal:
        Store(state).open()
    assert f"record the same address {addresses[1]!r}: the file's content is damaged" in str(
        refusal.value
    )
    assert "rows 1 (ip_id " in str(refusal.value) and "and 2 (ip_id " in str(refusal.value)


# -- case 12: text that is not UTF-8 ----------------------------------------------------------


def test_a_row_that_is_not_utf8_is_named_as_damaged_content(make_daemon: Any) -> None:
    daemon = used_state_dir(make_daemon, adds=2)
    state = daemon.state_dir / "state.db"
    db = sqlite3.connect(state)
    ip_id = db.execute("SELECT ip_id FROM assignments WHERE container_id='c2'").fetchone()[0]
    with db:
        db.execute(
            "UPDATE assignments SET pod_namespace=CAST(x'73686fff70' AS TEXT) "
            "WHERE container_id='c2'"
        )
    db.close()
    message = refused(daemon)
    assert f"state file {state} is corrupt (its content is damaged: row 2 of table " in message
    assert f"assignments (ip_id {ip_id!r}) has a pod_namespace that is not UTF-8 text" in message
    assert "b'sho\\xffp'" in message and "--reset-state" in message
    assert "permission" not in message and "access problem" not in message


# -- case 9: modes ----------------------------------------------------------------------------


def modes(directory: Path) -> dict[str, str]:
    return {
        p.name: f"{stat.S_IMODE(p.lstat().st_mode):04o}" for p in directory.iterdir() if p.is_file()
    }


def test_state_files_are_0600_in_a_0755_directory_under_umask_022(make_daemon: Any) -> None:
    """The DaemonSet's DirectoryOrCreate makes the directory 0755: no local user may read the
    node's assignments, whatever SQLite, the umask or the directory would give."""
    daemon = make_daemon(start=False)
    daemon.state_dir.mkdir(mode=0o755)
    daemon.state_dir.chmod(0o755)
    daemon.start(prefix=UMASK_022)
    assert add(daemon, 1)[0] == 200
    found = modes(daemon.state_dir)
    assert {"state.db", "state.db-wal", "state.db-shm", "cns.lock"} <= found.keys()
    assert "standalone-allocator.json" in found
    assert set(found.values()) == {"0600"}, found
    assert daemon.stop() == 0
    # Files an older cns left readable by everyone are narrowed at the next start, and logged.
    for name in ("state.db", "standalone-allocator.json", "cns.lock"):
        (daemon.state_dir / name).chmod(0o644)
    daemon.start(prefix=UMASK_022)
    assert set(modes(daemon.state_dir).values()) == {"0600"}
    tightened = [
        json.loads(line)
        for line in daemon.log().splitlines()
        if '"state_file_mode_tightened"' in line
    ]
    assert sorted(Path(line["path"]).name for line in tightened) == [
        "cns.lock",
        "standalone-allocator.json",
        "state.db",
    ]
    assert {(line["mode"], line["now"]) for line in tightened} == {("0644", "0600")}
    assert daemon.pool()["ips"]["Assigned"] == 1
