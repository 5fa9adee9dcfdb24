"""A minimal rtnetlink client for the ADD/DEL hot path: fixed requests packed with `struct`.

Why not pyroute2 here: building the same ten requests through pyroute2's request layer costs
~5 ms of Python CPU per pod against ~0.2 ms of kernel time, on the daemon's one thread; in a burst
of sandboxes that CPU is what every other ADD queues behind (docs/benchmarks.md, "Pod interface
attach, per address family").
The kernel handles an rtnetlink request inside `send()`, so the acknowledgement is already queued
when `recv()` runs: a blocking socket costs no more loop time than an asynchronous one would.
pyroute2 still decodes dumps where the daemon reads state back (`netlink.check`).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator

NETLINK_ROUTE = 0
RTMGRP_LINK = 0x1
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_NEWROUTE = 20, 24
RTM_NEWNEIGH, RTM_DELNEIGH, RTM_GETNEIGH = 28, 29, 30
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_LINKINFO, IFLA_NET_NS_FD = 1, 3, 4, 18, 28
IFLA_AF_SPEC, IFLA_INET_CONF, IPV4_DEVCONF_PROXY_ARP = 26, 1, 3
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFA_F_NODAD = 0x02
RTA_DST, RTA_OIF, RTA_GATEWAY = 1, 4, 5
NDA_DST, NDA_LLADDR = 1, 2
IFF_UP = 0x1
RT_TABLE_MAIN, RTPROT_BOOT, RTN_UNICAST = 254, 3, 1
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK = 0, 253
NUD_PERMANENT = 0x80
NTF_PROXY = 0x08

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst/src len, tos, table, proto, scope, type
_NDMSG = struct.Struct("=BxxxiHBB")  # ndmsg: family, ifindex, state, flags, type
_ERROR = struct.Struct("=i")
_REPLY_TIMEOUT_SECONDS = 5.0


def attr(kind: int, payload: bytes) -> bytes:
    """One rtattr, padded to the 4-byte boundary the kernel expects."""
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _name(value: str) -> bytes:
    return value.encode() + b"\0"


def _u32(value: int) -> bytes:
    return struct.pack("=I", value)


def _mac(value: str) -> bytes:
    return bytes.fromhex(value.replace(":", ""))


def _ip(address: str) -> tuple[int, bytes]:
    """The address family and the packed address, as the kernel's attributes carry it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return family, socket.inet_pton(family, address)


def veth_pair(
    host: str, host_mac: str, peer: str, peer_mac: str, peer_netns_fd: int, mtu: int
) -> bytes:
    """RTM_NEWLINK body: a veth pair with its final names, MTU and MACs, the host end up and
    the peer created straight in the namespace behind `peer_netns_fd`."""
    peer_info = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + b"".join(
        (
            attr(IFLA_IFNAME, _name(peer)),
            attr(IFLA_NET_NS_FD, _u32(peer_netns_fd)),
            attr(IFLA_MTU, _u32(mtu)),
            attr(IFLA_ADDRESS, _mac(peer_mac)),
        )
    )
    link_info = attr(IFLA_INFO_KIND, b"veth\0") + attr(
        IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer_info)
    )
    return _IFINFO.pack(socket.AF_UNSPEC, 0, 0, IFF_UP, IFF_UP) + b"".join(
        (
            attr(IFLA_IFNAME, _name(host)),
            attr(IFLA_MTU, _u32(mtu)),
            attr(IFLA_ADDRESS, _mac(host_mac)),
            attr(IFLA_LINKINFO, link_info),
        )
    )


def link_up(index: int) -> bytes:
    """RTM_NEWLINK body that only sets IFF_UP on an existing link."""
    return _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP)


def proxy_arp(index: int) -> bytes:
    """RTM_NEWLINK body that turns on proxy-ARP on an existing link: the same setting as
    /proc/sys/net/ipv4/conf/<link>/proxy_arp, set without writing /proc/sys (read-only under
    the systemd unit's ProtectKernelTunables=)."""
    conf = attr(IFLA_INET_CONF, attr(IPV4_DEVCONF_PROXY_ARP, _u32(1)))
    return _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + attr(
        IFLA_AF_SPEC, attr(socket.AF_INET, conf)
    )


def link_by_name(name: str) -> bytes:
    """RTM_GETLINK/RTM_DELLINK body naming the link instead of giving its index."""
    return _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, _name(name))


def link_by_index(index: int) -> bytes:
    return _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0)


def ip_address(index: int, address: str, prefixlen: int, flags: int = 0) -> bytes:
    """RTM_NEWADDR body, IPv4 or IPv6 by the address; the local and the peer address are the
    same. `flags` go in ifaddrmsg's one-byte field, enough for IFA_F_NODAD (an IPv6 address
    usable at once, without the second of duplicate address detection)."""
    family, raw = _ip(address)
    return _IFADDR.pack(family, prefixlen, flags, RT_SCOPE_UNIVERSE, index) + (
        attr(IFA_LOCAL, raw) + attr(IFA_ADDRESS, raw)
    )


def route(dst: str, dst_len: int, oif: int, gateway: str | None = None) -> bytes:
    """RTM_NEWROUTE body in the main table, IPv4 or IPv6 by `dst`. An IPv4 route without a
    gateway is on-link (scope link); IPv6 routes are always scope universe (as `ip -6 route`
    sends them; the kernel ignores the scope of an IPv6 route)."""
    family, raw_dst = _ip(dst)
    on_link = gateway is None and family == socket.AF_INET
    scope = RT_SCOPE_LINK if on_link else RT_SCOPE_UNIVERSE
    header = _RTMSG.pack(family, dst_len, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, scope, RTN_UNICAST, 0)
    attrs = attr(RTA_OIF, _u32(oif))
    if dst_len:
        attrs = attr(RTA_DST, raw_dst) + attrs
    if gateway:
        attrs += attr(RTA_GATEWAY, _ip(gateway)[1])
    return header + attrs


def permanent_neighbour(index: int, address: str, mac: str) -> bytes:
    """RTM_NEWNEIGH body: a static ARP (IPv4) or NDP (IPv6) entry, so nobody resolves it."""
    family, raw = _ip(address)
    return _NDMSG.pack(family, index, NUD_PERMANENT, 0, 0) + (
        attr(NDA_DST, raw) + attr(NDA_LLADDR, _mac(mac))
    )


def proxy_neighbour(index: int, address: str) -> bytes:
    """RTM_NEWNEIGH/RTM_DELNEIGH body of a proxy entry (`ip neigh add proxy ADDRESS dev LINK`):
    the node answers ARP (IPv4) or neighbour solicitations (IPv6) for `address` on link
    `index` with that link's MAC."""
    family, raw = _ip(address)
    return _NDMSG.pack(family, index, NUD_PERMANENT, NTF_PROXY, 0) + attr(NDA_DST, raw)


def changed_links(data: bytes) -> set[int]:
    """The indexes of the links an RTM_NEWLINK or RTM_DELLINK notification in `data` names."""
    found = set()
    offset = 0
    while offset + _HEADER.size + _IFINFO.size <= len(data):
        length, kind, _flags, _sequence, _port = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size:
            break
        if kind in (RTM_NEWLINK, RTM_DELLINK):
            found.add(_IFINFO.unpack_from(data, offset + _HEADER.size)[2])
        offset += (length + 3) & ~3
    return found


def proxy_dump() -> bytes:
    """RTM_GETNEIGH dump body: the proxy entries of every family and link."""
    return _NDMSG.pack(socket.AF_UNSPEC, 0, 0, NTF_PROXY, 0)


def proxy_entries(messages: list[bytes]) -> list[tuple[int, str]]:
    """(link index, address) of each proxy entry among the RTM_NEWNEIGH messages of a dump."""
    entries = []
    for message in messages:
        family, index, _state, flags, _type = _NDMSG.unpack_from(message, _HEADER.size)
        if not flags & NTF_PROXY:
            continue
        offset = _HEADER.size + _NDMSG.size
        while offset + 4 <= len(message):
            length, kind = struct.unpack_from("=HH", message, offset)
            if length < 4:
                break
            if kind == NDA_DST:
                raw = message[offset + 4 : offset + length]
                entries.append((index, socket.inet_ntop(family, raw)))
            offset += (length + 3) & ~3
    return entries


CREATE = NLM_F_CREATE | NLM_F_EXCL
REPLACE = NLM_F_CREATE | NLM_F_REPLACE


class Rtnl:
    """One NETLINK_ROUTE socket; each request waits for its own acknowledgement or reply.
    Use with `contextlib.closing`."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock or socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
        self.sock.settimeout(_REPLY_TIMEOUT_SECONDS)
        self._sequence = 0

    def close(self) -> None:
        self.sock.close()

    def _send(self, kind: int, body: bytes, flags: int) -> int:
        """Send one request; returns its sequence number."""
        self._sequence += 1
        header = _HEADER.pack(
            _HEADER.size + len(body), kind, NLM_F_REQUEST | flags, self._sequence, 0
        )
        self.sock.send(header + body)
        return self._sequence

    def _replies(self, sequence: int) -> Iterator[tuple[int, bytes]]:
        """(type, message) of each reply to request `sequence`, as they come; an error reply
        raises OSError with the kernel's errno (an acknowledgement, errno 0, is yielded)."""
        while True:
            data = self.sock.recv(1 << 20)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, reply, _flags, reply_sequence, _port = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    raise OSError(errno.EPROTO, f"malformed netlink message of {length} bytes")
                message = data[offset : offset + length]
                offset += (length + 3) & ~3
                if reply_sequence != sequence:
                    continue  # an answer to an earlier request that timed out
                if reply == NLMSG_ERROR:
                    (code,) = _ERROR.unpack_from(message, _HEADER.size)
                    if code:
                        raise OSError(-code, os.strerror(-code))
                yield reply, message

    def request(self, kind: int, body: bytes, flags: int = 0) -> bytes:
        """Send one request and return the kernel's reply message (the ack for a change).

        Raises OSError with the kernel's errno when it refuses the request.
        """
        ack = 0 if kind == RTM_GETLINK else NLM_F_ACK
        sequence = self._send(kind, body, ack | flags)
        return next(self._replies(sequence))[1]

    def dump(self, kind: int, body: bytes) -> list[bytes]:
        """Send one dump request and return every message of the reply, up to NLMSG_DONE.

        Raises OSError with the kernel's errno when it refuses the request.
        """
        messages: list[bytes] = []
        for reply, message in self._replies(self._send(kind, body, NLM_F_DUMP)):
            if reply == NLMSG_DONE:
                return messages
            messages.append(message)
        raise AssertionError("unreachable: the replies end only by raising")

    def link_index(self, name: str) -> int | None:
        """The index of link `name` in this socket's namespace, None if there is none."""
        try:
            reply = self.request(RTM_GETLINK, link_by_name(name))
        except OSError as exc:
            if exc.errno in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        (index,) = struct.unpack_from("=i", reply, _HEADER.size + 4)
        return int(index)
