"""A CRI v1 client (`runtime.v1.RuntimeService`, pod sandboxes only) over a unix socket, with
stubs generated on the fly from tests/cri/api.proto (grpcio and grpcio-tools from PyPI).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PROTO = Path(__file__).resolve().parent.parent / "cri" / "api.proto"

_STUB_PACKAGE = "cns_cri_v1"
_stubs: tuple[ModuleType, ModuleType] | None = None
_stubs_lock = threading.Lock()


def cri_stubs(proto: Path = PROTO) -> tuple[ModuleType, ModuleType]:
    """(api_pb2, api_pb2_grpc) generated from tests/cri/api.proto with grpc_tools.protoc.

    Generated once into a temp dir keyed by the proto's hash and the generator's versions, and
    imported as the package `cns_cri_v1` (its own name: no clash with another `api_pb2`).
    """
    global _stubs
    with _stubs_lock:
        if _stubs is not None:
            return _stubs
        from grpc_tools import protoc  # type: ignore[import-untyped,unused-ignore]

        versions = ",".join(
            importlib.metadata.version(dist) for dist in ("grpcio-tools", "protobuf")
        )
        source = proto.read_bytes()
        key = hashlib.sha256(source + versions.encode()).hexdigest()[:16]
        cache_root = Path(tempfile.gettempdir()) / "cns-cri-stubs"
        cache_root.mkdir(exist_ok=True)
        target = cache_root / key
        if not (target / _STUB_PACKAGE / "api_pb2_grpc.py").exists():
            scratch = Path(tempfile.mkdtemp(dir=cache_root, prefix=".gen-"))
            (scratch / _STUB_PACKAGE).mkdir()
            (scratch / _STUB_PACKAGE / "api.proto").write_bytes(source)
            well_known = Path(protoc.__file__).parent / "_proto"
            code = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{scratch}",
                    f"-I{well_known}",
                    f"--python_out={scratch}",
                    f"--grpc_python_out={scratch}",
                    f"{_STUB_PACKAGE}/api.proto",
                ]
            )
            if code != 0:
                shutil.rmtree(scratch, ignore_errors=True)
                raise RuntimeError(f"grpc_tools.protoc failed ({code}) on {proto}")
            try:
                scratch.rename(target)
            except OSError:  # another process generated it meanwhile
                shutil.rmtree(scratch, ignore_errors=True)
        sys.path.insert(0, str(target))
        try:
            pb2 = importlib.import_module(f"{_STUB_PACKAGE}.api_pb2")
            pb2_grpc = importlib.import_module(f"{_STUB_PACKAGE}.api_pb2_grpc")
        finally:
            sys.path.remove(str(target))
        _stubs = (pb2, pb2_grpc)
        return _stubs


class CriClient:
    """CRI v1 `runtime.v1.RuntimeService` over a unix socket, pod sandboxes only."""

    def __init__(self, socket: Path, *, cgroup_parent: str = "", timeout: float = 60) -> None:
        import grpc  # type: ignore[import-untyped,unused-ignore]

        self.pb, grpc_stubs = cri_stubs()
        self.cgroup_parent = cgroup_parent
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.stub = grpc_stubs.RuntimeServiceStub(self.channel)

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def version(self) -> Any:
        return self.stub.Version(self.pb.VersionRequest(version="v1"), timeout=self.timeout)

    def run_pod_sandbox(
        self,
        name: str,
        namespace: str,
        uid: str,
        *,
        attempt: int = 0,
        port_mappings: Sequence[tuple[int, int]] = (),
    ) -> str:
        """RunPodSandbox as kubelet sends it for a pod on the pod network; returns its id.

        `port_mappings`: (container_port, host_port) TCP pairs, for the portmap plugin.
        """
        pb = self.pb
        linux = pb.LinuxPodSandboxConfig(
            cgroup_parent=f"{self.cgroup_parent}/pod{uid}" if self.cgroup_parent else "",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.CONTAINER)
            ),
        )
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, namespace=namespace, uid=uid, attempt=attempt
            ),
            hostname=name[:63],
            port_mappings=[
                pb.PortMapping(protocol=pb.TCP, container_port=inner, host_port=outer)
                for inner, outer in port_mappings
            ],
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace},
            linux=linux,
        )
        response = self.stub.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config), timeout=self.timeout
        )
        sandbox_id: str = response.pod_sandbox_id
        return sandbox_id

    def status(self, sandbox_id: str, verbose: bool = False) -> Any:
        """The PodSandboxStatusResponse (`.status`, and `.info` when verbose)."""
        request = self.pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose)
        return self.stub.PodSandboxStatus(request, timeout=self.timeout)

    def ready(self, sandbox_id: str) -> bool:
        return bool(self.status(sandbox_id).status.state == self.pb.SANDBOX_READY)

    def pod_ip(self, sandbox_id: str) -> str:
        ip: str = self.status(sandbox_id).status.network.ip
        return ip

    def info(self, sandbox_id: str) -> dict[str, Any]:
        """containerd's verbose `info` JSON: pid, runtimeSpec, cniResult, ..."""
        raw = self.status(sandbox_id, verbose=True).info.get("info", "{}")
        info: dict[str, Any] = json.loads(raw)
        return info

    def netns(self, sandbox_id: str, locate: Callable[[str], Path] = Path) -> str | None:
        """Path of the sandbox's network namespace (None once it is stopped); `locate`: where a
        path of the runtime's mount namespace is seen from here (a multi-node cluster's node's)."""
        spec = self.info(sandbox_id).get("runtimeSpec", {})
        for namespace in spec.get("linux", {}).get("namespaces", []):
            if namespace.get("type") == "network":
                path = namespace.get("path")
                return str(locate(path)) if path and locate(path).exists() else None
        return None

    def stop(self, sandbox_id: str) -> None:
        self.stub.StopPodSandbox(
            self.pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=self.timeout
        )

    def remove(self, sandbox_id: str) -> None:
        self.stub.RemovePodSandbox(
            self.pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=self.timeout
        )

    def list_pod_sandboxes(self) -> list[Any]:
        response = self.stub.ListPodSandbox(self.pb.ListPodSandboxRequest(), timeout=self.timeout)
        return list(response.items)
