"""Kubernetes Events as the kubelet writes them, decided purely: which Event object a report
lands in, with what count, and which reports are dropped.

A component reports a `Note` (about one object: a type, a reason, a message) through a
`Recorder`, which must never block and never fail: an ADD waiting for an address reports that it
waits on every try. The `Correlator` turns notes into `Aggregate`s, as client-go's
`tools/record` EventCorrelator does:

- one Event object per (object, type, reason): a repeat raises its `count` and moves its
  `lastTimestamp`, and its message is the latest (client-go keys by the message too and merges
  similar messages after ten; here the reason alone groups, so a changing "why" never makes a
  second object);
- a spam filter per object (client-go's `EventSourceObjectSpamFilter`): a token bucket of
  `burst` notes refilled at `qps`; a note beyond it is dropped and counted;
- bounded memory: both the aggregates and the buckets are LRU caches of `max_objects` entries
  (client-go's 4096), so an object seen long ago is forgotten, and its next note makes a new
  Event.

The `Outbox` is the bounded queue between the caller and the one task that writes: it holds at
most one entry per aggregate (a repeat before the write only raises the count the write will
carry) and at most `capacity` aggregates; an aggregate beyond that is dropped and counted. What
is written, and how, is the adapter's (cns/kube/events.py).

Everything here is synchronous and takes the time as an argument: no clock, no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

NORMAL = "Normal"
WARNING = "Warning"

# client-go's defaults (tools/record/events_cache.go): LRU size, spam burst and refill rate.
MAX_OBJECTS = 4096
SPAM_BURST = 25
SPAM_QPS = 1 / 300
OUTBOX_CAPACITY = 256
# The API server refuses a message over 1 KiB in events.k8s.io; core/v1 keeps it short too.
MAX_MESSAGE_CHARS = 1024


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about (its `involvedObject`)."""

    kind: str
    name: str
    namespace: str = ""
    api_version: str = "v1"
    uid: str = ""


@dataclass(frozen=True, slots=True)
class Note:
    """One report: `reason` is a CamelCase word for programs, `message` a sentence for people."""

    about: ObjectRef
    type: str
    reason: str
    message: str


class Recorder(Protocol):
    """Where the node service and the controller report what an operator should see on an
    object. `record` returns at once and never raises: a lost note is counted, not an error."""

    def record(self, note: Note) -> None: ...


class NoRecorder:
    """No Kubernetes (standalone), or events turned off: notes go nowhere."""

    def record(self, note: Note) -> None:
        return None


NO_RECORDER: Recorder = NoRecorder()

K = TypeVar("K")
V = TypeVar("V")

AggregateKey = tuple[ObjectRef, str, str]  # (object, type, reason)


def aggregate_key(note: Note) -> AggregateKey:
    return (note.about, note.type, note.reason)


MAX_NAME_CHARS = 253  # a DNS subdomain


def event_name(about: ObjectRef, stamp: int) -> str:
    """The Event object's name: the object's and a time in hex nanoseconds, as client-go names
    them; the correlator makes `stamp` unique, so two aggregates never share a name."""
    suffix = f".{stamp:x}"
    return about.name[: MAX_NAME_CHARS - len(suffix)] + suffix


def short_message(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


@dataclass(slots=True)
class Aggregate:
    """One Event object: the notes of one key since `first_at`. `written` is the count the
    API server has (0: not created yet, or its creation failed)."""

    key: AggregateKey
    name: str
    message: str
    first_at: float
    last_at: float
    count: int = 1
    written: int = 0

    @property
    def note(self) -> Note:
        about, type_, reason = self.key
        return Note(about, type_, reason, self.message)


@dataclass(slots=True)
class Tokens:
    """A token bucket that refuses instead of waiting: `take` is False when empty."""

    burst: int
    qps: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        elapsed = max(0.0, now - self.at)
        self.tokens = min(float(self.burst), self.tokens + elapsed * self.qps)
        self.at = max(self.at, now)
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(slots=True)
class Correlator:
    """Notes in, aggregates out (see the module's docstring)."""

    max_objects: int = MAX_OBJECTS
    burst: int = SPAM_BURST
    qps: float = SPAM_QPS
    rate_limited: int = 0  # notes the spam filter dropped
    _last_stamp: int = 0  # the last name's nanoseconds: each new aggregate's are later
    _aggregates: collections.OrderedDict[AggregateKey, Aggregate] = field(
        default_factory=collections.OrderedDict
    )
    _buckets: collections.OrderedDict[ObjectRef, Tokens] = field(
        default_factory=collections.OrderedDict
    )

    def observe(self, note: Note, now: float) -> Aggregate | None:
        """The aggregate `note` raised (created at count 1, or counted once more), or None
        when the spam filter drops it."""
        bucket = _lru_get(self._buckets, note.about)
        if bucket is None:
            bucket = Tokens(self.burst, self.qps, float(self.burst), now)
            _lru_put(self._buckets, note.about, bucket, self.max_objects)
        if not bucket.take(now):
            self.rate_limited += 1
            return None
        key = aggregate_key(note)
        message = short_message(note.message)
        aggregate = _lru_get(self._aggregates, key)
        if aggregate is None:
            self._last_stamp = max(self._last_stamp + 1, int(now * 1e9))
            name = event_name(note.about, self._last_stamp)
            aggregate = Aggregate(key, name, message, now, now)
            _lru_put(self._aggregates, key, aggregate, self.max_objects)
            return aggregate
        aggregate.count += 1
        aggregate.last_at = max(aggregate.last_at, now)
        aggregate.message = message
        return aggregate

    def __len__(self) -> int:
        return len(self._aggregates)

    @property
    def objects(self) -> int:
        return len(self._buckets)


def _lru_get(cache: collections.OrderedDict[K, V], key: K) -> V | None:
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def _lru_put(cache: collections.OrderedDict[K, V], key: K, value: V, size: int) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


@dataclass(slots=True)
class Outbox:
    """The aggregates waiting to be written, oldest first, each at most once."""

    capacity: int = OUTBOX_CAPACITY
    dropped: int = 0  # aggregates that found the outbox full
    _waiting: collections.OrderedDict[AggregateKey, Aggregate] = field(
        default_factory=collections.OrderedDict
    )

    def put(self, aggregate: Aggregate) -> bool:
        """Queue the aggregate's write; False (and counted) when the outbox is full. One
        already queued stays where it is: its write will carry the count it has then."""
        if aggregate.key in self._waiting:
            return True
        if len(self._waiting) >= self.capacity:
            self.dropped += 1
            return False
        self._waiting[aggregate.key] = aggregate
        return True

    def take(self) -> Aggregate | None:
        if not self._waiting:
            return None
        return self._waiting.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Aggregate]:
        return iter(self._waiting.values())
