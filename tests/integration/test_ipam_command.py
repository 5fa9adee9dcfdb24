"""`cns ipam check / show / release` against a real kube-apiserver, with the real controller
granting the addresses and each kind of inconsistency then made on purpose: a duplicate across
two NNCs, a leaked record entry, a pod whose address no record holds, a stale record for a
node that does not exist; and a release that frees the leak and refuses the address a pod
took between the check and the release. Hostile input (a malformed report, an NNC and an
IPBlock with garbage in them) gets an error naming the field.

The controller is stopped before the inconsistencies are made: running, it repairs some of
them (it completes a grant the record holds, asks a duplicate back) and the test would race it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cns.core.allocation import Entry
from cns.kube.ipam_view import RELEASE_ANNOTATION
from cns.kube.ipblock import block_entries, encode_entry
from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.fleet import addresses
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API
from tests.harness.kube_cluster import KubeCluster, binaries, missing_binaries_message
from tests.harness.kube_scenario import object_ref, subnet_objects
from tests.harness.process import ManagedProcess, private_tmp
from tests.harness.requirements import unavailable

# `cns ipam` runs with an operator's own credentials, limited to config/rbac-ipam.yaml's roles.
CHECKER = "ipam-checker"  # cns-ipam-check only
OPERATOR = "ipam-operator"  # cns-ipam-check and cns-ipam-release


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeCluster]:
    bin_dir = binaries()
    if bin_dir is None:
        unavailable(missing_binaries_message())
    cluster = KubeCluster.start(bin_dir, extra_users=(CHECKER, OPERATOR))
    try:
        cluster.apply(REPO / "config" / "crd")
        cluster.apply(REPO / "config" / "rbac.yaml")
        cluster.apply(REPO / "config" / "rbac-ipam.yaml")
        bindings = [(CHECKER, "cns-ipam-check"), (OPERATOR, "cns-ipam-check"),
                    (OPERATOR, "cns-ipam-release")]  # fmt: skip
        for user, role in bindings:
            cluster.create({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{user}-{role}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                              "name": user}],
            })  # fmt: skip
        yield cluster
    finally:
        cluster.stop()


CIDR = "10.93.0.0/27"  # gateway .1; hosts .2-.30
POD_NAMESPACE = "default"


@dataclass
class Cluster:
    kube: KubeCluster
    subnet: str
    nodes: list[str]
    workdir: Path
    pods: list[str]

    def ipam(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`cns ipam ARGS` as the operator allowed to release (`release`) or only to read."""
        user = OPERATOR if args[0] == "release" else CHECKER
        return self.ipam_as(user, *args)

    def ipam_as(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "cns.commands.cli", "ipam", *args,
                   "--kubeconfig", str(self.kube.kubeconfig_for(user))]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)

    def nnc(self, node: str) -> dict[str, Any]:
        return self.kube.get(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)

    def block(self) -> dict[str, Any]:
        (block,) = self.kube.get(
            CS_API, "IPBlock", params={"labelSelector": f"acn.azure.com/subnet={self.subnet}"}
        )["items"]
        return block

    def record(self) -> dict[str, Entry]:
        return block_entries(self.block())

    def put_entry(self, address: str, entry: Entry) -> None:
        """An allocation entry written into the subnet's block, as a broken writer would."""
        block = self.block()
        allocations = {**block["spec"]["allocations"], address: encode_entry(entry)}
        self.kube.patch(CS_API, "IPBlock", block["metadata"]["name"],
                        {"spec": {"allocations": allocations}})  # fmt: skip

    def pod(self, name: str, node: str, address: str) -> None:
        """A pod on `node` whose status says it holds `address` (no kubelet: written here)."""
        self.kube.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": POD_NAMESPACE},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "pause"}]},
        })  # fmt: skip
        self.pods.append(name)
        status = {"podIP": address, "podIPs": [{"ip": address}]}
        self.kube.patch("v1", "Pod", name, {"status": status}, POD_NAMESPACE, subresource="status")

    def free_addresses(self) -> list[str]:
        """Hosts of the subnet that no NNC lists and no record holds."""
        taken = {*self.record(), *(a for n in self.nodes for a in addresses(self.nnc(n)))}
        return [f"10.93.0.{i}" for i in range(2, 31) if f"10.93.0.{i}" not in taken]


@pytest.fixture
def cluster(kube: KubeCluster, tmp_path: Path) -> Iterator[Cluster]:
    """A ClusterSubnet and two nodes whose NNCs the real controller filled (4 addresses each),
    with one pod on each node holding one of them; the controller stopped again (running, it
    repairs some of what the tests break). Everything removed afterwards, and waited for: the
    next test checks the whole cluster."""
    subnet = f"ipam-{uuid.uuid4().hex[:6]}"
    nodes = [f"{subnet}-a", f"{subnet}-b"]
    kube.create({"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": subnet},
                 "spec": {"subnet": CIDR}})  # fmt: skip
    for name in nodes:
        kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    command = controller_command(kube, subnet=subnet, identity="replica-0", lease_seconds=2)
    controller = ManagedProcess(
        "controller", command, tmp_path / "controller.log", env=private_tmp(tmp_path)
    )
    controller.spawn(REPO)
    state = Cluster(kube, subnet, nodes, tmp_path, [])
    try:
        kube.wait_for(
            lambda: all(kube.exists(NNC_API, "NodeNetworkConfig", n, KUBE_SYSTEM) for n in nodes),
            timeout=60,
            what="an NNC for each node",
        )
        for name in nodes:
            kube.patch(NNC_API, "NodeNetworkConfig", name, {"spec": {"requestedIPCount": 3}},
                       KUBE_SYSTEM)  # fmt: skip
        kube.wait_for(
            lambda: all(len(addresses(state.nnc(n))) == 4 for n in nodes),
            timeout=60,
            what="a primary IP and 3 addresses granted to each node",
        )
        for name in nodes:
            state.pod(f"{name}-pod", name, addresses(state.nnc(name))[1])
        controller.stop(timeout=15)
        yield state
    finally:
        controller.stop(timeout=15)
        pods = [object_ref("v1", "Pod", p, POD_NAMESPACE) for p in state.pods]
        for ref in pods:  # no kubelet to confirm a graceful deletion
            path = kube.path_for("v1", "Pod", ref["metadata"]["name"], POD_NAMESPACE)
            kube.request("DELETE", path, params={"gracePeriodSeconds": 0})
        kube.delete(pods)
        kube.delete(subnet_objects(kube, subnet, nodes))


def _report(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _found(data: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["problem"], f["address"]) for f in data["findings"]}


@pytest.mark.slow
def test_check_reports_each_inconsistency_made_on_purpose_with_its_exit_status(
    cluster: Cluster,
) -> None:
    a, b = cluster.nodes
    clean = cluster.ipam("check", "-o", "json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert _report(clean)["clean"] is True
    shown = json.loads(cluster.ipam("show", "-o", "json", "--blocks").stdout)
    (subnet,) = [s for s in shown["subnets"] if s["name"] == cluster.subnet]
    assert (subnet["capacity"], subnet["reserved"], subnet["granted"], subnet["assigned"]) == (
        29, 8, 8, 2,
    )  # fmt: skip
    node_a = next(n for n in shown["nodes"] if n["node"] == a)
    assert (node_a["granted"], node_a["assigned"], node_a["free"]) == (4, 1, 3)
    assert node_a["ranges"]
    lines = [line.split() for line in cluster.ipam("show", "--blocks").stdout.splitlines()]
    assert [cluster.subnet, CIDR, "29", "8", "8", "2", "21", "27.6"] in lines
    assert [a, cluster.subnet, "3", "4", "4", "1", "3"] in lines
    assert [a, cluster.subnet, *node_a["ranges"]] in lines
    quiet = cluster.ipam("check", "--show-problem-ips")
    assert (quiet.returncode, quiet.stdout) == (0, "")

    # A duplicate: node b's NNC also lists an address node a holds.
    nnc_b = cluster.nnc(b)
    taken = addresses(cluster.nnc(a))[2]
    containers = nnc_b["status"]["networkContainers"]
    containers[0]["ipAssignments"].append({"name": "stolen-1", "ip": taken})
    cluster.kube.patch(NNC_API, "NodeNetworkConfig", b, {"status": {"networkContainers":
                       containers}}, KUBE_SYSTEM, subresource="status")  # fmt: skip
    # A leak: a record entry for node a that no NNC lists and no pod holds.
    leaked, unrecorded, stale = cluster.free_addresses()[:3]
    uid_a = cluster.nnc(a)["metadata"]["uid"]
    cluster.put_entry(leaked, Entry(a, "leak-1", uid=uid_a))
    # A pod whose address no record holds.
    cluster.pod("stray", b, unrecorded)
    # A stale record: an entry for a node that does not exist.
    cluster.put_entry(stale, Entry("gone-node", "old-1", uid="00000000-dead"))

    report_file = cluster.workdir / "report.json"
    result = cluster.ipam("check", "-o", "json", "--output-report", str(report_file))
    assert result.returncode == 4 + 8 + 16 + 32, result.stdout + result.stderr
    data = _report(result)
    assert _found(data) == {
        ("duplicate", taken),
        ("leaked", leaked),
        ("unrecorded", unrecorded),
        ("stale", stale),
    }
    assert data["exitStatus"] == result.returncode
    assert json.loads(report_file.read_text()) == data
    by_problem = {f["problem"]: f for f in data["findings"]}
    assert sorted(by_problem["duplicate"]["nodes"]) == [a, b]
    assert by_problem["leaked"]["record"]["node"] == a
    assert by_problem["unrecorded"]["pods"] == [f"{POD_NAMESPACE}/stray"]
    assert "gone-node, which does not exist" in by_problem["stale"]["why"]
    table = cluster.ipam("check")
    assert table.returncode == 60
    assert ["leaked", leaked] in [line.split()[:2] for line in table.stdout.splitlines()]
    assert "1 duplicate, 1 leaked, 1 unrecorded, 1 stale" in table.stdout


@pytest.mark.slow
def test_release_frees_the_leak_and_refuses_the_address_a_pod_took_after_the_check(
    cluster: Cluster,
) -> None:
    a = cluster.nodes[0]
    uid_a = cluster.nnc(a)["metadata"]["uid"]
    first, second = cluster.free_addresses()[:2]
    cluster.put_entry(first, Entry(a, "leak-1", uid=uid_a))
    cluster.put_entry(second, Entry(a, "leak-2", uid=uid_a))
    report_file = cluster.workdir / "report.json"
    checked = cluster.ipam("check", "--output-report", str(report_file))
    assert checked.returncode == 8, checked.stdout + checked.stderr
    assert {f["address"] for f in json.loads(report_file.read_text())["findings"]} == {
        first, second,
    }  # fmt: skip

    # Between the check and the release, a pod takes the second address.
    cluster.pod("late", a, second)
    before = cluster.block()

    # Reading is not releasing: the read-only role's release is refused by the API server.
    forbidden = cluster.ipam_as(CHECKER, "release", "--from-report", str(report_file), "--grace",
                                "0")  # fmt: skip
    assert forbidden.returncode == 1
    assert "cns ipam release: the API server answered 403" in forbidden.stderr
    assert cluster.block()["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

    young = cluster.ipam("release", "--from-report", str(report_file))
    assert young.returncode == 1
    assert f"refused {first}: the report is" in young.stderr and "grace" in young.stderr
    dry = cluster.ipam("release", "--from-report", str(report_file), "--grace", "0", "--dry-run")
    assert dry.returncode == 1, dry.stdout + dry.stderr
    assert f"would release {first} (node {a}, IPBlock " in dry.stdout
    assert f"refused {second}: pod {POD_NAMESPACE}/late holds it" in dry.stderr
    assert cluster.block()["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

    done = cluster.ipam("release", "--from-report", str(report_file), "--grace", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"released {first} (node {a}" in done.stdout
    assert f"refused {second}: pod {POD_NAMESPACE}/late holds it" in done.stderr
    record = cluster.record()
    assert first not in record
    assert record[second] == Entry(a, "leak-2", uid=uid_a)
    annotations = cluster.nnc(a)["metadata"].get("annotations") or {}
    assert annotations[RELEASE_ANNOTATION].startswith(f"{first} ")

    again = cluster.ipam("release", "--from-report", str(report_file), "--grace", "0")
    assert f"refused {first}: no allocation record holds it any more" in again.stderr
    after = cluster.ipam("check", "-o", "json")
    assert after.returncode == 0, after.stdout


@pytest.mark.slow
def test_hostile_input_gets_an_error_naming_the_field(cluster: Cluster) -> None:
    a = cluster.nodes[0]
    bad = cluster.workdir / "bad.json"
    for content, named in [
        ("{not json", "not JSON"),
        (json.dumps({"kind": "cns-ipam-check-report", "version": 1, "checkedAtEpoch": 1,
                     "findings": [{"problem": "leaked", "address": "10.93.0.999"}]}),
         "findings[0].address: '10.93.0.999' is not an IP address"),
    ]:  # fmt: skip
        bad.write_text(content)
        result = cluster.ipam("release", "--from-report", str(bad))
        assert result.returncode == 1
        assert named in result.stderr
        assert result.stderr.startswith(f"cns ipam release: report {bad}: ")
    missing = cluster.ipam("release", "--from-report", str(cluster.workdir / "none.json"))
    assert missing.returncode == 1 and "cannot be read" in missing.stderr

    # Garbage in an NNC and in an IPBlock: named, and the rest still checked.
    nnc = cluster.nnc(a)
    containers = nnc["status"]["networkContainers"]
    containers[0]["ipAssignments"][0]["ip"] = "not-an-ip"
    cluster.kube.patch(NNC_API, "NodeNetworkConfig", a, {"status": {"networkContainers":
                       containers}}, KUBE_SYSTEM, subresource="status")  # fmt: skip
    garbage = cluster.free_addresses()[0]
    block = cluster.block()
    cluster.kube.patch(CS_API, "IPBlock", block["metadata"]["name"],
                       {"spec": {"allocations": {garbage: "one-word"}}})  # fmt: skip
    result = cluster.ipam("check", "-o", "json")
    data = _report(result)
    unreadable = [f["why"] for f in data["findings"] if f["problem"] == "unreadable"]
    assert result.returncode & 64, result.stdout + result.stderr
    name = containers[0]["ipAssignments"][0]["name"]
    assert any(
        w.startswith(f"NodeNetworkConfig {a}: status.networkContainers[id=")
        and f".ipAssignments[name={name}]" in w
        and "not-an-ip" in w
        for w in unreadable
    ), unreadable
    assert f"IPBlock {block['metadata']['name']}: spec.allocations[{garbage}]: 'one-word'" in (
        " ".join(unreadable)
    )
