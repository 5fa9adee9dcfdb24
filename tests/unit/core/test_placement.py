"""Which ClusterSubnet a node goes to (cns/core/placement.py): label selectors as Kubernetes
reads them, the rank of a subnet without a selector, and overlapping ranges."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.core.placement import (
    NodeSelector,
    Placement,
    overlapping,
    parse_node_selector,
    place_node,
)


def selector(raw: object) -> NodeSelector:
    return parse_node_selector(raw)


@pytest.mark.parametrize(
    ("raw", "labels", "matches"),
    [
        (None, {}, True),
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"pool": "b"}}, {"pool": "b", "x": "y"}, True),
        ({"matchLabels": {"pool": "b"}}, {"pool": "c"}, False),
        ({"matchLabels": {"pool": "b"}}, {}, False),
        (
            {"matchExpressions": [{"key": "z", "operator": "In", "values": ["1", "2"]}]},
            {"z": "2"},
            True,
        ),
        ({"matchExpressions": [{"key": "z", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "z", "operator": "NotIn", "values": ["1"]}]},
            {"z": "1"},
            False,
        ),
        ({"matchExpressions": [{"key": "z", "operator": "Exists"}]}, {"z": ""}, True),
        ({"matchExpressions": [{"key": "z", "operator": "DoesNotExist"}]}, {"z": ""}, False),
        (
            {
                "matchLabels": {"pool": "b"},
                "matchExpressions": [{"key": "zone", "operator": "In", "values": ["1"]}],
            },
            {"pool": "b", "zone": "2"},
            False,
        ),
    ],
)
def test_selectors_match_as_kubernetes_label_selectors_do(
    raw: object, labels: dict[str, str], matches: bool
) -> None:
    assert selector(raw).matches(labels) is matches


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("pool=b", "spec.nodeSelector: a label selector is an object"),
        ({"matchLabel": {}}, "unknown fields ['matchLabel']"),
        ({"matchLabels": {"pool": 1}}, "spec.nodeSelector.matchLabels.pool"),
        ({"matchExpressions": {"key": "a"}}, "spec.nodeSelector.matchExpressions: a list"),
        ({"matchExpressions": [{"operator": "Exists"}]}, "matchExpressions[0].key"),
        (
            {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
            "matchExpressions[0].operator: 'Gt'",
        ),
        ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "In needs at least one value"),
        (
            {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
            "Exists takes no values",
        ),
    ],
)
def test_an_unreadable_selector_is_refused_naming_the_field(raw: object, field: str) -> None:
    """Never read as "every node": the subnet is then not served, and the log says why."""
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_node_selector(raw)


def test_a_specific_selector_outranks_a_subnet_without_one() -> None:
    selectors = {
        "default": selector(None),
        "gpu": selector({"matchLabels": {"pool": "gpu"}}),
    }
    assert place_node({"pool": "gpu"}, selectors) == Placement("gpu")
    assert place_node({"pool": "web"}, selectors) == Placement("default")


def test_a_node_no_subnet_serves_is_placed_nowhere() -> None:
    selectors = {"gpu": selector({"matchLabels": {"pool": "gpu"}})}
    assert place_node({"pool": "web"}, selectors) == Placement("")
    assert place_node({}, {}) == Placement("")


def test_a_contested_node_goes_to_the_first_by_name_and_says_so() -> None:
    selectors = {
        "b": selector({"matchLabels": {"zone": "1"}}),
        "a": selector({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}),
        "c": selector(None),
    }
    assert place_node({"zone": "1"}, selectors) == Placement("a", ("a", "b"))
    assert place_node({}, {"y": selector(None), "x": selector({})}) == Placement("x", ("x", "y"))


labels = st.dictionaries(st.sampled_from(["pool", "zone", "gpu"]), st.sampled_from(["a", "b"]))
raw_selectors = st.one_of(
    st.none(),
    st.builds(lambda d: {"matchLabels": d}, labels),
)


@given(st.dictionaries(st.sampled_from("abcdef"), raw_selectors, max_size=5), labels)
def test_placement_depends_on_the_subnets_not_on_their_order(
    raws: dict[str, object], node: dict[str, str]
) -> None:
    """Every shard and every replica must place a node alike, whatever order its cache lists
    the subnets in; and the subnet chosen matches the node."""
    selectors = {name: selector(raw) for name, raw in raws.items()}
    placed = place_node(node, selectors)
    assert place_node(node, dict(reversed(selectors.items()))) == placed
    if placed.subnet:
        assert selectors[placed.subnet].matches(node)


def net(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(cidr)


def test_only_the_oldest_of_overlapping_subnets_is_served() -> None:
    ranges = [
        ("old", net("10.0.0.0/16")),
        ("inside", net("10.0.4.0/24")),
        ("apart", net("10.1.0.0/16")),
        ("around", net("10.0.0.0/8")),
        ("v6", net("fd00::/64")),
    ]
    assert overlapping(ranges) == {"inside": "old", "around": "old"}
    # A range refused is no obstacle to others: only served ones are.
    assert overlapping([("a", net("10.0.0.0/24")), ("b", net("10.0.0.0/16")),
                        ("c", net("10.0.1.0/24"))]) == {"b": "a"}  # fmt: skip
