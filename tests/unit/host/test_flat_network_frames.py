"""The flat-network mode's messages, packed without privilege: rtnetlink proxy entries and the
announcement frames (gratuitous ARP, unsolicited neighbour advertisement)."""

from __future__ import annotations

import ipaddress
import socket
import struct

from cns.host import announce, rtnl

MAC = bytes.fromhex("020000aabbcc")


def test_a_proxy_entry_is_an_ndmsg_with_ntf_proxy_and_the_address() -> None:
    body = rtnl.proxy_neighbour(7, "10.123.0.66")
    family, index, state, flags, kind = struct.unpack_from("=BxxxiHBB", body)
    assert (family, index, flags, kind) == (socket.AF_INET, 7, rtnl.NTF_PROXY, 0)
    assert state == rtnl.NUD_PERMANENT
    assert body[12:] == rtnl.attr(rtnl.NDA_DST, bytes([10, 123, 0, 66]))
    six = rtnl.proxy_neighbour(7, "fd00:123::41")
    assert six[0] == socket.AF_INET6
    assert six[12:] == rtnl.attr(rtnl.NDA_DST, ipaddress.IPv6Address("fd00:123::41").packed)


def _message(body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), rtnl.RTM_NEWNEIGH, 2, 1, 0) + body


def test_a_dump_yields_the_proxy_entries_with_their_link() -> None:
    ordinary = rtnl.permanent_neighbour(3, "10.123.0.9", "02:00:00:00:00:01")
    lladdr_after = rtnl.proxy_neighbour(5, "fd00:123::41") + rtnl.attr(rtnl.NDA_LLADDR, MAC)
    messages = [
        _message(rtnl.proxy_neighbour(4, "10.123.0.66")),
        _message(ordinary),  # not a proxy entry
        _message(lladdr_after),
    ]
    assert rtnl.proxy_entries(messages) == [(4, "10.123.0.66"), (5, "fd00:123::41")]


def test_the_dump_request_asks_for_proxy_entries_of_every_family() -> None:
    assert struct.unpack_from("=BxxxiHBB", rtnl.proxy_dump()) == (0, 0, 0, rtnl.NTF_PROXY, 0)


def test_gratuitous_arp_is_a_broadcast_request_with_sender_and_target_the_address() -> None:
    frame = announce.gratuitous_arp(MAC, ipaddress.IPv4Address("10.123.0.66"))
    assert len(frame) == 42
    destination, source, ethertype = struct.unpack_from("!6s6sH", frame)
    assert (destination, source, ethertype) == (b"\xff" * 6, MAC, 0x0806)
    hardware, protocol, hlen, plen, op, sha, spa, tha, tpa = struct.unpack_from(
        "!HHBBH6s4s6s4s", frame, 14
    )
    assert (hardware, protocol, hlen, plen, op) == (1, 0x0800, 6, 4, 1)
    assert sha == MAC and tha == b"\0" * 6
    assert spa == tpa == bytes([10, 123, 0, 66])


def test_unsolicited_advertisement_overrides_to_all_nodes_with_a_valid_checksum() -> None:
    address = ipaddress.IPv6Address("fd00:123::41")
    frame = announce.unsolicited_advertisement(MAC, address)
    destination, source, ethertype = struct.unpack_from("!6s6sH", frame)
    assert (destination, source, ethertype) == (bytes.fromhex("333300000001"), MAC, 0x86DD)
    first, length, next_header, hops, src, dst = struct.unpack_from("!IHBB16s16s", frame, 14)
    assert first >> 28 == 6 and (next_header, hops) == (58, 255)
    assert src == address.packed and dst == ipaddress.IPv6Address("ff02::1").packed
    icmp = frame[54:]
    assert len(icmp) == length == 32
    kind, code, _checksum, flags, target = struct.unpack_from("!BBHI16s", icmp)
    assert (kind, code) == (136, 0)
    assert flags == 0x20000000  # override; neither router nor solicited
    assert target == address.packed
    assert icmp[24:] == b"\x02\x01" + MAC  # target link-layer address option
    # The checksum over the pseudo-header and the message, checksum included, is zero.
    pseudo = src + dst + struct.pack("!I3xB", length, 58)
    assert announce._checksum(pseudo + icmp) == 0


def test_the_announcement_follows_the_address_family() -> None:
    assert announce.announcement(MAC, "10.123.0.66")[12:14] == b"\x08\x06"
    assert announce.announcement(MAC, "fd00:123::41")[12:14] == b"\x86\xdd"


def test_link_notifications_name_the_links_they_change() -> None:
    def notification(kind: int, index: int) -> bytes:
        body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + rtnl.attr(rtnl.IFLA_IFNAME, b"x\0")
        return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body

    data = notification(rtnl.RTM_NEWLINK, 2) + notification(rtnl.RTM_DELLINK, 7)
    data += notification(rtnl.RTM_NEWNEIGH, 9)  # not a link
    assert rtnl.changed_links(data) == {2, 7}
