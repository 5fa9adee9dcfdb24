"""A `KubeNode` with no cns on it: the node's containerd has the reference plugins in its CNI bin
dir and no network configuration, as a fresh node has, and cns arrives the way an operator installs
it: the image imported into containerd, `kubectl apply -k` of config/ (`install_overlay`).

The node's host paths of config/daemonset.yaml (/opt/cni, /etc/cni/net.d, /run/cns, /var/lib/cns,
/run/containerd, the kubelet's seccomp dir) are directories of the test (`host_paths`): an overlay
of config/ maps them, points the in-cluster API address at the loopback apiserver (there is no
kube-proxy for the `kubernetes` Service) and moves the debug and metrics ports to free ones.
Everything else is config/ as written.

The host is prepared as config/daemonset.yaml asks of a node's operator: net.ipv4.ip_forward=1 (the
confined daemon cannot write /proc/sys), put back as it was found when the node stops.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO
from tests.harness.containerd import Containerd
from tests.harness.kube_node import KubeNode, publish_node_address
from tests.harness.podman import build_pause_archive
from tests.harness.ports import free_port

KUBE_SYSTEM_PODS = "/api/v1/namespaces/kube-system/pods"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def build_image(archive: Path) -> str:
    """`make image` (scripts/build-image.sh), saved to `archive`; returns the tag it built."""
    script = REPO / "scripts" / "build-image.sh"
    subprocess.run(["bash", str(script), "--save", str(archive)], check=True, cwd=REPO)
    tag = subprocess.run(
        ["bash", str(script), "--tag"], check=True, cwd=REPO, capture_output=True, text=True
    )
    return tag.stdout.strip()


def rewrite_paths(value: Any, pointer: str, mapping: dict[str, str]) -> Iterator[dict[str, Any]]:
    """JSON-patch `replace` operations for every string under `value` that is one of `mapping`'s
    paths or lies below one (longest match first)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from rewrite_paths(item, f"{pointer}/{key}", mapping)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from rewrite_paths(item, f"{pointer}/{index}", mapping)
    elif isinstance(value, str):
        for old in sorted(mapping, key=len, reverse=True):
            if value == old or value.startswith(old + "/"):
                yield {"op": "replace", "path": pointer, "value": mapping[old] + value[len(old) :]}
                return


def write_overlay(
    directory: Path,
    docs: Mapping[tuple[str, str], dict[str, Any]],
    patches: Mapping[tuple[str, str], list[dict[str, Any]]],
    tag: str,
) -> Path:
    """A kustomization in `directory` over config/ (whose objects are `docs`, by kind and
    name): the image `tag` and each object's JSON `patches`; returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    targets = []
    for (kind, name), patch_ops in patches.items():
        doc = docs[kind, name]
        group, _, version = doc["apiVersion"].rpartition("/")
        target = {"version": version, "kind": kind, "name": name}
        if group:
            target["group"] = group
        if "namespace" in doc["metadata"]:
            target["namespace"] = doc["metadata"]["namespace"]
        path = f"{kind.lower()}-{name}.json"
        (directory / path).write_text(json.dumps(patch_ops, indent=1))
        targets.append({"target": target, "path": path})
    kustomization = {
        # kubectl 1.20's kustomize (v2.0.3): a directory base goes in `bases`, relative.
        "bases": [os.path.relpath(REPO / "config", directory)],
        "images": [{"name": "localhost/cns", "newTag": tag}],
        "patchesJson6902": targets,
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


class InstalledNode(KubeNode):
    """A node whose cns is only Kubernetes workloads, installed by the test (see the module)."""

    def __init__(self, kube: Any, workdir: Path, *, image_archive: Path, **options: Any) -> None:
        super().__init__(kube, workdir, **options)
        self.image_archive = image_archive
        root = workdir / "host"
        self.opt_cni, self.cni_conf = root / "opt-cni", root / "net.d"
        self.cns_run, self.cns_state = root / "run-cns", root / "var-lib-cns"
        self.debug_port, self.metrics_port = free_port(), free_port()
        self.daemon_metrics_port = free_port()  # the daemon's metrics listener
        self._ip_forward = IP_FORWARD.read_text()

    def _start(self) -> None:
        """containerd + kubelet, no cns: the node registers and stays NotReady (no network)."""
        IP_FORWARD.write_text("1")
        self._start_control_plane()
        self.containerd = Containerd(
            self.workdir / "containerd",
            conflist=None,
            cni_dirs=(self.opt_cni / "bin", self.cni_conf),
            pause_archive=build_pause_archive(self.workdir / "images"),
        )
        self.start_runtime_and_kubelet(self.image_archive)
        # `kubectl exec ds/cns -- cns status` (README) goes through the node's address.
        publish_node_address(self.kube, self.name)

    def _restore_host(self) -> None:
        super()._restore_host()
        IP_FORWARD.write_text(self._ip_forward)

    def host_paths(self) -> dict[str, str]:
        """config/daemonset.yaml's host paths -> this node's."""
        assert self.containerd is not None
        return {
            "/opt/cni": str(self.opt_cni),
            "/etc/cni/net.d": str(self.cni_conf),
            "/run/cns": str(self.cns_run),
            "/var/lib/cns": str(self.cns_state),
            "/run/containerd": str(self.containerd.socket.parent),
            "/var/lib/kubelet/seccomp": str(self.kubelet_root / "seccomp"),
        }

    def cni_files(self) -> dict[str, str]:
        """Every file, link and directory of the node's CNI dirs, with its content or target."""
        found = {}
        for root in (self.opt_cni, self.cni_conf):
            for path in sorted(root.rglob("*")):
                if path.is_symlink():
                    found[str(path)] = f"-> {path.readlink()}"
                elif path.is_dir():
                    found[str(path)] = "<dir>"
                else:
                    found[str(path)] = path.read_bytes().hex()
        return found

    def install_overlay(
        self, directory: Path, tag: str, settings: Mapping[str, object] | None = None
    ) -> Path:
        """A kustomization over config/ for this node (see the module), with `settings` set in
        the daemon's config file (the ConfigMap's cns.yaml); returns its directory."""
        base = yaml.safe_load_all(self.kubectl("kustomize", str(REPO / "config")))
        docs = {(d["kind"], d["metadata"]["name"]): d for d in base if d}
        paths = self.host_paths()
        api_env = [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.kube.port)},
        ]
        config_map = docs["ConfigMap", "cns-config"]
        config = yaml.safe_load(config_map["data"]["cns.yaml"])
        config["debugListen"] = f"127.0.0.1:{self.debug_port}"
        config["metrics"]["port"] = self.daemon_metrics_port
        config["logFormat"] = "json"
        config["leakReclaim"]["criSocket"] = str(self.containerd_socket())
        config.update(settings or {})
        for key in ("socketPath", "stateDir"):
            (op,) = rewrite_paths(config[key], "", paths)
            config[key] = op["value"]
        patches: dict[tuple[str, str], list[dict[str, Any]]] = {
            ("ConfigMap", "cns-config"): [
                {"op": "replace", "path": "/data/cns.yaml", "value": yaml.safe_dump(config)}
            ],
        }
        daemonset = docs["DaemonSet", "cns"]
        pod_spec = daemonset["spec"]["template"]["spec"]
        ops = list(rewrite_paths(pod_spec, "/spec/template/spec", paths))
        container = "/spec/template/spec/containers/0"
        ops += [{"op": "add", "path": f"{container}/env/-", "value": env} for env in api_env]
        ops.append({"op": "replace", "path": f"{container}/ports/0/containerPort",
                    "value": self.daemon_metrics_port})  # fmt: skip
        patches["DaemonSet", "cns"] = ops
        controller = docs["Deployment", "cns-controller"]["spec"]["template"]["spec"]
        command = controller["containers"][0]["command"]
        listen = command.index("--metrics-listen") + 1
        patches["Deployment", "cns-controller"] = [
            {
                "op": "replace",
                "path": f"{container}/command/{listen}",
                "value": command[listen].replace(":10091", f":{self.metrics_port}"),
            },
            {"op": "replace", "path": f"{container}/ports/0/containerPort",
             "value": self.metrics_port},
            *({"op": "add", "path": f"{container}/env/-", "value": env} for env in api_env),
        ]  # fmt: skip
        return write_overlay(directory, docs, patches, tag)

    def containerd_socket(self) -> Path:
        assert self.containerd is not None
        return self.containerd.socket

    def system_pods(self, selector: str) -> list[dict[str, Any]]:
        body = self.kube.request("GET", f"{KUBE_SYSTEM_PODS}?labelSelector={selector}").json
        return list(body.get("items") or [])

    def system_sandboxes(self) -> dict[str, int]:
        """The node's pod sandboxes in kube-system (pod name -> CRI state: 0 ready), from
        containerd: what runs there, whatever the API server says."""
        assert self.containerd is not None
        with self.containerd.client() as cri:
            return {
                s.metadata.name: s.state
                for s in cri.list_pod_sandboxes()
                if s.metadata.namespace == "kube-system"
            }


def cns_processes() -> dict[int, str]:
    """Every process running the image's `cns` (pid -> its memory cgroup): a container's runs in
    the pods' cgroup, a host process would not."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cgroups = (proc / "cgroup").read_text().splitlines()
        except OSError:
            continue
        if any(arg.endswith(b"/opt/cns/bin/cns") for arg in argv[:2]):
            memory = [line.split(":", 2)[2] for line in cgroups if ":memory:" in line]
            found[int(proc.name)] = memory[0] if memory else ""
    return found
