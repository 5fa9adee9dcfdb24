"""cns/host/rtnl.py and the synchronous attach/detach built on it.

The encoders are checked by decoding their bytes with pyroute2 (an independent implementation of
the same wire format); the requests and `cns.host.datapath` are checked against the real kernel in
scratch namespaces (root).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.ndmsg import ndmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from cns.host import datapath, rtnl
from tests.harness import REPO


def decoded(message_class: type, kind: int, body: bytes) -> Any:  # a pyroute2 message
    header = rtnl._HEADER.pack(rtnl._HEADER.size + len(body), kind, rtnl.NLM_F_REQUEST, 1, 0)
    message = message_class(header + body)
    message.decode()
    return message


def test_attributes_are_padded_to_four_bytes() -> None:
    assert rtnl.attr(3, b"eth0\0") == b"\x09\x00\x03\x00eth0\0\0\0\0"
    assert rtnl.attr(4, b"\xdc\x05\0\0") == b"\x08\x00\x04\x00\xdc\x05\0\0"


def test_veth_request_decodes_to_the_pair_we_asked_for() -> None:
    body = rtnl.veth_pair("cnsabc", "ee:01:02:03:04:05", "eth0", "02:01:02:03:04:05", 7, 1400)
    message = decoded(ifinfmsg, rtnl.RTM_NEWLINK, body)
    assert message["flags"] & rtnl.IFF_UP and message["change"] & rtnl.IFF_UP
    assert message.get_attr("IFLA_IFNAME") == "cnsabc"
    assert message.get_attr("IFLA_MTU") == 1400
    assert message.get_attr("IFLA_ADDRESS") == "ee:01:02:03:04:05"
    info = message.get_attr("IFLA_LINKINFO")
    assert info.get_attr("IFLA_INFO_KIND") == "veth"
    peer = info.get_attr("IFLA_INFO_DATA").get_attr("VETH_INFO_PEER")
    assert peer.get_attr("IFLA_IFNAME") == "eth0"
    assert peer.get_attr("IFLA_NET_NS_FD") == 7
    assert peer.get_attr("IFLA_MTU") == 1400
    assert peer.get_attr("IFLA_ADDRESS") == "02:01:02:03:04:05"


def test_address_route_and_neighbour_requests_decode() -> None:
    address = decoded(ifaddrmsg, rtnl.RTM_NEWADDR, rtnl.ip_address(5, "10.1.2.3", 32))
    assert (address["family"], address["prefixlen"], address["index"]) == (2, 32, 5)
    assert address.get_attr("IFA_LOCAL") == address.get_attr("IFA_ADDRESS") == "10.1.2.3"

    host_route = decoded(rtmsg, rtnl.RTM_NEWROUTE, rtnl.route("10.1.2.3", 32, 9))
    assert (host_route["dst_len"], host_route["table"]) == (32, 254)
    assert host_route["scope"] == rtnl.RT_SCOPE_LINK
    assert host_route.get_attr("RTA_DST") == "10.1.2.3" and host_route.get_attr("RTA_OIF") == 9
    assert host_route.get_attr("RTA_GATEWAY") is None

    default = decoded(rtmsg, rtnl.RTM_NEWROUTE, rtnl.route("0.0.0.0", 0, 2, datapath.GATEWAY))
    assert default["dst_len"] == 0 and default.get_attr("RTA_DST") is None
    assert default["scope"] == rtnl.RT_SCOPE_UNIVERSE
    assert default.get_attr("RTA_GATEWAY") == datapath.GATEWAY

    neighbour = decoded(
        ndmsg, rtnl.RTM_NEWNEIGH, rtnl.permanent_neighbour(2, datapath.GATEWAY, "ee:00:00:00:00:01")
    )
    assert (neighbour["ifindex"], neighbour["state"]) == (2, rtnl.NUD_PERMANENT)
    assert neighbour.get_attr("NDA_DST") == datapath.GATEWAY
    assert neighbour.get_attr("NDA_LLADDR") == "ee:00:00:00:00:01"


def test_ipv6_address_request_has_nodad_and_decodes() -> None:
    body = rtnl.ip_address(5, "fd00:c5::a", 128, rtnl.IFA_F_NODAD)
    address = decoded(ifaddrmsg, rtnl.RTM_NEWADDR, body)
    assert (address["family"], address["prefixlen"], address["index"]) == (10, 128, 5)
    assert address["flags"] == rtnl.IFA_F_NODAD == 0x02  # IFA_F_NODAD in linux/if_addr.h
    assert address.get_attr("IFA_LOCAL") == address.get_attr("IFA_ADDRESS") == "fd00:c5::a"
    # ifaddrmsg (8 bytes), then IFA_LOCAL and IFA_ADDRESS: 4-byte header, the 16 address bytes
    packed = ipaddress.IPv6Address("fd00:c5::a").packed
    assert body[8:12] == b"\x14\x00\x02\x00" and body[12:28] == packed
    assert body[28:32] == b"\x14\x00\x01\x00" and body[32:48] == packed and len(body) == 48


def test_ipv6_route_requests_decode_with_universe_scope() -> None:
    host_route = decoded(rtmsg, rtnl.RTM_NEWROUTE, rtnl.route("fd00:c5::a", 128, 9))
    assert (host_route["family"], host_route["dst_len"], host_route["table"]) == (10, 128, 254)
    assert host_route["scope"] == rtnl.RT_SCOPE_UNIVERSE  # what `ip -6 route add` sends
    assert host_route.get_attr("RTA_DST") == "fd00:c5::a" and host_route.get_attr("RTA_OIF") == 9
    assert host_route.get_attr("RTA_GATEWAY") is None

    default = decoded(rtmsg, rtnl.RTM_NEWROUTE, rtnl.route("::", 0, 2, datapath.GATEWAY6))
    assert (default["family"], default["dst_len"]) == (10, 0)
    assert default.get_attr("RTA_DST") is None and default.get_attr("RTA_OIF") == 2
    assert default.get_attr("RTA_GATEWAY") == "fe80::1"


def test_ipv6_neighbour_request_decodes() -> None:
    body = rtnl.permanent_neighbour(2, datapath.GATEWAY6, "ee:00:00:00:00:01")
    neighbour = decoded(ndmsg, rtnl.RTM_NEWNEIGH, body)
    assert (neighbour["family"], neighbour["ifindex"]) == (10, 2)
    assert neighbour["state"] == rtnl.NUD_PERMANENT
    assert neighbour.get_attr("NDA_DST") == "fe80::1"
    assert neighbour.get_attr("NDA_LLADDR") == "ee:00:00:00:00:01"


def run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"cns-rtnl-{uuid.uuid4().hex[:8]}"
    run("ip", "netns", "add", name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_the_kernel_refusal_comes_back_as_its_errno() -> None:
    with contextlib.closing(rtnl.Rtnl()) as ipr:
        assert ipr.link_index("lo") == 1
        assert ipr.link_index("cns-nonesuch") is None
        with pytest.raises(OSError) as refused:
            ipr.request(rtnl.RTM_DELLINK, rtnl.link_by_index(2**31 - 1))
        assert refused.value.errno == errno.ENODEV


def test_attach_builds_the_pod_network_and_is_idempotent(netns: str) -> None:
    path = f"/var/run/netns/{netns}"
    container = f"rtnl-{netns}"
    try:
        first = datapath.attach(path, "eth0", container, ["10.254.7.9"], 1400)
        again = datapath.attach(path, "eth0", container, ["10.254.7.9"], 1400)
        assert again == first
        assert datapath.host_link_exists(container, "eth0")
        host = run("ip", "-o", "link", "show", first.host_ifname)
        assert "mtu 1400" in host and first.host_mac in host and "UP" in host
        assert f"10.254.7.9 dev {first.host_ifname} scope link" in run("ip", "-4", "route")
        in_pod = ("ip", "netns", "exec", netns)
        pod = run(*in_pod, "ip", "-o", "link", "show", "eth0")
        assert "mtu 1400" in pod and first.sandbox_mac in pod and "state UP" in pod
        assert "state UNKNOWN" in run(*in_pod, "ip", "-o", "link", "show", "lo")  # lo is up
        assert run(*in_pod, "ip", "-4", "-o", "addr", "show", "eth0").count("10.254.7.9/32") == 1
        routes = run(*in_pod, "ip", "-4", "route")
        assert "default via 169.254.1.1 dev eth0" in routes
        assert "169.254.1.1 dev eth0 scope link" in routes
        neighbour = run(*in_pod, "ip", "neigh", "show", "169.254.1.1")
        assert first.host_mac in neighbour and "PERMANENT" in neighbour
        proxy_arp = Path(f"/proc/sys/net/ipv4/conf/{first.host_ifname}/proxy_arp")
        assert proxy_arp.read_text().strip() == "1"
    finally:
        assert datapath.detach(container, "eth0")
    assert not datapath.detach(container, "eth0")
    assert not datapath.host_link_exists(container, "eth0")
    assert "10.254.7.9" not in run("ip", "-4", "route")


def test_attach_writes_nothing_under_proc_sys(netns: str) -> None:
    """The systemd unit makes /proc/sys read-only (ProtectKernelTunables=): proxy-ARP is set
    through rtnetlink. Here attach runs in a mount namespace where /proc/sys is read-only."""
    container = f"rtnl-ro-{netns}"
    script = (
        "import errno\n"
        "try:\n    open('/proc/sys/net/ipv4/ip_forward', 'w')\n"
        "except OSError as exc:\n    assert exc.errno == errno.EROFS, exc\n"
        "else:\n    raise SystemExit('/proc/sys is writable')\n"
        "from cns.host import datapath\n"
        f"datapath.attach('/var/run/netns/{netns}', 'eth0', {container!r}, ['10.254.7.11'], 1500)\n"
    )
    try:
        result = subprocess.run(
            ["unshare", "--mount", "sh", "-c",
             'mount --bind -o ro /proc/sys /proc/sys && exec "$0" -c "$1"', sys.executable, script],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        host = datapath.host_ifname(container, "eth0")
        assert Path(f"/proc/sys/net/ipv4/conf/{host}/proxy_arp").read_text().strip() == "1"
    finally:
        datapath.detach(container, "eth0")


def test_attach_refuses_what_it_cannot_build(netns: str) -> None:
    path = f"/var/run/netns/{netns}"
    with pytest.raises(datapath.AttachError, match="does not exist"):
        datapath.attach("/var/run/netns/cns-nonesuch", "eth0", "rtnl-x", ["10.254.7.10"], 1500)
    run("ip", "netns", "exec", netns, "ip", "link", "add", "eth0", "type", "veth")
    with pytest.raises(datapath.AttachError, match="eth0 exists in the pod"):
        datapath.attach(path, "eth0", "rtnl-x", ["10.254.7.10"], 1500)
    assert not datapath.host_link_exists("rtnl-x", "eth0")
