"""The whole system on a real node (tests/harness/kube_node.py): kubelet + containerd + `cns-cni`
+ the cns daemon and controller, on a real kube-apiserver with scheduler and controller-manager.
Root only.
"""

from __future__ import annotations

import json
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.daemon import metric_sum
from tests.harness.host import host_test_address, ping, run
from tests.harness.kube_api import NNC_API
from tests.harness.kube_cluster import KubeCluster, binaries, kube_cluster_fixture
from tests.harness.kube_node import (
    LEAK_GRACE_SECONDS,
    HostState,
    KubeNode,
    deployment,
    host_state,
    missing_node_binaries,
)
from tests.harness.requirements import require, require_runtime_root

HOST_ADDRESS = "10.251.255.1"  # on a link of its own: "the node" as pods see it
BATCH = 16


def formula(demand: int) -> int:
    """requested = B * ceil(mf + U/B) - primary, B = 16, mf = 0.5, one primary IP."""
    return BATCH * math.ceil(0.5 + demand / BATCH) - 1


def require_node() -> None:
    require_runtime_root("containerd")
    bin_dir = binaries()
    missing = ["kube-apiserver/etcd"] if bin_dir is None else missing_node_binaries(bin_dir)
    require(missing, ": run `bash scripts/build-kubernetes.sh` (test.sh)")


class NncHistory:
    """Every version of the node's NNC spec, from a watch started before the action."""

    def __init__(self, node: KubeNode) -> None:
        self.node = node
        self.specs: list[dict[str, Any]] = []
        start = node.nnc()
        self.specs.append(start["spec"])
        path = node.kube.path_for(NNC_API, "NodeNetworkConfig", namespace="kube-system")
        params = {
            "fieldSelector": f"metadata.name={node.name}",
            "resourceVersion": start["metadata"]["resourceVersion"],
            "timeoutSeconds": 600,
        }
        self._thread = threading.Thread(target=self._follow, args=(path, params), daemon=True)
        self._thread.start()

    def _follow(self, path: str, params: dict[str, Any]) -> None:
        for event in self.node.kube.watch(path, params, timeout=610):
            if event["type"] in ("ADDED", "MODIFIED"):
                self.specs.append(event["object"]["spec"])

    def requested_values(self) -> list[int]:
        """The distinct successive values of spec.requestedIPCount."""
        values: list[int] = []
        for spec in self.specs:
            value = int(spec.get("requestedIPCount", 0))
            if not values or values[-1] != value:
                values.append(value)
        return values

    def max_ips_not_in_use(self) -> int:
        return max(len(spec.get("ipsNotInUse") or []) for spec in self.specs)


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeCluster]:
    require_node()
    yield from kube_cluster_fixture()


@pytest.fixture(scope="module")
def host_before() -> HostState:
    return host_state()


@pytest.fixture(scope="module")
def node(
    kube: KubeCluster, host_before: HostState, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KubeNode]:
    workdir = Path(tmp_path_factory.mktemp("node"))
    with host_test_address(HOST_ADDRESS, "cnsnodehost"):
        node = KubeNode.start(kube, workdir, subnet_cidr="10.250.0.0/24")
        try:
            yield node
        finally:
            node.stop()
            assert node.leftovers() == []
    assert host_state() == host_before, "the node's teardown left the host changed"


def assigned_by_pod(node: KubeNode) -> dict[str, str]:
    assert node.daemon is not None
    return {
        ip["owner"]["podName"]: ip["address"]
        for ip in node.daemon.ips()
        if ip["state"] == "Assigned" and ip.get("owner")
    }


def check_pods_against_cns(node: KubeNode, pods: list[dict[str, Any]]) -> dict[str, str]:
    """Each pod's status.podIP is the IP cns assigned to exactly that pod; no IP twice."""
    cns = assigned_by_pod(node)
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    for name, ip in ips.items():
        assert cns.get(name) == ip, f"{name}: podIP {ip}, cns has {cns.get(name)}"
    assert len(set(ips.values())) == len(ips), f"an IP twice: {sorted(ips.values())}"
    return ips


def check_reachability(node: KubeNode, ips: dict[str, str]) -> None:
    """One pod pings every other pod and the node; the node pings every pod."""
    first, *others = sorted(ips)
    targets = " ".join([ips[name] for name in others] + [HOST_ADDRESS])
    script = (
        f"for ip in {targets}; do ping -c1 -W2 $ip >/dev/null || ping -c1 -W2 $ip >/dev/null"
        " || echo unreachable $ip; done; echo done"
    )
    netns = Path(node.pod_netns(first)).name
    output = run(["ip", "netns", "exec", netns, "sh", "-c", script], timeout=300).stdout
    assert output.strip().endswith("done") and "unreachable" not in output, output
    for name, ip in ips.items():
        assert ping(ip).returncode == 0, f"node cannot reach {name} at {ip}"


def scale(node: KubeNode, name: str, replicas: int) -> None:
    node.kubectl("scale", f"deployment/{name}", f"--replicas={replicas}")


def test_deployment_of_30_pods_runs_on_cns_ips(node: KubeNode) -> None:
    assert node.daemon is not None
    node.wait(lambda: node.nnc()["spec"].get("requestedIPCount") == formula(0), "initial request")
    history = NncHistory(node)
    node.kube.apply(deployment("web", 30))
    pods = node.wait_running("app=web", 30)
    ips = check_pods_against_cns(node, pods)
    assert all(ip.startswith("10.250.0.") for ip in ips.values())
    check_reachability(node, ips)
    # The burst of 30 was one publish, straight to the formula's value (never batch by batch).
    assert history.requested_values() == [formula(0), formula(30)], history.requested_values()

    scale(node, "web", 0)
    node.wait_gone("app=web")
    node.wait(lambda: not assigned_by_pod(node), "every IP released")
    node.wait(lambda: node.nnc()["spec"].get("requestedIPCount") == formula(0), "request is 15")
    node.wait(lambda: not node.nnc()["spec"].get("ipsNotInUse"), "release handshake completed")
    node.kubectl("delete", "deployment/web")


def test_pod_deleted_while_daemon_down_is_released_when_it_returns(node: KubeNode) -> None:
    daemon = node.daemon
    assert daemon is not None
    node.kube.apply(deployment("queued", 3))
    pods = node.wait_running("app=queued", 3)
    before = check_pods_against_cns(node, pods)
    victim = sorted(before)[0]

    daemon.stop()
    node.kubectl("delete", "pod", victim, "--wait=false")
    node.wait(lambda: all(p["metadata"]["name"] != victim for p in node.pods("app=queued")),
         "the deleted pod gone while the daemon is down", timeout=120)  # fmt: skip
    node.start_daemon()
    # The DEL was queued by cns-cni; the daemon applies the queue at start.
    node.wait(lambda: victim not in assigned_by_pod(node), f"{victim}'s IP released")
    assert daemon.metrics()['cns_ip_releases_total{reason="queued-del"}'] >= 1
    pods = node.wait_running("app=queued", 3)  # the replacement got its network too
    check_pods_against_cns(node, pods)
    assert len(assigned_by_pod(node)) == 3
    node.kubectl("delete", "deployment/queued")
    node.wait_gone("app=queued")
    node.wait(lambda: not assigned_by_pod(node), "every IP released")


def check_live_sandboxes_keep_their_ips(node: KubeNode) -> int:
    """Every ready sandbox containerd has: its IP is assigned in cns to exactly that sandbox.
    Returns how many were checked."""
    assert node.daemon is not None and node.containerd is not None
    owner = {ip["address"]: ip["owner"] for ip in node.daemon.ips() if ip.get("owner")}
    checked = 0
    with node.containerd.client() as cri:
        for sandbox in cri.list_pod_sandboxes():
            if sandbox.state != cri.pb.SANDBOX_READY:
                continue
            address = cri.pod_ip(sandbox.id)
            held = owner.get(address)
            assert held is not None and held["containerID"] == sandbox.id, (sandbox, held)
            checked += 1
    return checked


def sandbox_of(node: KubeNode, pod: str) -> str:
    assert node.daemon is not None
    (sandbox,) = [
        ip["owner"]["containerID"]
        for ip in node.daemon.ips()
        if (ip.get("owner") or {}).get("podName") == pod
    ]
    return str(sandbox)


def lose_dels_while_down(node: KubeNode, what: str, action: Callable[[], None]) -> None:
    """Stop the daemon, do `action` (the runtime's DELs are queued by cns-cni), wait until
    the runtime has no sandbox the action ends, throw the queued DELs away, start it again."""
    daemon, containerd = node.daemon, node.containerd
    assert daemon is not None and containerd is not None
    daemon.stop()
    action()
    queue = daemon.state_dir / "release-queue"
    lost = sorted(queue.iterdir()) if queue.exists() else []
    assert lost, f"{what}: no DEL was queued while the daemon was down"
    for entry in lost:
        entry.unlink()
    node.start_daemon()


def reclaimed(node: KubeNode, address: str) -> dict[str, Any] | None:
    assert node.daemon is not None
    (row,) = [ip for ip in node.daemon.ips() if ip["address"] == address]
    return row.get("reclaimed") if row.get("owner") is None else None


def check_reclaimed(node: KubeNode, *, reason: str, sandboxes: dict[str, str]) -> None:
    """The leak check took each address of `sandboxes` (address -> sandbox) back from its
    sandbox for `reason`, and counted them (the daemon was restarted just before: its counters
    start at 0)."""
    assert node.daemon is not None
    for address, sandbox in sandboxes.items():
        record = node.wait(
            lambda a=address: reclaimed(node, a), f"{address} reclaimed", timeout=120
        )
        assert (record["reason"], record["containerID"]) == (reason, sandbox), record
        assert record["suspectedSeconds"] >= LEAK_GRACE_SECONDS
    metrics = node.daemon.metrics()
    assert metrics[f'cns_ip_leaks_reclaimed_total{{reason="{reason}"}}'] == len(sandboxes)
    assert metric_sum(metrics, "cns_ip_leaks_reclaimed_total") == len(sandboxes)


def test_leaked_ips_come_back_and_no_live_pod_loses_its_ip(node: KubeNode) -> None:
    """Three ways a DEL never reaches cns (the daemon down, its queued DEL lost): a sandbox
    re-created, a pod deleted, a pod force-deleted. Each IP comes back with its reason; after
    every step every live sandbox still holds its own IP."""
    daemon, containerd = node.daemon, node.containerd
    assert daemon is not None and containerd is not None
    node.kube.apply(deployment("leaky", 4))
    pods = node.wait_running("app=leaky", 4)
    ips = check_pods_against_cns(node, pods)
    assert check_live_sandboxes_keep_their_ips(node) >= 4
    recreated, deleted, forced, _ = sorted(ips)

    # 1. The sandbox is removed behind the kubelet's back: it makes a new one, with a new IP.
    old_sandbox = sandbox_of(node, recreated)

    def remove_sandbox() -> None:
        with containerd.client() as cri:
            cri.stop(old_sandbox)
            cri.remove(old_sandbox)

    lose_dels_while_down(node, "sandbox re-created", remove_sandbox)
    check_reclaimed(node, reason="sandbox-replaced", sandboxes={ips[recreated]: old_sandbox})
    check_pods_against_cns(node, node.wait_running("app=leaky", 4))
    assert check_live_sandboxes_keep_their_ips(node) >= 4

    # 2. A pod deleted and 3. a pod force-deleted, both gone from the runtime while cns is down:
    # in one outage: the kubelet often removes a dead pod's last container and sandbox only in
    # its garbage collection (once a minute), and one wait for it is enough.
    flags = {deleted: [], forced: ["--force", "--grace-period=0"]}
    sandboxes = {pod: sandbox_of(node, pod) for pod in flags}

    def delete() -> None:
        for pod, pod_flags in flags.items():
            node.kubectl("delete", "pod", pod, "--wait=false", *pod_flags)

        def gone() -> bool:
            # The pods too, not only their sandboxes: a pod still in the API (being deleted)
            # makes its leak "pod-ended", not "pod-gone".
            if {p["metadata"]["name"] for p in node.pods("app=leaky")} & set(flags):
                return False
            with containerd.client() as cri:
                return not set(sandboxes.values()) & {s.id for s in cri.list_pod_sandboxes()}

        node.wait(gone, "both pods and their sandboxes removed", timeout=180)

    lose_dels_while_down(node, "pods deleted, one by force", delete)
    check_reclaimed(
        node, reason="pod-gone", sandboxes={ips[pod]: sandboxes[pod] for pod in sandboxes}
    )
    check_pods_against_cns(node, node.wait_running("app=leaky", 4))
    assert check_live_sandboxes_keep_their_ips(node) >= 4

    assert daemon.metrics()["cns_ip_leak_suspects"] == 0
    node.kubectl("delete", "deployment/leaky")
    node.wait_gone("app=leaky")
    node.wait(lambda: not assigned_by_pod(node), "every IP released")


def test_daemon_restart_during_rollout_leaves_every_pod_networked(node: KubeNode) -> None:
    daemon = node.daemon
    assert daemon is not None and daemon.proc is not None
    node.kube.apply(deployment("roll", 10))
    node.wait_running("app=roll", 10)
    node.kubectl("rollout", "restart", "deployment/roll")
    time.sleep(1.0)  # the rollout is under way: old pods going, new ones coming
    daemon.stop(signal.SIGKILL)
    time.sleep(2.0)
    node.start_daemon()
    # The state file checked by the world at the start: containerd's sandboxes and the API's
    # pods, both asked, and no address a live pod holds is another's in the state file.
    world = node.wait(
        lambda: (w := daemon.pool()["worldCheck"])["state"] == "done" and w, "the world check"
    )
    assert world["sources"] == {"cri": "checked", "api": "checked"}, world
    assert world["outcomes"].get("conflict", 0) == 0 and world["outcomes"]["fine"] >= 1, world
    node.kubectl("rollout", "status", "deployment/roll", "--timeout=240s", timeout=250)
    node.wait(lambda: len(node.pods("app=roll")) == 10, "old pods gone", timeout=120)
    pods = node.wait_running("app=roll", 10)
    ips = check_pods_against_cns(node, pods)
    # No IP held by a pod that is gone, and every new pod has a working interface.
    node.wait(lambda: set(assigned_by_pod(node)) == set(ips), "only live pods hold IPs")
    for name, ip in ips.items():
        assert ping(ip).returncode == 0, f"{name} at {ip} has no network"
    node.kubectl("delete", "deployment/roll")
    node.wait_gone("app=roll")
    node.wait(lambda: not assigned_by_pod(node), "every IP released")


FURTHER = {"blue": "10.246.0.0/24", "tiny": "10.247.0.0/28"}  # tiny: 12 pod addresses at most


def namespace_of(name: str, subnets: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "annotations": {"acn.azure.com/subnets": subnets}},
    }


def running_ips(node: KubeNode, namespace: str, selector: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in node.pods(selector, namespace)
        if p["status"].get("phase") == "Running" and p["status"].get("podIP")
    }


def sandbox_failures(node: KubeNode, namespace: str) -> list[str]:
    events = node.kube.request("GET", f"/api/v1/namespaces/{namespace}/events").json
    return [
        str(e.get("message"))
        for e in events.get("items") or []
        if e.get("reason") == "FailedCreatePodSandBox"
    ]


def test_namespaces_choose_their_subnets_and_one_running_out_spares_the_other(
    node: KubeNode,
) -> None:
    """Two namespaces annotated `acn.azure.com/subnets` with two further subnets: their pods
    get addresses of those subnets only (the daemon asks for each subnet for its pods, the
    controller grants a network container of each). The small one runs out (exhausted, which
    the daemon reads from its ClusterSubnetState), and the other's pods keep getting addresses.
    A malformed annotation fails the pod's ADD with code 7 naming it; a subnet that does not
    exist is asked for, and the ADD fails with code 11 naming it."""
    daemon = node.daemon
    assert daemon is not None
    node.start_cns_controller(subnet="")  # every ClusterSubnet: the further ones too
    try:
        for name, cidr in FURTHER.items():
            node.kube.apply(
                {
                    "apiVersion": "acn.azure.com/v1alpha1",
                    "kind": "ClusterSubnet",
                    "metadata": {"name": name},
                    "spec": {"subnet": cidr, "scaler": {"batchSize": 4}},
                }
            )
        for name in FURTHER:
            node.kube.apply(namespace_of(f"ns-{name}", name))
            node.kube.apply(deployment(name, 3 if name == "blue" else 16, namespace=f"ns-{name}"))
        for name, subnets in (("bad", "Blue"), ("nowhere", "nowhere")):
            node.kube.apply(namespace_of(f"ns-{name}", subnets))
            node.kube.apply(deployment(name, 1, namespace=f"ns-{name}"))

        blue = check_pods_against_cns(node, node.wait_running("app=blue", 3, namespace="ns-blue"))
        assert all(ip.startswith("10.246.0.") for ip in blue.values()), blue
        node.wait(
            lambda: (node.kube.get("acn.azure.com/v1alpha1", "ClusterSubnetState", "tiny")
                     .get("status") or {}).get("exhausted") is True,
            "tiny exhausted", timeout=120,
        )  # fmt: skip
        node.wait(
            lambda: daemon.pool()["subnets"]["tiny"]["subnetExhausted"],
            "the daemon to read tiny's exhaustion",
        )
        tiny = node.wait(
            lambda: len(ips := running_ips(node, "ns-tiny", "app=tiny")) >= 8 and ips,
            "tiny's pods to fill it",
            timeout=120,
        )
        assert all(ip.startswith("10.247.0.") for ip in tiny.values()), tiny
        assert len(tiny) < 16  # it holds no more

        # Blue's pods keep getting addresses while tiny is out of them.
        node.kubectl("scale", "deployment/blue", "--replicas=6", "-n", "ns-blue")
        pods = node.wait_running("app=blue", 6, namespace="ns-blue")
        blue = check_pods_against_cns(node, pods)
        assert all(ip.startswith("10.246.0.") for ip in blue.values()), blue
        lane = node.wait(
            lambda: (lane := daemon.pool()["subnets"]["blue"])["podDemand"] == 6 and lane,
            "blue's pod demand",
        )
        assert not lane["subnetExhausted"] and lane["scalerBatchSize"] == 4  # its ClusterSubnet
        for name, ip in blue.items():
            assert ping(ip).returncode == 0, f"node cannot reach {name} at {ip}"

        failures = node.wait(lambda: sandbox_failures(node, "ns-bad"), "the bad pod's failure")
        assert any(
            "annotation acn.azure.com/subnets='Blue' of namespace ns-bad" in f for f in failures
        ), failures
        assert daemon.log().count('"subnets_annotation_invalid"') == 1
        # A subnet no ClusterSubnet has: asked for (its pod's demand), then code 11 naming it.
        asked = [entry["name"] for entry in node.nnc()["spec"].get("subnets") or []]
        assert "nowhere" in asked, asked
        failures = node.wait(lambda: sandbox_failures(node, "ns-nowhere"), "nowhere's failure")
        assert any("no free IP of subnet nowhere" in f for f in failures), failures
    finally:
        for name in (*FURTHER, "bad", "nowhere"):
            node.kubectl("delete", "namespace", f"ns-{name}", "--wait=false")
        for name in (*FURTHER, "bad", "nowhere"):
            node.wait_gone(f"app={name}", namespace=f"ns-{name}")
        node.wait(lambda: not assigned_by_pod(node), "every IP released")
        node.start_cns_controller()


def test_subnet_scarcity_flips_to_batch_one_and_every_pod_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A /26 (61 usable IPs) cannot hold 45 pods at batch 16 (64 IPs) but can at batch 1 (47)."""
    require_node()
    replicas = 45
    # At batch 1 under exhaustion the node keeps one free secondary IP: 45 + 1, plus the primary.
    assert formula(replicas) + 1 > 61 >= replicas + 2
    before = host_state()
    bin_dir = binaries()
    assert bin_dir is not None
    kube = KubeCluster.start(bin_dir)
    try:
        workdir = Path(tmp_path_factory.mktemp("scarce"))
        node = KubeNode.start(
            kube,
            workdir,
            subnet_cidr="10.252.0.0/26",
            scaler={"batchSize": BATCH},
            max_pods=replicas + 5,
        )
        try:
            history = NncHistory(node)
            node.kube.apply(deployment("scarce", replicas))
            pods = node.wait_running("app=scarce", replicas, timeout=300)
            check_pods_against_cns(node, pods)
            css = kube.get("acn.azure.com/v1alpha1", "ClusterSubnetState", "pods")
            assert css["status"]["exhausted"] is True
            assert node.daemon is not None
            metrics = node.daemon.get("/metrics")
            assert "cns_subnet_exhausted 1.0" in metrics
            # Idle IPs went back through the handshake, and the node settled at batch 1.
            assert history.max_ips_not_in_use() > 0
            node.wait(lambda: node.nnc()["spec"].get("requestedIPCount") == replicas + 1,
                 "request at batch 1: one free IP")  # fmt: skip
            node.wait(lambda: not node.nnc()["spec"].get("ipsNotInUse"), "handshake completed")
        finally:
            node.stop()
            assert node.leftovers() == []
    finally:
        kube.stop()
    assert host_state() == before


def docs_cluster_walkthrough(workdir: Path) -> str:
    """The shell blocks of docs/kubernetes.md that use `make cluster-up`'s cluster, as a script
    for the cluster in `workdir` (started already)."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    blocks: list[str] = re.findall(r"```sh\n(.*?)```", text, re.S)
    tour = [b for b in blocks if b.startswith("make cluster-up\n")]
    recipe = [b for b in blocks if "kind: Deployment" in b]
    assert len(tour) == 1 and len(recipe) == 1, "docs/kubernetes.md lost its cluster walkthrough"
    script = tour[0].removeprefix("make cluster-up\n") + recipe[0]
    return f"cd {REPO}\n" + script.replace("/var/tmp/cns-cluster", str(workdir))


def test_cluster_up_and_down_entry_points(tmp_path: Path) -> None:
    """`make cluster-up`/`cluster-down` (tests.harness.cluster_cli): a Ready node on which the
    walkthrough of docs/kubernetes.md works as written (`cns status` finds the cluster's daemon,
    INTERNAL-IP 127.0.0.1, `kubectl exec`, a Deployment scaled in one request), then the host
    unchanged."""
    require_node()
    before = host_state()
    command = [sys.executable, "-m", "tests.harness.cluster_cli"]
    up = run([*command, "up", "--dir", tmp_path, "--subnet", "10.253.0.0/24"], timeout=330)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"source {tmp_path / 'env'}" in up.stdout, up.stdout
        info = json.loads((tmp_path / "ready").read_text())
        nodes = run([info["kubectl"], f"--kubeconfig={info['kubeconfig']}", "get", "nodes"])
        assert "node1" in nodes.stdout and " Ready " in nodes.stdout, nodes.stdout + nodes.stderr
        script = tmp_path / "walkthrough.sh"
        script.write_text(docs_cluster_walkthrough(tmp_path))
        walk = run(["bash", "-e", script], input="", timeout=300)
        output = walk.stdout + walk.stderr
        assert walk.returncode == 0, output
        node_lines = [line for line in walk.stdout.splitlines() if line.startswith("node1 ")]
        wide, nnc = node_lines[0], node_lines[-1]  # `get nodes -o wide` first, `get nnc` last
        assert wide.split()[5] == "127.0.0.1", wide  # INTERNAL-IP
        assert re.search(r"^requestedIPCount +15$", walk.stdout, re.M), output  # `cns status`
        demo = re.search(r"^(10\.253\.0\.\d+) +Assigned .* default/demo$", walk.stdout, re.M)
        assert demo, output  # `cns status --ips`
        assert f"inet {demo.group(1)}/32" in walk.stdout, output  # `kubectl exec`: the same IP
        assert nnc.split()[1] == str(formula(20)), nnc  # the burst of 20 pods: one request, 31
    finally:
        down = run([*command, "down", "--dir", tmp_path], timeout=200)
    assert down.returncode == 0, down.stdout + down.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["walkthrough.sh"]  # only the test's
    assert host_state() == before
