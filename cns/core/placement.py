"""Which ClusterSubnet a node takes its addresses from.

One controller serves every ClusterSubnet of a cluster, and each node takes its addresses from
one of them. A ClusterSubnet says which nodes it serves with a `nodeSelector`, in the form of
Kubernetes' own label selectors (`matchLabels`, `matchExpressions` with In, NotIn, Exists and
DoesNotExist), as a NetworkPolicy selects pods or Calico's IPPool selects nodes:

- a node goes to the subnet whose selector matches its labels;
- a subnet without a selector (or with an empty one) serves the nodes that no selector claims,
  so a cluster of one subnet needs no selector at all;
- several subnets that claim the same node at the same rank are an operator's mistake: the
  node goes to the first by name, always the same one, and the controller says so.

A node keeps the subnet it has: the choice is made once, when the node has none yet, and kept
on its NodeNetworkConfig (docs/kubernetes.md, "Several subnets"). Two subnets whose ranges
overlap could grant one address to two nodes, so only the older of them is served
(`overlapping`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True, slots=True)
class Requirement:
    """One label requirement: `key` `operator` `values`."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return labels.get(self.key) not in self.values  # NotIn: also true without the label


@dataclass(frozen=True, slots=True)
class NodeSelector:
    """Every requirement must hold. No requirement at all: the subnet serves the nodes no other
    subnet claims."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)


def parse_node_selector(raw: Any, field: str = "spec.nodeSelector") -> NodeSelector:
    """A label selector as the API server holds it (absent or null: no requirement).

    Raises ValueError naming the field at fault: a selector that cannot be read must not be
    taken as "every node"."""
    if raw is None:
        return NodeSelector()
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: a label selector is an object, not {type(raw).__name__}")
    unknown = set(raw) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"{field}: unknown fields {sorted(unknown)}")
    requirements: list[Requirement] = []
    match_labels = raw.get("matchLabels") or {}
    if not isinstance(match_labels, dict):
        raise ValueError(f"{field}.matchLabels: an object of label values")
    for key, value in sorted(match_labels.items()):
        if not isinstance(value, str):
            raise ValueError(f"{field}.matchLabels.{key}: a label value is a string")
        requirements.append(Requirement(str(key), "In", frozenset((value,))))
    expressions = raw.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise ValueError(f"{field}.matchExpressions: a list of requirements")
    for index, expression in enumerate(expressions):
        requirements.append(_requirement(expression, f"{field}.matchExpressions[{index}]"))
    return NodeSelector(tuple(requirements))


def _requirement(raw: Any, field: str) -> Requirement:
    if not isinstance(raw, dict) or not isinstance(raw.get("key"), str) or not raw["key"]:
        raise ValueError(f"{field}.key: a requirement names a label key")
    operator = raw.get("operator")
    if operator not in OPERATORS:
        raise ValueError(f"{field}.operator: {operator!r} is not one of {', '.join(OPERATORS)}")
    values = raw.get("values") or []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{field}.values: a list of strings")
    if operator in ("In", "NotIn") and not values:
        raise ValueError(f"{field}.values: {operator} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ValueError(f"{field}.values: {operator} takes no values")
    return Requirement(raw["key"], operator, frozenset(values))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a node goes: `subnet` ("" when none serves it) and, when several subnets claimed
    it at the same rank, all of them (`contested`, `subnet` first)."""

    subnet: str
    contested: tuple[str, ...] = ()


def place_node(labels: Mapping[str, str], selectors: Mapping[str, NodeSelector]) -> Placement:
    """The subnet of a node that has none yet, from the served subnets' selectors by name."""
    specific = sorted(n for n, s in selectors.items() if s.requirements and s.matches(labels))
    candidates = specific or sorted(n for n, s in selectors.items() if not s.requirements)
    if not candidates:
        return Placement("")
    return Placement(candidates[0], tuple(candidates) if len(candidates) > 1 else ())


def overlapping(subnets: Sequence[tuple[str, IPNetwork]]) -> dict[str, str]:
    """The subnets that cannot be served because their range overlaps one earlier in
    `subnets` (oldest first), each with the one it overlaps. Only the first one is served: two
    subnets sharing addresses would keep separate records of them and could both grant one."""
    served: list[tuple[str, IPNetwork]] = []
    refused: dict[str, str] = {}
    for name, network in subnets:
        other = next((n for n, net in served if _overlap(net, network)), None)
        if other is None:
            served.append((name, network))
        else:
            refused[name] = other
    return refused


def _overlap(a: IPNetwork, b: IPNetwork) -> bool:
    return a.version == b.version and a.overlaps(b)


def label_map(raw: Any) -> dict[str, str]:
    """An object's labels as strings (anything else in the field is ignored)."""
    if not isinstance(raw, dict):
        return {}
    return {str(k): v for k, v in raw.items() if isinstance(v, str)}
