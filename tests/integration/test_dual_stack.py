"""Dual-stack pod interfaces (issue 17): `datapath.attach` with an IPv4 and an IPv6 address.

The real-kernel tests build two "pods" and a "host" that are all scratch network namespaces:
attach and detach run in a child process that `ip netns exec` puts into the host namespace, so
the IPv6 forwarding they turn on (which changes how a node treats router advertisements) and
every other sysctl they touch belong to that namespace, and deleting the namespaces removes
everything, on failure too.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cns.host import datapath
from cns.node.attachments import cni_result
from tests.harness import REPO
from tests.harness.bridge import require_bridge
from tests.harness.host import MACHINE_SYSCTLS
from tests.integration.test_cns_cni_netns import Node

HOST_V4, HOST_V6 = "192.0.2.254", "2001:db8:c5::1"  # documentation ranges, on the host's lo
PODS = {"a": ("10.254.9.10", "fd00:c5::a"), "b": ("10.254.9.11", "fd00:c5::b")}


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@dataclass
class Lab:
    host: str
    pods: dict[str, str]  # pod -> netns name

    def path(self, pod: str) -> str:
        return f"/var/run/netns/{self.pods[pod]}"

    def container(self, pod: str) -> str:
        return f"{self.host}-{pod}"

    def on_host(self, code: str) -> subprocess.CompletedProcess[str]:
        """Python run inside the host namespace (with cns importable); what it prints."""
        return subprocess.run(
            ["ip", "netns", "exec", self.host, sys.executable, "-c", code],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip

    def host_run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.host, *args], capture_output=True, text=True
        )

    def pod_run(self, pod: str, *args: str) -> subprocess.CompletedProcess[str]:
        command = ["ip", "netns", "exec", self.pods[pod], *args]
        return subprocess.run(command, capture_output=True, text=True)


@pytest.fixture
def lab() -> Iterator[Lab]:
    tag = f"cns6-{uuid.uuid4().hex[:6]}"
    made = Lab(f"{tag}-host", {pod: f"{tag}-{pod}" for pod in PODS})
    machine = {path: path.read_text() for path in MACHINE_SYSCTLS}
    try:
        for name in (made.host, *made.pods.values()):
            sh("ip", "netns", "add", name)
        sh("ip", "-n", made.host, "link", "set", "lo", "up")
        sh("ip", "-n", made.host, "addr", "add", f"{HOST_V4}/32", "dev", "lo")
        sh("ip", "-n", made.host, "addr", "add", f"{HOST_V6}/128", "dev", "lo")
        yield made
    finally:
        for name in (made.host, *made.pods.values()):  # the veths go with their namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert {path: path.read_text() for path in MACHINE_SYSCTLS} == machine


ATTACH = """
import dataclasses, json, sys
from cns.host import datapath
datapath.enable_forwarding(4)
datapath.enable_forwarding(6)
made = {}
for pod, (path, container, addresses) in json.loads(sys.argv[1]).items():
    made[pod] = dataclasses.asdict(datapath.attach(path, "eth0", container, addresses, 1400))
print(json.dumps(made))
"""


def attach_pods(lab: Lab) -> dict[str, dict[str, str]]:
    wanted = {pod: (lab.path(pod), lab.container(pod), list(PODS[pod])) for pod in PODS}
    code = ATTACH.replace("sys.argv[1]", repr(json.dumps(wanted)))
    done = lab.on_host(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def check_pod(lab: Lab, pod: str) -> list[str]:
    code = (
        "import asyncio, json\nfrom cns.host import datapath\n"
        f"print(json.dumps(asyncio.run(datapath.check({lab.path(pod)!r}, 'eth0', "
        f"{lab.container(pod)!r}, {list(PODS[pod])!r}))))"
    )
    done = lab.on_host(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def links(run: Callable[..., subprocess.CompletedProcess[str]]) -> list[str]:
    return [
        line.split(": ")[1].split("@")[0] for line in run("ip", "-o", "link").stdout.splitlines()
    ]


def ping(run: subprocess.CompletedProcess[str], what: str) -> None:
    assert run.returncode == 0, f"{what}: {run.stdout}{run.stderr}"


@pytest.mark.root
def test_dual_stack_pods_reach_each_other_and_the_host_and_detach_leaves_nothing(
    lab: Lab,
) -> None:
    made = attach_pods(lab)
    assert attach_pods(lab) == made  # a repeated ADD completes, and changes nothing
    assert lab.host_run("sysctl", "-n", "net.ipv6.conf.all.forwarding").stdout.strip() == "1"
    for pod, (v4, v6) in PODS.items():
        host, host_mac, sandbox_mac = (
            made[pod][k] for k in ("host_ifname", "host_mac", "sandbox_mac")
        )
        addresses = lab.pod_run(pod, "ip", "-o", "addr", "show", "eth0").stdout
        assert addresses.count(f"{v4}/32") == addresses.count(f"{v6}/128") == 1
        (line,) = (line for line in addresses.splitlines() if f"{v6}/128" in line)
        assert "tentative" not in line  # IFA_F_NODAD: usable at once (the link-local is not)
        routes6 = lab.pod_run(pod, "ip", "-6", "route").stdout
        assert "default via fe80::1 dev eth0" in routes6
        gateway = lab.pod_run(pod, "ip", "-6", "neigh", "show", "fe80::1", "dev", "eth0").stdout
        assert host_mac in gateway and "PERMANENT" in gateway
        assert f"{v6} dev {host}" in lab.host_run("ip", "-6", "route").stdout
        assert f"{v4} dev {host} scope link" in lab.host_run("ip", "-4", "route").stdout
        neighbour = lab.host_run("ip", "-6", "neigh", "show", v6, "dev", host).stdout
        assert sandbox_mac in neighbour and "PERMANENT" in neighbour
        assert check_pod(lab, pod) == []

    for source, target in (("a", "b"), ("b", "a")):
        for address in PODS[target]:
            ping(lab.pod_run(source, "ping", "-c1", "-W2", address), f"{source} -> {address}")
        for address in (HOST_V4, HOST_V6):
            ping(lab.pod_run(source, "ping", "-c1", "-W2", address), f"{source} -> host {address}")
        for address in PODS[source]:
            ping(lab.host_run("ping", "-c1", "-W2", address), f"host -> {address}")

    # CHECK names what is missing, per family
    lab.pod_run("a", "ip", "-6", "route", "del", "default")
    lab.host_run("ip", "-6", "route", "del", PODS["a"][1])
    assert sorted(check_pod(lab, "a")) == [
        f"default route via fe80::1 is missing in {lab.path('a')}",
        f"host route {PODS['a'][1]}/128 via {made['a']['host_ifname']} is missing",
    ]

    detached = lab.on_host(
        "from cns.host import datapath\n"
        f"print([datapath.detach(c, 'eth0') for c in {[lab.container(p) for p in PODS]!r}])"
    )
    assert detached.stdout.strip() == "[True, True]", detached.stderr
    assert links(lab.host_run) == ["lo"]
    assert "fd00:c5" not in lab.host_run("ip", "-6", "route").stdout
    assert "10.254.9" not in lab.host_run("ip", "-4", "route").stdout
    assert lab.host_run("ip", "-6", "neigh").stdout.strip() == ""
    for pod in PODS:
        assert links(functools.partial(lab.pod_run, pod)) == ["lo"]  # the peer went too
        assert lab.pod_run(pod, "ip", "-6", "neigh").stdout.strip() == ""


@pytest.mark.root
def test_attach_enables_ipv6_on_both_ends_when_it_is_disabled(lab: Lab) -> None:
    """Links inherit net.ipv6.conf.default.disable_ipv6 of their namespace (Docker sets it in
    its containers); the kernel then refuses IPv6 addresses and routes on them (EACCES)."""
    for run in (lab.host_run, lambda *a: lab.pod_run("a", *a)):
        run("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
    code = ATTACH.replace(
        "sys.argv[1]", repr(json.dumps({"a": [lab.path("a"), "dis", list(PODS["a"])]}))
    )
    done = lab.on_host(code)
    assert done.returncode == 0, done.stderr
    host = json.loads(done.stdout)["a"]["host_ifname"]
    assert lab.host_run("sysctl", "-n", f"net.ipv6.conf.{host}.disable_ipv6").stdout.strip() == "0"
    assert lab.pod_run("a", "sysctl", "-n", "net.ipv6.conf.eth0.disable_ipv6").stdout.strip() == "0"
    ping(lab.host_run("ping", "-c1", "-W2", PODS["a"][1]), "host -> a over IPv6")


@pytest.mark.root
def test_disabled_ipv6_and_forwarding_off_with_read_only_proc_sys_fail_naming_the_sysctl(
    lab: Lab,
) -> None:
    """Under the systemd unit /proc/sys is read-only: cns can neither clear disable_ipv6 nor
    turn IPv6 forwarding on (0 in a new namespace), and says which setting the operator must
    change."""
    lab.host_run("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
    code = (
        "from cns.host import datapath\n"
        "for step in (lambda: datapath.enable_forwarding(6),\n"
        f"             lambda: datapath.attach({lab.path('a')!r}, 'eth0', 'ro',\n"
        f"                                    {list(PODS['a'])!r}, 1500)):\n"
        "    try:\n        step()\n"
        "    except datapath.AttachError as exc:\n        print(exc)\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", lab.host, "unshare", "--mount", "sh", "-c",
         'mount --bind -o ro /proc/sys /proc/sys && exec "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    forwarding, disabled = done.stdout.splitlines()
    assert forwarding == (
        "net.ipv6.conf.all.forwarding is 0 and cns cannot set it (Read-only file system): "
        "set net.ipv6.conf.all.forwarding=1 on the node (e.g. in /etc/sysctl.d/)"
    ), done.stderr
    host = datapath.host_ifname("ro", "eth0")
    assert f"IPv6 is disabled on {host} on the host" in disabled
    assert f"set net.ipv6.conf.{host}.disable_ipv6=0" in disabled


@pytest.mark.root
@pytest.mark.parametrize(
    ("subnet", "suffix", "gateway", "default", "host", "ipv6_forwarding"),
    [
        ("fd00:c5:1::/120", "/128", "fe80::1", "::/0", HOST_V6, "1"),
        ("10.254.10.0/24", "/32", "169.254.1.1", "0.0.0.0/0", HOST_V4, "0"),
    ],
    ids=["ipv6", "ipv4"],
)
def test_cns_cni_through_the_daemon_per_family(
    lab: Lab,
    make_daemon: Any,
    plugin_dir: Path,
    subnet: str,
    suffix: str,
    gateway: str,
    default: str,
    host: str,
    ipv6_forwarding: str,
) -> None:
    """The whole path: `cns-cni` ADD, CHECK and DEL against a daemon whose standalone subnet is
    IPv6 or IPv4. The daemon runs in the scratch host namespace (its unix socket is a file,
    reachable from here), so the forwarding it turns on is that namespace's; IPv6 forwarding
    only when a pod has an IPv6 address."""
    require_bridge()
    daemon = make_daemon({"standalone": {"subnet": subnet}}, start=False)
    daemon.start(prefix=["ip", "netns", "exec", lab.host], wait=False)
    daemon.wait_socket()
    plugin = {"type": "cns-cni", "socket": str(daemon.socket), "mtu": 1400}
    node = Node(daemon, plugin_dir, [plugin])
    node.tag = lab.host.removesuffix("-host")  # its pods' namespaces are the lab's
    node.namespaces = list(lab.pods.values())
    result = node.add("a")
    (ip,) = result["ips"]
    assert ip["address"].endswith(suffix) and (ip["gateway"], ip["interface"]) == (gateway, 1)
    assert result["routes"] == [{"dst": default, "gw": gateway}]
    address = ip["address"].split("/")[0]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet)
    forwarding = lab.host_run("sysctl", "-n", "net.ipv6.conf.all.forwarding").stdout.strip()
    assert forwarding == ipv6_forwarding
    ping(lab.pod_run("a", "ping", "-c1", "-W2", host), "pod -> host")
    ping(lab.host_run("ping", "-c1", "-W2", address), "host -> pod")
    checked = node.check("a")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    node.delete("a")
    assert links(lab.host_run) == ["lo"]
    for family in ("-4", "-6"):
        assert address not in lab.host_run("ip", family, "route", "show", "table", "all").stdout


@pytest.mark.root
def test_ipv6_forwarding_off_and_read_only_fails_the_add_and_gives_the_ip_back(
    lab: Lab, make_daemon: Any
) -> None:
    """IPv6 forwarding is checked once the pod's address is known to be IPv6, so the ADD fails
    after the IP was assigned: the IP is released (reason attach-failed) and the error names
    the sysctl. The daemon runs in the scratch host namespace with /proc/sys read-only."""
    require_bridge()
    lab.host_run("sysctl", "-qw", "net.ipv4.ip_forward=1")  # the check before the IP passes
    daemon = make_daemon({"standalone": {"subnet": "fd00:c5:2::/120"}}, start=False)
    read_only = 'mount --bind -o ro /proc/sys /proc/sys && exec "$@"'
    prefix = ["ip", "netns", "exec", lab.host, "unshare", "--mount", "sh", "-c", read_only, "sh"]
    daemon.start(prefix=prefix, wait=False)
    daemon.wait_socket()
    body = {"containerID": "fwd6", "ifName": "eth0", "netns": lab.path("a"), "mtu": 1500}
    status, error = daemon.call("POST", "/v1/cni/attach", body)
    assert (status, error["code"]) == (500, 105), error
    assert "net.ipv6.conf.all.forwarding is 0" in error["details"], error
    assert "set net.ipv6.conf.all.forwarding=1" in error["details"]
    assert links(lab.host_run) == ["lo"]
    pool = lab.on_host(  # the debug endpoint listens on the host namespace's loopback
        f"import urllib.request; print(urllib.request.urlopen('{daemon.debug_url}/debug/pool')"
        ".read().decode())"
    )
    assert json.loads(pool.stdout)["ips"]["Assigned"] == 0, pool.stderr
    assert "attach-failed" in daemon.log()
    assert lab.host_run("sysctl", "-n", "net.ipv6.conf.all.forwarding").stdout.strip() == "0"


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        (["10.0.0.1", "10.0.0.2"], "two IPv4 addresses \\(10.0.0.1, 10.0.0.2\\)"),
        (["fd00::1", "10.0.0.1", "fd00::2"], "two IPv6 addresses \\(fd00::1, fd00::2\\)"),
        (["10.0.0.300"], "'10.0.0.300' is not an IP address"),
        (["10.0.0.1/32"], "'10.0.0.1/32' is not an IP address"),
        ([], "no address to attach"),
    ],
)
def test_attach_refuses_bad_address_lists_before_touching_anything(
    addresses: list[str], message: str
) -> None:
    # A namespace that does not exist: the refusal comes first, from the addresses alone.
    with pytest.raises(datapath.AttachError, match=message):
        datapath.attach("/var/run/netns/cns-nonesuch", "eth0", "refused", addresses, 1500)


def test_cni_result_has_an_address_and_a_default_route_per_family() -> None:
    attached = datapath.Attachment("cnsabc", "ee:00:00:00:00:01", "02:00:00:00:00:01", 1400)
    result = cni_result(attached, ["10.1.2.3", "fd00::a"], "/var/run/netns/p", "eth0")
    assert result["interfaces"] == [
        {"name": "cnsabc", "mac": "ee:00:00:00:00:01", "mtu": 1400},
        {"name": "eth0", "mac": "02:00:00:00:00:01", "mtu": 1400, "sandbox": "/var/run/netns/p"},
    ]
    assert result["ips"] == [
        {"address": "10.1.2.3/32", "gateway": "169.254.1.1", "interface": 1},
        {"address": "fd00::a/128", "gateway": "fe80::1", "interface": 1},
    ]
    assert result["routes"] == [
        {"dst": "0.0.0.0/0", "gw": "169.254.1.1"},
        {"dst": "::/0", "gw": "fe80::1"},
    ]
    v6 = cni_result(attached, ["fd00:0::b"], "/var/run/netns/p", "eth0")
    assert v6["ips"] == [{"address": "fd00::b/128", "gateway": "fe80::1", "interface": 1}]
    assert v6["routes"] == [{"dst": "::/0", "gw": "fe80::1"}]
    v4 = cni_result(attached, ["10.1.2.3"], "/var/run/netns/p", "eth0")
    assert v4["routes"] == [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}]


@pytest.mark.root
def test_cns_cni_gets_an_address_of_each_subnet_in_one_add(
    lab: Lab, make_daemon: Any, plugin_dir: Path
) -> None:
    """`cns-cni` with `subnets`: one ADD gives the pod its IPv4 address (the primary subnet)
    and its IPv6 one (a further subnet), wired on one interface; CHECK checks both, DEL
    releases both. The daemon runs in the scratch host namespace, as above."""
    require_bridge()
    daemon = make_daemon(
        {
            "standalone": {
                "name": "v4pods",
                "subnet": "10.254.11.0/24",
                "subnets": [{"name": "v6pods", "subnet": "fd00:c5:3::/120"}],
            }
        },
        start=False,
    )
    daemon.start(prefix=["ip", "netns", "exec", lab.host], wait=False)
    daemon.wait_socket()
    plugin = {"type": "cns-cni", "socket": str(daemon.socket), "subnets": ["v4pods", "v6pods"]}
    node = Node(daemon, plugin_dir, [plugin])
    node.tag = lab.host.removesuffix("-host")
    node.namespaces = list(lab.pods.values())
    result = node.add("a")
    four, six = (ip["address"] for ip in result["ips"])
    assert four.startswith("10.254.11.") and four.endswith("/32")
    assert six.startswith("fd00:c5:3::") and six.endswith("/128")
    assert [route["dst"] for route in result["routes"]] == ["0.0.0.0/0", "::/0"]
    ping(lab.pod_run("a", "ping", "-c1", "-W2", HOST_V4), "pod -> host over IPv4")
    ping(lab.pod_run("a", "ping", "-c1", "-W2", HOST_V6), "pod -> host over IPv6")
    checked = node.check("a")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    node.delete("a")
    assert links(lab.host_run) == ["lo"]
    with contextlib.closing(sqlite3.connect(daemon.state_dir / "state.db")) as db:
        assert db.execute("SELECT * FROM assignments").fetchall() == []
