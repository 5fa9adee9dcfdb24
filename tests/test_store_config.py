"""Durable state and configuration validation."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import cns.state.store
from cns.config.daemon_config import ConfigError, StandaloneSubnet, load, parse, with_overrides
from cns.core.pool import Assignment
from cns.core.subnet import Subnet
from cns.core.types import Owner, Scaler
from cns.state.store import Forget, Rejected, Save, StateError, Store

REPO = Path(__file__).resolve().parent.parent


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


def test_shipped_config_is_valid() -> None:
    config = load(REPO / "config" / "cns.yaml")
    # `cns install --systemd` writes it on every node: each must keep its own name.
    assert config.node_name == socket.gethostname()
    assert config.scaler == Scaler(16, 50, 150, 250)
    assert config.standalone.subnet == "10.240.0.0/22"
    assert config.debug_host_port == ("127.0.0.1", 10090)


def test_defaults_when_empty() -> None:
    config = parse({}, "x.yaml")
    assert config.socket_path == Path("/run/cns/cns.sock")
    standalone = config.standalone
    assert Subnet("s", standalone.subnet, standalone.gateway).gateway_address == "10.240.0.1"
    assert (config.coalescing.quiet_seconds, config.coalescing.max_delay_seconds) == (0.1, 1.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"bogus": 1}, "unknown key.*bogus"),
        ({"scaler": {"batchSize": 0}}, "scaler.batchSize"),
        ({"scaler": {"batchSize": "16"}}, "scaler.batchSize: must be an integer"),
        ({"scaler": {"releaseThresholdPercnt": 150}}, "scaler.releaseThresholdPercnt"),
        ({"scaler": {"requestThresholdPercent": 80}}, "releaseThresholdPercent must be >="),
        ({"standalone": {"subnet": "10.0.0.0/33"}}, "standalone.subnet"),
        ({"standalone": {"gateway": "192.168.1.1"}}, "standalone.gateway: .* not in subnet"),
        (
            {"standalone": {"gateway": "10.240.0.0"}},
            "standalone.gateway: 10.240.0.0 is the network address of 10.240.0.0/22, not a host",
        ),
        (
            {"standalone": {"gateway": "10.240.3.255"}},
            "standalone.gateway: 10.240.3.255 is the broadcast address of 10.240.0.0/22",
        ),
        (
            {
                "standalone": {
                    "subnets": [{"name": "v6", "subnet": "fd00::/64", "gateway": "fd00::"}]
                }
            },
            r"subnets\[0\].gateway: fd00:: is the network address of fd00::/64",
        ),
        ({"standalone": {"exhaustion": {"lowerPercent": 95}}}, "exhaustion.lowerPercent"),
        ({"standalone": {"subnets": {"name": "v6"}}}, "standalone.subnets: must be a list"),
        ({"standalone": {"subnets": [{"subnet": "fd00::/64"}]}}, r"standalone.subnets\[0\].name"),
        (
            {"standalone": {"subnets": [{"name": "a b", "subnet": "fd00::/64"}]}},
            r"standalone.subnets\[0\].name: 'a b' must start",
        ),
        (
            {"standalone": {"subnets": [{"name": "standalone", "subnet": "fd00::/64"}]}},
            r"subnets\[0\].name: 'standalone' is the name of another subnet",
        ),
        (
            {"standalone": {"subnets": [{"name": "v6", "subnet": "10.240.1.0/24"}]}},
            r"subnets\[0\].subnet: 10.240.1.0/24 overlaps 10.240.0.0/22",
        ),
        (
            {"standalone": {"subnets": [{"name": "v6", "subnet": "fd00::/64", "gw": "x"}]}},
            r"unknown key\(s\): standalone.subnets\[0\].gw",
        ),
        (
            {
                "standalone": {
                    "subnets": [{"name": "v6", "subnet": "fd00::/64", "gateway": "fd01::1"}]
                }
            },
            r"subnets\[0\].gateway: fd01::1 is not in subnet",
        ),
        ({"mode": "magic"}, "mode: must be one of"),
        ({"kubernetes": {"watchTimeoutSeconds": 1}}, "kubernetes.watchTimeoutSeconds"),
        ({"kubernetes": {"subnet": "x"}}, "kubernetes.subnet"),
        ({"debugListen": "nowhere"}, "debugListen"),
        ({"addTimeoutSeconds": -1}, "addTimeoutSeconds"),
        ({"requestCoalescing": {"quietSeconds": -1}}, "requestCoalescing.quietSeconds"),
        (
            {"requestCoalescing": {"quietSeconds": 2, "maxDelaySeconds": 1}},
            "requestCoalescing.maxDelaySeconds: 1 is shorter than quietSeconds",
        ),
        ({"requestCoalescing": {"quietSecs": 1}}, "requestCoalescing.quietSecs"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_config_names_the_key(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(data, "cns.yaml")


def test_standalone_further_subnets_are_read_ipv4_and_ipv6() -> None:
    standalone = parse(
        {
            "standalone": {
                "name": "v4pods",
                "subnets": [
                    {"name": "v6pods", "subnet": "fd00:10:240::/64", "primaryIPCount": 0},
                    {"name": "more", "subnet": "10.241.0.0/24", "gateway": "10.241.0.254"},
                ],
            }
        },
        "t",
    ).standalone
    assert standalone.primary == StandaloneSubnet(
        name="v4pods", subnet="10.240.0.0/22", gateway="", primary_ip_count=1
    )
    assert standalone.subnets == (
        StandaloneSubnet(name="v6pods", subnet="fd00:10:240::/64", primary_ip_count=0),
        StandaloneSubnet(name="more", subnet="10.241.0.0/24", gateway="10.241.0.254"),
    )


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scaler: [unclosed")
    with pytest.raises(ConfigError, match=str(path)):
        load(path)


def test_flags_override_the_file() -> None:
    config = with_overrides(
        parse({}, "x"), socket_path="/tmp/s.sock", state_dir="/tmp/st", debug_listen="127.0.0.1:1"
    )
    assert str(config.socket_path) == "/tmp/s.sock"
    assert str(config.state_dir) == "/tmp/st"
    assert config.debug_listen == "127.0.0.1:1"
    with pytest.raises(ConfigError, match="--debug-listen"):
        with_overrides(config, debug_listen="bad")


def test_leak_reclaim_asks_containerd_in_kubernetes_mode_and_nothing_standalone() -> None:
    assert parse({}, "t").leak_reclaim.cri_socket == ""
    kube = parse({"mode": "kubernetes"}, "t").leak_reclaim
    assert (kube.cri_socket, kube.check_seconds, kube.grace_seconds) == (
        "/run/containerd/containerd.sock",
        60.0,
        300.0,
    )
    off = parse({"mode": "kubernetes", "leakReclaim": {"criSocket": ""}}, "t")
    assert off.leak_reclaim.cri_socket == ""
    crio = parse({"leakReclaim": {"criSocket": "unix:///var/run/crio/crio.sock"}}, "t")
    assert crio.leak_reclaim.cri_socket == "/var/run/crio/crio.sock"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"criSocket": "run/containerd.sock"}, "leakReclaim.criSocket: must be an absolute path"),
        ({"graceSeconds": 0}, "leakReclaim.graceSeconds"),
        ({"checkSeconds": "often"}, "leakReclaim.checkSeconds"),
        ({"gracePeriod": 5}, "leakReclaim.gracePeriod"),
    ],
)
def test_leak_reclaim_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"leakReclaim": section}, "t")


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


def test_a_gateway_that_is_the_network_address_stops_cns_run_naming_the_field(
    make_daemon: Any,
) -> None:
    """Pods would be told to route through the subnet's network address, which no host owns."""
    gateway = {"standalone": {"subnet": "10.240.8.0/24", "gateway": "10.240.8.0"}}
    daemon = make_daemon(gateway, start=False)
    daemon.start(wait=False)
    assert daemon.proc.wait(timeout=30) == 2
    assert (
        "standalone.gateway: 10.240.8.0 is the network address of 10.240.8.0/24, not a host "
        "address" in daemon.log()
    )
    assert not (daemon.state_dir / "state.db").exists()
