"""The release queue: what the plugin writes, and what the daemon accepts from the directory.

The directory is treated as untrusted: nothing in it may block the daemon, make it follow a
symlink, read without bound, or release an attachment other than the one a file's name says.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from cni_plugin.release_queue import NAME_MAX, entry_name, queue_release
from cns import release_queue
from cns.core.types import OwnerKey
from cns.release_queue import MAX_ENTRY_BYTES, MAX_QUARANTINED, BadEntry, collect, parse_entry


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
    assert parse_entry("c1_eth0.json", entry("c1")) == OwnerKey("c1", "eth0")
    long = "x" * 300
    assert parse_entry(entry_name(container_id=long, ifname="eth0"), entry(long)) == OwnerKey(
        long, "eth0"
    )
    for name, data, reason in [
        ("c2_eth0.json", entry("c1"), "does not match"),
        ("c1_eth0.json", b"{not json", "not JSON"),
        ("c1_eth0.json", b"[" * 100_000, "not JSON"),
        ("c1_eth0.json", b"\xff", "not JSON"),
        ("c1_eth0.json", b"[]", "not a JSON object"),
        ("c1_eth0.json", b'{"containerID": 1, "ifName": "eth0"}', "must be strings"),
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
    release_queue.remove(queue, entries)
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
    assert parse_entry(Path(path).name, Path(path).read_bytes()) == OwnerKey("y" * 1000, "eth0")
