"""The cluster as `cns ipam` sees it (`read_cluster`), and the writes of `cns ipam release`.

Every object is read directly from the API server (consistent lists, no caches) and checked
field by field: an object or field that cannot be read becomes an `Unreadable` naming it, and
the rest of the cluster is still checked. The comparison is `cns.core.ipam_audit`.

A release follows the controller's own protocol for taking an address back
(docs/design/controller-safety.md): mark the record entry `releasing` by a write conditional on
its block's resourceVersion, then fence the owner's NodeNetworkConfig (an annotation written
conditionally, which changes its resourceVersion, so a grant planned before it cannot land in
it), then read that NNC and free the entry, again conditionally, only if the NNC lists the
address nowhere; otherwise the mark is taken back.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
from dataclasses import replace
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from cns.core.allocation import Entry
from cns.core.ipam_audit import (
    ClusterView,
    Granted,
    NodeConfig,
    PodHolding,
    Recorded,
    SubnetInfo,
    Unreadable,
)
from cns.core.subnet import Address
from cns.core.types import Scaler
from cns.kube.client import KubeClient
from cns.kube.cluster_subnet import cluster_subnet
from cns.kube.ipblock import decode_entry, encode_entry
from cns.kube.nnc_containers import mentioned_addresses, read_containers
from cns.kube.node_addresses import node_addresses
from cns.kube.objects import CLUSTER_SUBNET, GROUP, IP_BLOCK, NNC
from cns.kube.pods import pod_may_use_ip
from cns.kube.wire import ClusterSubnet, IPBlock, NodeNetworkConfig, Pod

READ_TIMEOUT = 60.0
# Written on a NodeNetworkConfig by `cns ipam release` before it frees an address of the node:
# the address and when (any write changes the object's resourceVersion: that is the fence).
RELEASE_ANNOTATION = f"{GROUP}/ipam-release"
_SHAPE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, IndexError)


async def read_cluster(kube: KubeClient, *, namespace: str) -> ClusterView:
    """Every ClusterSubnet, IPBlock, NodeNetworkConfig (of `namespace`), Node and Pod, read now."""
    subnets, blocks, nncs, nodes, pods = await asyncio.gather(
        kube.list_now(CLUSTER_SUBNET),
        kube.list_now(IP_BLOCK),
        kube.list_now(NNC, namespace=namespace),
        kube.list_nodes_now(timeout=READ_TIMEOUT),
        kube.list_pods_now(timeout=READ_TIMEOUT),
    )
    unreadable: list[Unreadable] = []
    own: list[Address] = []  # the nodes' own addresses: never granted, not in the capacity
    for node in nodes:
        found, problems = node_addresses(node)
        own += found
        unreadable += (
            Unreadable("Node", p.node, p.field, f"{p.value}: {p.error}") for p in problems
        )
    infos = [info for cs in subnets if (info := _subnet(cs, own, unreadable)) is not None]
    record = [r for block in blocks for r in recorded_entries(block, unreadable)]
    configs = {c.node: c for c in (node_config(nnc, unreadable) for nnc in nncs)}
    holdings = [h for pod in pods for h in pod_holdings(pod, unreadable)]
    names = frozenset(
        str(name)
        for node in nodes
        if isinstance(name := (node.get("metadata") or {}).get("name"), str)
    )
    return ClusterView(
        subnets=tuple(sorted(infos, key=lambda s: s.name)),
        nodes=names,
        configs=configs,
        record=tuple(record),
        pods=tuple(holdings),
        unreadable=tuple(unreadable),
    )


def _name(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else "?"


def _subnet(
    cs: ClusterSubnet, node_ips: list[Address], unreadable: list[Unreadable]
) -> SubnetInfo | None:
    """The subnet's capacity as the controller counts it (`Subnet.capacity`)."""
    name = _name(cs)
    try:
        subnet = cluster_subnet(cs, Scaler()).with_node_addresses(node_ips)
        return SubnetInfo(name, str(subnet.network), subnet.capacity, subnet.draining)
    except _SHAPE_ERRORS as exc:
        unreadable.append(Unreadable("ClusterSubnet", name, "spec", _why(exc)))
        return None


def recorded_entries(block: IPBlock, unreadable: list[Unreadable]) -> list[Recorded]:
    """An IPBlock's allocation entries; each one it cannot read (key not a canonical address of
    the block, value not an entry) appended to `unreadable`, as the controller ignores it."""
    name = _name(block)
    spec = block.get("spec")
    if not isinstance(spec, dict):
        unreadable.append(Unreadable("IPBlock", name, "spec", "not an object"))
        return []
    subnet = spec.get("subnet")
    try:
        network = ipaddress.ip_network(str(spec.get("cidr")))
    except ValueError as exc:
        unreadable.append(Unreadable("IPBlock", name, "spec.cidr", str(exc)))
        return []
    allocations = spec.get("allocations") or {}
    if not isinstance(allocations, dict):
        unreadable.append(Unreadable("IPBlock", name, "spec.allocations", "not an object"))
        return []
    found = []
    for address, value in allocations.items():
        where = f"spec.allocations[{address}]"
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            unreadable.append(Unreadable("IPBlock", name, where, "the key is not an IP address"))
            continue
        if ip not in network or str(ip) != address:
            why = f"not in the block's {network}" if ip not in network else "not canonical"
            unreadable.append(Unreadable("IPBlock", name, where, why))
            continue
        entry = decode_entry(value)
        if entry is None:
            unreadable.append(
                Unreadable(
                    "IPBlock",
                    name,
                    where,
                    f"{value!r} is not '<node> <id> <uid> [primary] [releasing]'",
                )
            )
            continue
        found.append(Recorded(address, str(subnet or ""), name, entry))
    return found


def node_config(nnc: NodeNetworkConfig, unreadable: list[Unreadable]) -> NodeConfig:
    """An NNC's grants (what `read_containers` accepts, as the node would use them) and every
    address it mentions; each field it cannot read appended to `unreadable`."""
    name = _name(nnc)
    meta = nnc.get("metadata") or {}
    spec = nnc.get("spec") or {}
    status = nnc.get("status")
    if not isinstance(spec, dict):
        unreadable.append(Unreadable("NodeNetworkConfig", name, "spec", "not an object"))
        spec = {}
    requested = spec.get("requestedIPCount", 0)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        unreadable.append(
            Unreadable(
                "NodeNetworkConfig", name, "spec.requestedIPCount", f"{requested!r} is not a count"
            )
        )
        requested = 0
    if status is not None and not isinstance(status, dict):
        unreadable.append(Unreadable("NodeNetworkConfig", name, "status", "not an object"))
    elif isinstance(status, dict) and not isinstance(status.get("networkContainers", []), list):
        unreadable.append(
            Unreadable("NodeNetworkConfig", name, "status.networkContainers", "not a list")
        )
    containers, ignored = read_containers(nnc)
    for left_out in ignored:
        where = f"status.networkContainers[id={left_out.id or '?'}]"
        if left_out.assignment:
            where += f".ipAssignments[name={left_out.assignment}]"
        why = f"{left_out.value!r}" + (
            f": {left_out.reason}" if left_out.reason else " is not usable"
        )
        unreadable.append(Unreadable("NodeNetworkConfig", name, f"{where}.{left_out.field}", why))
    granted = []
    for nc in containers:
        granted += [Granted(name, ip, nc.id, primary=True) for ip in nc.primary_ips]
        granted += [Granted(name, c.address, c.id) for c in nc.ip_configs]
    return NodeConfig(
        node=name,
        uid=str(meta.get("uid") or ""),
        granted=tuple(granted),
        mentioned=frozenset(mentioned_addresses(nnc)),
        requested=requested,
    )


def pod_holdings(pod: Pod, unreadable: list[Unreadable]) -> list[PodHolding]:
    """The addresses of a pod's `status.podIPs` (else `status.podIP`); none for a host-network
    pod; each entry that is not an IP appended to `unreadable`."""
    meta = pod.get("metadata") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '?')}"
    if (pod.get("spec") or {}).get("hostNetwork"):
        return []
    status = pod.get("status") or {}
    listed = status.get("podIPs")
    if listed is None:
        listed = [{"ip": status["podIP"]}] if status.get("podIP") else []
    if not isinstance(listed, list):
        unreadable.append(Unreadable("Pod", name, "status.podIPs", "not a list"))
        return []
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    live = pod_may_use_ip(pod)
    found = []
    for i, item in enumerate(listed):
        value = item.get("ip") if isinstance(item, dict) else None
        try:
            address = str(ipaddress.ip_address(str(value)))
        except ValueError:
            unreadable.append(
                Unreadable("Pod", name, f"status.podIPs[{i}].ip", f"{value!r} is not an IP address")
            )
            continue
        found.append(PodHolding(name, node, address, live))
    return found


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


# The release's writes.


class ReleaseRefused(Exception):
    """The release of one address did not happen; the message says why."""


async def release_entry(kube: KubeClient, recorded: Recorded, *, namespace: str, at: str) -> None:
    """Free `recorded` (the entry as the caller's checks saw it) by the protocol in the module
    docstring; ReleaseRefused when any step finds the cluster changed."""
    address, seen = recorded.address, recorded.entry
    block = await kube.get(IP_BLOCK, recorded.block)
    if block is None or _entry_of(block, address) != seen:
        raise ReleaseRefused("its record changed since it was checked (read again)")
    try:
        marked = await _write_entry(kube, block, address, replace(seen, releasing=True))
    except ReleaseRefused as exc:
        raise ReleaseRefused(f"{exc}; nothing was written") from None
    try:
        nnc = await _fence(kube, seen.node, namespace=namespace, note=f"{address} {at}")
        if nnc is not None and address in mentioned_addresses(nnc):
            raise ReleaseRefused(f"the NodeNetworkConfig of node {seen.node} lists it now")
    except ReleaseRefused as exc:
        try:
            await _write_entry(kube, marked, address, seen)
        except ReleaseRefused as undo:
            raise ReleaseRefused(
                f"{exc}; taking its releasing mark back failed too ({undo}): the controller "
                "finishes that release by its own protocol"
            ) from None
        raise ReleaseRefused(f"{exc}; its record entry is as it was") from None
    try:
        await _write_entry(kube, marked, address, None)
    except ReleaseRefused as exc:
        raise ReleaseRefused(
            f"{exc}; the entry stays releasing, which the controller frees once it has read "
            "the node's NodeNetworkConfig"
        ) from None


def _entry_of(block: IPBlock, address: str) -> Entry | None:
    allocations = (block.get("spec") or {}).get("allocations")
    if not isinstance(allocations, dict) or address not in allocations:
        return None
    return decode_entry(allocations[address])


async def _write_entry(
    kube: KubeClient, block: IPBlock, address: str, entry: Entry | None
) -> IPBlock:
    """`block` with `address`'s entry replaced (None: removed), written conditionally on the
    resourceVersion it was read at; the other entries as they were, byte for byte."""
    body = copy.deepcopy(block)
    allocations = body["spec"]["allocations"]
    assert isinstance(allocations, dict)
    if entry is None:
        allocations.pop(address, None)
    else:
        allocations[address] = encode_entry(entry)  # type: ignore[assignment]
    name = _name(block)
    try:
        return await kube.replace(IP_BLOCK, name, body)
    except ApiException as exc:
        if exc.status in (404, 409):
            raise ReleaseRefused(f"IPBlock {name} changed meanwhile ({exc.status})") from None
        raise


async def _fence(
    kube: KubeClient, node: str, *, namespace: str, note: str
) -> NodeNetworkConfig | None:
    """The node's NNC after a conditional write of `RELEASE_ANNOTATION` to it (None: it has
    none); retried on a conflict with the node's or the controller's own writes."""
    for _ in range(5):
        nnc = await kube.get(NNC, node, namespace=namespace)
        if nnc is None:
            return None
        meta = nnc["metadata"]
        patch: NodeNetworkConfig = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "annotations": {RELEASE_ANNOTATION: note},
            }
        }
        try:
            return await kube.merge_patch(NNC, node, patch, namespace=namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status != 409:
                raise
    raise ReleaseRefused(f"the NodeNetworkConfig of node {node} kept changing; not fenced")
