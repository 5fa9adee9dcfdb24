"""The cluster-wide IPAM check (`cns ipam check`, `show`, `release`): what the allocation record,
the NodeNetworkConfigs and the pods say about each address, compared.

Three parties speak about an address. The record (the IPBlocks, `cns.core.allocation`) says
which node it was granted to, under which IP name and NNC object; each node's NodeNetworkConfig
lists the addresses its network containers hold; each pod's `status.podIPs` names the addresses
its sandbox uses. In a healthy cluster they agree: a pod's address is recorded for the pod's
node and listed in that node's NNC, and every recorded address is listed by its node. What
`check` reports where they do not (`Problem`):

- **duplicate**: an address on two nodes (two NNCs list it, or the record names one node and
  another node's NNC or pod holds it) or held by two live pods;
- **leaked**: recorded for a node that exists, but no NNC lists it and no pod holds it: nothing
  can use it, and no other node can be granted it. (An address a node's NNC lists and no pod
  holds is the node's pool headroom, not a leak: `show` counts it as free on the node.)
- **unrecorded**: a live pod holds an address of a ClusterSubnet that no record entry holds;
- **stale**: a record entry for a node that no longer exists;
- **unreadable**: an object or field the check cannot read (named; the rest is still checked).

`release_refusal` is the release's rule, applied to a view read at release time: an address is
released only if it is still exactly the leak the report proved, for at least the grace period,
so a grant being completed (record written, NNC not yet) is never taken for a leak.

Pure: no clock, no I/O; cns/kube/ipam_view.py reads the cluster, cns/commands/ipam.py writes.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cns.core.allocation import Entry, is_record_word

REPORT_KIND = "cns-ipam-check-report"
REPORT_VERSION = 1


class Problem(StrEnum):
    DUPLICATE = "duplicate"
    LEAKED = "leaked"
    UNRECORDED = "unrecorded"
    STALE = "stale"
    UNREADABLE = "unreadable"


# `cns ipam check`'s exit status is the sum of the bits of the problems found (0: clean; 1 is
# an error, 2 a usage error): a script tests `status & 8` for leaks.
EXIT_BITS = {
    Problem.DUPLICATE: 4,
    Problem.LEAKED: 8,
    Problem.UNRECORDED: 16,
    Problem.STALE: 32,
    Problem.UNREADABLE: 64,
}


@dataclass(frozen=True, slots=True)
class Recorded:
    """One entry of the allocation record: `address` claimed in IPBlock `block` of `subnet`."""

    address: str
    subnet: str
    block: str
    entry: Entry


@dataclass(frozen=True, slots=True)
class Granted:
    """An address a node's NNC lists: an IP config (`id`) or a container's primary IP."""

    node: str
    address: str
    id: str
    primary: bool = False


@dataclass(frozen=True, slots=True)
class PodHolding:
    """A pod's address (`status.podIPs`); `live`: the pod may still use it (not finished, not
    being deleted)."""

    pod: str  # namespace/name
    node: str
    address: str
    live: bool = True


@dataclass(frozen=True, slots=True)
class SubnetInfo:
    name: str
    cidr: str
    capacity: int
    draining: bool = False  # `spec.draining`: its pods left are `assigned`, by node too


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One node's NodeNetworkConfig: what its containers grant, every address they mention
    however spelt or usable (`mentioned_addresses`), and what it asks for."""

    node: str
    uid: str
    granted: tuple[Granted, ...] = ()
    mentioned: frozenset[str] = frozenset()
    requested: int = 0


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An object the check could not read whole: `field` of `kind` `name` is wrong."""

    kind: str
    name: str
    field: str
    why: str


@dataclass(frozen=True)
class ClusterView:
    subnets: tuple[SubnetInfo, ...] = ()
    nodes: frozenset[str] = frozenset()
    configs: Mapping[str, NodeConfig] = field(default_factory=dict)  # by node name
    record: tuple[Recorded, ...] = ()
    pods: tuple[PodHolding, ...] = ()
    unreadable: tuple[Unreadable, ...] = ()


@dataclass(frozen=True, slots=True)
class Finding:
    problem: Problem
    address: str  # "" for an unreadable object
    subnet: str
    why: str
    nodes: tuple[str, ...] = ()
    pods: tuple[str, ...] = ()
    record: Recorded | None = None


class _Index:
    """The view by address."""

    def __init__(self, view: ClusterView) -> None:
        self.record: dict[str, list[Recorded]] = defaultdict(list)
        for recorded in view.record:
            self.record[recorded.address].append(recorded)
        self.granted: dict[str, list[Granted]] = defaultdict(list)
        self.mentioned: dict[str, set[str]] = defaultdict(set)
        for config in view.configs.values():
            for granted in config.granted:
                self.granted[granted.address].append(granted)
                self.mentioned[granted.address].add(config.node)
            for address in config.mentioned:
                self.mentioned[address].add(config.node)
        self.held: dict[str, list[PodHolding]] = defaultdict(list)
        for holding in view.pods:
            self.held[holding.address].append(holding)
        self.networks = [(s, ipaddress.ip_network(s.cidr)) for s in view.subnets]

    def subnet_of(self, address: str) -> str:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return ""
        return next((s.name for s, net in self.networks if ip in net), "")


def check(view: ClusterView) -> list[Finding]:
    """Every problem the view shows, by problem then address."""
    index = _Index(view)
    findings = [
        Finding(Problem.UNREADABLE, "", "", f"{u.kind} {u.name}: {u.field}: {u.why}")
        for u in view.unreadable
    ]
    addresses = sorted({*index.record, *index.granted, *index.held}, key=_address_key)
    for address in addresses:
        findings += _address_findings(address, index, view.nodes)
    findings.sort(key=lambda f: (list(Problem).index(f.problem), _address_key(f.address)))
    return findings


def _address_findings(address: str, index: _Index, nodes: frozenset[str]) -> list[Finding]:
    recorded = index.record.get(address, [])
    granted_nodes = sorted({g.node for g in index.granted.get(address, ())})
    held = index.held.get(address, [])
    live = [h for h in held if h.live]
    subnet = recorded[0].subnet if recorded else index.subnet_of(address)
    found = []
    duplicate = []
    recorded_nodes = sorted({r.entry.node for r in recorded})
    if len(recorded) > 1:
        duplicate.append(f"recorded {len(recorded)} times (nodes {', '.join(recorded_nodes)})")
    if len(granted_nodes) > 1:
        duplicate.append(f"granted to nodes {', '.join(granted_nodes)}")
    owner = recorded_nodes[0] if len(recorded_nodes) == 1 else ""
    if owner:
        others = [n for n in granted_nodes if n != owner]
        if others:
            duplicate.append(f"recorded for node {owner}, granted to node {', '.join(others)}")
    pods = sorted({h.pod for h in live})
    if len(pods) > 1:
        duplicate.append(f"held by pods {', '.join(pods)}")
    home = owner or (granted_nodes[0] if len(granted_nodes) == 1 else "")
    strays = sorted({(h.pod, h.node) for h in live if home and h.node and h.node != home})
    for pod, node in strays:
        duplicate.append(f"held by pod {pod} on node {node}, but it is node {home}'s")
    if duplicate:
        involved = sorted({*recorded_nodes, *granted_nodes, *(h.node for h in live if h.node)})
        found.append(
            Finding(
                Problem.DUPLICATE,
                address,
                subnet,
                "; ".join(duplicate),
                tuple(involved),
                tuple(pods),
                recorded[0] if len(recorded) == 1 else None,
            )
        )
    if len(recorded) == 1:
        one = recorded[0]
        entry = one.entry
        if entry.node not in nodes:
            holders = f"; held by pod {', '.join(pods)}" if pods else ""
            found.append(
                Finding(
                    Problem.STALE,
                    address,
                    subnet,
                    f"recorded for node {entry.node}, which does not exist{holders}",
                    (entry.node,),
                    tuple(pods),
                    one,
                )
            )
        elif not entry.releasing and not held and address not in index.mentioned:
            found.append(
                Finding(
                    Problem.LEAKED,
                    address,
                    subnet,
                    f"recorded for node {entry.node} (IP {entry.id}); no NodeNetworkConfig "
                    "lists it and no pod holds it",
                    (entry.node,),
                    (),
                    one,
                )
            )
    if not recorded and subnet:
        for holding in sorted(live, key=lambda h: h.pod):
            listed = f", granted to node {', '.join(granted_nodes)}" if granted_nodes else ""
            found.append(
                Finding(
                    Problem.UNRECORDED,
                    address,
                    subnet,
                    f"held by pod {holding.pod} on node {holding.node or '?'}{listed}; "
                    "no allocation record holds it",
                    tuple(granted_nodes),
                    (holding.pod,),
                )
            )
    return found


def exit_status(findings: Iterable[Finding]) -> int:
    """The exit status of `cns ipam check` (`EXIT_BITS`): 0 when there is nothing."""
    return sum(EXIT_BITS[p] for p in {f.problem for f in findings})


def release_refusal(
    finding: Finding, view: ClusterView, *, age_seconds: float, grace_seconds: float
) -> str | None:
    """Why the address of `finding` (from a report `age_seconds` old) must not be released now,
    judged from `view` (read now); None: it may be. Only a leak is released, and only while it
    is still the very entry the report saw (same node, IP name and NNC object, not releasing),
    its node exists, no NodeNetworkConfig mentions it in any form and no pod, live or not,
    holds it."""
    if finding.problem is not Problem.LEAKED or finding.record is None:
        return f"not a leak in the report but {finding.problem.value}"
    if not age_seconds >= grace_seconds:
        return (
            f"the report is {age_seconds:.0f}s old, less than the grace of {grace_seconds:g}s "
            "(a grant being completed looks like a leak for a moment)"
        )
    index = _Index(view)
    address, seen = finding.address, finding.record
    now = index.record.get(address, [])
    pods = sorted({h.pod for h in index.held.get(address, ())})
    if pods:
        return f"pod {', '.join(pods)} holds it"
    listing = sorted(index.mentioned.get(address, ()))
    if listing:
        return f"the NodeNetworkConfig of node {', '.join(listing)} lists it"
    if not now:
        return "no allocation record holds it any more"
    if len(now) > 1:
        return f"{len(now)} allocation records hold it"
    current = now[0]
    if (current.block, current.entry) != (seen.block, seen.entry):
        return f"its record changed since the check: now {_entry_text(current.entry)}"
    if current.entry.node not in view.nodes:
        return f"node {current.entry.node} no longer exists (a stale record, not a leak)"
    return None


def _entry_text(entry: Entry) -> str:
    flags = " releasing" if entry.releasing else ""
    return f"node {entry.node}, IP {entry.id}, NNC uid {entry.uid or '-'}{flags}"


def _address_key(address: str) -> tuple[int, int, str]:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return (9, 0, address)
    return (ip.version, int(ip), address)


# Utilization (`cns ipam show`).


@dataclass(frozen=True, slots=True)
class SubnetUse:
    """`reserved`: addresses the record holds for nodes; `granted`: those NNCs list;
    `assigned`: those live pods hold; `free`: capacity - reserved."""

    name: str
    cidr: str
    capacity: int
    reserved: int
    granted: int
    assigned: int
    draining: bool = False

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.reserved)


@dataclass(frozen=True, slots=True)
class NodeUse:
    """One node's share of one subnet: `assigned` of its `granted` addresses are held by live
    pods on the node; the rest (`free`) is its pool's headroom."""

    node: str
    subnet: str
    requested: int
    reserved: int
    granted: int
    assigned: int
    ranges: tuple[str, ...]

    @property
    def free(self) -> int:
        return max(0, self.granted - self.assigned)


def utilization(view: ClusterView) -> tuple[list[SubnetUse], list[NodeUse]]:
    """Per subnet and per (node, subnet): the figures `cns ipam show` prints."""
    index = _Index(view)
    reserved: dict[tuple[str, str], int] = defaultdict(int)
    for recorded in view.record:
        reserved[(recorded.subnet, recorded.entry.node)] += 1
    by_node: dict[tuple[str, str], list[str]] = defaultdict(list)
    for config in view.configs.values():
        for grant in config.granted:
            by_node[(index.subnet_of(grant.address), config.node)].append(grant.address)
    assigned_addresses = {h.address for h in view.pods if h.live}
    on_node = {(h.node, h.address) for h in view.pods if h.live}
    subnets = []
    for info in view.subnets:
        listed_here = {a for (s, _), listed in by_node.items() if s == info.name for a in listed}
        subnets.append(
            SubnetUse(
                info.name,
                info.cidr,
                info.capacity,
                reserved=sum(n for (s, _), n in reserved.items() if s == info.name),
                granted=len(listed_here),
                assigned=sum(1 for a in assigned_addresses if index.subnet_of(a) == info.name),
                draining=info.draining,
            )
        )
    nodes = []
    keys = sorted({*by_node, *((s, n) for s, n in reserved)})
    for subnet, node in keys:
        listed = sorted(set(by_node.get((subnet, node), ())), key=_address_key)
        nnc = view.configs.get(node)
        nodes.append(
            NodeUse(
                node,
                subnet or "?",
                requested=nnc.requested if nnc else 0,
                reserved=reserved.get((subnet, node), 0),
                granted=len(listed),
                assigned=sum(1 for a in listed if (node, a) in on_node),
                ranges=address_ranges(listed),
            )
        )
    nodes.sort(key=lambda u: (u.node, u.subnet))
    return subnets, nodes


def address_ranges(addresses: Iterable[str]) -> tuple[str, ...]:
    """Consecutive addresses as `first-last` ranges, in order (`10.0.0.2-10.0.0.9`)."""
    values = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda ip: (ip.version, ip))
    ranges: list[str] = []
    start = end = None
    for ip in values:
        if end is not None and ip.version == end.version and int(ip) == int(end) + 1:
            end = ip
            continue
        if start is not None:
            ranges.append(str(start) if start == end else f"{start}-{end}")
        start = end = ip
    if start is not None:
        ranges.append(str(start) if start == end else f"{start}-{end}")
    return tuple(ranges)


# The report (`check -o json`, `--output-report`, `release --from-report`).


class ReportInvalid(ValueError):
    """A report that cannot be used; the message names the field."""


def report(findings: list[Finding], *, checked_at: str, checked_at_epoch: float) -> dict[str, Any]:
    """The report of one check, as JSON-ready data."""
    counts = {p.value: 0 for p in Problem}
    for f in findings:
        counts[f.problem.value] += 1
    return {
        "kind": REPORT_KIND,
        "version": REPORT_VERSION,
        "checkedAt": checked_at,
        "checkedAtEpoch": checked_at_epoch,
        "clean": not findings,
        "exitStatus": exit_status(findings),
        "counts": counts,
        "findings": [_finding_json(f) for f in findings],
    }


def _finding_json(finding: Finding) -> dict[str, Any]:
    data: dict[str, Any] = {
        "problem": finding.problem.value,
        "address": finding.address,
        "subnet": finding.subnet,
        "why": finding.why,
        "nodes": list(finding.nodes),
        "pods": list(finding.pods),
    }
    if finding.record is not None:
        entry = finding.record.entry
        data["record"] = {
            "block": finding.record.block,
            "node": entry.node,
            "id": entry.id,
            "uid": entry.uid,
            "primary": entry.primary,
            "releasing": entry.releasing,
        }
    return data


def parse_report(data: object) -> tuple[float, list[Finding]]:
    """The time (epoch seconds) and findings of a report `report` wrote; ReportInvalid naming
    the field otherwise."""
    if not isinstance(data, dict):
        raise ReportInvalid(f"not a JSON object but {type(data).__name__}")
    if data.get("kind") != REPORT_KIND:
        raise ReportInvalid(f"kind: {data.get('kind')!r} is not {REPORT_KIND!r}")
    if data.get("version") != REPORT_VERSION:
        raise ReportInvalid(f"version: {data.get('version')!r} is not {REPORT_VERSION}")
    epoch = data.get("checkedAtEpoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int | float) or not epoch >= 0:
        raise ReportInvalid(f"checkedAtEpoch: {epoch!r} is not a time in seconds")
    items = data.get("findings")
    if not isinstance(items, list):
        raise ReportInvalid("findings: not a list")
    return float(epoch), [_parse_finding(item, f"findings[{i}]") for i, item in enumerate(items)]


def _parse_finding(item: object, where: str) -> Finding:
    if not isinstance(item, dict):
        raise ReportInvalid(f"{where}: not an object")
    try:
        problem = Problem(str(item.get("problem")))
    except ValueError:
        raise ReportInvalid(
            f"{where}.problem: {item.get('problem')!r} is not one of "
            f"{', '.join(p.value for p in Problem)}"
        ) from None
    address = _text(item, "address", where, required=problem is not Problem.UNREADABLE)
    if address:
        try:
            canonical = str(ipaddress.ip_address(address))
        except ValueError:
            raise ReportInvalid(f"{where}.address: {address!r} is not an IP address") from None
        if canonical != address:
            raise ReportInvalid(f"{where}.address: {address!r} is not canonical ({canonical})")
    record = None
    raw = item.get("record")
    if raw is not None:
        record = _parse_record(raw, address, _text(item, "subnet", where), f"{where}.record")
    elif problem is Problem.LEAKED:
        raise ReportInvalid(f"{where}.record: missing (a leak names its record entry)")
    return Finding(
        problem,
        address,
        _text(item, "subnet", where),
        _text(item, "why", where),
        _names(item, "nodes", where),
        _names(item, "pods", where),
        record,
    )


def _parse_record(raw: object, address: str, subnet: str, where: str) -> Recorded:
    if not isinstance(raw, dict):
        raise ReportInvalid(f"{where}: not an object")
    words = {}
    for name in ("block", "node", "id"):
        value = _text(raw, name, where, required=True)
        if not is_record_word(value):
            raise ReportInvalid(f"{where}.{name}: {value!r} is empty or has blanks")
        words[name] = value
    uid = _text(raw, "uid", where)
    flags = {}
    for name in ("primary", "releasing"):
        value = raw.get(name, False)
        if not isinstance(value, bool):
            raise ReportInvalid(f"{where}.{name}: {value!r} is not true or false")
        flags[name] = value
    entry = Entry(words["node"], words["id"], flags["primary"], flags["releasing"], uid)
    return Recorded(address, subnet, words["block"], entry)


def _text(obj: dict[str, Any], name: str, where: str, *, required: bool = False) -> str:
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise ReportInvalid(f"{where}.{name}: {value!r} is not a string")
    if required and not value:
        raise ReportInvalid(f"{where}.{name}: missing")
    return value


def _names(obj: dict[str, Any], name: str, where: str) -> tuple[str, ...]:
    value = obj.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ReportInvalid(f"{where}.{name}: not a list of strings")
    return tuple(value)
