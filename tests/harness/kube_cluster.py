"""A real kube-apiserver and etcd on loopback, for tests that need the real Kubernetes API.

The binaries come from `scripts/build-kubernetes.sh` (kube-apiserver v1.20.2 built from Debian's
source package, etcd 3.4 from Debian), cached in `/var/cache/cns-kubernetes/bin` (or
`$CNS_KUBE_CACHE/bin`). This module never builds them: `binaries()` says whether they are there.

    import pytest
    from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture

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
import http.client
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.harness.kube_api import ADMIN, CONTROLLER_USER, DAEMON_USER, KubeApi, KubeError
from tests.harness.ports import free_port
from tests.harness.process import ManagedProcess, tail

BUILD_SCRIPT = "scripts/build-kubernetes.sh"
DEFAULT_CACHE = Path("/var/cache/cns-kubernetes")
# The Services' cluster IPs: IPv4, and IPv6 on a dual-stack cluster (1.20 takes at most a /108).
SERVICE_RANGES = ("10.0.0.0/24", "fd00:10:96::/112")


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
    from tests.harness.requirements import unavailable  # pytest only where a test needs it

    bin_dir = binaries()
    if bin_dir is None:
        unavailable(missing_binaries_message())
    cluster = KubeCluster.start(bin_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


class KubeCluster(KubeApi):
    """etcd + kube-apiserver on loopback, and a client of that apiserver (`KubeApi`: `request`,
    `get`, `apply`, ...). Create with `KubeCluster.start()`; `stop()` when done.

    Attributes: `server` (https://127.0.0.1:PORT), `token` (admin bearer token), `kubeconfig`
    (admin kubeconfig file, CA-verified), `ca_file`, `etcd_url`, `workdir`, `tokens` (user name ->
    token for every static user).
    """

    def __init__(
        self,
        bin_dir: Path,
        workdir: Path,
        extra_users: Iterable[str] = (),
        service_account_tokens: bool = False,
        address: str = "127.0.0.1",
        dual_stack: bool = False,
    ) -> None:
        self.bin_dir = bin_dir
        self.address = address
        self.dual_stack = dual_stack
        self.workdir = workdir
        self.service_account_tokens = service_account_tokens
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd_metrics_port = free_port()
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        tokens = {
            user: base64.b32encode(os.urandom(20)).decode().lower()
            for user in (ADMIN, DAEMON_USER, CONTROLLER_USER, *extra_users)
        }
        super().__init__(port=free_port(), tokens=tokens, host=address)
        self.token = self.tokens[ADMIN]
        self.ca_file = workdir / "certs" / "apiserver.crt"
        self.kubeconfig = workdir / "kubeconfig"
        self.etcd_log = workdir / "etcd.log"
        self.apiserver_log = workdir / "kube-apiserver.log"
        self._etcd = ManagedProcess("etcd", [], self.etcd_log)
        self._apiserver = ManagedProcess("kube-apiserver", [], self.apiserver_log)
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
        service_account_tokens: bool = False,
        address: str = "127.0.0.1",
        dual_stack: bool = False,
    ) -> KubeCluster:
        """Start etcd and kube-apiserver on free ports; return once the API is ready.

        `extra_users` get a token (no groups, so only what RBAC grants them).
        `service_account_tokens`: the ServiceAccount admission plugin on, so pods get their
        service account's token and CA mounted (in-cluster config, as cns's own workloads use
        it); off by default, as the other tests' pods need no API access. `dual_stack`: the
        `IPv6DualStack` feature gate on and Service ranges of both families (SERVICE_RANGES; a
        Service may then ask for both, `ipFamilyPolicy`). Raises KubeError
        (with the last log lines) if a process exits or the API is not ready within `timeout`.
        """
        bin_dir = bin_dir or binaries()
        if bin_dir is None:
            raise KubeError(missing_binaries_message())
        began = time.monotonic()
        deadline = began + timeout
        for attempt in range(3):
            workdir = Path(tempfile.mkdtemp(prefix="cns-kube-", dir=workdir_parent))
            cluster = cls(
                bin_dir, workdir, extra_users, service_account_tokens, address, dual_stack
            )
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
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            f"--secure-port={self.port}",
            "--insecure-port=0",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.workdir / 'sa.key'}",
            f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
            f"--service-cluster-ip-range={','.join(SERVICE_RANGES[: 2 if self.dual_stack else 1])}",
            # Loopback is no endpoint a node could reach: then the Service `kubernetes` has none.
            f"--endpoint-reconciler-type={'none' if self.address == '127.0.0.1' else 'lease'}",
            "--profiling=false",
            # `kubectl exec` and `logs` dial the node's address: a node's name does not resolve.
            "--kubelet-preferred-address-types=InternalIP",
            # As kubeadm's: tests/e2e/test_install_e2e.py compares cns with a privileged container.
            "--allow-privileged=true",
        ]
        if not self.service_account_tokens:
            self._apiserver.argv.append("--disable-admission-plugins=ServiceAccount")
        if self.dual_stack:
            self._apiserver.argv.append("--feature-gates=IPv6DualStack=true")

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
            if not self.trusted and self.ca_file.exists():
                # The apiserver may still be writing it: retry until it parses.
                with contextlib.suppress(ssl.SSLError, ValueError, OSError):
                    self._write_kubeconfig()
            if self.trusted:
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

    def server_pids(self) -> dict[str, int | None]:
        """The pids of etcd and kube-apiserver (None while one is not running): a benchmark
        reports their CPU, since on one machine they share the cores with what it measures."""
        return {
            name: process.popen.pid if process.running() and process.popen else None
            for name, process in (("etcd", self._etcd), ("apiserver", self._apiserver))
        }

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
                + tail(process.log, lines)
            )
        return "\n".join(parts)

    def _write_kubeconfig(self) -> None:
        self.trust(self.ca_file.read_text())
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
