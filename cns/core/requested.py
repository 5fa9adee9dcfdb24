"""The addresses a pod asks for, and which of the ADD's subnets each belongs to; pure.

One spelling everywhere: `10.240.0.9`, or one address of each family separated by a comma,
`10.240.0.9,fd00::9` (the socket API's `requestedIP`, `IP=` in CNI_ARGS, the `ips` capability's
list, the pod annotation `acn.azure.com/ip-address`). At most one per family: a dual-stack ADD
gets one address of each of its subnets, and the family is what tells a pod's two addresses
apart without naming the subnets again.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# The pod annotation that asks for addresses (Kubernetes mode).
POD_ADDRESS_ANNOTATION = "acn.azure.com/ip-address"


def parse_requested(value: str) -> tuple[str, ...]:
    """The addresses in `value` (canonical, in its order; none for ""). ValueError saying what is
    wrong: an item that is not an address, more than two, two of one family."""
    if not value.strip():
        return ()
    items = [item.strip() for item in value.split(",", 2)]
    if len(items) > 2:
        raise ValueError("more than two addresses: at most one IPv4 and one IPv6 address")
    addresses = []
    for item in items:
        try:
            addresses.append(ipaddress.ip_address(item))
        except ValueError:
            raise ValueError(f"{item[:64]!r} is not an IP address") from None
    if len(addresses) == 2 and addresses[0].version == addresses[1].version:
        raise ValueError(
            f"{addresses[0]} and {addresses[1]} are both IPv{addresses[0].version}: "
            "at most one address per family"
        )
    return tuple(str(ip) for ip in addresses)


class Misplaced(ValueError):
    """A requested address that does not fit the ADD's subnets: the request is wrong (CNI 7)."""


def place(
    addresses: Sequence[str],
    *,
    named: Sequence[str],
    networks: Mapping[str, Sequence[IPNetwork]],
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Which named subnet each address is in: (subnet -> address, addresses not placed yet).

    `networks` holds every subnet the node knows, with the prefixes of its network containers
    (none yet: unknown). An address goes to the named subnet whose prefix holds it. One inside
    a subnet the ADD does not name, two inside one subnet, or one inside no named subnet while
    every named subnet's prefixes are known, raise Misplaced; one inside no known prefix while
    some named subnet has no network container yet is returned as not placed (that container
    may bring it). Of one named subnet, nothing needs placing: its address is its own (whether
    its pool has it is the pool's to say).
    """
    if len(named) == 1 and len(addresses) == 1:
        return _alone(addresses[0], named[0], networks)
    placed: dict[str, str] = {}
    unplaced: list[str] = []
    for address in addresses:
        ip = ipaddress.ip_address(address)
        holders = [name for name, nets in networks.items() if any(ip in net for net in nets)]
        home = next((name for name in holders if name in named), None)
        if home is None and holders:
            raise _elsewhere(address, holders[0], named)
        if home is None:
            if all(networks.get(name) for name in named):
                raise Misplaced(
                    f"{address} is in none of the subnets the ADD names ({_names(named)})"
                )
            unplaced.append(address)
        elif home in placed:
            raise Misplaced(f"{placed[home]} and {address} are both in subnet {_name(home)}")
        else:
            placed[home] = address
    return placed, tuple(unplaced)


def _alone(
    address: str, name: str, networks: Mapping[str, Sequence[IPNetwork]]
) -> tuple[dict[str, str], tuple[str, ...]]:
    ip = ipaddress.ip_address(address)
    own = networks.get(name) or ()
    if not any(ip in net for net in own):
        for other, nets in networks.items():
            if other != name and any(ip in net for net in nets):
                raise _elsewhere(address, other, (name,))
    return {name: address}, ()


def _elsewhere(address: str, holder: str, named: Sequence[str]) -> Misplaced:
    return Misplaced(
        f"{address} is in subnet {_name(holder)}, which the ADD does not name "
        f"(it names {_names(named)})"
    )


def _name(name: str) -> str:
    return name or "the primary subnet"


def _names(named: Sequence[str]) -> str:
    return ", ".join(map(_name, named))
