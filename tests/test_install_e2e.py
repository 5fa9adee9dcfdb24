"""cns installed the way an operator installs it, on a real node (tests/harness/install_node.py):
`make image`, the image imported into the node's containerd, `kubectl apply -k` of config/, and
cns running only as Kubernetes workloads; then `kubectl delete -k` leaves the node's CNI dirs as
they were. Root only; builds the image (scripts/build-image.sh: podman, mmdebstrap, Debian's
packages and PyPI; the Debian bases are cached in /var/cache/cns-image).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.harness.host import host_test_address
from tests.harness.install_node import InstalledNode, build_image, cns_processes
from tests.harness.kube_api import CS_API
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_node import POD_CGROUP_PARENT, deployment, host_state
from tests.harness.requirements import require
from tests.test_node_e2e import HOST_ADDRESS, check_reachability, require_node

SUBNET = "10.249.0.0/24"
CNS = "app.kubernetes.io/name=cns"
CONTROLLER = "app.kubernetes.io/name=cns-controller"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    require_node()
    require([tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None], "")
    archive = tmp_path_factory.mktemp("image") / "cns.tar"
    tag = build_image(archive)
    return tag, archive


@pytest.fixture
def node(image: tuple[str, Path], tmp_path: Path) -> Iterator[InstalledNode]:
    before = host_state()
    kube = KubeCluster.start(service_account_tokens=True)
    try:
        with host_test_address(HOST_ADDRESS, "cnsnodehost"):
            node = InstalledNode.start(
                kube, tmp_path / "node", subnet_cidr=SUBNET, image_archive=image[1]
            )
            try:
                yield node
            finally:
                node.stop()
                assert node.leftovers() == []
    finally:
        kube.stop()
    assert host_state() == before, "the node's teardown left the host changed"


def cns_status(node: InstalledNode) -> dict[str, object]:
    """`cns status --ips --json` from the node, against the DaemonSet pod's debug endpoint."""
    result = subprocess.run(
        [sys.executable, "-m", "cns.cli", "status", "--ips", "--json",
         "--debug-url", f"http://127.0.0.1:{node.debug_port}"],
        capture_output=True, text=True, cwd=REPO, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    status: dict[str, object] = json.loads(result.stdout)
    return status


def test_kubectl_apply_k_installs_cns_and_delete_k_leaves_the_cni_dirs_as_before(
    node: InstalledNode, image: tuple[str, Path]
) -> None:
    tag, _ = image
    before = node.cni_files()
    assert not any(path.endswith(".conflist") for path in before)  # a node with no network
    overlay = node.install_overlay(node.workdir / "overlay", tag)

    began = time.monotonic()
    node.kubectl("apply", "-k", str(overlay))
    node.wait(
        lambda: node.kube.exists("apiextensions.k8s.io/v1", "CustomResourceDefinition",
                                 "clustersubnets.acn.azure.com"),
        "CRDs created",
    )  # fmt: skip
    node.wait(lambda: _applied(node), "the pod subnet applied", timeout=60)
    node.wait(
        lambda: _ready(node.system_pods(CNS)) == 1, "the cns DaemonSet pod Ready", timeout=180
    )
    node.wait_node_ready()
    installed = time.monotonic() - began
    print(f"install: kubectl apply -k to a Ready node with a Ready cns pod in {installed:.1f} s")

    # cns is only Kubernetes workloads: the daemon and one controller, in the pods' cgroup.
    processes = cns_processes()
    assert len(processes) == 2, processes
    assert all(cgroup.startswith(POD_CGROUP_PARENT) for cgroup in processes.values()), processes
    # Two controller replicas on the host network: one runs and leads, the other finds the
    # node's metrics port taken and waits for another node.
    controllers = node.system_pods(CONTROLLER)
    assert sorted(p["status"].get("phase") for p in controllers) == ["Pending", "Running"]
    (running,) = [p for p in controllers if p["status"].get("phase") == "Running"]
    (daemon,) = node.system_pods(CNS)
    sandboxes = node.system_sandboxes()
    assert sandboxes == {daemon["metadata"]["name"]: 0, running["metadata"]["name"]: 0}
    lease = node.wait(
        lambda: node.kube.get("coordination.k8s.io/v1", "Lease", "cns-controller", "kube-system"),
        "the controller's lease",
    )
    assert lease["spec"]["holderIdentity"] == running["metadata"]["name"]

    # The files the init container wrote are what containerd runs pods with.
    conflist = json.loads((node.cni_conf / "10-cns.conflist").read_text())
    assert conflist["plugins"][0]["socket"] == str(node.cns_run / "cns.sock")

    node.kube.apply(deployment("web", 4))
    pods = node.wait_running("app=web", 4)
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    assert all(ip.startswith("10.249.0.") for ip in ips.values()), ips
    assert len(set(ips.values())) == 4, ips
    check_reachability(node, ips)

    status = cns_status(node)
    owners = {
        ip["owner"]["podName"]: ip["address"]
        for ip in status["ips"]  # type: ignore[attr-defined]
        if ip["state"] == "Assigned" and ip.get("owner")
    }
    assert owners == ips
    pool = status["pool"]
    assert pool["ips"]["Assigned"] == 4  # type: ignore[index]
    # The leak check reaches containerd through the read-only /run/containerd mount.
    assert pool["leakCheck"]["enabled"], pool  # type: ignore[index]
    assert not pool["leakCheck"].get("runtimeError"), pool  # type: ignore[index]

    node.kubectl("delete", "deployment/web")
    node.wait_gone("app=web")

    began = time.monotonic()
    node.kubectl("delete", "-k", str(overlay), timeout=180)
    node.wait(lambda: not node.system_pods(CNS), "the cns pod gone", timeout=120)
    node.wait(lambda: not node.system_sandboxes(), "cns's pod sandboxes gone", timeout=60)
    print(f"uninstall: kubectl delete -k to no cns pod sandbox in {time.monotonic() - began:.1f} s")
    assert not cns_processes()
    assert node.cni_files() == before


def _applied(node: InstalledNode) -> bool:
    """The test's ClusterSubnet, once its CRD serves (an apply right after the CRD can 404)."""
    try:
        node.kube.apply(
            {
                "apiVersion": CS_API,
                "kind": "ClusterSubnet",
                "metadata": {"name": "pods"},
                "spec": {"subnet": SUBNET},
            }
        )
    except Exception:
        return False
    return True


def _ready(pods: list[dict[str, object]]) -> int:
    def ready(pod: dict[str, object]) -> bool:
        conditions = pod.get("status", {}).get("conditions") or []  # type: ignore[attr-defined]
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    return sum(1 for pod in pods if ready(pod))
