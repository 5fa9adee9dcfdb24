"""The one door to the Kubernetes API for the daemon and the controller.

Credentials, the calls on custom objects (addressed by a `Kind`, not by five positional
strings), merge patches, and the watched collections the callers read from. Objects are plain
dicts typed by their kind (`cns.kube.wire`); the modules of each kind build and read them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol, cast

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kubeconfig
from kubernetes_asyncio.client.exceptions import ApiException

from cns.kube.objects import GROUP, Kind
from cns.kube.watch import ListCall, WatchedCollection, node_changed, node_identity
from cns.kube.wire import Namespace, Node, ObjectT, Pod

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class CredentialsError(Exception):
    """The kubeconfig file or the service account could not be loaded; the message says which."""


class TokenBucket:
    """client-go's client-side rate limit (`flowcontrol.NewTokenBucketRateLimiter`): on average
    `qps` requests a second, up to `burst` at once after a quiet spell. Callers wait in the
    order they asked: each takes a token, or reserves the next one and sleeps until it is due.
    `qps <= 0` means no limit."""

    def __init__(
        self, qps: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if qps > 0 and burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.qps, self.burst, self._clock = qps, burst, clock
        self._tokens = float(burst)
        self._at = clock()

    def reserve(self) -> float:
        """Take a token; the seconds to wait before using it (0 when one was saved)."""
        if self.qps <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now
        self._tokens -= 1
        return max(0.0, -self._tokens / self.qps)

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)


async def connect(kubeconfig_file: str, *, qps: float = 0, burst: int = 1) -> KubeClient:
    """A client with the credentials of `kubeconfig_file`, or of the pod's service account when
    it is empty (in-cluster); its object calls within `qps`/`burst` (TokenBucket)."""
    settings = client.Configuration()
    try:
        if kubeconfig_file:
            await kubeconfig.load_kube_config(
                config_file=kubeconfig_file, client_configuration=settings
            )
        else:
            kubeconfig.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=settings
            )
    except Exception as exc:
        where = kubeconfig_file or "the in-cluster service account"
        raise CredentialsError(f"cannot load Kubernetes credentials from {where}: {exc}") from exc
    return KubeClient(client.ApiClient(settings), limit=TokenBucket(qps, burst))


class _MergePatchCalls(Protocol):
    """The patch calls as kubernetes_asyncio implements them. Its stubs leave `_content_type`
    out, but the calls accept it (`all_params` in its custom_objects_api.py), and a merge patch
    needs it: without it a dict body goes as a JSON patch, which the API server refuses (400)."""

    def patch_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: object,
        *, _content_type: str, _request_timeout: float | None,
    ) -> Awaitable[Any]: ...  # fmt: skip

    def patch_namespaced_custom_object_status(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: object,
        *, _content_type: str, _request_timeout: float | None,
    ) -> Awaitable[Any]: ...  # fmt: skip

    def patch_cluster_custom_object(
        self, group: str, version: str, plural: str, name: str, body: object,
        *, _content_type: str, _request_timeout: float | None,
    ) -> Awaitable[Any]: ...  # fmt: skip

    def patch_cluster_custom_object_status(
        self, group: str, version: str, plural: str, name: str, body: object,
        *, _content_type: str, _request_timeout: float | None,
    ) -> Awaitable[Any]: ...  # fmt: skip


class KubeClient:
    """An API client and the API groups cns uses. Errors are the library's `ApiException`:
    callers decide what a 404 or a 409 means for them.

    `get`, `create`, `replace` and `merge_patch` wait for `limit`; watches and the lease calls
    (`coordination`) do not: a burst of writes must never delay a lease renewal."""

    def __init__(self, api: client.ApiClient, *, limit: TokenBucket | None = None) -> None:
        self.api = api
        self.limit = limit or TokenBucket(0, 1)
        # Called once the rate limit admits a write, just before it is sent: the controller's
        # fencing check, which must come after any wait for a token, never before it.
        self.before_write: Callable[[], None] = lambda: None
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.coordination = client.CoordinationV1Api(api)

    async def close(self) -> None:
        await self.api.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def get(self, kind: Kind[ObjectT], name: str, *, namespace: str = "") -> ObjectT | None:
        """The object as the API server has it now (not a cache); None if it does not exist."""
        await self.limit.acquire()
        try:
            if kind.namespaced:
                found: ObjectT = await self.custom.get_namespaced_custom_object(
                    GROUP, kind.version, namespace, kind.plural, name
                )
            else:
                found = await self.custom.get_cluster_custom_object(
                    GROUP, kind.version, kind.plural, name
                )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None
        return found

    async def list_now(self, kind: Kind[ObjectT], *, namespace: str = "") -> list[ObjectT]:
        """Every object of `kind` as the API server has it now: a consistent read (no
        resourceVersion given), so it shows every object created before any object already
        seen, whatever the watches have delivered so far."""
        await self.limit.acquire()
        if kind.namespaced:
            reply: dict[str, Any] = await self.custom.list_namespaced_custom_object(
                GROUP, kind.version, namespace, kind.plural
            )
        else:
            reply = await self.custom.list_cluster_custom_object(GROUP, kind.version, kind.plural)
        return list(reply.get("items") or [])

    async def create(self, kind: Kind[ObjectT], body: ObjectT, *, namespace: str = "") -> ObjectT:
        """Create `body`; an object of that name that exists already is a 409."""
        await self.limit.acquire()
        self.before_write()
        created: ObjectT
        if kind.namespaced:
            created = await self.custom.create_namespaced_custom_object(
                GROUP, kind.version, namespace, kind.plural, body
            )
        else:
            created = await self.custom.create_cluster_custom_object(
                GROUP, kind.version, kind.plural, body
            )
        return created

    async def replace(self, kind: Kind[ObjectT], name: str, body: ObjectT) -> ObjectT:
        """Replace a cluster-scoped object; a `metadata.resourceVersion` in `body` makes it
        conditional (409 if the object changed since)."""
        await self.limit.acquire()
        self.before_write()
        assert not kind.namespaced, "only cluster-scoped objects are replaced"
        replaced: ObjectT = await self.custom.replace_cluster_custom_object(
            GROUP, kind.version, kind.plural, name, body
        )
        return replaced

    async def merge_patch(
        self,
        kind: Kind[ObjectT],
        name: str,
        patch: ObjectT,
        *,
        namespace: str = "",
        status: bool = False,
        request_timeout: float | None = None,
    ) -> ObjectT:
        """Apply an RFC 7386 merge patch to the object, or to its status subresource. A
        `metadata.resourceVersion` in `patch` makes it conditional (409 if the object changed)."""
        await self.limit.acquire()
        self.before_write()
        calls = cast(_MergePatchCalls, self.custom)
        patched: ObjectT
        if kind.namespaced:
            call = (
                calls.patch_namespaced_custom_object_status
                if status
                else calls.patch_namespaced_custom_object
            )
            patched = await call(
                GROUP, kind.version, namespace, kind.plural, name, patch,
                _content_type=MERGE_PATCH, _request_timeout=request_timeout,
            )  # fmt: skip
        else:
            cluster_call = (
                calls.patch_cluster_custom_object_status
                if status
                else calls.patch_cluster_custom_object
            )
            patched = await cluster_call(
                GROUP, kind.version, kind.plural, name, patch,
                _content_type=MERGE_PATCH, _request_timeout=request_timeout,
            )  # fmt: skip
        return patched

    def watch(
        self,
        kind: Kind[ObjectT],
        on_change: Callable[[], None],
        *,
        namespace: str = "",
        name: str = "",
        labels: str = "",
        timeout_seconds: int = 300,
        slim: Callable[[ObjectT], ObjectT] | None = None,
    ) -> WatchedCollection[ObjectT]:
        """The custom objects of `kind`, optionally of one namespace, of one name or matching a
        label selector, kept current by list+watch once the collection runs; each object as
        `slim` reduces it (default: without managedFields)."""
        selectors = {"group": GROUP, "version": kind.version, "plural": kind.plural}
        call: ListCall
        if kind.namespaced:
            selectors["namespace"] = namespace
            call = self.custom.list_namespaced_custom_object
        else:
            call = self.custom.list_cluster_custom_object
        if name:
            selectors["field_selector"] = f"metadata.name={name}"
        if labels:
            selectors["label_selector"] = labels
        return WatchedCollection(
            kind.plural,
            call,
            on_change,
            selectors=selectors,
            timeout_seconds=timeout_seconds,
            slim=slim,
        )

    def watch_pods(
        self, node_name: str, on_change: Callable[[], None], *, timeout_seconds: int = 300
    ) -> WatchedCollection[Pod]:
        """The pods scheduled to one node, in every namespace."""
        return WatchedCollection[Pod](
            "pods",
            self.core.list_pod_for_all_namespaces,
            on_change,
            selectors={"field_selector": f"spec.nodeName={node_name}"},
            timeout_seconds=timeout_seconds,
        )

    def watch_namespaces(
        self,
        on_change: Callable[[], None],
        *,
        slim: Callable[[Namespace], Namespace],
        timeout_seconds: int = 300,
    ) -> WatchedCollection[Namespace]:
        """Every Namespace, each as `slim` reduces it."""
        return WatchedCollection[Namespace](
            "namespaces",
            self.core.list_namespace,
            on_change,
            timeout_seconds=timeout_seconds,
            slim=slim,
        )

    async def read_pod(self, name: str, *, namespace: str, timeout: float) -> Pod | None:
        """A Pod as the API server has it now, as a dict; None if it does not exist."""
        found = await self._read_core(
            self.core.read_namespaced_pod, name, namespace=namespace, timeout=timeout
        )
        return cast(Pod | None, found)

    async def read_namespace(self, name: str, *, timeout: float) -> Namespace | None:
        """A Namespace as the API server has it now, as a dict; None if it does not exist."""
        found = await self._read_core(self.core.read_namespace, name, timeout=timeout)
        return cast(Namespace | None, found)

    async def read_node(self, name: str, *, timeout: float) -> Node | None:
        """A Node as the API server has it now (not a cache), as a dict; None if it does not
        exist."""
        found = await self._read_core(self.core.read_node, name, timeout=timeout)
        return cast(Node | None, found)

    async def patch_node(
        self, name: str, patch: Node, *, content_type: str, status: bool = False, timeout: float
    ) -> Node | None:
        """Patch a Node (`status`: its status subresource) with a merge patch (a
        `metadata.resourceVersion` in it makes it conditional: 409 if the node changed) or a
        strategic merge patch; None if the node does not exist."""
        call = self.core.patch_node_status if status else self.core.patch_node
        self.before_write()
        found = await self._read_core(
            call, name, patch, timeout=timeout, _content_type=content_type
        )
        return cast(Node | None, found)

    async def list_pods_now(self, *, timeout: float) -> list[Pod]:
        """Every Pod of every namespace as the API server has it now (a consistent read)."""
        return cast(
            list[Pod], await self._list_core(self.core.list_pod_for_all_namespaces, timeout)
        )

    async def list_nodes_now(self, *, timeout: float) -> list[Node]:
        """Every Node as the API server has it now (a consistent read)."""
        return cast(list[Node], await self._list_core(self.core.list_node, timeout))

    async def _list_core(
        self, call: Callable[..., Awaitable[Any]], timeout: float
    ) -> list[dict[str, Any]]:
        """The items of a core list call as dicts, read unparsed (as `_read_core`)."""
        await self.limit.acquire()
        response = await call(_preload_content=False, _request_timeout=timeout)
        try:
            if not 200 <= response.status <= 299:
                raise ApiException(status=response.status, reason=response.reason)
            found: dict[str, Any] = json.loads(await response.read())
        finally:
            response.release()
        return list(found.get("items") or [])

    async def _read_core(
        self,
        call: Callable[..., Awaitable[Any]],
        name: str,
        *body: object,
        timeout: float,
        **where: str,
    ) -> dict[str, Any] | None:
        """The object (as a read or a patch answers it) as a dict, read unparsed: the library's
        models cost more than the object (`_preload_content=False` also leaves the status to
        check here)."""
        await self.limit.acquire()
        response = await call(
            name, *body, **where, _preload_content=False, _request_timeout=timeout
        )
        try:
            if response.status == 404:
                return None
            if not 200 <= response.status <= 299:
                raise ApiException(status=response.status, reason=response.reason)
            found: dict[str, Any] = json.loads(await response.read())
        finally:
            response.release()
        return found

    def watch_nodes(self, on_change: Callable[[], None]) -> WatchedCollection[Node]:
        """The Node objects; only a node added or deleted, or its labels or addresses changed,
        calls `on_change`: the kubelets' status updates change every Node every few minutes,
        which is nothing to a control plane that only needs to know which nodes exist, where
        they go (labels choose a node's subnet) and which addresses are theirs (never granted
        to pods)."""
        return WatchedCollection[Node](
            "nodes",
            self.core.list_node,
            on_change,
            wake_on_modified=node_changed,
            slim=node_identity,
        )
