"""`cns-cni`, the main plugin, for real: veth pairs in network namespaces, chained with the
reference `tuning`, `bandwidth` and `portmap` plugins the way libcni runs a conflist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO
from tests.harness.bridge import require_bridge
from tests.harness.cni_env import cni_env
from tests.harness.daemon import Daemon
from tests.harness.host import REFERENCE_PLUGINS

HOST_ADDRESS = "192.0.2.254"  # TEST-NET-1, put on lo so pods have a host address to reach


def sh(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


class Node:
    """A daemon, cns-cni installed, and a conflist run with libcni's rules."""

    def __init__(self, daemon: Daemon, plugin_dir: Path, plugins: list[dict[str, Any]]):
        self.daemon = daemon
        self.plugin_dir = plugin_dir
        self.conflist = {"cniVersion": "1.0.0", "name": "cns", "plugins": plugins}
        self.namespaces: list[str] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.tag = f"cnsmp{os.getpid() % 10000}"

    def netns(self, pod: str) -> str:
        name = f"{self.tag}-{pod}"
        if name not in self.namespaces:
            sh("ip", "netns", "add", name)
            self.namespaces.append(name)
        return name

    def _exec(
        self, plugin: dict[str, Any], command: str, pod: str, netns: str, prev: Any
    ) -> subprocess.CompletedProcess[str]:
        conf = {**plugin, "name": self.conflist["name"], "cniVersion": self.conflist["cniVersion"]}
        if prev is not None:
            conf["prevResult"] = prev
        if "portMappings" in plugin.get("capabilities", {}):
            conf["runtimeConfig"] = {
                "portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}]
            }
        env = cni_env(
            command,
            container=f"c-{pod}",
            netns=netns,
            plugin_dirs=(self.plugin_dir, REFERENCE_PLUGINS),
            pod=pod,
            namespace="test",
        )
        binary = self.plugin_dir / plugin["type"]
        if not binary.exists():
            binary = REFERENCE_PLUGINS / plugin["type"]
        return subprocess.run(
            [str(binary)], input=json.dumps(conf), env=env, capture_output=True, text=True
        )

    def add(self, pod: str) -> dict[str, Any]:
        netns = f"/var/run/netns/{self.netns(pod)}"
        prev: Any = None
        for plugin in self.conflist["plugins"]:
            result = self._exec(plugin, "ADD", pod, netns, prev)
            assert result.returncode == 0, f"{plugin['type']} ADD: {result.stdout}{result.stderr}"
            prev = json.loads(result.stdout)
        self.results[pod] = prev
        return dict(prev)

    def check(self, pod: str) -> subprocess.CompletedProcess[str]:
        netns = f"/var/run/netns/{self.netns(pod)}"
        return self._exec(self.conflist["plugins"][0], "CHECK", pod, netns, self.results[pod])

    def delete(self, pod: str, netns: bool = True) -> None:
        path = f"/var/run/netns/{self.tag}-{pod}" if netns else ""
        for plugin in reversed(self.conflist["plugins"]):
            result = self._exec(plugin, "DEL", pod, path, self.results.get(pod))
            assert result.returncode == 0, f"{plugin['type']} DEL: {result.stdout}{result.stderr}"

    def in_pod(self, pod: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns(pod), *args], capture_output=True, text=True
        )

    def cleanup(self) -> None:
        """DEL every pod's chain (idempotent: portmap's iptables rules go too), then the netns."""
        for pod in list(self.results):
            netns = f"/var/run/netns/{self.tag}-{pod}"
            for plugin in reversed(self.conflist["plugins"]):
                self._exec(plugin, "DEL", pod, netns, self.results[pod])
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def node(make_daemon: Any, plugin_dir: Path) -> Iterator[Node]:
    require_bridge()
    daemon = make_daemon({"attachmentCheckSeconds": 0.5, "standalone": {"subnet": "10.245.0.0/24"}})
    plugins = [
        {
            "type": "cns-cni",
            "socket": str(daemon.socket),
            "releaseQueueDir": str(daemon.state_dir / "release-queue"),
            "mtu": 1400,
        },
        {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.arp_ignore": "1"}},
        {"type": "bandwidth", "ingressRate": 100_000_000, "ingressBurst": 1_000_000},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ]
    cluster = Node(daemon, plugin_dir, plugins)
    subprocess.run(["ip", "addr", "add", f"{HOST_ADDRESS}/32", "dev", "lo"], capture_output=True)
    try:
        yield cluster
    finally:
        subprocess.run(
            ["ip", "addr", "del", f"{HOST_ADDRESS}/32", "dev", "lo"], capture_output=True
        )
        cluster.cleanup()


def releases(daemon: Daemon) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics"))}
    return {s.labels["reason"]: s.value for s in families["cns_ip_releases"].samples}


@pytest.mark.root
def test_pods_get_transparent_networking_and_the_chain_runs(node: Node) -> None:
    first = node.add("a")
    second = node.add("b")
    host_if, pod_if = first["interfaces"][0], first["interfaces"][1]
    assert host_if["name"].startswith("cns") and "sandbox" not in host_if
    assert pod_if["name"] == "eth0" and pod_if["sandbox"].endswith(node.netns("a"))
    assert all(len(i["mac"]) == 17 for i in first["interfaces"])
    ip = first["ips"][0]
    assert ip["address"].endswith("/32") and ip["gateway"] == "169.254.1.1"
    assert ip["interface"] == 1
    address = ip["address"].split("/")[0]
    other = second["ips"][0]["address"].split("/")[0]

    link = node.in_pod("a", "ip", "-o", "link", "show", "eth0").stdout
    assert "mtu 1400" in link
    assert f"{address}/32" in node.in_pod("a", "ip", "-4", "-o", "addr", "show", "eth0").stdout
    routes = node.in_pod("a", "ip", "-4", "route").stdout
    assert "default via 169.254.1.1 dev eth0" in routes
    neigh = node.in_pod("a", "ip", "neigh", "show", "169.254.1.1").stdout
    assert "PERMANENT" in neigh and host_if["mac"] in neigh
    assert f"{address} dev {host_if['name']}" in sh("ip", "-4", "route")
    proxy_arp = Path(f"/proc/sys/net/ipv4/conf/{host_if['name']}/proxy_arp").read_text()
    assert proxy_arp.strip() == "1"
    # the chained plugins ran on our result
    assert node.in_pod("a", "sysctl", "-n", "net.ipv4.conf.eth0.arp_ignore").stdout.strip() == "1"
    assert "tbf" in sh("tc", "qdisc", "show", "dev", host_if["name"])

    for pod, target in (("a", other), ("b", address), ("a", HOST_ADDRESS)):
        ping = node.in_pod(pod, "ping", "-c1", "-W2", target)
        assert ping.returncode == 0, f"{pod} -> {target}: {ping.stdout}{ping.stderr}"

    assert node.check("a").returncode == 0
    sh("ip", "netns", "exec", node.netns("a"), "ip", "route", "del", "default")
    broken = node.check("a")
    assert broken.returncode != 0
    error = json.loads(broken.stdout)
    assert error["code"] == 106 and "default route" in error["msg"]

    for pod in ("a", "b"):
        node.delete(pod)
        node.delete(pod, netns=False)  # runtimes call DEL again without a netns
    assert "cns" not in "".join(
        line for line in sh("ip", "-o", "link").splitlines() if host_if["name"] in line
    )
    assert node.daemon.pool()["ips"]["Assigned"] == 0
    assert releases(node.daemon)["cni-del"] == 2


@pytest.mark.root
def test_del_after_the_netns_is_gone_and_leaked_sandboxes_are_reaped(node: Node) -> None:
    node.add("gone")
    subprocess.run(["ip", "netns", "del", node.netns("gone")], check=True)
    node.namespaces.remove(f"{node.tag}-gone")
    node.delete("gone")  # netns path no longer exists: still a success
    assert node.daemon.pool()["ips"]["Assigned"] == 0
    # The reaper may have released "gone" first (its netns and veth vanished before the DEL).
    reaped_before = releases(node.daemon).get("leak-check", 0)

    # A sandbox recreated behind our back: its netns and host veth vanish, nobody calls DEL.
    leaked = node.add("leak")
    host = leaked["interfaces"][0]["name"]
    subprocess.run(["ip", "netns", "del", node.netns("leak")], check=True)
    node.namespaces.remove(f"{node.tag}-leak")
    subprocess.run(["ip", "link", "del", host], capture_output=True)
    deadline = time.monotonic() + 10
    while node.daemon.pool()["ips"]["Assigned"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node.daemon.pool()["ips"]["Assigned"] == 0
    assert releases(node.daemon).get("leak-check") == reaped_before + 1
    assert "netns and host veth gone" in node.daemon.log()


@pytest.mark.root
def test_attachments_survive_a_crash_and_leaks_are_reaped_after_restart(node: Node) -> None:
    kept = node.add("kept")["ips"][0]["address"].split("/")[0]
    lost = node.add("lost")
    daemon = node.daemon
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait()
    # While the daemon is down, one sandbox disappears without a DEL.
    subprocess.run(["ip", "netns", "del", node.netns("lost")], check=True)
    node.namespaces.remove(f"{node.tag}-lost")
    subprocess.run(["ip", "link", "del", lost["interfaces"][0]["name"]], capture_output=True)
    daemon.start()
    deadline = time.monotonic() + 10
    while daemon.pool()["ips"]["Assigned"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    owners = {ip["address"]: ip["owner"] for ip in daemon.ips() if ip["owner"]}
    assert list(owners) == [kept] and owners[kept]["containerID"] == "c-kept"
    assert releases(daemon).get("leak-check") == 1
    ping = node.in_pod("kept", "ping", "-c1", "-W2", HOST_ADDRESS)
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert node.check("kept").returncode == 0


@pytest.mark.root
def test_ip_forward_off_and_read_only_fails_the_add_clearly(make_daemon: Any) -> None:
    """Under the systemd unit /proc/sys is read-only: with net.ipv4.ip_forward at 0, cns cannot
    turn it on, and the ADD says which setting the operator must change, before any IP is
    taken. The daemon runs in a mount namespace where ip_forward reads 0 and is read-only."""
    require_bridge()
    daemon = make_daemon(start=False)
    forward = daemon.workdir / "ip_forward"
    forward.write_text("0\n")
    with daemon.log_path.open("ab") as log:
        daemon.proc = subprocess.Popen(
            ["unshare", "--mount", "sh", "-c",
             'mount --bind -o ro "$0" /proc/sys/net/ipv4/ip_forward && exec "$@"', str(forward),
             sys.executable, "-m", "cns.commands.cli", "run", "--config", str(daemon.config_path)],
            stdout=log, stderr=log, cwd=REPO,
        )  # fmt: skip
    daemon.wait_ready()
    body = {"containerID": "fwd", "ifName": "eth0", "netns": "/var/run/netns/none", "mtu": 1500}
    status, error = daemon.call("POST", "/v1/cni/attach", body)
    assert (status, error["code"]) == (500, 105), error
    assert "net.ipv4.ip_forward is 0" in error["details"], error
    assert "/etc/sysctl.d" in error["details"]
    assert daemon.pool()["ips"]["Assigned"] == 0
    assert all(ip["owner"] is None for ip in daemon.ips())


def test_attach_for_another_pod_leaves_the_running_pod_alone(node: Node) -> None:
    """Same container ID and interface, another pod name: refused before anything is touched
    (the pod's veth, its IP, its durable record)."""
    address = node.add("a")["ips"][0]["address"]
    netns = f"/var/run/netns/{node.netns('a')}"
    hijack = {"containerID": "c-a", "ifName": "eth0", "netns": netns, "podName": "other",
              "podNamespace": "test"}  # fmt: skip
    status, err = node.daemon.call("POST", "/v1/cni/attach", hijack)
    assert (status, err["code"]) == (409, 4) and "test/a" in err["msg"]
    assert node.check("a").returncode == 0
    assert node.in_pod("a", "ping", "-c1", "-W2", HOST_ADDRESS).returncode == 0
    assert node.daemon.stop() == 0
    node.daemon.start()
    assert node.check("a").returncode == 0  # the attachment's record survived too
    (owner,) = [ip for ip in node.daemon.ips() if ip["owner"]]
    assert f"{owner['address']}/32" == address and owner["owner"]["podName"] == "a"


def test_a_netns_that_is_not_a_network_namespace_is_refused_at_once(
    node: Node, tmp_path: Path
) -> None:
    """CNI_NETNS comes from the runtime. A FIFO there blocked the thread that opened it until a
    writer came, i.e. forever: an attach never answered and kept its IP, and a CHECK froze the
    event loop itself. A regular file, a directory or a device made CHECK an internal error
    (setns: EINVAL). Each is now a clear error, at once, and nothing is kept."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    regular = tmp_path / "file"
    regular.write_text("not a namespace\n")
    paths = [str(fifo), str(regular), str(tmp_path), "/dev/null"]
    daemon = node.daemon
    for path in paths:
        body = {"containerID": "c-bad", "ifName": "eth0", "netns": path}
        status, err = daemon.call("POST", "/v1/cni/attach", body)
        assert (status, err["code"]) == (500, 105), err
        assert f"{path} is not a network namespace" in err["details"], err
    assert all(ip["owner"] is None for ip in daemon.ips())  # each IP was released again

    node.add("good")
    for path in paths:
        body = {"containerID": "c-good", "ifName": "eth0", "netns": path}
        status, err = daemon.call("POST", "/v1/cni/verify", body)
        assert (status, err["code"]) == (409, 106), err
        assert f"{path} is not a network namespace" in err["msg"], err
    assert node.check("good").returncode == 0
    assert daemon.get("/readyz")
    assert "api_internal_error" not in daemon.log()


def test_a_repeated_add_naming_another_netns_leaves_the_pod_alone(node: Node) -> None:
    """The same container and interface ADDed again with another (or a mistyped) netns: the
    interface could not be built there (code 105), and undoing that failed ADD deleted the
    running pod's veth and released its IP. Now refused before anything is touched; the same
    namespace by another path is a repeated ADD, and once the pod's namespace is gone (its
    sandbox died without a DEL), the attachment may be built anew."""
    address = node.add("a")["ips"][0]["address"]
    other = f"/var/run/netns/{node.netns('b')}"
    for netns in (other, "/var/run/netns/cnsmp-typo"):
        body = {"containerID": "c-a", "ifName": "eth0", "netns": netns}
        status, err = node.daemon.call("POST", "/v1/cni/attach", body)
        assert (status, err["code"]) == (409, 4), err
        assert "/var/run/netns/cnsmp" in err["msg"], err
    assert node.check("a").returncode == 0
    assert node.in_pod("a", "ping", "-c1", "-W2", HOST_ADDRESS).returncode == 0

    same = {"containerID": "c-a", "ifName": "eth0", "netns": f"/run/netns/{node.netns('a')}"}
    status, reply = node.daemon.call("POST", "/v1/cni/attach", same)
    assert status == 200 and reply["ips"][0]["address"] == address, reply

    # A process still in the old namespace keeps it (and its veth) alive after the unmount, as
    # the kernel's deferred teardown does for a while anyway.
    holder = subprocess.Popen(["ip", "netns", "exec", node.netns("a"), "sleep", "60"])
    try:
        subprocess.run(["ip", "netns", "del", node.netns("a")], check=True)
        moved = {"containerID": "c-a", "ifName": "eth0", "netns": other}
        status, reply = node.daemon.call("POST", "/v1/cni/attach", moved)
        assert status == 200 and reply["ips"][0]["address"] == address, reply
    finally:
        holder.kill()
        holder.wait()
    assert node.in_pod("b", "ping", "-c1", "-W2", HOST_ADDRESS).returncode == 0


def test_a_failed_add_keeps_the_ip_an_earlier_add_gave(node: Node) -> None:
    """An attach for a container+interface that already holds an IP (from a cns-ipam ADD, or an
    earlier attach) and fails to build its interface (here: the pod already has an eth0) used to
    release that IP on its way out: a failed request took away an assignment it had not made.
    It now changes nothing it did not create."""
    node.add("a")
    plain = {"containerID": "c-x", "ifName": "eth0", "podName": "x", "podNamespace": "test"}
    status, reply = node.daemon.call("POST", "/v1/cni/add", plain)
    assert status == 200, reply
    address = reply["ips"][0]["address"].split("/")[0]
    into_a = {**plain, "netns": f"/var/run/netns/{node.netns('a')}"}
    status, err = node.daemon.call("POST", "/v1/cni/attach", into_a)
    assert (status, err["code"]) == (500, 105) and "eth0 exists in the pod" in err["details"], err
    held = {ip["owner"]["containerID"]: ip["address"] for ip in node.daemon.ips() if ip["owner"]}
    assert held.get("c-x") == address, held
    assert node.check("a").returncode == 0
    assert node.daemon.stop() == 0
    node.daemon.start()  # and so on disk
    held = {ip["owner"]["containerID"]: ip["address"] for ip in node.daemon.ips() if ip["owner"]}
    assert held.get("c-x") == address, held
