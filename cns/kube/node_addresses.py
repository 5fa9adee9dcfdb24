"""A Node's own addresses (`status.addresses`, InternalIP and ExternalIP), read with checks.

The controller never grants them to pods (`Subnet.with_node_addresses`). The kubelet and cloud
providers write these entries; one that cannot be read is a problem named by its field and
ignored, never a reason to stop serving the subnet.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from cns.core.subnet import Address
from cns.kube.wire import Node

# The kinds of `status.addresses` entries that are IP addresses of the node itself.
NODE_ADDRESS_TYPES = ("InternalIP", "ExternalIP")


@dataclass(frozen=True, slots=True)
class NodeAddressProblem:
    """An entry of a Node's `status.addresses` that was ignored, and why."""

    node: str
    field: str  # e.g. status.addresses[2].address
    value: str
    error: str


def node_addresses(node: Node) -> tuple[list[Address], list[NodeAddressProblem]]:
    """The IP addresses a Node lists as its InternalIP and ExternalIP, and the entries that
    cannot be read (not a list, an entry not an object, an address that is not an IP)."""
    name = str((node.get("metadata") or {}).get("name") or "")
    status = node.get("status")
    listed: object = status.get("addresses") if isinstance(status, dict) else None
    if listed is None:
        return [], []
    if not isinstance(listed, list):
        problem = NodeAddressProblem(name, "status.addresses", repr(listed)[:80], "not a list")
        return [], [problem]
    found: list[Address] = []
    problems: list[NodeAddressProblem] = []
    for index, entry in enumerate(listed):
        field = f"status.addresses[{index}]"
        if not isinstance(entry, dict):
            problems.append(NodeAddressProblem(name, field, repr(entry)[:80], "not an object"))
            continue
        if entry.get("type") not in NODE_ADDRESS_TYPES:
            continue
        text = entry.get("address")
        try:
            if not isinstance(text, str):
                raise ValueError("not a string")
            found.append(ipaddress.ip_address(text))
        except ValueError as exc:
            problems.append(NodeAddressProblem(name, f"{field}.address", repr(text)[:80], str(exc)))
    return found, problems
