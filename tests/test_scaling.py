"""The idempotent target, release hysteresis and exhaustion: worked examples and properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.core.batch import most_free
from cns.core.scaling import (
    effective_batch,
    is_settled,
    next_exhausted,
    next_request,
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
