"""`cns controller`: fulfils every node's NodeNetworkConfig from the ClusterSubnets it serves.

One controller serves every ClusterSubnet of the cluster (or, sharded, the one it is given).
Each node takes its addresses from one primary subnet, chosen once by the subnets' node
selectors (cns/core/placement.py) and kept on its NNC, and from each further subnet its NNC
asks for by name (`spec.subnets`), with one network container per subnet. A round goes through
the subnets one after the other; each has its own planning state and its own records, in which
a node is a member under its name (the member is the pair NNC, subnet), so a subnet that fails
its round holds up no other, and one subnet's grants never depend on another's
(docs/design/controller-safety.md, "Nodes in several subnets").

The API server is the only source of truth, read through watches; only the leader (a Lease)
writes. A round brings the planning state up to date with the caches
(cns/controller/state.py), plans the nodes that changed (`plan_round`, in a worker thread so
that the event loop keeps renewing the lease) and writes in an order that makes a stale
writer's grant fail instead of land (docs/design/controller-safety.md):

1. the IPBlocks the round touches, each replaced conditionally on the resourceVersion it was
   planned from (or created, which fails if it exists): every address granted, released or added
   to a container this round is in one of them;
2. the NodeNetworkConfig statuses, each conditional on the resourceVersion it was planned from,
   with only the changes whose blocks were written;
3. the ClusterSubnet and ClusterSubnetState status, also conditional.

Before every write the leader checks that it can still prove it holds the lease (fencing). A
conflict means a cache was stale: the object is read again and the round runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from sys import intern
from typing import Any, TypeVar

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.controller.lease import LeaderElector, LostLeadership
from cns.controller.model import SubnetModel
from cns.controller.plan import Plan, plan_round
from cns.controller.state import SubnetState, read_state
from cns.core.allocation import Entry, apply_changes, block_index, block_network
from cns.core.placement import (
    IPNetwork,
    NodeSelector,
    label_map,
    overlapping,
    parse_node_selector,
    place_node,
)
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, Scaler
from cns.kube import NAMESPACE
from cns.kube.client import KubeClient
from cns.kube.resources import (
    CLUSTER_SUBNET,
    CLUSTER_SUBNET_STATE,
    IP_BLOCK,
    NNC,
    SUBNET_LABEL,
    Kind,
    block_entries,
    block_object,
    block_spec,
    cluster_subnet,
    cluster_subnet_status,
    conditional,
    further_subnets,
    mentioned_addresses,
    merge_scalers,
    nnc_label_patch,
    nnc_object,
    nnc_status_patch,
    nnc_subnet,
    recorded_status,
    slim_block,
    slim_nnc,
    subnet_names,
    subnet_state_exhausted,
    subnet_state_object,
    subnet_state_patch,
)
from cns.kube.watch import WatchedCollection
from cns.support import faults

log = structlog.get_logger("cns.controller")

ROUND_RETRY_SECONDS = 1.0
# How often the planning state is checked against the caches, object by object: a safety net
# for a defect in the incremental updates, not part of correctness.
RECHECK_SECONDS = 300.0
WRITE_CONCURRENCY = 16
# How long a direct read of a Node may take before the round fails and is tried again.
NODE_READ_SECONDS = 10.0
# At most how many addresses a round plans to grant when the subnet has room for all
# (`SubnetModel.take_slice`): 5,000 nodes' first addresses go in slices of this many, while
# 10 % of them changing at once (up to 64 addresses each) stays one round.
ROUND_ADDRESSES = 32_768
_T = TypeVar("_T")
# How often a standby follows the caches into its planning state, at most.
WARM_SECONDS = 1.0


@dataclass(slots=True)
class Counters:
    """What the controller counts, for its metrics endpoint and its tests."""

    rounds: int = 0
    duplicates: int = 0  # addresses in two containers, last round
    duplicates_found: int = 0  # addresses newly found in two containers, ever
    conflicts: int = 0  # addresses listed against the record, last round
    write_conflicts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fenced: int = 0  # rounds stopped because the lease could not be proven
    round_seconds: float = 0.0  # the last round's
    rechecks: int = 0  # planning states built from scratch
    state_differences: int = 0  # rechecks that found the incremental state wrong (a defect)
    round_seconds_total: float = 0.0


async def _bounded(calls: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run the calls concurrently, at most WRITE_CONCURRENCY at a time; the first error wins.

    WRITE_CONCURRENCY workers take the calls from `calls` one after the other, so a lazy
    iterable is consumed only as fast as the writes go out: a term's first round writes every
    NNC, and 5,000 tasks each holding its patch (a container's addresses, as dicts) were the
    controller's memory peak."""
    pending = iter(calls)

    async def worker() -> None:
        for call in pending:
            await call()

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(WRITE_CONCURRENCY):
                group.create_task(worker())
    except BaseExceptionGroup as errors:
        first, *others = errors.exceptions
        for other in others:  # the round fails with the first; the others are said here
            log.warning("concurrent_write_failed", error=repr(other))
        raise first from None


async def _to_thread_to_the_end(call: Callable[[], _T]) -> _T:
    """`call()` in a worker thread; if the caller is cancelled meanwhile, the cancellation waits
    until the thread is done: the call reads the planning state, which whatever runs next
    (a standby's warm-up after a lost term) goes on to change."""
    running = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


@dataclass(slots=True, eq=False)
class SubnetLane:
    """What the controller keeps between rounds for one subnet it serves."""

    name: str
    # The subnet's own draws (the division of scarce addresses): what one subnet's rounds draw
    # changes nothing in another's, also for a node that is a member of both.
    rng: random.Random
    state: SubnetState | None = None  # None until first built from the caches
    checked_at: float = 0.0
    written_scaler: Scaler | None = None
    asked: set[str] = field(default_factory=set)
    reported: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    keeping: set[str] = field(default_factory=set)  # nodes whose addresses wait for an NNC
    # Releasing entries a direct read found gone from their node's NNC (`_released_unlisted`).
    unlisted: dict[str, Entry] = field(default_factory=dict)


@dataclass(slots=True)
class Survey:
    """The ClusterSubnets as one round finds them."""

    # The subnets this controller serves: name -> (object, parsed spec).
    served: dict[str, tuple[dict[str, Any], Subnet]]
    # Every subnet nodes can be placed in (valid, not overlapping another), even those another
    # shard serves: placement must come out the same in every shard.
    selectors: dict[str, NodeSelector]


@dataclass(frozen=True, slots=True)
class NNCSeen:
    """What a round reads of one NNC object: its subnet, the further subnets it is a member of
    (`further_subnets`), the subnets its `spec.subnets` names and the (subnet name, range)
    pairs its network containers hold addresses in."""

    obj: dict[str, Any]
    name: str
    subnet: str
    held: tuple[tuple[str, str], ...]
    further: tuple[str, ...] = ()
    asked: tuple[str, ...] = ()

    @classmethod
    def of(cls, obj: dict[str, Any]) -> NNCSeen:
        containers = (obj.get("status") or {}).get("networkContainers") or ()
        held = tuple(
            (str(nc.get("subnetName")), str(nc.get("subnetAddressSpace")))
            for nc in containers
            if isinstance(nc, dict)
        )
        name, subnet = str(obj["metadata"]["name"]), nnc_subnet(obj)
        return cls(obj, name, subnet, held, further_subnets(obj), subnet_names(obj))


def _age(cs: dict[str, Any]) -> tuple[str, str]:
    meta = cs.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


class Controller:
    """The control plane of the cluster's ClusterSubnets (`subnet_name`: only that one)."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        subnet_name: str = "",
        namespace: str = NAMESPACE,
        identity: str = "",
        default_scaler: Scaler | None = None,
        seed: int | None = None,
        lease_seconds: int = 15,
    ) -> None:
        self.kube = kube
        self.subnet_name = subnet_name
        self.namespace = namespace
        self.identity = identity or f"cns-controller-{uuid.uuid4().hex[:8]}"
        self.default_scaler = default_scaler or Scaler()
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.elector = LeaderElector(
            kube,
            name=f"cns-controller-{subnet_name}" if subnet_name else "cns-controller",
            namespace=namespace,
            identity=self.identity,
            lease_seconds=lease_seconds,
            renew_deadline_seconds=lease_seconds * 2 / 3,
            retry_seconds=max(0.2, lease_seconds / 7.5),
        )
        kube.before_write = self._fence  # every write proves the lease, after any wait
        self._dirty = asyncio.Event()
        self.lanes: dict[str, SubnetLane] = {}
        self._said: dict[tuple[str, ...], str] = {}  # subnet problems logged, by what
        self._unserved: set[str] = set()  # nodes logged as served by no subnet
        self._entries_said: dict[tuple[str, str], str] = {}  # (node, subnet) -> event logged
        self._seen: dict[str, NNCSeen] = {}  # `_nnc_index`'s memory
        self.nodes = kube.watch_nodes(self.kick)
        # The NNCs and IPBlocks hold every address: their caches keep only what a round reads.
        self.nncs = kube.watch(NNC, self.kick, namespace=namespace, slim=slim_nnc)
        # Every ClusterSubnet and state, even sharded: placement and the overlap check need
        # all of them (a handful of small objects).
        self.subnets = kube.watch(CLUSTER_SUBNET, self.kick)
        self.states = kube.watch(CLUSTER_SUBNET_STATE, self.kick)
        self.blocks = kube.watch(
            IP_BLOCK,
            self.kick,
            labels=f"{SUBNET_LABEL}={subnet_name}" if subnet_name else "",
            slim=slim_block,
        )
        self._collections = (self.nodes, self.nncs, self.subnets, self.states, self.blocks)

    def _lane(self, name: str) -> SubnetLane:
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = SubnetLane(name, random.Random(self.rng.getrandbits(64)))
        return lane

    def kick(self) -> None:
        self._dirty.set()

    def _fence(self) -> None:
        self.elector.fence()

    async def run(self) -> None:
        """Watch for as long as the process lives; campaign, lead until the lease is lost, step
        down, campaign again.

        A standby keeps its caches and planning state warm (`_keep_warm`), so a new term starts
        from them rather than from a fresh list: a fail-over costs the lease's expiry and one
        round. That is safe because nothing is trusted beyond what the API server answered:
        every write is conditional on the resourceVersion it was planned from, so a cache that
        lags makes a write fail and be planned again, never land on a stale basis.
        """
        async with asyncio.TaskGroup() as watches:
            for collection in self._collections:
                watches.create_task(collection.run(), name=f"watch-{collection.name}")
            while True:
                await self._stand_by()
                for lane in self.lanes.values():  # a new term writes every NNC status once
                    lane.written_scaler, lane.asked = None, set()
                self.kick()  # the term's first round runs at once
                try:
                    async with asyncio.TaskGroup() as term:
                        term.create_task(self.elector.hold(), name="lease")
                        term.create_task(self._reconcile_forever(), name="reconcile")
                except* LostLeadership as lost:
                    log.warning("leadership_lost", reason=str(lost.exceptions[0]))

    async def _stand_by(self) -> None:
        """Keep the planning state warm until this replica leads."""
        warm = asyncio.create_task(self._keep_warm(), name="keep-warm")
        try:
            await self.elector.acquire()
        finally:
            warm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warm

    async def _keep_warm(self) -> None:
        """Standing by: bring the planning state up to date with the caches (no planning, no
        writes) after changes, at most every WARM_SECONDS, so that a new term's first round has
        only the last changes to catch up with."""
        for collection in self._collections:
            await collection.synced.wait()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._warm_once()
            except Exception as exc:  # the term's first round tries again, and says why
                log.error("standby_sync_failed", error=repr(exc), retry="at the next change")
            await asyncio.sleep(WARM_SECONDS)

    async def _warm_once(self) -> None:
        index = self._nnc_index()
        survey = self._survey(index)
        nncs, blocks = self._snapshot(survey, index)
        for name, (_, subnet) in sorted(survey.served.items()):
            lane = self._lane(name)
            state = await self._synced_state(lane, subnet, nncs=nncs[name], blocks=blocks[name])
            # Only the nodes a round would act on stay for the term's first round (a model just
            # built counts every node as changed; most need nothing).
            state.model.settle(state.model.take_changed())

    async def _reconcile_forever(self) -> None:
        for collection in self._collections:
            await collection.synced.wait()
        while True:
            # Idle, a round still runs every RECHECK_SECONDS: it re-checks the planning state.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), RECHECK_SECONDS)
            self._dirty.clear()
            started = time.perf_counter()
            try:
                failures = await self.reconcile()
            except LostLeadership:
                self.counters.fenced += 1
                raise
            except Exception as exc:
                failures = [("", exc)]
            for subnet, error in failures:
                _round_failed(error, **({"subnet": subnet} if subnet else {}))
            if failures:
                await asyncio.sleep(ROUND_RETRY_SECONDS)
                self.kick()
            self.counters.rounds += 1
            self.counters.round_seconds = time.perf_counter() - started
            self.counters.round_seconds_total += self.counters.round_seconds

    async def reconcile(self) -> list[tuple[str, Exception]]:
        """One round: place new nodes and create their NNCs, then for each subnet served bring
        its planning state up to date with the caches, plan the nodes that changed, and write
        the plan in order. Returns the subnets whose round failed, with why: the others ran
        all the same."""
        index = self._nnc_index()
        survey = self._survey(index)
        if self.subnet_name and self.subnet_name not in survey.served:
            log.info("waiting_for_clustersubnet", subnet=self.subnet_name)
        await self._place_nodes(survey, index)
        self._report_subnet_requests(survey, index)
        failures: list[tuple[str, Exception]] = []
        for name, (cs, subnet) in sorted(survey.served.items()):
            lane = self._lane(name)
            # Each subnet's snapshot is taken when its round starts: an NNC that is a member of
            # several subnets (`spec.subnets`) was maybe just written by an earlier one's round,
            # and a write planned from the version before would be refused (409).
            index = self._nnc_index()
            nncs, blocks = self._snapshot(survey, index, only=name)
            try:
                await self._reconcile_subnet(lane, cs, subnet, nncs=nncs[name], blocks=blocks[name])
            except LostLeadership:
                raise
            except Exception as exc:
                failures.append((name, exc))
        for name in self.lanes.keys() - survey.served.keys():  # deleted, or no longer valid
            del self.lanes[name]
        return failures

    async def _reconcile_subnet(
        self,
        lane: SubnetLane,
        cs: dict[str, Any],
        subnet: Subnet,
        *,
        nncs: dict[str, dict[str, Any]],
        blocks: dict[str, dict[str, Any]],
    ) -> None:
        state = await self._synced_state(lane, subnet, nncs=nncs, blocks=blocks)
        model = state.model
        changed = model.take_slice(model.take_changed(), ROUND_ADDRESSES)
        try:
            await self._plan_and_write(lane, cs, subnet, state, nncs, changed)
        finally:
            # Whatever became of the round, the nodes that still need one stay in the next.
            model.settle(changed)
            if model.waiting:
                self.kick()  # the next slice

    async def _plan_and_write(
        self,
        lane: SubnetLane,
        cs: dict[str, Any],
        subnet: Subnet,
        state: SubnetState,
        nncs: dict[str, dict[str, Any]],
        changed: set[str],
    ) -> None:
        """Plan the `changed` nodes, then write blocks, NNCs and the subnet status in order."""
        model = state.model
        current, nodes_gone = await self._current_owners(model)
        unlisted = await self._released_unlisted(lane, model)
        previous = recorded_status(subnet=cs, state=self._subnet_state(subnet.name))
        # Planning runs in a worker thread (the event loop goes on renewing the lease); nothing
        # changes the model until it returns, also when the round is cancelled meanwhile.
        plan = await _to_thread_to_the_end(
            partial(
                plan_round,
                model,
                changed=changed,
                previous=previous,
                rng=lane.rng,
                new_id=_new_id,
                current_uids=current,
                nodes_gone=nodes_gone,
                released_unlisted=unlisted,
            )
        )
        await faults.pause("controller.after_plan")
        self._report_audit(lane, plan)
        failed = await self._write_blocks(subnet, plan, state.blocks)
        self._report_owners(lane, plan)
        network = subnet.network

        def confirmed(address: str) -> bool:
            return block_index(network, address) not in failed

        computed = {"batchSize": plan.status.batch}
        scaler = merge_scalers(self.default_scaler, (cs.get("spec") or {}).get("scaler"), computed)
        await self._write_nncs(lane, subnet, plan, nncs, confirmed, scaler, changed)
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
        await self._publish_subnet_status(cs, plan, len(model.nodes), scaler)

    def _survey(self, index: dict[str, NNCSeen]) -> Survey:
        """The subnets nodes can be placed in and the ones served here. A ClusterSubnet whose
        spec cannot be read, or whose range overlaps an older one's, is not served: it is said
        once in the log, and its nodes wait."""
        valid: list[tuple[str, dict[str, Any], Subnet, NodeSelector]] = []
        problems: dict[tuple[str, ...], tuple[str, dict[str, str]]] = {}
        for cs in sorted(self.subnets.objects.values(), key=_age):
            name = str(cs["metadata"]["name"])
            try:
                subnet = cluster_subnet(cs, self.default_scaler)
                selector = parse_node_selector((cs.get("spec") or {}).get("nodeSelector"))
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
            for name, network in self._held_ranges(index)
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
        return Survey(
            served={
                name: (cs, subnet)
                for name, cs, subnet, _ in valid
                if name not in refused and self.subnet_name in ("", name)
            },
            selectors={name: sel for name, _, _, sel in valid if name not in refused},
        )

    def _nnc_index(self) -> dict[str, NNCSeen]:
        """What a round reads of every NNC, by cache key: parsed once per object (the watch
        replaces an object that changes, so an identity check tells what is new)."""
        seen = self._seen
        index = {}
        for key, obj in self.nncs.objects.items():
            known = seen.get(key)
            index[key] = known if known is not None and known.obj is obj else NNCSeen.of(obj)
        self._seen = index
        return index

    @staticmethod
    def _held_ranges(index: dict[str, NNCSeen]) -> set[tuple[str, IPNetwork]]:
        """Each (subnet name, range) the NNCs' network containers hold addresses of."""
        spaces = {space for seen in index.values() for space in seen.held}
        held = set()
        for name, space in spaces:
            with contextlib.suppress(ValueError):
                held.add((name, ipaddress.ip_network(space, strict=False)))
        return held

    def _say(self, problems: dict[tuple[str, ...], tuple[str, dict[str, str]]]) -> None:
        """Log each problem of the survey once, when it appears, and when it is gone."""
        for key in problems.keys() - self._said.keys():
            event, fields = problems[key]
            log.error(event, **fields)
        for key in self._said.keys() - problems.keys():
            log.info("subnet_problem_resolved", problem=self._said[key], subject=key[1])
        self._said = {key: event for key, (event, _) in problems.items()}

    async def _place_nodes(self, survey: Survey, index: dict[str, NNCSeen]) -> None:
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
                creates.append(partial(self._create_nnc, meta, placed.subnet))
            else:
                creates.append(partial(self._label_nnc, seen.obj, placed.subnet))
        for name in sorted(unserved - self._unserved):  # once, until it is served or gone
            log.warning("node_not_served", node=name, why="no ClusterSubnet's nodeSelector matches")
        self._unserved = unserved
        await _bounded(creates)

    def _report_subnet_requests(self, survey: Survey, index: dict[str, NNCSeen]) -> None:
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
        return self._survey(index)

    def _snapshot(
        self, survey: Survey, index: dict[str, NNCSeen], only: str = ""
    ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, dict[str, Any]]]]:
        """Per subnet served (or just `only`): its members' NNCs by name and its IPBlocks by
        cache key, as the caches hold them now. An NNC is a member of its primary subnet and of
        each further one it holds or asks for (`NNCSeen.further`). The watch replaces objects
        rather than changing them, so these dicts stay as read (with their resourceVersions)
        while a round runs."""
        served = [only] if only else survey.served
        nncs: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in served}
        blocks: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in served}
        for seen in index.values():
            for subnet_name in (seen.subnet, *seen.further):
                of_subnet = nncs.get(subnet_name)
                if of_subnet is not None:
                    of_subnet[seen.name] = seen.obj
        for key, obj in self.blocks.objects.items():
            of_subnet = blocks.get(block_spec(obj)[0])
            if of_subnet is not None:
                of_subnet[key] = obj
        return nncs, blocks

    def _subnet_state(self, name: str) -> dict[str, Any]:
        """The ClusterSubnetState of a subnet; {} while there is none."""
        return self.states.objects.get(WatchedCollection.key_for(name)) or {}

    async def _synced_state(
        self,
        lane: SubnetLane,
        subnet: Subnet,
        *,
        nncs: dict[str, dict[str, Any]],
        blocks: dict[str, dict[str, Any]],
    ) -> SubnetState:
        """The planning state, brought up to date with the snapshot: built from scratch (in a
        worker thread) the first time and when the subnet's spec changes, else synced.
        Every RECHECK_SECONDS it is then checked against the snapshot (`_recheck`)."""
        state = lane.state
        if state is None or state.subnet != subnet:
            state = await asyncio.to_thread(partial(read_state, subnet, nncs=nncs, blocks=blocks))
            lane.state, lane.checked_at = state, time.monotonic()
            self.counters.rechecks += 1
            return state
        state.sync(nncs=nncs, blocks=blocks)
        if time.monotonic() >= lane.checked_at + RECHECK_SECONDS:
            lane.checked_at = time.monotonic()
            state = await self._recheck(lane, state, nncs=nncs, blocks=blocks)
        return state

    async def _recheck(
        self,
        lane: SubnetLane,
        state: SubnetState,
        *,
        nncs: dict[str, dict[str, Any]],
        blocks: dict[str, dict[str, Any]],
    ) -> SubnetState:
        """The safety net: check the state, just synced with the snapshot, against it object by
        object (`SubnetState.differences`), in a worker thread while the round waits (nothing
        changes the model meanwhile; the event loop goes on renewing the lease). A difference
        is a defect: it is logged and counted, and a state read from scratch takes over.

        It used to build that second state every time and compare, alongside the rounds: a
        whole second copy of the subnet's state for a moment, the controller's memory peak."""
        try:
            differences = await _to_thread_to_the_end(
                partial(state.differences, nncs=nncs, blocks=blocks)
            )
        except Exception as exc:
            log.error("planning_recheck_failed", error=repr(exc), retry_in=RECHECK_SECONDS)
            return state
        self.counters.rechecks += 1
        if not differences:
            return state
        self.counters.state_differences += 1
        log.error("planning_state_differs", subnet=state.subnet.name, differences=differences)
        fresh = await _to_thread_to_the_end(
            partial(read_state, state.subnet, nncs=nncs, blocks=blocks)
        )
        lane.state = fresh
        return fresh

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

    async def _released_unlisted(self, lane: SubnetLane, model: SubnetModel) -> frozenset[str]:
        """The releasing entries whose node's NNC, read directly, lists them no more: only those
        may be freed (`plan_round`).

        The cache cannot tell. The NNC and IPBlock watches are two streams, and a copy of the
        node's NNC older than the grant does not list the address either: freed from that copy,
        it could be granted to another node while the first one's container still lists it. A
        direct read is newer than the `releasing` mark the block cache shows, and nothing adds
        a releasing address to a container again, so what it shows stays true: each entry's
        node is read once, the answer kept in the lane while the entry stays as it is."""
        known, found = lane.unlisted, {}
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
        lane.unlisted = found
        return frozenset(found)

    def _report_owners(self, lane: SubnetLane, plan: Plan) -> None:
        """Say what became of the addresses of NNC objects that are gone: moved to the node's
        new object, kept while it has none (once, until that changes), freed with the Node."""
        for node, count in sorted(plan.moved.items()):
            log.warning(
                "nnc_replaced_addresses_kept",
                subnet=lane.name,
                node=node,
                addresses=count,
                action="moved to the node's current NodeNetworkConfig under the same ids",
            )
        for node in sorted(plan.kept.keys() - lane.keeping):
            log.warning(
                "nnc_gone_addresses_kept",
                subnet=lane.name,
                node=node,
                addresses=plan.kept[node],
                action="held for the node, whose Node exists, until its NodeNetworkConfig does",
            )
        lane.keeping = set(plan.kept)
        for node, count in sorted(plan.left.items()):
            log.info("node_gone_addresses_freed", subnet=lane.name, node=node, addresses=count)

    def _report_audit(self, lane: SubnetLane, plan: Plan) -> None:
        """Log each duplicate or conflict once when it appears, and count it."""
        duplicates, conflicts = frozenset(plan.duplicates), frozenset(plan.conflicts)
        reported_duplicates, reported_conflicts = lane.reported
        for address in sorted(duplicates - reported_duplicates):
            log.error(
                "duplicate_address",
                subnet=lane.name,
                address=address,
                nodes=list(plan.duplicates[address]),
                action="asking every node that lists it to release it if no pod uses it",
            )
        for address in sorted(conflicts - reported_conflicts):
            listed_by, recorded_for = plan.conflicts[address]
            log.error(
                "address_conflict",
                subnet=lane.name,
                address=address,
                listed_by=listed_by,
                recorded_for=recorded_for or None,
                action="asking the node that lists it to release it if no pod uses it",
            )
        for address in sorted((reported_duplicates | reported_conflicts) - duplicates - conflicts):
            log.info("address_conflict_resolved", subnet=lane.name, address=address)
        self.counters.duplicates_found += len(duplicates - reported_duplicates)
        lane.reported = (duplicates, conflicts)
        self.counters.duplicates = sum(len(other.reported[0]) for other in self.lanes.values())
        self.counters.conflicts = sum(len(other.reported[1]) for other in self.lanes.values())

    async def _write_blocks(
        self, subnet: Subnet, plan: Plan, blocks: dict[int, dict[str, Any]]
    ) -> set[int]:
        """Write every block the plan touches; return the indexes whose write was refused."""
        network = subnet.network
        touched: dict[int, dict[str, Entry | None]] = defaultdict(dict)
        for address in plan.touched:
            changes = touched[block_index(network, address)]
            if address in plan.record:
                changes[address] = plan.record[address]
        failed: set[int] = set()

        async def write(index: int, changes: dict[str, Entry | None]) -> None:
            current = blocks.get(index)
            entries = block_entries(current) if current else {}
            apply_changes(entries, changes)
            cidr = str(block_network(network, index))
            body = block_object(subnet_name=subnet.name, index=index, cidr=cidr, entries=entries)
            name = body["metadata"]["name"]
            with self.blocks.writing(WatchedCollection.key_for(name)):
                try:
                    if current is None:
                        written = await self.kube.create(IP_BLOCK, body)
                    else:
                        written = await self.kube.replace(
                            IP_BLOCK, name, conditional(body, read=current)
                        )
                except ApiException as exc:
                    if exc.status not in (404, 409):
                        raise
                    failed.add(index)
                    self._refused(
                        "ipblock_write_refused",
                        exc,
                        counter="ipblock",
                        retry="re-reading the block; its addresses wait for the next round",
                        block=name,
                    )
                    await self._refresh_block(name)
                    return
                # The plan's own entries, not the reply's copies (`slim_block`).
                sent = body["spec"]["allocations"]
                self.blocks.put_written(slim_block(written, entries, sent=sent), read=current)

        await _bounded(partial(write, index, changes) for index, changes in sorted(touched.items()))
        if failed:
            self.kick()
        return failed

    async def _refresh_block(self, name: str) -> None:
        fresh = await self.kube.get(IP_BLOCK, name)
        if fresh is None:
            self.blocks.discard(WatchedCollection.key_for(name))
        else:
            self.blocks.put(fresh)

    async def _write_nncs(
        self,
        lane: SubnetLane,
        subnet: Subnet,
        plan: Plan,
        nncs: dict[str, dict[str, Any]],
        confirmed: Callable[[str], bool],
        scaler: Scaler,
        planned: set[str],
    ) -> None:
        """Patch the NNCs whose status changes: every one when the scaler changed (or at the
        start of a term), else those planned, asked to release, or asked in the last round.
        The subnet's scaler goes to the NNCs it is the primary subnet of; the others (members
        by `spec.subnets`) get their container of this subnet and its release requests."""
        asked = set(plan.release_requests)
        if scaler != lane.written_scaler:
            names: Iterable[str] = nncs
        else:
            names = (planned | asked | lane.asked) & nncs.keys()

        def writes() -> Iterator[Callable[[], Awaitable[None]]]:
            """Each patch built when a worker is free to send it (`_bounded`)."""
            for name in sorted(names):
                nnc = nncs[name]
                change = plan.node_changes.get(name)
                nc = change.container(confirmed) if change is not None else None
                primary = nnc_subnet(nnc) == subnet.name
                patch = nnc_status_patch(
                    nnc,
                    scaler=scaler if primary else None,
                    release=list(plan.release_requests.get(name, ())),
                    nc=nc,
                    subnet_name=subnet.name,
                    subnet_full=bool(plan.short_of),
                )
                if patch is not None:
                    yield partial(self._patch_nnc_status, name, patch=patch, read=nnc, nc=nc)

        await _bounded(writes())
        lane.written_scaler, lane.asked = scaler, asked

    async def _patch_nnc_status(
        self,
        name: str,
        *,
        patch: dict[str, Any],
        read: dict[str, Any],
        nc: NetworkContainer | None,
    ) -> None:
        await faults.pause("controller.before_nnc_write")
        with self.nncs.writing(WatchedCollection.key_for(name, namespace=self.namespace)):
            try:
                updated = await self.kube.merge_patch(
                    NNC, name, patch, namespace=self.namespace, status=True
                )
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                # The node changed its spec meanwhile, or another writer was first: read it
                # again and plan again.
                self._refused(
                    "nnc_write_refused",
                    exc,
                    counter="nodenetworkconfig",
                    retry="re-reading the NNC and planning again",
                    node=name,
                )
                fresh = await self.kube.get(NNC, name, namespace=self.namespace)
                if fresh is not None:
                    self.nncs.put(fresh)
                self.kick()
                return
            # The IP configs written (or, with none, those read) rather than the reply's
            # copies (`slim_nnc`).
            known = [*([nc.ip_configs] if nc is not None else []), *_ip_configs_of(read)]
            self.nncs.put_written(slim_nnc(updated, *known), read=read)

    async def _create_nnc(self, meta: dict[str, Any], subnet_name: str) -> None:
        body = nnc_object(
            node_name=meta["name"],
            node_uid=meta["uid"],
            namespace=self.namespace,
            subnet_name=subnet_name,
        )
        try:
            created = await self.kube.create(NNC, body, namespace=self.namespace)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self._refused(
                "nnc_create_refused",
                exc,
                counter="",
                retry="none needed: the watch delivers the existing NNC",
                node=meta["name"],
            )
            return
        self.nncs.put(created)
        log.info("nnc_created", node=meta["name"], subnet=subnet_name)

    async def _label_nnc(self, nnc: dict[str, Any], subnet_name: str) -> None:
        name = nnc["metadata"]["name"]
        with self.nncs.writing(WatchedCollection.key_for(name, namespace=self.namespace)):
            try:
                updated = await self.kube.merge_patch(
                    NNC, name, nnc_label_patch(nnc, subnet_name), namespace=self.namespace
                )
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                self._refused(
                    "nnc_label_refused",
                    exc,
                    counter="nodenetworkconfig",
                    retry="placing the node again from the NNC the watch delivers",
                    node=name,
                )
                self.kick()
                return
            self.nncs.put_written(updated, read=nnc)
        log.info("nnc_placed", node=name, subnet=subnet_name)

    async def _publish_subnet_status(
        self, cs: dict[str, Any], plan: Plan, node_count: int, scaler: Scaler
    ) -> None:
        status = plan.status
        name = str(cs["metadata"]["name"])
        cs_status = cluster_subnet_status(
            status,
            scaler=scaler,
            capacity=plan.capacity,
            node_count=node_count,
            duplicates=len(plan.duplicates),
            conflicts=len(plan.conflicts),
        )
        if {k: (cs.get("status") or {}).get(k) for k in cs_status} != cs_status:
            await self._patch_cluster_status(
                self.subnets, CLUSTER_SUBNET, read=cs, patch={"status": cs_status}
            )
        state = self._subnet_state(name)
        if not state:
            try:
                state = await self.kube.create(CLUSTER_SUBNET_STATE, subnet_state_object(name))
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self._refused(
                    "status_write_refused",
                    exc,
                    counter=CLUSTER_SUBNET_STATE.plural,
                    retry="planning again",
                    kind=CLUSTER_SUBNET_STATE.plural,
                    name=name,
                )
                self.kick()
                return
            self.states.put(state)
        if subnet_state_exhausted(state) != status.exhausted:
            log.warning("subnet_exhaustion_changed", subnet=name, exhausted=status.exhausted)
            await self._patch_cluster_status(
                self.states,
                CLUSTER_SUBNET_STATE,
                read=state,
                patch=subnet_state_patch(exhausted=status.exhausted, at=dt.datetime.now(dt.UTC)),
            )

    async def _patch_cluster_status(
        self,
        collection: WatchedCollection,
        kind: Kind,
        *,
        read: dict[str, Any],
        patch: dict[str, Any],
    ) -> None:
        """Merge-patch the status of a cluster-scoped object, conditional on the resourceVersion
        it was read at; another round when someone else wrote it first."""
        name = read["metadata"]["name"]
        body = conditional(patch, read=read)
        with collection.writing(WatchedCollection.key_for(name)):
            try:
                updated = await self.kube.merge_patch(kind, name, body, status=True)
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                self._refused(
                    "status_write_refused",
                    exc,
                    counter=kind.plural,
                    retry="planning again",
                    kind=kind.plural,
                    name=name,
                )
                self.kick()
                return
            collection.put_written(updated, read=read)

    def _refused(
        self, event: str, exc: ApiException, *, counter: str, retry: str, **names: str
    ) -> None:
        """Log a refused write with the object, the API server's reason and what happens next;
        count it under `counter` ("" for a create that found the object there already)."""
        if counter:
            self.counters.write_conflicts[counter] += 1
        log.warning(event, status=exc.status, reason=refusal_reason(exc), retry=retry, **names)


# What `_report_subnet_requests` says of an entry of `spec.subnets` that gets nothing.
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


def _ip_configs_of(nnc: dict[str, Any]) -> list[tuple[IPConfig, ...]]:
    """The IP configs of a slim NNC's containers (`slim_nnc`), parsed already."""
    containers = (nnc.get("status") or {}).get("networkContainers") or ()
    return [
        nc["ipAssignments"]
        for nc in containers
        if isinstance(nc, dict) and isinstance(nc.get("ipAssignments"), tuple)
    ]


def _round_failed(exc: Exception, **names: str) -> None:
    """Log a failed round (of one subnet, when `names` says which); the next starts after
    ROUND_RETRY_SECONDS."""
    if isinstance(exc, ApiException):
        log.warning(
            "round_failed",
            status=exc.status,
            reason=refusal_reason(exc),
            retry_in=ROUND_RETRY_SECONDS,
            **names,
        )
    else:
        log.error("round_failed", error=repr(exc), retry_in=ROUND_RETRY_SECONDS, **names)


def refusal_reason(exc: ApiException) -> str:
    """The API server's message for a refused write (its Status object), else the HTTP reason."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or exc.reason or "")


def _new_id() -> str:
    """A new IP config's name, interned (as `slim_nnc` and `decode_entry` intern theirs): the
    cache's copy from the write's reply is then this very string."""
    return intern(str(uuid.uuid4()))


def _newer(obj: dict[str, Any], cached: dict[str, Any]) -> bool:
    """Whether `obj` is a later version than `cached` (resourceVersions compared as the
    integers etcd makes them; one that is not an integer is never taken for newer)."""
    try:
        return int(obj["metadata"]["resourceVersion"]) > int(cached["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return False
