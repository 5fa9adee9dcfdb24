"""The host is not a pod (issue 25, case 10): `cns-cni` ADD naming the daemon's own network
namespace is refused, by any path, and neither it nor the DEL after it changes the host.

The daemon runs in a scratch network namespace that plays the host (with a default route of its
own) and in a PID namespace of its own, so every path to "the host" it is given (/proc/1, its own
/proc/PID and /proc/self, the /run/netns bind mount, a symlink) leads to that scratch namespace:
code that fails this test damages only the scratch namespace, never the machine's network.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cns.host import datapath
from tests.harness import REPO
from tests.harness.bridge import require_bridge
from tests.harness.cni_env import cni_env
from tests.harness.daemon import Daemon
from tests.harness.host import MACHINE_SYSCTLS, REFERENCE_PLUGINS

UPLINK_V4, GATEWAY_V4 = "198.51.100.1/24", "198.51.100.254"  # TEST-NET-2, on the uplink
UPLINK_V6, GATEWAY_V6 = "2001:db8:25::1/64", "2001:db8:25::fe"


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@dataclass
class ScratchHost:
    name: str  # the network namespace that plays the host
    pod: str  # a real pod's namespace, to show that ADD still works

    def run(self, *args: str) -> str:
        return sh("ip", "netns", "exec", self.name, *args)

    def network(self) -> dict[str, str]:
        """What an attach in the host would change: routes of both families, links, neighbours."""
        return {
            "ip route": self.run("ip", "route", "show", "table", "all"),
            "ip -6 route": self.run("ip", "-6", "route", "show", "table", "all"),
            "ip link": self.run("ip", "-d", "link"),
            "ip addr": self.run("ip", "addr"),
            "ip neigh": self.run("ip", "neigh", "show", "nud", "permanent"),
        }


def machine_defaults() -> dict[str, str]:
    """The machine's own default routes (its links change under other tests; these must not)."""
    return {family: sh("ip", family, "route", "show", "default") for family in ("-4", "-6")}


@pytest.fixture
def scratch_host() -> Iterator[ScratchHost]:
    require_bridge()
    tag = f"cnshg-{uuid.uuid4().hex[:6]}"
    made = ScratchHost(f"{tag}-host", f"{tag}-pod")
    machine = {path: path.read_text() for path in MACHINE_SYSCTLS}
    before = machine_defaults()
    try:
        for name in (made.name, made.pod):
            sh("ip", "netns", "add", name)
        sh("ip", "-n", made.name, "link", "set", "lo", "up")
        # No dummy driver everywhere: a veth pair whose both ends stay in the scratch host.
        sh("ip", "-n", made.name, "link", "add", "uplink", "type", "veth", "peer", "name", "far")
        for link in ("uplink", "far"):  # no link-local address: none turns from tentative
            sh("ip", "-n", made.name, "link", "set", link, "addrgenmode", "none", "up")
        sh("ip", "-n", made.name, "addr", "add", UPLINK_V4, "dev", "uplink")
        sh("ip", "-n", made.name, "addr", "add", UPLINK_V6, "dev", "uplink", "nodad")
        sh("ip", "-n", made.name, "route", "add", "default", "via", GATEWAY_V4)
        sh("ip", "-n", made.name, "-6", "route", "add", "default", "via", GATEWAY_V6)
        yield made
    finally:
        for name in (made.name, made.pod):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert {path: path.read_text() for path in MACHINE_SYSCTLS} == machine
    assert machine_defaults() == before


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def namespace_pid(pid: int) -> int:
    """`pid`'s number in its own (innermost) PID namespace."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {pid}")


class HostDaemon:
    """A daemon in the scratch host's network namespace and a PID namespace of its own, under a
    shell that is that namespace's PID 1 (as init is the host's)."""

    def __init__(self, daemon: Daemon, host: ScratchHost) -> None:
        self.daemon = daemon
        self.host = host
        wrapper = [
            "ip", "netns", "exec", host.name,
            "unshare", "--pid", "--mount-proc", "--kill-child",
            "sh", "-c", '"$@" & wait', "sh",
        ]  # fmt: skip
        daemon.start(prefix=wrapper, wait=False)
        daemon.wait_socket()
        assert daemon.proc is not None
        (shell,) = children(daemon.proc.pid)
        (self.pid,) = children(shell)  # the daemon, as this test sees it

    def ips(self) -> list[dict[str, Any]]:
        """/debug/ips, read on the scratch host's loopback where the daemon listens."""
        code = (
            "import urllib.request; print(urllib.request.urlopen("
            f"'{self.daemon.debug_url}/debug/ips', timeout=10).read().decode())"
        )
        listed: list[dict[str, Any]] = json.loads(self.host.run(sys.executable, "-c", code))["ips"]
        return listed

    def stop(self) -> None:
        """SIGTERM to the daemon itself (unshare keeps SIGTERM blocked for its child's sake)."""
        os.kill(self.pid, signal.SIGTERM)
        assert self.daemon.proc is not None
        assert self.daemon.proc.wait(timeout=30) == 0, self.daemon.log_tail()
        self.daemon.proc = None


def cns_cni(
    plugin_dir: Path, daemon: Daemon, command: str, container: str, netns: str
) -> subprocess.CompletedProcess[str]:
    conf = {
        "cniVersion": "1.0.0",
        "name": "cns",
        "type": "cns-cni",
        "socket": str(daemon.socket),
        "releaseQueueDir": str(daemon.state_dir / "release-queue"),
    }
    env = cni_env(
        command,
        container=container,
        netns=netns,
        plugin_dirs=(plugin_dir, REFERENCE_PLUGINS),
        pod=container,
        namespace="test",
    )
    return subprocess.run(
        [str(plugin_dir / "cns-cni")],
        input=json.dumps(conf),
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


@pytest.mark.root
def test_cns_cni_add_naming_the_host_namespace_is_refused_and_changes_nothing(
    scratch_host: ScratchHost, make_daemon: Any, plugin_dir: Path, tmp_path: Path
) -> None:
    daemon = make_daemon({"standalone": {"subnet": "10.254.25.0/24"}}, start=False)
    host = HostDaemon(daemon, scratch_host)
    link = tmp_path / "looks-like-a-pod"
    link.symlink_to(f"/var/run/netns/{scratch_host.name}")
    paths = {  # as the daemon sees them: each is the scratch host's namespace
        "init": "/proc/1/ns/net",
        "daemon": f"/proc/{namespace_pid(host.pid)}/ns/net",
        "self": "/proc/self/ns/net",
        "bind-mount": f"/var/run/netns/{scratch_host.name}",
        "symlink": str(link),
    }
    before = scratch_host.network()
    try:
        for name, path in paths.items():
            added = cns_cni(plugin_dir, daemon, "ADD", f"host-{name}", path)
            assert scratch_host.network() == before, f"ADD {name} ({path}) changed the host"
            error = json.loads(added.stdout)
            assert added.returncode == 1, f"{name}: {added.stdout}"
            assert error["code"] == 4, f"{name}: {error}"
            assert error["msg"].startswith(f"CNI_NETNS: {path} is the host's own network"), error
        for name, path in paths.items():
            deleted = cns_cni(plugin_dir, daemon, "DEL", f"host-{name}", path)
            assert deleted.returncode == 0, f"{name}: {deleted.stdout}{deleted.stderr}"
        assert scratch_host.network() == before, "DEL changed the host"
        # cns-ipam's ADD (the chained main plugin would build the pod there) is refused too.
        body = {"containerID": "ipam-host", "ifName": "eth0", "netns": paths["self"]}
        status, error = daemon.call("POST", "/v1/cni/add", body)
        assert (status, error["code"]) == (400, 4), error
        assert error["msg"].startswith("CNI_NETNS: /proc/self/ns/net is the host's own"), error
        assert [ip for ip in host.ips() if ip["owner"]] == []  # no address went to a refused ADD
        # A pod of its own is attached as always, and its DEL leaves the host as it was.
        pod = f"/var/run/netns/{scratch_host.pod}"
        added = cns_cni(plugin_dir, daemon, "ADD", "real-pod", pod)
        assert added.returncode == 0, added.stdout + added.stderr
        (ip,) = json.loads(added.stdout)["ips"]
        assert ip["address"].startswith("10.254.25.")
        assert cns_cni(plugin_dir, daemon, "DEL", "real-pod", pod).returncode == 0
        assert scratch_host.network() == before
    finally:
        host.stop()


def test_the_host_namespace_is_known_by_identity_not_by_path(tmp_path: Path) -> None:
    """Any path to the calling thread's namespace is the host; another file is not."""
    link = tmp_path / "ns"
    link.symlink_to(f"/proc/{os.getpid()}/ns/net")
    for path in ("/proc/self/ns/net", "/proc/thread-self/ns/net", str(link)):
        with pytest.raises(datapath.HostNamespace, match="is the host's own network namespace"):
            datapath.refuse_host_namespace(path)
    datapath.refuse_host_namespace("/proc/self/ns/uts")  # another namespace: not refused here
    datapath.refuse_host_namespace(str(tmp_path / "missing"))  # left to the step that opens it
