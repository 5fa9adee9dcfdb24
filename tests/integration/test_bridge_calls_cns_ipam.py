"""End to end with real third-party code: the reference `bridge` plugin calls `cns-ipam`.

Needs root (network namespaces, a bridge). Under CI these tests must run: a missing privilege
fails them instead of skipping them.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.bridge import BridgeNetwork, require_bridge


def formula(demand: int) -> int:
    return 16 * math.ceil(0.5 + demand / 16) - 1


@pytest.fixture
def bridge_net(make_daemon: Any, plugin_dir: Path) -> Iterator[BridgeNetwork]:
    require_bridge()
    daemon = make_daemon({"standalone": {"subnet": "10.240.0.0/22", "allocationLatencyMs": 20}})
    network = BridgeNetwork(daemon, plugin_dir, str(os.getpid() % 10000))
    try:
        yield network
    finally:
        network.cleanup()


@pytest.mark.root
@pytest.mark.slow
def test_150_pods_through_bridge_get_unique_working_ips(bridge_net: BridgeNetwork) -> None:
    daemon = bridge_net.daemon
    seen: dict[str, int] = {}
    results: list[dict[str, Any]] = []
    for n in range(150):
        result = bridge_net.cni("ADD", n)
        assert result.returncode == 0, (result.stdout, result.stderr)
        body = json.loads(result.stdout)
        results.append(body)
        address = body["ips"][0]["address"].split("/")[0]
        gateway = body["ips"][0]["gateway"]
        assert address not in seen, f"{address} given to pod {n} and pod {seen[address]}"
        seen[address] = n
        ping = bridge_net.ping(n, gateway)
        assert ping.returncode == 0, ping.stdout + ping.stderr
        inside = subprocess.run(
            ["ip", "-netns", bridge_net.netns(n), "-4", "-o", "addr", "show", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"{address}/22" in inside
        pool = daemon.wait_pool(lambda p, u=n + 1: p["requestedIPCount"] == formula(u))
        assert pool["demand"] == n + 1

    owners = {ip["owner"]["podName"] for ip in daemon.ips() if ip["owner"]}
    assert owners == {f"pod-{n}" for n in range(150)}

    plain = bridge_net.config
    bridge_net.config = dict(plain, prevResult=results[0])
    result = bridge_net.cni("CHECK", 0)
    assert result.returncode == 0, result.stdout + result.stderr
    bridge_net.config = dict(plain, prevResult=results[1])  # someone else's IP
    result = bridge_net.cni("CHECK", 0)
    assert result.returncode != 0 and json.loads(result.stdout)["code"] == 104
    bridge_net.config = plain

    for n in range(150):
        result = bridge_net.cni("DEL", n)
        assert result.returncode == 0, result.stdout + result.stderr
    assert bridge_net.cni("DEL", 0, netns=False).returncode == 0  # second DEL, no netns
    pool = daemon.wait_pool(lambda p: p["requestedIPCount"] == formula(0))
    assert pool["ips"]["Assigned"] == 0 and pool["demand"] == 0


@pytest.mark.root
def test_del_while_daemon_is_down_is_applied_after_start(bridge_net: BridgeNetwork) -> None:
    daemon = bridge_net.daemon
    for n in range(3):
        assert bridge_net.cni("ADD", n).returncode == 0
    daemon.stop()
    result = bridge_net.cni("DEL", 1)
    assert result.returncode == 0, result.stdout + result.stderr
    queued = list((daemon.state_dir / "release-queue").glob("*.json"))
    assert [p.name for p in queued] == ["e2e-1_eth0.json"]
    daemon.start()
    owners = {ip["owner"]["containerID"] for ip in daemon.ips() if ip["owner"]}
    assert owners == {"e2e-0", "e2e-2"}
    assert not list((daemon.state_dir / "release-queue").glob("*.json"))


@pytest.mark.root
def test_add_with_daemon_down_is_a_clear_cni_error(bridge_net: BridgeNetwork) -> None:
    bridge_net.daemon.stop()
    result = bridge_net.cni("ADD", 7)
    assert result.returncode != 0
    error = json.loads(result.stdout)
    assert error["code"] == 100 and "unreachable" in error["msg"]
    assert "Traceback" not in result.stderr


def _addresses(netns: str, family: str) -> str:
    return subprocess.run(
        ["ip", "-netns", netns, family, "-o", "addr", "show", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.root
def test_dual_stack_pods_through_bridge_get_and_keep_an_ipv4_and_an_ipv6_address(
    make_daemon: Any, plugin_dir: Path
) -> None:
    """Two pods, each one IPv4 and one IPv6 address in one ADD (cns-ipam `subnets`), ping each
    other over both families, and a third asking for a pair of addresses gets those; the
    daemon's restart keeps both addresses of each pod (their CHECK passes, a new pod gets other
    addresses), and a DEL releases both."""
    require_bridge()
    daemon = make_daemon(
        {
            "standalone": {
                "name": "v4pods",
                "subnet": "10.241.0.0/24",
                "allocationLatencyMs": 20,
                "subnets": [{"name": "v6pods", "subnet": "fd00:cafe::/64"}],
            }
        }
    )
    network = BridgeNetwork(daemon, plugin_dir, f"{os.getpid() % 10000}6")
    network.config["ipam"]["subnets"] = ["v4pods", "v6pods"]
    # The bridge plugin, as the gateway, turns IPv6 forwarding on: put it back afterwards.
    forwarding = Path("/proc/sys/net/ipv6/conf/all/forwarding")
    was = forwarding.read_text()
    try:
        results: dict[int, dict[str, Any]] = {}
        for n in (0, 1):
            result = network.cni("ADD", n)
            assert result.returncode == 0, (result.stdout, result.stderr)
            results[n] = json.loads(result.stdout)
            four, six = (ip["address"] for ip in results[n]["ips"])
            assert four.startswith("10.241.0.") and four.endswith("/24")
            assert six.startswith("fd00:cafe::") and six.endswith("/64")
            assert four in _addresses(network.netns(n), "-4")
            assert six in _addresses(network.netns(n), "-6")
        for pinger, target in ((0, 1), (1, 0)):
            for ip in results[target]["ips"]:
                ping = network.ping(pinger, ip["address"].split("/")[0])
                assert ping.returncode == 0, ping.stdout + ping.stderr

        # A pod asking for one address of each family (the `ips` capability, as host-local
        # reads it: with prefixes, in any order) gets exactly those, and works on both.
        free = sorted(ip["address"] for ip in daemon.ips() if ip["state"] == "Available")
        asked = [next(a for a in free if ":" in a), next(a for a in free if "." in a)]
        plain = network.config
        network.config = dict(plain, runtimeConfig={"ips": [f"{asked[0]}/64", f"{asked[1]}/24"]})
        result = network.cni("ADD", 3)
        network.config = plain
        assert result.returncode == 0, (result.stdout, result.stderr)
        got = [ip["address"] for ip in json.loads(result.stdout)["ips"]]
        assert got == [f"{asked[1]}/24", f"{asked[0]}/64"]
        assert got[0] in _addresses(network.netns(3), "-4")
        assert got[1] in _addresses(network.netns(3), "-6")
        for address in asked:
            ping = network.ping(0, address)
            assert ping.returncode == 0, ping.stdout + ping.stderr
        assert network.cni("DEL", 3).returncode == 0

        daemon.stop()
        daemon.start()
        plain = network.config
        for n in (0, 1):
            network.config = dict(plain, prevResult=results[n])
            check = network.cni("CHECK", n)
            assert check.returncode == 0, check.stdout
        network.config = plain
        third = network.cni("ADD", 2)  # gets neither family's address of the two held
        assert third.returncode == 0, third.stdout
        held = {ip["address"] for n in (0, 1) for ip in results[n]["ips"]}
        given = {ip["address"] for ip in json.loads(third.stdout)["ips"]}
        assert len(given) == 2 and not given & held
        assert network.cni("DEL", 2).returncode == 0

        assert network.cni("DEL", 0).returncode == 0
        network.config = dict(plain, prevResult=results[0])
        gone = network.cni("CHECK", 0)
        assert gone.returncode != 0 and json.loads(gone.stdout)["code"] == 3
        network.config = plain
        db = sqlite3.connect(daemon.state_dir / "state.db")
        try:
            rows = db.execute("SELECT container_id, subnet FROM assignments").fetchall()
        finally:
            db.close()
        assert sorted(rows) == [("e2e-1", ""), ("e2e-1", "v6pods")]
    finally:
        network.cleanup()
        forwarding.write_text(was)
