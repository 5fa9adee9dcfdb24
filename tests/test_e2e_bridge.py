"""End to end with real third-party code: the reference `bridge` plugin calls `cns-ipam`.

Needs root (network namespaces, a bridge). Under CI these tests must run: a missing privilege
fails them instead of skipping them.
"""

from __future__ import annotations

import json
import math
import os
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
