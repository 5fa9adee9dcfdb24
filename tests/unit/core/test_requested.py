"""The addresses a pod asks for (cns/core/requested.py) and the annotation that carries them
(cns/kube/pods.py `pod_address`): pure."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.core.requested import Misplaced, parse_requested, place
from cns.kube.pods import pod_address

NETWORKS = {
    "v4pods": [ipaddress.ip_network("10.1.0.0/24")],
    "v6pods": [ipaddress.ip_network("fd00::/64")],
    "other4": [ipaddress.ip_network("10.2.0.0/24")],
    "fresh": [],  # no network container yet
}


def test_one_address_or_one_per_family_canonical_in_order() -> None:
    assert parse_requested("") == parse_requested("  ") == ()
    assert parse_requested("10.1.0.9") == ("10.1.0.9",)
    assert parse_requested(" FD00:0::9 , 10.1.0.9") == ("fd00::9", "10.1.0.9")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("banana", "'banana' is not an IP address"),
        ("10.1.0.9,", "'' is not an IP address"),
        ("10.1.0.9/24", "'10.1.0.9/24' is not an IP address"),
        ("10.1.0.9,10.1.0.10", "10.1.0.9 and 10.1.0.10 are both IPv4"),
        ("fd00::9,fd00::9", "fd00::9 and fd00::9 are both IPv6"),
        ("10.1.0.9,fd00::9,fd00::a", "more than two addresses"),
        ("," * 100_000, "more than two addresses"),
    ],
)
def test_anything_else_is_refused_saying_what_is_wrong(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match="^" + problem.replace("(", r"\(").replace(".", r"\.")):
        parse_requested(value)


@given(st.text(max_size=60))
def test_parsing_never_fails_otherwise_and_round_trips(value: str) -> None:
    try:
        parsed = parse_requested(value)
    except ValueError:
        return
    assert parse_requested(",".join(parsed)) == parsed
    assert len({ipaddress.ip_address(a).version for a in parsed}) == len(parsed) <= 2


def test_each_address_goes_to_the_named_subnet_holding_it() -> None:
    both = ("v4pods", "v6pods")
    assert place(("fd00::9", "10.1.0.9"), named=both, networks=NETWORKS) == (
        {"v6pods": "fd00::9", "v4pods": "10.1.0.9"},
        (),
    )
    # Of one subnet, its address is its own: whether its pool has it is the pool's to say.
    assert place(("10.9.0.9",), named=("v4pods",), networks=NETWORKS) == (
        {"v4pods": "10.9.0.9"},
        (),
    )
    # A named subnet without a container yet may hold the address: not placed yet.
    assert place(("fd00:1::9",), named=("v4pods", "fresh"), networks=NETWORKS) == (
        {},
        ("fd00:1::9",),
    )


@pytest.mark.parametrize(
    ("addresses", "named", "problem"),
    [
        (("10.2.0.9",), ("v4pods", "v6pods"), "10.2.0.9 is in subnet other4, which the ADD does "
         "not name (it names v4pods, v6pods)"),
        (("10.2.0.9",), ("v4pods",), "10.2.0.9 is in subnet other4, which the ADD does not name "
         "(it names v4pods)"),
        (("10.1.0.9",), ("",), "10.1.0.9 is in subnet v4pods, which the ADD does not name (it "
         "names the primary subnet)"),
        (("10.9.0.9", "fd00::9"), ("v4pods", "v6pods"), "10.9.0.9 is in none of the subnets the "
         "ADD names (v4pods, v6pods)"),
        (("10.1.0.9", "10.1.0.10"), ("v4pods", "v6pods"), "10.1.0.9 and 10.1.0.10 are both in "
         "subnet v4pods"),
    ],
)  # fmt: skip
def test_addresses_that_do_not_fit_the_named_subnets_are_misplaced(
    addresses: tuple[str, ...], named: tuple[str, ...], problem: str
) -> None:
    with pytest.raises(Misplaced) as wrong:
        place(addresses, named=named, networks=NETWORKS)
    assert str(wrong.value) == problem


def test_the_annotation_carries_one_address_or_one_per_family() -> None:
    def pod(value: object) -> dict[str, object]:
        return {"metadata": {"annotations": {"acn.azure.com/ip-address": value}}}

    assert pod_address({"metadata": {}}) is None
    assert pod_address(pod("10.1.0.9")) == "10.1.0.9"
    assert pod_address(pod("10.1.0.9, FD00::9")) == "10.1.0.9,fd00::9"
    with pytest.raises(ValueError, match="are both IPv4"):
        pod_address(pod("10.1.0.9,10.1.0.10"))
    with pytest.raises(ValueError, match="is not an IP address"):
        pod_address(pod("not-an-address"))
