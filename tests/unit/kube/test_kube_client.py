"""cns's Kubernetes client without an API server: credential errors, the rules by which a watch
cache takes in what its owner learnt itself, and how it reads a watch's stream. (Its calls
against a real kube-apiserver are in tests/integration/test_kube_crds.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from kubernetes_asyncio.client.exceptions import ApiException

from cns.kube import watch as watch_module
from cns.kube.client import CredentialsError, connect
from cns.kube.watch import WatchedCollection


def block(resource_version: str) -> dict[str, Any]:
    return {"metadata": {"name": "pods-b0", "resourceVersion": resource_version}}


async def never_listed(**_: Any) -> Any:
    raise AssertionError("the cache tests never list")


def collection() -> WatchedCollection:
    return WatchedCollection("ipblocks", never_listed, lambda: None)


async def test_a_missing_kubeconfig_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "kubeconfig"
    with pytest.raises(
        CredentialsError, match=f"cannot load Kubernetes credentials from {missing}"
    ):
        await connect(str(missing))


async def test_outside_a_pod_the_service_account_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CredentialsError, match="from the in-cluster service account"):
        await connect("")


def test_our_write_replaces_the_version_it_was_made_from() -> None:
    cache = collection()
    read = block("1")
    cache.put(read)
    cache.put_written(block("2"), read=read)
    assert cache.first()["metadata"]["resourceVersion"] == "2"


def test_our_write_does_not_replace_what_the_watch_delivered_meanwhile() -> None:
    cache = collection()
    read = block("1")
    cache.put(read)
    cache.put(block("3"))  # the watch, while our write of version 2 was on its way
    cache.put_written(block("2"), read=read)
    assert cache.first()["metadata"]["resourceVersion"] == "3"


def test_a_created_object_goes_in_unless_the_watch_has_it_already() -> None:
    cache = collection()
    cache.put_written(block("1"), read=None)
    assert cache.first()["metadata"]["resourceVersion"] == "1"
    cache.put(block("2"))
    cache.put_written(block("1"), read=None)
    assert cache.first()["metadata"]["resourceVersion"] == "2"


def test_the_cache_is_read_only_from_outside() -> None:
    cache = collection()
    cache.put(block("1"))
    with pytest.raises(TypeError):
        cache.objects["/pods-b0"] = block("2")  # type: ignore[index]
    cache.discard(WatchedCollection.key_for("pods-b0"))
    assert cache.first() == {} and dict(cache.objects) == {}


class Response:
    def __init__(self, body: dict[str, Any] | str, status: int = 200) -> None:
        self.body = body
        self.status, self.reason = status, "OK" if status == 200 else "Not Found"

    async def read(self) -> bytes:
        return (self.body if isinstance(self.body, str) else json.dumps(self.body)).encode()

    def release(self) -> None:
        pass


async def test_a_list_goes_page_by_page_each_slimmed_before_the_next_is_asked_for() -> None:
    """A list asks for LIST_PAGE objects at a time with the server's continuation, as
    client-go's reflector does, and reduces each page before asking for the next: a list of
    5,000 NNCs never sits in memory whole. The listing's resourceVersion is the watch's."""
    items = [block(str(n)) | {"metadata": {"name": f"b{n}"}} for n in range(5)]
    calls: list[dict[str, Any]] = []
    events: list[str] = []

    async def list_call(**kwargs: Any) -> Response:
        calls.append(kwargs)
        events.append("page")
        start = int(kwargs.get("_continue") or 0)
        end = start + kwargs["limit"]
        more = {"continue": str(end)} if end < len(items) else {}
        return Response({"metadata": {"resourceVersion": "42", **more}, "items": items[start:end]})

    def slim(obj: dict[str, Any]) -> dict[str, Any]:
        events.append("slim")
        return obj

    cache = WatchedCollection("ipblocks", list_call, lambda: None, slim=slim)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(watch_module, "LIST_PAGE", 2)
        await cache._list()
    assert sorted(cache.objects) == [f"/b{n}" for n in range(5)]
    assert cache.resource_version == "42" and cache.synced.is_set()
    assert [(c["limit"], c.get("_continue")) for c in calls] == [(2, None), (2, "2"), (2, "4")]
    assert events == ["page", "slim", "slim", "page", "slim", "slim", "page", "slim"]


class Stream:
    """A watch's streaming response: one JSON line an event, then the end of the stream."""

    def __init__(self, events: list[dict[str, Any]], *, status: int = 200) -> None:
        self.status = status
        self.lines = [json.dumps(event).encode() + b"\n" for event in events]
        self.content = self
        self.ended: str | None = None

    async def readline(self) -> bytes:
        return self.lines.pop(0) if self.lines else b""

    async def read(self) -> bytes:
        return json.dumps({"kind": "Status", "reason": "Forbidden", "message": "no"}).encode()

    def release(self) -> None:
        self.ended = "released"

    def close(self) -> None:
        self.ended = "closed"


def event(kind: str, name: str, version: str) -> dict[str, Any]:
    return {"type": kind, "object": {"metadata": {"name": name, "resourceVersion": version}}}


async def test_a_watch_applies_its_events_and_resumes_where_the_server_ended_it() -> None:
    """The events go into the cache in order and the next watch starts from the last version
    seen, a bookmark's too: a watch the API server ends (its timeout, or a reader it found too
    slow) is resumed, never listed again. Each event wakes the owner, a bookmark does not."""
    responses: list[Response | Stream] = [
        Response({"metadata": {"resourceVersion": "4"}, "items": []}),
        Stream([event("ADDED", "b0", "5"), event("ADDED", "b1", "6"),
                event("MODIFIED", "b0", "7"), event("BOOKMARK", "", "8")]),
        Stream([event("DELETED", "b1", "9")]),
    ]  # fmt: skip
    streams = responses[1:]
    calls: list[dict[str, Any]] = []
    woken: list[int] = []

    async def list_call(**kwargs: Any) -> Response | Stream:
        calls.append(kwargs)
        if not responses:
            raise asyncio.CancelledError  # the test is over
        return responses.pop(0)

    cache = WatchedCollection("ipblocks", list_call, lambda: woken.append(1))
    with pytest.raises(asyncio.CancelledError):
        await cache.run()
    assert [c.get("watch", False) for c in calls] == [False, True, True, True]
    assert [c.get("resource_version") for c in calls] == [None, "4", "8", "9"]
    assert all(c["allow_watch_bookmarks"] for c in calls[1:])
    assert sorted(cache.objects) == ["/b0"] and cache.first()["metadata"]["resourceVersion"] == "7"
    assert len(woken) == 1 + 3 + 1  # the list, three changes, the deletion
    assert [s.ended for s in streams] == ["released", "released"]


async def test_an_expired_version_lists_again_and_a_refused_watch_backs_off() -> None:
    """An ERROR event with 410 Gone makes the collection list again (the version to resume
    from is gone); a watch the server refuses (HTTP 403) raises with its reason, and the
    stream is closed, not reused."""
    expiry = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    gone = Stream([{"type": "ERROR", "object": expiry}])
    cache = WatchedCollection("ipblocks", lambda **_: asyncio.sleep(0, gone), lambda: None)
    with pytest.raises(ApiException) as expired:
        await cache._watch_once()
    assert expired.value.status == 410 and gone.ended == "closed"

    refused = Stream([], status=403)
    cache = WatchedCollection("ipblocks", lambda **_: asyncio.sleep(0, refused), lambda: None)
    with pytest.raises(ApiException) as forbidden:
        await cache._watch_once()
    assert forbidden.value.status == 403 and forbidden.value.reason == "Forbidden: no"
    assert refused.ended == "closed"


async def test_the_echo_of_a_version_the_cache_holds_is_not_reduced_again() -> None:
    """An event of the very version the cache holds (the echo of our own write, whose reply
    `put_written` cached) keeps the cached object and wakes nobody; a newer one is reduced."""
    slimmed: list[str] = []

    def slim(obj: dict[str, Any]) -> dict[str, Any]:
        slimmed.append(obj["metadata"]["resourceVersion"])
        return obj

    stream = Stream([event("MODIFIED", "pods-b0", "2"), event("MODIFIED", "pods-b0", "3")])
    woken: list[int] = []
    cache = WatchedCollection(
        "ipblocks", lambda **_: asyncio.sleep(0, stream), lambda: woken.append(1), slim=slim
    )
    read = block("1")
    cache.put(read)
    written = block("2")
    cache.put_written(written, read=read)
    slimmed.clear()
    await cache._watch_once()
    assert slimmed == ["3"] and len(woken) == 1
    assert cache.first()["metadata"]["resourceVersion"] == "3"


async def test_a_kind_the_api_server_does_not_serve_is_said_once_and_counts_as_empty() -> None:
    """A 404 on list (the kind's CRD is not installed): one log line, the collection is synced
    and empty (its readers go on), and it is listed again slowly until the kind is served."""
    served = [False]
    changes: list[int] = []

    async def list_call(**kwargs: Any) -> Response:
        if not served[0]:
            return Response("404 page not found", status=404)
        return Response({"metadata": {"resourceVersion": "7"}, "items": [block("5")]})

    cache = WatchedCollection("clustersubnets", list_call, lambda: changes.append(1))
    with pytest.MonkeyPatch.context() as patch, structlog.testing.capture_logs() as logs:
        patch.setattr(watch_module, "MISSING_RETRY_SECONDS", 0.01, raising=False)
        task = asyncio.create_task(cache.run())
        await asyncio.wait_for(cache.synced.wait(), 5)
        assert cache.missing and dict(cache.objects) == {} and changes == [1]
        served[0] = True
        for _ in range(500):
            if cache.objects:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert list(cache.objects) == ["/pods-b0"] and not cache.missing and changes == [1, 1]
    events = [e["event"] for e in logs]
    before = events[: events.index("watch_resource_found")]  # then a watch of the fake fails
    assert before.count("watch_resource_missing") == 1 and "watch_failed" not in before
