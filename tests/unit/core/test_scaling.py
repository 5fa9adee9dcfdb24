"""The idempotent target, release hysteresis and exhaustion: worked examples and properties."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cns.core.batch import most_free
from cns.core.scaling import (
    effective_batch,
    exhaustion_after,
    is_settled,
    next_exhausted,
    next_request,
    reserved_once_cleared,
    target_request,
)
from cns.core.types import Scaler

DEFAULT = Scaler()


def test_seed_example_b16_mf05_u25_is_48() -> None:
    # docs/design/pool-scaling.md: B=16, mf=0.5, U=25 -> Request = 48 (no primary IP).
    assert target_request(DEFAULT, demand=25, primary_ip_count=0, exhausted=False) == 48


def test_primary_ip_deduction_keeps_total_aligned() -> None:
    # docs/design/errata.md: B=16, mf=0.5, U=24 -> 31 requested, only 7 free, total 32.
    assert target_request(DEFAULT, 24, 1, False) == 31


def test_empty_node_requests_one_batch_minus_primary() -> None:
    assert target_request(DEFAULT, 0, 1, False) == 15


def test_exhausted_keeps_exactly_one_free_secondary() -> None:
    for demand in range(0, 40):
        assert target_request(DEFAULT, demand, 1, True) == demand + 1
        assert target_request(DEFAULT, demand, 3, True) == demand + 1


def test_primary_deduction_never_takes_the_last_free_ip() -> None:
    no_buffer = Scaler(request_threshold_percent=0, release_threshold_percent=100)
    # mf=0, U=16: 16*ceil(1)=16, minus the primary would leave 15 < U: one more batch instead.
    assert target_request(no_buffer, 16, 1, False) == 31


def test_max_ip_count_clamps_the_total() -> None:
    assert target_request(DEFAULT, 240, 1, False) == 249
    assert target_request(DEFAULT, 500, 1, False) == 249
    assert target_request(Scaler(max_ip_count=1), 0, 1, False) == 0


def test_grow_is_one_step_not_one_batch_at_a_time() -> None:
    # 100 pods scheduled at once: straight to the target, no intermediate 1-batch steps.
    assert (
        next_request(DEFAULT, current=15, demand=100, primary_ip_count=1, exhausted=False)
        == 16 * math.ceil(0.5 + 100 / 16) - 1
    )


def test_shrink_waits_for_the_release_threshold() -> None:
    # 47 requested (total 48); U drops to 24: 23 free <= 1.5*16 = 24 -> keep.
    assert next_request(DEFAULT, current=47, demand=24, primary_ip_count=1, exhausted=False) == 47
    # U drops to 20: 27 free > 24 -> shrink in one step to the target for U=20.
    assert (
        next_request(DEFAULT, current=47, demand=20, primary_ip_count=1, exhausted=False)
        == target_request(DEFAULT, 20, 1, False)
        == 31
    )


def test_exhaustion_releases_down_to_one_free_ip() -> None:
    assert next_request(DEFAULT, current=47, demand=20, primary_ip_count=1, exhausted=True) == 21


def test_batch_change_realigns_at_once() -> None:
    # The batch went from 16 to 8 with 20 requested (total 21): not aligned, take the target.
    small = Scaler(batch_size=8)
    assert (
        next_request(small, current=20, demand=10, primary_ip_count=1, exhausted=False)
        == target_request(small, 10, 1, False)
        == 15
    )


def test_next_exhausted_hysteresis() -> None:
    assert next_exhausted(False, 91, 100, 90, 50) is True
    assert next_exhausted(False, 90, 100, 90, 50) is False
    assert next_exhausted(True, 60, 100, 90, 50) is True
    assert next_exhausted(True, 49, 100, 90, 50) is False
    assert next_exhausted(False, 0, 0, 90, 50) is True


def test_an_idle_node_takes_back_its_floor_once_exhaustion_clears() -> None:
    # docs/simulate.md, churn-24 with minIPCount 40: idle and exhausted, a node asks for 1
    # (batch 1, one free IP); cleared, it takes 47 secondary IPs (3 batches minus the primary).
    floor = Scaler(min_ip_count=40)
    assert target_request(floor, 0, 1, True) == 1
    assert reserved_once_cleared(floor, 1, 1) == 48
    assert reserved_once_cleared(floor, 0, 1) == 48  # no request yet: the floor still comes
    assert reserved_once_cleared(DEFAULT, 25, 1) == 32  # U = 24: 31 and the primary
    assert reserved_once_cleared(Scaler(max_ip_count=30), 29, 1) == 30  # maxIPCount caps it


def test_exhaustion_clears_only_if_what_comes_back_keeps_it_cleared() -> None:
    # 8 idle nodes on a /24: 16 reserved at batch 1, 8 * 48 = 384 once cleared (> 90 % of 253).
    def after(reserved: int, once_cleared: int, exhausted: bool = True) -> bool:
        return exhaustion_after(
            exhausted,
            reserved=reserved,
            once_cleared=once_cleared,
            capacity=253,
            upper_percent=90,
            lower_percent=50,
        )

    assert after(16, 384) is True  # next_exhausted alone would clear: 16 < 126.5
    assert next_exhausted(True, 16, 253, 90, 50) is False
    assert after(16, 227) is False  # 227 <= 227.7: stays cleared once the nodes take it
    assert after(16, 228) is True
    assert after(127, 0) is True  # the lower threshold still applies
    assert after(228, 0, exhausted=False) is True  # setting is unchanged
    assert after(227, 10**6, exhausted=False) is False


def test_scaler_problems_name_fields() -> None:
    bad = Scaler(batch_size=0, request_threshold_percent=120, release_threshold_percent=100)
    problems = " ".join(bad.problems())
    assert "batchSize" in problems
    assert "requestThresholdPercent" in problems
    assert "releaseThresholdPercent" in problems
    assert Scaler().problems() == []


# -- properties ---------------------------------------------------------------------------------


@st.composite
def scalers(draw: st.DrawFn) -> Scaler:
    batch = draw(st.integers(1, 64))
    request = draw(st.integers(0, 100))
    release = draw(st.integers(request + 100, request + 300))
    max_ip = draw(st.integers(1, 512))
    floor = draw(st.one_of(st.just(0), st.integers(0, max_ip - 1)))
    return Scaler(batch, request, release, max_ip, floor)


demands = st.integers(0, 600)
primaries = st.integers(0, 4)


@given(scalers(), demands, primaries, st.booleans())
def test_target_is_aligned_unless_clamped(
    scaler: Scaler, demand: int, primary: int, exhausted: bool
) -> None:
    target = target_request(scaler, demand, primary, exhausted)
    assert target >= 0
    assert target + primary <= max(scaler.max_ip_count, primary)
    clamped = target + primary >= scaler.max_ip_count
    if not clamped:
        assert (target + primary) % effective_batch(scaler, exhausted) == 0
        # at least mf*B free and never fewer than one free IP
        assert target - demand >= 1
        mf_b = scaler.request_threshold_percent / 100 * effective_batch(scaler, exhausted)
        assert target + primary - demand >= mf_b - 1e-9
        if not exhausted:  # the warm floor, dropped while the subnet is exhausted
            assert target >= scaler.min_ip_count


@given(scalers(), st.lists(demands, min_size=1, max_size=20), primaries)
def test_a_node_keeps_no_more_free_than_the_controller_assumes(
    scaler: Scaler, history: list[int], primary: int
) -> None:
    """`most_free` is what the controller's batch rule assumes a node holds beyond its used IPs
    (docs/design/phase4.md); with a warm floor too, whatever the history of demand."""
    current = 0
    for demand in history:
        current = next_request(
            scaler, current=current, demand=demand, primary_ip_count=primary, exhausted=False
        )
    bound = most_free(
        scaler.batch_size,
        request_threshold_percent=scaler.request_threshold_percent,
        release_threshold_percent=scaler.release_threshold_percent,
        min_ip_count=scaler.min_ip_count,
    )
    assert current - history[-1] <= bound


def test_the_warm_floor_keeps_whole_batches_and_drops_under_exhaustion() -> None:
    warm = Scaler(batch_size=16, min_ip_count=20)
    assert target_request(warm, 0, 1, False) == 31  # 20 + 1 primary, up to 2 batches
    assert target_request(warm, 0, 0, False) == 32
    assert target_request(warm, 30, 1, False) == 47  # the formula is above the floor
    assert target_request(warm, 0, 1, True) == 1  # exhausted: one free IP is the floor
    assert (
        target_request(Scaler(batch_size=16, max_ip_count=25, min_ip_count=20), 0, 1, False) == 24
    )
    assert "minIPCount" in Scaler(max_ip_count=10, min_ip_count=10).problems()[0]


@given(scalers(), st.integers(0, 600), demands, primaries, st.booleans())
def test_next_request_is_a_fixed_point(
    scaler: Scaler, current: int, demand: int, primary: int, exhausted: bool
) -> None:
    once = next_request(
        scaler, current=current, demand=demand, primary_ip_count=primary, exhausted=exhausted
    )
    assert (
        next_request(
            scaler, current=once, demand=demand, primary_ip_count=primary, exhausted=exhausted
        )
        == once
    )
    assert once >= target_request(scaler, demand, primary, exhausted) or once == current
    assert is_settled(scaler, once, primary, exhausted) or once + primary > scaler.max_ip_count


@given(scalers(), demands, primaries, st.booleans(), st.integers(2, 30))
def test_a_pod_toggling_at_a_batch_boundary_changes_the_request_at_most_once(
    scaler: Scaler, demand: int, primary: int, exhausted: bool, rounds: int
) -> None:
    current = next_request(
        scaler, current=0, demand=demand, primary_ip_count=primary, exhausted=exhausted
    )
    changes = 0
    for step in range(rounds):
        u = demand + (step + 1) % 2
        new = next_request(
            scaler, current=current, demand=u, primary_ip_count=primary, exhausted=exhausted
        )
        changes += new != current
        current = new
    assert changes <= 1


@given(scalers(), st.lists(demands, min_size=1, max_size=30), primaries, st.booleans())
def test_converged_total_is_a_multiple_of_batch_unless_clamped(
    scaler: Scaler, history: list[int], primary: int, exhausted: bool
) -> None:
    current = 0
    for demand in history:
        current = next_request(
            scaler, current=current, demand=demand, primary_ip_count=primary, exhausted=exhausted
        )
        total = current + primary
        clamped = current == max(0, scaler.max_ip_count - primary)
        assert clamped or total % effective_batch(scaler, exhausted) == 0


@pytest.mark.parametrize("exhausted", [False, True])
@given(current=st.integers(0, 300), demand=st.integers(0, 240))
def test_request_covers_demand(exhausted: bool, current: int, demand: int) -> None:
    request = next_request(
        DEFAULT, current=current, demand=demand, primary_ip_count=1, exhausted=exhausted
    )
    assert request >= min(demand + 1, DEFAULT.max_ip_count - 1)


# -- exhaustion with the nodes' reactions: no flip back ------------------------------------------


@given(scalers(), st.integers(0, 300), primaries, st.integers(0, 600), st.booleans())
def test_what_a_node_takes_back_is_never_more_than_counted(
    scaler: Scaler, demand: int, primary: int, current: int, heard: bool
) -> None:
    """From whatever request a node sends (batch 1 once it has heard of the exhaustion, its
    batch of before while it has not), `reserved_once_cleared` bounds what it holds once the
    exhaustion clears, for as long as its demand stays."""
    requested = next_request(
        scaler, current=current, demand=demand, primary_ip_count=primary, exhausted=heard
    )
    counted = reserved_once_cleared(scaler, requested, primary)
    sent = requested
    for _ in range(3):
        sent = next_request(
            scaler, current=sent, demand=demand, primary_ip_count=primary, exhausted=False
        )
        assert primary + sent <= counted


Cluster = tuple[Scaler, list[tuple[int, int]], int, int, int]


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    """A scaler, nodes as (demand, primary IPs), a capacity and exhaustion thresholds."""
    scaler = draw(scalers())
    nodes = draw(
        st.lists(st.tuples(st.integers(0, 80), st.integers(1, 2)), min_size=1, max_size=12)
    )
    capacity = draw(st.integers(1, 2000))
    upper = draw(st.integers(1, 100))
    lower = draw(st.integers(0, upper))
    return scaler, nodes, capacity, upper, lower


def exhaustion_rounds(
    cluster: Cluster, exhausted: bool, currents: list[int], rounds: int = 12
) -> list[bool]:
    """Rounds of a subnet whose nodes' demands do not change: each node sends the request for
    the exhaustion state it was told, the control plane grants what fits and decides the state
    from what is reserved and what the nodes would take back. The states, first one included."""
    scaler, nodes, capacity, upper, lower = cluster
    states = [exhausted]
    for _ in range(rounds):
        currents = [
            next_request(
                scaler, current=current, demand=demand, primary_ip_count=primary,
                exhausted=exhausted,
            )
            for current, (demand, primary) in zip(currents, nodes, strict=True)
        ]  # fmt: skip
        exhausted = exhaustion_after(
            exhausted,
            reserved=min(capacity, sum(p + c for c, (_, p) in zip(currents, nodes, strict=True))),
            once_cleared=sum(
                reserved_once_cleared(scaler, c, p)
                for c, (_, p) in zip(currents, nodes, strict=True)
            ),
            capacity=capacity,
            upper_percent=upper,
            lower_percent=lower,
        )
        states.append(exhausted)
    return states


def changes(states: list[bool]) -> int:
    return sum(a != b for a, b in itertools.pairwise(states))


@given(clusters())
def test_with_fixed_demands_exhaustion_changes_at_most_once(cluster: Cluster) -> None:
    """Nodes starting out (no request yet, not exhausted) with demands that do not change: the
    subnet becomes exhausted or not, once, and stays so. With `next_exhausted` alone a warm
    floor or a large batch on enough nodes flips it every round trip."""
    states = exhaustion_rounds(cluster, False, [0] * len(cluster[1]))
    assert changes(states) <= 1, states


@given(clusters(), st.booleans(), st.lists(st.integers(0, 300), min_size=12, max_size=12))
@example((Scaler(min_ip_count=40), [(0, 1)] * 8, 253, 90, 50), False, [0] * 12)  # churn-24
def test_from_any_pools_a_cleared_exhaustion_never_returns(
    cluster: Cluster, exhausted: bool, currents: list[int]
) -> None:
    """Whatever the nodes held before (requests kept by the release hysteresis, either state):
    once the exhaustion clears with the demands unchanged, it is not set again."""
    states = exhaustion_rounds(cluster, exhausted, currents[: len(cluster[1])])
    cleared = next((i for i in range(1, len(states)) if states[i - 1] and not states[i]), None)
    if cleared is not None:
        assert not any(states[cleared:]), states


@given(clusters())
def test_exhaustion_clears_once_the_demand_has_fallen_enough(cluster: Cluster) -> None:
    """Exhausted nodes whose demand has fallen ask for it plus one IP; when that is under the
    lower threshold and what they take back once cleared fits under the upper one, the
    exhaustion clears in the next round."""
    scaler, nodes, capacity, upper, lower = cluster
    at_batch_one = [demand + 1 for demand, _ in nodes]
    reserved = sum(p + c for c, (_, p) in zip(at_batch_one, nodes, strict=True))
    taken = sum(p + target_request(scaler, u, p, exhausted=False) for u, p in nodes)
    states = exhaustion_rounds(cluster, True, at_batch_one, rounds=1)
    fits = reserved * 100 < lower * capacity and taken * 100 <= upper * capacity
    if scaler.max_ip_count > max(u + 1 + p for u, p in nodes):
        assert states[1] == (not fits)
