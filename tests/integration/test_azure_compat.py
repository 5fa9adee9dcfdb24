"""Wire compatibility with Azure CNS (docs/azure-compat.md): objects in Azure's exact format
(tests/harness/azure.py) are kept whole by cns's CRDs on a real kube-apiserver, and a daemon
uses the network containers it can honour, and shows, never uses, the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from kubernetes_asyncio import client

from cns.core.pool import Pool
from cns.core.types import IgnoredContainer, IPState, Owner, Scaler
from cns.kube import watch
from cns.kube.client import KubeClient, connect
from cns.kube.nnc import nnc_status_patch
from cns.kube.nnc_containers import ignored_containers, network_containers
from cns.kube.objects import CLUSTER_SUBNET
from cns.node.kube_source import KubeSource
from cns.node.service import NodeIPAM
from cns.state.store import Store
from tests.harness import REPO, azure
from tests.harness.daemon import Daemon
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API, load_manifests
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import Scenario, object_ref

kube = pytest.fixture(scope="module")(kube_cluster_fixture)

NC_A = "2f1e6a3c-0000-4000-8000-00000000000a"
NC_B = "2f1e6a3c-0000-4000-8000-00000000000b"
NC_C = "2f1e6a3c-0000-4000-8000-00000000000c"


def with_type(nc: dict[str, Any], nc_type: str) -> dict[str, Any]:
    return {**nc, "type": nc_type}


# --------------------------------------------------------------------------- parsing


def test_the_usable_containers_are_read_and_the_others_named_by_field() -> None:
    unset = azure.vnet_nc("nc-e", "10.71.0.0/24", 1)
    del unset["type"], unset["assignmentMode"]  # as written before Azure had the fields
    prefixed = {**azure.vnet_nc("nc-f", "10.73.0.0/24", 1), "primaryIP": "10.73.0.4/32"}
    obj = azure.nnc(
        "n1",
        [
            azure.vnet_nc(NC_A, "10.70.0.0/24", 3),
            azure.overlay_nc(NC_B),
            azure.vnetblock_nc(NC_C),
            with_type(azure.vnet_nc("nc-d", "10.74.0.0/24", 1), "infiniband"),
            unset,
            prefixed,
        ],
    )
    a, e, f = network_containers(obj)
    assert (a.id, a.primary_ips, a.subnet, a.gateway, a.version) == (
        NC_A,
        ("10.70.0.4",),
        "10.70.0.0/24",
        "10.70.0.1",
        1,
    )
    assert [c.address for c in a.ip_configs] == ["10.70.0.5", "10.70.0.6", "10.70.0.7"]
    assert [c.id for c in a.ip_configs] == [azure.ip_name(NC_A, c.address) for c in a.ip_configs]
    assert (e.id, f.id, f.primary_ips) == ("nc-e", "nc-f", ("10.73.0.4",))
    assert ignored_containers(obj) == (
        IgnoredContainer(NC_B, "assignmentMode", "static"),
        IgnoredContainer(NC_B, "type", "overlay"),
        IgnoredContainer(NC_C, "assignmentMode", "static"),
        IgnoredContainer(NC_C, "type", "vnetblock"),
        IgnoredContainer("nc-d", "type", "infiniband"),
    )
    # Azure's statuses are informational: the same containers whatever they say.
    for status in azure.NNC_STATUSES:
        for nc_status in azure.NC_STATUSES:
            other = copy.deepcopy(obj)
            other["status"]["status"] = status
            other["status"]["networkContainers"][0]["status"] = nc_status
            assert network_containers(other) == network_containers(obj)


def state(nc_a_type: str = "vnet") -> dict[str, Any]:
    return azure.nnc(
        "n1",
        [with_type(azure.vnet_nc(NC_A, "10.70.0.0/24", 3), nc_a_type), azure.overlay_nc(NC_B)],
    )


async def test_the_node_uses_only_what_it_can_says_so_once_and_withdraws_a_turned_nc(
    tmp_path: Path,
) -> None:
    """KubeSource and a real NodeIPAM (pool, store), the NNC put in the watch cache."""
    store = Store(tmp_path / "state.db")
    store.open()
    async with client.ApiClient() as api:
        source = KubeSource(
            KubeClient(api), node_name="n1", subnet_name=azure.SUBNET_NAME, fallback_scaler=Scaler()
        )
        node = NodeIPAM(Pool(), store, source, Scaler(), 3600.0)
        source._listener = node.on_state
        for collection in (source.nnc, source.subnet, source.subnet_state, source.pods):
            collection.synced.set()

        def deliver(obj: dict[str, Any]) -> list[MutableMapping[str, Any]]:
            with structlog.testing.capture_logs() as logs:
                source.nnc.put(obj)
                source._changed()
            return [e for e in logs if e["event"].startswith("network_container_")]

        said = deliver(state())
        assert [(e["event"], e["nc"], e.get("field"), e.get("value")) for e in said] == [
            ("network_container_ignored", NC_B, "assignmentMode", "static"),
            ("network_container_ignored", NC_B, "type", "overlay"),
            ("network_container_applied", NC_A, None, None),
        ]
        assert said[0]["usable"] == ["dynamic"] and said[1]["usable"] == ["vnet"]
        assert said[0]["log_level"] == "error"
        assert list(node.pool.containers) == [NC_A]
        assert node.ignored_containers == ignored_containers(state())
        assert node.pool.counts()[IPState.AVAILABLE] == 3
        assert deliver(state()) == []  # said once

        result = await node.add(Owner("c1", "eth0", "web", "shop"))
        assert result.record.address in {"10.70.0.5", "10.70.0.6", "10.70.0.7"}

        # The control plane turns the NC into one the node cannot use: its free IPs go at once,
        # the pod keeps its address.
        said = deliver(state("vnetblock"))
        assert [(e["event"], e["nc"]) for e in said] == [
            ("network_container_ignored", NC_A),
            ("network_container_withdrawn", NC_A),  # free_ips_dropped=2
        ]
        assert (said[1]["free_ips_dropped"], said[1]["assigned_kept"]) == (2, 1)
        counts = node.pool.counts()
        assert (counts[IPState.AVAILABLE], counts[IPState.ASSIGNED]) == (0, 1)
        assert deliver(state("vnetblock")) == []  # said once

        said = deliver(state())
        assert [(e["event"], e["nc"]) for e in said] == [
            ("network_container_no_longer_ignored", NC_A),
            ("network_container_applied", NC_A),
        ]
        assert node.pool.counts()[IPState.AVAILABLE] == 2
    store.close()


# --------------------------------------------------------------------------- real kube-apiserver


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    return kube


def nnc_ref(node: str) -> dict[str, Any]:
    return object_ref(NNC_API, "NodeNetworkConfig", node, KUBE_SYSTEM)


def write_status(cluster: KubeCluster, obj: dict[str, Any]) -> dict[str, Any]:
    """The status as DNC-RC writes it: the whole status through the status subresource."""
    name = obj["metadata"]["name"]
    return cluster.patch(
        NNC_API,
        "NodeNetworkConfig",
        name,
        {"status": obj["status"]},
        KUBE_SYSTEM,
        subresource="status",
    )


@pytest.mark.slow
def test_azure_format_nncs_are_kept_whole(cluster: KubeCluster) -> None:
    containers = [
        *(azure.vnet_nc(f"nc-{i}", f"10.7{i}.0.0/24", 2, status=s, version=i)
          for i, s in enumerate(azure.NC_STATUSES)),
        azure.overlay_nc(NC_B),
        azure.vnetblock_nc(NC_C),
    ]  # fmt: skip
    obj = azure.nnc("azure-rt", containers)
    created = cluster.create(obj)
    try:
        assert created["spec"] == obj["spec"]  # nothing pruned (availabilityZone included)
        for status in azure.NNC_STATUSES:
            obj["status"]["status"] = status
            written = write_status(cluster, obj)
            read = cluster.get(NNC_API, "NodeNetworkConfig", "azure-rt", KUBE_SYSTEM)
            assert written["status"] == read["status"] == obj["status"]
            assert read["spec"] == obj["spec"]
            assert read["metadata"]["labels"] == obj["metadata"]["labels"]
        # cns's controller's own write over it stays valid (and says SubnetFull).
        patch = nnc_status_patch(
            read,
            scaler=Scaler(),
            release=[],
            nc=network_containers(read)[0],
            subnet_name=azure.SUBNET_NAME,
            subnet_full=True,
        )
        assert patch is not None
        answer = cluster.patch(
            NNC_API, "NodeNetworkConfig", "azure-rt", patch, KUBE_SYSTEM, subresource="status"
        )
        assert answer["status"]["status"] == "SubnetFull"
        assert answer["spec"]["availabilityZone"] == 1
    finally:
        cluster.delete(nnc_ref("azure-rt"))


@pytest.mark.slow
def test_azure_format_subnet_states_are_kept_whole(cluster: KubeCluster) -> None:
    name = "azure-css-rt"
    obj = azure.subnet_state(name, exhausted=True)
    cluster.create(obj)
    try:
        for timestamp in (azure.GO_TIME_STRING, "2026-11-26T17:31:15Z"):
            status = {**obj["status"], "timestamp": timestamp}
            patched = cluster.patch(
                CS_API, "ClusterSubnetState", name, {"status": status}, subresource="status"
            )
            assert patched["status"] == status
            assert cluster.get(CS_API, "ClusterSubnetState", name)["status"] == status
        # The one difference that stays: cns's ClusterSubnetState is cluster-scoped, Azure's is
        # in kube-system, so a writer that names a namespace finds nothing there.
        path = f"/apis/{CS_API}/namespaces/{KUBE_SYSTEM}/clustersubnetstates/{name}"
        assert cluster.request("GET", path).status == 404
    finally:
        cluster.delete(object_ref(CS_API, "ClusterSubnetState", name))


@pytest.fixture
def azure_node(cluster: KubeCluster, tmp_path: Path) -> Iterator[Scenario]:
    """A node whose NNC an Azure-format control plane (this test) writes; no cns controller.
    The scenario's ClusterSubnet is not the one the daemon follows (Azure has none)."""
    scenario = Scenario(cluster, tmp_path, "azure-unused", "10.99.0.0/24")
    scenario.add_node("az-n1")
    yield scenario
    scenario.cleanup()
    cluster.delete(object_ref(CS_API, "ClusterSubnetState", azure.SUBNET_NAME))


def cns_status(daemon: Daemon, *args: str) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cns.commands.cli",
            "status",
            "--debug-url",
            daemon.debug_url,
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
        check=True,
    )
    return done.stdout


def log_events(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in daemon.log().splitlines() if f'"event": "{event}"' in line]


@pytest.mark.slow
def test_a_daemon_follows_an_azure_format_nnc(cluster: KubeCluster, azure_node: Scenario) -> None:
    vnet = azure.vnet_nc(NC_A, "10.70.0.0/24", 8)
    obj = azure.nnc("az-n1", [vnet, azure.overlay_nc(NC_B)])
    cluster.create(obj)
    write_status(cluster, obj)
    cluster.create(azure.subnet_state(azure.SUBNET_NAME, exhausted=False))
    daemon = azure_node.start_daemon("az-n1", subnet_name="")  # follows the NC's subnetName
    usable = {a["ip"] for a in vnet["ipAssignments"]}

    daemon.wait_pool(lambda p: p["ips"]["Available"] == 8, "the NC's 8 IPs")
    given = set()
    for i in range(3):
        status, body = daemon.call(
            "POST", "/v1/cni/add", {"containerID": f"az{i}", "ifName": "eth0"}
        )
        assert status == 200, body
        address, _, prefix = body["ips"][0]["address"].partition("/")
        given.add(address)
        assert prefix == "24"
    assert given <= usable
    pool = daemon.pool()
    assert [nc["id"] for nc in pool["networkContainers"]] == [NC_A]
    expected = [
        {"id": NC_B, "field": "assignmentMode", "value": "static"},
        {"id": NC_B, "field": "type", "value": "overlay"},
    ]
    assert pool["ignoredNetworkContainers"] == expected
    assert json.loads(cns_status(daemon, "--json"))["ignoredNetworkContainers"] == expected
    assert f"{NC_B} assignmentMode=static, {NC_B} type=overlay" in cns_status(daemon)
    metrics = daemon.metrics()
    assert metrics['cns_network_containers_ignored{field="type",value="overlay"}'] == 1
    assert metrics['cns_network_containers_ignored{field="assignmentMode",value="static"}'] == 1

    # The daemon writes only its own fields of the spec: Azure's availabilityZone stays.
    azure_node.wait(
        lambda: azure_node.nnc("az-n1")["spec"]["requestedIPCount"] == 15, "the daemon's request"
    )
    assert azure_node.nnc("az-n1")["spec"]["availabilityZone"] == 1

    # Azure's statuses, as DNC-RC writes them, change nothing.
    obj["status"]["status"] = "Error"
    obj["status"]["networkContainers"][0]["status"] = "NCUpdateSubnetFullError"
    write_status(cluster, obj)
    status, body = daemon.call("POST", "/v1/cni/add", {"containerID": "az3", "ifName": "eth0"})
    assert status == 200 and body["ips"][0]["address"].split("/")[0] in usable, body

    # The control plane turns the NC into a type cns cannot use: nothing more is handed out.
    obj["status"]["networkContainers"][0] = with_type(vnet, "vnetblock")
    write_status(cluster, obj)
    pool = daemon.wait_pool(lambda p: p["ips"]["Available"] == 0, "the NC withdrawn")
    assert pool["ips"]["Assigned"] == 4
    assert {"id": NC_A, "field": "type", "value": "vnetblock"} in pool["ignoredNetworkContainers"]
    assert len(log_events(daemon, "network_container_withdrawn")) == 1

    # Each change was said once, however many events came between.
    ignored = [
        (e["nc"], e["field"], e["value"]) for e in log_events(daemon, "network_container_ignored")
    ]
    assert ignored == [
        (NC_B, "assignmentMode", "static"),
        (NC_B, "type", "overlay"),
        (NC_A, "type", "vnetblock"),
    ]
    obj["status"]["networkContainers"][0] = {**vnet, "version": 2}
    write_status(cluster, obj)
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 4, "the NC back")
    assert daemon.pool()["ignoredNetworkContainers"] == expected
    assert [e["nc"] for e in log_events(daemon, "network_container_no_longer_ignored")] == [NC_A]

    # Azure's exhaustion, as DNC-RC writes it.
    cluster.patch(
        CS_API,
        "ClusterSubnetState",
        azure.SUBNET_NAME,
        {"status": {"exhausted": True, "timestamp": azure.GO_TIME_STRING}},
        subresource="status",
    )
    daemon.wait_pool(lambda p: p["subnetExhausted"], "the subnet exhaustion")


@pytest.fixture
def azure_only(cluster: KubeCluster, azure_node: Scenario) -> Iterator[Scenario]:
    """The cluster with Azure's CRDs only: no ClusterSubnet, and a ClusterSubnetState CRD in
    Azure's scope (namespaced); cns's CRDs put back afterwards."""
    cns = [*load_manifests(REPO / "config" / "crd" / "clustersubnets.yaml"),
           *load_manifests(REPO / "config" / "crd" / "clustersubnetstates.yaml")]  # fmt: skip
    cluster.delete(cns)
    namespaced = copy.deepcopy(cns[1])
    namespaced["spec"]["scope"] = "Namespaced"
    cluster.apply(namespaced)
    yield azure_node
    cluster.delete(namespaced)
    cluster.apply(cns)


@pytest.mark.slow
async def test_without_the_clustersubnet_crd_the_daemon_serves_from_its_nnc(
    cluster: KubeCluster, azure_only: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ClusterSubnet list is a 404: said once, taken as no ClusterSubnet, and the node
    serves from its NNC (before, the watch retried forever and the node never became ready).
    The missing kind is listed again at a slow pace, so a CRD installed later is followed.
    Then a further subnet's network container leaves the NNC while a pod holds an address of
    it: the pod keeps it until its DEL, and an ADD naming that subnet fails at once (before, the
    node went on handing out the gone container's addresses)."""
    vnet = azure.vnet_nc(NC_A, "10.70.0.0/24", 4)
    further = {**azure.vnet_nc("nc-podnet2", "10.71.0.0/24", 2), "subnetName": "podnet2"}
    obj = azure.nnc("az-n1", [vnet, further])
    cluster.create(obj)
    write_status(cluster, obj)
    state = azure.subnet_state(azure.SUBNET_NAME, exhausted=False)
    cluster.create(state, namespace=KUBE_SYSTEM)
    daemon = azure_only.start_daemon("az-n1", subnet_name="", config={"addTimeoutSeconds": 3})
    daemon.wait_pool(lambda p: p["ips"]["Available"] == 4, "the NC's 4 IPs")
    status, body = daemon.call("POST", "/v1/cni/add", {"containerID": "az0", "ifName": "eth0"})
    assert status == 200, body
    missing = log_events(daemon, "watch_resource_missing")
    # Said once per watch (with further subnets' ClusterSubnets watched, once for each).
    assert {e["watch"] for e in missing} == {"clustersubnets"}, missing
    assert len(missing) <= 2
    assert "CRD" in missing[0]["meaning"] and missing[0]["retry_in"] == watch.MISSING_RETRY_SECONDS
    assert not [e for e in log_events(daemon, "watch_failed") if e["watch"] == "clustersubnets"]
    # Azure's ClusterSubnetState, in kube-system, is read as cns's: the daemon lists them
    # cluster-wide, which the API server serves for a namespaced kind too.
    cluster.patch(
        CS_API,
        "ClusterSubnetState",
        azure.SUBNET_NAME,
        {"status": {"exhausted": True, "timestamp": azure.GO_TIME_STRING}},
        KUBE_SYSTEM,
        subresource="status",
    )
    daemon.wait_pool(lambda p: p["subnetExhausted"], "the exhaustion of Azure's subnet state")

    both = {"ifName": "eth0", "subnets": [azure.SUBNET_NAME, "podnet2"]}
    status, body = daemon.call("POST", "/v1/cni/add", {"containerID": "az1", **both})
    assert status == 200 and body["ips"][1]["address"].startswith("10.71.0."), body
    obj["status"]["networkContainers"] = [vnet]
    write_status(cluster, obj)
    lane = daemon.wait_pool(lambda p: p["subnets"]["podnet2"].get("removed"), "podnet2 removed")
    assert lane["subnets"]["podnet2"]["ips"] == {**lane["subnets"]["podnet2"]["ips"],
                                                 "Assigned": 1, "Available": 0}  # fmt: skip
    assert [e["subnet"] for e in log_events(daemon, "subnet_removed")] == ["podnet2"]
    status, body = daemon.call("POST", "/v1/cni/add", {"containerID": "az2", **both})
    assert (status, body["code"]) == (503, 11) and "subnet podnet2 was removed" in body["msg"]
    status, body = daemon.call("POST", "/v1/cni/del", {"containerID": "az1", "ifName": "eth0"})
    assert status == 200, body
    daemon.wait_pool(lambda p: "subnets" not in p, "podnet2 drained")
    azure_only.wait(
        lambda: not azure_only.nnc("az-n1")["spec"].get("subnets"), "podnet2 no longer asked for"
    )

    # The same watch in this process, listing again every 0.2 s: the CRD comes, then a subnet.
    monkeypatch.setattr(watch, "MISSING_RETRY_SECONDS", 0.2)
    changes: list[int] = []
    async with await connect(str(cluster.kubeconfig)) as kube:
        subnets = kube.watch(CLUSTER_SUBNET, lambda: changes.append(1), name="late")
        task = asyncio.create_task(subnets.run())
        try:
            await asyncio.wait_for(subnets.synced.wait(), 30)
            assert subnets.objects == {} and changes == [1]
            cluster.apply(REPO / "config" / "crd" / "clustersubnets.yaml")
            late = {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": "late"}}
            cluster.create({**late, "spec": {"subnet": "10.98.0.0/24"}})
            try:
                for _ in range(300):
                    if subnets.first():
                        break
                    await asyncio.sleep(0.1)
                assert subnets.first()["spec"]["subnet"] == "10.98.0.0/24"
            finally:
                cluster.delete(late)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
