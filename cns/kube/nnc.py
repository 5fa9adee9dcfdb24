"""The NodeNetworkConfig: the node's requests (`spec`), the subnets it is in, and what the
controller writes of it (a new NNC, its subnet label, its status) and keeps in its cache
(`slim_nnc`). Its network containers are read in `cns.kube.nnc_containers`.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

from cns.core.types import IPConfig, NetworkContainer, PoolRequest, Scaler
from cns.kube.nnc_containers import USABLE_VALUES, ip_configs, nc_to_status, wire_containers
from cns.kube.objects import NNC, SUBNET_LABEL, conditional, interned, interned_list, kept
from cns.kube.scalers import scaler_to_wire
from cns.kube.wire import (
    NNCSpec,
    NNCStatus,
    NodeNetworkConfig,
    ObjectMeta,
    RequestFields,
    SubnetRequest,
    WireNetworkContainer,
    WireScaler,
)


def _request_of(fields: RequestFields) -> PoolRequest:
    """A request's three fields: the NNC spec's own, or one of its `spec.subnets` entries."""
    return PoolRequest(
        int(fields.get("requestedIPCount") or 0),
        tuple(str(ip) for ip in fields.get("ipsNotInUse") or ()),
        tuple(str(ip) for ip in fields.get("requestedIPs") or ()),
    )


def pool_request(nnc: NodeNetworkConfig) -> PoolRequest:
    """The node's request of its primary subnet (the one the controller placed it in)."""
    return _request_of(nnc.get("spec") or {})


def subnet_requests(nnc: NodeNetworkConfig) -> dict[str, PoolRequest]:
    """`spec.subnets`: the node's requests of further ClusterSubnets, by name, in the order it
    lists them. An entry that names no subnet is no request; of two naming one subnet (which
    the CRD refuses), the first counts. May name the primary subnet: the caller ignores that."""
    return {name: _request_of(item) for name, item in _subnet_entries(nnc).items()}


def subnet_names(nnc: NodeNetworkConfig) -> tuple[str, ...]:
    """The subnets `spec.subnets` names, in its order (`subnet_requests` without parsing the
    requests, so never raising)."""
    return tuple(_subnet_entries(nnc))


def _subnet_entries(nnc: NodeNetworkConfig) -> dict[str, SubnetRequest]:
    """`spec.subnets` by name; nothing where it is not a list (or the spec not an object)."""
    spec = nnc.get("spec")
    items = spec.get("subnets") if isinstance(spec, dict) else None
    entries: dict[str, SubnetRequest] = {}
    for item in items if isinstance(items, list) else ():
        name = item.get("name") if isinstance(item, dict) else None
        if isinstance(name, str) and name and name not in entries:
            entries[name] = item
    return entries


def subnet_request(nnc: NodeNetworkConfig, subnet_name: str) -> PoolRequest:
    """The node's request of one subnet: the spec's own fields for its primary subnet, its
    `spec.subnets` entry for a further one (none asked: nothing requested)."""
    if nnc_subnet(nnc) == subnet_name:
        return pool_request(nnc)
    return subnet_requests(nnc).get(subnet_name) or PoolRequest(0)


def further_subnets(nnc: NodeNetworkConfig) -> tuple[str, ...]:
    """The ClusterSubnets a NodeNetworkConfig takes addresses from besides its primary one
    (`nnc_subnet`): those its network containers hold, then those `spec.subnets` asks for.
    Those asked for only once it holds a container: the primary subnet's container comes first
    in `status.networkContainers` (what Azure's control plane and `nnc_subnet` read), so no
    further one is created before it."""
    primary = nnc_subnet(nnc)
    held = _container_subnets(nnc)
    asked = subnet_names(nnc) if held else ()
    return tuple(name for name in dict.fromkeys([*held, *asked]) if name != primary)


def _container_subnets(nnc: NodeNetworkConfig) -> list[str]:
    """The `subnetName`s of an NNC's network containers, in their order."""
    return [
        str(nc["subnetName"])
        for nc in wire_containers(nnc)
        if isinstance(nc, dict) and isinstance(nc.get("subnetName"), str) and nc["subnetName"]
    ]


def _request_fields(request: PoolRequest) -> RequestFields:
    return {
        "requestedIPCount": request.requested_ip_count,
        "ipsNotInUse": list(request.ips_not_in_use),
        "requestedIPs": list(request.requested_ips),
    }


def request_patch(
    request: PoolRequest, further: dict[str, PoolRequest] | None = None
) -> NodeNetworkConfig:
    """The merge patch of an NNC's spec: the primary subnet's request and, when `further` is
    given, `spec.subnets` (replaced whole, as a merge patch replaces a list)."""
    spec = cast(NNCSpec, _request_fields(request))  # with `subnets` to come
    if further is not None:
        spec["subnets"] = [{"name": name, **_request_fields(r)} for name, r in further.items()]
    return {"spec": spec}


def release_requests(nnc: NodeNetworkConfig) -> tuple[str, ...]:
    """`status.ipsToRelease`: IP names the control plane asks the node to give up."""
    return tuple(str(name) for name in (nnc.get("status") or {}).get("ipsToRelease") or ())


def nnc_object(
    *, node_name: str, node_uid: str, namespace: str, subnet_name: str
) -> NodeNetworkConfig:
    """A new node's NodeNetworkConfig, owned by its Node object so that it goes with it, and
    labelled with the subnet it takes its addresses from ("": none serves it yet)."""
    meta: ObjectMeta = {
        "name": node_name,
        "namespace": namespace,
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}
        ],
    }
    if subnet_name:
        meta["labels"] = {SUBNET_LABEL: subnet_name}
    return {
        "apiVersion": NNC.api_version,
        "kind": "NodeNetworkConfig",
        "metadata": meta,
        "spec": {"requestedIPCount": 0},
    }


def nnc_recreation(
    previous: ObjectMeta,
    *,
    node_name: str,
    namespace: str,
    subnet_name: str,
    spec: NNCSpec,
) -> NodeNetworkConfig:
    """The NodeNetworkConfig a node creates again when its own was deleted under it: the labels
    and owner (the Node) of the one it saw last (`previous`, its metadata), the subnet label
    the controller sets (`subnet_name`, when the old one had none), and `spec`."""
    meta: ObjectMeta = {"name": node_name, "namespace": namespace}
    labels = previous.get("labels")
    labels = dict(labels) if isinstance(labels, dict) else {}
    if subnet_name:
        labels.setdefault(SUBNET_LABEL, subnet_name)
    if labels:
        meta["labels"] = labels
    owners = previous.get("ownerReferences")
    if isinstance(owners, list) and owners:
        meta["ownerReferences"] = owners
    return {
        "apiVersion": NNC.api_version,
        "kind": "NodeNetworkConfig",
        "metadata": meta,
        "spec": spec,
    }


def nnc_subnet(nnc: NodeNetworkConfig) -> str:
    """The ClusterSubnet a NodeNetworkConfig takes its addresses from ("" while none).

    Its network container's `subnetName` first: addresses in use say where the node is, whatever
    a label says (a label is writable by anyone who may patch the NNC); then the label the
    controller set when it placed the node (cns/core/placement.py)."""
    held = _container_subnets(nnc)
    if held:
        return held[0]
    labels = (nnc.get("metadata") or {}).get("labels") or {}
    value = labels.get(SUBNET_LABEL) if isinstance(labels, dict) else None
    return value if isinstance(value, str) else ""


def nnc_label_patch(read: NodeNetworkConfig, subnet_name: str) -> NodeNetworkConfig:
    """The merge patch that places an NNC read as `read` in a subnet, conditional on that read:
    if another writer placed it meanwhile, the API server refuses this one."""
    patch: NodeNetworkConfig = {"metadata": {"labels": {SUBNET_LABEL: subnet_name}}}
    return conditional(patch, read=read)


def nnc_status_patch(
    read: NodeNetworkConfig,
    *,
    scaler: Scaler | None,
    release: list[str],
    nc: NetworkContainer | None,
    subnet_name: str,
    subnet_full: bool,
) -> NodeNetworkConfig | None:
    """The merge patch of an NNC's status for one subnet's round, conditional on the version
    it was `read` at; None when it would change nothing.

    It carries the IP names the node is asked to give up and, when it changes, the subnet's
    network container. `ipsToRelease` is one list for every subnet (IP names are unique across
    them): the names this subnet asks for replace the ones of its own container, the others'
    stay. A merge patch replaces `networkContainers` whole, so the other subnets' containers
    are written back as `read` has them (a write for one subnet never drops another's), in the
    wire order: the primary subnet's first, then those of `spec.subnets` in its order.

    `scaler` is given for the node's primary subnet only: the scaler, `assignedIPCount` and
    `status` are that subnet's (what Azure's control plane writes). A further subnet's scaler
    and exhaustion are read by the node from that subnet's ClusterSubnet and state."""
    status = read.get("status") or {}
    releases = _releases(read, subnet_name, release)
    wire_scaler = scaler_to_wire(scaler) if scaler is not None else None
    if (
        nc is None
        and (wire_scaler is None or status.get("scaler") == wire_scaler)
        and list(status.get("ipsToRelease") or ()) == releases
    ):
        return None
    written: NNCStatus = {"ipsToRelease": releases}
    if wire_scaler is not None:
        written["scaler"] = wire_scaler
        written["status"] = "Updated"
    if nc is not None:
        written["networkContainers"] = _containers_with(read, nc, subnet_name)
        if wire_scaler is not None:
            written["assignedIPCount"] = len(nc.ip_configs)
            if subnet_full:
                written["status"] = "SubnetFull"
    patch: NodeNetworkConfig = {"status": written}
    return conditional(patch, read=read)


def _releases(read: NodeNetworkConfig, subnet_name: str, release: list[str]) -> list[str]:
    """`ipsToRelease` after one subnet's round: what it asks for, plus the names asked for
    before that another subnet's container still lists (a name no container lists any more
    was given up already)."""
    others = {
        config.id
        for nc_subnet, configs in _container_configs(read)
        if nc_subnet != subnet_name
        for config in configs
    }
    kept = [str(name) for name in (read.get("status") or {}).get("ipsToRelease") or ()]
    return sorted({*(name for name in kept if name in others), *release})


def _container_configs(read: NodeNetworkConfig) -> list[tuple[str, tuple[IPConfig, ...]]]:
    """Each network container's subnet name and IP configs (none where they do not parse)."""
    result = []
    for nc in wire_containers(read):
        if isinstance(nc, dict):
            configs: tuple[IPConfig, ...] = ()
            with contextlib.suppress(KeyError, TypeError):
                configs = ip_configs(nc.get("ipAssignments") or ())
            result.append((str(nc.get("subnetName") or ""), configs))
    return result


def _containers_with(
    read: NodeNetworkConfig, nc: NetworkContainer, subnet_name: str
) -> list[WireNetworkContainer]:
    """The NNC's network containers in wire form, the one of `subnet_name` being `nc`."""
    result = [
        _container_wire(other)
        for other in wire_containers(read)
        if isinstance(other, dict) and other.get("subnetName") != subnet_name
    ]
    result.append(nc_to_status(nc, subnet_name=subnet_name))
    order = dict.fromkeys([nnc_subnet(read), *subnet_names(read)])
    rank = {name: i for i, name in enumerate(order)}

    def place(container: WireNetworkContainer) -> int:
        name = container.get("subnetName")
        return rank.get(name, len(rank)) if isinstance(name, str) else len(rank)

    return sorted(result, key=place)


def _container_wire(nc: WireNetworkContainer) -> WireNetworkContainer:
    """A network container read from the API server (or slimmed, `slim_nnc`), to write back
    as it is: the fields the controller writes (the same as `slim_nnc` keeps)."""
    wire = cast(WireNetworkContainer, kept(nc, _NC_FIELDS))
    if "ipAssignments" in nc:
        assignments = nc["ipAssignments"]
        with contextlib.suppress(KeyError, TypeError):
            assignments = [{"name": c.id, "ip": c.address} for c in ip_configs(assignments)]
        wire["ipAssignments"] = assignments
    return wire


# What the controller writes of a container besides its addresses: kept in the cache, so that a
# write for one subnet puts the other subnets' containers back as they are (`nnc_status_patch`).
_NC_FIELDS = (
    "id",
    "primaryIP",
    "subnetName",
    "subnetAddressSpace",
    "defaultGateway",
    "nodeIP",
    "version",
    *USABLE_VALUES,
)
_scalers: dict[tuple[tuple[str, Any], ...], WireScaler] = {}


def _slim_nc(nc: Any, known: tuple[tuple[IPConfig, ...], ...]) -> Any:
    if not isinstance(nc, dict):
        return nc
    slimmed = kept(nc, _NC_FIELDS)
    if "ipAssignments" in nc:
        assignments = nc["ipAssignments"]
        # Parsed here when it parses: the planning state's NodeView then holds these very
        # IPConfig objects (`network_containers` passes a tuple through) instead of its own
        # beside a dict per address. One that does not parse is kept, to fail where it did.
        with contextlib.suppress(KeyError, TypeError):
            assignments = ip_configs(assignments)
            assignments = next((k for k in known if k == assignments), assignments)
        slimmed["ipAssignments"] = assignments
    return slimmed


def _shared_scaler(scaler: Any) -> Any:
    """One dict for every NNC whose scaler is the same: thousands of NNCs carry one value."""
    if not isinstance(scaler, dict) or not all(
        isinstance(v, int | str | None) for v in scaler.values()
    ):
        return scaler
    key = tuple(sorted(scaler.items()))
    shared = _scalers.get(key)
    if shared is None and len(_scalers) < 64:  # a few values in any real cluster
        shared = _scalers[key] = cast(WireScaler, scaler)
    return shared if shared is not None else scaler


def slim_nnc(nnc: NodeNetworkConfig, *known: tuple[IPConfig, ...]) -> NodeNetworkConfig:
    """A NodeNetworkConfig as the controller's cache keeps it: only what the controller reads
    (`nnc_subnet`, `node_view`, `pool_request`, `subnet_requests`, `nnc_status_patch`,
    `conditional`, the cache's key), strings interned: the addresses and IP config names are
    the planning state's own strings then, and a cache of 5,000 NNCs no longer holds each
    address twice. Read-only, as every cached object is (the scaler dict is shared between
    NNCs).

    A container whose IP configs equal one of `known` (what the controller just wrote) keeps
    that tuple rather than the reply's copy: a round that grants every node its addresses
    would otherwise hold them twice until its plan is gone (the leader's memory peak).

    Not for the daemon: its NNC is one object and it reads more of it."""
    meta = nnc.get("metadata")
    slim: dict[str, Any] = {  # built from unchecked input, shape by shape
        "metadata": kept(meta, ("name", "namespace", "uid", "resourceVersion")),
    }
    if isinstance(meta, dict) and "labels" in meta:
        labels = meta["labels"]
        slim["metadata"]["labels"] = (
            {interned(k): interned(v) for k, v in labels.items()}
            if isinstance(labels, dict)
            else labels
        )
    spec = nnc.get("spec")
    if "spec" in nnc:
        slim["spec"] = spec
        if isinstance(spec, dict):
            slim["spec"] = {
                name: interned_list(spec[name])
                for name in ("requestedIPCount", "ipsNotInUse", "requestedIPs", "subnets")
                if name in spec
            }
    status = nnc.get("status")
    if "status" in nnc:
        slim["status"] = status
        if isinstance(status, dict):
            slim_status: NNCStatus = {}
            if "scaler" in status:
                slim_status["scaler"] = _shared_scaler(status["scaler"])
            if "ipsToRelease" in status:
                slim_status["ipsToRelease"] = interned_list(status["ipsToRelease"])
            if "networkContainers" in status:
                containers = status["networkContainers"]
                slim_status["networkContainers"] = (
                    [_slim_nc(nc, known) for nc in containers]
                    if isinstance(containers, list)
                    else containers
                )
            slim["status"] = slim_status
    return cast(NodeNetworkConfig, slim)
