"""cns installed the way an operator installs it, on a real node (tests/harness/install_node.py):
`make image`, the image imported into the node's containerd, `kubectl apply -k` of config/, and
cns running only as Kubernetes workloads; then `kubectl delete -k` leaves the node's CNI dirs as
they were. Root only; builds the image (scripts/build-image.sh: podman, mmdebstrap, Debian's
packages and PyPI; the Debian bases are cached in /var/cache/cns-image).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.host import host_test_address
from tests.harness.install_node import InstalledNode, build_image, cns_processes
from tests.harness.kube_api import CS_API
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_node import POD_CGROUP_PARENT, deployment, host_state
from tests.harness.requirements import require
from tests.harness.roll import PodWatch, Scaler, Stall, allocated, scale
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


def cns_status(node: InstalledNode, *args: str) -> str:
    """README's `kubectl -n kube-system exec ds/cns -- cns status`: through the API server to
    the node's kubelet, into the DaemonSet pod's container (its own config file names the port)."""
    return node.kubectl("-n", "kube-system", "exec", "ds/cns", "--", "cns", "status", *args)


def owners(node: InstalledNode) -> dict[str, str]:
    """Pod name -> the address cns has assigned it, each address once (`cns status --ips`)."""
    status = json.loads(cns_status(node, "--ips", "--json"))
    assigned = [ip for ip in status["ips"] if ip["state"] == "Assigned" and ip.get("owner")]
    found = {ip["owner"]["podName"]: ip["address"] for ip in assigned}
    assert len(found) == len({ip["address"] for ip in assigned}) == len(assigned), assigned
    return found


def install(
    node: InstalledNode,
    tag: str,
    subnet: dict[str, object],
    settings: dict[str, object] | None = None,
) -> Path:
    """`kubectl apply -k` of the node's overlay (`settings` in the daemon's config), the pod
    subnet; returns once the cns pod and the node are Ready, with cns only Kubernetes workloads
    (the daemon and one controller)."""
    overlay = node.install_overlay(node.workdir / "overlay", tag, settings)
    began = time.monotonic()
    node.kubectl("apply", "-k", str(overlay))
    node.wait(
        lambda: node.kube.exists("apiextensions.k8s.io/v1", "CustomResourceDefinition",
                                 "clustersubnets.acn.azure.com"),
        "CRDs created",
    )  # fmt: skip
    node.wait(lambda: _applied(node, subnet), "the pod subnet applied", timeout=60)
    node.wait(
        lambda: _ready(node.system_pods(CNS)) == 1, "the cns DaemonSet pod Ready", timeout=180
    )
    node.wait_node_ready()
    installed = time.monotonic() - began
    print(f"install: kubectl apply -k to a Ready node with a Ready cns pod in {installed:.1f} s")
    processes = cns_processes()
    assert len(processes) == 2, processes
    assert all(cgroup.startswith(POD_CGROUP_PARENT) for cgroup in processes.values()), processes
    return overlay


def uninstall(node: InstalledNode, overlay: Path, before: dict[str, str]) -> None:
    """`kubectl delete -k`: no cns pod, sandbox or process left, the CNI dirs as `before`."""
    began = time.monotonic()
    node.kubectl("delete", "-k", str(overlay), timeout=180)
    node.wait(lambda: not node.system_pods(CNS), "the cns pod gone", timeout=120)
    node.wait(lambda: not node.system_sandboxes(), "cns's pod sandboxes gone", timeout=60)
    print(f"uninstall: kubectl delete -k to no cns pod sandbox in {time.monotonic() - began:.1f} s")
    assert not cns_processes()
    assert node.cni_files() == before


def test_kubectl_apply_k_installs_cns_and_delete_k_leaves_the_cni_dirs_as_before(
    node: InstalledNode, image: tuple[str, Path]
) -> None:
    tag, _ = image
    before = node.cni_files()
    assert not any(path.endswith(".conflist") for path in before)  # a node with no network
    overlay = install(node, tag, {"subnet": SUBNET})

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

    # README's command, as written: the pool's tables.
    rows = [line.split() for line in cns_status(node).splitlines()]
    tables = dict(row for row in rows if len(row) == 2)  # FIELD VALUE and STATE IPS rows
    assert (tables["STATE"], tables["Assigned"]) == ("IPS", "4"), tables
    assert owners(node) == ips
    status = json.loads(cns_status(node, "--json"))
    # The leak check reaches containerd through the read-only /run/containerd mount.
    assert status["leakCheck"]["enabled"], status
    assert not status["leakCheck"].get("runtimeError"), status

    # The preStop hook as the kubelet runs it, while its DaemonSet lives (the pod's service
    # account and RBAC for real): an upgrade or a restart, the files stay.
    daemonset = node.kube.get("apps/v1", "DaemonSet", "cns", "kube-system")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    files = node.cni_files()
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    said = node.kubectl("-n", "kube-system", "exec", "ds/cns", "--", *hook)
    assert "the DaemonSet exists" in said, said
    assert node.cni_files() == files

    node.kubectl("delete", "deployment/web")
    node.wait_gone("app=web")
    uninstall(node, overlay, before)


def _applied(node: InstalledNode, spec: dict[str, object]) -> bool:
    """The test's ClusterSubnet, once its CRD serves (an apply right after the CRD can 404)."""
    try:
        node.kube.apply(
            {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": "pods"},
             "spec": spec}
        )  # fmt: skip
    except Exception:
        return False
    return True


def _ready(pods: list[dict[str, object]]) -> int:
    def ready(pod: dict[str, object]) -> bool:
        conditions = pod.get("status", {}).get("conditions") or []  # type: ignore[attr-defined]
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    return sum(1 for pod in pods if ready(pod))


def test_a_rolling_upgrade_of_cns_keeps_every_pod_its_address_and_the_node_its_network(
    node: InstalledNode, image: tuple[str, Path]
) -> None:
    """Issue 16's rolling upgrade: the DaemonSet, then the controller, each rolled to a new image
    reference while a Deployment scales, against the same scaling with no roll (the baseline of
    the ADD stall, tests/harness/roll.py). Throughout: no pod's address changes, no address is
    held by two live pods, and the node's conflist never goes (the old pod's preStop sees its
    DaemonSet alive)."""
    tag, _ = image
    before = node.cni_files()
    # The controller's two scale-ups (baseline, roll) must start from the same pool: no reuse
    # cooldown (a released address counts as demand for 30 s) and a batch pinned at 16 (the
    # utilization-aware batch moves with the pods). Then 4 pods hold 15 secondary IPs after any
    # scale-down from 10 or more (27 or more free, above the release threshold of 24).
    overlay = install(
        node, tag, {"subnet": SUBNET, "scaler": {"batchSize": 16}}, {"ipCooldownSeconds": 0}
    )
    # The new version: a second reference to the image, so the roll is a change of the pod
    # template's image as an upgrade is (the same bytes: what is measured is the roll).
    new = f"localhost/cns:{tag}-next"
    assert node.containerd is not None
    node.containerd.ctr("-n", "k8s.io", "images", "tag", f"localhost/cns:{tag}", new, check=True)
    node.kube.apply(deployment("web", 4))
    node.wait_running("app=web", 4)
    watch = PodWatch(node, "app=web", node.cni_conf / "10-cns.conflist")
    watch.start()
    try:
        # The DaemonSet: 4 -> 10 -> 6 -> 10 -> 4 pods, 4 s a step, twice over, then up to 10;
        # in the roll the same steps (and more if the roll outlasts them), from its start.
        steps = [10, 6, 10, 4] * 2
        (old_pod,) = node.system_pods(CNS)
        base = measure(node, watch, steps, final=10)
        roll = measure(node, watch, steps, final=10, until=lambda: roll_daemonset(node, new))
        (new_pod,) = node.system_pods(CNS)
        assert new_pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
        spec = new_pod["spec"]
        assert {c["image"] for c in spec["containers"] + spec["initContainers"]} == {new}
        print(f"DaemonSet roll: {roll}; baseline {base}; ratio {ratio(roll, base)}")

        # The controller: from 4 pods to 3 beyond what the node holds, which needs a grant; in
        # the roll, asked once the old replicas are gone (Recreate), so the new leader grants.
        scale(node, "web", 4)
        node.wait_running("app=web", 4)
        first = settled_pool(node, 4)
        base_c = measure(node, watch, [first + 3], final=first + 3)
        scale(node, "web", 4)
        node.wait_running("app=web", 4)
        pool = settled_pool(node, 4)
        print(f"controller scale-ups: baseline 4 -> {first + 3} pods, roll 4 -> {pool + 3}")
        # The same demand, the same settled pool (the target is idempotent): equal scale-ups.
        assert pool == first
        roll_c = measure(
            node, watch, [pool + 3], final=pool + 3,
            start=lambda: stop_controller(node, new), until=lambda: new_leader(node, new),
        )  # fmt: skip
        print(f"controller roll: {roll_c}; baseline {base_c}; ratio {ratio(roll_c, base_c)}")
    finally:
        watch.stop()
    print(f"{watch.polls} polls, {len(watch.pods)} pods, poll errors: {len(watch.errors)}")
    assert watch.moved() == {}
    assert watch.doubles == []
    assert watch.conflist_missing == 0
    running = node.wait_running("app=web", pool + 3)
    live = {p["metadata"]["name"]: p["status"]["podIP"] for p in running}
    assert owners(node) == live

    node.kubectl("delete", "deployment/web")
    node.wait_gone("app=web")
    uninstall(node, overlay, before)


def measure(
    node: InstalledNode,
    watch: PodWatch,
    steps: list[int],
    *,
    final: int,
    start: Callable[[], None] | None = None,
    until: Callable[[], None] | None = None,
) -> Stall:
    """After `start`, scale through `steps` (4 s each; over and over until `until` returns),
    then to `final` pods, every one Running: the ADD stalls of the pods bound meanwhile."""
    began = time.monotonic()
    if start is not None:
        start()
    scaler = Scaler(node, "web", steps, dwell=4)
    scaler.start()
    try:
        if until is not None:
            until()
    finally:
        scaler.stop()
    scale(node, "web", final)
    node.wait_running("app=web", final, timeout=300)
    assert not scaler.errors, scaler.errors
    return watch.stall(began, time.monotonic())


def ratio(roll: Stall, base: Stall) -> str:
    return f"{roll.longest / base.longest:.2f}" if base.longest else "n/a"


def roll_daemonset(node: InstalledNode, image: str) -> None:
    """README's upgrade: `kubectl set image`, then `rollout status` until the new pod is Ready."""
    began = time.monotonic()
    node.kubectl("-n", "kube-system", "set", "image", "daemonset/cns", f"*={image}")
    node.kubectl("-n", "kube-system", "rollout", "status", "daemonset/cns", "--timeout=180s",
                 timeout=200)  # fmt: skip
    print(f"DaemonSet roll: set image to rollout status done in {time.monotonic() - began:.1f} s")


def stop_controller(node: InstalledNode, image: str) -> None:
    """The controller Deployment to `image` (Recreate): returns once the old replicas are gone,
    before the new ones run, when no controller serves the node."""
    began = time.monotonic()
    node.kubectl("-n", "kube-system", "set", "image", "deployment/cns-controller", f"*={image}")
    node.wait(
        lambda: all(p["spec"]["containers"][0]["image"] == image
                    for p in node.system_pods(CONTROLLER)),
        "the old controller replicas gone", timeout=120,
    )  # fmt: skip
    print(f"controller roll: old replicas gone {time.monotonic() - began:.1f} s after set image")


def new_leader(node: InstalledNode, image: str) -> None:
    """Until a replica of `image` leads. (`rollout status` would wait for both replicas, and on
    one node the second is Pending, its host port taken, whatever the version.)"""

    def leads() -> bool:
        pods = node.system_pods(CONTROLLER)
        lease = node.kube.get("coordination.k8s.io/v1", "Lease", "cns-controller", "kube-system")
        holder = lease["spec"].get("holderIdentity")
        return any(
            p["metadata"]["name"] == holder
            and p["spec"]["containers"][0]["image"] == image
            and p["status"].get("phase") == "Running"
            for p in pods
        )

    began = time.monotonic()
    node.wait(leads, "a controller of the new image leading", timeout=180)
    print(f"controller roll: a new replica leads {time.monotonic() - began:.1f} s later")


def settled_pool(node: InstalledNode, pods: int) -> int:
    """The node's granted addresses once its demand is its `pods` (the DELs of the pods scaled
    away have landed) and its pool is what that demand asks (requested = target) and granted:
    so that two scale-ups from the same number of pods start from the same pool."""

    def settled() -> int | None:
        pool = json.loads(cns_status(node, "--json"))
        granted = allocated(node.nnc())
        at_target = pool["requestedIPCount"] == pool["targetIPCount"] == granted
        return granted if pool["demand"] == pods and at_target else None

    pool: int = node.wait(settled, "the node's pool at its target, granted", timeout=300)
    return pool
