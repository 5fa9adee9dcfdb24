"""The planner never grants a node's own address, and reports one a pod held before."""

from __future__ import annotations

import ipaddress
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core.allocation import Entry
from cns.core.subnet import Subnet
from cns.core.subnet_model import SubnetModel
from cns.core.subnet_plan import NodeView, plan_subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, SubnetStatus
from tests.unit.core.granting import granted_after_rounds, ids, planned_keeping_withdrawn

SUBNET = Subnet("pods", "10.60.0.0/27", reserved_ips=frozenset({"10.60.0.30"}))


@settings(max_examples=60, deadline=None)
@given(
    offsets=st.sets(st.integers(0, 40), max_size=12),
    requests=st.lists(st.integers(0, 40), min_size=1, max_size=4),
)
def test_the_plan_never_grants_a_nodes_own_address(offsets: set[int], requests: list[int]) -> None:
    """Whatever the nodes ask for, however scarce the rest, the addresses of the nodes that
    fall in the subnet are granted to no one; those outside it change nothing."""
    base = int(SUBNET.network.network_address)
    node_addresses = [ipaddress.IPv4Address(base + offset) for offset in offsets]
    subnet = SUBNET.with_node_addresses(node_addresses)
    inside = {str(ip) for ip in node_addresses if ip in SUBNET.network} - {
        "10.60.0.0",
        "10.60.0.31",
    }
    assert subnet.node_ips == inside
    assert subnet.capacity == SUBNET.capacity - len(inside - {SUBNET.gateway_address, "10.60.0.30"})
    held, recorded = granted_after_rounds(subnet, requests)
    granted = set(held)
    assert granted, "the nodes got addresses"
    assert not granted & subnet.excluded
    assert not recorded & subnet.excluded


def test_a_node_address_a_pod_already_holds_is_reported_and_kept() -> None:
    """A node that takes an address granted earlier: the pod keeps it (nothing taken away),
    the model names it with its holder, its node is asked to give it back (which it does once
    no pod uses it), and it is never granted again once released."""
    nc = NetworkContainer(
        id="nc-a",
        primary_ips=("10.60.0.2",),
        subnet=str(SUBNET.network),
        gateway=SUBNET.gateway_address,
        ip_configs=(IPConfig("x", "10.60.0.3"),),
        version=1,
        programmed_version=1,
    )
    record = {
        "10.60.0.2": Entry("a", "nc-a", primary=True),
        "10.60.0.3": Entry("a", "x"),
    }
    subnet = SUBNET.with_node_addresses([ipaddress.ip_address("10.60.0.3")])
    view = NodeView("a", nc, PoolRequest(1))
    model = SubnetModel.build(subnet, [view], record)
    assert model.node_addresses_held() == {"10.60.0.3": ("a",)}
    planned_keeping_withdrawn(subnet, view, record, address="10.60.0.3", ip_id="x")
    # Released by its node, it is freed and not granted again.
    released = NodeView("a", nc, PoolRequest(0, ("x",)))
    first = plan_subnet(subnet, [released], record, SubnetStatus(), random.Random(0), ids())
    assert first.record["10.60.0.3"] == Entry("a", "x", releasing=True)
