"""Kubernetes Events written for cns: the `Recorder` the node service and the controller report
to, and the one task that writes what it aggregates.

`record` runs on the caller's step (an ADD, a controller round): it correlates the note and
queues the aggregate in a bounded outbox (cns/core/events.py), and never awaits, so no CNI verb
waits for the API server. `write_forever` creates each aggregate's core/v1 Event once and then
raises its `count`, `lastTimestamp` and `message` with a merge PATCH, as the kubelet's recorder
does. A note lost (outbox full, write refused or timed out) is counted for the metrics and said
in one log line per spell of losses, never retried: an Event is a hint for people, and the next
note of the same aggregate carries the count on.

Event writes bypass the client's token bucket (`KubeClient.limit`), so that they never delay a
NodeNetworkConfig write behind them, and take their own, the kubelet's defaults (`--event-qps=5`,
`--event-burst=10`): the writes share the loop with the CNI verbs, and a burst of notes about
many pods must not keep it busy.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, cast

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cns.core.events import (
    OUTBOX_CAPACITY,
    Aggregate,
    Correlator,
    Note,
    ObjectRef,
    Outbox,
)
from cns.kube.client import MERGE_PATCH, KubeClient, TokenBucket

log = structlog.get_logger("cns.kube.events")

# After a note wakes the writer, it waits this long before writing: the ADD that reported the
# note is answered first, and a burst's repeats become one write of their count.
GATHER_SECONDS = 0.2
EVENT_QPS = 5.0
EVENT_BURST = 10
# A write slower than this counts as lost: the outbox keeps filling meanwhile, and an API
# server that is down must not hold the writer for the client's default minutes.
WRITE_TIMEOUT_SECONDS = 5.0
# Events about cluster-scoped objects (ClusterSubnet, Node) live here, as client-go puts them.
CLUSTER_EVENTS_NAMESPACE = "default"

UidOf = Callable[[ObjectRef], str]


class _EventCalls(Protocol):
    """The Event calls as kubernetes_asyncio implements them: its stubs want model objects and
    leave `_content_type` out, but the calls take a dict and it (`all_params`)."""

    def create_namespaced_event(
        self, namespace: str, body: object,
        *, _request_timeout: float, _preload_content: bool,
    ) -> Awaitable[aiohttp.ClientResponse]: ...  # fmt: skip

    def patch_namespaced_event(
        self, name: str, namespace: str, body: object,
        *, _content_type: str, _request_timeout: float, _preload_content: bool,
    ) -> Awaitable[aiohttp.ClientResponse]: ...  # fmt: skip


class EventRecorder:
    """Correlates notes, queues the aggregates, writes them from `write_forever`.

    `component` is the Event's `source.component` and `reportingComponent` (cns,
    cns-controller); `host` its `source.host` and `reportingInstance` (the node's name, or the
    controller's identity). `uid_of` fills an object's UID the note left empty (the pod watch
    knows it): `kubectl describe` finds an Event by the object's UID."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        component: str,
        host: str,
        uid_of: UidOf = lambda ref: ref.uid,
        correlator: Correlator | None = None,
        capacity: int = OUTBOX_CAPACITY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self._calls = cast(_EventCalls, kube.core)
        self.component = component
        self.host = host
        self.uid_of = uid_of
        self.correlator = correlator or Correlator()
        self.outbox = Outbox(capacity)
        self.clock = clock
        self.written = 0  # creates and patches that succeeded
        self.failed = 0  # writes refused or timed out
        self.limit = TokenBucket(EVENT_QPS, EVENT_BURST)
        self._wake = asyncio.Event()
        self._losing = False  # a loss has been said since the last successful write

    @property
    def lost(self) -> int:
        return self.outbox.dropped + self.failed

    def record(self, note: Note) -> None:
        aggregate = self.correlator.observe(note, self.clock())
        if aggregate is None:
            return
        if self.outbox.put(aggregate):
            self._wake.set()
        else:
            self._say_lost("outbox-full", note)

    def _say_lost(self, why: str, note: Note, **fields: object) -> None:
        """One log line per spell of losses: the first after a write that succeeded."""
        if self._losing:
            return
        self._losing = True
        about = note.about
        log.warning(
            "event_lost",
            why=why,
            object=f"{about.kind}/{about.namespace}/{about.name}".replace("//", "/"),
            reason=note.reason,
            lost=self.lost,
            **fields,
        )

    async def write_forever(self) -> None:
        """Write what the outbox holds, oldest first; wait when it is empty."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(GATHER_SECONDS)
            self._wake.clear()
            await self.drain()

    async def drain(self) -> None:
        """Write everything queued, each write after a token of `limit`: an aggregate that
        waits in the outbox meanwhile gathers its repeats into the one write."""
        while self.outbox:
            await self.limit.acquire()
            aggregate = self.outbox.take()
            if aggregate is not None:
                await self.write(aggregate)

    async def write(self, aggregate: Aggregate) -> None:
        """Create the aggregate's Event, or PATCH its count; a 404 (expired, deleted) creates it
        again under its name, a 409 on create (made by an earlier life) patches it."""
        count = aggregate.count
        try:
            if aggregate.written:
                try:
                    await self._patch(aggregate)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    await self._create(aggregate)
            else:
                try:
                    await self._create(aggregate)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    await self._patch(aggregate)
        except Exception as exc:  # any failure is a lost note; the task goes on
            self.failed += 1
            self._say_lost("write-failed", aggregate.note, error=_said(exc))
            return
        aggregate.written = count
        self.written += 1
        self._losing = False

    def _namespace(self, about: ObjectRef) -> str:
        return about.namespace or CLUSTER_EVENTS_NAMESPACE

    async def _create(self, aggregate: Aggregate) -> None:
        about, type_, reason = aggregate.key
        uid = about.uid or self.uid_of(about)
        involved: dict[str, str] = {"kind": about.kind, "name": about.name}
        involved |= {"apiVersion": about.api_version}
        if about.namespace:
            involved["namespace"] = about.namespace
        if uid:
            involved["uid"] = uid
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": aggregate.name, "namespace": self._namespace(about)},
            "involvedObject": involved,
            "type": type_,
            "reason": reason,
            "message": aggregate.message,
            "count": aggregate.count,
            "firstTimestamp": _rfc3339(aggregate.first_at),
            "lastTimestamp": _rfc3339(aggregate.last_at),
            "source": {"component": self.component, "host": self.host},
            "reportingComponent": self.component,
            "reportingInstance": self.host,
        }
        answer = await self._calls.create_namespaced_event(
            self._namespace(about),
            body,
            _request_timeout=WRITE_TIMEOUT_SECONDS,
            _preload_content=False,
        )
        _refuse_failure(answer)

    async def _patch(self, aggregate: Aggregate) -> None:
        patch = {
            "count": aggregate.count,
            "lastTimestamp": _rfc3339(aggregate.last_at),
            "message": aggregate.message,
        }
        answer = await self._calls.patch_namespaced_event(
            aggregate.name,
            self._namespace(aggregate.key[0]),
            patch,
            _content_type=MERGE_PATCH,
            _request_timeout=WRITE_TIMEOUT_SECONDS,
            _preload_content=False,
        )
        _refuse_failure(answer)


def _refuse_failure(answer: aiohttp.ClientResponse) -> None:
    """ApiException for an answer that is not a 2xx. The reply is not read: left unparsed (the
    library would build a model object of it), the write costs the loop a fraction."""
    answer.release()
    if not 200 <= answer.status <= 299:
        raise ApiException(status=answer.status, reason=answer.reason)


def _rfc3339(at: float) -> str:
    """Seconds, as core/v1 Events carry them (`metav1.Time`)."""
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _said(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return repr(exc)


class EventCollector(Collector):
    """The recorder's counts for Prometheus, registered by the program that runs it."""

    def __init__(self, recorder: EventRecorder, *, prefix: str) -> None:
        self.recorder = recorder
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        recorder, prefix = self.recorder, self.prefix
        lost = CounterMetricFamily(
            f"{prefix}_events_lost",
            "Kubernetes Events not written: the outbox was full (outbox-full) or the API "
            "server refused or did not answer the write (write-failed).",
            labels=["why"],
        )
        lost.add_metric(["outbox-full"], recorder.outbox.dropped)
        lost.add_metric(["write-failed"], recorder.failed)
        yield lost
        yield CounterMetricFamily(
            f"{prefix}_events_rate_limited",
            "Notes the per-object spam filter dropped (25 at once, then one per 5 minutes; "
            "their Event's count stops rising meanwhile).",
            value=recorder.correlator.rate_limited,
        )
        yield CounterMetricFamily(
            f"{prefix}_events_written",
            "Kubernetes Event creates and count patches that succeeded.",
            value=recorder.written,
        )
        yield GaugeMetricFamily(
            f"{prefix}_events_queued",
            "Event writes waiting in the outbox.",
            value=len(recorder.outbox),
        )
