"""Pod interfaces in the "transparent" style: a veth pair per pod, no bridge.

In the pod: `eth0` with the pod IP as /32, a link-local gateway (169.254.1.1) as the only route
target, and a permanent neighbour entry for it pointing at the host veth's MAC, so the pod never
ARPs for its gateway. On the host: a /32 route to the pod via the host veth, and proxy-ARP on that
veth. Pods on the node reach each other and the host through the host's routing table; the pod
subnet never appears on a host interface. ADD and DEL send fixed requests through cns/rtnl.py;
CHECK reads the state back with pyroute2's AsyncIPRoute, which decodes the dumps.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import AsyncIPRoute

from cns import rtnl

GATEWAY = "169.254.1.1"
CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # ioctl(2) on an nsfs descriptor: the CLONE_NEW* type of its namespace
_libc = ctypes.CDLL(None, use_errno=True)
LOOPBACK_INDEX = 1  # the kernel gives `lo` index 1 in every network namespace
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class AttachError(Exception):
    """The pod's interface could not be set up or checked; the message says which step."""


@dataclass(frozen=True, slots=True)
class Attachment:
    host_ifname: str
    host_mac: str
    sandbox_mac: str
    mtu: int


def _digest(container_id: str, ifname: str) -> str:
    return hashlib.sha1(f"{container_id}/{ifname}".encode()).hexdigest()


def host_ifname(container_id: str, ifname: str) -> str:
    """Stable host veth name per attachment (`cns` + 11 hex chars: 14 < IFNAMSIZ)."""
    return f"cns{_digest(container_id, ifname)[:11]}"


def _mac_pair(container_id: str, ifname: str) -> tuple[str, str]:
    """Stable, locally administered unicast MACs for the host and the pod end.

    Chosen by us rather than read back from the kernel, which saves two link dumps per ADD and
    gives a repeated ADD the same result. Each veth is its own point-to-point segment, so the
    MACs only need to differ from each other.
    """
    digest = _digest(container_id, ifname)
    octets = [digest[i : i + 2] for i in range(12, 22, 2)]
    return "ee:" + ":".join(octets), "02:" + ":".join(octets)


def open_netns(netns: str) -> int:
    """A descriptor of the network namespace at `netns`; AttachError if there is none there.

    The path comes from the runtime, so it is opened without blocking (a FIFO would block the
    opening thread until a writer came: forever) and without becoming our terminal, then asked
    what it is: a regular file, a directory or a device gets a clear error rather than EINVAL
    from setns(2) or from the kernel's link request.
    """
    try:
        fd = os.open(netns, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AttachError(f"network namespace {netns} does not exist") from None
    except OSError as exc:
        raise AttachError(f"cannot open network namespace {netns}: {exc.strerror}") from None
    try:
        kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError:  # ENOTTY: not a namespace at all
        kind = None
    if kind != CLONE_NEWNET:
        os.close(fd)
        raise AttachError(f"{netns} is not a network namespace")
    return fd


def _socket_in(netns: str) -> socket.socket:
    """A NETLINK_ROUTE socket inside `netns`, opened by this thread entering it and leaving at once.

    pyroute2's own NetNS forks a helper process; in an asyncio daemon the child inherits the
    loop's signal wake-up fd, and the SIGTERM that ends the helper reaches the daemon's loop as
    its own. setns() moves only the calling thread, which goes straight back (no await between).
    """
    target = open_netns(netns)
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns}")
            try:
                return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, rtnl.NETLINK_ROUTE)
            finally:
                if _libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the host namespace")
        finally:
            os.close(own)
    finally:
        os.close(target)


def enable_forwarding() -> None:
    """Pod-to-pod traffic is routed by the host: IPv4 forwarding must be on.

    Written only when it is off: under the systemd unit /proc/sys is read-only
    (ProtectKernelTunables=) and the operator sets it (README, "Running under systemd").
    """
    if IP_FORWARD.read_text().strip() == "1":
        return
    try:
        IP_FORWARD.write_text("1")
    except OSError as exc:
        raise AttachError(
            f"net.ipv4.ip_forward is 0 and cns cannot set it ({exc.strerror}): "
            "set net.ipv4.ip_forward=1 on the node (e.g. in /etc/sysctl.d/)"
        ) from exc


def attach(netns: str, ifname: str, container_id: str, address: str, mtu: int) -> Attachment:
    """Create (or, on a repeated ADD, complete) the pod's veth pair; idempotent.

    The pair is created with its final names, MTU and MACs and the host end up, in one request,
    straight into the pod's namespace: eleven netlink round trips in all, as few as the topology
    allows (the pod end's flags and addresses can only be set once it exists). Synchronous: each
    request is done by the kernel inside send() (cns/rtnl.py).
    """
    ip = ipaddress.ip_address(address)
    if ip.version != 4:
        raise AttachError(f"{address}: only IPv4 pod addresses are supported by cns-cni")
    netns_fd = open_netns(netns)
    host = host_ifname(container_id, ifname)
    host_mac, sandbox_mac = _mac_pair(container_id, ifname)
    try:
        with contextlib.closing(rtnl.Rtnl()) as ipr:
            veth = rtnl.veth_pair(host, host_mac, ifname, sandbox_mac, netns_fd, mtu)
            try:
                ipr.request(rtnl.RTM_NEWLINK, veth, rtnl.CREATE)
            except OSError as exc:
                if exc.errno != errno.EEXIST:  # a repeated ADD, or the pod already has `ifname`
                    raise AttachError(f"creating veth {host} into {netns}: {exc}") from exc
            index = ipr.link_index(host)
            if index is None:
                raise AttachError(f"creating veth {host} into {netns}: {ifname} exists in the pod")
            ipr.request(rtnl.RTM_NEWLINK, rtnl.proxy_arp(index))
            # A repeated ADD finds the route already there.
            ipr.request(rtnl.RTM_NEWROUTE, rtnl.ipv4_route(address, 32, index), rtnl.REPLACE)
    finally:
        os.close(netns_fd)
    try:
        with contextlib.closing(rtnl.Rtnl(_socket_in(netns))) as ns:
            pod = ns.link_index(ifname)
            if pod is None:
                raise AttachError(f"no {ifname} in {netns}")
            ns.request(rtnl.RTM_NEWLINK, rtnl.link_up(pod))
            ns.request(rtnl.RTM_NEWLINK, rtnl.link_up(LOOPBACK_INDEX))
            with contextlib.suppress(FileExistsError):  # a repeated ADD
                ns.request(rtnl.RTM_NEWADDR, rtnl.ipv4_address(pod, address, 32), rtnl.CREATE)
            ns.request(rtnl.RTM_NEWROUTE, rtnl.ipv4_route(GATEWAY, 32, pod), rtnl.REPLACE)
            ns.request(rtnl.RTM_NEWROUTE, rtnl.ipv4_route("0.0.0.0", 0, pod, GATEWAY), rtnl.REPLACE)
            neighbour = rtnl.permanent_neighbour(pod, GATEWAY, host_mac)
            ns.request(rtnl.RTM_NEWNEIGH, neighbour, rtnl.REPLACE)
    except OSError as exc:
        raise AttachError(f"configuring {ifname} in {netns}: {exc}") from exc
    return Attachment(host, host_mac, sandbox_mac, mtu)


def detach(container_id: str, ifname: str) -> bool:
    """Delete the host veth (its peer and the /32 route go with it). False if already gone."""
    host = host_ifname(container_id, ifname)
    with contextlib.closing(rtnl.Rtnl()) as ipr:
        index = ipr.link_index(host)
        if index is None:
            return False
        try:
            ipr.request(rtnl.RTM_DELLINK, rtnl.link_by_index(index))
        except OSError as exc:
            if exc.errno not in (errno.ENODEV, errno.ENOENT):
                raise
            return False
    return True


def host_link_exists(container_id: str, ifname: str) -> bool:
    with contextlib.closing(rtnl.Rtnl()) as ipr:
        return ipr.link_index(host_ifname(container_id, ifname)) is not None


async def check(netns: str, ifname: str, container_id: str, address: str) -> list[str]:
    """What differs from a correct attachment; empty when the pod's network is intact."""
    problems: list[str] = []
    host = host_ifname(container_id, ifname)
    async with AsyncIPRoute() as ipr:
        found = await ipr.link_lookup(ifname=host)
        if not found:
            return [f"host veth {host} is missing"]
        routes = [r async for r in await ipr.get_routes(dst=f"{address}/32", table=254)]
        if not any(r.get_attr("RTA_OIF") == found[0] for r in routes):
            problems.append(f"host route {address}/32 via {host} is missing")
    if not os.path.exists(netns):
        return [*problems, f"network namespace {netns} is gone"]
    try:
        inside = _socket_in(netns)
    except (AttachError, OSError) as exc:  # not a namespace, or setns refused
        return [*problems, str(exc)]
    async with AsyncIPRoute(fileno=inside.detach()) as ns:
        pod = await ns.link_lookup(ifname=ifname)
        if not pod:
            return [*problems, f"{ifname} is missing in {netns}"]
        addresses = {
            a.get_attr("IFA_ADDRESS") async for a in await ns.get_addr(index=pod[0], family=2)
        }
        if address not in addresses:
            problems.append(f"{ifname} does not carry {address}")
        defaults = [
            r
            async for r in await ns.get_routes(family=2, table=254)
            if r["dst_len"] == 0 and r.get_attr("RTA_GATEWAY") == GATEWAY
        ]
        if not defaults:
            problems.append(f"default route via {GATEWAY} is missing in {netns}")
    return problems
