"""The release queue: what the plugin writes, and what the daemon accepts from the directory.

The directory is treated as untrusted: nothing in it may block the daemon, make it follow a
symlink, read without bound, or release an attachment other than the one a file's name says.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from cni_plugin.release_queue import NAME_MAX, entry_name, queue_release
from cns.core.pool import Pool
from cns.core.types import OwnerKey, Scaler
from cns.node.control_plane import MemorySource, SourceState
from cns.node.releasing import INVALID_ENTRY_EXAMPLES, RELEASE_QUEUE_SLICE
from cns.node.service import NodeIPAM
from cns.state import release_queue_reader
from cns.state.release_queue_reader import (
    MAX_ENTRY_BYTES,
    MAX_QUARANTINED,
    BadEntry,
    collect,
    parse_entry,
)
from cns.state.store import Store


def entry(container_id: str, ifname: str = "eth0") -> bytes:
    return json.dumps({"containerID": container_id, "ifName": ifname, "queuedAt": 1.0}).encode()


def add(daemon: Any, container_id: str) -> None:
    body = {"containerID": container_id, "ifName": "eth0", "netns": "/x"}
    status, reply = daemon.call("POST", "/v1/cni/add", body)
    assert status == 200, reply


def collect_within(directory: Path, seconds: float = 30) -> tuple[Any, Any]:
    """collect() in a thread: a FIFO that blocked it would fail here instead of hanging."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(collect(directory)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, "collect() blocked"
    return result[0]  # type: ignore[no-any-return]


def test_queue_names_are_hashed_when_too_long_for_a_file_name() -> None:
    assert entry_name(container_id="c1", ifname="eth0") == "c1_eth0.json"
    fits = "c" * (NAME_MAX - len("_eth0.json"))
    assert entry_name(container_id=fits, ifname="eth0") == f"{fits}_eth0.json"
    long = entry_name(container_id=fits + "c", ifname="eth0")
    assert long.startswith("h-") and long.endswith(".json") and len(long) == 71
    assert long != entry_name(container_id=fits + "d", ifname="eth0")
    assert entry_name(container_id=fits + "c", ifname="eth0") == long  # the daemon derives the same


def test_parse_entry_needs_name_and_content_to_agree() -> None:
    assert parse_entry("c1_eth0.json", entry("c1")).key == OwnerKey("c1", "eth0")
    assert parse_entry("c1_eth0.json", entry("c1")).queued_at == 1.0
    long = "x" * 300
    assert parse_entry(entry_name(container_id=long, ifname="eth0"), entry(long)).key == OwnerKey(
        long, "eth0"
    )
    for name, data, reason in [
        ("c2_eth0.json", entry("c1"), "does not match"),
        ("c1_eth0.json", b"{not json", "not JSON"),
        ("c1_eth0.json", b"[" * 100_000, "not JSON"),
        ("c1_eth0.json", b"\xff", "not JSON"),
        ("c1_eth0.json", b"[]", "not a JSON object"),
        ("c1_eth0.json", b'{"containerID": 1, "ifName": "eth0"}', "must be strings"),
        ("c1_eth0.json", b'{"containerID": "c1", "ifName": "eth0"}', "queuedAt must be"),
        ("c1_eth0.json", b'{"containerID": "c1", "ifName": "eth0", "queuedAt": true}', "queuedAt"),
        ("c1_eth0.json", b'{"containerID": "c1", "ifName": "eth0", "queuedAt": -1}', "not a time"),
        ("_eth0.json", entry(""), "containerID"),
        ("x_a b.json", entry("x", "a b"), "ifName"),
    ]:
        with pytest.raises(BadEntry, match=reason):
            parse_entry(name, data)


def test_collect_reads_only_small_regular_files_whose_name_matches(tmp_path: Path) -> None:
    queue = tmp_path / "release-queue"
    queue.mkdir()
    (queue / "good_eth0.json").write_bytes(entry("good"))
    (queue / ".good2_eth0.json.123.tmp").write_bytes(entry("good2"))  # still being written
    os.mkfifo(queue / "fifo_eth0.json")
    (queue / "passwd_eth0.json").symlink_to("/etc/passwd")
    (queue / "big_eth0.json").write_bytes(b" " * (10 << 20))
    (queue / "other_eth0.json").write_bytes(entry("victim"))
    (queue / "dir_eth0.json").mkdir()
    (queue / "stray.txt").write_text("x")
    entries, bad = collect_within(queue)
    assert [(e.name, e.key) for e in entries] == [("good_eth0.json", OwnerKey("good", "eth0"))]
    reasons = {b.name: b.reason for b in bad}
    assert set(reasons) == {
        "fifo_eth0.json", "passwd_eth0.json", "big_eth0.json", "other_eth0.json",
        "dir_eth0.json", "stray.txt",
    }  # fmt: skip
    assert "FIFO" in reasons["fifo_eth0.json"]
    assert "symlink" in reasons["passwd_eth0.json"]
    assert f"larger than {MAX_ENTRY_BYTES}" in reasons["big_eth0.json"]
    assert "does not match" in reasons["other_eth0.json"]
    assert {b.outcome for b in bad} == {"quarantined"}
    quarantined = sorted(p.name for p in (queue / "quarantine").iterdir())
    assert quarantined == sorted(reasons)
    assert (queue / "quarantine" / "passwd_eth0.json").is_symlink()  # moved, never followed
    assert sorted(p.name for p in queue.iterdir()) == [
        ".good2_eth0.json.123.tmp", "good_eth0.json", "quarantine",
    ]  # fmt: skip
    release_queue_reader.remove(queue, entries)
    assert not (queue / "good_eth0.json").exists()


def test_quarantine_is_bounded(tmp_path: Path) -> None:
    queue = tmp_path / "release-queue"
    (queue / "quarantine").mkdir(parents=True)
    for n in range(MAX_QUARANTINED):
        (queue / "quarantine" / f"old{n}").write_text("")
    (queue / "bad_eth0.json").write_text("{")
    _, bad = collect_within(queue)
    assert [b.outcome for b in bad] == ["deleted (quarantine full)"]
    assert not (queue / "bad_eth0.json").exists()
    assert len(list((queue / "quarantine").iterdir())) == MAX_QUARANTINED


def test_a_fifo_in_the_queue_does_not_stop_the_daemon(make_daemon: Any) -> None:
    """Reading a FIFO blocks until a writer comes; on the event loop it froze every ADD."""
    daemon = make_daemon()
    add(daemon, "c1")
    queue = daemon.state_dir / "release-queue"
    queue.mkdir(exist_ok=True)
    os.mkfifo(queue / "fifo_eth0.json")
    (queue / "c2_eth0.json").write_bytes(entry("c1"))  # names c2, releases c1: refused
    (queue / "passwd_eth0.json").symlink_to("/etc/passwd")
    daemon.wait_pool(lambda p: (queue / "quarantine" / "fifo_eth0.json").exists(), timeout=30)
    add(daemon, "c3")  # the daemon still serves
    owners = {ip["owner"]["containerID"] for ip in daemon.ips() if ip["owner"]}
    assert owners == {"c1", "c3"}
    log = daemon.log()
    for name in ("fifo_eth0.json", "c2_eth0.json", "passwd_eth0.json"):
        assert (queue / "quarantine" / name).exists() or (queue / "quarantine" / name).is_symlink()
        assert f"{queue / name}" in log
    assert "root:" not in log  # /etc/passwd was never read


def test_a_long_container_id_is_queued_by_the_plugin_and_applied(
    make_daemon: Any, plugin_dir: Path
) -> None:
    """300 characters: too long for `<id>_<ifname>.json`, so the plugin hashes the name."""
    daemon = make_daemon()
    container_id = "k" * 300
    add(daemon, container_id)
    assert daemon.stop() == 0  # the DEL finds the daemon down and queues it
    result = daemon.ipam(plugin_dir, "DEL", container_id)
    assert (result.returncode, result.stdout) == (0, ""), result.stdout
    queued = [p.name for p in (daemon.state_dir / "release-queue").iterdir()]
    assert queued == [entry_name(container_id=container_id, ifname="eth0")]
    assert queued[0].startswith("h-")
    daemon.start()
    assert daemon.pool()["ips"]["Assigned"] == 0
    assert not list((daemon.state_dir / "release-queue").glob("*.json"))


def test_queue_release_in_process_hashes_long_names(tmp_path: Path) -> None:
    path = queue_release(str(tmp_path), container_id="y" * 1000, ifname="eth0", now=1.0)
    assert Path(path).name == entry_name(container_id="y" * 1000, ifname="eth0")
    assert parse_entry(Path(path).name, Path(path).read_bytes()).key == OwnerKey("y" * 1000, "eth0")


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """`chattr +i`: not even root can delete or rename the file until it is lifted."""
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def holder(daemon: Any, container_id: str) -> str | None:
    """The address `container_id` holds, if any."""
    return next(
        (
            ip["address"]
            for ip in daemon.ips()
            if (ip["owner"] or {}).get("containerID") == container_id
        ),
        None,
    )


def drain(daemon: Any, *, releasing: str) -> None:
    """SIGHUP, with an entry for `releasing` (which holds an IP) queued: once it is released,
    a whole drain has run."""
    queue_release(str(daemon.state_dir / "release-queue"), container_id=releasing, ifname="eth0")
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_pool(lambda _: holder(daemon, releasing) is None, f"{releasing} released")


def test_an_entry_that_cannot_be_deleted_neither_stops_the_start_nor_releases_a_later_add(
    make_daemon: Any,
) -> None:
    """An immutable entry made the daemon exit at start with a traceback. Now it is applied,
    named once, and never applied to the attachment's later ADD: not while the daemon runs, nor
    after a restart (when the state file's time of that ADD is what tells the two apart)."""
    daemon = make_daemon()
    add(daemon, "c1")
    assert daemon.stop() == 0
    path = Path(queue_release(str(daemon.state_dir / "release-queue"), container_id="c1",
                              ifname="eth0"))  # fmt: skip
    with immutable(path):
        daemon.start()
        assert holder(daemon, "c1") is None  # applied
        add(daemon, "c1")  # the same container and interface, later: a new address
        again = holder(daemon, "c1")
        add(daemon, "c2")
        drain(daemon, releasing="c2")
        assert holder(daemon, "c1") == again
        assert daemon.log().count('"release_queue_entry_not_removed"') == 1
        assert str(path) in daemon.log()
        assert daemon.stop() == 0
        daemon.start()  # the entry is read again, and found older than c1's address
        assert holder(daemon, "c1") == again
        assert '"release_queue_entry_outdated"' in daemon.log()
        assert path.exists()


def test_a_running_daemon_applies_an_undeletable_entry_once(make_daemon: Any) -> None:
    """The entry appears while the daemon runs (a DEL that timed out) and cannot be deleted:
    it used to be applied again every 5 s, each time to whatever the attachment held."""
    daemon = make_daemon()
    add(daemon, "c1")
    add(daemon, "c2")
    path = Path(queue_release(str(daemon.state_dir / "release-queue"), container_id="c1",
                              ifname="eth0"))  # fmt: skip
    with immutable(path):
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_pool(lambda _: holder(daemon, "c1") is None, "c1 released")
        add(daemon, "c1")
        again = holder(daemon, "c1")
        drain(daemon, releasing="c2")
        add(daemon, "c3")
        drain(daemon, releasing="c3")
        assert holder(daemon, "c1") == again
        assert daemon.log().count('"release_queue_entry_not_removed"') == 1


def test_an_entry_queued_before_an_add_of_its_attachment_is_not_applied(
    make_daemon: Any,
) -> None:
    """The plugin stamped a DEL (the daemon did not answer in time), then the runtime ADDed the
    same container and interface again before the next drain: the attachment is alive, and the
    DEL queued before that ADD is not for it. (The file lands after the ADD, so that no drain
    can apply it earlier.)"""
    daemon = make_daemon()
    add(daemon, "c1")
    held = holder(daemon, "c1")
    add(daemon, "c2")
    time.sleep(0.01)
    queued_at = time.time()
    time.sleep(0.01)
    add(daemon, "c1")  # the runtime's ADD after it: answered with the address c1 holds
    queue_release(str(daemon.state_dir / "release-queue"), container_id="c1", ifname="eth0",
                  now=queued_at)  # fmt: skip
    drain(daemon, releasing="c2")
    assert holder(daemon, "c1") == held
    assert '"release_queue_entry_outdated"' in daemon.log()
    assert not list((daemon.state_dir / "release-queue").glob("*.json"))


class CountingIPAM(NodeIPAM):
    """The real node, counting the releases the drain makes."""

    releases_made = 0

    def release(self, key: OwnerKey, reason: str) -> list[Any]:
        self.releases_made += 1
        return super().release(key, reason)


async def test_a_drain_sums_up_bad_files_and_yields_to_the_loop_between_slices(
    tmp_path: Path,
) -> None:
    """2,000 bad files gave 2,000 log lines, and 2,000 entries were applied in one turn of the
    event loop (50,000 of them stalled every request for seconds)."""
    queue = tmp_path / "release-queue"
    for n in range(1000):
        queue_release(str(queue), container_id=f"gone{n}", ifname="eth0")
        (queue / f"bad{n}_eth0.json").write_text("{")
    for n in range(1000):
        (queue / f"other{n}_eth0.json").write_bytes(entry(f"victim{n}"))
    store = Store(tmp_path / "state.db")
    store.open()
    ipam = CountingIPAM(Pool(), store, MemorySource(SourceState(())), Scaler(), 1.0)
    seen: list[int] = []
    draining = asyncio.create_task(ipam.drain_release_queue(queue))
    with structlog.testing.capture_logs() as logs:
        while not draining.done():
            seen.append(ipam.releases_made)
            await asyncio.sleep(0)
        assert await draining == 1000
    store.close()
    steps = [later - earlier for earlier, later in itertools.pairwise(seen)]
    assert max(steps) <= RELEASE_QUEUE_SLICE and ipam.releases_made == 1000
    invalid = [line for line in logs if line["event"] == "release_queue_entries_invalid"]
    assert len(invalid) == 1 and invalid[0]["count"] == 2000
    assert invalid[0]["reasons"] == {"not JSON": 1000, "name mismatch": 1000}
    assert invalid[0]["outcomes"] == {
        "quarantined": MAX_QUARANTINED,
        "deleted (quarantine full)": 1900,
    }
    assert len(invalid[0]["examples"]) == INVALID_ENTRY_EXAMPLES
    assert os.listdir(queue) == ["quarantine"]


def test_a_queue_that_is_not_a_directory_does_not_stop_the_start(make_daemon: Any) -> None:
    """A regular file where the queue directory belongs made the daemon exit at start."""
    daemon = make_daemon(start=False)
    daemon.state_dir.mkdir()
    queue = daemon.state_dir / "release-queue"
    queue.write_text("not a directory")
    daemon.start()
    add(daemon, "c1")
    lines = [json.loads(x) for x in daemon.log().splitlines() if "release_queue_entries" in x]
    line = lines[0]  # one per drain
    assert line["examples"][0]["file"] == str(queue) and "not a readable directory" in str(line)
    assert queue.read_text() == "not a directory"
