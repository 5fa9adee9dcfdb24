"""Contract tests of config/ against a real kube-apiserver (tests/harness/kube_cluster.py): the
three CRDs, the RBAC manifests and the DaemonSet/Deployment manifests, plus the harness's outage
helpers.

What is asserted here is what the real server does (validation, pruning, defaulting, status
subresource, field selectors, discovery, printer columns, RBAC); the daemon and controller code
and any fake API server must agree with it.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cns.commands.install import SECCOMP_PROFILE_NAME
from tests.harness import REPO
from tests.harness.kube_api import (
    CONTROLLER_USER,
    DAEMON_USER,
    MERGE_PATCH,
    STRATEGIC_PATCH,
    ApiError,
    load_manifests,
)
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture

CONFIG = REPO / "config"
GROUP = "acn.azure.com"
NNC_V = f"{GROUP}/v1alpha"
CS_V = f"{GROUP}/v1alpha1"
NS = "kube-system"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"

kube = pytest.fixture(scope="session")(kube_cluster_fixture)

SCALER = {
    "batchSize": 16,
    "releaseThresholdPercent": 150,
    "requestThresholdPercent": 50,
    "maxIPCount": 250,
}
NETWORK_CONTAINER = {
    "id": "nc-6e1f2a",
    "primaryIP": "10.240.0.4",
    "subnetName": "pod-subnet",
    "subnetAddressSpace": "10.240.0.0/16",
    "defaultGateway": "10.240.0.1",
    "nodeIP": "10.224.0.5",
    "version": 3,
    "ipAssignments": [
        {"name": "6e1f2a-1", "ip": "10.240.0.5"},
        {"name": "6e1f2a-2", "ip": "10.240.0.6"},
    ],
}
NNC_STATUS = {
    "assignedIPCount": 2,
    "status": "Updated",
    "scaler": SCALER,
    "networkContainers": [NETWORK_CONTAINER],
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def nnc(name: str, spec: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": NNC_V,
        "kind": "NodeNetworkConfig",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec if spec is not None else {"requestedIPCount": 16},
    }
    doc.update(extra)
    return doc


def cluster_subnet(name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": CS_V,
        "kind": "ClusterSubnet",
        "metadata": {"name": name},
        "spec": spec if spec is not None else {"subnet": "10.240.0.0/16"},
    }


def subnet_state(name: str, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": CS_V, "kind": "ClusterSubnetState", "metadata": {"name": name}, **extra}


@pytest.fixture(scope="module")
def installed(kube: KubeCluster) -> list[dict[str, Any]]:
    """The CRDs and RBAC of config/, applied (server-side apply) and established."""
    return kube.apply(CONFIG / "crd") + kube.apply(CONFIG / "rbac.yaml")


@pytest.fixture
def node_config(kube: KubeCluster, installed: object) -> Iterator[str]:
    """A fresh NodeNetworkConfig in kube-system; yields its name."""
    name = unique("node")
    kube.create(nnc(name))
    yield name
    kube.delete(nnc(name), wait=False)


# --------------------------------------------------------------------------- CRDs accepted


def test_crds_are_established_structural_and_named(
    kube: KubeCluster, installed: list[dict[str, Any]]
) -> None:
    crds = {d["metadata"]["name"]: d for d in installed if d["kind"] == "CustomResourceDefinition"}
    assert set(crds) == {
        "nodenetworkconfigs.acn.azure.com",
        "clustersubnetstates.acn.azure.com",
        "clustersubnets.acn.azure.com",
        "ipblocks.acn.azure.com",
    }
    for name, crd in crds.items():
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("Established") == "True", (name, conditions)
        assert conditions.get("NamesAccepted") == "True", (name, conditions)
        # A non-structural schema would be reported here (and pruning/defaulting disabled).
        assert "NonStructuralSchema" not in conditions, (name, conditions)
    assert crds["nodenetworkconfigs.acn.azure.com"]["status"]["acceptedNames"]["shortNames"] == [
        "nnc"
    ]


def test_rbac_objects_are_stored(kube: KubeCluster, installed: list[dict[str, Any]]) -> None:
    stored = {(d["kind"], d["metadata"]["name"]) for d in installed}
    for name in ("cns", "cns-controller"):
        assert kube.exists("v1", "ServiceAccount", name, NS)
        for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
            assert (kind, name) in stored


@pytest.mark.parametrize(
    ("api_version", "plural", "kind", "short", "namespaced"),
    [
        (NNC_V, "nodenetworkconfigs", "NodeNetworkConfig", "nnc", True),
        (CS_V, "clustersubnetstates", "ClusterSubnetState", "css", False),
        (CS_V, "clustersubnets", "ClusterSubnet", "csub", False),
    ],
)
def test_discovery_lists_short_names_scope_and_status_subresource(
    kube: KubeCluster,
    installed: object,
    api_version: str,
    plural: str,
    kind: str,
    short: str,
    namespaced: bool,
) -> None:
    resources = {r["name"]: r for r in kube.discovery(api_version)["resources"]}
    main = resources[plural]
    assert main["kind"] == kind
    assert main["shortNames"] == [short]
    assert main["namespaced"] is namespaced
    assert {"get", "list", "watch", "create", "patch", "update"} <= set(main["verbs"])
    assert set(resources[f"{plural}/status"]["verbs"]) == {"get", "patch", "update"}


def test_short_names_are_not_taken_by_built_in_resources(
    kube: KubeCluster, installed: object
) -> None:
    """kubectl resolves a short name that a built-in resource also claims to the built-in one:
    `kubectl get cs` lists ComponentStatuses, never ClusterSubnets."""
    groups = kube.request("GET", "/apis").raise_for_status().json["groups"]
    versions = ["v1", *(v["groupVersion"] for g in groups for v in g["versions"])]
    ours: dict[str, str] = {}
    built_in: dict[str, str] = {}
    for api_version in versions:
        for resource in kube.discovery(api_version)["resources"]:
            claims = ours if api_version.startswith(f"{GROUP}/") else built_in
            for short in resource.get("shortNames") or []:
                claims[short] = f"{resource['name']} ({api_version})"
    assert built_in["cs"].startswith("componentstatuses")
    taken = {short: (ours[short], built_in[short]) for short in set(ours) & set(built_in)}
    assert not taken
    assert set(ours) == {"nnc", "css", "csub", "ipb"}


# --------------------------------------------------------------------------- NodeNetworkConfig


def test_nnc_create_drops_status_and_prunes_unknown_fields(
    kube: KubeCluster, installed: object
) -> None:
    name = unique("node")
    spec = {"requestedIPCount": 16, "ipsNotInUse": ["10.240.0.9"], "notInSchema": 1}
    created = kube.create(nnc(name, spec, status=NNC_STATUS))
    try:
        assert "status" not in created
        assert created["spec"] == {"requestedIPCount": 16, "ipsNotInUse": ["10.240.0.9"]}
        assert kube.get(NNC_V, "NodeNetworkConfig", name, NS)["spec"] == created["spec"]
    finally:
        kube.delete(nnc(name))


def test_nnc_status_merge_patch_round_trips_a_full_network_container(
    kube: KubeCluster, node_config: str
) -> None:
    patched = kube.patch(
        NNC_V, "NodeNetworkConfig", node_config, {"status": NNC_STATUS}, NS, subresource="status"
    )
    assert patched["status"] == NNC_STATUS
    read = kube.get(NNC_V, "NodeNetworkConfig", node_config, NS)
    assert read["status"] == NNC_STATUS
    assert read["spec"] == {"requestedIPCount": 16}
    # Zero values are valid (the initial request of a new node is 0).
    zero = {"assignedIPCount": 0, "networkContainers": [{**NETWORK_CONTAINER, "version": 0}]}
    patched = kube.patch(
        NNC_V, "NodeNetworkConfig", node_config, {"status": zero}, NS, subresource="status"
    )
    assert patched["status"]["assignedIPCount"] == 0
    assert patched["status"]["networkContainers"][0]["version"] == 0


def test_nnc_spec_and_status_are_written_through_separate_endpoints(
    kube: KubeCluster, node_config: str
) -> None:
    kube.patch(
        NNC_V, "NodeNetworkConfig", node_config, {"status": NNC_STATUS}, NS, subresource="status"
    )
    # PATCH on the resource changes spec and silently ignores status ...
    both = {"spec": {"requestedIPCount": 32}, "status": {"assignedIPCount": 99}}
    patched = kube.patch(NNC_V, "NodeNetworkConfig", node_config, both, NS)
    assert patched["spec"]["requestedIPCount"] == 32
    assert patched["status"]["assignedIPCount"] == NNC_STATUS["assignedIPCount"]
    # ... and PATCH on /status changes status and silently ignores spec.
    both = {"spec": {"requestedIPCount": 48}, "status": {"assignedIPCount": 30}}
    patched = kube.patch(NNC_V, "NodeNetworkConfig", node_config, both, NS, subresource="status")
    assert patched["spec"]["requestedIPCount"] == 32
    assert patched["status"]["assignedIPCount"] == 30
    # merge-patch replaces lists wholesale (the daemon must send the complete ipsNotInUse).
    path = kube.path_for(NNC_V, "NodeNetworkConfig", node_config, NS)
    kube.patch(NNC_V, "NodeNetworkConfig", node_config, {"spec": {"ipsNotInUse": ["a", "b"]}}, NS)
    patched = kube.patch(
        NNC_V, "NodeNetworkConfig", node_config, {"spec": {"ipsNotInUse": ["b"]}}, NS
    )
    assert patched["spec"]["ipsNotInUse"] == ["b"]
    # Custom resources have no strategic merge patch.
    answer = kube.request("PATCH", path, {"spec": {"requestedIPCount": 1}}, STRATEGIC_PATCH)
    assert answer.status == 415


def test_nnc_stale_resource_version_conflicts(kube: KubeCluster, node_config: str) -> None:
    current = kube.get(NNC_V, "NodeNetworkConfig", node_config, NS)
    stale = current["metadata"]["resourceVersion"]
    kube.patch(NNC_V, "NodeNetworkConfig", node_config, {"spec": {"requestedIPCount": 17}}, NS)
    with pytest.raises(ApiError) as info:
        kube.patch(
            NNC_V,
            "NodeNetworkConfig",
            node_config,
            {"metadata": {"resourceVersion": stale}, "spec": {"requestedIPCount": 18}},
            NS,
        )
    assert info.value.status == 409
    assert info.value.reason == "Conflict"


def test_nnc_field_selector_on_metadata_name(kube: KubeCluster, installed: object) -> None:
    names = [unique("node"), unique("node")]
    for name in names:
        kube.create(nnc(name))
    try:
        listed = kube.get(
            NNC_V,
            "NodeNetworkConfig",
            namespace=NS,
            params={"fieldSelector": f"metadata.name={names[0]}"},
        )
        assert [item["metadata"]["name"] for item in listed["items"]] == [names[0]]
        # The same selector on a watch: only that object's synthetic ADDED.
        path = kube.path_for(NNC_V, "NodeNetworkConfig", namespace=NS)
        events = list(
            kube.watch(path, {"fieldSelector": f"metadata.name={names[1]}", "timeoutSeconds": 1})
        )
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", names[1])
        ]
        # Any other field is refused.
        answer = kube.request("GET", path, params={"fieldSelector": "spec.requestedIPCount=16"})
        assert answer.status == 400
    finally:
        kube.delete([nnc(name) for name in names])


def _status_patch(kube: KubeCluster, name: str, status: dict[str, Any]) -> None:
    kube.patch(NNC_V, "NodeNetworkConfig", name, {"status": status}, NS, subresource="status")


def _bad_container(**changes: Any) -> dict[str, Any]:
    container = copy.deepcopy(NETWORK_CONTAINER)
    container.update(changes)
    return {"networkContainers": [container]}


@pytest.mark.parametrize(
    ("status", "field"),
    [
        (
            {"scaler": {**SCALER, "requestThresholdPercent": 101}},
            "status.scaler.requestThresholdPercent",
        ),
        ({"scaler": {"batchSize": 0}}, "status.scaler.batchSize"),
        ({"scaler": {"maxIPCount": 0}}, "status.scaler.maxIPCount"),
        ({"scaler": {"releaseThresholdPercent": -1}}, "status.scaler.releaseThresholdPercent"),
        ({"assignedIPCount": -1}, "status.assignedIPCount"),
        ({"status": "Bogus"}, "status.status"),
        # No index in the field path: kube-apiserver 1.20 reports the schema path.
        (
            _bad_container(ipAssignments=[{"name": "x"}]),
            "status.networkContainers.ipAssignments.ip",
        ),
        (
            _bad_container(ipAssignments=[{"ip": "10.240.0.7"}]),
            "status.networkContainers.ipAssignments.name",
        ),
        (
            _bad_container(subnetAddressSpace="10.240.0.0/33"),
            "status.networkContainers.subnetAddressSpace",
        ),
        (_bad_container(version=-1), "status.networkContainers.version"),
        (_bad_container(version="3"), "status.networkContainers.version"),
    ],
)
def test_nnc_invalid_status_is_rejected_naming_the_field(
    kube: KubeCluster, node_config: str, status: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiError) as info:
        _status_patch(kube, node_config, status)
    assert info.value.status == 422, info.value
    assert info.value.reason == "Invalid"
    assert field in info.value.fields, info.value.causes
    assert field in info.value.message


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"requestedIPCount": -1}, "spec.requestedIPCount"),
        ({"requestedIPCount": "16"}, "spec.requestedIPCount"),
        ({"ipsNotInUse": "10.240.0.5"}, "spec.ipsNotInUse"),
        ({"subnets": [{"requestedIPCount": 4}]}, "spec.subnets.name"),
        ({"subnets": [{"name": ""}]}, "spec.subnets.name"),
        ({"subnets": [{"name": "v6", "requestedIPCount": -1}]}, "spec.subnets.requestedIPCount"),
        ({"subnets": [{"name": "v6", "ipsNotInUse": "x"}]}, "spec.subnets.ipsNotInUse"),
        ({"subnets": [{"name": "v6"}, {"name": "v6"}]}, "spec.subnets[1]"),
        ({"subnets": [{"name": f"s{i}"} for i in range(17)]}, "spec.subnets"),
    ],
)
def test_nnc_invalid_spec_is_rejected_naming_the_field(
    kube: KubeCluster, installed: object, spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiError) as info:
        kube.create(nnc(unique("node"), spec))
    assert info.value.status == 422, info.value
    assert field in info.value.fields, info.value.causes


def test_nnc_spec_subnets_are_stored_as_written(kube: KubeCluster, node_config: str) -> None:
    """The daemon's requests of further subnets (`spec.subnets`) are kept, not pruned."""
    entries = [
        {"name": "pods-v6", "requestedIPCount": 16, "ipsNotInUse": ["a"], "requestedIPs": []},
        {"name": "pods-b", "requestedIPCount": 0},
    ]
    patched = kube.patch(
        NNC_V, "NodeNetworkConfig", node_config, {"spec": {"subnets": entries}}, NS
    )
    assert patched["spec"]["subnets"] == entries


def test_empty_strings_are_valid(kube: KubeCluster, node_config: str) -> None:
    _status_patch(kube, node_config, {"status": ""})
    kube.patch(NNC_V, "NodeNetworkConfig", node_config, {"spec": {"ipsNotInUse": [""]}}, NS)


# --------------------------------------------------------------------------- ClusterSubnet(State)


def test_cluster_subnet_defaults_and_status(kube: KubeCluster, installed: object) -> None:
    name = unique("subnet")
    created = kube.create(cluster_subnet(name, {"subnet": "10.240.0.0/16"}))
    try:
        assert created["spec"] == {
            "subnet": "10.240.0.0/16",
            "exhaustion": {"upperPercent": 90, "lowerPercent": 50},
            "nodeSafetyFactor": 2,
            "maxBatchSize": 16,
        }
        spec = {
            "subnet": "fd00:10::/64",
            "gateway": "fd00:10::1",
            "reservedIPs": ["fd00:10::2"],
            "overflow": ["more-v6", "even-more.v6"],
            "exhaustion": {"upperPercent": 80},
            "scaler": {"batchSize": 4},
        }
        patched = kube.patch(CS_V, "ClusterSubnet", name, {"spec": spec})
        assert patched["spec"]["exhaustion"] == {"upperPercent": 80, "lowerPercent": 50}
        assert patched["spec"]["scaler"] == {"batchSize": 4}
        assert patched["spec"]["overflow"] == ["more-v6", "even-more.v6"]
        status = {
            "scaler": {**SCALER, "batchSize": 4},
            "reservedIPCount": 1200,
            "capacity": 65531,
            "nodeCount": 75,
            "utilizationPercent": 1.83,
            "exhausted": False,
            "batchChanges": 2,
        }
        patched = kube.patch(CS_V, "ClusterSubnet", name, {"status": status}, subresource="status")
        assert patched["status"] == status
        assert kube.get(CS_V, "ClusterSubnet", name)["status"] == status
    finally:
        kube.delete(cluster_subnet(name))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"gateway": "10.240.0.1"}, "spec.subnet"),
        (None, "spec"),
        ({"subnet": "10.240.0.0"}, "spec.subnet"),
        (
            {"subnet": "10.240.0.0/16", "exhaustion": {"upperPercent": 101}},
            "spec.exhaustion.upperPercent",
        ),
        (
            {"subnet": "10.240.0.0/16", "exhaustion": {"lowerPercent": -1}},
            "spec.exhaustion.lowerPercent",
        ),
        ({"subnet": "10.240.0.0/16", "nodeSafetyFactor": 0}, "spec.nodeSafetyFactor"),
        ({"subnet": "10.240.0.0/16", "maxBatchSize": 0}, "spec.maxBatchSize"),
        (
            {"subnet": "10.240.0.0/16", "scaler": {"requestThresholdPercent": 101}},
            "spec.scaler.requestThresholdPercent",
        ),
        ({"subnet": "10.240.0.0/16", "reservedIPs": [1]}, "spec.reservedIPs"),
        ({"subnet": "10.240.0.0/16", "overflow": "more"}, "spec.overflow"),
        ({"subnet": "10.240.0.0/16", "overflow": ["a", "b", "c", "d", "e"]}, "spec.overflow"),
        ({"subnet": "10.240.0.0/16", "overflow": ["More"]}, "spec.overflow"),
        ({"subnet": "10.240.0.0/16", "overflow": ["more", "more"]}, "spec.overflow[1]"),
    ],
)
def test_cluster_subnet_invalid_spec_is_rejected_naming_the_field(
    kube: KubeCluster, installed: object, spec: dict[str, Any] | None, field: str
) -> None:
    doc = cluster_subnet(unique("subnet"), spec)
    if spec is None:
        del doc["spec"]
    with pytest.raises(ApiError) as info:
        kube.create(doc)
    assert info.value.status == 422, info.value
    assert field in info.value.fields, info.value.causes


def test_cluster_subnet_state_status_subresource(kube: KubeCluster, installed: object) -> None:
    name = unique("subnet")
    created = kube.create(subnet_state(name, status={"exhausted": True}))
    try:
        assert "status" not in created
        status = {"exhausted": True, "timestamp": "2024-05-01T12:00:00Z"}
        patched = kube.patch(
            CS_V, "ClusterSubnetState", name, {"status": status}, subresource="status"
        )
        assert patched["status"] == status
        patched = kube.patch(
            CS_V, "ClusterSubnetState", name, {"status": {"exhausted": False}}, subresource="status"
        )
        assert patched["status"] == {"exhausted": False, "timestamp": "2024-05-01T12:00:00Z"}
        # Any timestamp string, as Azure's schema (tests/integration/test_azure_compat.py); not a
        # boolean.
        with pytest.raises(ApiError) as info:
            kube.patch(
                CS_V,
                "ClusterSubnetState",
                name,
                {"status": {"exhausted": "yes"}},
                subresource="status",
            )
        assert info.value.status == 422
        assert "status.exhausted" in info.value.fields
    finally:
        kube.delete(subnet_state(name))


def test_cluster_subnet_node_selector_is_kept_and_checked(
    kube: KubeCluster, installed: object
) -> None:
    """A selector survives the API server's pruning as written (the controller reads it back);
    an operator outside Kubernetes' four is refused naming the field."""
    name = unique("subnet")
    selector = {
        "matchLabels": {"pool": "gpu"},
        "matchExpressions": [{"key": "zone", "operator": "In", "values": ["1", "2"]}],
    }
    try:
        kube.create(cluster_subnet(name, {"subnet": "10.241.0.0/16", "nodeSelector": selector}))
        assert kube.get(CS_V, "ClusterSubnet", name)["spec"]["nodeSelector"] == selector
    finally:
        kube.delete(cluster_subnet(name))
    bad = {"matchExpressions": [{"key": "zone", "operator": "Gt", "values": ["1"]}]}
    with pytest.raises(ApiError) as info:
        kube.create(cluster_subnet(unique("subnet"), {"subnet": "10.0.0.0/8", "nodeSelector": bad}))
    assert info.value.status == 422, info.value
    assert "spec.nodeSelector.matchExpressions.operator" in info.value.fields, info.value.causes


# --------------------------------------------------------------------------- printer columns


def _table(kube: KubeCluster, api_version: str, kind: str, name: str, ns: str | None) -> Any:
    path = kube.path_for(api_version, kind, name, ns)
    return kube.request("GET", path, headers={"Accept": TABLE}).raise_for_status().json


def test_printer_columns(kube: KubeCluster, node_config: str) -> None:
    _status_patch(kube, node_config, NNC_STATUS)
    placed = {"metadata": {"labels": {"acn.azure.com/subnet": "pod-subnet"}}}
    kube.patch(NNC_V, "NodeNetworkConfig", node_config, placed, NS)
    table = _table(kube, NNC_V, "NodeNetworkConfig", node_config, NS)
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == ["Name", "Requested", "Allocated IPs", "Subnet", "Status", "Age"]
    assert table["rows"][0]["cells"][:5] == [node_config, 16, 2, "pod-subnet", "Updated"]

    name = unique("subnet")
    kube.create(cluster_subnet(name))
    state = subnet_state(name)
    kube.create(state)
    try:
        status = {"scaler": {"batchSize": 8}, "reservedIPCount": 100, "capacity": 65531}
        kube.patch(CS_V, "ClusterSubnet", name, {"status": status}, subresource="status")
        table = _table(kube, CS_V, "ClusterSubnet", name, None)
        assert [c["name"] for c in table["columnDefinitions"]] == [
            "Name", "Subnet", "Batch", "Reserved", "Capacity", "Draining", "Held",
        ]  # fmt: skip
        assert table["rows"][0]["cells"][:5] == [name, "10.240.0.0/16", 8, 100, 65531]
        assert not any(table["rows"][0]["cells"][5:])  # not draining: both empty
        kube.patch(CS_V, "ClusterSubnet", name, {"spec": {"draining": True}})
        drain = {"addressesHeld": 3, "nodes": [{"name": "n1", "addressesHeld": 3}]}
        kube.patch(CS_V, "ClusterSubnet", name, {"status": {"draining": True, "drain": drain}},
                   subresource="status")  # fmt: skip
        table = _table(kube, CS_V, "ClusterSubnet", name, None)
        assert table["rows"][0]["cells"][5:] == [True, 3]

        status = {"exhausted": True, "timestamp": "2024-05-01T12:00:00Z"}
        kube.patch(CS_V, "ClusterSubnetState", name, {"status": status}, subresource="status")
        table = _table(kube, CS_V, "ClusterSubnetState", name, None)
        assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Exhausted", "Timestamp"]
        assert table["rows"][0]["cells"][:2] == [name, True]
    finally:
        kube.delete([cluster_subnet(name), state])


# --------------------------------------------------------------------------- RBAC


def _allowed(kube: KubeCluster, user: str, verb: str, resource: str, ns: str) -> bool:
    """SubjectAccessReview; `resource` is "[GROUP/]PLURAL[/SUBRESOURCE][:NAME]" (GROUP has a
    dot, or is `apps`)."""
    resource, _, name = resource.partition(":")
    parts = resource.split("/")
    group = parts.pop(0) if "." in parts[0] or parts[0] == "apps" else ""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": [
                "system:serviceaccounts",
                "system:serviceaccounts:kube-system",
                "system:authenticated",
            ],
            "resourceAttributes": {
                "namespace": ns,
                "verb": verb,
                "group": group,
                "resource": parts[0],
                "subresource": parts[1] if len(parts) > 1 else "",
                "name": name,
            },
        },
    }
    answer = kube.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(answer.raise_for_status().json["status"].get("allowed"))


ACN = GROUP
DAEMON_ALLOWED = [
    *[(v, f"{ACN}/nodenetworkconfigs", NS) for v in ("get", "list", "watch", "patch")],
    # A node re-creates its NNC deleted under its pods, asking for the addresses they hold.
    ("create", f"{ACN}/nodenetworkconfigs", NS),
    *[(v, f"{ACN}/clustersubnetstates", "") for v in ("get", "list", "watch")],
    *[(v, f"{ACN}/clustersubnets", "") for v in ("get", "list", "watch")],
    *[(v, r, "") for v in ("get", "list", "watch") for r in ("pods", "namespaces")],
    ("get", "pods", "default"),  # an ADD whose pod the watch has not delivered yet
    ("get", "apps/daemonsets:cns", NS),  # the preStop hook: an upgrade or an uninstall?
    # IP pressure: the node's taint (spec, read first for its resourceVersion) and condition.
    ("get", "nodes", ""),
    ("patch", "nodes", ""),
    ("patch", "nodes/status", ""),
    # Events on its pods (any namespace) and its NNC: created, then their count patched.
    *[(v, "events", ns) for v in ("create", "patch") for ns in ("default", NS)],
]
DAEMON_DENIED = [
    ("get", "apps/daemonsets:other", NS),
    ("list", "apps/daemonsets", NS),
    ("patch", "apps/daemonsets:cns", NS),
    ("patch", f"{ACN}/nodenetworkconfigs/status", NS),  # status belongs to the control plane
    ("delete", f"{ACN}/nodenetworkconfigs", NS),
    ("list", f"{ACN}/nodenetworkconfigs", "default"),
    ("patch", f"{ACN}/clustersubnets", ""),
    ("patch", f"{ACN}/clustersubnetstates/status", ""),
    ("get", "secrets", NS),
    ("list", "nodes", ""),
    ("watch", "nodes", ""),
    ("update", "nodes", ""),  # a whole-object write could drop what another writer just set
    ("update", "nodes/status", ""),
    ("delete", "nodes", ""),
    ("list", f"{ACN}/ipblocks", ""),  # the allocation record is the control plane's alone
    ("patch", "pods", "default"),
    ("patch", "namespaces", ""),
    *[(v, "events", "default") for v in ("get", "list", "watch", "update", "delete")],
    ("create", "events.k8s.io/events", "default"),
]
CONTROLLER_ALLOWED = [
    *[
        (v, f"{ACN}/{r}", NS)
        for v in ("get", "list", "watch", "create", "patch", "update")
        for r in ("nodenetworkconfigs", "nodenetworkconfigs/status")
    ],
    *[
        (v, f"{ACN}/{r}", "")
        for v in ("get", "list", "watch", "create", "patch", "update")
        for r in (
            "clustersubnets",
            "clustersubnets/status",
            "clustersubnetstates",
            "clustersubnetstates/status",
        )
    ],
    *[(v, f"{ACN}/ipblocks", "") for v in ("get", "list", "watch", "create", "update")],
    *[(v, "nodes", "") for v in ("get", "list", "watch")],
    *[(v, "coordination.k8s.io/leases", NS) for v in ("get", "create", "update")],
    # core/v1 Events on ClusterSubnets ("default") and NNCs: created, then their count patched.
    *[(v, "events", ns) for v in ("create", "patch") for ns in ("default", NS)],
]
CONTROLLER_DENIED = [
    ("delete", f"{ACN}/nodenetworkconfigs", NS),
    ("delete", f"{ACN}/ipblocks", ""),
    ("create", f"{ACN}/nodenetworkconfigs", "default"),
    ("update", "coordination.k8s.io/leases", "default"),
    ("patch", "nodes", ""),
    ("list", "pods", ""),
    ("get", "secrets", NS),
    *[(v, "events", "default") for v in ("get", "list", "watch", "update", "delete")],
    ("create", "events.k8s.io/events", NS),
]


@pytest.mark.parametrize(
    ("user", "verb", "resource", "ns", "expected"),
    [
        *[(DAEMON_USER, v, r, n, True) for v, r, n in DAEMON_ALLOWED],
        *[(DAEMON_USER, v, r, n, False) for v, r, n in DAEMON_DENIED],
        *[(CONTROLLER_USER, v, r, n, True) for v, r, n in CONTROLLER_ALLOWED],
        *[(CONTROLLER_USER, v, r, n, False) for v, r, n in CONTROLLER_DENIED],
    ],
)
def test_rbac_grants_exactly_what_each_component_needs(
    kube: KubeCluster,
    installed: object,
    user: str,
    verb: str,
    resource: str,
    ns: str,
    expected: bool,
) -> None:
    assert _allowed(kube, user, verb, resource, ns) is expected


def test_rbac_for_real_with_the_daemon_token(kube: KubeCluster, node_config: str) -> None:
    path = kube.path_for(NNC_V, "NodeNetworkConfig", node_config, NS)
    answer = kube.request(
        "PATCH", path, {"spec": {"requestedIPCount": 32}}, MERGE_PATCH, user=DAEMON_USER
    )
    assert answer.status == 200, answer.body
    answer = kube.request(
        "PATCH", f"{path}/status", {"status": {"assignedIPCount": 1}}, MERGE_PATCH, user=DAEMON_USER
    )
    assert answer.status == 403
    pods = kube.request(
        "GET", "/api/v1/pods", params={"fieldSelector": "spec.nodeName=node-1"}, user=DAEMON_USER
    )
    assert pods.status == 200, pods.body


# --------------------------------------------------------------------------- deployment manifests


def _docs(name: str) -> list[dict[str, Any]]:
    return load_manifests(CONFIG / name)


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in docs}


def test_kube_system_namespace_exists_by_default(kube: KubeCluster) -> None:
    assert kube.exists("v1", "Namespace", NS)


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "controller.yaml", "subnet.yaml"])
def test_manifests_pass_server_side_dry_run(
    kube: KubeCluster, installed: object, manifest: str
) -> None:
    for doc in _docs(manifest):
        created = kube.create(doc, dry_run=True)
        assert created["kind"] == doc["kind"]
        assert created["metadata"]["name"] == doc["metadata"]["name"]
        namespace = doc["metadata"].get("namespace")
        assert not kube.exists(doc["apiVersion"], doc["kind"], doc["metadata"]["name"], namespace)


@pytest.mark.parametrize(
    ("manifest", "kind"), [("daemonset.yaml", "DaemonSet"), ("controller.yaml", "Deployment")]
)
def test_pod_templates_pass_pod_admission(
    kube: KubeCluster, installed: object, manifest: str, kind: str
) -> None:
    """Admission (e.g. Priority) sees pods, not templates: dry-run a pod made from the template."""
    workload = _by_kind(_docs(manifest))[kind]
    template = workload["spec"]["template"]
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": unique("pod"), "namespace": NS},
        "spec": {**template["spec"], "nodeName": "node-1"},
    }
    created = kube.create(pod, dry_run=True)
    assert created["spec"]["priority"] >= 2_000_000_000  # system-*-critical resolved
    pod["spec"]["priorityClassName"] = "no-such-priority"
    with pytest.raises(ApiError) as info:
        kube.create(pod, dry_run=True)
    assert info.value.status == 403
    assert "no-such-priority" in info.value.message


def _subcommand_parser(command: str) -> argparse.ArgumentParser | None:
    from cns.commands.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(command)
            return sub if isinstance(sub, argparse.ArgumentParser) else None
    return None


def test_daemonset_wiring_matches_the_daemon(installed: object) -> None:
    from cns.commands.cli import build_parser
    from cns.config.daemon_config import parse

    docs = _by_kind(_docs("daemonset.yaml"))
    config_map, daemonset = docs["ConfigMap"], docs["DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["serviceAccountName"] == "cns"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}

    command = container["command"]
    assert command[0] == "cns"
    args = build_parser().parse_args(command[1:])
    assert args.command == "run"
    assert args.node_name == "$(NODE_NAME)"
    config_path = Path(args.config)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    config_mount = mounts[str(config_path.parent)]
    assert volumes[config_mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["metadata"]["namespace"] == daemonset["metadata"]["namespace"]

    config = parse(yaml.safe_load(config_map["data"][config_path.name]), "cns-config")
    assert config.mode == "kubernetes"
    assert config.kubernetes.subnet_name == ""  # the daemon follows the subnet its NNC names
    assert config.kubernetes.namespace == NS
    # The plugin on the host reaches the socket and the release queue at the same paths.
    # The leak check reaches the runtime's CRI socket at the host's path, read-only.
    cri_socket = Path(config.leak_reclaim.cri_socket)
    # `cns status` on the host reads the debug socket at the same path.
    host_paths = (config.socket_path, config.debug_socket_path, config.release_queue_dir)
    for host_path in (*host_paths, cri_socket):
        mount = next(m for p, m in mounts.items() if host_path.is_relative_to(p))
        assert volumes[mount["name"]]["hostPath"]["path"] == mount["mountPath"]
    assert next(m for p, m in mounts.items() if cri_socket.is_relative_to(p))["readOnly"]
    # Probes ask the daemon's root-only debug socket (cns/commands/probe.py), never the debug port.
    for probe, endpoint in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        command = container[probe]["exec"]["command"]
        assert command == [
            "/opt/cns/bin/python", "-m", "cns.commands.probe",
            str(config.debug_socket_path), endpoint,
        ]  # fmt: skip

    # The cns container's Localhost seccomp profile is the file the first init container writes
    # into the kubelet's seccomp dir (a hostPath at the same path).
    profile_init, init = pod["initContainers"]
    profile = build_parser().parse_args(profile_init["command"][1:])
    assert profile.command == "install-seccomp-profile"
    (profile_mount,) = profile_init["volumeMounts"]
    assert profile_mount["mountPath"] == profile.dir
    assert volumes[profile_mount["name"]]["hostPath"]["path"] == profile.dir
    local = container["securityContext"]["seccompProfile"]["localhostProfile"]
    kubelet_seccomp_dir = Path("/var/lib/kubelet/seccomp")
    assert kubelet_seccomp_dir / local == Path(profile.dir, SECCOMP_PROFILE_NAME)

    install = build_parser().parse_args(init["command"][1:])
    assert install.command == "install-cni"
    init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    for directory in (install.bin_dir, install.lib_dir, install.conf_dir):
        # `cns install-cni` writes these paths into the launcher: they must be the host's.
        mount = next(m for p, m in init_mounts.items() if Path(directory).is_relative_to(p))
        assert volumes[mount["name"]]["hostPath"]["path"] == mount["mountPath"]
    assert Path(install.bin_dir) == Path("/opt/cni/bin")
    # The conflist the plugin reads on the host names the daemon's socket and release queue.
    assert (install.socket, install.release_queue_dir) == (
        str(config.socket_path),
        str(config.release_queue_dir),
    )
    # The files live as long as the container: postStart writes them again (a restart of the
    # container alone does not rerun the init container), preStop removes the same ones.
    hooks = container["lifecycle"]
    assert hooks["postStart"]["exec"]["command"] == init["command"]
    uninstall = build_parser().parse_args(hooks["preStop"]["exec"]["command"][1:])
    assert uninstall.command == "uninstall-cni"
    # ... only when the pod stops for good: not while its own DaemonSet lives (a roll).
    meta = daemonset["metadata"]
    assert uninstall.unless_daemonset_alive == f"{meta['namespace']}/{meta['name']}"
    dirs = ("bin_dir", "lib_dir", "conf_dir")
    assert [getattr(uninstall, d) for d in dirs] == [getattr(install, d) for d in dirs]
    for mount in init["volumeMounts"]:
        assert mount in container["volumeMounts"]
    # The daemon sets up interfaces inside the pods' namespaces, which appear after it started
    # (its securityContext: tests/unit/kube/test_manifest_privileges.py).
    netns = mounts["/run/netns"]
    assert netns["mountPropagation"] == "HostToContainer"
    assert volumes[netns["name"]]["hostPath"]["path"] == "/run/netns"


def test_controller_manifest_wiring(installed: object) -> None:
    deployment = _by_kind(_docs("controller.yaml"))["Deployment"]
    (subnet,) = _docs("subnet.yaml")
    assert deployment["metadata"]["namespace"] == NS
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cns-controller"
    # It hands out the pod network: it cannot wait for an address from it.
    assert pod["hostNetwork"] is True
    assert pod["tolerations"] == [{"operator": "Exists"}]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:2] == ["cns", "controller"]
    assert "--subnet" not in command  # one controller serves every ClusterSubnet
    assert subnet["metadata"]["name"] == "pod-subnet"
    assert subnet["spec"]["subnet"] == "10.240.0.0/16"
    assert subnet["spec"]["gateway"] == "10.240.0.1"
    parser = _subcommand_parser("controller")
    assert parser is not None, "`cns controller` is missing from the command line"
    parser.parse_args(command[2:])


def _kind_name(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def test_kustomization_is_every_manifest_with_the_image_set(kube: KubeCluster) -> None:
    """`kubectl kustomize config/` with the cluster's kubectl (1.20, kustomize v2.0.3): the CRDs,
    RBAC, DaemonSet and Deployment as written, every image the one `images:` names, pulled from
    the node's own store; the pod subnet and the standalone config are not part of it."""
    kubectl = kube.bin_dir / "kubectl"
    if not kubectl.exists():
        pytest.skip("kubectl is built with the node binaries (scripts/test.sh builds them)")
    rendered = subprocess.run(
        [str(kubectl), "kustomize", str(CONFIG)], check=True, capture_output=True, text=True
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    kustomization = yaml.safe_load((CONFIG / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    expected = [doc for name in kustomization["resources"] for doc in load_manifests(CONFIG / name)]
    assert sorted(map(_kind_name, docs)) == sorted(map(_kind_name, expected))
    assert not {"subnet.yaml", "cns.yaml"} & set(kustomization["resources"])
    for doc in docs:
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["image"] == f"{image['newName']}:{image['newTag']}"
            assert container["imagePullPolicy"] == "IfNotPresent"


# --------------------------------------------------------------------------- kubernetes-asyncio


async def test_kubernetes_asyncio_uses_the_generated_kubeconfig(
    kube: KubeCluster, node_config: str
) -> None:
    """Through cns's own client: its credential loading and its merge patch."""
    from cns.kube.client import connect
    from cns.kube.objects import NNC

    async with await connect(str(kube.kubeconfig_for(DAEMON_USER))) as api:
        # The apiserver's own CA, not insecure-skip-tls-verify.
        assert api.api.configuration.verify_ssl
        listed = await api.custom.list_namespaced_custom_object(
            GROUP,
            "v1alpha",
            NS,
            "nodenetworkconfigs",
            field_selector=f"metadata.name={node_config}",
        )
        assert [item["metadata"]["name"] for item in listed["items"]] == [node_config]
        patched = await api.merge_patch(
            NNC, node_config, {"spec": {"requestedIPCount": 48}}, namespace=NS
        )
        assert patched["spec"]["requestedIPCount"] == 48


async def test_the_controllers_writes_through_cns_client(
    kube: KubeCluster, node_config: str
) -> None:
    """What the controller writes, as its service account, through `cns.kube.client`: IPBlocks
    created and replaced, statuses merge-patched (the status subresource only), each write
    conditional on the resourceVersion it was planned from; a read of nothing is None."""
    import datetime as dt

    from kubernetes_asyncio.client.exceptions import ApiException

    from cns.core.allocation import Entry
    from cns.kube.client import connect
    from cns.kube.cluster_subnet import subnet_state_object, subnet_state_patch
    from cns.kube.ipblock import block_name, block_object
    from cns.kube.objects import CLUSTER_SUBNET, CLUSTER_SUBNET_STATE, IP_BLOCK, NNC, conditional

    name = unique("client")
    kube.create(cluster_subnet(name))
    block = block_name(name, 0)

    def ipblock(entries: dict[str, Entry]) -> dict[str, Any]:
        return block_object(subnet_name=name, index=0, cidr="10.240.0.0/24", entries=entries)

    try:
        async with await connect(str(kube.kubeconfig_for(CONTROLLER_USER))) as api:
            assert await api.get(IP_BLOCK, block) is None
            created = await api.create(IP_BLOCK, ipblock({"10.240.0.5": Entry("n1", "g1")}))
            assert created["spec"]["allocations"]["10.240.0.5"] == "n1 g1 -"
            with pytest.raises(ApiException) as exists:
                await api.create(IP_BLOCK, ipblock({}))
            assert exists.value.status == 409
            replaced = await api.replace(IP_BLOCK, block, conditional(ipblock({}), read=created))
            assert not replaced["spec"].get("allocations")
            with pytest.raises(ApiException) as stale:
                await api.replace(IP_BLOCK, block, conditional(ipblock({}), read=created))
            assert stale.value.status == 409

            state = await api.create(CLUSTER_SUBNET_STATE, subnet_state_object(name))
            now = dt.datetime.now(dt.UTC)
            patch = subnet_state_patch(exhausted=True, at=now)
            exhausted = await api.merge_patch(
                CLUSTER_SUBNET_STATE, name, conditional(patch, read=state), status=True
            )
            assert exhausted["status"]["exhausted"] is True
            with pytest.raises(ApiException) as stale:
                await api.merge_patch(
                    CLUSTER_SUBNET_STATE, name, conditional(patch, read=state), status=True
                )
            assert stale.value.status == 409

            cs = await api.get(CLUSTER_SUBNET, name)
            assert cs is not None
            both = {"spec": {"gateway": "10.240.0.9"}, "status": {"capacity": 7}}
            written = await api.merge_patch(
                CLUSTER_SUBNET, name, conditional(both, read=cs), status=True
            )
            assert written["status"]["capacity"] == 7
            assert "gateway" not in written["spec"]  # the status subresource ignores the spec

            nnc_status = await api.merge_patch(
                NNC, node_config, {"status": {"assignedIPCount": 3}}, namespace=NS, status=True
            )
            assert nnc_status["status"]["assignedIPCount"] == 3
            assert await api.get(NNC, unique("gone"), namespace=NS) is None

        async with await connect(str(kube.kubeconfig)) as admin:
            gateway = {"spec": {"gateway": "10.240.0.1"}}
            spec = await admin.merge_patch(CLUSTER_SUBNET, name, gateway)
            assert spec["spec"]["gateway"] == "10.240.0.1"
            assert spec["status"]["capacity"] == 7  # a patch of the object leaves the status
    finally:
        kube.delete(
            [
                cluster_subnet(name),
                subnet_state(name),
                {"apiVersion": CS_V, "kind": "IPBlock", "metadata": {"name": block}},
            ],
            wait=False,
        )


# --------------------------------------------------------------------------- harness: outages


def test_compact_etcd_expires_old_resource_versions(kube: KubeCluster, node_config: str) -> None:
    old = kube.get(NNC_V, "NodeNetworkConfig", node_config, NS)["metadata"]["resourceVersion"]
    kube.patch(NNC_V, "NodeNetworkConfig", node_config, {"spec": {"requestedIPCount": 20}}, NS)
    revision = kube.compact_etcd()
    assert revision > int(old)
    path = kube.path_for(NNC_V, "NodeNetworkConfig", namespace=NS)
    answer = kube.request(
        "GET", path, params={"resourceVersion": old, "resourceVersionMatch": "Exact"}
    )
    assert answer.status == 410, answer.body
    assert answer.json["reason"] == "Expired"


async def test_watch_caches_keep_no_managed_fields_and_nodes_only_their_identity_and_addresses(
    kube: KubeCluster, node_config: str
) -> None:
    """What a cache holds, listed and then watched: objects without server-side apply's
    managedFields, and Nodes reduced to name, uid, labels and resourceVersion."""
    import asyncio

    from cns.kube.client import connect
    from cns.kube.objects import NNC

    node = unique("slim")
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node, "labels": {"pool": "a"}, "annotations": {"big": "x" * 999}},
            "spec": {"podCIDR": "10.9.0.0/24"},
        }
    )
    listed = [{"type": "InternalIP", "address": "10.9.1.5"}]
    status = {"addresses": listed, "conditions": [{"type": "Ready", "status": "True"}]}
    kube.patch("v1", "Node", node, {"status": status}, subresource="status")
    try:
        assert kube.get("v1", "Node", node)["metadata"]["managedFields"]  # the server sends it
        async with await connect(str(kube.kubeconfig)) as admin:
            nncs = admin.watch(NNC, lambda: None, namespace=NS)
            nodes = admin.watch_nodes(lambda: None)
            running = [asyncio.create_task(c.run()) for c in (nncs, nodes)]
            try:
                await asyncio.wait_for(nodes.synced.wait(), 30)
                await asyncio.wait_for(nncs.synced.wait(), 30)
                patch = {"spec": {"requestedIPCount": 48}}
                kube.patch(NNC_V, "NodeNetworkConfig", node_config, patch, NS)
                kube.patch("v1", "Node", node, {"metadata": {"labels": {"pool": "b"}}})
                key, node_key = f"{NS}/{node_config}", f"/{node}"
                for _ in range(300):
                    watched = nncs.objects[key]["spec"].get("requestedIPCount") == 48
                    if watched and nodes.objects[node_key]["metadata"]["labels"]["pool"] == "b":
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the watch never delivered the patches")
                for obj in [*nncs.objects.values(), *nodes.objects.values()]:
                    assert "managedFields" not in obj["metadata"], obj["metadata"]
                slim = nodes.objects[node_key]
                assert set(slim) == {"metadata", "status"}
                assert set(slim["metadata"]) == {"name", "uid", "labels", "resourceVersion"}
                assert slim["status"] == {"addresses": listed}  # no conditions
            finally:
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
    finally:
        kube.request("DELETE", f"/api/v1/nodes/{node}")


async def test_a_list_in_pages_sees_every_object(
    kube: KubeCluster, installed: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch lists in pages (`LIST_PAGE`, the API server's `continue` token): with pages of
    one object, every NNC is in the cache once synced, as slimmed by the controller's cache."""
    import asyncio

    from cns.kube import watch as watch_module
    from cns.kube.client import connect
    from cns.kube.nnc import slim_nnc
    from cns.kube.objects import NNC

    names = [unique("paged") for _ in range(3)]
    for name in names:
        kube.create(nnc(name, {"requestedIPCount": 16}))
    monkeypatch.setattr(watch_module, "LIST_PAGE", 1)
    try:
        async with await connect(str(kube.kubeconfig)) as admin:
            nncs = admin.watch(NNC, lambda: None, namespace=NS, slim=slim_nnc)
            running = asyncio.create_task(nncs.run())
            try:
                await asyncio.wait_for(nncs.synced.wait(), 30)
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
        listed = kube.request("GET", kube.path_for(NNC_V, "NodeNetworkConfig", namespace=NS))
        assert len(listed.json["items"]) >= 3
        assert set(nncs.objects) == {f"{NS}/{o['metadata']['name']}" for o in listed.json["items"]}
        for name in names:
            assert nncs.objects[f"{NS}/{name}"]["spec"] == {"requestedIPCount": 16}
    finally:
        for name in names:
            kube.delete(nnc(name), wait=False)


async def test_the_daemon_source_chooses_subnets_and_reads_further_subnets_with_its_rbac(
    kube: KubeCluster, installed: object
) -> None:
    """KubeSource as the daemon runs it, with the daemon's RBAC-limited credentials: pods count
    in the subnets their own or their namespace's `acn.azure.com/subnets` annotation chooses
    (a subnet only chosen is listed, to be asked for); a further subnet's ClusterSubnet and
    ClusterSubnetState give its lane scaler and exhaustion; an ADD for a pod no watch holds
    reads it (and its namespace) from the API server."""
    import asyncio

    from cns.core.types import Scaler
    from cns.kube.client import connect
    from cns.node.control_plane import SourceState
    from cns.node.kube_source import KubeSource

    node, primary, blue, green = unique("sel"), unique("p"), unique("blue"), unique("green")
    namespace = unique("ns")
    annotation = f"{GROUP}/subnets"
    container = {**NETWORK_CONTAINER, "subnetName": primary}
    further = {**NETWORK_CONTAINER, "id": "nc-blue", "subnetName": blue, "primaryIP": "10.9.0.4",
               "subnetAddressSpace": "10.9.0.0/24", "defaultGateway": "10.9.0.1",
               "ipAssignments": [{"name": "blue-5", "ip": "10.9.0.5"}]}  # fmt: skip
    status = {"networkContainers": [container, further]}

    def pod(name: str, ns: str, on: str, subnets: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": ns}
        if subnets is not None:
            meta["annotations"] = {annotation: subnets}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"nodeName": on, "containers": [{"name": "c", "image": "busybox"}]},
        }

    objects = [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": namespace, "annotations": {annotation: green}}},
        nnc(node), cluster_subnet(blue, {"subnet": "10.9.0.0/24", "scaler": {"batchSize": 8}}),
        subnet_state(blue),
        pod("by-namespace", namespace, node), pod("by-pod", namespace, node, blue),
        pod("elsewhere", "default", "other-node", f"{blue}, {green}"),
    ]  # fmt: skip
    for doc in objects:
        kube.create(doc)
    try:
        kube.patch(NNC_V, "NodeNetworkConfig", node, {"status": status}, NS, subresource="status")
        exhausted = {"status": {"exhausted": True, "timestamp": "2026-11-27T00:00:00Z"}}
        kube.patch(CS_V, "ClusterSubnetState", blue, exhausted, subresource="status")
        async with await connect(str(kube.kubeconfig_for(DAEMON_USER))) as client:
            source = KubeSource(
                client, node_name=node, subnet_name=primary, fallback_scaler=Scaler(batch_size=16)
            )
            states: list[SourceState] = []
            running = asyncio.create_task(source.run(states.append))
            try:
                for _ in range(300):
                    lanes = states[-1].subnets if states else {}
                    if blue in lanes and lanes[blue].exhausted and green in lanes:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"never delivered: {states[-1:] or 'nothing'}")
                lane = lanes[blue]
                assert lane.scaler is not None and lane.scaler.batch_size == 8
                assert [nc.id for nc in lane.containers] == ["nc-blue"]
                assert (lane.pod_demand, lanes[green].pod_demand) == (1, 1)
                assert not lanes[green].containers and states[-1].pod_demand == 0
                assert await source.choose_subnets(namespace, "by-namespace", ()) == (green,)
                # Not on this node, so in no cache: read from the API server.
                chosen = await source.choose_subnets("default", "elsewhere", ())
                assert chosen == (blue, green)
                assert await source.choose_subnets("default", "no-such-pod", ("x",)) == ("x",)
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
    finally:
        kube.delete(objects, wait=False)


def test_ipblock_entries_of_both_forms_are_kept_and_read(
    kube: KubeCluster, installed: object
) -> None:
    """Entries are written as one string each; entries of the earlier map form, as a
    controller before that wrote them, must survive the new schema (not pruned on read) so
    that an upgraded controller still sees every claim."""
    from cns.core.allocation import Entry
    from cns.kube.ipblock import block_entries

    name = unique("forms")
    kube.create(
        {
            "apiVersion": CS_V,
            "kind": "IPBlock",
            "metadata": {"name": name},
            "spec": {
                "subnet": "forms",
                "cidr": "10.250.0.0/24",
                "allocations": {
                    "10.250.0.5": {"node": "n1", "id": "g1", "uid": "u1", "releasing": True},
                    "10.250.0.6": "n2 g2 u2 primary",
                },
            },
        }
    )
    try:
        stored = kube.get(CS_V, "IPBlock", name)
        assert block_entries(stored) == {
            "10.250.0.5": Entry("n1", "g1", releasing=True, uid="u1"),
            "10.250.0.6": Entry("n2", "g2", primary=True, uid="u2"),
        }
        # `allocations` is one atomic field: the server tracks no key of it, since the cost
        # of a write follows the fields it tracks (docs/benchmarks.md, IPBlock write cost).
        tracked = [m["fieldsV1"] for m in stored["metadata"]["managedFields"]]
        assert tracked and all(
            f["f:spec"]["f:allocations"] == {} for f in tracked if "f:spec" in f
        ), tracked
    finally:
        kube.request("DELETE", kube.path_for(CS_V, "IPBlock", name))


def test_restart_apiserver_keeps_data_and_expires_old_watches(
    kube: KubeCluster, node_config: str
) -> None:
    path = kube.path_for(NNC_V, "NodeNetworkConfig", namespace=NS)
    old = kube.get(NNC_V, "NodeNetworkConfig", node_config, NS)["metadata"]["resourceVersion"]
    kube.patch(NNC_V, "NodeNetworkConfig", node_config, {"spec": {"requestedIPCount": 24}}, NS)
    kube.stop_apiserver()
    assert not kube.apiserver_running
    with pytest.raises(OSError):
        kube.request("GET", "/readyz", timeout=2)
    kube.start_apiserver()
    assert kube.get(NNC_V, "NodeNetworkConfig", node_config, NS)["spec"]["requestedIPCount"] == 24
    # The new watch cache starts at the current revision: resuming from before the restart is 410,
    # delivered as an ERROR event in a 200 stream.
    events = list(kube.watch(path, {"resourceVersion": old, "timeoutSeconds": 2}))
    assert events[0]["type"] == "ERROR", events
    assert events[0]["object"]["code"] == 410
    kube.restart_apiserver(graceful=False)  # SIGKILL, like a crash
    assert kube.request("GET", "/readyz").status == 200
