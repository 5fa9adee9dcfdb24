"""One served subnet's round: its planning state synced, the changed nodes planned, the plan
written in order (docs/design/controller-safety.md):

1. the IPBlocks the round touches, each replaced conditionally on the resourceVersion it was
   planned from (or created, which fails if it exists): every address granted, released or added
   to a container this round is in one of them;
2. the NodeNetworkConfig statuses, each conditional on the resourceVersion it was planned from,
   with only the changes whose blocks were written;
3. the ClusterSubnet and ClusterSubnetState status, also conditional.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from sys import intern

import structlog

from cns.controller.notes import NODE_ADDRESS, RESERVED_ADDRESS, ControllerEvents, Withdrawn
from cns.controller.recheck import synced_state, to_thread_to_the_end
from cns.controller.served import Counters, ServedSubnet
from cns.controller.state import PlanningState
from cns.controller.writes import Writer
from cns.core.allocation import block_index
from cns.core.subnet import Subnet
from cns.core.subnet_model import SubnetModel
from cns.core.subnet_plan import Plan, plan_round
from cns.core.types import Scaler
from cns.kube.client import KubeClient
from cns.kube.cluster_subnet import recorded_status, subnet_scalers
from cns.kube.nnc_containers import mentioned_addresses
from cns.kube.objects import NNC
from cns.kube.scalers import merge_scalers
from cns.kube.wire import ClusterSubnet, IPBlock, NodeNetworkConfig, WireScaler
from cns.support import faults

log = structlog.get_logger("cns.controller")

# How long a direct read of a Node may take before the round fails and is tried again.
NODE_READ_SECONDS = 10.0
# At most how many addresses a round plans to grant when the subnet has room for all
# (`SubnetModel.take_slice`): 5,000 nodes' first addresses go in slices of this many, while
# 10 % of them changing at once (up to 64 addresses each) stays one round.
ROUND_ADDRESSES = 32_768


class SubnetRounds:
    """Runs the rounds of the subnets served (`served`, shared with the controller), one at a
    time, and says in the log what each one found and did."""

    def __init__(
        self,
        kube: KubeClient,
        writer: Writer,
        *,
        namespace: str,
        default_scaler: Scaler,
        counters: Counters,
        served: dict[str, ServedSubnet],
        kick: Callable[[], None],
        events: ControllerEvents,
    ) -> None:
        self.kube = kube
        self.events = events
        self.writer = writer
        self.namespace = namespace
        self.default_scaler = default_scaler
        self.counters = counters
        self.served = served
        self.kick = kick

    async def run(
        self,
        served: ServedSubnet,
        cs: ClusterSubnet,
        subnet: Subnet,
        *,
        nncs: dict[str, NodeNetworkConfig],
        blocks: dict[str, IPBlock],
    ) -> None:
        """The subnet's round over its members' NNCs and its IPBlocks (`nncs`, `blocks`: the
        caches' snapshot): the changed nodes, at most ROUND_ADDRESSES addresses of them."""
        state = await self.synced_state(served, subnet, nncs=nncs, blocks=blocks)
        model = state.model
        changed = model.take_slice(model.take_changed(), ROUND_ADDRESSES)
        try:
            await self._plan_and_write(served, cs, subnet, state, nncs, changed)
        finally:
            self.counters.subnet(served.name).rounds += 1
            # Whatever became of the round, the nodes that still need one stay in the next.
            model.settle(changed)
            if model.waiting:
                self.kick()  # the next slice

    async def synced_state(
        self,
        served: ServedSubnet,
        subnet: Subnet,
        *,
        nncs: dict[str, NodeNetworkConfig],
        blocks: dict[str, IPBlock],
    ) -> PlanningState:
        """The subnet's planning state, in step with the snapshot (`recheck.synced_state`)."""
        return await synced_state(served, subnet, nncs=nncs, blocks=blocks, counters=self.counters)

    async def _plan_and_write(
        self,
        served: ServedSubnet,
        cs: ClusterSubnet,
        subnet: Subnet,
        state: PlanningState,
        nncs: dict[str, NodeNetworkConfig],
        changed: set[str],
    ) -> None:
        """Plan the `changed` nodes, then write blocks, NNCs and the subnet status in order."""
        model = state.model
        current, nodes_gone = await self._current_owners(model)
        unlisted = await self._released_unlisted(served, model)
        previous = recorded_status(subnet=cs, state=self.writer.subnet_state(subnet.name))
        # Planning runs in a worker thread (the event loop goes on renewing the lease); nothing
        # changes the model until it returns, also when the round is cancelled meanwhile.
        plan = await to_thread_to_the_end(
            partial(
                plan_round,
                model,
                changed=changed,
                previous=previous,
                rng=served.rng,
                new_id=_new_id,
                current_uids=current,
                nodes_gone=nodes_gone,
                released_unlisted=unlisted,
            )
        )
        await faults.pause("controller.after_plan")
        served.status = plan.status
        self._report_audit(served, plan)
        self._report_withdrawn(served, model)
        failed = await self.writer.write_blocks(subnet, plan, state.blocks)
        self._report_owners(served, plan)
        network = subnet.network

        def confirmed(address: str) -> bool:
            return block_index(network, address) not in failed

        computed: WireScaler = {"batchSize": plan.status.batch}
        scaler = merge_scalers(self.default_scaler, subnet_scalers(cs)[0], computed)
        await self._write_nncs(served, subnet, plan, nncs, confirmed, scaler, changed)
        if plan.released or plan.deferred:
            # The released entries are freed once the containers no longer list them, at the
            # latest in a round that writes no block otherwise.
            self.kick()
        if plan.node_changes or failed:
            log.info(
                "subnet_round",
                subnet=subnet.name,
                planned=len(changed),
                changed=len(plan.node_changes),
                granted=sum(plan.granted.values()),
                released=sum(plan.released.values()),
                short_of=plan.short_of,
                frees_deferred=plan.deferred,
                reserved=plan.status.reserved,
                capacity=plan.capacity,
                batch=plan.status.batch,
                exhausted=plan.status.exhausted,
                blocks_refused=len(failed),
            )
        await self.writer.publish_subnet_status(cs, plan, len(model.nodes), scaler)

    async def _write_nncs(
        self,
        served: ServedSubnet,
        subnet: Subnet,
        plan: Plan,
        nncs: dict[str, NodeNetworkConfig],
        confirmed: Callable[[str], bool],
        scaler: Scaler,
        planned: set[str],
    ) -> None:
        """Patch the NNCs whose status changes: every one when the scaler changed (or at the
        start of a term), else those planned, asked to release, or asked in the last round."""
        asked = set(plan.release_requests)
        if scaler != served.written_scaler:
            names: Iterable[str] = nncs
        else:
            names = (planned | asked | served.asked) & nncs.keys()
        await self.writer.write_nncs(
            names, subnet=subnet, plan=plan, nncs=nncs, confirmed=confirmed, scaler=scaler
        )
        served.written_scaler, served.asked = scaler, asked

    async def _current_owners(self, model: SubnetModel) -> tuple[dict[str, str | None], set[str]]:
        """For nodes holding addresses granted to another NNC object than the cache shows (or
        none): the uid their NNC has now (None if deleted), and which of them have no Node
        object any more. Direct reads, since a cache may lag: an entry of a gone NNC object
        moves to the node's current one, and is freed only once the Node is gone too
        (`plan_round`). The Node is read after the NNC, and only when an entry's object is
        gone."""
        current: dict[str, str | None] = {}
        gone: set[str] = set()
        for node in sorted(model.stale_owners()):
            nnc = await self.kube.get(NNC, node, namespace=self.namespace)
            uid = None if nnc is None else str(nnc["metadata"].get("uid") or "")
            current[node] = uid
            orphaned = any(model.entries[a].uid != uid for a in model.by_node.get(node, ()))
            if orphaned and await self.kube.read_node(node, timeout=NODE_READ_SECONDS) is None:
                gone.add(node)
        return current, gone

    async def _released_unlisted(self, served: ServedSubnet, model: SubnetModel) -> frozenset[str]:
        """The releasing entries whose node's NNC, read directly, lists them no more: only those
        may be freed (`plan_round`).

        The cache cannot tell. The NNC and IPBlock watches are two streams, and a copy of the
        node's NNC older than the grant does not list the address either: freed from that copy,
        it could be granted to another node while the first one's container still lists it. A
        direct read is newer than the `releasing` mark the block cache shows, and nothing adds
        a releasing address to a container again, so what it shows stays true: each entry's
        node is read once, the answer kept while the entry stays as it is."""
        known, found = served.unlisted, {}
        pending: dict[str, list[str]] = defaultdict(list)
        for address in model.releasing:
            entry = model.entries[address]
            if known.get(address) == entry:
                found[address] = entry
            elif all(holder.node != entry.node for holder in model.holders(address)):
                pending[entry.node].append(address)
        for node, addresses in sorted(pending.items()):
            nnc = await self.kube.get(NNC, node, namespace=self.namespace)
            listed = mentioned_addresses(nnc) if nnc is not None else set()
            for address in addresses:
                if str(ipaddress.ip_address(address)) not in listed:
                    found[address] = model.entries[address]
        served.unlisted = found
        return frozenset(found)

    def _report_owners(self, served: ServedSubnet, plan: Plan) -> None:
        """Say what became of the addresses of NNC objects that are gone: moved to the node's
        new object, kept while it has none (once, until that changes), freed with the Node."""
        for node, count in sorted(plan.moved.items()):
            log.warning(
                "nnc_replaced_addresses_kept",
                subnet=served.name,
                node=node,
                addresses=count,
                action="moved to the node's current NodeNetworkConfig under the same ids",
            )
        for node in sorted(plan.kept.keys() - served.keeping):
            log.warning(
                "nnc_gone_addresses_kept",
                subnet=served.name,
                node=node,
                addresses=plan.kept[node],
                action="held for the node, whose Node exists, until its NodeNetworkConfig does",
            )
        served.keeping = set(plan.kept)
        for node, count in sorted(plan.left.items()):
            log.info("node_gone_addresses_freed", subnet=served.name, node=node, addresses=count)

    def _report_audit(self, served: ServedSubnet, plan: Plan) -> None:
        """Log each duplicate or conflict once when it appears, and count it."""
        duplicates, conflicts = frozenset(plan.duplicates), frozenset(plan.conflicts)
        reported_duplicates, reported_conflicts = served.reported
        for address in sorted(duplicates - reported_duplicates):
            log.error(
                "duplicate_address",
                subnet=served.name,
                address=address,
                nodes=list(plan.duplicates[address]),
                action="asking every node that lists it to release it if no pod uses it",
            )
            self.events.duplicate(served.name, address=address, nodes=plan.duplicates[address])
        for address in sorted(conflicts - reported_conflicts):
            listed_by, recorded_for = plan.conflicts[address]
            log.error(
                "address_conflict",
                subnet=served.name,
                address=address,
                listed_by=listed_by,
                recorded_for=recorded_for or None,
                action="asking the node that lists it to release it if no pod uses it",
            )
        for address in sorted((reported_duplicates | reported_conflicts) - duplicates - conflicts):
            log.info("address_conflict_resolved", subnet=served.name, address=address)
        for address in sorted(reported_duplicates - duplicates):
            self.events.duplicate_withdrawn(served.name, address=address)
        self.counters.duplicates_found += len(duplicates - reported_duplicates)
        served.reported = (duplicates, conflicts)
        every = self.served.values()
        self.counters.duplicates = sum(len(other.reported[0]) for other in every)
        self.counters.conflicts = sum(len(other.reported[1]) for other in every)

    def _report_withdrawn(self, served: ServedSubnet, model: SubnetModel) -> None:
        """Say once, when it appears and when it is gone, each withdrawn address a pod still
        holds: a node's own (granted before the node took it) or a reserved one (granted before
        the reservation). Neither shared silently nor taken from the pod, which keeps it until
        its node releases it; it is never granted again."""
        served.node_held = self._report_held(
            served, NODE_ADDRESS, model.node_addresses_held(), served.node_held
        )
        served.reserved_held = self._report_held(
            served, RESERVED_ADDRESS, model.reserved_addresses_held(), served.reserved_held
        )
        every = self.served.values()
        self.counters.node_address_conflicts = sum(len(other.node_held) for other in every)
        self.counters.reserved_addresses_held = sum(len(other.reserved_held) for other in every)

    def _report_held(
        self,
        served: ServedSubnet,
        kind: Withdrawn,
        held: dict[str, tuple[str, ...]],
        said: dict[str, tuple[str, ...]],
    ) -> dict[str, tuple[str, ...]]:
        for address in sorted(held.keys() - said.keys()):
            log.error(
                kind.log_event,
                subnet=served.name,
                address=address,
                held_by=list(held[address]),
                action=f"left with the pod until released, then never granted again; {kind.remedy}",
            )
            self.events.withdrawn_in_use(served.name, kind, address=address, held_by=held[address])
        for address in sorted(said.keys() - held.keys()):
            log.info(f"{kind.log_event}_resolved", subnet=served.name, address=address)
            self.events.withdrawn_released(served.name, kind, address=address)
        return held


def _new_id() -> str:
    """A new IP config's name, interned (as `slim_nnc` and `decode_entry` intern theirs): the
    cache's copy from the write's reply is then this very string."""
    return intern(str(uuid.uuid4()))
