"""Nothing lost, nothing shared (issue 11): one daemon per state directory, no silent fresh start,
a store that refuses a second owner, one request's bad record failing only that request, and
full, read-only or unreadable state directories reported and recovered from without a restart.

The store and NodeIPAM tests call them directly with content the socket API would refuse at the
door: they must be safe on their own. The disk tests use real mounts (tmpfs, a loop-mounted
ext4 image) and real daemon processes; they need root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from cns.config.daemon_config import StandaloneConfig
from cns.core.pool import Assignment, Pool
from cns.core.types import IPConfig, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.node.control_plane import MemorySource, SourceState
from cns.node.errors import IPAMError
from cns.node.service import NodeIPAM
from cns.node.standalone import StandaloneAllocator
from cns.state.store import Rejected, Save, Store
from cns.web.api import http_status
from tests.harness import REPO
from tests.harness.ports import free_port
from tests.harness.requirements import missing_root, require
from tests.integration.test_daemon import add, cns_cli
from tests.unit.node.test_kube_source import kube_source, nnc

SURROGATE = "web-\ud800"  # a lone UTF-16 surrogate: valid in a Python str, not in UTF-8


def require_root() -> None:
    require(missing_root(), " for real mounts")


def network(count: int) -> NetworkContainer:
    return NetworkContainer(
        id="nc1",
        primary_ips=("10.1.0.2",),
        subnet="10.1.0.0/24",
        gateway="10.1.0.1",
        ip_configs=tuple(IPConfig(f"ip-{n}", f"10.1.0.{n}", 1) for n in range(10, 10 + count)),
        version=1,
        programmed_version=1,
    )


def node_with_ips(path: Path, count: int) -> NodeIPAM:
    store = Store(path)
    store.open()
    ipam = NodeIPAM(Pool(), store, MemorySource(), Scaler(batch_size=16), 1.0)
    ipam.on_state(SourceState((network(count),)))
    return ipam


def on_disk(path: Path) -> dict[str, tuple[str, str, str]]:
    """ip_id -> (container, ifname, pod name), read by a second connection."""
    db = sqlite3.connect(path)
    try:
        return {
            ip: (cid, ifname, pod)
            for ip, cid, ifname, pod in db.execute(
                "SELECT ip_id, container_id, ifname, pod_name FROM assignments"
            )
        }
    finally:
        db.close()


def in_memory(ipam: NodeIPAM) -> dict[str, tuple[str, str, str]]:
    return {
        a.ip_id: (a.owner.container_id, a.owner.ifname, a.owner.pod_name)
        for a in ipam.pool.assignments()
    }


# -- the store's uniqueness -------------------------------------------------------------------


async def test_a_save_for_another_owner_is_refused_and_the_owner_may_update_its_pod(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    store = Store(path)
    store.open()
    first = Assignment("ip-1", "10.0.0.1", "nc", Owner("c1", "eth0"))
    await store.commit([Save(first)])
    thief = Assignment("ip-1", "10.0.0.1", "nc", Owner("c9", "eth0", "other", "ns"))
    with pytest.raises(Rejected, match="conflicts with the state file"):
        await store.commit([Save(thief)])
    learnt = Assignment("ip-1", "10.0.0.1", "nc", Owner("c1", "eth0", "web", "shop"))
    await store.commit([Save(learnt)])  # the same owner learns its pod name later
    store.close()
    assert on_disk(path) == {"ip-1": ("c1", "eth0", "web")}


# -- group commit isolation -------------------------------------------------------------------


async def test_a_bad_record_fails_only_its_own_request(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    ipam = node_with_ips(path, 8)
    results = await asyncio.gather(
        ipam.add(Owner("good1", "eth0", "web-1", "shop")),
        ipam.add(Owner("bad", "eth0", SURROGATE, "shop")),
        ipam.add(Owner("good2", "eth0", "web-2", "shop")),
        return_exceptions=True,
    )
    good1, bad, good2 = results
    assert not isinstance(good1, BaseException) and not isinstance(good2, BaseException)
    assert isinstance(bad, IPAMError)
    assert (http_status(bad), bad.code) == (400, 7) and "podName" in bad.msg
    assert ipam.store.failure is None  # one request's content is not a storage failure
    assert in_memory(ipam) == on_disk(path)
    assert {owner for owner, _, _ in on_disk(path).values()} == {"good1", "good2"}
    retried = await ipam.add(Owner("bad", "eth0", "web-3", "shop"))
    assert on_disk(path)[retried.record.id] == ("bad", "eth0", "web-3")
    bad_id = await asyncio.gather(ipam.add(Owner("x\ud800", "eth0")), return_exceptions=True)
    assert isinstance(bad_id[0], IPAMError) and (http_status(bad_id[0]), bad_id[0].code) == (400, 4)
    assert "containerID" in bad_id[0].msg
    assert in_memory(ipam) == on_disk(path)
    ipam.store.close()


async def test_an_add_repeated_before_its_commit_shares_its_fate(tmp_path: Path) -> None:
    """The second ADD of one owner returns the IP the first is still committing: it must not be
    acknowledged when that commit fails; an ADD that brings a good pod name records its own."""
    path = tmp_path / "state.db"
    ipam = node_with_ips(path, 8)
    first, again = await asyncio.gather(
        ipam.add(Owner("c1", "eth0", SURROGATE, "ns")),
        ipam.add(Owner("c1", "eth0")),  # nothing new to record: waits for the first's commit
        return_exceptions=True,
    )
    assert isinstance(first, IPAMError) and isinstance(again, IPAMError)
    assert on_disk(path) == {} and in_memory(ipam) == {}
    first, other = await asyncio.gather(
        ipam.add(Owner("c2", "eth0", SURROGATE, "ns")),
        ipam.add(Owner("c2", "eth0", "web", "ns")),  # another pod for this owner: refused
        return_exceptions=True,
    )
    assert isinstance(first, IPAMError) and isinstance(other, IPAMError)
    assert (http_status(other), other.code) == (409, 4)
    assert on_disk(path) == {} == in_memory(ipam)  # the refused record was undone
    fixed = await ipam.add(Owner("c2", "eth0", "web", "ns"))
    assert on_disk(path) == {fixed.record.id: ("c2", "eth0", "web")} == in_memory(ipam)
    # A refused pod name learnt later leaves the owner its durable IP, and it is still served.
    with pytest.raises(IPAMError):
        await ipam.add(Owner("c2", "eth0", SURROGATE, "ns"))
    assert in_memory(ipam) == {fixed.record.id: ("c2", "eth0", "web")}
    assert (await ipam.add(Owner("c2", "eth0"))).record.id == fixed.record.id
    ipam.store.close()


async def test_a_del_and_an_add_reusing_its_ip_in_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    ipam = node_with_ips(path, 1)
    held = await ipam.add(Owner("a", "eth0"))
    released, taken = await asyncio.gather(
        ipam.delete(OwnerKey("a", "eth0")),
        ipam.add(Owner("b", "eth0", SURROGATE, "ns")),  # gets the IP the DEL just freed
        return_exceptions=True,
    )
    assert not isinstance(released, BaseException) and released is not None
    assert released.id == held.record.id
    assert isinstance(taken, IPAMError) and http_status(taken) == 400
    assert on_disk(path) == {} == in_memory(ipam)
    assert ipam.pool.available_count() == 1
    assert (await ipam.add(Owner("c", "eth0"))).record.id == held.record.id
    ipam.store.close()


# -- one daemon per state directory -----------------------------------------------------------


def test_a_second_daemon_on_the_same_state_dir_is_refused_naming_the_holder(
    make_daemon: Any,
) -> None:
    daemon = make_daemon()
    assert add(daemon, 1)[0] == 200
    assert daemon.proc is not None
    holder = daemon.proc.pid
    # Frozen, the first daemon touches nothing itself: whatever changes would be the second's.
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        queue = daemon.state_dir / "release-queue"
        queue.mkdir(exist_ok=True)
        (queue / "c1_eth0.json").write_text(
            json.dumps({"containerID": "c1", "ifName": "eth0", "queuedAt": time.time()})
        )
        before = {
            p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in daemon.state_dir.rglob("*")
        }
        elsewhere = ("--socket", str(daemon.workdir / "other.sock"))
        elsewhere += ("--debug-listen", f"127.0.0.1:{free_port()}")
        second = cns_cli("run", "--config", str(daemon.config_path), *elsewhere)
        after = {
            p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in daemon.state_dir.rglob("*")
        }
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert second.returncode == 1, second.stderr
    assert f"state directory {daemon.state_dir} is in use by pid {holder}" in second.stderr
    assert "Traceback" not in second.stderr
    assert after == before
    assert not (daemon.workdir / "other.sock").exists()
    assert daemon.pool()["ips"]["Assigned"] == 1  # the first still serves, c1 still assigned
    assert add(daemon, 2)[0] == 200


def test_a_lock_file_left_by_a_dead_daemon_does_not_block(make_daemon: Any) -> None:
    daemon = make_daemon()
    address = add(daemon, 1)[1]["ips"][0]["address"]
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait()
    daemon.proc = None
    assert "pid" in (daemon.state_dir / "cns.lock").read_text()
    daemon.start()
    assert add(daemon, 1)[1]["ips"][0]["address"] == address


# -- never start empty where state existed ----------------------------------------------------


def used_state_dir(make_daemon: Any) -> Any:
    """A daemon that assigned an address and stopped: its state directory is a used one."""
    daemon = make_daemon()
    assert add(daemon, 1)[0] == 200
    assert daemon.stop() == 0
    return daemon


@pytest.mark.parametrize(
    ("damage", "evidence"),
    [
        ("truncate", "is empty (0 bytes)"),
        ("delete-keep-wal", "is missing, but state.db-wal shows"),
        ("delete", "is missing, but standalone-allocator.json shows"),
    ],
)
def test_lost_state_is_refused_and_reset_only_on_request(
    make_daemon: Any, damage: str, evidence: str
) -> None:
    daemon = used_state_dir(make_daemon)
    state = daemon.state_dir / "state.db"
    if damage == "truncate":
        state.write_bytes(b"")
    elif damage == "delete-keep-wal":
        state.with_name("state.db-wal").write_bytes(b"\0" * 32)
        state.unlink()
    else:
        state.unlink()
    refused = cns_cli("run", "--config", str(daemon.config_path))
    assert refused.returncode == 1
    assert f"state file {state} {evidence}" in refused.stderr, refused.stderr
    assert "--reset-state" in refused.stderr and "Traceback" not in refused.stderr
    if damage == "truncate":
        assert state.read_bytes() == b""  # evidence is never touched

    present = sorted(p.name for p in daemon.state_dir.glob("state.db*"))
    allocator = daemon.state_dir / "standalone-allocator.json"
    grant = json.loads(allocator.read_text())["networkContainer"]["id"]
    daemon.start(extra_args=("--reset-state",))
    assert daemon.pool()["ips"]["Assigned"] == 0
    kept = sorted(p.name for p in daemon.state_dir.glob("state.db*.reset-*"))
    assert [name.partition(".reset-")[0] for name in kept] == present
    reset = [json.loads(line) for line in daemon.log().splitlines() if '"state_reset"' in line]
    assert reset[0]["level"] == "warning"
    assert sorted(Path(p).name for p in reset[0]["moved"]) == kept
    # The allocator's file stands for the control plane: a node reset leaves it alone.
    assert json.loads(allocator.read_text())["networkContainer"]["id"] == grant


@pytest.mark.parametrize("reset", [(), ("--reset-state",)])
def test_an_empty_allocator_file_is_refused_naming_it(
    make_daemon: Any, reset: tuple[str, ...]
) -> None:
    """The allocator's file stands for the control plane: a reset does not touch it either."""
    daemon = used_state_dir(make_daemon)
    allocator = daemon.state_dir / "standalone-allocator.json"
    allocator.write_bytes(b"")
    refused = cns_cli("run", "--config", str(daemon.config_path), *reset)
    assert refused.returncode == 1
    assert f"standalone allocator state {allocator} is unreadable" in refused.stderr
    assert allocator.read_bytes() == b""
    assert (daemon.state_dir / "state.db").exists()  # no reset happened on the way


@pytest.mark.parametrize("content", ["{}", "[]", "not JSON", "a directory"])
def test_a_kube_snapshot_without_state_is_refused(make_daemon: Any, content: str) -> None:
    """Whatever it holds: a snapshot that cannot be used (and would be ignored by a node that
    has its state) is still the trace of a node that handed out addresses."""
    daemon = make_daemon(start=False)
    daemon.state_dir.mkdir()
    snapshot = daemon.state_dir / "kube-snapshot.json"
    if content == "a directory":
        snapshot.mkdir()
    else:
        snapshot.write_text(content)
    refused = cns_cli("run", "--config", str(daemon.config_path))
    assert refused.returncode == 1 and "kube-snapshot.json shows" in refused.stderr


def test_a_fresh_node_with_queued_dels_starts(make_daemon: Any) -> None:
    """The plugin queues a DEL whenever the daemon is down, also before its first start."""
    daemon = make_daemon(start=False)
    queue = daemon.state_dir / "release-queue"
    queue.mkdir(parents=True)
    (queue / "c1_eth0.json").write_text(
        json.dumps({"containerID": "c1", "ifName": "eth0", "queuedAt": time.time()})
    )
    daemon.start()
    assert not (queue / "c1_eth0.json").exists()
    assert not (queue / "quarantine").exists()  # applied, not refused
    assert (daemon.state_dir / "state.db").stat().st_size > 0


# -- failing disks ----------------------------------------------------------------------------


class Mounts:
    """Real file systems for state directories; all unmounted at the end, whatever happened."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.mounted: list[Path] = []
        self.loops: list[str] = []

    def new_tmpfs(self, name: str, size: str) -> Path:
        where = self.scratch / name
        self.tmpfs(where, size)
        return where

    def tmpfs(self, where: Path, size: str) -> None:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            check=True,
        )
        self.mounted.append(where)

    def ext4(self, where: Path, size_mb: int) -> Path:
        """An ext4 image on a loop device that turns read-only on errors, as /var often does."""
        image = self.scratch / f"{where.name}.ext4"
        with image.open("wb") as f:
            f.truncate(size_mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        self.mount_image(image, where)
        return image

    def mount_image(self, image: Path, where: Path) -> None:
        """On a loop device of its own: `mount -o loop` would reuse one still attached, and with
        it a file system a lazy unmount left alive (and read-only)."""
        loop = subprocess.run(
            ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
        ).stdout.strip()
        self.loops.append(loop)
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-o", "errors=remount-ro", loop, str(where)], check=True)
        self.mounted.append(where)

    def unmount(self, where: Path) -> None:
        """Lazily: a daemon may still hold files there."""
        subprocess.run(["umount", "-l", str(where)], check=True)
        self.mounted.remove(where)

    def cleanup(self) -> None:
        for where in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(where)], check=False)
        for loop in self.loops:  # a loop device still in use detaches when it is released
            subprocess.run(["losetup", "-d", loop], check=False)
        self.mounted.clear()
        self.loops.clear()


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Mounts]:
    """Request it before make_daemon: it is torn down after the daemons are killed."""
    require_root()
    scratch = tmp_path / "mounts"
    scratch.mkdir()
    found = Mounts(scratch)
    try:
        yield found
    finally:
        found.cleanup()


class Filler:
    """Keeps a file system full: whatever SQLite frees (it checkpoints and drops its WAL when
    it reopens the file) is taken again at once. `free` removes the file and the space is back."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"
        self.stop = threading.Event()
        self.file = self.path.open("wb", buffering=0)
        self._top_up()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _top_up(self) -> None:
        for chunk in (1 << 20, 1 << 12, 1 << 9):
            with contextlib.suppress(OSError):
                while True:
                    self.file.write(b"\xff" * chunk)

    def _run(self) -> None:
        while not self.stop.wait(0.002):
            self._top_up()

    def free(self) -> None:
        self.stop.set()
        self.thread.join()
        self.file.close()
        self.path.unlink()


def status_of(daemon: Any, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"{daemon.debug_url}{path}", timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def wait_for(predicate: Any, what: str, timeout: float = 20) -> Any:
    """Poll until `predicate` returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)
    return value


def metric(daemon: Any, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(daemon.get("/metrics")):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


class Stream:
    """ADDs from a few threads until stopped; keeps every reply (acknowledged ones count)."""

    def __init__(self, daemon: Any, threads: int = 3) -> None:
        self.daemon = daemon
        self.acknowledged: dict[str, str] = {}
        self.replies: list[tuple[int, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            container = f"s{worker}-{n}"
            n += 1
            status, body = self.daemon.call(
                "POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"}
            )
            with self.lock:
                self.replies.append((status, body))
                if status == 200:
                    self.acknowledged[container] = body["ips"][0]["address"]
            time.sleep(0.02)

    def count(self, predicate: Any) -> int:
        with self.lock:
            return sum(1 for status, body in self.replies if predicate(status, body))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def assert_nothing_acknowledged_was_lost(daemon: Any, acknowledged: dict[str, str]) -> None:
    """kill -9, start again, and every acknowledged ADD still holds its address."""
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait()
    daemon.proc = None
    daemon.start()
    held = {ip["owner"]["containerID"]: ip["address"] for ip in daemon.ips() if ip["owner"]}
    for container, address in acknowledged.items():
        assert held.get(container) == address.split("/")[0], f"{container} lost {address}"


def test_a_full_disk_fails_adds_naming_enospc_and_recovers_without_restart(
    mounts: Mounts, make_daemon: Any
) -> None:
    # A batch of 256: while the disk is full the pool cannot grow (the standalone allocator
    # saves to the same disk), and the few commits that slip into space SQLite freed for a
    # moment must not empty it, or ADDs wait for IPs (code 11) instead of reaching a commit.
    daemon = make_daemon({"addTimeoutSeconds": 2, "scaler": {"batchSize": 256}}, start=False)
    mounts.tmpfs(daemon.state_dir, "8m")
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    stream = Stream(daemon)
    try:
        wait_for(lambda: len(stream.acknowledged) >= 5, "ADDs before the disk fills")
        filler = Filler(daemon.state_dir)
        wait_for(lambda: stream.count(lambda s, b: s == 503 and b["code"] == 5) >= 10, "code 5")
        health = wait_for(
            lambda: (reply := status_of(daemon, "/healthz"))[0] == 503 and reply[1], "/healthz 503"
        )
        assert health == {
            "ok": False,
            "reason": f"cannot commit state to {daemon.state_dir / 'state.db'}: ENOSPC (No space "
            "left on device)",
        }
        wait_for(lambda: metric(daemon, "cns_state_storage_ok") == 0, "storage gauge 0")
    finally:
        stream.finish()
    # No traffic now: the storage probe alone must notice that space is back.
    filler.free()
    wait_for(lambda: status_of(daemon, "/healthz") == (200, {"ok": True}), "/healthz 200 again")
    assert metric(daemon, "cns_state_storage_ok") == 1
    acknowledged = dict(stream.acknowledged)
    for n in range(10):
        status, body = add(daemon, 1000 + n)
        assert status == 200, body
        acknowledged[f"c{1000 + n}"] = body["ips"][0]["address"]
    assert daemon.proc.pid == pid and daemon.proc.poll() is None  # it never exited
    failed = [body for status, body in stream.replies if status != 200]
    assert {body["code"] for body in failed} <= {5, 11}, failed
    assert next(body for body in failed if body["code"] == 5)["msg"] == health["reason"]
    assert metric(daemon, "cns_state_commit_failures_total", cause="ENOSPC") >= 1
    log = daemon.log()
    assert '"state_commit_failed"' in log and '"state_storage_recovered"' in log
    assert_nothing_acknowledged_was_lost(daemon, acknowledged)


async def test_a_del_that_cannot_be_committed_keeps_the_ip(mounts: Mounts, tmp_path: Path) -> None:
    where = mounts.new_tmpfs("state", "4m")
    ipam = node_with_ips(where / "state.db", 4)
    key = OwnerKey("a", "eth0")
    held = await ipam.add(Owner("a", "eth0"))
    filler = Filler(where)
    try:
        with pytest.raises(IPAMError) as failed:
            await ipam.delete(key)
        assert (http_status(failed.value), failed.value.code) == (503, 5)
        assert "ENOSPC" in failed.value.msg
        record = ipam.pool.lookup(key)  # the release was undone: the pod still has its address
        assert record is not None and record.id == held.record.id
        assert in_memory(ipam) == {held.record.id: ("a", "eth0", "")}
        assert ipam.status() == (False, str(ipam.store.failure))
    finally:
        filler.free()
    await ipam.store.probe()
    assert ipam.store.failure is None
    released = await ipam.delete(key)
    assert released is not None and released.id == held.record.id
    assert on_disk(where / "state.db") == {} == in_memory(ipam)
    ipam.store.close()


async def test_the_allocator_grants_nothing_it_could_not_write(
    mounts: Mounts, tmp_path: Path
) -> None:
    where = mounts.new_tmpfs("allocator", "1m")
    path = where / "standalone-allocator.json"
    config = StandaloneConfig(subnet="10.5.0.0/24", allocation_latency_ms=0)
    allocator = StandaloneAllocator(config, path, scaler=Scaler())
    allocator.load()
    states: list[SourceState] = []
    task = asyncio.create_task(allocator.run(states.append))
    try:
        await asyncio.sleep(0.05)
        filler = Filler(where)
        try:
            await allocator.publish(PoolRequest(15))
            await asyncio.sleep(0.5)
            assert not task.done()  # a failed save never ends the allocator (nor the daemon)
            assert len(states) == 1 and allocator.grant.nc.ip_configs == ()
            assert json.loads(path.read_text())["networkContainer"]["ipConfigs"] == []
        finally:
            filler.free()
        for _ in range(100):  # retried by itself once the file can be written
            if len(states) == 2:
                break
            await asyncio.sleep(0.05)
        granted = [c.address for c in states[-1].containers[0].ip_configs]
        assert len(granted) == 15
        on_file = json.loads(path.read_text())["networkContainer"]["ipConfigs"]
        assert [c["address"] for c in on_file] == granted
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class RecordingCustomObjects:
    """Stands in for the API server's NNC patch endpoint; records what reached it."""

    def __init__(self) -> None:
        self.patches: list[Any] = []

    async def patch_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.patches.append(args[5])
        return nnc("11", requested=args[5]["spec"]["requestedIPCount"], nc_version=2)


async def test_a_kube_snapshot_that_cannot_be_written_blocks_only_the_publish(
    mounts: Mounts, tmp_path: Path
) -> None:
    where = mounts.new_tmpfs("kube", "1m")
    snapshot = where / "kube-snapshot.json"
    async with client.ApiClient() as api:
        source = kube_source(api, snapshot_path=snapshot)
        api_server = RecordingCustomObjects()
        source.kube.custom = api_server  # type: ignore[assignment]
        delivered: list[SourceState] = []
        source._listener = delivered.append
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        for collection in source._collections:
            collection.synced.set()
        filler = Filler(where)
        try:
            source._changed()  # the watch's callback: logs, never raises into the watch
            assert len(delivered) == 1 and not snapshot.exists()
            with pytest.raises(RuntimeError, match=r"not published.*ENOSPC"):
                await source.publish(PoolRequest(31))
            assert api_server.patches == []  # write-ahead: nothing published without the file
        finally:
            filler.free()
        await source.publish(PoolRequest(31))
        assert [patch["spec"]["requestedIPCount"] for patch in api_server.patches] == [31]
        written = json.loads(snapshot.read_text())
        assert written["nodenetworkconfig"]["spec"]["requestedIPCount"] == 31


def trigger_fs_error(mountpoint: Path) -> None:
    """ext4's own test hook: the kernel records an error, aborts the journal and remounts the
    file system read-only at once, files open for writing or not (a plain `mount -o
    remount,ro` is refused while the daemon has its files open)."""
    device = subprocess.run(
        ["findmnt", "-no", "SOURCE", str(mountpoint)], capture_output=True, text=True, check=True
    ).stdout.strip()
    Path(f"/sys/fs/ext4/{Path(device).name}/trigger_fs_error").write_text("cns test\n")


def test_a_read_only_state_dir_fails_adds_naming_erofs_and_recovers_after_repair(
    mounts: Mounts, make_daemon: Any
) -> None:
    daemon = make_daemon(start=False)
    image = mounts.ext4(daemon.state_dir, 32)
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    acknowledged = {}
    for n in range(5):
        status, body = add(daemon, n)
        assert status == 200, body
        acknowledged[f"c{n}"] = body["ips"][0]["address"]
    trigger_fs_error(daemon.state_dir)
    status, body = add(daemon, 100)
    expected = (
        f"cannot commit state to {daemon.state_dir / 'state.db'}: EROFS (Read-only file system)"
    )
    assert (status, body["code"], body["msg"]) == (503, 5, expected)
    assert status_of(daemon, "/healthz") == (503, {"ok": False, "reason": expected})
    assert add(daemon, 0)[1]["ips"][0]["address"] == acknowledged["c0"]  # reads still work
    # The operator's repair: unmount, fsck, mount again. The daemon reopens the file itself.
    mounts.unmount(daemon.state_dir)
    fsck = subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True, text=True)
    assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr  # 1: errors corrected
    mounts.mount_image(image, daemon.state_dir)
    wait_for(lambda: status_of(daemon, "/healthz") == (200, {"ok": True}), "/healthz 200 again")
    for n in range(100, 105):
        status, body = add(daemon, n)
        assert status == 200, body
        acknowledged[f"c{n}"] = body["ips"][0]["address"]
    assert daemon.proc.pid == pid and daemon.proc.poll() is None  # it never exited
    assert metric(daemon, "cns_state_commit_failures_total", cause="EROFS") >= 1
    assert_nothing_acknowledged_was_lost(daemon, acknowledged)


def test_start_up_tells_a_read_only_state_dir_from_a_corrupt_one(
    mounts: Mounts, make_daemon: Any
) -> None:
    daemon = make_daemon(start=False)
    mounts.tmpfs(daemon.state_dir, "4m")
    daemon.start()
    assert add(daemon, 1)[0] == 200
    assert daemon.stop() == 0
    subprocess.run(["mount", "-o", "remount,ro", str(daemon.state_dir)], check=True)
    refused = cns_cli("run", "--config", str(daemon.config_path))
    assert refused.returncode == 1
    assert f"cannot lock state directory {daemon.state_dir}" in refused.stderr
    assert "EROFS (Read-only file system)" in refused.stderr
    assert "corrupt" not in refused.stderr and "Traceback" not in refused.stderr


def test_start_up_tells_an_unreadable_state_file_from_a_corrupt_one(make_daemon: Any) -> None:
    """EACCES for real: root without CAP_DAC_OVERRIDE meets a state file it does not own."""
    require_root()
    daemon = used_state_dir(make_daemon)
    state = daemon.state_dir / "state.db"
    os.chown(state, 65534, 65534)
    state.chmod(0o600)
    no_dac = "-dac_override,-dac_read_search"
    refused = subprocess.run(
        [
            *("setpriv", f"--bounding-set={no_dac}", f"--inh-caps={no_dac}", "--"),
            *(sys.executable, "-m", "cns.commands.cli", "run", "--config", str(daemon.config_path)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert refused.returncode == 1
    assert (
        f"state file {state} cannot be opened for reading and writing: EACCES (Permission denied)"
        in refused.stderr
    ), refused.stderr
    assert "not corruption" in refused.stderr and "Traceback" not in refused.stderr
    os.chown(state, 0, 0)
    daemon.start()  # once the permissions are right, it starts with its assignments
    assert daemon.pool()["ips"]["Assigned"] == 1
