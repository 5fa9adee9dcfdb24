"""A list-then-watch loop that survives timeouts, disconnects, 410 Gone and API outages.

Kubernetes watches end: at `timeoutSeconds`, when the connection drops, or with 410 Gone when
the resourceVersion they resume from has been compacted away. This keeps one cache of objects
current through all of that: resume from the last resourceVersion (or bookmark) after a timeout
or disconnect, list again after 410 (as an ERROR event or as HTTP 410), and back off while the
API server is unreachable. Objects stay raw dicts: no model deserialisation on the hot path.
A kind the API server does not serve at all (a 404 on list: its CRD is not installed, as
cns's ClusterSubnet in a cluster with only Azure's CRDs) is said once and counts as listed and
empty, so its readers go on without it; it is listed again every MISSING_RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Generic, cast

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.kube.wire import KubeObject, Node, ObjectT

log = structlog.get_logger("cns.kube.watch")

ListCall = Callable[..., Awaitable[Any]]
BACKOFF_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
LIST_PAGE = 500  # objects a list asks for at a time
# How often a kind the API server does not serve (404 on list: its CRD is not installed) is
# listed again, in case it is installed later.
MISSING_RETRY_SECONDS = 60.0


def without_managed_fields(obj: ObjectT) -> ObjectT:
    """The object without `metadata.managedFields` (dropped in place), as client-go's informers
    keep theirs: server-side apply's bookkeeping mirrors every field an object has, so it
    roughly doubles a cache of NNCs and IPBlocks, and nothing here reads it."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


def node_identity(node: Node) -> Node:
    """A Node as a control plane that needs to know which nodes exist and which addresses they
    have keeps it: name, uid, labels, resourceVersion and `status.addresses`. The rest of a real
    Node's status (images, conditions) is kilobytes, thousands of times over in a large
    cluster."""
    meta: Mapping[str, object] = node.get("metadata") or {}
    kept = ("name", "uid", "labels", "resourceVersion")
    slim: dict[str, object] = {"metadata": {key: meta[key] for key in kept if key in meta}}
    status = node.get("status")
    if isinstance(status, dict) and "addresses" in status:
        slim["status"] = {"addresses": status["addresses"]}  # read with checks by the reader
    return cast(Node, slim)


def labels_changed(old: KubeObject, new: KubeObject) -> bool:
    """Whether an object's labels differ between two of its versions."""
    return (old.get("metadata") or {}).get("labels") != (new.get("metadata") or {}).get("labels")


def node_changed(old: KubeObject, new: KubeObject) -> bool:
    """Whether a Node's labels (its subnet) or addresses (excluded from its subnet) differ
    between two of its versions: the kubelets' heartbeats change neither."""
    return labels_changed(old, new) or _addresses(old) != _addresses(new)


def _addresses(obj: KubeObject) -> object:
    status = obj.get("status")
    return status.get("addresses") if isinstance(status, dict) else None


class WatchedCollection(Generic[ObjectT]):
    """The current objects of one list+watch, keyed by namespace/name, with a change callback.

    Others read the cache through `objects` and `first()`; what they learnt themselves (a write
    of their own, a direct read) goes in through `put`, `put_written` and `discard`, so that
    the rules for it stay here. The watch replaces an object rather than changing it: a dict
    read from the cache stays as it was read.

    The owner's own writes do not call `on_change`: a controller that woke up for the echo of
    every status it wrote ran about 2.5 rounds per change. A write goes out inside
    `writing(key)`; the events for that key that arrive meanwhile are held, and once the write
    is over (its reply given to `put_written`, or failed) they wake the owner only if one of
    them is not the write's own resourceVersion. Later events carrying that resourceVersion
    (a watch that resumed) do not wake it either.
    """

    def __init__(
        self,
        name: str,
        list_call: ListCall,
        on_change: Callable[[], None],
        *,
        selectors: dict[str, str] | None = None,
        timeout_seconds: int = 300,
        wake_on_modified: Callable[[ObjectT, ObjectT], bool] | None = None,
        slim: Callable[[ObjectT], ObjectT] | None = None,
    ) -> None:
        self.name = name
        self.slim: Callable[[ObjectT], ObjectT] = slim or without_managed_fields
        # Which modifications call `on_change` (None: all of them).
        self.wake_on_modified = wake_on_modified
        self.list_call = list_call
        self.on_change = on_change
        self.timeout_seconds = timeout_seconds
        self.selectors = selectors or {}
        self._objects: dict[str, ObjectT] = {}
        self._written: dict[str, str] = {}  # key -> resourceVersion of our last write
        self._writing: dict[str, int] = defaultdict(int)  # key -> writes in flight
        self._held: dict[str, list[str]] = defaultdict(list)  # key -> versions seen meanwhile
        self.synced = asyncio.Event()
        self.resource_version = ""
        # Counts every change of `objects`: unchanged, a reader may keep what it derived.
        self.changes = 0
        self.missing = False  # the last list was a 404: the API server does not serve the kind

    @staticmethod
    def key(obj: KubeObject) -> str:
        meta = obj.get("metadata") or {}
        return WatchedCollection.key_for(meta.get("name", ""), namespace=meta.get("namespace", ""))

    @staticmethod
    def key_for(name: str, *, namespace: str = "") -> str:
        return f"{namespace}/{name}"

    @property
    def objects(self) -> Mapping[str, ObjectT]:
        """The current objects by key, read-only."""
        return MappingProxyType(self._objects)

    def first(self) -> ObjectT:
        """The object of a collection of one name; {} while there is none."""
        return next(iter(self._objects.values()), cast(ObjectT, {}))

    def put(self, obj: ObjectT) -> None:
        """An object at least as new as the cache's: read directly, or from a snapshot file
        before the first list. The watch delivers anything newer later."""
        obj = self.slim(obj)
        self._objects[self.key(obj)] = obj
        self.changes += 1

    def put_written(self, written: ObjectT, *, read: ObjectT | None) -> None:
        """The reply to our own write of an object read as `read` (None: it did not exist), unless
        the watch has delivered another version meanwhile, which is as new or newer."""
        key = self.key(written)
        self._written[key] = _version(written)
        if self._objects.get(key) is read:
            self._objects[key] = self.slim(written)
            self.changes += 1

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[None]:
        """Around a write of our own to the object `key` (see the class docstring)."""
        self._writing[key] += 1
        try:
            yield
        finally:
            self._writing[key] -= 1
            if not self._writing[key]:
                del self._writing[key]
                held = self._held.pop(key, [])
                if any(version != self._written.get(key) for version in held):
                    self.on_change()

    def _wakes(self, key: str, obj: ObjectT) -> bool:
        old = self._objects.get(key)
        if old is not None and self.wake_on_modified and not self.wake_on_modified(old, obj):
            return False
        version = _version(obj)
        if key in self._writing:
            self._held[key].append(version)
            return False
        return version != self._written.get(key)

    def discard(self, key: str) -> None:
        """Forget an object a direct read found gone."""
        self._objects.pop(key, None)
        self.changes += 1

    async def run(self) -> None:
        """Keep the collection current forever; only cancellation ends it.

        A watch that ends (timeout) or breaks (disconnect, API server down) resumes from the last
        resourceVersion seen; only 410 Gone, or a list that failed, makes it list again.
        """
        failures = 0
        must_list = True
        while True:
            try:
                if must_list:
                    await self._list()
                    must_list = False
                await self._watch_once()
                failures = 0
                continue
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch_expired_relisting", watch=self.name)
                    must_list = True
                    continue
                if exc.status == 404 and must_list:
                    self._missing()
                    await asyncio.sleep(MISSING_RETRY_SECONDS)
                    continue
                must_list = must_list or exc.status == 404  # the kind went away while watched
                failure = f"HTTP {exc.status} {exc.reason}"
            except Exception as exc:  # any failure: back off and try again, never die
                failure = repr(exc)
            delay = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
            failures += 1
            log.warning("watch_failed", watch=self.name, error=failure, retry_in=delay)
            await asyncio.sleep(delay)

    def _missing(self) -> None:
        """The list was a 404: the API server does not serve this kind. Said once; the
        collection is listed and empty from now on, until a list succeeds."""
        if not self.missing:
            self.missing = True
            log.warning(
                "watch_resource_missing",
                watch=self.name,
                meaning="the API server does not serve this kind (its CRD is not installed): "
                "taken as none of them; install the CRD to use it",
                retry_in=MISSING_RETRY_SECONDS,
            )
        changed = bool(self._objects) or not self.synced.is_set()
        self._objects = {}
        self.changes += 1
        self.resource_version = ""
        self.synced.set()
        if changed:
            self.on_change()

    async def _list(self) -> None:
        """List in pages of LIST_PAGE objects, as client-go's reflector does: a page's JSON is
        decoded and slimmed before the next is asked for, so a list of 5,000 NNCs never sits
        in memory whole as JSON and as dicts (the pages are one consistent snapshot: the API
        server serves the continuation at the first page's resourceVersion). An expired
        continuation is a 410, which lists again from the start (`run`)."""
        slim = self.slim
        objects: dict[str, ObjectT] = {}
        token = ""
        while True:
            pages = {"limit": LIST_PAGE, **({"_continue": token} if token else {})}
            response = await self.list_call(
                **self.selectors,
                **pages,
                _preload_content=False,
                _request_timeout=30,
            )
            try:
                body = await response.read()
            finally:
                response.release()
            if not 200 <= response.status <= 299:  # not raised for an unread (raw) response
                raise ApiException(
                    status=response.status, reason=f"{response.reason}: {body[:200]!r}"
                )
            listing = json.loads(body)
            meta = listing.get("metadata") or {}
            if "resourceVersion" not in meta:
                raise ValueError(f"list of {self.name} is not a list: {str(listing)[:200]}")
            for item in listing.get("items") or []:
                obj = slim(item)
                objects[self.key(obj)] = obj
            del listing
            token = str(meta.get("continue") or "")
            if not token:
                break
        self._objects = objects
        self.changes += 1
        self.resource_version = str(meta["resourceVersion"])
        if self.missing:
            self.missing = False
            log.info("watch_resource_found", watch=self.name, objects=len(objects))
        self.synced.set()
        self.on_change()

    async def _watch_once(self) -> None:
        """Stream events until the server ends the watch; raises on 410 and errors.

        The stream is read here, one JSON decode an event. kubernetes_asyncio's `Watch` decoded
        each event three times (its model deserialiser dumps and loads the object again) and
        built an API client of its own, TLS context included (~60 ms of CPU), for every watch
        it opened; the API server ends a watch whose reader falls behind (its cacher allows a
        watcher 10 events and 100 ms: "Forcing watcher close due to unresponsiveness"), so a
        busy controller re-opens watches during a burst, and the slower it reads the more."""
        response = await self.list_call(
            **self.selectors,
            watch=True,
            resource_version=self.resource_version,
            timeout_seconds=self.timeout_seconds,
            allow_watch_bookmarks=True,
            _preload_content=False,
            _request_timeout=self.timeout_seconds + 30,
        )
        ended = False
        try:
            if not 200 <= response.status <= 299:
                body = await response.read()
                raise ApiException(status=response.status, reason=_status_reason(body))
            while line := await response.content.readline():
                self._event(_decode_event(line))
            ended = True
        finally:
            if ended:  # read to its end: the connection goes back to the pool
                response.release()
            else:
                response.close()

    def _event(self, event: dict[str, Any]) -> None:
        """Apply one watch event to the cache (see `_decode_event` for what it holds)."""
        kind, raw = event["type"], event["object"]
        version = _version(raw)
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return
        key = self.key(raw)
        if kind == "DELETED":
            self._objects.pop(key, None)
            self.changes += 1
            self._written.pop(key, None)
            self.on_change()
            return
        cached = self._objects.get(key)
        if cached is not None and version and _version(cached) == version:
            # The version the cache holds already, most often the echo of our own write
            # (`put_written`): an object's resourceVersion names its content, so the slimmed
            # copy stays and the event is not reduced again (an IPBlock: 256 entries decoded).
            obj = cached
        else:
            obj = self.slim(cast(ObjectT, raw))
        wakes = self._wakes(key, obj)
        self._objects[key] = obj
        self.changes += 1
        if wakes:
            self.on_change()


def _version(obj: KubeObject) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _decode_event(line: bytes) -> dict[str, Any]:
    """A watch event's line as {"type", "object"}; an ERROR event (410 Gone: the version to
    resume from was compacted away) or a bare Status raises ApiException with its code."""
    event = json.loads(line)
    if not isinstance(event, dict):
        raise ValueError(f"a watch event is not an object: {line[:200]!r}")
    obj = event.get("object")
    if "type" not in event or not isinstance(obj, dict):
        if "code" in event:
            raise ApiException(status=event["code"], reason=_reason(event))
        raise ValueError(f"a watch event without type or object: {line[:200]!r}")
    if event["type"] == "ERROR":
        raise ApiException(status=obj.get("code") or 500, reason=_reason(obj))
    return event


def _reason(status: dict[str, Any]) -> str:
    return f"{status.get('reason')}: {status.get('message')}"


def _status_reason(body: bytes) -> str:
    """The reason and message of a Status the API server answered with, else the body."""
    with contextlib.suppress(ValueError):
        status = json.loads(body)
        if isinstance(status, dict):
            return _reason(status)
    return body[:200].decode(errors="replace")
