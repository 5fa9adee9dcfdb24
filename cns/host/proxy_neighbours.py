"""The uplink's proxy neighbour entries (`ip neigh ... proxy`), through rtnetlink, and finding the
uplink: the flat-network mode's host side (docs/networking.md, "Flat network").

The kernel answers an ARP request (IPv4) or a neighbour solicitation (IPv6) arriving on a link for
an address with a proxy entry on that link, with the link's MAC, if forwarding is on and the route
to the address leaves by another link (here: the pod's host veth, or ptp's). IPv6 also needs
proxy_ndp on the link. The requests are synchronous (cns/host/rtnl.py): run them in a worker
thread from the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from pyroute2 import AsyncIPRoute

from cns.core.flat_network import IPInterface
from cns.host import rtnl


@dataclass(frozen=True, slots=True)
class Uplink:
    name: str
    index: int
    mac: bytes


class UplinkMissing(LookupError):
    """The named link does not exist in the daemon's network namespace."""


async def link_addresses() -> dict[str, list[IPInterface]]:
    """Every link's name with its IPv4 and IPv6 addresses (address/prefix length)."""
    found: dict[str, list[IPInterface]] = {}
    async with AsyncIPRoute() as ipr:
        names = {
            link["index"]: link.get_attr("IFLA_IFNAME") async for link in await ipr.get_links()
        }
        for name in names.values():
            found[name] = []
        async for message in await ipr.get_addr():
            address = message.get_attr("IFA_LOCAL") or message.get_attr("IFA_ADDRESS")
            name = names.get(message["index"])
            if address and name is not None:
                found[name].append(ipaddress.ip_interface(f"{address}/{message['prefixlen']}"))
    return found


async def uplink(name: str) -> Uplink:
    """The link `name`'s index and MAC; UplinkMissing if there is none."""
    async with AsyncIPRoute() as ipr:
        found = [link async for link in await ipr.get_links(ifname=name)] if name else []
    if not found:
        raise UplinkMissing(name)
    mac = found[0].get_attr("IFLA_ADDRESS") or "00:00:00:00:00:00"
    return Uplink(name, int(found[0]["index"]), bytes.fromhex(mac.replace(":", "")))


def link_events() -> socket.socket:
    """A non-blocking rtnetlink socket that receives every link change: taking a link down
    flushes its proxy entries, which its coming back up must restore."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, rtnl.NETLINK_ROUTE)
    sock.setblocking(False)
    sock.bind((0, rtnl.RTMGRP_LINK))
    return sock


def proxied(index: int) -> list[str]:
    """The addresses with a proxy entry on link `index`."""
    with contextlib.closing(rtnl.Rtnl()) as ipr:
        messages = ipr.dump(rtnl.RTM_GETNEIGH, rtnl.proxy_dump())
    return [address for link, address in rtnl.proxy_entries(messages) if link == index]


def add(index: int, addresses: Iterable[str]) -> None:
    """A proxy entry on link `index` for each address (one already there is kept)."""
    with contextlib.closing(rtnl.Rtnl()) as ipr:
        for address in addresses:
            ipr.request(rtnl.RTM_NEWNEIGH, rtnl.proxy_neighbour(index, address), rtnl.REPLACE)


def remove(index: int, addresses: Iterable[str]) -> None:
    """Remove the proxy entry on link `index` of each address (one already gone is fine)."""
    with contextlib.closing(rtnl.Rtnl()) as ipr:
        for address in addresses:
            try:
                ipr.request(rtnl.RTM_DELNEIGH, rtnl.proxy_neighbour(index, address))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
