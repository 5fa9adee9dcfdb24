"""The event correlator and outbox (cns/core/events.py): one Event per (object, type, reason)
with a count, a spam filter per object, bounded memory, a bounded queue that drops and counts."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core.events import (
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    NORMAL,
    WARNING,
    Correlator,
    Note,
    ObjectRef,
    Outbox,
)

POD = ObjectRef("Pod", "web-0", "default")


def note(about: ObjectRef = POD, reason: str = "WaitingForIPAddress", message: str = "m") -> Note:
    return Note(about, WARNING, reason, message)


def test_repeats_of_one_reason_are_one_aggregate_with_a_count_and_the_latest_message() -> None:
    correlator = Correlator()
    first = correlator.observe(note(message="exhausted"), 100.0)
    again = correlator.observe(note(message="allocation pending"), 105.0)
    assert first is again and again is not None
    assert (again.count, again.first_at, again.last_at) == (2, 100.0, 105.0)
    assert again.message == "allocation pending"
    assert len(correlator) == 1


def test_another_reason_or_type_or_object_is_another_aggregate_with_its_own_name() -> None:
    correlator = Correlator()
    seen = [
        correlator.observe(note(), 1.0),
        correlator.observe(note(reason="RequestedIPAddressRefused"), 1.0),
        correlator.observe(Note(POD, NORMAL, "WaitingForIPAddress", "m"), 1.0),
        correlator.observe(note(ObjectRef("Pod", "web-1", "default")), 1.0),
    ]
    assert all(a is not None and a.count == 1 for a in seen)
    assert len({a.name for a in seen if a is not None}) == 4  # same instant, distinct names


def test_spam_filter_admits_a_burst_then_one_per_refill() -> None:
    correlator = Correlator(burst=3, qps=0.1)
    admitted = [correlator.observe(note(), 0.0) is not None for _ in range(5)]
    assert admitted == [True, True, True, False, False]
    assert correlator.rate_limited == 2
    assert correlator.observe(note(), 5.0) is None  # half a token
    assert correlator.observe(note(), 10.0) is not None
    other = ObjectRef("Pod", "web-1", "default")  # the filter is per object
    assert correlator.observe(note(other), 10.0) is not None


def test_a_long_message_is_cut_and_a_long_name_is_kept_a_dns_name() -> None:
    long_ref = ObjectRef("Pod", "p" * 300, "default")
    aggregate = Correlator().observe(note(long_ref, message="x" * 5000), 1.0)
    assert aggregate is not None
    assert len(aggregate.message) == MAX_MESSAGE_CHARS and aggregate.message.endswith("...")
    assert len(aggregate.name) <= MAX_NAME_CHARS


def test_outbox_holds_an_aggregate_once_and_drops_beyond_capacity() -> None:
    correlator, outbox = Correlator(), Outbox(capacity=2)
    a = correlator.observe(note(), 1.0)
    b = correlator.observe(note(reason="B"), 1.0)
    c = correlator.observe(note(reason="C"), 1.0)
    assert a and b and c
    assert outbox.put(a) and outbox.put(a) and outbox.put(b)
    assert not outbox.put(c)
    assert (len(outbox), outbox.dropped) == (2, 1)
    assert outbox.take() is a and outbox.take() is b and outbox.take() is None


refs = st.builds(
    ObjectRef,
    kind=st.sampled_from(["Pod", "NodeNetworkConfig"]),
    name=st.sampled_from(["a", "b", "c", "d", "e"]),
    namespace=st.sampled_from(["", "default"]),
)
notes = st.builds(
    Note,
    about=refs,
    type=st.sampled_from([NORMAL, WARNING]),
    reason=st.sampled_from(["R1", "R2", "R3"]),
    message=st.text(max_size=5),
)
timed_notes = st.lists(
    st.tuples(notes, st.floats(min_value=0, max_value=100, allow_nan=False)), max_size=200
)


@settings(max_examples=200)
@given(timed_notes)
def test_without_limits_each_key_is_one_aggregate_counting_its_notes(
    sequence: list[tuple[Note, float]],
) -> None:
    correlator = Correlator(max_objects=1000, burst=10_000, qps=1)
    expected: collections.Counter[tuple[ObjectRef, str, str]] = collections.Counter()
    made = {}
    for n, at in sorted(sequence, key=lambda pair: pair[1]):
        aggregate = correlator.observe(n, at)
        assert aggregate is not None
        key = (n.about, n.type, n.reason)
        expected[key] += 1
        made[key] = aggregate
        assert aggregate.message == n.message
    assert {k: a.count for k, a in made.items()} == dict(expected)
    assert len({a.name for a in made.values()}) == len(made)


@settings(max_examples=200)
@given(
    timed_notes,
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=1, max_value=5),
    st.integers(min_value=1, max_value=6),
)
def test_memory_and_queue_stay_bounded_and_every_note_is_counted_somewhere(
    sequence: list[tuple[Note, float]], max_objects: int, burst: int, capacity: int
) -> None:
    correlator = Correlator(max_objects=max_objects, burst=burst, qps=0.5)
    outbox = Outbox(capacity=capacity)
    admitted = queued = 0
    for n, at in sorted(sequence, key=lambda pair: pair[1]):
        aggregate = correlator.observe(n, at)
        if aggregate is not None:
            admitted += 1
            queued += outbox.put(aggregate)
        assert len(correlator) <= max_objects and correlator.objects <= max_objects
        assert len(outbox) <= capacity
    assert admitted + correlator.rate_limited == len(sequence)
    assert queued + outbox.dropped == admitted


@settings(max_examples=200)
@given(
    st.lists(st.floats(min_value=0, max_value=1000, allow_nan=False), max_size=300),
    st.integers(min_value=1, max_value=30),
    st.floats(min_value=0.001, max_value=2),
)
def test_spam_filter_never_admits_more_than_burst_plus_refill(
    times: list[float], burst: int, qps: float
) -> None:
    correlator = Correlator(burst=burst, qps=qps)
    times = sorted(times)
    admitted = [t for t in times if correlator.observe(note(), t) is not None]
    if admitted:
        span = admitted[-1] - times[0]
        assert len(admitted) <= burst + span * qps + 1e-9
