"""Pod interfaces in the "transparent" style: a veth pair per pod, no bridge.

In the pod: `eth0` with the pod IP as /32 (IPv4) and/or /128 (IPv6), a link-local gateway per
family (169.254.1.1, fe80::1) as the only route target, and a permanent neighbour entry for it
pointing at the host veth's MAC, so the pod never resolves its gateway. On the host: a /32 or
/128 route to the pod via the host veth, proxy-ARP on that veth (IPv4) and a permanent neighbour
entry for the pod's IPv6 address (`attach` says why not proxy-NDP). Pods on the node reach each
other and the host through the host's routing table; the pod subnet never appears on a host
interface. ADD and DEL send fixed requests through cns/host/rtnl.py; CHECK reads the state back with
pyroute2's AsyncIPRoute, which decodes the dumps.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2 import AsyncIPRoute

from cns.host import rtnl

GATEWAY = "169.254.1.1"
GATEWAY6 = "fe80::1"
GATEWAYS = {4: GATEWAY, 6: GATEWAY6}
DEFAULT_ROUTES = {4: "0.0.0.0/0", 6: "::/0"}
CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # ioctl(2) on an nsfs descriptor: the CLONE_NEW* type of its namespace
_libc = ctypes.CDLL(None, use_errno=True)
LOOPBACK_INDEX = 1  # the kernel gives `lo` index 1 in every network namespace
FORWARDING = {4: "net.ipv4.ip_forward", 6: "net.ipv6.conf.all.forwarding"}
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class AttachError(Exception):
    """The pod's interface could not be set up or checked; the message says which step."""


class HostNamespace(AttachError):
    """The namespace named for a pod is the one the daemon works in: the host's.

    Building a pod's interface there would put the pod's default route (via 169.254.1.1) in the
    host's table in place of the host's own, and the DEL that removes the veth would leave the
    host without one.
    """

    def __init__(self, netns: str) -> None:
        super().__init__(
            f"{netns} is the host's own network namespace (the one cns runs in), not a pod's"
        )
        self.netns = netns


OWN_NAMESPACE = "/proc/thread-self/ns/net"


def _identity(status: os.stat_result) -> tuple[int, int]:
    """What makes two nsfs files one namespace, whatever their paths (`ip netns identify`)."""
    return status.st_dev, status.st_ino


def refuse_host_namespace(netns: str, fd: int | None = None) -> None:
    """HostNamespace if `netns` (or the namespace descriptor `fd` opened from it) is the calling
    thread's own network namespace, compared by identity: /proc/<pid>/ns/net, /proc/self/ns/net,
    a bind mount of it under /run/netns and a symlink to any of them are all the host. A path
    that cannot be looked up is left to the step that opens it."""
    try:
        named = os.fstat(fd) if fd is not None else os.stat(netns)
    except OSError:
        return
    if _identity(named) == _identity(os.stat(OWN_NAMESPACE)):
        raise HostNamespace(netns)


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
    """A descriptor of the network namespace at `netns`; AttachError if there is none there,
    HostNamespace if it is the calling thread's own (checked on the descriptor, so a path
    swapped since an earlier check cannot slip the host in).

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
    try:
        if kind != CLONE_NEWNET:
            raise AttachError(f"{netns} is not a network namespace")
        refuse_host_namespace(netns, fd)
    except AttachError:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _inside(netns: str) -> Iterator[None]:
    """This thread inside `netns` for the `with` body, which must not await (nothing else may
    run on the thread meanwhile), and back in its own namespace after.

    pyroute2's own NetNS forks a helper process; in an asyncio daemon the child inherits the
    loop's signal wake-up fd, and the SIGTERM that ends the helper reaches the daemon's loop as
    its own. setns() moves only the calling thread; what it opens inside (a netlink socket, a
    file under /proc/sys/net) stays bound to that namespace after the thread has left.
    """
    target = open_netns(netns)
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns}")
            try:
                yield
            finally:
                if _libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the host namespace")
        finally:
            os.close(own)
    finally:
        os.close(target)


def _socket_in(netns: str) -> socket.socket:
    """A NETLINK_ROUTE socket inside `netns`."""
    with _inside(netns):
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, rtnl.NETLINK_ROUTE)


def enable_forwarding(version: int = 4) -> None:
    """Pod-to-pod traffic is routed by the host: forwarding must be on for each family a pod
    has an address of (IPv6: only then, see docs/networking.md for what it changes on the host).
    """
    ensure_sysctl(*FORWARDING[version].split("."), absent=f"IPv{version} is off in this kernel")


def ensure_sysctl(*keys: str, absent: str) -> None:
    """The sysctl `keys` (e.g. "net", "ipv4", "ip_forward") at 1; AttachError naming it when it
    does not exist (`absent` says why) or is 0 and cannot be set.

    Written only when it is off: under the systemd unit /proc/sys is read-only
    (ProtectKernelTunables=) and the operator sets it (README, "Running under systemd").
    """
    sysctl = ".".join(keys)
    path = Path("/proc/sys", *keys)
    try:
        if path.read_text().strip() == "1":
            return
    except FileNotFoundError:  # ipv6.disable=1 on the kernel's command line, no such link
        raise AttachError(f"{sysctl} does not exist: {absent}") from None
    try:
        path.write_text("1")
    except OSError as exc:
        raise AttachError(
            f"{sysctl} is 0 and cns cannot set it ({exc.strerror}): "
            f"set {sysctl}=1 on the node (e.g. in /etc/sysctl.d/)"
        ) from exc


def _enable_ipv6(ifname: str, where: str) -> None:
    """Clear disable_ipv6 on `ifname` in the calling thread's namespace (the kernel refuses
    IPv6 addresses and routes on a link where it is set with EACCES); AttachError naming the
    sysctl when /proc/sys is read-only (the systemd unit) or IPv6 is off in the kernel."""
    sysctl = f"net.ipv6.conf.{ifname}.disable_ipv6"
    try:
        Path("/proc/sys/net/ipv6/conf", ifname, "disable_ipv6").write_text("0")
    except OSError as exc:
        raise AttachError(
            f"IPv6 is disabled on {ifname} {where} and cns cannot enable it ({exc.strerror}): "
            f"set {sysctl}=0 (new links inherit net.ipv6.conf.default.disable_ipv6)"
        ) from exc


def _ipv6_request(
    ipr: rtnl.Rtnl, kind: int, body: bytes, flags: int, enable: Callable[[], None]
) -> None:
    """One IPv6 request; if the kernel refuses it because IPv6 is disabled on the link, `enable`
    it and send the request again. Costs nothing when IPv6 is on (the usual case)."""
    try:
        ipr.request(kind, body, flags)
    except PermissionError as exc:
        if exc.errno != errno.EACCES:  # EPERM: no CAP_NET_ADMIN, nothing to enable
            raise
        enable()
        ipr.request(kind, body, flags)


def pod_addresses(addresses: Sequence[str]) -> list[IPAddress]:
    """The pod's addresses, parsed: one or two, at most one per family; AttachError otherwise.

    One interface has one gateway per family, and the CNI result one default route per family:
    a second address of a family would need a policy (which is the source?) nobody asked for.
    """
    parsed: list[IPAddress] = []
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            raise AttachError(f"{address!r} is not an IP address") from None
        same = [p for p in parsed if p.version == ip.version]
        if same:
            raise AttachError(
                f"two IPv{ip.version} addresses ({same[0]}, {ip}): a pod interface takes at "
                "most one address per family"
            )
        parsed.append(ip)
    if not parsed:
        raise AttachError("no address to attach")
    return parsed


def attach(
    netns: str, ifname: str, container_id: str, addresses: Sequence[str], mtu: int
) -> Attachment:
    """Create (or, on a repeated ADD, complete) the pod's veth pair with one IPv4 and/or one
    IPv6 address; idempotent.

    The pair is created with its final names, MTU and MACs and the host end up, in one request,
    straight into the pod's namespace. Netlink round trips, as few as the topology allows (the
    pod end's flags and addresses can only be set once it exists): five for every pod (the
    veth, its index on the host and in the pod, the pod's link and `lo` up); IPv4 six more
    (proxy-ARP, host route; in the pod the address, the route to the gateway, the default route
    and the neighbour), IPv6 five more (host route and neighbour; in the pod the address, the
    default route and the neighbour): 11 for IPv4, 10 for IPv6, 16 for both. Synchronous: each
    request is done by the kernel inside send() (cns/host/rtnl.py).

    IPv6 mirrors IPv4 with permanent neighbour entries at both ends instead of proxy-ARP: the
    pod's gateway fe80::1 is a fixed link-local that no interface owns (like 169.254.1.1),
    resolved by a static entry to the host veth's MAC; the host resolves the pod's /128 by a
    static entry to the pod's MAC (which cns chose). Nothing on the veth ever sends a neighbour
    solicitation, so nothing waits for duplicate address detection: the host veth's own
    link-local, which NDP would have to send from, stays tentative for about a second after the
    link comes up, and the host's first packets to a new pod would wait (2 s measured,
    docs/networking.md). Proxy-NDP
    (proxy_ndp=1) is per address (`ip -6 neigh add proxy`), not per link like proxy-ARP, and
    the static entry already answers the one address the pod resolves. The pod's address is
    added with IFA_F_NODAD for the same reason: usable at once.
    """
    ips = pod_addresses(addresses)
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
            for ip in ips:
                # A repeated ADD finds the route (and the neighbour) already there.
                host_route = rtnl.route(str(ip), ip.max_prefixlen, index)
                if ip.version == 4:
                    ipr.request(rtnl.RTM_NEWLINK, rtnl.proxy_arp(index))
                    ipr.request(rtnl.RTM_NEWROUTE, host_route, rtnl.REPLACE)
                    continue
                enable = functools.partial(_enable_ipv6, host, "on the host")
                _ipv6_request(ipr, rtnl.RTM_NEWROUTE, host_route, rtnl.REPLACE, enable)
                neighbour = rtnl.permanent_neighbour(index, str(ip), sandbox_mac)
                ipr.request(rtnl.RTM_NEWNEIGH, neighbour, rtnl.REPLACE)
    except OSError as exc:
        raise AttachError(f"configuring {host} on the host: {exc}") from exc
    finally:
        os.close(netns_fd)
    try:
        with contextlib.closing(rtnl.Rtnl(_socket_in(netns))) as ns:
            pod = ns.link_index(ifname)
            if pod is None:
                raise AttachError(f"no {ifname} in {netns}")
            ns.request(rtnl.RTM_NEWLINK, rtnl.link_up(pod))
            ns.request(rtnl.RTM_NEWLINK, rtnl.link_up(LOOPBACK_INDEX))
            for ip in ips:
                _configure_pod(ns, netns, ifname, pod, ip, host_mac)
    except OSError as exc:
        raise AttachError(f"configuring {ifname} in {netns}: {exc}") from exc
    return Attachment(host, host_mac, sandbox_mac, mtu)


def _configure_pod(
    ns: rtnl.Rtnl, netns: str, ifname: str, pod: int, ip: IPAddress, host_mac: str
) -> None:
    """The pod's address, its family's gateway and the default route via it (the socket `ns`
    is inside the pod's namespace)."""
    gateway = GATEWAYS[ip.version]
    address = rtnl.ip_address(
        pod, str(ip), ip.max_prefixlen, 0 if ip.version == 4 else rtnl.IFA_F_NODAD
    )
    if ip.version == 4:
        with contextlib.suppress(FileExistsError):  # a repeated ADD
            ns.request(rtnl.RTM_NEWADDR, address, rtnl.CREATE)
        # IPv4 needs an on-link route to its gateway; an IPv6 link-local one is on-link already.
        ns.request(rtnl.RTM_NEWROUTE, rtnl.route(gateway, 32, pod), rtnl.REPLACE)
    else:

        def enable() -> None:
            with _inside(netns):
                _enable_ipv6(ifname, f"in {netns}")

        with contextlib.suppress(FileExistsError):
            _ipv6_request(ns, rtnl.RTM_NEWADDR, address, rtnl.CREATE, enable)
    default = "0.0.0.0" if ip.version == 4 else "::"
    ns.request(rtnl.RTM_NEWROUTE, rtnl.route(default, 0, pod, gateway), rtnl.REPLACE)
    neighbour = rtnl.permanent_neighbour(pod, gateway, host_mac)
    ns.request(rtnl.RTM_NEWNEIGH, neighbour, rtnl.REPLACE)


def detach(container_id: str, ifname: str) -> bool:
    """Delete the host veth: its peer, the host routes (/32, /128) and the neighbour entry for
    the pod's IPv6 address go with it. False if already gone."""
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


async def check(netns: str, ifname: str, container_id: str, addresses: Sequence[str]) -> list[str]:
    """What differs from a correct attachment of `addresses`; empty when the pod's network is
    intact: per address, the host route via the host veth, the address on the pod's interface
    and the family's default route via its gateway."""
    problems: list[str] = []
    ips = [ipaddress.ip_address(a) for a in addresses]
    host = host_ifname(container_id, ifname)
    async with AsyncIPRoute() as ipr:
        found = await ipr.link_lookup(ifname=host)
        if not found:
            return [f"host veth {host} is missing"]
        for ip in ips:
            # The routes through the host veth, not a lookup of the pod's address: on a node
            # without a route that covers it, a lookup fails (ENETUNREACH) instead of missing.
            routes = await ipr.get_routes(family=_family(ip), oif=found[0], table=254)
            if not [r async for r in routes if _is_host_route(r, ip)]:
                problems.append(f"host route {ip}/{ip.max_prefixlen} via {host} is missing")
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
        for ip in ips:
            family, gateway = _family(ip), GATEWAYS[ip.version]
            carried = {
                a.get_attr("IFA_ADDRESS")
                async for a in await ns.get_addr(index=pod[0], family=family)
            }
            if str(ip) not in carried:
                problems.append(f"{ifname} does not carry {ip}")
            defaults = [
                r
                async for r in await ns.get_routes(family=family, table=254)
                if r["dst_len"] == 0 and r.get_attr("RTA_GATEWAY") == gateway
            ]
            if not defaults:
                problems.append(f"default route via {gateway} is missing in {netns}")
    return problems


def _is_host_route(route: Any, ip: IPAddress) -> bool:
    return bool(route["dst_len"] == ip.max_prefixlen and route.get_attr("RTA_DST") == str(ip))


def _family(ip: IPAddress) -> int:
    return socket.AF_INET if ip.version == 4 else socket.AF_INET6
