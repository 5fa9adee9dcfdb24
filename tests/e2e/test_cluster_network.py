"""Pods across the nodes of one real multi-node cluster (tests/harness/multinode.py): three
nodes, each with its own network stack, containerd, kubelet, kube-proxy and the cns DaemonSet
pod, on one bridge, in the flat-network mode (docs/networking.md). Root only.

Every test here shares the session's `cns-cni` cluster (`cluster`, tests/e2e/conftest.py), the
dual-stack one (every pod IPv4 and IPv6), and leaves it as it found it: its Deployments and
Services are deleted, its nodes run again. The Service has both families and answers on both
cluster IPs; the scaled Deployment's audit covers both: all an IPv4-only cluster would check.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.core.requested import POD_ADDRESS_ANNOTATION
from tests.harness.fleet import DuplicateWatch, addresses
from tests.harness.host import run
from tests.harness.kube_api import CS_API
from tests.harness.kube_node import deployment
from tests.harness.multinode import (
    CNS,
    DUAL_STACK,
    PING_TRIES,
    SUBNET6_NAME,
    SUBNET_NAME,
    ClusterNode,
    MultiNodeCluster,
    is_ready,
    neighbour_report,
    pod_ips,
    spread,
    unreachable,
)
from tests.harness.podman import build_pause_archive

HTTP_PORT = 8080
CNS_COMMAND = Path(sys.executable).parent / "cns"  # the operator's, on the host
# An HTTP GET from a node (the host's python3: its static busybox's wget crashes resolving).
FETCH = (
    "import sys, urllib.request; "
    "print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode().strip())"
)
# The workload image's busybox serving its pod's name over HTTP.
SERVE_NAME = "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www"


def with_command(body: dict[str, Any], command: list[str] | None) -> dict[str, Any]:
    if command is not None:
        body["spec"]["template"]["spec"]["containers"][0]["command"] = command
    return body


@contextlib.contextmanager
def running(
    cluster: MultiNodeCluster, name: str, replicas: int, command: list[str] | None = None
) -> Iterator[list[dict[str, Any]]]:
    """A spread Deployment, its pods Running; deleted (and its pods gone) afterwards."""
    cluster.kube.apply(with_command(spread(name, replicas), command))
    try:
        yield cluster.wait_running(f"app={name}", replicas)
    finally:
        cluster.kubectl("delete", "deployment", name, "--wait=false")
        cluster.wait_gone(f"app={name}")


def url_host(ip: str) -> str:
    """`ip` as the host part of a URL (an IPv6 address in brackets)."""
    return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip


def first_unreachable(
    cluster: MultiNodeCluster, pods: list[dict[str, Any]], *, tries: int = PING_TRIES
) -> list[str]:
    """The addresses of `pods[1:]` that `pods[0]` cannot ping (`unreachable`)."""
    node = cluster.node(pods[0]["spec"]["nodeName"])
    targets = [p["status"]["podIP"] for p in pods[1:]]
    return unreachable(node, pods[0]["metadata"]["name"], targets, tries=tries)


@pytest.mark.parametrize("cluster", [DUAL_STACK], indirect=True)
def test_a_cluster_ip_service_backed_by_every_node_answers_from_every_node(
    cluster: MultiNodeCluster,
) -> None:
    """On the dual-stack cluster the Service has a cluster IP of each family (1.20's
    `ipFamilyPolicy: PreferDualStack`), and each answers from every node with every backend."""
    spec: dict[str, Any] = {
        "selector": {"app": "names"},
        "ports": [{"port": 80, "targetPort": HTTP_PORT, "protocol": "TCP"}],
    }
    if cluster.dual_stack:
        spec |= {"ipFamilyPolicy": "PreferDualStack", "ipFamilies": ["IPv4", "IPv6"]}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "names", "namespace": "default"},
        "spec": spec,
    }
    with running(cluster, "names", 3, ["/bin/sh", "-c", SERVE_NAME]) as pods:
        cluster.kube.apply(service)
        try:
            cluster_ips = cluster.kube.request(
                "GET", "/api/v1/namespaces/default/services/names"
            ).json["spec"]["clusterIPs"]
            versions = [ipaddress.ip_address(ip).version for ip in cluster_ips]
            assert versions == [s.version for s in cluster.subnets.values()], cluster_ips
            backends = {p["metadata"]["name"] for p in pods}
            for node, cluster_ip in itertools.product(cluster.nodes, cluster_ips):
                url = f"http://{url_host(cluster_ip)}/"
                seen: set[str] = set()
                deadline = time.monotonic() + 60
                while seen != backends and time.monotonic() < deadline:
                    answer = node.host.run("python3", "-c", FETCH, url, check=False)
                    if answer.returncode == 0:
                        seen.add(answer.stdout.strip())
                assert seen == backends, (node.name, cluster_ip, seen, backends)
        finally:
            cluster.kubectl("delete", "service", "names")


@pytest.mark.parametrize("cluster", [DUAL_STACK], indirect=True)
def test_a_deployment_scaled_across_nodes_never_shares_an_address(
    cluster: MultiNodeCluster,
) -> None:
    """On the dual-stack cluster every pod has one address of each family, and neither family
    has an address on two nodes or a node's own (IPv6 grants pass the nodes' fd00:123::1<N>)."""
    watch = DuplicateWatch(cluster.kube)
    watch.start()
    families = [subnet.version for subnet in cluster.subnets.values()]
    try:
        with running(cluster, "scaled", 6) as pods:
            for replicas in (30, 3, 24):
                cluster.kubectl("scale", "deployment", "scaled", f"--replicas={replicas}")
                pods = cluster.wait_running("app=scaled", replicas, timeout=300)
                for pod in pods:
                    assert [ipaddress.ip_address(a).version for a in pod_ips(pod)] == families
                ips = [ip for p in pods for ip in pod_ips(p)]
                assert len(set(ips)) == len(ips), sorted(ips)
                if replicas > len(cluster.nodes):
                    # Scaled up: spread over every node. (Scaled down to 3, the ReplicaSet may
                    # keep them on fewer: its ranking of equal pods is no spread.)
                    nodes = {p["spec"]["nodeName"] for p in pods}
                    assert nodes == {n.name for n in cluster.nodes}, nodes
            nncs = cluster.kube.request(
                "GET", "/apis/acn.azure.com/v1alpha/namespaces/kube-system/nodenetworkconfigs"
            ).json["items"]
            granted = {ipaddress.ip_address(a) for nnc in nncs for a in addresses(nnc)}
            never = {ipaddress.ip_address(a) for a in cluster.gateways}
            never |= {ipaddress.ip_address(a) for n in cluster.nodes for a in n.addresses}
            assert never.isdisjoint(granted), sorted(never & granted)
            assert all(any(a in s for s in cluster.subnets.values()) for a in granted)
            for version in families:  # granted past the nodes' addresses: they were skipped
                assert max(a for a in granted if a.version == version) > max(
                    a for a in never if a.version == version
                ), sorted(granted)
            # The operator's whole-cluster check agrees: records, NNCs and pods consistent.
            check = run([CNS_COMMAND, "ipam", "check", "-o", "json",
                         "--kubeconfig", cluster.kubeconfig], timeout=60)  # fmt: skip
            assert check.returncode == 0, check.stdout + check.stderr
    finally:
        watch.stop.set()
        watch.join(timeout=30)
    assert watch.events > 0
    assert not watch.duplicates, watch.duplicates[:10]


def test_the_cns_pod_of_one_node_restarted_while_the_others_serve(
    cluster: MultiNodeCluster,
) -> None:
    victim = cluster.nodes[-1]
    cns_pods = cluster.pods("app.kubernetes.io/name=cns", namespace="kube-system")
    old = next(p for p in cns_pods if p["spec"]["nodeName"] == victim.name)
    with running(cluster, "during", 2):
        cluster.kubectl(
            "delete", "pod", "-n", "kube-system", old["metadata"]["name"], "--wait=false"
        )
        # The others keep serving: scaled up while the victim's daemon is away.
        cluster.kubectl("scale", "deployment", "during", "--replicas=6")
        pods = cluster.wait_running("app=during", 6, timeout=300)
        assert len({p["status"]["podIP"] for p in pods}) == 6

        def replaced() -> bool:
            live = cluster.pods("app.kubernetes.io/name=cns", namespace="kube-system")
            return any(
                p["spec"].get("nodeName") == victim.name  # none yet while it is being scheduled
                and p["metadata"]["uid"] != old["metadata"]["uid"]
                and p["status"].get("phase") == "Running"
                for p in live
            )

        cluster.kube.wait_for(replaced, timeout=120, what=f"a new cns pod on {victim.name}")
        assert not first_unreachable(cluster, pods)


def test_a_whole_node_stopped_and_started_again_while_the_others_serve(
    cluster: MultiNodeCluster,
) -> None:
    victim = cluster.nodes[-1]
    with whole_afterwards(cluster, victim), running(cluster, "steady", 3) as before:
        stopped_at = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        mac = victim.host.uplink_mac()
        victim.stop()  # its kubelet, containerd (every sandbox), kube-proxy and namespaces
        serve_elsewhere(cluster, victim)
        start_again(cluster, victim)
        # As a NIC's across a reboot: a new MAC leaves the others' neighbour entries stale.
        assert victim.host.uplink_mac() == mac

        def restarted(pods: list[dict[str, Any]]) -> bool:
            """Every pod Running, the victim's in a sandbox made since the stop."""
            return len(pods) == 3 and all(
                p["status"].get("phase") == "Running"
                and (p["spec"]["nodeName"] != victim.name or started_since(p, stopped_at))
                for p in pods
            )

        after = cluster.wait_pods("app=steady", restarted, "the victim's pod again", 300)
        ips = [p["status"]["podIP"] for p in after]
        assert len(set(ips)) == 3, ips
        assert {p["spec"]["nodeName"] for p in after} == {n.name for n in cluster.nodes}
        missed = first_unreachable(cluster, after)
        if missed:  # how the neighbours saw it, and whether it answers a little later
            report = neighbour_report(cluster, missed)
            time.sleep(10)
            later = first_unreachable(cluster, after)
            raise AssertionError(f"{missed} unreachable; 10 s later: {later}\n{report}")
        kept = {p["metadata"]["name"]: p["status"]["podIP"] for p in before}
        for pod in after:  # the other nodes' pods kept their addresses throughout
            if pod["spec"]["nodeName"] != victim.name:
                assert kept[pod["metadata"]["name"]] == pod["status"]["podIP"]


def started_since(pod: dict[str, Any], moment: datetime.datetime) -> bool:
    for status in pod["status"].get("containerStatuses") or []:
        started = ((status.get("state") or {}).get("running") or {}).get("startedAt")
        if started and datetime.datetime.fromisoformat(started.replace("Z", "+00:00")) >= moment:
            return True
    return False


def start_again(cluster: MultiNodeCluster, node: ClusterNode) -> None:
    """The stopped node booted again: an empty /run, then its namespaces, containerd, kubelet and
    kube-proxy over the directories it kept (its cns state among them); back once it is Ready with
    a Ready cns pod (its logs in the error if not)."""
    node.forget_run_state()
    node.start_namespaces()
    node.start_runtime([build_pause_archive(cluster.workdir / "images"), cluster.image[1]])
    node.start_agents()
    try:
        cluster.wait(lambda: serving(cluster, node), f"{node.name} Ready again", timeout=180)
    except Exception as error:
        raise AssertionError(f"{error}\n{node.log_tail(40)}") from error


def serving(cluster: MultiNodeCluster, node: ClusterNode) -> bool:
    """`node` runs, its Node is Ready, its cns pod too, and its containerd answers."""
    if not node.up or node.containerd is None:
        return False
    # A DaemonSet pod has no nodeName until the scheduler binds it (Kubernetes 1.20).
    cns = [p for p in cluster.pods(CNS, "kube-system") if p["spec"].get("nodeName") == node.name]
    nodes = cluster.kube.request("GET", "/api/v1/nodes").json["items"]
    if not (
        cns
        and all(is_ready(p) for p in cns)
        and any(is_ready(n) for n in nodes if n["metadata"]["name"] == node.name)
    ):
        return False
    try:
        return node.containerd.ctr("version").returncode == 0
    except subprocess.TimeoutExpired:
        return False


@contextlib.contextmanager
def whole_afterwards(cluster: MultiNodeCluster, node: ClusterNode) -> Iterator[None]:
    """For a test that stops, drains or deletes `node`: afterwards, passed or failed, the node
    serves again (started again as after a reboot if it is not serving, uncordoned), so that one
    failure cannot take the session's later tests on this cluster with it."""
    try:
        yield
    finally:
        if not serving(cluster, node):
            if node.up:  # left running but broken: a reboot
                print(f"{node.name} not serving after the test:\n{node.log_tail(40)}")
                node.stop()
            start_again(cluster, node)
        cluster.kubectl("uncordon", node.name)


def serve_elsewhere(cluster: MultiNodeCluster, away: ClusterNode) -> None:
    """While `away` is down: a Deployment on the other nodes starts, gets unique addresses."""
    body = spread("meanwhile", 4)
    body["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "NotIn",
                         "values": [away.name]}
                    ]}
                ]
            }
        }
    }  # fmt: skip
    cluster.kube.apply(body)
    try:
        pods = cluster.wait_running("app=meanwhile", 4)
        assert len({p["status"]["podIP"] for p in pods}) == 4
    finally:
        cluster.kubectl("delete", "deployment", "meanwhile", "--wait=false")
        cluster.wait_gone("app=meanwhile")


def nnc_addresses(cluster: MultiNodeCluster) -> dict[str, set[str]]:
    nncs = cluster.kube.request(
        "GET", "/apis/acn.azure.com/v1alpha/namespaces/kube-system/nodenetworkconfigs"
    ).json["items"]
    return {nnc["metadata"]["name"]: set(addresses(nnc)) for nnc in nncs}


def test_a_drained_and_deleted_node_gives_its_addresses_to_the_others(
    cluster: MultiNodeCluster,
) -> None:
    """Node3 drained, stopped and deleted (a machine taken out of the cluster): its NNC goes
    with the Node, its addresses go back to the subnet and, lowest first, to the nodes that grow;
    a pod on node1 that asks for one of node3's pods' addresses (`acn.azure.com/ip-address`) gets
    it and answers at once from node2, which had cached node3's MAC for it (the announcement).
    Node3 joins again afterwards (a new Node), so the session's cluster is whole."""
    victim = cluster.nodes[-1]
    mover, watching = [node for node in cluster.nodes if node is not victim]
    with whole_afterwards(cluster, victim), running(cluster, "leaving", 6) as pods:
        on_victim = [p for p in pods if p["spec"]["nodeName"] == victim.name]
        # A pod on node2 talks to the victim's pods: node2 caches node3's MAC for them.
        (watcher, *_) = [p for p in pods if p["spec"]["nodeName"] == watching.name]
        assert not first_unreachable(cluster, [watcher, *on_victim])
        held = nnc_addresses(cluster)[victim.name]
        cluster.kubectl("drain", victim.name, "--ignore-daemonsets", "--delete-local-data",
                        "--force", "--timeout=120s", timeout=150)  # fmt: skip
        victim.stop()
        cluster.kubectl("delete", "node", victim.name)
        cluster.wait(lambda: victim.name not in nnc_addresses(cluster),
                     f"{victim.name}'s NNC gone with its Node", timeout=120)  # fmt: skip
        # One of its pods' addresses moves to node1, asked for by name.
        address = on_victim[0]["status"]["podIP"]
        body = pinned("moved", 1, mover, "default")
        body["spec"]["template"]["metadata"]["annotations"] = {POD_ADDRESS_ANNOTATION: address}
        cluster.kube.apply(body)
        try:
            (moved,) = cluster.wait_running("app=moved", 1, timeout=180)
            assert moved["status"]["podIP"] == address, moved["status"]
            # At once: within two pings, before node2's stale entry would be probed anew.
            assert not first_unreachable(cluster, [watcher, moved], tries=2)
        finally:
            cluster.kubectl("delete", "deployment", "moved", "--wait=false")
            cluster.wait_gone("app=moved")
        # The others grow until they hold more of the victim's former addresses.
        cluster.kubectl("scale", "deployment", "leaving", "--replicas=40")
        regranted: set[str] = set()

        def some_regranted() -> bool:
            nonlocal regranted
            regranted = (held - {address}) & set().union(*nnc_addresses(cluster).values())
            return bool(regranted)

        cluster.wait(some_regranted, "a former address of node3 granted again", timeout=180)
        now = cluster.wait_running("app=leaving", 40, timeout=300)
        ips = [p["status"]["podIP"] for p in now]
        assert len(set(ips)) == len(ips)
        print(f"{address} moved to {mover.name}; regranted {sorted(regranted)}")


SCARCE = ipaddress.ip_network("10.124.0.0/28")  # 13 usable, off the LAN: pods of one node only


def pinned(name: str, replicas: int, node: ClusterNode, namespace: str) -> dict[str, Any]:
    body = deployment(name, replicas, namespace=namespace)
    body["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    return body


def sandbox_failures(cluster: MultiNodeCluster, namespace: str, prefix: str) -> list[str]:
    """The kubelets' FailedCreatePodSandBox messages for pods named `prefix`*."""
    events = cluster.kube.get("v1", "Event", namespace=namespace)
    return [
        e.get("message") or ""
        for e in events.get("items") or []
        if e.get("reason") == "FailedCreatePodSandBox"
        and e["involvedObject"]["name"].startswith(prefix)
    ]


def test_subnet_exhaustion_across_nodes_adds_wait_then_succeed_as_pods_leave_elsewhere(
    cluster: MultiNodeCluster,
) -> None:
    """A small second ClusterSubnet, batch 1, drawn from by one namespace (its annotation
    `acn.azure.com/subnets`): node1's pods hold part of it, node2 asks for more than is left.
    The subnet becomes exhausted, node2's extra ADDs wait and fail with code 11 naming the
    subnet (the kubelet retries them), and once node1's pods leave, their addresses go back and
    node2's pods get them. No address is ever on two nodes. The subnet's network containers stay
    on the nodes' NNCs afterwards (a deleted ClusterSubnet leaves them: docs/kubernetes.md)."""
    first, second = cluster.nodes[0], cluster.nodes[1]
    namespace = "scarce"
    cluster.kube.apply(
        {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": namespace},
         "spec": {"subnet": str(SCARCE), "gateway": str(SCARCE[1]),
                  "scaler": {"batchSize": 1}}}
    )  # fmt: skip
    cluster.kube.apply(
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": namespace, "annotations": {"acn.azure.com/subnets": namespace}}}
    )  # fmt: skip
    watch = DuplicateWatch(cluster.kube)
    watch.start()
    try:
        capacity = cluster.wait(lambda: scarce_status(cluster).get("capacity"), "its capacity")
        cluster.kube.apply(pinned("holder", 4, first, namespace))
        held = cluster.wait_running("app=holder", 4, namespace=namespace)
        before = {p["status"]["podIP"] for p in held}
        assert all(ipaddress.ip_address(ip) in SCARCE for ip in before), before
        # node1 holds its 4, one spare and a primary IP: node2 (a primary IP too) cannot get
        # capacity - 5 addresses while they are there, and can once they are gone.
        wanted = capacity - 5
        cluster.kube.apply(pinned("waiter", wanted, second, namespace))
        cluster.wait(
            lambda: scarce_status(cluster, "ClusterSubnetState").get("exhausted") is True,
            "the ClusterSubnetState exhausted",
            120,
        )
        cluster.wait(
            lambda: any(f"no free IP of subnet {namespace}" in m
                        for m in sandbox_failures(cluster, namespace, "waiter-")),
            "an ADD on node2 that waited for an address and failed", timeout=120,
        )  # fmt: skip
        running = [p for p in cluster.pods("app=waiter", namespace) if p["status"].get("podIP")]
        assert len(running) < wanted, running
        cluster.kubectl("scale", "-n", namespace, "deployment", "holder", "--replicas=0")
        pods = cluster.wait_running("app=waiter", wanted, timeout=180, namespace=namespace)
        ips = [p["status"]["podIP"] for p in pods]
        assert len(set(ips)) == wanted and all(ipaddress.ip_address(i) in SCARCE for i in ips)
        assert before & set(ips), (sorted(before), sorted(ips))  # node1's went to node2
    finally:
        watch.stop.set()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        cluster.wait_gone("", namespace=namespace)
        cluster.kubectl("delete", "clustersubnet", namespace)
        watch.join(timeout=30)
    assert watch.events > 0
    assert not watch.duplicates, watch.duplicates[:10]


def scarce_status(cluster: MultiNodeCluster, kind: str = "ClusterSubnet") -> dict[str, Any]:
    """The small subnet's ClusterSubnet status (capacity, reserved, exhausted), or its
    ClusterSubnetState's (what the daemons follow)."""
    return cluster.kube.get(CS_API, kind, "scarce").get("status") or {}


def web_in(cluster: MultiNodeCluster, namespace: str) -> dict[str, str]:
    """A spread Deployment `web` of 6 pods in `namespace`, once Running: pod -> its IP."""
    body = spread("web", 6)
    body["metadata"]["namespace"] = namespace
    cluster.kube.apply(body)
    pods = cluster.wait_running("app=web", 6, namespace=namespace)
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}


def rolled(cluster: MultiNodeCluster, namespace: str) -> list[dict[str, Any]]:
    """`web` in `namespace` rolled (`kubectl rollout restart`): its new pods, once Running."""
    cluster.kubectl("rollout", "restart", "deployment/web", "-n", namespace)
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace,
                    "--timeout=180s", timeout=200)  # fmt: skip
    return cluster.wait_running("app=web", 6, namespace=namespace)


def running_ips(cluster: MultiNodeCluster, namespace: str) -> dict[str, str]:
    """The IPs of `web`'s pods in `namespace` that have one and are not ending."""
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in cluster.pods("app=web", namespace)
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    }


MIGRATED_FROM = ipaddress.ip_network("10.126.0.0/27")  # off the LAN, as SCARCE
MIGRATED_TO = ipaddress.ip_network("10.126.0.32/27")


def test_a_subnet_drained_and_its_pods_rolled_to_another_keep_an_address_throughout(
    cluster: MultiNodeCluster,
) -> None:
    """docs/kubernetes.md's migration recipe on the cluster: a namespace's pods spread over the
    nodes in one ClusterSubnet; a second one made and chosen by the namespace's annotation; the
    first drained (`spec.draining`): the nodes give its free addresses back and its pods keep
    theirs, counted by node in its status; `kubectl rollout restart` moves every pod to the
    second; the first, with nothing held, deleted. No address is ever on two nodes."""
    namespace, old, new = "migrate", "mig-old", "mig-new"

    def subnet(name: str, network: ipaddress.IPv4Network) -> dict[str, Any]:
        return {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": name},
                "spec": {"subnet": str(network), "gateway": str(network[1])}}  # fmt: skip

    def choosing(name: str) -> dict[str, Any]:
        annotations = {"acn.azure.com/subnets": name}
        return {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": namespace, "annotations": annotations}}  # fmt: skip

    def drain() -> dict[str, Any] | None:
        status = cluster.kube.get(CS_API, "ClusterSubnet", old).get("status") or {}
        drained: dict[str, Any] | None = status.get("drain")
        return drained

    cluster.kube.apply(subnet(old, MIGRATED_FROM))
    cluster.kube.apply(choosing(old))
    watch = DuplicateWatch(cluster.kube)
    watch.start()
    try:
        before = web_in(cluster, namespace)
        assert all(ipaddress.ip_address(ip) in MIGRATED_FROM for ip in before.values()), before
        assert len({p["spec"]["nodeName"] for p in cluster.pods("app=web", namespace)}) == 3
        # 1-3: the new subnet, chosen by the namespace; the old one drained.
        cluster.kube.apply(subnet(new, MIGRATED_TO))
        cluster.kube.apply(choosing(new))
        cluster.kubectl("patch", "clustersubnet", old, "--type", "merge",
                        "-p", '{"spec": {"draining": true}}')  # fmt: skip
        # The nodes keep what the pods hold (two each) and give the rest back.
        held = cluster.wait(lambda: (d := drain()) and d["addressesHeld"] == 6 and d,
                            "the old subnet's free addresses given back", timeout=60)  # fmt: skip
        by_node = [{"name": node.name, "addressesHeld": 2} for node in cluster.nodes]
        assert held["nodes"] == by_node, held
        assert running_ips(cluster, namespace) == before  # nothing taken from a pod
        # 4: the roll; every new pod in the new subnet, the old ones' addresses go back.
        after = rolled(cluster, namespace)
        ips = [p["status"]["podIP"] for p in after]
        assert len(set(ips)) == 6 and all(ipaddress.ip_address(i) in MIGRATED_TO for i in ips)
        cluster.wait(lambda: (d := drain()) and d["addressesHeld"] == 0, "drained", timeout=120)
        # 5: nothing held: deleted.
        cluster.kubectl("delete", "clustersubnet", old)
    finally:
        watch.stop.set()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        cluster.wait_gone("", namespace=namespace)
        cluster.kubectl("delete", "clustersubnet", old, new, "--ignore-not-found")
        watch.join(timeout=30)
    assert watch.events > 0
    assert not watch.duplicates, watch.duplicates[:10]


OVERFLOW_TO = ipaddress.ip_network("10.126.0.64/27")  # off the LAN, as SCARCE


def test_a_drained_primary_sends_new_pods_to_its_overflow_subnet_without_annotations(
    cluster: MultiNodeCluster,
) -> None:
    """The migration recipe with overflow instead of annotations: a Deployment's pods in the
    nodes' primary subnet (the LAN); a new ClusterSubnet named as the primary's overflow subnet
    and the primary drained, both on the running cluster (no restart); `kubectl rollout
    restart` gives every new pod an address of the overflow subnet (its IPv6 one unchanged)
    while the old ones keep theirs until they end. Undone afterwards: the primary serves again,
    the overflow subnet is given back whole. The pods are dual-stack: their IPv6 subnet is
    not drained, and their IPv6 addresses stay its own. No address is ever on two nodes."""
    namespace, primary, spare = "overflow", SUBNET_NAME, "ov-spare"

    def patch_primary(spec: dict[str, Any]) -> None:
        cluster.kubectl("patch", "clustersubnet", primary, "--type", "merge",
                        "-p", json.dumps({"spec": spec}))  # fmt: skip

    def spare_held() -> int | None:
        """What the nodes hold of the overflow subnet for pods, once it is drained."""
        status = cluster.kube.get(CS_API, "ClusterSubnet", spare).get("status") or {}
        return (status.get("drain") or {}).get("addressesHeld")

    # Dual-stack pods that name the primary: it is theirs by name as by default.
    chosen = {"acn.azure.com/subnets": f"{primary},{SUBNET6_NAME}"}
    cluster.kube.apply({"apiVersion": "v1", "kind": "Namespace",
                        "metadata": {"name": namespace, "annotations": chosen}})  # fmt: skip
    watch = DuplicateWatch(cluster.kube)
    watch.start()
    try:
        before = web_in(cluster, namespace)
        assert not any(ipaddress.ip_address(ip) in OVERFLOW_TO for ip in before.values())
        assert all(len(pod_ips(p)) == 2 for p in cluster.pods("app=web", namespace))
        cluster.kube.apply({
            "apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": spare},
            "spec": {"subnet": str(OVERFLOW_TO), "gateway": str(OVERFLOW_TO[1]),
                     "nodeSelector": {"matchLabels": {"cns-primary": spare}}},
        })  # fmt: skip
        patch_primary({"overflow": [spare], "draining": True})
        assert running_ips(cluster, namespace) == before  # nothing taken from a pod
        after = rolled(cluster, namespace)
        ips = [p["status"]["podIP"] for p in after]
        assert len(set(ips)) == 6 and all(ipaddress.ip_address(i) in OVERFLOW_TO for i in ips)
        sixes = [ip for p in after for ip in pod_ips(p) if ipaddress.ip_address(ip).version == 6]
        assert len(set(sixes)) == 6  # each pod's IPv6 address from its own subnet, as before
        # Undone: the primary serves again; the pods end; the overflow subnet, drained, is
        # given back whole by every node.
        patch_primary({"overflow": None, "draining": None})
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        cluster.wait_gone("", namespace=namespace)
        cluster.kubectl("patch", "clustersubnet", spare, "--type", "merge",
                        "-p", '{"spec": {"draining": true}}')  # fmt: skip
        cluster.wait(lambda: spare_held() == 0, "the overflow subnet given back", timeout=60)
    finally:
        with contextlib.suppress(Exception):
            patch_primary({"overflow": None, "draining": None})
        watch.stop.set()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")
        cluster.wait_gone("", namespace=namespace)
        cluster.kubectl("delete", "clustersubnet", spare, "--ignore-not-found")
        watch.join(timeout=30)
    assert watch.events > 0
    assert not watch.duplicates, watch.duplicates[:10]
