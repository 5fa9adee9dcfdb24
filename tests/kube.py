"""A real kube-apiserver and etcd on loopback, for tests that need the real Kubernetes API.

The binaries come from `scripts/build-kubernetes.sh` (kube-apiserver v1.20.2 built from Debian's
source package, etcd 3.4 from Debian), cached in `/var/cache/cns-kubernetes/bin` (or
`$CNS_KUBE_CACHE/bin`). This module never builds them: `binaries()` says whether they are there.

    import pytest
    from tests.kube import KubeCluster, kube_cluster_fixture

    kube = pytest.fixture(scope="session")(kube_cluster_fixture)

    def test_something(kube: KubeCluster) -> None:
        kube.apply(REPO / "config/crd")
        nnc = kube.get("acn.azure.com/v1alpha", "NodeNetworkConfig", "node-1", "kube-system")

Each cluster gets free loopback ports and its own temporary directory (data, certs, logs,
kubeconfig). Authentication is by static bearer tokens (`--token-auth-file`): `admin` is in
`system:masters`, and the service accounts of cns (`system:serviceaccount:kube-system:cns` and
`...:cns-controller`) have tokens too, so `kubeconfig_for(...)` lets a process run with exactly the
permissions `config/rbac.yaml` grants. Authorization is RBAC. There is no controller-manager or
scheduler: nothing runs pods, garbage-collects, or finalizes namespaces.

Known deviation of this build from a real v1.20.2: built with Go >= 1.16, its CRD validation
rejects the empty string "" in any string field of a custom resource ("must be of type string:
null"; kubernetes/kubernetes#99804, fixed upstream in 1.21 by kubernetes/kube-openapi#230). The
cure is a one-line patch of vendor/github.com/go-openapi/validate/type.go in the build
(`if data == nil || reflect.DeepEqual(...)` -> `if data == nil`). Until then, tests must not rely
on "" being accepted (nor rejected).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BUILD_SCRIPT = "scripts/build-kubernetes.sh"
DEFAULT_CACHE = Path("/var/cache/cns-kubernetes")
ADMIN = "admin"
DAEMON_USER = "system:serviceaccount:kube-system:cns"
CONTROLLER_USER = "system:serviceaccount:kube-system:cns-controller"

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

ManifestSource = str | os.PathLike[str] | Mapping[str, Any] | Iterable[Mapping[str, Any]]


def binaries() -> Path | None:
    """The directory holding `kube-apiserver` and `etcd`, or None if either is missing."""
    root = Path(os.environ.get("CNS_KUBE_CACHE") or DEFAULT_CACHE)
    bin_dir = root / "bin"
    for name in ("kube-apiserver", "etcd"):
        if not os.access(bin_dir / name, os.X_OK):
            return None
    return bin_dir


def missing_binaries_message() -> str:
    root = os.environ.get("CNS_KUBE_CACHE") or DEFAULT_CACHE
    return (
        f"kube-apiserver/etcd not found in {root}/bin: run `bash {BUILD_SCRIPT}` "
        "(builds them offline from Debian sources, ~6-10 minutes, cached)"
    )


def kube_cluster_fixture() -> Iterator[KubeCluster]:
    """Generator for a pytest fixture: `kube = pytest.fixture(scope="session")(this)`.

    Without the binaries it skips, or fails when `$CI` is set (CI must not skip silently).
    """
    import pytest

    bin_dir = binaries()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail(missing_binaries_message(), pytrace=False)
        pytest.skip(missing_binaries_message())
    cluster = KubeCluster.start(bin_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


class KubeError(RuntimeError):
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """PR_SET_PDEATHSIG: the child gets SIGKILL if the test process dies without cleaning up."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - 64 * 1024))
            text = file.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Process:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    starts: int = field(default=0)
    env: dict[str, str] | None = None

    def spawn(self, cwd: Path) -> None:
        self.starts += 1
        with self.log.open("ab") as log:
            log.write(f"\n===== start #{self.starts}: {' '.join(self.argv)}\n".encode())
            log.flush()
            # PDEATHSIG fires when the spawning *thread* exits: only use it from the main thread
            # (a restart from asyncio.to_thread must not kill the apiserver later).
            in_main = threading.current_thread() is threading.main_thread()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent if in_main else None,
            )

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (at once if `timeout` is 0)."""
        popen, self.popen = self.popen, None
        if popen is None or popen.poll() is not None:
            return
        if timeout > 0:
            popen.terminate()
            try:
                popen.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                pass
        popen.kill()
        popen.wait(10)

    def exited_because_port_taken(self) -> bool:
        return (
            self.popen is not None
            and self.popen.poll() is not None
            and "address already in use" in _tail(self.log, 30)
        )


class KubeCluster:
    """etcd + kube-apiserver on loopback. Create with `KubeCluster.start()`; `stop()` when done.

    Attributes: `server` (https://127.0.0.1:PORT), `token` (admin bearer token), `kubeconfig`
    (admin kubeconfig file, CA-verified), `ca_file`, `etcd_url`, `workdir`, `tokens` (user name ->
    token for every static user).
    """

    def __init__(self, bin_dir: Path, workdir: Path, extra_users: Iterable[str] = ()) -> None:
        self.bin_dir = bin_dir
        self.workdir = workdir
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd_metrics_port = free_port()
        self.port = free_port()
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.server = f"https://127.0.0.1:{self.port}"
        self.tokens: dict[str, str] = {
            user: base64.b32encode(os.urandom(20)).decode().lower()
            for user in (ADMIN, DAEMON_USER, CONTROLLER_USER, *extra_users)
        }
        self.token = self.tokens[ADMIN]
        self.ca_file = workdir / "certs" / "apiserver.crt"
        self.kubeconfig = workdir / "kubeconfig"
        self.etcd_log = workdir / "etcd.log"
        self.apiserver_log = workdir / "kube-apiserver.log"
        self._etcd = _Process("etcd", [], self.etcd_log)
        self._apiserver = _Process("kube-apiserver", [], self.apiserver_log)
        self._ssl: ssl.SSLContext | None = None
        self._discovery: dict[str, list[ResourceInfo]] = {}
        self._stopped = False
        self.startup_seconds = 0.0

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def start(
        cls,
        bin_dir: Path | None = None,
        *,
        timeout: float = 120.0,
        extra_users: Iterable[str] = (),
        workdir_parent: str | None = None,
    ) -> KubeCluster:
        """Start etcd and kube-apiserver on free ports; return once the API is ready.

        `extra_users` get a token (no groups, so only what RBAC grants them). Raises KubeError
        (with the last log lines) if a process exits or the API is not ready within `timeout`.
        """
        bin_dir = bin_dir or binaries()
        if bin_dir is None:
            raise KubeError(missing_binaries_message())
        began = time.monotonic()
        deadline = began + timeout
        for attempt in range(3):
            workdir = Path(tempfile.mkdtemp(prefix="cns-kube-", dir=workdir_parent))
            cluster = cls(bin_dir, workdir, extra_users)
            atexit.register(cluster.stop)
            try:
                cluster._prepare()
                cluster._start_etcd(deadline)
                cluster.start_apiserver(timeout=max(1.0, deadline - time.monotonic()))
                cluster._wait_bootstrap(deadline)
            except _PortTaken:
                cluster.stop(graceful=False)
                if attempt == 2:
                    raise KubeError("could not find free loopback ports in 3 attempts") from None
                continue
            except BaseException:
                cluster.stop(graceful=False)
                raise
            cluster.startup_seconds = time.monotonic() - began
            return cluster
        raise AssertionError("unreachable")

    def __enter__(self) -> KubeCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self, graceful: bool = True) -> None:
        """Terminate both processes and remove the temporary directory (idempotent).

        Set CNS_KUBE_KEEP=1 to keep the directory (logs, etcd data) for debugging.
        """
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        self._apiserver.stop(5.0 if graceful else 0.0)
        self._etcd.stop(5.0 if graceful else 0.0)
        if os.environ.get("CNS_KUBE_KEEP"):
            print(f"kube harness: kept {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _prepare(self) -> None:
        (self.workdir / "certs").mkdir()
        with (self.workdir / "tokens.csv").open("w") as file:
            for i, (user, token) in enumerate(self.tokens.items()):
                if user == ADMIN:
                    groups = "system:masters"
                elif user.startswith("system:serviceaccount:"):
                    namespace = user.split(":")[2]
                    groups = f"system:serviceaccounts,system:serviceaccounts:{namespace}"
                else:
                    groups = ""
                file.write(f'{token},{user},uid-{i},"{groups}"\n')
        subprocess.run(
            ["openssl", "genrsa", "-out", str(self.workdir / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        etcd_url = self.etcd_url
        peer_url = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._etcd.argv = [
            str(self.bin_dir / "etcd"),
            "--name=default",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            f"--listen-metrics-urls=http://127.0.0.1:{self.etcd_metrics_port}",
            "--logger=zap",
        ]
        self._apiserver.argv = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            "--insecure-port=0",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.workdir / 'sa.key'}",
            f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--endpoint-reconciler-type=none",
            "--disable-admission-plugins=ServiceAccount",
            "--profiling=false",
        ]

    def _start_etcd(self, deadline: float) -> None:
        self._etcd.spawn(self.workdir)
        while True:
            if not self._etcd.running():
                if self._etcd.exited_because_port_taken():
                    raise _PortTaken
                raise self._failure("etcd exited during start-up")
            with contextlib.suppress(OSError, ValueError):
                if self._etcd_call("GET", "/health").get("health") == "true":
                    return
            if time.monotonic() > deadline:
                raise self._failure("etcd did not become healthy in time")
            time.sleep(0.05)

    def start_apiserver(self, timeout: float = 60.0) -> None:
        """Start the apiserver (same port, etcd and certificates) and wait for `/readyz`."""
        if self._apiserver.running():
            raise KubeError("kube-apiserver is already running")
        deadline = time.monotonic() + timeout
        self._apiserver.spawn(self.workdir)
        while True:
            if not self._apiserver.running():
                if self._apiserver.exited_because_port_taken():
                    if self._apiserver.starts == 1:
                        raise _PortTaken
                    # Restart on the same port: wait for the old socket to go away.
                    if time.monotonic() > deadline:
                        raise self._failure(f"port {self.port} stayed in use")
                    time.sleep(0.2)
                    self._apiserver.spawn(self.workdir)
                    continue
                raise self._failure("kube-apiserver exited during start-up")
            if self._ssl is None and self.ca_file.exists():
                # The apiserver may still be writing it: retry until it parses.
                with contextlib.suppress(ssl.SSLError, ValueError, OSError):
                    self._write_kubeconfig()
            if self._ssl is not None:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    wait = min(5.0, max(0.5, deadline - time.monotonic()))
                    if self.request("GET", "/readyz", timeout=wait).status == 200:
                        return
            if time.monotonic() > deadline:
                raise self._failure("kube-apiserver /readyz did not answer 200 in time")
            time.sleep(0.1)

    def stop_apiserver(self, graceful: bool = True) -> None:
        """Stop the apiserver; etcd keeps running. `graceful`: SIGTERM (open watches are ended,
        SIGKILL after 5 s); otherwise SIGKILL at once, like a crash."""
        self._apiserver.stop(5.0 if graceful else 0.0)

    def restart_apiserver(
        self, downtime: float = 0.0, timeout: float = 60.0, graceful: bool = True
    ) -> None:
        """Stop the apiserver, wait `downtime` seconds, start it again and wait until ready.

        Watches break (clients see the connection end); the new apiserver's watch cache starts at
        the current etcd revision, so resuming a watch from an older resourceVersion may get 410.
        """
        self.stop_apiserver(graceful)
        if downtime > 0:
            time.sleep(downtime)
        self.start_apiserver(timeout)

    @property
    def apiserver_running(self) -> bool:
        return self._apiserver.running()

    def _wait_bootstrap(self, deadline: float) -> None:
        """Objects the apiserver creates itself shortly after /readyz (namespaces, priorities)."""
        for path in (
            "/api/v1/namespaces/default",
            "/api/v1/namespaces/kube-system",
            "/apis/scheduling.k8s.io/v1/priorityclasses/system-node-critical",
        ):
            while self.request("GET", path).status != 200:
                if time.monotonic() > deadline:
                    raise self._failure(f"{path} was not created by the apiserver in time")
                time.sleep(0.1)

    def _failure(self, what: str) -> KubeError:
        return KubeError(f"{what}\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of both logs, for error messages."""
        parts = []
        for process in (self._apiserver, self._etcd):
            code = process.popen.poll() if process.popen else None
            state = "not running" if process.popen is None else f"exit code {code}"
            if code is None and process.popen is not None:
                state = f"running, pid {process.popen.pid}"
            parts.append(
                f"--- {process.name} ({state}), last {lines} lines of {process.log}:\n"
                + _tail(process.log, lines)
            )
        return "\n".join(parts)

    def _write_kubeconfig(self) -> None:
        ca = self.ca_file.read_bytes()
        self._ssl = ssl.create_default_context(cadata=ca.decode())
        self._write_kubeconfig_for(ADMIN, self.kubeconfig)

    def _write_kubeconfig_for(self, user: str, path: Path) -> None:
        ca_data = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "cns-test",
                    "cluster": {"server": self.server, "certificate-authority-data": ca_data},
                }
            ],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "cns-test", "context": {"cluster": "cns-test", "user": user}}],
            "current-context": "cns-test",
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(path)

    def kubeconfig_for(self, user: str) -> Path:
        """A kubeconfig authenticating as `user` (one of `tokens`, e.g. DAEMON_USER)."""
        if user not in self.tokens:
            raise KeyError(f"no token for {user!r}; pass it in KubeCluster.start(extra_users=...)")
        safe = user.replace(":", "-")
        path = self.workdir / f"kubeconfig-{safe}"
        self._write_kubeconfig_for(user, path)
        return path

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
            query = urllib.parse.urlencode(
                {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
            )
            path = f"{path}{'&' if '?' in path else '?'}{query}"
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
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, context=self._ssl, timeout=timeout
        )
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
        query = {"watch": "true", **(params or {})}
        query = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in query.items()}
        full = f"{path}?{urllib.parse.urlencode(query)}"
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, context=self._ssl, timeout=timeout
        )
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

    # ------------------------------------------------------------------ etcd

    def _etcd_call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.etcd_port, timeout=10)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            data: dict[str, Any] = json.loads(answer.read() or b"{}")
        finally:
            conn.close()
        return data

    def etcd_revision(self) -> int:
        """etcd's current revision (= the newest resourceVersion the apiserver can hand out)."""
        probe = base64.b64encode(b"/cns-harness-probe").decode()
        answer = self._etcd_call("POST", "/v3/kv/range", {"key": probe, "count_only": True})
        try:
            return int(answer["header"]["revision"])
        except (KeyError, ValueError) as exc:
            raise KubeError(f"unexpected etcd range answer: {answer}") from exc

    def compact_etcd(self) -> int:
        """Compact etcd at its current revision (physically); return that revision.

        Afterwards a watch or list from an older resourceVersion that reaches etcd gets 410 Gone.
        Watches served from the apiserver's watch cache go by the cache's own window instead (see
        `restart_apiserver`, which resets that window to the current revision).
        """
        revision = self.etcd_revision()
        answer = self._etcd_call(
            "POST", "/v3/kv/compaction", {"revision": str(revision), "physical": True}
        )
        if "error" in answer and "compacted" not in str(answer.get("error")):
            raise KubeError(f"etcd compaction at {revision} failed: {answer}")
        return revision


class _PortTaken(Exception):
    """A process lost the race for a free port; the caller retries with new ports."""
