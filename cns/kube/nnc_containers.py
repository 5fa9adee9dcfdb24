"""The network containers of an NodeNetworkConfig's status: read and checked for the node and
the controller (`read_containers`), and written (`nc_to_status`).

The control plane's data is input: a container or an IP assignment the node cannot use is left
out with the reason (`IgnoredContainer`), never handed to a pod.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
from sys import intern
from typing import Any

from cns.core.types import IgnoredContainer, IPConfig, NetworkContainer
from cns.kube.wire import IPAssignment, NodeNetworkConfig, WireNetworkContainer

# What the node's data path can use (docs/azure-compat.md): IPs handed out one by one, listed
# in ipAssignments (assignmentMode dynamic), each a secondary address of a VNET subnet (type
# vnet). "" is a container written without the field; Azure's schema defaults both to these.
USABLE_VALUES = {"assignmentMode": ("", "dynamic"), "type": ("", "vnet")}


def wire_containers(nnc: NodeNetworkConfig) -> list[WireNetworkContainer]:
    """`status.networkContainers`; [] where it (or the status) is not what the CRD says."""
    status = nnc.get("status")
    containers = status.get("networkContainers") if isinstance(status, dict) else None
    return list(containers) if isinstance(containers, list) else []


def _unusable(nc: WireNetworkContainer) -> list[tuple[str, str]]:
    """The (field, value) pairs of a wire NC the node cannot honour; [] when it can use it."""
    values = ((name, str(nc.get(name) or "")) for name in USABLE_VALUES)
    return [(name, value) for name, value in values if value not in USABLE_VALUES[name]]


def mentioned_addresses(nnc: NodeNetworkConfig) -> set[str]:
    """Every address an NNC's network containers mention, in its canonical spelling, whether or
    not the container or entry is usable (`read_containers` leaves some out): for a decision
    that must not miss one, such as whether an address may be freed."""
    found: set[str] = set()
    pending: list[Any] = list(wire_containers(nnc))
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


def network_containers(nnc: NodeNetworkConfig) -> tuple[NetworkContainer, ...]:
    """The checked NCs of an NNC's status (`read_containers`), without what it left out."""
    return read_containers(nnc)[0]


def ignored_containers(nnc: NodeNetworkConfig) -> tuple[IgnoredContainer, ...]:
    """What `read_containers` leaves out of an NNC's status, each with its reason."""
    return read_containers(nnc)[1]


def read_containers(
    nnc: NodeNetworkConfig,
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
    for nc in wire_containers(nnc):
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


def _primary_address(nc: WireNetworkContainer) -> str:
    """`primaryIP` as an address: a prefix (`10.70.0.4/32`) read as its address; "" unset."""
    return str(nc.get("primaryIP") or "").split("/")[0]


def _container_problems(nc: WireNetworkContainer) -> list[tuple[str, str, str]]:
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


def ip_configs(assignments: list[IPAssignment] | tuple[IPConfig, ...]) -> tuple[IPConfig, ...]:
    """An NC's `ipAssignments` as IP configs; a tuple is one `slim_nnc` parsed already."""
    if isinstance(assignments, tuple):
        return assignments
    return tuple(IPConfig(intern(str(a["name"])), intern(str(a["ip"]))) for a in assignments)


def nc_to_status(
    nc: NetworkContainer, *, subnet_name: str, node_ip: str = ""
) -> WireNetworkContainer:
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
