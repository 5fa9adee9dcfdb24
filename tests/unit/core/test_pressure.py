"""IP pressure's hysteresis (cns/core/pressure.py) on random sequences of lane readings: it
matches a model that recomputes every decision from the whole history, enters and leaves only
for the documented reasons, and never flaps."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core.pressure import Cause, LaneReading, Pressure, PressureSettings, describe, step

SETTINGS = PressureSettings(
    enabled=True, enter_after_seconds=10, leave_free=3, leave_after_seconds=30
)
Reading = tuple[float, tuple[LaneReading, ...]]  # (time, every lane)

lane_readings = st.builds(
    LaneReading,
    subnet=st.sampled_from(["", "pods2"]),
    free=st.integers(0, 5),
    exhausted=st.booleans(),
    at_max_ip_count=st.booleans(),
)
histories = st.lists(
    st.tuples(st.floats(0, 20), st.lists(lane_readings, max_size=2, unique_by=lambda r: r.subnet)),
    max_size=60,
).map(
    lambda steps: [
        (sum(gap for gap, _ in steps[: i + 1]), tuple(lanes)) for i, (_, lanes) in enumerate(steps)
    ]
)
band = st.builds(
    LaneReading,
    subnet=st.just(""),
    free=st.integers(1, SETTINGS.leave_free - 1),
    exhausted=st.just(True),
    at_max_ip_count=st.booleans(),
)


def run(history: Sequence[Reading], start: Pressure | None = None) -> list[Pressure]:
    state, states = start or Pressure(), []
    for now, lanes in history:
        state = step(state, lanes, now=now, settings=SETTINGS)
        states.append(state)
    return states


def starving(lanes: Sequence[LaneReading]) -> bool:
    return any(lane.cause is not None and lane.free == 0 for lane in lanes)


def short(lanes: Sequence[LaneReading]) -> bool:
    return any(lane.cause is not None and lane.free < SETTINGS.leave_free for lane in lanes)


def held_since(history: Sequence[Reading], end: int, holds: bool, since: int) -> float:
    """When the run of readings ending at `end` (after index `since`) for which `starving` (or
    not `short`) holds began."""
    first = end
    while first - 1 > since and (
        starving(history[first - 1][1]) if holds else not short(history[first - 1][1])
    ):
        first -= 1
    return history[first][0]


def model(history: Sequence[Reading]) -> list[bool]:
    """Every decision recomputed from the history alone."""
    pressed, changed_at, answers = False, -1, []
    for i, (now, lanes) in enumerate(history):
        if not pressed:
            at_max = any(lane.starving and lane.cause is Cause.MAX_IP_COUNT for lane in lanes)
            run_began = held_since(history, i, True, changed_at)
            if starving(lanes) and (at_max or now - run_began >= SETTINGS.enter_after_seconds):
                pressed, changed_at = True, i
        elif not short(lanes):
            roomy = all(lane.free >= SETTINGS.leave_free for lane in lanes)
            if (
                roomy
                or now - held_since(history, i, False, changed_at) >= SETTINGS.leave_after_seconds
            ):
                pressed, changed_at = False, i
        answers.append(pressed)
    return answers


@settings(max_examples=400)
@given(histories)
def test_every_decision_is_what_the_whole_history_says(history: list[Reading]) -> None:
    assert [state.pressed for state in run(history)] == model(history)


@settings(max_examples=400)
@given(histories)
def test_it_enters_only_with_a_starving_lane_and_leaves_only_without_a_short_one(
    history: list[Reading],
) -> None:
    before = False
    for (_, lanes), state in zip(history, run(history), strict=True):
        if state.pressed and not before:
            assert starving(lanes)
            assert state.lanes and state.cause is not None
        if before and not state.pressed:
            assert not short(lanes)
        before = state.pressed


@settings(max_examples=400)
@given(histories)
def test_between_two_changes_the_input_crossed_the_whole_band(history: list[Reading]) -> None:
    """Entering needs a lane with no free address; leaving needs no lane short: the flag goes
    True, False, True only if the readings went starving, not short, starving (not just noise
    inside the band or on one edge)."""
    states = run(history)
    changes = [i for i in range(len(states)) if states[i].pressed != (i and states[i - 1].pressed)]
    for i in changes:
        lanes = history[i][1]
        assert starving(lanes) if states[i].pressed else not short(lanes)


@given(st.lists(st.tuples(st.floats(0, 100), st.lists(band, min_size=1, max_size=1)), max_size=40),
       st.booleans())  # fmt: skip
def test_readings_inside_the_band_never_change_the_answer(
    steps: list[tuple[float, list[LaneReading]]], pressed: bool
) -> None:
    history = [(sum(g for g, _ in steps[: i + 1]), tuple(ls)) for i, (_, ls) in enumerate(steps)]
    start = Pressure(pressed=pressed, lanes=("",), cause=Cause.EXHAUSTED) if pressed else None
    assert all(state.pressed is pressed for state in run(history, start))


@given(lane_readings, st.lists(st.floats(0, 100), min_size=1, max_size=30))
def test_the_same_reading_over_and_over_changes_the_answer_at_most_once(
    lane: LaneReading, gaps: list[float]
) -> None:
    history = [(sum(gaps[: i + 1]), (lane,)) for i in range(len(gaps))]
    answers = [state.pressed for state in run(history)]
    assert sum(1 for a, b in zip([False, *answers], answers, strict=False) if a != b) <= 1


def exhausted(free: int) -> tuple[LaneReading, ...]:
    return (LaneReading(subnet="pods2", free=free, exhausted=True, at_max_ip_count=False),)


def test_an_exhausted_lane_enters_after_the_delay_and_a_full_one_at_once() -> None:
    states = run([(0, exhausted(0)), (9.9, exhausted(0)), (10, exhausted(0))])
    assert [s.pressed for s in states] == [False, False, True]
    assert states[-1].lanes == ("pods2",) and states[-1].cause is Cause.EXHAUSTED
    full = LaneReading(subnet="", free=0, exhausted=False, at_max_ip_count=True)
    (state,) = run([(0, (full,))])
    assert state.pressed and state.cause is Cause.MAX_IP_COUNT
    assert "maxIPCount" in describe(state, SETTINGS)


def test_a_free_address_in_between_restarts_the_delay() -> None:
    states = run([(0, exhausted(0)), (6, exhausted(1)), (7, exhausted(0)), (16, exhausted(0))])
    assert not any(s.pressed for s in states)
    assert run([(0, exhausted(0)), (7, exhausted(0)), (17, exhausted(0))])[-1].pressed


def test_it_leaves_with_enough_free_at_once_or_with_the_cause_gone_for_a_while() -> None:
    pressed = Pressure(pressed=True, lanes=("pods2",), cause=Cause.EXHAUSTED)
    assert not run([(0, exhausted(3))], pressed)[-1].pressed
    cleared = (LaneReading(subnet="pods2", free=0, exhausted=False, at_max_ip_count=False),)
    states = run([(0, cleared), (29, cleared), (30, cleared)], pressed)
    assert [s.pressed for s in states] == [True, True, False]
    assert describe(states[-1], SETTINGS) == "the node can give pods addresses"


def test_a_decision_found_at_start_is_kept_and_learns_its_cause() -> None:
    found = Pressure(pressed=True)
    assert describe(found, SETTINGS).startswith("found set when the daemon started")
    full = LaneReading(subnet="", free=0, exhausted=False, at_max_ip_count=True)
    (state,) = run([(0, (full,))], found)
    assert state.pressed and state.cause is Cause.MAX_IP_COUNT and state.lanes == ("",)
    assert not run([(0, exhausted(3))], found)[-1].pressed
