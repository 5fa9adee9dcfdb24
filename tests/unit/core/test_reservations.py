"""Reserved ranges as intervals agree with the brute-force set of addresses they name."""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.core.reservations import ReservationError, Reservations, parse_entry

NETWORK = ipaddress.ip_network("10.240.0.0/26")
V6 = ipaddress.ip_network("fd00::/64")
BASE = int(NETWORK.network_address)


def count_in(reserved: Reservations, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> int:
    return reserved.count_between(int(network.network_address), int(network.broadcast_address))


def spelled(first: int, last: int, how: int) -> str:
    low, high = ipaddress.ip_address(BASE + first), ipaddress.ip_address(BASE + last)
    if how == 0 or first == last:
        return f"{low}-{high}" if first != last else str(low)
    return f"{low} - {high}"


@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63), st.integers(0, 1)), max_size=8))
def test_membership_and_count_match_the_set_of_addresses_named(
    entries: list[tuple[int, int, int]],
) -> None:
    texts = [spelled(min(a, b), max(a, b), how) for a, b, how in entries]
    named = {BASE + o for a, b, _ in entries for o in range(min(a, b), max(a, b) + 1)}
    reserved = Reservations.parse(texts, network=NETWORK)
    for offset in range(64):
        assert (ipaddress.ip_address(BASE + offset) in reserved) == (BASE + offset in named)
    assert count_in(reserved, NETWORK) == len(named)
    # Merged: sorted, disjoint and never adjacent.
    spans = list(reserved.spans())
    assert all(last + 1 < first for (_, last), (first, _) in itertools.pairwise(spans))


def test_a_cidr_is_its_whole_block_and_counts_only_inside_the_network() -> None:
    reserved = Reservations.parse(["10.240.0.60/30"], network=NETWORK)
    assert count_in(reserved, NETWORK) == 4
    assert count_in(reserved, ipaddress.ip_network("10.240.0.62/31")) == 2
    assert ipaddress.ip_address("10.240.0.63") in reserved
    assert ipaddress.ip_address("10.240.0.64") not in reserved


def test_ipv6_ranges() -> None:
    reserved = Reservations.parse(["fd00::10-fd00::1f", "fd00::/124"], network=V6)
    assert count_in(reserved, ipaddress.ip_network("fd00::/64")) == 32
    assert ipaddress.ip_address("fd00::1f") in reserved
    assert ipaddress.ip_address("10.240.0.1") not in reserved


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("10.240.0.9-10.240.0.3", "above its last"),
        ("10.240.0.1-fd00::1", "one family"),
        ("10.240.0", "not an address"),
        ("10.240.0.1-", "not an address"),
        ("", "not an address"),
    ],
)
def test_a_bad_entry_is_an_error_naming_it(entry: str, says: str) -> None:
    with pytest.raises(ReservationError, match=says) as raised:
        parse_entry(entry)
    assert repr(entry) in str(raised.value)


def test_an_entry_of_the_other_family_is_an_error() -> None:
    with pytest.raises(ReservationError, match=r"IPv6 entry in the IPv4 subnet 10\.240\.0\.0/26"):
        Reservations.parse(["fd00::1"], network=NETWORK)


@pytest.mark.parametrize("entry", ["10.240.1.0/24", "10.240.0.64-10.240.0.70", "10.0.0.1"])
def test_an_entry_naming_no_address_of_the_subnet_is_an_error(entry: str) -> None:
    with pytest.raises(ReservationError, match=r"no address of the subnet 10\.240\.0\.0/26"):
        Reservations.parse([entry], network=NETWORK)


def test_an_entry_reaching_past_the_subnet_reserves_its_part_inside() -> None:
    reserved = Reservations.parse(["10.240.0.0/16", "10.240.0.60-10.240.1.3"], network=NETWORK)
    assert count_in(reserved, NETWORK) == 64
