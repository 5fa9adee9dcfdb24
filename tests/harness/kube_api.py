"""A client of the Kubernetes REST API for tests: plain requests, watches, discovery, apply.

It speaks to one apiserver on loopback with static bearer tokens (user name -> token), and
verifies the server with the CA the apiserver wrote (`trust`). `kube_cluster.KubeCluster` is
this client bound to the apiserver it runs:

    kube.apply(REPO / "config/crd")
    nnc = kube.get(NNC_API, "NodeNetworkConfig", "node-1", KUBE_SYSTEM)
    for event in kube.watch(kube.path_for(NNC_API, "NodeNetworkConfig"), {"timeoutSeconds": 5}):
        ...

Errors: `ApiError` for a non-2xx answer (`raise_for_status`), `KubeError` when the harness
cannot go on (a kind not served, a wait timed out).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.harness import HarnessError

ADMIN = "admin"
DAEMON_USER = "system:serviceaccount:kube-system:cns"
CONTROLLER_USER = "system:serviceaccount:kube-system:cns-controller"

KUBE_SYSTEM = "kube-system"
NNC_API = "acn.azure.com/v1alpha"
CS_API = "acn.azure.com/v1alpha1"
LEASE_API = "coordination.k8s.io/v1"

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

ManifestSource = str | os.PathLike[str] | Mapping[str, Any] | Iterable[Mapping[str, Any]]


class KubeError(HarnessError):
    """The harness could not start, stop or reach the cluster (the message has the log tails)."""


@dataclass(frozen=True)
class Response:
    """One HTTP answer of the API server; `body` is parsed JSON when the answer is JSON."""

    status: int
    headers: Mapping[str, str]
    body: Any
    method: str = ""
    path: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def json(self) -> dict[str, Any]:
        if not isinstance(self.body, dict):
            raise TypeError(f"{self.method} {self.path}: body is not a JSON object: {self.body!r}")
        return self.body

    def raise_for_status(self) -> Response:
        if not self.ok:
            raise ApiError(self)
        return self


class ApiError(Exception):
    """A non-2xx answer. `status`, `reason` (e.g. "Invalid", "Conflict"), `message`, `causes`."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.status = response.status
        body = response.body if isinstance(response.body, dict) else {}
        self.reason: str = body.get("reason", "")
        self.message: str = body.get("message", "") or str(response.body)[:2000]
        details = body.get("details") or {}
        self.causes: list[dict[str, Any]] = list(details.get("causes") or [])
        super().__init__(
            f"{response.method} {response.path}: {self.status} {self.reason}: {self.message}"
        )

    @property
    def fields(self) -> list[str]:
        """The `field` of every cause, e.g. ["spec.requestedIPCount"]."""
        return [str(cause.get("field", "")) for cause in self.causes]


@dataclass(frozen=True)
class ResourceInfo:
    """What discovery says about one resource (`GET /apis/GROUP/VERSION`)."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool
    verbs: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()


def load_manifests(source: ManifestSource) -> list[dict[str, Any]]:
    """Documents from a YAML file, a directory of them (sorted), a mapping or mappings.

    A `str` is a path. `kind: List` documents are flattened; empty documents are dropped.
    """
    docs: list[Any]
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
            return [doc for file in files for doc in load_manifests(file)]
        docs = list(yaml.safe_load_all(path.read_text()))
    elif isinstance(source, Mapping):
        docs = [source]
    else:
        docs = list(source)
    result: list[dict[str, Any]] = []
    for doc in docs:
        if not doc:
            continue
        if not isinstance(doc, Mapping) or "apiVersion" not in doc or "kind" not in doc:
            raise ValueError(f"not a Kubernetes object (apiVersion/kind missing): {doc!r:.200}")
        if str(doc["kind"]).endswith("List") and "items" in doc:
            result.extend(load_manifests(doc.get("items") or []))
        else:
            result.append(json.loads(json.dumps(doc)))  # deep copy, plain JSON types
    return result


def query_string(params: Mapping[str, Any]) -> str:
    """URL-encoded, booleans as "true"/"false" (Python's "True" is not a Kubernetes boolean)."""
    return urllib.parse.urlencode(
        {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
    )


class KubeApi:
    """Requests to the apiserver at `host`:`port` as any user of `tokens` (ADMIN by default).

    No request can be made before `trust` has been given the apiserver's CA certificate.
    """

    def __init__(self, *, port: int, tokens: Mapping[str, str], host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.server = f"https://{host}:{port}"
        self.tokens = dict(tokens)
        self._ssl: ssl.SSLContext | None = None
        self._discovery: dict[str, list[ResourceInfo]] = {}

    def trust(self, ca_pem: str) -> None:
        """Verify the apiserver with this CA from now on (ssl.SSLError if it does not parse)."""
        self._ssl = ssl.create_default_context(cadata=ca_pem)

    @property
    def trusted(self) -> bool:
        return self._ssl is not None

    # ------------------------------------------------------------------ raw HTTP

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        user: str = ADMIN,
        timeout: float = 30.0,
    ) -> Response:
        """One request to the apiserver; never raises for an HTTP error status (see Response).

        `body`: dict/list (sent as JSON), str or bytes (sent as is). `content_type` defaults to
        application/json when there is a body. `params` are added to the query string (booleans
        as "true"/"false"). `user` picks the bearer token.
        """
        if self._ssl is None:
            raise KubeError("the apiserver has not written its certificate yet")
        if params:
            path = f"{path}{'&' if '?' in path else '?'}{query_string(params)}"
        payload: bytes | None
        if body is None:
            payload = None
        elif isinstance(body, bytes):
            payload = body
        elif isinstance(body, str):
            payload = body.encode()
        else:
            payload = json.dumps(body).encode()
        all_headers = {"Authorization": f"Bearer {self.tokens[user]}", "Accept": "application/json"}
        if payload is not None:
            all_headers["Content-Type"] = content_type or "application/json"
        all_headers.update(headers or {})
        conn = http.client.HTTPSConnection(self.host, self.port, context=self._ssl, timeout=timeout)
        try:
            conn.request(method, path, body=payload, headers=all_headers)
            answer = conn.getresponse()
            raw = answer.read()
            answer_headers = {k.lower(): v for k, v in answer.getheaders()}
        finally:
            conn.close()
        parsed: Any = raw.decode(errors="replace")
        if "json" in answer_headers.get("content-type", "") and raw:
            with contextlib.suppress(ValueError):
                parsed = json.loads(raw)
        return Response(answer.status, answer_headers, parsed, method, path)

    def watch(
        self,
        path: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float = 60.0,
        user: str = ADMIN,
    ) -> Iterator[dict[str, Any]]:
        """Stream a watch: yields each event ({"type": ..., "object": ...}) as it arrives.

        `path` is a collection (e.g. from `path_for(...)`); `watch=true` is added. Pass
        `timeoutSeconds` in `params` to have the server end the stream. A 410 may arrive as an
        ERROR event (yielded like any other) or as an HTTP error (raises ApiError).
        """
        full = f"{path}?{query_string({'watch': True, **(params or {})})}"
        conn = http.client.HTTPSConnection(self.host, self.port, context=self._ssl, timeout=timeout)
        try:
            conn.request("GET", full, headers={"Authorization": f"Bearer {self.tokens[user]}"})
            answer = conn.getresponse()
            if answer.status != 200:
                raw = answer.read()
                body: Any = raw.decode(errors="replace")
                with contextlib.suppress(ValueError):
                    body = json.loads(raw)
                raise ApiError(
                    Response(answer.status, dict(answer.getheaders()), body, "GET", full)
                )
            while line := answer.readline():
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()

    # ------------------------------------------------------------------ discovery and paths

    def resource(self, api_version: str, kind: str, *, wait: float = 10.0) -> ResourceInfo:
        """Discovery data for a kind; refreshes (up to `wait` s) for just-created CRDs."""
        deadline = time.monotonic() + wait
        while True:
            for info in self._discover(api_version, refresh=False):
                if info.kind == kind:
                    return info
            for info in self._discover(api_version, refresh=True):
                if info.kind == kind:
                    return info
            if time.monotonic() > deadline:
                raise KubeError(f"{kind} ({api_version}) is not served by the apiserver")
            time.sleep(0.1)

    def discovery(self, api_version: str) -> dict[str, Any]:
        """The raw APIResourceList of a group/version (e.g. "acn.azure.com/v1alpha", "v1")."""
        path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        return self.request("GET", path).raise_for_status().json

    def _discover(self, api_version: str, refresh: bool) -> list[ResourceInfo]:
        if refresh or api_version not in self._discovery:
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            answer = self.request("GET", path)
            infos = []
            if answer.ok:
                for item in answer.json.get("resources", []):
                    if "/" in item["name"]:
                        continue
                    infos.append(
                        ResourceInfo(
                            api_version,
                            item["kind"],
                            item["name"],
                            bool(item["namespaced"]),
                            tuple(item.get("verbs") or ()),
                            tuple(item.get("shortNames") or ()),
                        )
                    )
            self._discovery[api_version] = infos
        return self._discovery[api_version]

    def path_for(
        self,
        api_version: str,
        kind: str,
        name: str | None = None,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> str:
        """The REST path, e.g. /apis/acn.azure.com/v1alpha/namespaces/kube-system/
        nodenetworkconfigs/node-1/status. `namespace` is ignored for cluster-scoped kinds; for
        namespaced kinds None means all namespaces (collections) or "default" (objects)."""
        info = self.resource(api_version, kind)
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        if info.namespaced and (namespace or name):
            base += f"/namespaces/{namespace or 'default'}"
        path = f"{base}/{info.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path

    def _object_path(
        self, doc: Mapping[str, Any], namespace: str | None, subresource: str | None = None
    ) -> str:
        meta = doc.get("metadata") or {}
        return self.path_for(
            doc["apiVersion"],
            doc["kind"],
            meta["name"],
            meta.get("namespace") or namespace,
            subresource,
        )

    # ------------------------------------------------------------------ objects

    def get(
        self,
        api_version: str,
        kind: str,
        name: str | None = None,
        namespace: str | None = None,
        *,
        params: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One object, or the list (name None; all namespaces if namespace None). ApiError on
        failure (`exc.status == 404` when missing)."""
        path = self.path_for(api_version, kind, name, namespace)
        return self.request("GET", path, params=params).raise_for_status().json

    def exists(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        answer = self.request("GET", self.path_for(api_version, kind, name, namespace))
        if answer.status == 404:
            return False
        answer.raise_for_status()
        return True

    def create(
        self,
        doc: Mapping[str, Any],
        *,
        namespace: str | None = None,
        dry_run: bool = False,
        user: str = ADMIN,
    ) -> dict[str, Any]:
        """POST one object (`dry_run`: `?dryRun=All`, validated and admitted but not stored)."""
        meta = doc.get("metadata") or {}
        collection = self.path_for(
            doc["apiVersion"], doc["kind"], None, meta.get("namespace") or namespace or "default"
        )
        params = {"dryRun": "All"} if dry_run else None
        answer = self.request("POST", collection, dict(doc), params=params, user=user)
        return answer.raise_for_status().json

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
        user: str = ADMIN,
    ) -> dict[str, Any]:
        """PATCH an object or its subresource (default: JSON merge patch)."""
        path = self.path_for(api_version, kind, name, namespace, subresource)
        return self.request("PATCH", path, patch, content_type, user=user).raise_for_status().json

    def apply(
        self,
        source: ManifestSource,
        *,
        namespace: str | None = None,
        dry_run: bool = False,
        field_manager: str = "cns-tests",
        timeout: float = 60.0,
    ) -> list[dict[str, Any]]:
        """Create or update every object (server-side apply, forced), in order.

        CustomResourceDefinitions are waited for until Established and served, so objects of the
        new kinds can follow in the same call. Status in a manifest is ignored by the server for
        kinds with a status subresource. Returns the objects as stored.
        """
        result = []
        for doc in load_manifests(source):
            meta = doc.setdefault("metadata", {})
            info = self.resource(doc["apiVersion"], doc["kind"])
            if info.namespaced:
                meta["namespace"] = meta.get("namespace") or namespace or "default"
            params: dict[str, Any] = {"fieldManager": field_manager, "force": True}
            if dry_run:
                params["dryRun"] = "All"
            answer = self.request(
                "PATCH", self._object_path(doc, namespace), doc, APPLY_PATCH, params=params
            )
            stored = answer.raise_for_status().json
            if doc["kind"] == "CustomResourceDefinition" and not dry_run:
                stored = self.wait_crd(meta["name"], timeout)
            result.append(stored)
        return result

    def wait_crd(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until a CRD is Established and its kind is in discovery; return the CRD."""
        deadline = time.monotonic() + timeout
        crd_version = "apiextensions.k8s.io/v1"
        while True:
            crd = self.get(crd_version, "CustomResourceDefinition", name)
            conditions = {c["type"]: c for c in (crd.get("status") or {}).get("conditions") or []}
            if conditions.get("Established", {}).get("status") == "True":
                break
            names_accepted = conditions.get("NamesAccepted", {})
            if names_accepted.get("status") == "False":
                raise KubeError(f"CRD {name}: names not accepted: {names_accepted}")
            if time.monotonic() > deadline:
                raise KubeError(f"CRD {name} not Established in {timeout} s: {conditions}")
            time.sleep(0.05)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                self.resource(
                    f"{group}/{version['name']}", kind, wait=max(1.0, deadline - time.monotonic())
                )
        return crd

    def delete(
        self,
        source: ManifestSource,
        *,
        namespace: str | None = None,
        wait: bool = True,
        timeout: float = 60.0,
    ) -> None:
        """Delete every object (in reverse order); missing ones are fine. `wait`: until gone.

        Namespaces are never waited for: without kube-controller-manager nothing finalizes them
        (they stay Terminating).
        """
        docs = load_manifests(source)
        pending = []
        for doc in reversed(docs):
            try:
                self.resource(doc["apiVersion"], doc["kind"], wait=0.0)
            except KubeError:
                continue  # the kind is not served (e.g. its CRD is gone): nothing to delete
            path = self._object_path(doc, namespace)
            answer = self.request("DELETE", path)
            if answer.status == 404:
                continue
            answer.raise_for_status()
            if doc["kind"] != "Namespace":
                pending.append(path)
        deadline = time.monotonic() + timeout
        for path in pending if wait else []:
            while self.request("GET", path).status != 404:
                if time.monotonic() > deadline:
                    raise KubeError(f"{path} still exists {timeout} s after DELETE")
                time.sleep(0.05)
        self._discovery.clear()

    def wait_for(
        self,
        condition: Callable[[], Any],
        timeout: float = 10.0,
        what: str = "condition",
        interval: float = 0.05,
    ) -> Any:
        """Poll until `condition()` is truthy and return it; KubeError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise KubeError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(interval)
