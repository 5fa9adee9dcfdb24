"""Nodes on one flat L2 segment, each a network namespace of its own with a cns daemon in it, for
the flat-network mode (docs/networking.md, "Flat network").

    lan = FlatLan("fn1234")                   # a namespace holding the bridge
    node = lan.node("n1", "10.123.0.11", "fd00:123::11")   # its uplink `lan0` on the bridge
    daemon = lan.daemon(node, workdir, {...})  # `cns run` inside node's namespace
    pod = lan.pod(node, "a")                   # a pod namespace; `cni(...)` runs a plugin for it
    lan.cleanup()                              # daemons stopped, every namespace deleted

Everything lives in namespaces the harness creates (addresses of 10.123.0.0/24 and fd00:123::/64
only there); deleting them removes every link, address, route, neighbour and sysctl they hold.
The plugins run in the node's namespace, as its runtime would run them, and reach its daemon by
its unix socket.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import HarnessError
from tests.harness.cni_env import cni_env
from tests.harness.daemon import Daemon, unix_request
from tests.harness.host import REFERENCE_PLUGINS, run

LAN_V4, LAN_V6 = "10.123.0.0/24", "fd00:123::/64"
UPLINK = "lan0"


def in_netns(netns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run(["ip", "netns", "exec", netns, *args])


@dataclass
class LanNode:
    """A machine on the LAN: its namespace, its uplink's addresses and MAC, its daemon."""

    netns: str
    v4: str
    v6: str
    mac: str = ""
    daemon: Daemon | None = None

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return in_netns(self.netns, *args)

    def proxied(self) -> set[str]:
        """The addresses with a proxy entry on the uplink."""
        found = set()
        for family in ("-4", "-6"):
            out = self.run("ip", family, "neigh", "show", "proxy", "dev", UPLINK).stdout
            found |= {line.split()[0] for line in out.splitlines() if line.strip()}
        return found

    def neighbour_mac(self, address: str) -> str:
        """The MAC this machine's neighbour cache holds for `address` ("" for none)."""
        words = self.run("ip", "neigh", "show", address, "dev", UPLINK).stdout.split()
        return words[words.index("lladdr") + 1] if "lladdr" in words else ""


@dataclass
class FlatLan:
    tag: str
    lan: str = ""
    nodes: list[LanNode] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lan = f"{self.tag}-lan"
        run(["ip", "netns", "add", self.lan], check=True)
        in_netns(self.lan, "ip", "link", "add", "br0", "type", "bridge")
        in_netns(self.lan, "ip", "link", "set", "br0", "up")

    def node(self, name: str, v4: str, v6: str) -> LanNode:
        """A machine on the bridge: uplink `lan0` with `v4`/24 and `v6`/64 (no DAD wait)."""
        netns = f"{self.tag}-{name}"
        run(["ip", "netns", "add", netns], check=True)
        node = LanNode(netns, v4, v6)
        self.nodes.append(node)
        port = f"{name}-port"
        run(["ip", "-n", self.lan, "link", "add", port, "type", "veth", "peer", "name", UPLINK,
             "netns", netns], check=True)  # fmt: skip
        run(["ip", "-n", self.lan, "link", "set", port, "master", "br0", "up"], check=True)
        node.run("ip", "link", "set", "lo", "up")
        node.run("ip", "addr", "add", f"{v4}/24", "dev", UPLINK)
        node.run("ip", "addr", "add", f"{v6}/64", "dev", UPLINK, "nodad")
        node.run("ip", "link", "set", "dev", UPLINK, "up")
        node.mac = json.loads(node.run("ip", "-j", "link", "show", UPLINK).stdout)[0]["address"]
        return node

    def daemon(
        self, node: LanNode, workdir: Path, overrides: Mapping[str, Any], *, wait: bool = True
    ) -> Daemon:
        """`cns run` inside the node's namespace (its debug port is that namespace's loopback:
        `debug(...)` asks the debug socket instead)."""
        workdir.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(workdir, {"nodeName": node.netns, **overrides})
        node.daemon = daemon
        daemon.start(wait=False, prefix=["ip", "netns", "exec", node.netns])
        if wait:
            wait_served(daemon)
        return daemon

    def pod(self, node: LanNode, name: str) -> str:
        """A pod's network namespace (its path) on `node`; the plugins build its interface."""
        netns = f"{self.tag}-{node.netns.removeprefix(self.tag + '-')}-{name}"
        run(["ip", "netns", "add", netns], check=True)
        self.pods.append(netns)
        return f"/var/run/netns/{netns}"

    def cleanup(self) -> None:
        for node in self.nodes:
            if node.daemon is not None:
                node.daemon.stop()
        for netns in [*self.pods, *(n.netns for n in self.nodes), self.lan]:
            run(["ip", "netns", "del", netns])


def wait_served(daemon: Daemon, timeout: float = 30) -> None:
    """Until the daemon answers on its CNI socket (HarnessError if it exits first)."""
    deadline = time.monotonic() + timeout
    while True:
        daemon.wait_socket(timeout)
        try:
            status, _ = unix_request(daemon.socket, "GET", "/v1/cni/status")
        except OSError:
            status = 0
        if status:
            return
        if time.monotonic() > deadline:
            raise HarnessError(f"cns does not answer on {daemon.socket}:\n{daemon.log_tail()}")
        time.sleep(0.05)


def debug(daemon: Daemon, path: str) -> Any:
    """A debug endpoint over the daemon's debug socket."""
    status, body = unix_request(daemon.debug_socket, "GET", path)
    assert status == 200, (status, body)
    return body


def cni(
    plugin_dir: Path,
    node: LanNode,
    conf: Mapping[str, Any],
    command: str,
    container: str,
    netns: str,
    *,
    args: str = "",
) -> subprocess.CompletedProcess[str]:
    """One plugin run as the node's runtime runs it: in the node's namespace (a plugin such as
    ptp builds its host side where it runs), `conf` on stdin, the CNI variables around it."""
    env = cni_env(
        command,
        container=container,
        netns=netns,
        plugin_dirs=(plugin_dir, REFERENCE_PLUGINS),
        pod=container,
        namespace=f"flat{args}",
    )
    binary = plugin_dir / conf["type"]
    if not binary.exists():
        binary = REFERENCE_PLUGINS / conf["type"]
    conf = {"cniVersion": "1.0.0", "name": "flat", **conf}
    return run(["ip", "netns", "exec", node.netns, binary], env=env, input=json.dumps(conf))
