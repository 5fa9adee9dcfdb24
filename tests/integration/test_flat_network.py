"""The flat-network mode for real (issue 27 item 1): two nodes, each a network namespace with its
own cns daemon, on one bridge (tests/harness/flat_lan.py), pods taking addresses of the LAN's own
subnet, and a third machine on the LAN that only watches and pings.

The nodes' pod ranges are disjoint parts of the LAN 10.123.0.0/24 (fd00:123::/64): node 1 hands
out 10.123.0.64/27 and fd00:123::40/122, node 2 10.123.0.96/27 and fd00:123::80/122; their uplinks
hold 10.123.0.11 and .12, the watcher .13. Nothing leaves the test's namespaces.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.bridge import require_bridge
from tests.harness.daemon import unix_request
from tests.harness.flat_lan import FlatLan, LanNode, cni, wait_served
from tests.harness.host import MACHINE_SYSCTLS, named_netns
from tests.harness.systemd_node import wait_for

RANGES = {
    "n1": ("10.123.0.64/27", "fd00:123::40/122"),
    "n2": ("10.123.0.96/27", "fd00:123::80/122"),
}
STALE, FOREIGN = ("10.123.0.90", "fd00:123::7f"), ("10.123.0.200", "fd00:123::1:5")


def node_config(v4: str, v6: str, **flat: Any) -> dict[str, Any]:
    return {
        "flatNetwork": {"enabled": True, **flat},
        "ipCooldownSeconds": 0,
        "reconcileIntervalSeconds": 300,  # the entries follow releases, not the clock
        "standalone": {
            "subnet": v4,
            "allocationLatencyMs": 0,
            "subnets": [{"name": "v6", "subnet": v6}],
        },
    }


class Lan:
    """The LAN with nodes n1, n2 and the watcher n3, and the plugin configurations."""

    def __init__(self, lan: FlatLan, plugin_dir: Path, workdir: Path) -> None:
        self.lan = lan
        self.plugin_dir = plugin_dir
        self.workdir = workdir
        self.n1 = lan.node("n1", "10.123.0.11", "fd00:123::11")
        self.n2 = lan.node("n2", "10.123.0.12", "fd00:123::12")
        self.n3 = lan.node("n3", "10.123.0.13", "fd00:123::13")
        self.netns: dict[str, str] = {}  # container -> its netns path

    def start(self, node: LanNode, config: dict[str, Any]) -> None:
        self.lan.daemon(node, self.workdir / node.netns, config)

    def conf(self, node: LanNode, plugin: str, subnets: list[str]) -> dict[str, Any]:
        assert node.daemon is not None
        daemon = node.daemon
        plugged = {"socket": str(daemon.socket), "subnets": subnets,
                   "releaseQueueDir": str(daemon.state_dir / "release-queue")}  # fmt: skip
        if plugin == "cns-cni":
            return {"type": "cns-cni", **plugged}
        return {"type": "ptp", "ipam": {"type": "cns-ipam", **plugged}}

    def add(self, node: LanNode, pod: str, plugin: str = "cns-cni", args: str = "") -> list[str]:
        """ADD pod `pod` on `node` (dual-stack with cns-cni, IPv4 with ptp); its addresses."""
        self.netns[pod] = self.netns.get(pod) or self.lan.pod(node, pod)
        subnets = ["standalone", "v6"] if plugin == "cns-cni" else ["standalone"]
        done = cni(self.plugin_dir, node, self.conf(node, plugin, subnets), "ADD", pod,
                   self.netns[pod], args=args)  # fmt: skip
        assert done.returncode == 0, f"ADD {pod}: {done.stdout}{done.stderr}"
        return [ip["address"].split("/")[0] for ip in json.loads(done.stdout)["ips"]]

    def delete(self, node: LanNode, pod: str, plugin: str = "cns-cni") -> None:
        subnets = ["standalone", "v6"] if plugin == "cns-cni" else ["standalone"]
        conf = self.conf(node, plugin, subnets)
        done = cni(self.plugin_dir, node, conf, "DEL", pod, self.netns[pod])
        assert done.returncode == 0, f"DEL {pod}: {done.stdout}{done.stderr}"

    def ping(self, pod: str, address: str) -> subprocess.CompletedProcess[str]:
        netns = Path(self.netns[pod]).name
        return subprocess.run(["ip", "netns", "exec", netns, "ping", "-c1", "-W3", address],
                              capture_output=True, text=True)  # fmt: skip


@pytest.fixture
def lan(plugin_dir: Path, tmp_path: Path) -> Iterator[Lan]:
    require_bridge()
    machine = {path: path.read_text() for path in MACHINE_SYSCTLS}
    flat = FlatLan(f"fn{uuid.uuid4().hex[:6]}")
    try:
        yield Lan(flat, plugin_dir, tmp_path)
    finally:
        flat.cleanup()
    assert {path: path.read_text() for path in MACHINE_SYSCTLS} == machine
    assert not [name for name in named_netns() if name.startswith(flat.tag)]


def reaches(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0, f"{what}: {result.stdout}{result.stderr}"


@pytest.mark.root
def test_pods_on_two_nodes_reach_each_other_and_the_other_node_and_release_drops_the_entry(
    lan: Lan,
) -> None:
    lan.start(lan.n1, node_config(*RANGES["n1"]))
    lan.start(lan.n2, node_config(*RANGES["n2"]))
    a = lan.add(lan.n1, "a")
    b = lan.add(lan.n2, "b")
    p = lan.add(lan.n1, "p", plugin="ptp")  # the IPAM-only plugin: ptp builds the interface
    q = lan.add(lan.n2, "q", plugin="ptp")
    # Each node answers for exactly its own pods' addresses.
    assert lan.n1.proxied() == {*a, *p}
    assert lan.n2.proxied() == {*b, *q}

    for source, targets in (
        ("a", [*b, *q, lan.n2.v4, lan.n2.v6, lan.n3.v4, lan.n3.v6]),
        ("b", [*a, *p, lan.n1.v4, lan.n1.v6]),
        ("p", [*q, b[0], lan.n2.v4]),
        ("q", [*p, a[0], lan.n1.v4]),
    ):
        for target in targets:
            reaches(lan.ping(source, target), f"{source} -> {target}")
    for address in [*a, *b, *p, *q]:  # another machine on the LAN reaches every pod
        reaches(lan.n3.run("ping", "-c1", "-W3", address), f"watcher -> {address}")

    lan.delete(lan.n1, "a")
    lan.delete(lan.n1, "p", plugin="ptp")
    wait_for("node 1's entries gone after its DELs", lambda: lan.n1.proxied() == set(), 10)
    assert node_daemon(lan.n2).call("POST", "/v1/cni/gc", {"validAttachments": []})[0] == 200
    wait_for("node 2's entries gone after its GC", lambda: lan.n2.proxied() == set(), 10)


def node_daemon(node: LanNode) -> Any:
    assert node.daemon is not None
    return node.daemon


@pytest.mark.root
def test_start_adds_missing_entries_and_removes_stale_ones_inside_the_pod_subnets_only(
    lan: Lan,
) -> None:
    lan.start(lan.n1, node_config(*RANGES["n1"]))
    a = lan.add(lan.n1, "a")
    assert node_daemon(lan.n1).stop() == 0
    for address in a:  # lost while the daemon was down
        lan.n1.run("ip", "neigh", "del", "proxy", address, "dev", "lan0")
    for address in (*STALE, *FOREIGN):  # a stale one of its range; someone else's
        lan.n1.run("ip", "neigh", "add", "proxy", address, "dev", "lan0")
    assert lan.n1.proxied() == {*STALE, *FOREIGN}

    # Now naming the uplink; the daemon answers once the entries match.
    lan.start(lan.n1, node_config(*RANGES["n1"], uplink="lan0"))
    assert lan.n1.proxied() == {*a, *FOREIGN}
    reaches(lan.n3.run("ping", "-c1", "-W3", a[0]), "watcher -> a after the restart")


@pytest.mark.root
def test_an_address_moved_to_another_node_is_announced_so_neighbours_update_at_once(
    lan: Lan,
) -> None:
    """Both nodes hand out the same range here: a DEL on node 1 and an ADD of the same addresses
    on node 2, as a pod's address moves when a cluster's nodes share the LAN's subnet."""
    lan.start(lan.n1, node_config(*RANGES["n1"]))
    lan.start(lan.n2, node_config(*RANGES["n1"]))
    moved = lan.add(lan.n1, "a")
    for address in moved:
        reaches(lan.n3.run("ping", "-c1", "-W3", address), f"watcher -> {address} on node 1")
        assert lan.n3.neighbour_mac(address) == lan.n1.mac

    lan.delete(lan.n1, "a")
    lan.add(lan.n2, "c", args=f";IP={','.join(moved)}")
    # Right after the ADD, before any traffic: the watcher's cache names node 2.
    assert {lan.n3.neighbour_mac(address) for address in moved} == {lan.n2.mac}
    for address in moved:
        reaches(lan.n3.run("ping", "-c1", "-W3", address), f"watcher -> {address} on node 2")


@pytest.mark.root
def test_without_cap_net_raw_the_add_succeeds_and_the_failed_announcement_is_counted(
    lan: Lan,
) -> None:
    node = lan.n1
    workdir = lan.workdir / node.netns
    lan.lan.daemon(node, workdir, node_config(*RANGES["n1"]), wait=False)
    daemon = node_daemon(node)
    daemon.stop()  # restarted without CAP_NET_RAW in its bounding set (so, as root, none)
    daemon.start(wait=False, prefix=["setpriv", "--bounding-set=-net_raw", "ip", "netns",
                                     "exec", node.netns])  # fmt: skip
    wait_served(daemon)
    a = lan.add(node, "a")
    assert node.proxied() == set(a)  # the entries answer all the same
    reaches(lan.n3.run("ping", "-c1", "-W3", a[0]), "watcher -> a")
    fetch = f"import urllib.request as u; print(u.urlopen('{daemon.debug_url}/metrics').read())"
    metrics = node.run(sys.executable, "-c", fetch).stdout
    assert "cns_flat_network_announcements_failed_total 1.0" in metrics
    assert "flat_network_announce_failed" in daemon.log()


@pytest.mark.root
def test_with_the_mode_off_the_node_answers_for_no_pod(lan: Lan) -> None:
    config = node_config(*RANGES["n1"])
    config["flatNetwork"] = {"enabled": False}
    lan.start(lan.n1, config)
    a = lan.add(lan.n1, "a")
    assert lan.n1.proxied() == set()
    # The pod's address is nowhere on the LAN: the watcher's ARP goes unanswered.
    assert lan.n3.run("ping", "-c1", "-W1", a[0]).returncode != 0


@pytest.mark.root
@pytest.mark.parametrize(
    ("flat", "subnets", "message"),
    [
        ({"uplink": "nosuch0"}, RANGES["n1"], "flatNetwork.uplink: no interface 'nosuch0'"),
        (
            {},
            ("10.99.0.0/24", "fd00:99::/64"),
            "flatNetwork.uplink: no interface holds an address on the pod subnet",
        ),
    ],
)
def test_no_uplink_stops_start_up_naming_the_key(
    lan: Lan, flat: dict[str, str], subnets: tuple[str, str], message: str
) -> None:
    daemon = lan.lan.daemon(lan.n1, lan.workdir / "d", node_config(*subnets, **flat), wait=False)
    assert daemon.proc is not None
    assert daemon.proc.wait(timeout=60) != 0
    assert message in daemon.log()


@pytest.mark.root
def test_an_ipv6_add_fails_naming_proxy_ndp_when_it_is_off_and_cannot_be_set(lan: Lan) -> None:
    """As under the systemd unit or in a container: /proc/sys read-only (here in the daemon's
    own mount namespace), forwarding set by the operator, proxy_ndp forgotten."""
    node = lan.n1
    for sysctl in ("net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"):
        node.run("sysctl", "-qw", sysctl)
    read_only = (
        'mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec "$@"'
    )
    daemon = lan.lan.daemon(node, lan.workdir / "d", node_config(*RANGES["n1"]), wait=False)
    daemon.stop()
    daemon.start(
        wait=False, prefix=["ip", "netns", "exec", node.netns, "sh", "-c", read_only, "sh"]
    )
    wait_served(daemon)

    netns = lan.lan.pod(node, "a")
    done = cni(
        lan.plugin_dir, node, lan.conf(node, "cns-cni", ["standalone", "v6"]), "ADD", "a", netns
    )
    error = json.loads(done.stdout)
    assert done.returncode != 0 and error["code"] == 105, done.stdout
    assert "net.ipv6.conf.lan0.proxy_ndp is 0 and cns cannot set it" in error["details"]
    assert node.proxied() == set()  # the IPv4 entry was not set either: the ADD failed whole
    status, pool = unix_request(daemon.debug_socket, "GET", "/debug/pool")
    assert status == 200 and pool["ips"]["Assigned"] == 0  # its addresses went back
    # An IPv4-only pod on the same node is served: only IPv6 needs proxy_ndp.
    lan.netns["b"] = lan.lan.pod(node, "b")
    done = cni(lan.plugin_dir, node, lan.conf(node, "cns-cni", ["standalone"]), "ADD", "b",
               lan.netns["b"])  # fmt: skip
    assert done.returncode == 0, done.stdout


@pytest.mark.root
def test_entries_flushed_by_an_uplink_going_down_come_back_when_it_is_up_again(lan: Lan) -> None:
    """The kernel drops a link's proxy entries when it goes down (a cable pulled, a driver
    reset); the link's change wakes the reconcile (the interval here is 300 s)."""
    lan.start(lan.n1, node_config(*RANGES["n1"]))
    a = lan.add(lan.n1, "a")
    lan.n1.run("ip", "link", "set", "dev", "lan0", "down")  # flushes them (the daemon may
    lan.n1.run("ip", "link", "set", "dev", "lan0", "up")  # restore them before this, or after)
    wait_for("the entries back after the uplink came up", lambda: lan.n1.proxied() == set(a), 10)
    reaches(lan.n3.run("ping", "-c1", "-W3", a[0]), "watcher -> a after the flap")
