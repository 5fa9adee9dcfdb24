"""NodeNetworkConfig and ClusterSubnetState objects in Azure's wire format, as Azure's control
plane (DNC-RC) writes them: every field of Azure's Go types filled, under Azure's JSON names
(github.com/Azure/azure-container-networking, crd/nodenetworkconfig/api/v1alpha and
crd/clustersubnetstate/api/v1alpha1), for the tests of docs/azure-compat.md.

Empty strings are left out, as Azure's `omitempty` leaves them out (and as the harness's
kube-apiserver build refuses them: tests/harness/kube_cluster.py).
"""

from __future__ import annotations

import ipaddress
import uuid
from typing import Any

from tests.harness.kube_api import CS_API, KUBE_SYSTEM, NNC_API

SUBNET_NAME = "azure-podnet"  # Azure names the NC's subnet after the VNET subnet
NODE_IP = "10.224.0.5"
NC_STATUSES = (
    "NCUpdateSuccess",
    "NCUpdateFailed",
    "NCUpdateSubnetFullError",
    "NCUpdateInternalServerError",
    "NCUpdateUnauthorizedError",
)
NNC_STATUSES = ("Updating", "Updated", "Error")
SCALER = {
    "batchSize": 16,
    "releaseThresholdPercent": 150,
    "requestThresholdPercent": 50,
    "maxIPCount": 250,
}
# What DNC-RC writes into CSS status.timestamp is not specified; both forms must be accepted.
GO_TIME_STRING = "2026-11-26 17:31:15.123456789 +0000 UTC"


def arm_ids(subnet_name: str = SUBNET_NAME) -> dict[str, str]:
    """The Azure resource ids of an NC (Azure's JSON spells `subcriptionID` so)."""
    group = "/subscriptions/6e1f2a00-0000-4000-8000-000000000001/resourceGroups/mc_pods"
    vnet = f"{group}/providers/Microsoft.Network/virtualNetworks/aks-vnet"
    return {
        "subcriptionID": "6e1f2a00-0000-4000-8000-000000000001",
        "resourceGroupID": "mc_pods",
        "vnetID": vnet,
        "subnetID": f"{vnet}/subnets/{subnet_name}",
    }


def ip_name(nc_id: str, address: str) -> str:
    """A UUID, as Azure's IP assigner names an IP, stable for the same NC and address."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{nc_id}/{address}"))


def vnet_nc(
    nc_id: str,
    cidr: str,
    count: int,
    *,
    version: int = 1,
    status: str = "NCUpdateSuccess",
    nc_type: str = "vnet",
    mode: str = "dynamic",
) -> dict[str, Any]:
    """A dynamic VNET NC (Azure's "swift" pod subnet): gateway the first host, primary IP the
    fourth (Azure keeps .1 to .3), then `count` secondary IPs; every field of Azure's type."""
    hosts = list(ipaddress.ip_network(cidr).hosts())
    secondary = [str(a) for a in hosts[4 : 4 + count]]
    return {
        "id": nc_id,
        "assignmentMode": mode,
        "type": nc_type,
        "primaryIP": str(hosts[3]),
        "primaryIPV6": "fd00:70::4",
        "subnetName": SUBNET_NAME,
        "ipAssignments": [{"name": ip_name(nc_id, a), "ip": a} for a in secondary],
        "defaultGateway": str(hosts[0]),
        "defaultGatewayV6": "fd00:70::1",
        "macAddress": "00:0d:3a:6e:1f:2a",
        "subnetAddressSpace": cidr,
        "subnetAddressSpaceV6": "fd00:70::/64",
        "version": version,
        "nodeIP": NODE_IP,
        **arm_ids(),
        "status": status,
    }


def overlay_nc(nc_id: str, pod_cidr: str = "10.244.1.0/24") -> dict[str, Any]:
    """A static overlay NC: the node's whole pod CIDR as its primary IP, no IP listed."""
    return {
        "id": nc_id,
        "assignmentMode": "static",
        "type": "overlay",
        "primaryIP": pod_cidr,
        "subnetName": SUBNET_NAME,
        "subnetAddressSpace": "10.244.0.0/16",
        "version": 0,
        "nodeIP": NODE_IP,
        **arm_ids(),
        "status": "NCUpdateSuccess",
    }


def vnetblock_nc(nc_id: str) -> dict[str, Any]:
    """A static VNET-block NC: prefixes on the NIC (primary prefix, blocks as ipAssignments)."""
    return {
        "id": nc_id,
        "assignmentMode": "static",
        "type": "vnetblock",
        "primaryIP": "10.72.0.16/28",
        "subnetName": SUBNET_NAME,
        "ipAssignments": [{"name": ip_name(nc_id, "10.72.0.32/28"), "ip": "10.72.0.32/28"}],
        "defaultGateway": "10.72.0.1",
        "macAddress": "00:0d:3a:6e:1f:2b",
        "subnetAddressSpace": "10.72.0.0/16",
        "version": 2,
        "nodeIP": NODE_IP,
        **arm_ids(),
        "status": "NCUpdateSuccess",
    }


def nnc(
    node: str,
    containers: list[dict[str, Any]],
    *,
    status: str = "Updated",
    requested: int = 16,
) -> dict[str, Any]:
    """A NodeNetworkConfig as DNC-RC holds it: owned by its Node, spec and status filled."""
    assigned = sum(len(nc.get("ipAssignments") or ()) for nc in containers)
    return {
        "apiVersion": NNC_API,
        "kind": "NodeNetworkConfig",
        "metadata": {
            "name": node,
            "namespace": KUBE_SYSTEM,
            "labels": {"managed": "true", "owner": node},
        },
        "spec": {"requestedIPCount": requested, "ipsNotInUse": [], "availabilityZone": 1},
        "status": {
            "assignedIPCount": assigned,
            "scaler": SCALER,
            "status": status,
            "networkContainers": containers,
        },
    }


def subnet_state(name: str, *, exhausted: bool, timestamp: str = GO_TIME_STRING) -> dict[str, Any]:
    """A ClusterSubnetState with Azure's status (Azure's CRD keeps it in kube-system: cns's is
    cluster-scoped, docs/azure-compat.md)."""
    return {
        "apiVersion": CS_API,
        "kind": "ClusterSubnetState",
        "metadata": {"name": name},
        "status": {"exhausted": exhausted, "timestamp": timestamp},
    }
