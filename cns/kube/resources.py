"""The custom resources as plain dicts: names, and conversion to and from the core types.

Pure functions, so the daemon adapter, the controller and the tests share one reading of the
wire format (field names match Azure CNS's NodeNetworkConfig / ClusterSubnetState). Every object
and patch cns writes is built here; `cns.kube.client` only sends them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import re
import socket
from dataclasses import dataclass
from sys import intern
from typing import Any

from cni_plugin.skel import MAX_SUBNET_NAME_LENGTH, MAX_SUBNETS
from cns.core.allocation import Entry, is_record_word
from cns.core.requested import POD_ADDRESS_ANNOTATION, parse_requested
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, Scaler, SubnetStatus
from cns.node.control_plane import IgnoredContainer, SubnetChoiceInvalid

GROUP = "acn.azure.com"


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
    "minIPCount": "min_ip_count",
}


# What the node's data path can use (docs/azure-compat.md): IPs handed out one by one, listed
# in ipAssignments (assignmentMode dynamic), each a secondary address of a VNET subnet (type
# vnet). "" is a container written without the field; Azure's schema defaults both to these.
USABLE_VALUES = {"assignmentMode": ("", "dynamic"), "type": ("", "vnet")}


def _wire_containers(nnc: dict[str, Any]) -> list[dict[str, Any]]:
    """`status.networkContainers`; [] where it (or the status) is not what the CRD says."""
    status = nnc.get("status")
    containers = status.get("networkContainers") if isinstance(status, dict) else None
    return list(containers) if isinstance(containers, list) else []


def _unusable(nc: dict[str, Any]) -> list[tuple[str, str]]:
    """The (field, value) pairs of a wire NC the node cannot honour; [] when it can use it."""
    values = ((name, str(nc.get(name) or "")) for name in USABLE_VALUES)
    return [(name, value) for name, value in values if value not in USABLE_VALUES[name]]


def mentioned_addresses(nnc: dict[str, Any]) -> set[str]:
    """Every address an NNC's network containers mention, in its canonical spelling, whether or
    not the container or entry is usable (`read_containers` leaves some out): for a decision
    that must not miss one, such as whether an address may be freed."""
    found: set[str] = set()
    pending: list[Any] = list(_wire_containers(nnc))
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                found.add(str(ipaddress.ip_interface(value.strip()).ip))
    return found


def network_containers(nnc: dict[str, Any]) -> tuple[NetworkContainer, ...]:
    """The checked NCs of an NNC's status (`read_containers`), without what it left out."""
    return read_containers(nnc)[0]


def ignored_containers(nnc: dict[str, Any]) -> tuple[IgnoredContainer, ...]:
    """What `read_containers` leaves out of an NNC's status, each with its reason."""
    return read_containers(nnc)[1]


def read_containers(
    nnc: dict[str, Any],
) -> tuple[tuple[NetworkContainer, ...], tuple[IgnoredContainer, ...]]:
    """The network containers of an NNC's status the node can use, each checked, and what was
    left out: a container it cannot honour (`USABLE_VALUES`) or whose id, subnet, primary IP or
    gateway is invalid, whole, one entry per field at fault; an invalid `ipAssignments` entry
    alone (`_checked_configs`). The control plane's data is input: nothing left out reaches a
    pod. IP configs carry no version, so all count as programmed.

    A primary IP written as a prefix (Azure's control plane may) is read as its address.
    Addresses and IP config names are interned here and in `block_entries`: the controller's
    planning state then holds one copy of each where it would hold three (the NNC's listing,
    the IPBlock's key and entry): 480 bytes an address instead of 632."""
    result = []
    left_out: list[IgnoredContainer] = []
    for nc in _wire_containers(nnc):
        if not isinstance(nc, dict):
            left_out.append(IgnoredContainer("", "networkContainers", _shown(nc), "not an object"))
            continue
        shown_id = nc["id"] if isinstance(nc.get("id"), str) else _shown(nc.get("id"))
        unusable = _unusable(nc)
        if unusable:
            left_out += (IgnoredContainer(shown_id, name, value) for name, value in unusable)
            continue
        problems = _container_problems(nc)
        if problems:
            left_out += (IgnoredContainer(shown_id, *problem) for problem in problems)
            continue
        nc_id = str(nc["id"])
        network = ipaddress.ip_network(nc["subnetAddressSpace"])
        primary = _host_address(_primary_address(nc), network)[0]
        gateway = _host_address(nc.get("defaultGateway") or "", network)[0]
        configs, rejected = _checked_configs(
            nc.get("ipAssignments") or (), network, primary=primary, gateway=gateway
        )
        left_out += (IgnoredContainer(nc_id, *problem) for problem in rejected)
        version = int(nc.get("version") or 0)
        result.append(
            NetworkContainer(
                id=nc_id,
                primary_ips=(primary,) if primary else (),
                subnet=str(network),
                gateway=gateway,
                ip_configs=configs,
                version=version,
                programmed_version=version,
                subnet_name=str(nc.get("subnetName") or ""),
            )
        )
    return tuple(result), tuple(left_out)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_SHOWN_CHARACTERS = 200  # of a rejected value, in logs, /debug and metrics


def _shown(value: Any) -> str:
    """A rejected value as text, cut short: it may be anything, of any size."""
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= _SHOWN_CHARACTERS else text[:_SHOWN_CHARACTERS] + "..."


def _primary_address(nc: dict[str, Any]) -> str:
    """`primaryIP` as an address: a prefix (`10.70.0.4/32`) read as its address; "" unset."""
    return str(nc.get("primaryIP") or "").split("/")[0]


def _container_problems(nc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, value, reason) for each of a container's own fields that is invalid: `id` a
    non-empty string, `version` (when set) a whole number, `subnetAddressSpace` a prefix
    without host bits, `primaryIP` (when set)
    an address of it, `defaultGateway` (when set) a host address of it."""
    problems = []
    nc_id = nc.get("id")
    if not isinstance(nc_id, str) or not nc_id:
        problems.append(("id", _shown(nc_id), "not a non-empty string"))
    version = nc.get("version")
    if version is not None and (type(version) is not int or version < 0):
        problems.append(("version", _shown(version), "not a whole number of at least 0"))
    space = nc.get("subnetAddressSpace")
    network = _network(space)
    if network is None:
        problems.append(("subnetAddressSpace", _shown(space), _network_problem(space)))
        return problems
    primary = _primary_address(nc)
    if primary:
        problem = _host_address(primary, network)[1]
        if problem in ("not an address", "outside the subnet"):  # any address of it will do
            problems.append(("primaryIP", _shown(nc.get("primaryIP")), problem))
    gateway = nc.get("defaultGateway")
    if gateway:
        problem = _host_address(gateway, network)[1]
        if problem:
            problems.append(("defaultGateway", _shown(gateway), problem))
    return problems


def _network(value: Any) -> Network | None:
    """A prefix written without host bits, or None."""
    if not isinstance(value, str) or "/" not in value:
        return None
    try:
        return ipaddress.ip_network(value)
    except ValueError:
        return None


def _network_problem(value: Any) -> str:
    if isinstance(value, str) and "/" in value:
        with contextlib.suppress(ValueError):
            ipaddress.ip_network(value, strict=False)
            return "has host bits set (not the subnet's own address)"
    return "not a prefix (address/length)"


def _checked_configs(
    assignments: Any, network: Network, *, primary: str, gateway: str
) -> tuple[tuple[IPConfig, ...], list[tuple[str, str, str, str]]]:
    """An NC's `ipAssignments` as IP configs, and (field, value, reason, name) for each entry
    left out: a `name` that is not a non-empty string or was listed before; an `ip` that is not
    a plain address (no prefix) of `network`, is its network or broadcast address, the primary
    IP, the gateway, or an address listed before. A tuple (one `slim_nnc` parsed already) is
    checked too, and passed through when nothing is left out."""
    if isinstance(assignments, tuple) and _all_hosts(
        assignments, network, primary=primary, gateway=gateway
    ):
        return assignments, []
    configs: list[IPConfig] = []
    rejected: list[tuple[str, str, str, str]] = []
    seen: set[str] = set()
    names: set[str] = set()
    items = assignments if isinstance(assignments, list | tuple) else [assignments]
    name: Any
    value: Any
    for item in items:
        if isinstance(item, IPConfig):
            name, value = item.id, item.address
        elif isinstance(item, dict):
            name, value = item.get("name"), item.get("ip")
        else:
            rejected.append(("ipAssignments", _shown(item), "not an object", ""))
            continue
        if not isinstance(name, str) or not name or name in names:
            reason = "listed twice" if isinstance(name, str) and name else "not a non-empty string"
            rejected.append(("ipAssignments.name", _shown(name), reason, _shown(value)))
            continue
        address, problem = _host_address(value, network)
        if not problem:
            problem = (
                "the container's primary IP"
                if address == primary
                else "the container's gateway"
                if address == gateway
                else "listed twice"
                if address in seen
                else ""
            )
        if problem:
            rejected.append(("ipAssignments.ip", _shown(value), problem, name))
            continue
        seen.add(address)
        names.add(name)
        unchanged = isinstance(item, IPConfig) and address == value
        configs.append(item if unchanged else IPConfig(intern(name), intern(address)))
    if (
        isinstance(assignments, tuple)
        and len(configs) == len(assignments)
        and all(a is b for a, b in zip(configs, assignments, strict=True))
    ):
        return assignments, rejected
    return tuple(configs), rejected


def _all_hosts(
    configs: tuple[IPConfig, ...], network: Network, *, primary: str, gateway: str
) -> bool:
    """Whether every one of an IPv4 container's parsed IP configs passes `_checked_configs`,
    checked in bulk: the controller's cache holds them parsed (`slim_nnc`), and its full reads
    (start, the periodic consistency check) check every NNC's."""
    if network.version != 4 or not all(type(c) is IPConfig for c in configs):
        return False
    names = {c.id for c in configs}
    addresses = {c.address for c in configs}
    if len(names) != len(configs) or len(addresses) != len(configs) or "" in names:
        return False
    if primary in addresses or gateway in addresses:
        return False
    try:
        numbers = [int.from_bytes(socket.inet_pton(socket.AF_INET, a), "big") for a in addresses]
    except (OSError, TypeError):
        return False
    first, last = int(network.network_address), int(network.broadcast_address)
    if network.num_addresses > 2:
        first, last = first + 1, last - 1
    return not numbers or (first <= min(numbers) and max(numbers) <= last)


def _host_address(value: Any, network: Network) -> tuple[str, str]:
    """(the address `value` writes, canonical; why it is not a host address of `network`, or
    ""). An IPv4 address is read with `inet_pton` (strict dotted quad, so its text is already
    canonical): a third of the time `ipaddress` takes, for NCs of 30,000 addresses."""
    if not isinstance(value, str):
        return "", "not an address"
    if network.version == 4:
        try:
            number = int.from_bytes(socket.inet_pton(socket.AF_INET, value), "big")
        except OSError:
            return "", "outside the subnet" if _parses(socket.AF_INET6, value) else "not an address"
        address = value
    else:
        try:
            ip = ipaddress.IPv6Address(value) if "%" not in value else None
        except ValueError:
            ip = None
        if ip is None:
            return "", "outside the subnet" if _parses(socket.AF_INET, value) else "not an address"
        number, address = int(ip), str(ip)
    first, last = int(network.network_address), int(network.broadcast_address)
    if not first <= number <= last:
        return address, "outside the subnet"
    if network.num_addresses > 2:
        if number == first:
            return address, "the subnet's network address"
        if network.version == 4 and number == last:
            return address, "the subnet's broadcast address"
    return address, ""


def _parses(family: socket.AddressFamily, value: str) -> bool:
    try:
        socket.inet_pton(family, value)
    except OSError:
        return False
    return True


def _ip_configs(assignments: Any) -> tuple[IPConfig, ...]:
    """An NC's `ipAssignments` as IP configs; a tuple is one `slim_nnc` parsed already."""
    if isinstance(assignments, tuple):
        return assignments
    return tuple(IPConfig(intern(str(a["name"])), intern(str(a["ip"]))) for a in assignments)


def nc_to_status(nc: NetworkContainer, *, subnet_name: str, node_ip: str = "") -> dict[str, Any]:
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


def _request_of(fields: dict[str, Any]) -> PoolRequest:
    """A request's three fields: the NNC spec's own, or one of its `spec.subnets` entries."""
    return PoolRequest(
        int(fields.get("requestedIPCount") or 0),
        tuple(str(ip) for ip in fields.get("ipsNotInUse") or ()),
        tuple(str(ip) for ip in fields.get("requestedIPs") or ()),
    )


def pool_request(nnc: dict[str, Any]) -> PoolRequest:
    """The node's request of its primary subnet (the one the controller placed it in)."""
    return _request_of(nnc.get("spec") or {})


def subnet_requests(nnc: dict[str, Any]) -> dict[str, PoolRequest]:
    """`spec.subnets`: the node's requests of further ClusterSubnets, by name, in the order it
    lists them. An entry that names no subnet is no request; of two naming one subnet (which
    the CRD refuses), the first counts. May name the primary subnet: the caller ignores that."""
    return {name: _request_of(item) for name, item in _subnet_entries(nnc).items()}


def subnet_names(nnc: dict[str, Any]) -> tuple[str, ...]:
    """The subnets `spec.subnets` names, in its order (`subnet_requests` without parsing the
    requests, so never raising)."""
    return tuple(_subnet_entries(nnc))


def _subnet_entries(nnc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`spec.subnets` by name; nothing where it is not a list (or the spec not an object)."""
    spec = nnc.get("spec")
    items = spec.get("subnets") if isinstance(spec, dict) else None
    entries: dict[str, dict[str, Any]] = {}
    for item in items if isinstance(items, list) else ():
        name = item.get("name") if isinstance(item, dict) else None
        if isinstance(name, str) and name and name not in entries:
            entries[name] = item
    return entries


def subnet_request(nnc: dict[str, Any], subnet_name: str) -> PoolRequest:
    """The node's request of one subnet: the spec's own fields for its primary subnet, its
    `spec.subnets` entry for a further one (none asked: nothing requested)."""
    if nnc_subnet(nnc) == subnet_name:
        return pool_request(nnc)
    return subnet_requests(nnc).get(subnet_name) or PoolRequest(0)


def further_subnets(nnc: dict[str, Any]) -> tuple[str, ...]:
    """The ClusterSubnets a NodeNetworkConfig takes addresses from besides its primary one
    (`nnc_subnet`): those its network containers hold, then those `spec.subnets` asks for.
    Those asked for only once it holds a container: the primary subnet's container comes first
    in `status.networkContainers` (what Azure's control plane and `nnc_subnet` read), so no
    further one is created before it."""
    primary = nnc_subnet(nnc)
    held = _container_subnets(nnc)
    asked = subnet_names(nnc) if held else ()
    return tuple(name for name in dict.fromkeys([*held, *asked]) if name != primary)


def _container_subnets(nnc: dict[str, Any]) -> list[str]:
    """The `subnetName`s of an NNC's network containers, in their order."""
    return [
        str(nc["subnetName"])
        for nc in _wire_containers(nnc)
        if isinstance(nc, dict) and isinstance(nc.get("subnetName"), str) and nc["subnetName"]
    ]


def _request_fields(request: PoolRequest) -> dict[str, Any]:
    return {
        "requestedIPCount": request.requested_ip_count,
        "ipsNotInUse": list(request.ips_not_in_use),
        "requestedIPs": list(request.requested_ips),
    }


def request_patch(
    request: PoolRequest, further: dict[str, PoolRequest] | None = None
) -> dict[str, Any]:
    """The merge patch of an NNC's spec: the primary subnet's request and, when `further` is
    given, `spec.subnets` (replaced whole, as a merge patch replaces a list)."""
    spec = _request_fields(request)
    if further is not None:
        spec["subnets"] = [{"name": name, **_request_fields(r)} for name, r in further.items()]
    return {"spec": spec}


def annotations_of(obj: dict[str, Any]) -> dict[str, Any]:
    """An object's annotations ({} without any, or when they are not a mapping)."""
    annotations = (obj.get("metadata") or {}).get("annotations")
    return annotations if isinstance(annotations, dict) else {}


def pod_address(pod: dict[str, Any]) -> str | None:
    """The address a pod asks for in its `acn.azure.com/ip-address` annotation, or one per
    family separated by a comma (`10.240.0.9,fd00::9`), canonical; None without one.
    ValueError saying what is wrong when the annotation is not that."""
    value = annotations_of(pod).get(POD_ADDRESS_ANNOTATION)
    if value is None:
        return None
    return ",".join(parse_requested(str(value))) or None


SUBNETS_ANNOTATION = f"{GROUP}/subnets"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class AnnotationInvalid(SubnetChoiceInvalid):
    """An `acn.azure.com/subnets` annotation that names no usable list of subnets: `problem`
    says why, `where` which object carries it (`pod NS/NAME` or `namespace NS`)."""

    def __init__(self, where: str, value: str, problem: str) -> None:
        super().__init__(f"annotation {SUBNETS_ANNOTATION}={value[:300]!r} of {where}: {problem}")
        self.where = where
        self.value = value


def subnets_annotation_problem(value: str) -> str | None:
    """Why an `acn.azure.com/subnets` value is not a list of subnets, or None: comma-separated
    ClusterSubnet names (DNS-1123 subdomains, spaces around a name allowed), at least one, at
    most MAX_SUBNETS (the network configuration's own limit), none twice."""
    names = [name.strip() for name in value.split(",")]
    if len(names) > MAX_SUBNETS:
        return f"names {len(names)} subnets, at most {MAX_SUBNETS}"
    for index, name in enumerate(names):
        if not name:
            return f"name {index + 1} is empty"
        if len(name) > MAX_SUBNET_NAME_LENGTH or not all(
            _DNS_LABEL.fullmatch(label) for label in name.split(".")
        ):
            return (
                f"{name[:64]!r} is not a ClusterSubnet name (a DNS-1123 subdomain: lower-case "
                f"letters, digits, '-' and '.', at most {MAX_SUBNET_NAME_LENGTH} characters)"
            )
    if len(set(names)) != len(names):
        return "names a subnet twice"
    return None


def annotated_subnets(obj: dict[str, Any], where: str) -> tuple[str, ...] | None:
    """The subnets an object's `acn.azure.com/subnets` annotation names, in its order; None
    without the annotation. AnnotationInvalid (naming `where`) when it is malformed."""
    value = annotations_of(obj).get(SUBNETS_ANNOTATION)
    if value is None:
        return None
    text = str(value)
    problem = subnets_annotation_problem(text)
    if problem is not None:
        raise AnnotationInvalid(where, text, problem)
    return tuple(name.strip() for name in text.split(","))


def pod_subnets(
    pod: dict[str, Any] | None, namespace: dict[str, Any] | None, configured: tuple[str, ...]
) -> tuple[str, ...]:
    """The subnets a pod's ADD draws from, chosen as Calico chooses its IP pools: the pod's
    annotation, else its namespace's, else the network configuration's `subnets`; () means the
    node's primary subnet. None for an object that does not exist (or is not known). A
    malformed annotation is AnnotationInvalid, never a fall back to the next choice: the pod
    would land in a subnet nobody chose."""
    if pod is not None:
        meta = pod.get("metadata") or {}
        where = f"pod {meta.get('namespace', '')}/{meta.get('name', '')}"
        if (chosen := annotated_subnets(pod, where)) is not None:
            return chosen
    if namespace is not None:
        where = f"namespace {(namespace.get('metadata') or {}).get('name', '')}"
        if (chosen := annotated_subnets(namespace, where)) is not None:
            return chosen
    return configured


def namespace_identity(namespace: dict[str, Any]) -> dict[str, Any]:
    """A Namespace as the daemon keeps it: name, resourceVersion and the one annotation it
    reads (labels, finalizers and status are nothing to it; every node holds every namespace)."""
    meta = namespace.get("metadata") or {}
    kept: dict[str, Any] = {key: meta[key] for key in ("name", "resourceVersion") if key in meta}
    annotations = annotations_of(namespace)
    if SUBNETS_ANNOTATION in annotations:
        kept["annotations"] = {SUBNETS_ANNOTATION: annotations[SUBNETS_ANNOTATION]}
    return {"metadata": kept}


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


def pod_may_use_ip(pod: dict[str, Any]) -> bool:
    """Not finished (Succeeded, Failed) and not being deleted: its sandbox may still want the IP
    it has, or be re-created and want one."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def pod_network_addresses(pod: dict[str, Any]) -> tuple[str, ...]:
    """The addresses the API says a pod holds on the pod network (`status.podIPs`, else
    `status.podIP`), for a pod that may still use them (`counts_as_demand`): none for a
    host-network pod (its are the node's), nor for a finished pod or one being deleted (its DEL
    may have come already: the API's status lags behind it, and the leak check would take the
    address back anyway)."""
    if not counts_as_demand(pod):
        return ()
    status = pod.get("status") or {}
    listed = status.get("podIPs") or [{"ip": status.get("podIP")}]
    found = [item.get("ip") for item in listed if isinstance(item, dict)]
    return tuple(dict.fromkeys(ip for ip in found if isinstance(ip, str) and ip))


def counts_as_demand(pod: dict[str, Any]) -> bool:
    """A pod on the node that will want an IP from us (docs/design/subnet-scarcity.md, 3-1).

    Not host-network pods, finished pods, or pods being deleted (one that already has its IP is
    counted as assigned until its DEL; one that has none will never ask).
    """
    return not (pod.get("spec") or {}).get("hostNetwork") and pod_may_use_ip(pod)


def release_requests(nnc: dict[str, Any]) -> tuple[str, ...]:
    """`status.ipsToRelease`: IP names the control plane asks the node to give up."""
    return tuple(str(name) for name in (nnc.get("status") or {}).get("ipsToRelease") or ())


def block_name(subnet_name: str, index: int) -> str:
    return f"{subnet_name}-b{index}"


def encode_entry(entry: Entry) -> str:
    """An allocation as one string, `<node> <id> <uid>` then the flags `primary`, `releasing`
    (uid `-` when unknown). One string rather than a map of fields: the API server's cost of a write
    follows the number of fields (validation, managedFields): a full /24 block of typed maps cost it
    52.8 ms of CPU per write, 16.6 ms this way (bench/performance/ipblock_write_cost.py); the CRD
    also declares the map atomic, so the server tracks it as one field (0.73x again)."""
    words = [entry.node, entry.id, entry.uid or "-"]
    if not all(map(is_record_word, words)) or entry.uid == "-":
        raise ValueError(f"an allocation field is empty, has blanks or is a bare '-': {entry}")
    words += [
        flag for flag, on in (("primary", entry.primary), ("releasing", entry.releasing)) if on
    ]
    return " ".join(words)


def decode_entry(value: Any) -> Entry | None:
    """An allocation as written by `encode_entry`, or in the earlier map form
    ({node, id, uid, primary, releasing}), or already decoded (`slim_block`); None when it is
    not well formed."""
    if isinstance(value, Entry):
        return value
    if isinstance(value, dict):
        if not value.get("node") or not value.get("id"):
            return None
        return Entry(
            node=str(value["node"]),
            id=str(value["id"]),
            primary=bool(value.get("primary", False)),
            releasing=bool(value.get("releasing", False)),
            uid=str(value.get("uid") or ""),
        )
    if not isinstance(value, str):
        return None
    words = value.split()
    if len(words) < 3:
        return None
    node, entry_id, uid, *flags = words
    if not set(flags) <= {"primary", "releasing"} or len(flags) != len(set(flags)):
        return None
    return Entry(
        node=intern(node),
        id=intern(entry_id),
        primary="primary" in flags,
        releasing="releasing" in flags,
        uid="" if uid == "-" else intern(uid),
    )


def block_entries(block: dict[str, Any]) -> dict[str, Entry]:
    """The allocations of one IPBlock; an entry that is not well formed is left out (the
    address then counts as free in this block, and the audit sees it if a node lists it)."""
    result: dict[str, Entry] = {}
    allocations = (block.get("spec") or {}).get("allocations") or {}
    if not isinstance(allocations, dict):
        return result
    for address, value in allocations.items():
        entry = decode_entry(value)
        if entry is not None:
            result[intern(str(address))] = entry
    return result


def block_spec(block: dict[str, Any]) -> tuple[str, str]:
    """The subnet name and the CIDR an IPBlock says it covers ("" where it says nothing)."""
    spec = block.get("spec") or {}
    subnet = spec.get("subnet")
    return subnet if isinstance(subnet, str) else "", str(spec.get("cidr", ""))


def block_object(
    *, subnet_name: str, index: int, cidr: str, entries: dict[str, Entry]
) -> dict[str, Any]:
    """An IPBlock as the controller writes it (metadata.resourceVersion added by the caller)."""
    allocations = {address: encode_entry(entry) for address, entry in sorted(entries.items())}
    return {
        "apiVersion": IP_BLOCK.api_version,
        "kind": "IPBlock",
        "metadata": {"name": block_name(subnet_name, index), "labels": {SUBNET_LABEL: subnet_name}},
        "spec": {"subnet": subnet_name, "cidr": cidr, "allocations": allocations},
    }


def conditional(body: dict[str, Any], *, read: dict[str, Any]) -> dict[str, Any]:
    """`body` (a replacement or a merge patch) made conditional on the resourceVersion `read`
    was read at: the API server refuses it (409) if the object changed since."""
    version = read["metadata"]["resourceVersion"]
    return {**body, "metadata": {**(body.get("metadata") or {}), "resourceVersion": version}}


def cluster_subnet(cs: dict[str, Any], default_scaler: Scaler) -> Subnet:
    """A ClusterSubnet's spec as the planner's Subnet, with the request and release thresholds
    the nodes will use.

    Those are the thresholds of the scaler the controller publishes in `status.scaler`: the same
    merge of `spec.scaler` over its default scaler (a field set to 0, or a combination the scaler
    refuses, is ignored the same way as on the nodes). The phase-4 batch's grow bound is only as
    good as these thresholds (docs/design/phase4.md, "The rule"). The batch is pinned when the
    scaler the controller publishes has the same batch whatever batch it computed: set by
    `spec.scaler`, the nodes take that one, and count on it once the exhaustion clears.
    """
    spec = cs.get("spec") or {}
    exhaustion = spec.get("exhaustion") or {}
    thresholds = merge_scalers(default_scaler, spec.get("scaler"))
    one, two = (
        merge_scalers(default_scaler, spec.get("scaler"), {"batchSize": computed}).batch_size
        for computed in (1, 2)
    )
    return Subnet(
        name=cs["metadata"]["name"],
        cidr=str(spec["subnet"]),
        gateway=str(spec.get("gateway") or ""),
        reserved_ips=frozenset(str(ip) for ip in spec.get("reservedIPs") or ()),
        upper_percent=int(exhaustion.get("upperPercent", 90)),
        lower_percent=int(exhaustion.get("lowerPercent", 50)),
        node_safety_factor=int(spec.get("nodeSafetyFactor", 2)),
        max_batch=int(spec.get("maxBatchSize", 16)),
        request_threshold_percent=thresholds.request_threshold_percent,
        release_threshold_percent=thresholds.release_threshold_percent,
        min_ip_count=thresholds.min_ip_count,
        max_ip_count=thresholds.max_ip_count,
        pinned_batch=one if one == two else 0,
    )


def subnet_state_exhausted(state: dict[str, Any]) -> bool | None:
    """A ClusterSubnetState's `status.exhausted`; None while it has never been written."""
    exhausted = (state.get("status") or {}).get("exhausted")
    return None if exhausted is None else bool(exhausted)


def recorded_status(*, subnet: dict[str, Any], state: dict[str, Any]) -> SubnetStatus:
    """What the control plane wrote last into a ClusterSubnet's and its state's status."""
    status = subnet.get("status") or {}
    return SubnetStatus(
        exhausted=bool(subnet_state_exhausted(state)),
        reserved=int(status.get("reservedIPCount") or 0),
        batch=int((status.get("scaler") or {}).get("batchSize") or 0),
        batch_changes=int(status.get("batchChanges") or 0),
    )


def cluster_subnet_status(
    status: SubnetStatus,
    *,
    scaler: Scaler,
    capacity: int,
    node_count: int,
    duplicates: int,
    conflicts: int,
) -> dict[str, Any]:
    """A ClusterSubnet's `status`, whole: what `recorded_status` reads back, plus figures for
    operators (`kubectl get clustersubnet` prints batch, reserved and capacity)."""
    utilization = round(100 * status.reserved / capacity, 2) if capacity else 100.0
    return {
        "scaler": {**scaler_to_wire(scaler), "batchSize": status.batch},
        "reservedIPCount": status.reserved,
        "capacity": capacity,
        "nodeCount": node_count,
        "utilizationPercent": utilization,
        "exhausted": status.exhausted,
        "batchChanges": status.batch_changes,
        "duplicateIPCount": duplicates,
        "conflictIPCount": conflicts,
    }


def subnet_state_object(name: str) -> dict[str, Any]:
    """A new ClusterSubnetState, with no status yet."""
    return {
        "apiVersion": CLUSTER_SUBNET_STATE.api_version,
        "kind": "ClusterSubnetState",
        "metadata": {"name": name},
    }


def subnet_state_patch(*, exhausted: bool, at: dt.datetime) -> dict[str, Any]:
    """The merge patch of a ClusterSubnetState's status when the exhaustion changes at `at`."""
    return {"status": {"exhausted": exhausted, "timestamp": at.strftime("%Y-%m-%dT%H:%M:%SZ")}}


def nnc_object(
    *, node_name: str, node_uid: str, namespace: str, subnet_name: str
) -> dict[str, Any]:
    """A new node's NodeNetworkConfig, owned by its Node object so that it goes with it, and
    labelled with the subnet it takes its addresses from ("": none serves it yet)."""
    meta: dict[str, Any] = {
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
    previous: dict[str, Any],
    *,
    node_name: str,
    namespace: str,
    subnet_name: str,
    spec: dict[str, Any],
) -> dict[str, Any]:
    """The NodeNetworkConfig a node creates again when its own was deleted under it: the labels
    and owner (the Node) of the one it saw last (`previous`, its metadata), the subnet label
    the controller sets (`subnet_name`, when the old one had none), and `spec`."""
    meta: dict[str, Any] = {"name": node_name, "namespace": namespace}
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


def nnc_subnet(nnc: dict[str, Any]) -> str:
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


def nnc_label_patch(read: dict[str, Any], subnet_name: str) -> dict[str, Any]:
    """The merge patch that places an NNC read as `read` in a subnet, conditional on that read:
    if another writer placed it meanwhile, the API server refuses this one."""
    return conditional({"metadata": {"labels": {SUBNET_LABEL: subnet_name}}}, read=read)


def nnc_status_patch(
    read: dict[str, Any],
    *,
    scaler: Scaler | None,
    release: list[str],
    nc: NetworkContainer | None,
    subnet_name: str,
    subnet_full: bool,
) -> dict[str, Any] | None:
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
    written: dict[str, Any] = {"ipsToRelease": releases}
    if wire_scaler is not None:
        written.update(scaler=wire_scaler, status="Updated")
    if nc is not None:
        written["networkContainers"] = _containers_with(read, nc, subnet_name)
        if wire_scaler is not None:
            written["assignedIPCount"] = len(nc.ip_configs)
            if subnet_full:
                written["status"] = "SubnetFull"
    return conditional({"status": written}, read=read)


def _releases(read: dict[str, Any], subnet_name: str, release: list[str]) -> list[str]:
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


def _container_configs(read: dict[str, Any]) -> list[tuple[str, tuple[IPConfig, ...]]]:
    """Each network container's subnet name and IP configs (none where they do not parse)."""
    result = []
    for nc in _wire_containers(read):
        if isinstance(nc, dict):
            configs: tuple[IPConfig, ...] = ()
            with contextlib.suppress(KeyError, TypeError):
                configs = _ip_configs(nc.get("ipAssignments") or ())
            result.append((str(nc.get("subnetName") or ""), configs))
    return result


def _containers_with(
    read: dict[str, Any], nc: NetworkContainer, subnet_name: str
) -> list[dict[str, Any]]:
    """The NNC's network containers in wire form, the one of `subnet_name` being `nc`."""
    result = [
        _container_wire(other)
        for other in _wire_containers(read)
        if isinstance(other, dict) and other.get("subnetName") != subnet_name
    ]
    result.append(nc_to_status(nc, subnet_name=subnet_name))
    order = dict.fromkeys([nnc_subnet(read), *subnet_names(read)])
    rank = {name: i for i, name in enumerate(order)}

    def place(container: dict[str, Any]) -> int:
        name = container.get("subnetName")
        return rank.get(name, len(rank)) if isinstance(name, str) else len(rank)

    return sorted(result, key=place)


def _container_wire(nc: dict[str, Any]) -> dict[str, Any]:
    """A network container read from the API server (or slimmed, `slim_nnc`), to write back
    as it is: the fields the controller writes (the same as `slim_nnc` keeps)."""
    wire = _kept(nc, _NC_FIELDS)
    if "ipAssignments" in nc:
        assignments = nc["ipAssignments"]
        with contextlib.suppress(KeyError, TypeError):
            assignments = [{"name": c.id, "ip": c.address} for c in _ip_configs(assignments)]
        wire["ipAssignments"] = assignments
    return wire


def _interned(value: Any) -> Any:
    return intern(value) if type(value) is str else value


def _kept(obj: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """The `fields` a dict has, string values interned; {} for anything but a dict."""
    if not isinstance(obj, dict):
        return {}
    return {name: _interned(obj[name]) for name in fields if name in obj}


def _interned_list(values: Any) -> Any:
    """A list of strings with each interned; anything else as it is."""
    return [_interned(v) for v in values] if isinstance(values, list) else values


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
_scalers: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}


def _slim_nc(nc: Any, known: tuple[tuple[IPConfig, ...], ...]) -> Any:
    if not isinstance(nc, dict):
        return nc
    kept = _kept(nc, _NC_FIELDS)
    if "ipAssignments" in nc:
        assignments = nc["ipAssignments"]
        # Parsed here when it parses: the planning state's NodeView then holds these very
        # IPConfig objects (`network_containers` passes a tuple through) instead of its own
        # beside a dict per address. One that does not parse is kept, to fail where it did.
        with contextlib.suppress(KeyError, TypeError):
            assignments = _ip_configs(assignments)
            assignments = next((k for k in known if k == assignments), assignments)
        kept["ipAssignments"] = assignments
    return kept


def _shared_scaler(scaler: Any) -> Any:
    """One dict for every NNC whose scaler is the same: thousands of NNCs carry one value."""
    if not isinstance(scaler, dict) or not all(
        isinstance(v, int | str | None) for v in scaler.values()
    ):
        return scaler
    key = tuple(sorted(scaler.items()))
    shared = _scalers.get(key)
    if shared is None and len(_scalers) < 64:  # a few values in any real cluster
        shared = _scalers[key] = scaler
    return shared if shared is not None else scaler


def slim_nnc(nnc: dict[str, Any], *known: tuple[IPConfig, ...]) -> dict[str, Any]:
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
    slim: dict[str, Any] = {
        "metadata": _kept(meta, ("name", "namespace", "uid", "resourceVersion")),
    }
    if isinstance(meta, dict) and "labels" in meta:
        labels = meta["labels"]
        slim["metadata"]["labels"] = (
            {_interned(k): _interned(v) for k, v in labels.items()}
            if isinstance(labels, dict)
            else labels
        )
    spec = nnc.get("spec")
    if "spec" in nnc:
        slim["spec"] = spec
        if isinstance(spec, dict):
            slim["spec"] = {
                name: _interned_list(spec[name])
                for name in ("requestedIPCount", "ipsNotInUse", "requestedIPs", "subnets")
                if name in spec
            }
    status = nnc.get("status")
    if "status" in nnc:
        slim["status"] = status
        if isinstance(status, dict):
            kept: dict[str, Any] = {}
            if "scaler" in status:
                kept["scaler"] = _shared_scaler(status["scaler"])
            if "ipsToRelease" in status:
                kept["ipsToRelease"] = _interned_list(status["ipsToRelease"])
            if "networkContainers" in status:
                containers = status["networkContainers"]
                kept["networkContainers"] = (
                    [_slim_nc(nc, known) for nc in containers]
                    if isinstance(containers, list)
                    else containers
                )
            slim["status"] = kept
    return slim


def slim_block(
    block: dict[str, Any],
    written: dict[str, Entry] | None = None,
    *,
    sent: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An IPBlock as the controller's cache keeps it: name, resourceVersion, labels, subnet,
    cidr and its allocations already decoded (`block_entries`): the Entry objects are then the
    planning state's own, where the wire form kept a ~140-byte string per address besides.
    `block_entries`, `block_spec` and `conditional` read it as they read the wire form.

    Allocations equal to `written` (the entries the controller just wrote, of its plan) are
    kept as that dict rather than the reply's copy, for the reason `slim_nnc` gives. With
    `sent` (the allocations of the write's body, `block_object` of `written`), a reply holding
    just those strings is not decoded at all: a block's 256 entries cost the leader more CPU
    to decode than anything else it does with a reply."""
    meta = block.get("metadata")
    slim: dict[str, Any] = {
        "metadata": _kept(meta, ("name", "namespace", "uid", "resourceVersion", "labels"))
    }
    spec = block.get("spec")
    if "spec" in block:
        slim["spec"] = spec
        if isinstance(spec, dict):
            slim["spec"] = {k: _interned(spec[k]) for k in ("subnet", "cidr") if k in spec}
            if "allocations" in spec:
                allocations = spec["allocations"]
                if written is not None and sent is not None and allocations == sent:
                    allocations = written
                elif isinstance(allocations, dict):
                    allocations = block_entries(block)
                    if written is not None and allocations == written:
                        allocations = written
                slim["spec"]["allocations"] = allocations
    return slim
