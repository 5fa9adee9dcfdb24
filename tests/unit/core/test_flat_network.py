"""The flat-network mode's decisions: which proxy entries the uplink carries, which link is it."""

from __future__ import annotations

import ipaddress

import pytest

from cns.core.flat_network import ProxyChanges, UplinkError, choose_uplink, proxy_changes

SUBNETS = [ipaddress.ip_network("10.123.0.64/27"), ipaddress.ip_network("fd00:123::40/122")]


def test_held_addresses_get_entries_and_released_ones_lose_theirs() -> None:
    changes = proxy_changes(
        held=["10.123.0.66", "10.123.0.67", "fd00:123::41"],
        present=["10.123.0.67", "10.123.0.70", "fd00:123::42"],
        pod_subnets=SUBNETS,
    )
    assert changes == ProxyChanges(
        add=("10.123.0.66", "fd00:123::41"), remove=("10.123.0.70", "fd00:123::42")
    )


def test_entries_outside_the_pod_subnets_are_never_touched() -> None:
    """Another node's range of the same LAN, the operator's own entries: not ours."""
    changes = proxy_changes(
        held=["10.123.0.66"],
        present=["10.123.0.66", "10.123.0.99", "192.0.2.7", "fd00:123::1:5"],
        pod_subnets=SUBNETS,
    )
    assert changes == ProxyChanges(add=(), remove=())


def test_addresses_compare_as_addresses_not_text() -> None:
    changes = proxy_changes(
        held=["fd00:123:0:0::41"], present=["fd00:123::41"], pod_subnets=SUBNETS
    )
    assert changes == ProxyChanges(add=(), remove=())


def test_nothing_held_and_no_subnet_known_changes_nothing() -> None:
    assert proxy_changes(held=[], present=["10.123.0.66"], pod_subnets=[]) == ProxyChanges((), ())


def _links(
    **links: list[str],
) -> dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    return {
        name: [ipaddress.ip_interface(a) for a in addresses] for name, addresses in links.items()
    }


def test_the_uplink_is_the_link_on_the_pod_subnets_lan() -> None:
    links = _links(
        lo=["127.0.0.1/8", "::1/128"],
        eth0=["10.123.0.11/24", "fd00:123::11/64", "fe80::1/64"],
        eth1=["192.168.7.2/24"],
        cnsabc=[],
    )
    assert choose_uplink(links, SUBNETS) == "eth0"
    # the node's address inside the pod subnet itself (the VNET way) is found the same way
    assert choose_uplink(links, [ipaddress.ip_network("10.123.0.0/24")]) == "eth0"


@pytest.mark.parametrize(
    ("links", "message"),
    [
        (_links(eth0=["192.168.7.2/24"]), "no interface holds an address on the pod subnet"),
        (
            _links(eth0=["10.123.0.11/24"], eth1=["10.123.0.12/25"]),
            "several interfaces .*: eth0, eth1",
        ),
    ],
)
def test_no_single_uplink_is_an_error_naming_the_key(
    links: dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]], message: str
) -> None:
    with pytest.raises(UplinkError, match=f"^flatNetwork.uplink: {message}"):
        choose_uplink(links, SUBNETS)
