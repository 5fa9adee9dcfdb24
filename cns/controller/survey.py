"""Which ClusterSubnets the controller serves and which nodes are members of each.

A round starts with the survey: every NNC read once (`NNCSeen`), the ClusterSubnets sorted
into served and not (a spec that cannot be read, or a range over an older subnet's or over
addresses nodes still hold, is not served, said once in the log), new nodes placed in a
subnet (their NNC created or labelled), and one snapshot of the caches per served subnet.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import structlog

from cns.controller.writes import Writer, bounded
from cns.core.placement import (
    IPNetwork,
    NodeSelector,
    label_map,
    overlapping,
    parse_node_selector,
    place_node,
)
from cns.core.subnet import Address, Subnet
from cns.core.types import Scaler
from cns.kube.client import KubeClient
from cns.kube.cluster_subnet import cluster_subnet
from cns.kube.ipblock import block_spec
from cns.kube.nnc import further_subnets, nnc_subnet, subnet_names
from cns.kube.node_addresses import NodeAddressProblem, node_addresses
from cns.kube.objects import CLUSTER_SUBNET
from cns.kube.watch import WatchedCollection
from cns.kube.wire import ClusterSubnet, IPBlock, KubeObject, Node, NodeNetworkConfig

log = structlog.get_logger("cns.controller")

# Per served subnet: its members' NNCs by name, and its IPBlocks by cache key.
# A Node object as read: the object, its own addresses, the entries that could not be read.
NodeRead = tuple[Node, list[Address], list[NodeAddressProblem]]
Snapshot = tuple[dict[str, dict[str, NodeNetworkConfig]], dict[str, dict[str, IPBlock]]]


@dataclass(slots=True)
class Survey:
    """The ClusterSubnets as one round finds them."""

    # The subnets this controller serves: name -> (object, parsed spec).
    served: dict[str, tuple[ClusterSubnet, Subnet]]
    # Every subnet nodes can be placed in (valid, not overlapping another), even those another
    # shard serves: placement must come out the same in every shard.
    selectors: dict[str, NodeSelector]


@dataclass(frozen=True, slots=True)
class NNCSeen:
    """What a round reads of one NNC object: its subnet, the further subnets it is a member of
    (`further_subnets`), the subnets its `spec.subnets` names and the (subnet name, range)
    pairs its network containers hold addresses in."""

    obj: NodeNetworkConfig
    name: str
    subnet: str
    held: tuple[tuple[str, str], ...]
    further: tuple[str, ...] = ()
    asked: tuple[str, ...] = ()

    @classmethod
    def of(cls, obj: NodeNetworkConfig) -> NNCSeen:
        containers = (obj.get("status") or {}).get("networkContainers") or ()
        held = tuple(
            (str(nc.get("subnetName")), str(nc.get("subnetAddressSpace")))
            for nc in containers
            if isinstance(nc, dict)
        )
        name, subnet = str(obj["metadata"]["name"]), nnc_subnet(obj)
        return cls(obj, name, subnet, held, further_subnets(obj), subnet_names(obj))


# What `report_subnet_requests` says of an entry of `spec.subnets` that gets nothing.
_ENTRY_PROBLEMS = {
    "nnc_subnet_entry_ignored": (
        "it names the node's primary subnet",
        "ignored: the spec's own requestedIPCount, ipsNotInUse and requestedIPs are that "
        "subnet's request",
    ),
    "nnc_subnet_unknown": (
        "no ClusterSubnet of this name is served (none exists, or it is invalid or overlaps)",
        "nothing granted until it is",
    ),
}


class Surveyor:
    """Surveys the caches for each round, and remembers what it said in the log so that each
    problem is said once, when it appears, and when it is gone."""

    def __init__(
        self,
        kube: KubeClient,
        writer: Writer,
        *,
        subnet_name: str,
        namespace: str,
        default_scaler: Scaler,
        nodes: WatchedCollection[Node],
        nncs: WatchedCollection[NodeNetworkConfig],
        subnets: WatchedCollection[ClusterSubnet],
        blocks: WatchedCollection[IPBlock],
    ) -> None:
        self.kube = kube
        self.writer = writer
        self.subnet_name = subnet_name
        self.namespace = namespace
        self.default_scaler = default_scaler
        self.nodes = nodes
        self.nncs = nncs
        self.subnets = subnets
        self.blocks = blocks
        self._said: dict[tuple[str, ...], str] = {}  # subnet problems logged, by what
        self._unserved: set[str] = set()  # nodes logged as served by no subnet
        self._entries_said: dict[tuple[str, str], str] = {}  # (node, subnet) -> event logged
        self._seen: dict[str, NNCSeen] = {}  # `nnc_index`'s memory
        # `_node_addresses`' memory, by Node cache key.
        self._node_read: dict[str, NodeRead] = {}
        self._address_problems: set[NodeAddressProblem] = set()  # logged, until gone
        self._excluding: dict[Subnet, Subnet] = {}  # `_excluding_node_addresses`' memory
        self._node_changes = -1  # `nodes.changes` at the last `_read_node_addresses`

    def survey(self, index: dict[str, NNCSeen]) -> Survey:
        """The subnets nodes can be placed in and the ones served here. A ClusterSubnet whose
        spec cannot be read, or whose range overlaps an older one's, is not served: it is said
        once in the log, and its nodes wait."""
        valid: list[tuple[str, ClusterSubnet, Subnet, NodeSelector]] = []
        problems: dict[tuple[str, ...], tuple[str, dict[str, str]]] = {}
        for cs in sorted(self.subnets.objects.values(), key=_age):
            name = str(cs["metadata"]["name"])
            try:
                subnet = cluster_subnet(cs, self.default_scaler)
                spec = cs.get("spec")
                selector = parse_node_selector(spec.get("nodeSelector") if spec else None)
            except (KeyError, TypeError, ValueError) as exc:
                problems[("invalid", name, str(exc))] = (
                    "subnet_invalid",
                    {"subnet": name, "error": str(exc), "action": "not served until fixed"},
                )
                continue
            valid.append((name, cs, subnet, selector))
        # Ranges nodes still hold for a subnet that is gone (or unreadable) come first: a new
        # subnet over them could grant addresses in use.
        names = {name for name, _, _, _ in valid}
        orphans = sorted(
            (f"{name} (deleted, still held by nodes)", network)
            for name, network in _held_ranges(index)
            if name not in names
        )
        ranges = [*orphans, *((name, subnet.network) for name, _, subnet, _ in valid)]
        refused = {name: older for name, older in overlapping(ranges).items() if name in names}
        for name, older in refused.items():
            problems[("overlap", name, older)] = (
                "subnet_overlaps",
                {"subnet": name, "older": older, "action": "not served: the older one is"},
            )
        self._say(problems)
        served = [
            (name, cs, subnet)
            for name, cs, subnet, _ in valid
            if name not in refused and self.subnet_name in ("", name)
        ]
        excluding = self._excluding_node_addresses([subnet for _, _, subnet in served])
        return Survey(
            served={name: (cs, excluding[subnet]) for name, cs, subnet in served},
            selectors={name: sel for name, _, _, sel in valid if name not in refused},
        )

    def nnc_index(self) -> dict[str, NNCSeen]:
        """What a round reads of every NNC, by cache key: parsed once per object (the watch
        replaces an object that changes, so an identity check tells what is new)."""
        seen = self._seen
        index = {}
        for key, obj in self.nncs.objects.items():
            known = seen.get(key)
            index[key] = known if known is not None and known.obj is obj else NNCSeen.of(obj)
        self._seen = index
        return index

    def _excluding_node_addresses(self, subnets: list[Subnet]) -> dict[Subnet, Subnet]:
        """Each subnet with the nodes' own addresses excluded (`Subnet.with_node_addresses`),
        computed again only when a node's addresses or a subnet's spec changed: the same object
        otherwise, so that the planning state sees the same subnet and costs nothing (a
        subnet of 5,000 nodes' addresses took 15 ms to compute)."""
        if not subnets:
            return {}
        if self._read_node_addresses():
            self._excluding = {}
        known, excluding = self._excluding, {}
        own: list[Address] | None = None  # gathered only when a subnet is computed
        for subnet in subnets:
            found = known.get(subnet)
            if found is None:
                if own is None:
                    own = [a for _, addresses, _ in self._node_read.values() for a in addresses]
                found = subnet.with_node_addresses(own)
            excluding[subnet] = found
        self._excluding = excluding
        return excluding

    def _read_node_addresses(self) -> bool:
        """Read every node's own addresses (InternalIP, ExternalIP), once per Node object (the
        watch replaces an object that changes); whether they changed since the last read. An
        entry that cannot be read is said once in the log, naming its field, and ignored."""
        if self.nodes.changes == self._node_changes:
            return False
        self._node_changes = self.nodes.changes
        known = self._node_read
        read: dict[str, NodeRead] = {}
        changed = reread = False
        for key, node in self.nodes.objects.items():
            cached = known.get(key)
            if cached is not None and cached[0] is node:
                read[key] = cached
            else:
                addresses, found = node_addresses(node)
                read[key] = (node, addresses, found)
                changed |= addresses != (cached[1] if cached is not None else [])
                reread = True
        gone = known.keys() - read.keys() if len(read) != len(known) or reread else set()
        changed |= any(known[key][1] for key in gone)
        self._node_read = read
        if not (reread or gone):
            return changed
        problems = {problem for _, _, found in read.values() for problem in found}
        for problem in sorted(problems - self._address_problems, key=str):
            log.warning(
                "node_address_invalid",
                node=problem.node,
                field=problem.field,
                value=problem.value,
                error=problem.error,
                action="ignored: not excluded from any subnet",
            )
        self._address_problems = problems
        return changed

    def _say(self, problems: dict[tuple[str, ...], tuple[str, dict[str, str]]]) -> None:
        """Log each problem of the survey once, when it appears, and when it is gone."""
        for key in problems.keys() - self._said.keys():
            event, fields = problems[key]
            log.error(event, **fields)
        for key in self._said.keys() - problems.keys():
            log.info("subnet_problem_resolved", problem=self._said[key], subject=key[1])
        self._said = {key: event for key, (event, _) in problems.items()}

    async def place_nodes(self, survey: Survey, index: dict[str, NNCSeen]) -> None:
        """Give every node a subnet once: create the NNC of a node that has none, labelled
        with its subnet, and label an NNC that names none (made by an earlier version, or
        whose node no subnet served). Sharded, only the nodes placed in our subnet. A node no
        subnet serves gets no NNC yet: its daemon waits (said once in the log)."""
        creates: list[Callable[[], Awaitable[None]]] = []
        unserved = set()
        pending = []
        for node in self.nodes.objects.values():
            meta = node["metadata"]
            seen = index.get(WatchedCollection.key_for(meta["name"], namespace=self.namespace))
            if seen is None or not seen.subnet:
                pending.append((meta, seen))
        if pending:
            survey = await self._survey_now(index)
        for meta, seen in pending:
            placed = place_node(label_map(meta.get("labels")), survey.selectors)
            if not placed.subnet:
                unserved.add(meta["name"])
                continue
            if placed.contested:
                log.warning(
                    "node_claimed_by_several_subnets",
                    node=meta["name"],
                    subnets=list(placed.contested),
                    placed_in=placed.subnet,
                )
            if self.subnet_name not in ("", placed.subnet):
                continue  # another shard's node
            if seen is None:
                creates.append(partial(self.writer.create_nnc, meta, placed.subnet))
            else:
                creates.append(partial(self.writer.label_nnc, seen.obj, placed.subnet))
        for name in sorted(unserved - self._unserved):  # once, until it is served or gone
            log.warning("node_not_served", node=name, why="no ClusterSubnet's nodeSelector matches")
        self._unserved = unserved
        await bounded(creates)

    def report_subnet_requests(self, survey: Survey, index: dict[str, NNCSeen]) -> None:
        """Say once, per node and subnet, an entry of `spec.subnets` that gets nothing: one
        naming the node's primary subnet (ignored: the spec's own fields are that subnet's
        request), or a ClusterSubnet that does not exist or cannot be served (nothing granted
        until it can), and again when that is over. Sharded, only for our own nodes."""
        problems: dict[tuple[str, str], str] = {}
        for seen in index.values():
            if self.subnet_name not in ("", seen.subnet):
                continue
            for name in seen.asked:
                if name == seen.subnet:
                    problems[(seen.name, name)] = "nnc_subnet_entry_ignored"
                elif name not in survey.selectors:
                    problems[(seen.name, name)] = "nnc_subnet_unknown"
        for node, name in sorted(problems.keys() - self._entries_said.keys()):
            event = problems[(node, name)]
            why, action = _ENTRY_PROBLEMS[event]
            log.warning(event, node=node, subnet=name, why=why, action=action)
        for node, name in sorted(self._entries_said.keys() - problems.keys()):
            log.info("nnc_subnet_entry_resolved", node=node, subnet=name)
        self._entries_said = problems

    async def _survey_now(self, index: dict[str, NNCSeen]) -> Survey:
        """The survey from the ClusterSubnets as the API server has them now. A placement is
        for good, and the subnet watch may lag the node watch: a node that joined just after
        its subnet was created must not land in a catch-all subnet because the new subnet's
        event had not arrived. A consistent list shows every subnet created before the node."""
        for obj in await self.kube.list_now(CLUSTER_SUBNET):
            cached = self.subnets.objects.get(WatchedCollection.key(obj))
            if cached is None or _newer(obj, cached):
                self.subnets.put(obj)
        return self.survey(index)

    def snapshot(self, survey: Survey, index: dict[str, NNCSeen], only: str = "") -> Snapshot:
        """Per subnet served (or just `only`): its members' NNCs by name and its IPBlocks by
        cache key, as the caches hold them now. An NNC is a member of its primary subnet and of
        each further one it holds or asks for (`NNCSeen.further`). The watch replaces objects
        rather than changing them, so these dicts stay as read (with their resourceVersions)
        while a round runs."""
        served = [only] if only else survey.served
        nncs: dict[str, dict[str, NodeNetworkConfig]] = {name: {} for name in served}
        blocks: dict[str, dict[str, IPBlock]] = {name: {} for name in served}
        for seen in index.values():
            for subnet_name in (seen.subnet, *seen.further):
                of_subnet = nncs.get(subnet_name)
                if of_subnet is not None:
                    of_subnet[seen.name] = seen.obj
        for key, block in self.blocks.objects.items():
            blocks_of_subnet = blocks.get(block_spec(block)[0])
            if blocks_of_subnet is not None:
                blocks_of_subnet[key] = block
        return nncs, blocks


def _held_ranges(index: dict[str, NNCSeen]) -> set[tuple[str, IPNetwork]]:
    """Each (subnet name, range) the NNCs' network containers hold addresses of."""
    spaces = {space for seen in index.values() for space in seen.held}
    held = set()
    for name, space in spaces:
        with contextlib.suppress(ValueError):
            held.add((name, ipaddress.ip_network(space, strict=False)))
    return held


def _age(cs: ClusterSubnet) -> tuple[str, str]:
    meta = cs.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def _newer(obj: KubeObject, cached: KubeObject) -> bool:
    """Whether `obj` is a later version than `cached` (resourceVersions compared as the
    integers etcd makes them; one that is not an integer is never taken for newer)."""
    try:
        return int(obj["metadata"]["resourceVersion"]) > int(cached["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return False
