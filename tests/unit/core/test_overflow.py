"""Overflow: the gate, the choice of subnet, and the demand counted once (cns/core/overflow.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cns.core.overflow import (
    OverflowCandidate,
    first_with_room,
    overflow_demand,
    overflow_target,
    primary_demand,
    spill,
)

A, B = OverflowCandidate("a"), OverflowCandidate("b")


def test_no_overflow_while_the_primary_has_a_free_address_even_when_exhausted() -> None:
    assert overflow_target(primary_exhausted=True, primary_free=1, candidates=[A]) is None


def test_no_overflow_while_the_primary_is_not_exhausted_even_with_no_free_address() -> None:
    assert overflow_target(primary_exhausted=False, primary_free=0, candidates=[A]) is None


def test_exhausted_and_no_free_address_takes_the_first_subnet_with_room_in_order() -> None:
    assert overflow_target(primary_exhausted=True, primary_free=0, candidates=[A, B]) == "a"
    full_a = OverflowCandidate("a", exhausted=True)
    assert overflow_target(primary_exhausted=True, primary_free=0, candidates=[full_a, B]) == "b"


def test_a_draining_primary_sends_its_pods_on_as_an_exhausted_one_does() -> None:
    for free in (0, 3):  # a draining primary's free addresses go back, none is handed out
        target = overflow_target(
            primary_exhausted=False, primary_draining=True, primary_free=free, candidates=[B]
        )
        assert target == "b"


def test_a_subnet_draining_removed_exhausted_or_of_the_other_family_has_no_room() -> None:
    without_room = [
        OverflowCandidate("a", exhausted=True),
        OverflowCandidate("b", draining=True),
        OverflowCandidate("c", removed=True),
        OverflowCandidate("d", usable=False),
    ]
    assert first_with_room(without_room) is None
    assert first_with_room([*without_room, OverflowCandidate("e")]) == "e"


def test_spill_counts_only_what_the_primary_cannot_serve_and_only_while_the_gate_is_open() -> None:
    assert spill(primary_exhausted=True, demand=30, holds=24) == 6
    assert spill(primary_exhausted=True, demand=20, holds=24) == 0
    assert spill(primary_exhausted=False, demand=30, holds=24) == 0
    assert spill(primary_exhausted=False, primary_draining=True, demand=30, holds=24) == 6


@given(
    chosen_primary=st.integers(0, 500),
    overflowed=st.integers(0, 500),
    chosen_overflow=st.integers(0, 500),
    spilled=st.integers(0, 500),
)
def test_a_pod_that_overflowed_is_counted_once_across_the_two_subnets(
    chosen_primary: int, overflowed: int, chosen_overflow: int, spilled: int
) -> None:
    """The pods the cluster counts for the primary (`chosen_primary`, among them those holding
    an overflow address) plus those choosing the overflow subnet by name, plus those counted
    ahead: each once, in one subnet."""
    overflowed = min(overflowed, chosen_primary)
    total = primary_demand(chosen_primary, overflowed=overflowed) + overflow_demand(
        chosen_overflow, overflowed=overflowed, spilled=spilled
    )
    assert total == chosen_primary + chosen_overflow + spilled


def test_a_draining_primary_falls_back_to_an_exhausted_subnet_that_still_grants() -> None:
    """A draining primary grants nothing at all: with every overflow subnet exhausted, its
    pods go to the first that still grants (exhausted, not draining, same family) rather than
    wait for ever. An exhausted primary keeps its pods (it grants too)."""
    full, drained = OverflowCandidate("full", exhausted=True), OverflowCandidate("d", draining=True)
    assert first_with_room([drained, full], primary_draining=True) == "full"
    assert first_with_room([drained, full]) is None
    target = overflow_target(
        primary_exhausted=True, primary_draining=True, primary_free=0, candidates=[drained, full]
    )
    assert target == "full"
    assert overflow_target(primary_exhausted=True, primary_free=0, candidates=[full]) is None
