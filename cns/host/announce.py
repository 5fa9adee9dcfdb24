"""Announcing that this node now answers for an address: gratuitous ARP and unsolicited
neighbour advertisements, as raw Ethernet frames on the uplink.

A neighbour on the LAN that cached another node's MAC for a pod address (the pod was there
before) would otherwise keep sending to that node until its entry goes stale (tens of seconds).
IPv4: an ARP request with sender and target IP both the address, sender MAC the uplink's,
broadcast; a neighbour that holds an entry for the address takes the new MAC (the kernel treats
sender = target as gratuitous and overrides its entry). IPv6: a neighbour advertisement to
ff02::1 (all nodes) with the override flag and the uplink's MAC as target link-layer address,
which replaces the MAC of an existing entry (RFC 4861, 7.2.6).

The frames are packed here without any privilege (unit-tested); sending them needs an AF_PACKET
socket, hence CAP_NET_RAW.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable

BROADCAST = b"\xff" * 6
ALL_NODES = ipaddress.IPv6Address("ff02::1")
ALL_NODES_MAC = b"\x33\x33\x00\x00\x00\x01"  # 33:33 + the group's low 32 bits (RFC 2464)
ETH_P_IP, ETH_P_ARP, ETH_P_IPV6 = 0x0800, 0x0806, 0x86DD
ARP_ETHERNET = 1
ARP_REQUEST = 1
ICMPV6, NEIGHBOUR_ADVERTISEMENT, HOP_LIMIT = 58, 136, 255
NA_OVERRIDE = 0x20000000
TARGET_LINK_LAYER_ADDRESS = 2

_ETHERNET = struct.Struct("!6s6sH")
_ARP = struct.Struct("!HHBBH6s4s6s4s")  # hardware/protocol type and size, op, sha, spa, tha, tpa
_IPV6 = struct.Struct("!IHBB16s16s")  # version/class/flow, payload length, next header, hops


def gratuitous_arp(mac: bytes, address: ipaddress.IPv4Address) -> bytes:
    """The broadcast ARP request that tells the LAN `address` is at `mac`."""
    ip = address.packed
    arp = _ARP.pack(ARP_ETHERNET, ETH_P_IP, 6, 4, ARP_REQUEST, mac, ip, b"\0" * 6, ip)
    return _ETHERNET.pack(BROADCAST, mac, ETH_P_ARP) + arp


def _checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071)."""
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def unsolicited_advertisement(mac: bytes, address: ipaddress.IPv6Address) -> bytes:
    """The neighbour advertisement to all nodes that tells the LAN `address` is at `mac`
    (override set, solicited and router clear), sent from `address` itself."""
    option = struct.pack("!BB6s", TARGET_LINK_LAYER_ADDRESS, 1, mac)
    body = struct.pack("!I16s", NA_OVERRIDE, address.packed) + option
    length = 4 + len(body)
    pseudo = address.packed + ALL_NODES.packed + struct.pack("!I3xB", length, ICMPV6)
    checksum = _checksum(pseudo + struct.pack("!BBH", NEIGHBOUR_ADVERTISEMENT, 0, 0) + body)
    icmp = struct.pack("!BBH", NEIGHBOUR_ADVERTISEMENT, 0, checksum) + body
    ip = _IPV6.pack(6 << 28, length, ICMPV6, HOP_LIMIT, address.packed, ALL_NODES.packed)
    return _ETHERNET.pack(ALL_NODES_MAC, mac, ETH_P_IPV6) + ip + icmp


def announcement(mac: bytes, address: str) -> bytes:
    """The frame announcing `address` (IPv4 or IPv6) at `mac`."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv4Address):
        return gratuitous_arp(mac, ip)
    return unsolicited_advertisement(mac, ip)


class Announcer:
    """One AF_PACKET socket, opened at the first announcement and kept: closing one waits for an
    RCU grace period (3-12 ms measured), which every ADD would pay. Non-blocking: a full device
    queue is a failed announcement (OSError), never a stalled event loop."""

    def __init__(self, uplink: str) -> None:
        self.uplink = uplink
        self._sock: socket.socket | None = None

    def send(self, frames: Iterable[bytes]) -> None:
        """Send each frame as it is on the uplink (OSError: no CAP_NET_RAW, no such link...)."""
        if self._sock is None:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
            sock.setblocking(False)
            self._sock = sock
        for frame in frames:
            self._sock.sendto(frame, (self.uplink, 0))
