"""The free-address structure against a plain set of free addresses."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core.freespace import FreeSpace
from cns.core.subnet import Subnet

SUBNETS = [
    Subnet("v4", "10.0.0.0/23", reserved_ips=frozenset({"10.0.0.255", "10.0.1.7"})),
    Subnet("small", "10.0.0.0/28", gateway="10.0.0.9"),
    Subnet("tiny", "10.0.0.0/30"),
    Subnet("v6", "fd00::/119", reserved_ips=frozenset({"fd00::100", "FD00::101"})),
    Subnet(
        "ranges",
        "10.0.0.0/22",
        reserved_ips=frozenset({"10.0.0.0/24", "10.0.1.250-10.0.2.3", "10.0.3.128/25"}),
    ),
    Subnet("v6-ranges", "fd00::/118", reserved_ips=frozenset({"fd00::f0-fd00::1ff"})),
]


def usable(subnet: Subnet) -> list[int]:
    return [int(ipaddress.ip_address(a)) for a in subnet.usable()]


@pytest.mark.parametrize("subnet", SUBNETS, ids=lambda s: s.name)
def test_a_fresh_subnet_is_free_exactly_where_it_is_usable(subnet: Subnet) -> None:
    space = FreeSpace.of(subnet)
    network = subnet.network
    expected = usable(subnet)
    first = int(network.network_address)
    assert [a for a in range(first, first + network.num_addresses) if space.is_free(a)] == expected
    assert space.lowest() == (expected[0] if expected else None)
    assert space.taken == 0


@settings(max_examples=100, deadline=None)
@given(data=st.data(), which=st.sampled_from(SUBNETS))
def test_take_give_back_and_lowest_follow_a_set_model(data: st.DataObject, which: Subnet) -> None:
    space = FreeSpace.of(which)
    network = which.network
    first = int(network.network_address)
    free = set(usable(which))
    total = len(free)
    addresses = st.integers(first - 2, first + network.num_addresses + 1)
    for _ in range(data.draw(st.integers(0, 60))):
        action = data.draw(st.sampled_from(["take", "give_back", "take_lowest", "copy"]))
        if action == "copy":
            space = space.copy()
            continue
        if action == "take_lowest":
            lowest = space.lowest()
            assert lowest == (min(free) if free else None)
            if lowest is not None:
                assert space.take(lowest)
                free.discard(lowest)
            continue
        address = data.draw(addresses)
        usable_here = which.is_usable(str(ipaddress.ip_address(address)))
        if action == "take":
            assert space.take(address) == (address in free)
            free.discard(address)
        else:
            was_taken = usable_here and address not in free
            assert space.give_back(address) == was_taken
            if usable_here:
                free.add(address)
        assert space.taken == total - len(free)
        assert space.lowest() == (min(free) if free else None)


def test_a_copy_is_independent() -> None:
    space = FreeSpace.of(SUBNETS[0])
    copy = space.copy()
    lowest = copy.lowest()
    assert lowest is not None and copy.take(lowest)
    assert space.is_free(lowest) and space.taken == 0 and copy.taken == 1


FOUR_BLOCKS = [
    Subnet("four", "10.0.0.0/22", reserved_ips=frozenset({"10.0.2.9"})),
    # Its first block wholly reserved: the lowest untouched block with room is the second.
    Subnet("four-reserved", "10.0.0.0/22", reserved_ips=frozenset({"10.0.0.0/24", "10.0.2.9"})),
]


@settings(max_examples=100, deadline=None)
@given(
    four_blocks=st.sampled_from(FOUR_BLOCKS),
    taken=st.sets(st.integers(0, 1023), max_size=900),
    wanted=st.integers(1, 600),
)
def test_the_fitting_block_is_the_best_fit_else_the_emptiest(
    four_blocks: Subnet, taken: set[int], wanted: int
) -> None:
    """Against the rule counted from a plain set: among the blocks in use and the lowest one
    not in use, the one with the fewest free addresses that holds `wanted`, else the one with
    the most (lowest first on ties); None when nothing is free."""
    space = FreeSpace.of(four_blocks)
    base = int(four_blocks.network.network_address)
    usable_here = set(usable(four_blocks))
    for offset in taken:
        space.take(base + offset)
    free = usable_here - {base + offset for offset in taken}
    counts = {block: 0 for block in range(4)}
    in_use = set()
    for address in usable_here:
        block = (address - base) >> 8
        if address in free:
            counts[block] += 1
        else:
            in_use.add(block)
    idle = [block for block in range(4) if block not in in_use and counts[block]]
    candidates = in_use | set(idle[:1])
    fitting = [(counts[b], b) for b in candidates if counts[b] >= wanted]
    roomiest = [(-counts[b], b) for b in candidates if counts[b] > 0]
    expected = min(fitting)[1] if fitting else min(roomiest)[1] if roomiest else None
    assert space.fitting_block(wanted) == expected
    if expected is not None:
        lowest = space.lowest_in(expected)
        assert lowest == min(a for a in free if (a - base) >> 8 == expected)
        assert space.block_of(lowest) == expected
