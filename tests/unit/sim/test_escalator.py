"""Escalator's scaling decision: Escalator's worked examples, the decision table, and properties.

Design: docs/design/escalator.md. The properties check what the formulas are for: the
scale-up delta is the fewest identical nodes that bring utilisation back to the threshold, and no
decision leaves the group outside `[min_nodes, max_nodes]`.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.sim.escalator import (
    NodeGroupOptions,
    Resources,
    is_starving,
    nodes_delta,
    scale_up_delta,
    scale_up_from_zero,
    utilization_percent,
)

MB = 1_000_000
NODE = Resources(cpu_milli=1000, memory_bytes=4000 * MB)  # Escalator's example node: 1 CPU, 4000mb
POD = Resources(cpu_milli=500, memory_bytes=100 * MB)  # Escalator's example pod: 500m, 100mb


def decide(options: NodeGroupOptions, nodes: int, requests: Resources, **kwargs: object) -> int:
    arguments: dict[str, object] = {
        "nodes": nodes,
        "tainted": 0,
        "requests": requests,
        "node_capacity": NODE,
        "cached_node_capacity": NODE,
        "starving": False,
    }
    arguments.update(kwargs)
    return nodes_delta(options, **arguments)  # type: ignore[arg-type]


# -- Escalator's worked examples -----------------------------------------------------------------


def test_seed_requests_capacity_and_utilisation() -> None:
    # 10 pods of 500m / 100mb on 2 nodes of 1 CPU / 4000mb: CPU 250 %, memory 12.5 %; the higher.
    requests = POD.times(10)
    capacity = NODE.times(2)
    assert requests == Resources(cpu_milli=5000, memory_bytes=1000 * MB)
    assert capacity == Resources(cpu_milli=2000, memory_bytes=8000 * MB)
    assert utilization_percent(requests, capacity=capacity) == 250
    assert utilization_percent(
        Resources(cpu_milli=0, memory_bytes=1000 * MB), capacity=capacity
    ) == Fraction(25, 2)


def test_seed_scale_up_delta_250_percent_threshold_70_two_nodes_is_6() -> None:
    # (250 - 70) / 70 = 2.571..., * 2 nodes = 5.14..., ceil -> 6; 8 nodes then run at 62.5 %.
    assert scale_up_delta(2, Fraction(250), 70) == 6
    assert utilization_percent(POD.times(10), capacity=NODE.times(8)) == Fraction(125, 2)
    assert decide(NodeGroupOptions(max_nodes=100), 2, POD.times(10)) == 6


def test_seed_scale_up_from_zero_with_cached_capacity_is_3() -> None:
    # 1800m / 1000m / 70 * 100 = 2.571 -> 3 nodes
    requests = Resources(cpu_milli=1800, memory_bytes=100 * MB)
    assert scale_up_from_zero(requests, cached_node_capacity=NODE, threshold_percent=70) == 3
    assert utilization_percent(requests, capacity=Resources()) is None
    assert decide(NodeGroupOptions(), 0, requests) == 3


def test_seed_scale_up_from_zero_without_cache_is_1() -> None:
    requests = Resources(cpu_milli=1800, memory_bytes=100 * MB)
    assert scale_up_from_zero(requests, cached_node_capacity=None, threshold_percent=70) == 1
    assert decide(NodeGroupOptions(), 0, requests, cached_node_capacity=None) == 1


# -- the decision table ----------------------------------------------------------------------------
# Escalator's advanced-configuration example: lower 10, upper 40, scale-up 70, slow 1, fast 2.
# 10 nodes of 1000m: utilisation u % is 100 * u m requested.


@pytest.mark.parametrize(
    ("percent", "delta"),
    [
        (110, 6),  # ceil(10 * 40 / 70) = ceil(5.71)
        (75, 1),  # ceil(10 * 5 / 70) = ceil(0.71)
        (70, 0),  # at the threshold: nothing to add
        (50, 0),  # between the taint and scale-up thresholds: nothing
        (40, 0),  # "has to be lower than the threshold"
        (38, -1),  # slow removal
        (10, -1),
        (9, -2),  # fast removal
        (0, -2),
    ],
)
def test_decision_table(percent: int, delta: int) -> None:
    options = NodeGroupOptions(min_nodes=1, max_nodes=100)
    requests = Resources(cpu_milli=100 * percent, memory_bytes=0)
    assert decide(options, 10, requests) == delta


def test_nothing_requested_of_nothing_is_zero_percent() -> None:
    assert utilization_percent(Resources(), capacity=Resources()) == 0
    assert decide(NodeGroupOptions(), 0, Resources()) == 0


def test_memory_can_be_the_higher_utilisation() -> None:
    requests = Resources(cpu_milli=100, memory_bytes=3000 * MB)  # 10 % CPU, 75 % memory of one
    assert utilization_percent(requests, capacity=NODE) == 75
    assert decide(NodeGroupOptions(), 1, requests) == 1


def test_below_min_nodes_adds_the_difference() -> None:
    options = NodeGroupOptions(min_nodes=3, max_nodes=10)
    assert decide(options, 1, Resources()) == 2
    # two tainted nodes do not count as untainted
    assert decide(options, 4, Resources(), tainted=2) == 1


def test_scale_down_never_goes_below_min_nodes() -> None:
    options = NodeGroupOptions(min_nodes=3, max_nodes=10, fast_node_removal_rate=5)
    assert decide(options, 5, Resources()) == -2
    assert decide(options, 3, Resources()) == 0
    # already-tainted nodes are not untainted capacity: 5 nodes, 2 tainted, 3 untainted = min
    assert decide(options, 5, Resources(), tainted=2) == 0


def test_scale_up_never_goes_above_max_nodes() -> None:
    options = NodeGroupOptions(max_nodes=5)
    assert decide(options, 2, POD.times(10)) == 3
    assert decide(options, 5, POD.times(10)) == 0
    # tainted nodes are untainted first: 5 nodes, 2 of them tainted, 2 more untainted allowed
    assert decide(options, 5, POD.times(10), tainted=2) == 2


def test_scale_on_starve_adds_at_least_one() -> None:
    # 1 node at 50 %: no scale up, but a pod too large for any node's free room is pending.
    starving_options = NodeGroupOptions(max_nodes=10, scale_on_starve=True)
    requests = Resources(cpu_milli=500, memory_bytes=0)
    assert decide(NodeGroupOptions(max_nodes=10), 1, requests, starving=True) == 0
    assert decide(starving_options, 1, requests, starving=True) == 1
    assert decide(starving_options, 1, requests, starving=False) == 0
    # at max_nodes even a starving pod gets nothing
    assert (
        decide(NodeGroupOptions(max_nodes=1, scale_on_starve=True), 1, requests, starving=True) == 0
    )
    # it only raises the delta, never lowers a bigger one
    assert decide(starving_options, 2, POD.times(10), starving=True) == 6


def test_is_starving() -> None:
    free = Resources(cpu_milli=600, memory_bytes=500 * MB)
    assert not is_starving(None, largest_available=free)
    assert not is_starving(Resources(cpu_milli=600, memory_bytes=500 * MB), largest_available=free)
    assert is_starving(Resources(cpu_milli=601, memory_bytes=1), largest_available=free)
    assert is_starving(Resources(cpu_milli=1, memory_bytes=500 * MB + 1), largest_available=free)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="threshold_percent"):
        scale_up_delta(2, Fraction(250), 0)
    with pytest.raises(ValueError, match="threshold_percent"):
        scale_up_from_zero(POD, cached_node_capacity=NODE, threshold_percent=0)
    with pytest.raises(ValueError, match="tainted"):
        decide(NodeGroupOptions(), 2, POD, tainted=3)


def test_options_problems_name_the_field() -> None:
    assert NodeGroupOptions().problems() == []
    assert "minNodes" in NodeGroupOptions(min_nodes=-1).problems()[0]
    assert "maxNodes" in NodeGroupOptions(min_nodes=5, max_nodes=4).problems()[0]
    assert "scaleUpThresholdPercent" in NodeGroupOptions(scale_up_threshold_percent=0).problems()[0]
    assert "taintLower" in NodeGroupOptions(taint_lower_capacity_threshold_percent=50).problems()[0]
    assert "taintUpper" in NodeGroupOptions(taint_upper_capacity_threshold_percent=70).problems()[0]
    assert "RemovalRate" in NodeGroupOptions(slow_node_removal_rate=-1).problems()[0]


def test_exact_where_floats_ask_for_one_node_too_many() -> None:
    # 7 nodes at 360 %, threshold 70: 7 * 290 / 70 = 29 exactly, so 36 nodes run at exactly 70 %.
    # Escalator's float64 `(360 - 70) / 70 * 7` is 29.000000000000004, whose ceiling is 30.
    assert 7 * ((360.0 - 70.0) / 70.0) > 29
    assert scale_up_delta(7, Fraction(360), 70) == 29


# -- properties -----------------------------------------------------------------------------------

node_sizes = st.builds(
    Resources, cpu_milli=st.integers(1, 64_000), memory_bytes=st.integers(1, 1 << 40)
)
request_totals = st.builds(
    Resources, cpu_milli=st.integers(0, 10_000_000), memory_bytes=st.integers(0, 1 << 48)
)
thresholds = st.integers(1, 100)


@given(st.integers(1, 2000), node_sizes, request_totals, thresholds)
def test_scale_up_delta_is_the_fewest_nodes_back_under_the_threshold(
    nodes: int, node: Resources, requests: Resources, threshold: int
) -> None:
    utilization = utilization_percent(requests, capacity=node.times(nodes))
    assert utilization is not None
    delta = scale_up_delta(nodes, utilization, threshold)
    if delta == 0:
        assert utilization <= threshold
        return
    after = utilization_percent(requests, capacity=node.times(nodes + delta))
    fewer = utilization_percent(requests, capacity=node.times(nodes + delta - 1))
    assert after is not None and after <= threshold
    assert fewer is not None and fewer > threshold


@given(node_sizes, request_totals, thresholds)
def test_scale_up_from_zero_is_the_fewest_nodes_under_the_threshold(
    node: Resources, requests: Resources, threshold: int
) -> None:
    count = scale_up_from_zero(requests, cached_node_capacity=node, threshold_percent=threshold)
    if count == 0:
        assert requests == Resources()
        return
    after = utilization_percent(requests, capacity=node.times(count))
    fewer = utilization_percent(requests, capacity=node.times(count - 1))
    assert after is not None and after <= threshold
    assert fewer is None or fewer > threshold


@st.composite
def options(draw: st.DrawFn) -> NodeGroupOptions:
    minimum = draw(st.integers(0, 50))
    threshold = draw(st.integers(2, 100))
    upper = draw(st.integers(0, threshold - 1))
    slow = draw(st.integers(0, 5))
    return NodeGroupOptions(
        min_nodes=minimum,
        max_nodes=draw(st.integers(max(minimum, 1), 200)),
        scale_up_threshold_percent=threshold,
        taint_upper_capacity_threshold_percent=upper,
        taint_lower_capacity_threshold_percent=draw(st.integers(0, upper)),
        slow_node_removal_rate=slow,
        fast_node_removal_rate=draw(st.integers(slow, 10)),
        scale_on_starve=draw(st.booleans()),
    )


@given(
    options(),
    st.integers(0, 250),
    st.integers(0, 250),
    node_sizes,
    request_totals,
    st.booleans(),
    st.booleans(),
)
def test_decision_stays_within_min_and_max(
    group: NodeGroupOptions,
    nodes: int,
    tainted: int,
    node: Resources,
    requests: Resources,
    cached: bool,
    starving: bool,
) -> None:
    assert group.problems() == []
    tainted = min(tainted, nodes)
    untainted = nodes - tainted
    delta = nodes_delta(
        group,
        nodes=nodes,
        tainted=tainted,
        requests=requests,
        node_capacity=node,
        cached_node_capacity=node if cached else None,
        starving=starving,
    )
    if delta > 0:
        assert untainted + delta <= group.max_nodes
    if delta < 0:
        assert untainted + delta >= group.min_nodes
    if untainted < group.min_nodes:
        assert delta == group.min_nodes - untainted
    if group.scale_on_starve and starving and group.min_nodes <= untainted < group.max_nodes:
        assert delta >= 1


@given(options(), st.integers(1, 250), node_sizes, request_totals, request_totals)
def test_more_requests_never_mean_fewer_nodes(
    group: NodeGroupOptions, nodes: int, node: Resources, first: Resources, second: Resources
) -> None:
    low = Resources(
        cpu_milli=min(first.cpu_milli, second.cpu_milli),
        memory_bytes=min(first.memory_bytes, second.memory_bytes),
    )
    high = Resources(
        cpu_milli=max(first.cpu_milli, second.cpu_milli),
        memory_bytes=max(first.memory_bytes, second.memory_bytes),
    )

    def delta(requests: Resources) -> int:
        return nodes_delta(
            group,
            nodes=nodes,
            tainted=0,
            requests=requests,
            node_capacity=node,
            cached_node_capacity=node,
            starving=False,
        )

    assert delta(low) <= delta(high)
