"""The flat-network mode's decisions: which proxy neighbour entries the uplink should carry, and
which link is the uplink. Pure; cns/node/flat_network.py applies them.

A node answers ARP and neighbour solicitations on its uplink for exactly the pod addresses it
holds. The entries it manages are those inside its pod subnets: an entry outside them was made
by someone else (the operator, another tool) and is never touched.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cns.core.requested import IPNetwork

IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
UPLINK_KEY = "flatNetwork.uplink"


@dataclass(frozen=True, slots=True)
class ProxyChanges:
    """The entries to add and to remove, each sorted (addresses as text)."""

    add: tuple[str, ...]
    remove: tuple[str, ...]


def _inside(address: str, subnets: Iterable[IPNetwork]) -> bool:
    ip = ipaddress.ip_address(address)
    return any(ip.version == subnet.version and ip in subnet for subnet in subnets)


def proxy_changes(
    *, held: Iterable[str], present: Iterable[str], pod_subnets: Iterable[IPNetwork]
) -> ProxyChanges:
    """What makes the uplink's proxy entries (`present`) match the pod addresses the node
    `held`s: an entry for each held address inside a pod subnet, none for any other address
    inside one; entries outside every pod subnet stay as they are."""
    subnets = tuple(pod_subnets)
    wanted = {ipaddress.ip_address(a) for a in held if _inside(a, subnets)}
    there = {ipaddress.ip_address(a) for a in present if _inside(a, subnets)}
    return ProxyChanges(
        add=tuple(str(ip) for ip in sorted(wanted - there, key=_order)),
        remove=tuple(str(ip) for ip in sorted(there - wanted, key=_order)),
    )


def _order(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[int, int]:
    return ip.version, int(ip)


class UplinkError(ValueError):
    """No single link can be the uplink; the message names the config key to set."""


def choose_uplink(
    links: Mapping[str, Iterable[IPInterface]], pod_subnets: Iterable[IPNetwork]
) -> str:
    """The link on the pods' LAN: the one whose addresses' networks overlap a pod subnet (the
    node's own address on the flat LAN: 10.0.0.4/24 for pods of 10.0.0.0/24, or of a range of
    it). UplinkError when no link or several do."""
    subnets = tuple(pod_subnets)
    found = sorted(
        name
        for name, addresses in links.items()
        if any(a.network.overlaps(s) for a in addresses for s in subnets if a.version == s.version)
    )
    shown = ", ".join(str(s) for s in subnets)
    if not found:
        raise UplinkError(
            f"{UPLINK_KEY}: no interface holds an address on the pod subnet ({shown}); "
            "name the link to the pods' LAN"
        )
    if len(found) > 1:
        raise UplinkError(
            f"{UPLINK_KEY}: several interfaces hold an address on the pod subnet ({shown}): "
            f"{', '.join(found)}; name the one to the pods' LAN"
        )
    return found[0]
