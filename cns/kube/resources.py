"""The custom resources as plain dicts: names, and conversion to and from the core types.

Pure functions, so the daemon adapter, the controller and the tests share one reading of the
wire format (field names match Azure CNS's NodeNetworkConfig / ClusterSubnetState).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cns.core.allocation import Entry
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, Scaler

GROUP = "acn.azure.com"
NAMESPACE = "kube-system"
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True, slots=True)
class Kind:
    version: str
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{GROUP}/{self.version}"


NNC = Kind("v1alpha", "nodenetworkconfigs", namespaced=True)
CLUSTER_SUBNET_STATE = Kind("v1alpha1", "clustersubnetstates", namespaced=False)
CLUSTER_SUBNET = Kind("v1alpha1", "clustersubnets", namespaced=False)
IP_BLOCK = Kind("v1alpha1", "ipblocks", namespaced=False)
SUBNET_LABEL = f"{GROUP}/subnet"

_SCALER_FIELDS = {
    "batchSize": "batch_size",
    "requestThresholdPercent": "request_threshold_percent",
    "releaseThresholdPercent": "release_threshold_percent",
    "maxIPCount": "max_ip_count",
}


def network_containers(nnc: dict[str, Any]) -> tuple[NetworkContainer, ...]:
    """The NCs in an NNC's status; IP configs carry no version, so all count as programmed."""
    result = []
    for nc in (nnc.get("status") or {}).get("networkContainers") or []:
        version = int(nc.get("version") or 0)
        result.append(
            NetworkContainer(
                id=str(nc["id"]),
                primary_ips=(str(nc["primaryIP"]),) if nc.get("primaryIP") else (),
                subnet=str(nc.get("subnetAddressSpace") or ""),
                gateway=str(nc.get("defaultGateway") or ""),
                ip_configs=tuple(
                    IPConfig(str(a["name"]), str(a["ip"])) for a in nc.get("ipAssignments") or []
                ),
                version=version,
                programmed_version=version,
            )
        )
    return tuple(result)


def nc_to_status(nc: NetworkContainer, subnet_name: str, node_ip: str = "") -> dict[str, Any]:
    """The wire form of one NC, as the controller writes it into an NNC's status."""
    return {
        "id": nc.id,
        "primaryIP": nc.primary_ips[0] if nc.primary_ips else "",
        "subnetName": subnet_name,
        "subnetAddressSpace": nc.subnet,
        "defaultGateway": nc.gateway,
        "nodeIP": node_ip,
        "version": nc.version,
        "ipAssignments": [{"name": c.id, "ip": c.address} for c in nc.ip_configs],
    }


def pool_request(nnc: dict[str, Any]) -> PoolRequest:
    spec = nnc.get("spec") or {}
    return PoolRequest(
        int(spec.get("requestedIPCount") or 0),
        tuple(str(ip) for ip in spec.get("ipsNotInUse") or ()),
    )


def request_patch(request: PoolRequest) -> dict[str, Any]:
    return {
        "spec": {
            "requestedIPCount": request.requested_ip_count,
            "ipsNotInUse": list(request.ips_not_in_use),
        }
    }


def scaler_to_wire(scaler: Scaler) -> dict[str, int]:
    return {wire: getattr(scaler, attr) for wire, attr in _SCALER_FIELDS.items()}


def merge_scalers(fallback: Scaler, *layers: dict[str, Any] | None) -> Scaler:
    """Field by field, the first layer that sets a field wins; `fallback` fills the rest.

    Layers in order of priority: ClusterSubnet `spec.scaler` (operator overrides), ClusterSubnet
    `status.scaler` (what the control plane computed), NNC `status.scaler`.
    """
    values = {attr: getattr(fallback, attr) for attr in _SCALER_FIELDS.values()}
    for wire, attr in _SCALER_FIELDS.items():
        for layer in layers:
            if layer and isinstance(layer.get(wire), int) and layer[wire] > 0:
                values[attr] = int(layer[wire])
                break
    merged = Scaler(**values)
    return merged if not merged.problems() else fallback


def counts_as_demand(pod: dict[str, Any]) -> bool:
    """A pod on the node that will want an IP from us (docs/design/subnet-scarcity.md, 3-1).

    Not host-network pods, finished pods, or pods being deleted (one that already has its IP is
    counted as assigned until its DEL; one that has none will never ask).
    """
    spec = pod.get("spec") or {}
    if spec.get("hostNetwork") or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    phase = (pod.get("status") or {}).get("phase")
    return phase not in ("Succeeded", "Failed")


def release_requests(nnc: dict[str, Any]) -> tuple[str, ...]:
    """`status.ipsToRelease`: IP names the control plane asks the node to give up."""
    return tuple(str(name) for name in (nnc.get("status") or {}).get("ipsToRelease") or ())


def block_name(subnet_name: str, index: int) -> str:
    return f"{subnet_name}-b{index}"


def block_entries(block: dict[str, Any]) -> dict[str, Entry]:
    """The allocations of one IPBlock; an entry that is not well formed is left out (the
    address then counts as free in this block, and the audit sees it if a node lists it)."""
    result: dict[str, Entry] = {}
    allocations = (block.get("spec") or {}).get("allocations") or {}
    if not isinstance(allocations, dict):
        return result
    for address, value in allocations.items():
        if not isinstance(value, dict) or not value.get("node") or not value.get("id"):
            continue
        result[str(address)] = Entry(
            node=str(value["node"]),
            id=str(value["id"]),
            primary=bool(value.get("primary", False)),
            releasing=bool(value.get("releasing", False)),
            uid=str(value.get("uid") or ""),
        )
    return result


def block_object(
    subnet_name: str, index: int, cidr: str, entries: dict[str, Entry]
) -> dict[str, Any]:
    """An IPBlock as the controller writes it (metadata.resourceVersion added by the caller)."""
    allocations: dict[str, dict[str, Any]] = {}
    for address, entry in sorted(entries.items()):
        wire: dict[str, Any] = {"node": entry.node, "id": entry.id, "uid": entry.uid}
        if entry.primary:
            wire["primary"] = True
        if entry.releasing:
            wire["releasing"] = True
        allocations[address] = wire
    return {
        "apiVersion": IP_BLOCK.api_version,
        "kind": "IPBlock",
        "metadata": {"name": block_name(subnet_name, index), "labels": {SUBNET_LABEL: subnet_name}},
        "spec": {"subnet": subnet_name, "cidr": cidr, "allocations": allocations},
    }
