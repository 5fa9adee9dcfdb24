"""Reserved ranges (`reservedIPs`: addresses, CIDRs, first-last ranges) in the subnet's rules and
the controller's plan: never granted, counted out of the capacity, and one added over an address
a pod holds leaves it with the pod, reports it and asks it back."""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core.allocation import Entry
from cns.core.freespace import FreeSpace
from cns.core.reservations import ReservationError
from cns.core.subnet import MAX_RESERVED_BLOCKS, Subnet
from cns.core.subnet_model import SubnetModel
from cns.core.subnet_plan import NodeView, plan_subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, SubnetStatus
from tests.unit.core.granting import granted_after_rounds, ids, planned_keeping_withdrawn

CIDR = "10.61.0.0/26"
BASE = int(ipaddress.ip_address("10.61.0.0"))


def _text(first: int, last: int, how: int) -> str:
    low, high = (ipaddress.ip_address(BASE + offset) for offset in (first, last))
    if how == 1 and first == last:
        return str(low)
    if how == 2:  # the largest aligned block starting at `first` within the span
        size = 1
        while first % (size * 2) == 0 and first + size * 2 - 1 <= last:
            size *= 2
        return f"{low}/{32 - size.bit_length() + 1}"
    return f"{low}-{high}"


spans = st.lists(
    st.tuples(st.integers(0, 63), st.integers(0, 63), st.integers(0, 2)), min_size=1, max_size=5
)


@settings(max_examples=80, deadline=None)
@given(entries=spans, node_offsets=st.sets(st.integers(0, 63), max_size=4))
def test_usable_capacity_and_free_space_agree_with_the_addresses_named(
    entries: list[tuple[int, int, int]], node_offsets: set[int]
) -> None:
    """Counted from a plain set: the hosts minus the gateway, the nodes' own addresses and every
    address an entry names (a CIDR entry names its block)."""
    texts = [_text(min(a, b), max(a, b), how) for a, b, how in entries]
    named: set[int] = set()
    for text in texts:
        if "/" in text:
            network = ipaddress.ip_network(text)
            named |= set(range(int(network.network_address), int(network.broadcast_address) + 1))
        else:
            low, _, high = text.partition("-")
            first = int(ipaddress.ip_address(low))
            named |= set(range(first, int(ipaddress.ip_address(high or low)) + 1))
    subnet = Subnet("r", CIDR, reserved_ips=frozenset(texts)).with_node_addresses(
        [ipaddress.IPv4Address(BASE + offset) for offset in node_offsets]
    )
    hosts = set(range(BASE + 1, BASE + 63))
    expected = sorted(
        hosts - named - {BASE + 1} - {BASE + offset for offset in node_offsets}
    )  # BASE + 1: the gateway
    assert [int(ipaddress.ip_address(a)) for a in subnet.usable()] == expected
    assert subnet.capacity == len(expected)
    space = FreeSpace.of(subnet)
    assert [a for a in range(BASE, BASE + 64) if space.is_free(a)] == expected
    assert all(subnet.is_usable(str(ipaddress.ip_address(a))) == (a in expected) for a in hosts)


@settings(max_examples=40, deadline=None)
@given(entries=spans, requests=st.lists(st.integers(0, 70), min_size=1, max_size=3))
def test_the_plan_never_grants_a_reserved_address(
    entries: list[tuple[int, int, int]], requests: list[int]
) -> None:
    subnet = Subnet(
        "r", CIDR, reserved_ips=frozenset(_text(min(a, b), max(a, b), h) for a, b, h in entries)
    )
    granted, recorded = granted_after_rounds(subnet, requests)
    assert len(granted) == len(set(granted))
    assert not {a for a in granted if ipaddress.ip_address(a) in subnet.reservations}
    assert not {a for a in recorded if ipaddress.ip_address(a) in subnet.reservations}
    if subnet.capacity:
        assert granted, "the nodes got addresses"


def test_a_reservation_added_over_an_address_a_pod_holds_is_reported_and_asked_back() -> None:
    """Granted before the range was reserved: the pod keeps it (nothing taken away), the model
    names it with its holder, its node is asked to give it back (which it does once no pod uses
    it), and once released it is freed and never granted again."""
    before = Subnet("r", CIDR)
    nc = NetworkContainer(
        id="nc-a",
        primary_ips=("10.61.0.2",),
        subnet=CIDR,
        gateway=before.gateway_address,
        ip_configs=(IPConfig("x", "10.61.0.3"), IPConfig("y", "10.61.0.4")),
        version=1,
        programmed_version=1,
    )
    record = {
        "10.61.0.2": Entry("a", "nc-a", primary=True),
        "10.61.0.3": Entry("a", "x"),
        "10.61.0.4": Entry("a", "y"),
    }
    view = NodeView("a", nc, PoolRequest(2))
    assert SubnetModel.build(before, [view], record).reserved_addresses_held() == {}
    subnet = Subnet("r", CIDR, reserved_ips=frozenset({"10.61.0.3", "10.61.0.5-10.61.0.15"}))
    model = SubnetModel.build(subnet, [view], record)
    assert model.reserved_addresses_held() == {"10.61.0.3": ("a",)}
    plan = planned_keeping_withdrawn(subnet, view, record, address="10.61.0.3", ip_id="x")
    assert "a" not in plan.changed  # the pool is whole: nothing taken away, nothing added

    # Released by its node (it asks for one in its place): freed, and the new one is not reserved.
    released = NodeView("a", nc, PoolRequest(2, ("x",)))
    plan = plan_subnet(subnet, [released], record, SubnetStatus(), random.Random(0), ids())
    assert plan.record["10.61.0.3"] == Entry("a", "x", releasing=True)
    after = plan.changed["a"]
    addresses = {c.address for c in after.ip_configs}
    assert "10.61.0.3" not in addresses and "10.61.0.4" in addresses
    new = addresses - {"10.61.0.4"}
    assert new and all(ipaddress.ip_address(a) not in subnet.reservations for a in new)


def test_a_wholly_reserved_first_block_is_passed_over() -> None:
    subnet = Subnet("big", "10.62.0.0/22", reserved_ips=frozenset({"10.62.0.0/24"}))
    views = [NodeView("a", None, PoolRequest(4))]
    plan = plan_subnet(subnet, views, {}, SubnetStatus(), random.Random(0), ids())
    (nc,) = plan.changed.values()
    assert nc.primary_ips == ("10.62.1.0",)
    # Network and broadcast, and the reserved /24's 255 hosts (the gateway is one of them).
    assert subnet.capacity == 1024 - 2 - 255


@pytest.mark.parametrize(
    ("cidr", "entries", "says"),
    [
        ("10.61.0.0/26", ["10.61.1.0/24"], "no address of the subnet 10.61.0.0/26"),
        ("10.61.0.0/26", ["fd00::1"], "IPv6 entry in the IPv4 subnet"),
        ("10.61.0.0/26", ["10.61.0.9-10.61.0.2"], "above its last"),
        ("fd00::/64", ["fd00::/80"], f"more than {MAX_RESERVED_BLOCKS}"),
    ],
)
def test_a_reservation_the_subnet_cannot_take_is_an_error_naming_it(
    cidr: str, entries: list[str], says: str
) -> None:
    with pytest.raises(ReservationError, match=says):
        Subnet("r", cidr, reserved_ips=frozenset(entries))


def test_a_large_ipv6_range_costs_a_mask_per_block_it_touches() -> None:
    """A /109 of a /64 (2,048 blocks of /120): a mask per block, the rest untouched."""
    subnet = Subnet("v6", "fd00::/64", reserved_ips=frozenset({"fd00::/109", "FD00::FF:5"}))
    assert ipaddress.ip_address("fd00::ff:5") in subnet.reservations  # any spelling reserves
    space = FreeSpace.of(subnet)
    assert space.lowest() == int(ipaddress.ip_address("fd00::8:0"))
    assert not space.is_free(int(ipaddress.ip_address("fd00::ff:5")))
    # The hosts (all but the Subnet-Router anycast fd00::) minus the /109's others and ff:5.
    assert subnet.capacity == (2**64 - 1) - (2**19 - 1) - 1
