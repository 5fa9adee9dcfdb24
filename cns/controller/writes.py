"""The controller's writes to the API server, and the one way a refused write is handled.

A write is refused (404, 409; for a create, 409) when a cache was stale or another writer was
first: the refusal is logged with the object and the API server's reason, counted, the object
read again where the next round needs it, and another round asked for (`Writer.attempt`).
Every write the round plans is conditional on the resourceVersion it was planned from
(docs/design/controller-safety.md).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from functools import partial
from typing import TypeVar

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.controller.notes import ControllerEvents
from cns.controller.served import Counters
from cns.core.allocation import Entry, apply_changes, block_index, block_network
from cns.core.subnet import Subnet
from cns.core.subnet_plan import Plan
from cns.core.types import IPConfig, NetworkContainer, Scaler
from cns.kube.client import KubeClient
from cns.kube.cluster_subnet import (
    cluster_subnet_status,
    subnet_state_exhausted,
    subnet_state_object,
    subnet_state_patch,
)
from cns.kube.ipblock import block_entries, block_object, slim_block
from cns.kube.nnc import nnc_label_patch, nnc_object, nnc_status_patch, nnc_subnet, slim_nnc
from cns.kube.objects import CLUSTER_SUBNET, CLUSTER_SUBNET_STATE, IP_BLOCK, NNC, Kind, conditional
from cns.kube.watch import WatchedCollection
from cns.kube.wire import (
    ClusterSubnet,
    ClusterSubnetState,
    IPBlock,
    NodeNetworkConfig,
    ObjectMeta,
    ObjectT,
)
from cns.support import faults

log = structlog.get_logger("cns.controller")

WRITE_CONCURRENCY = 16
_T = TypeVar("_T")


async def bounded(calls: Iterable[Callable[[], Awaitable[None]]]) -> None:
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


def refusal_reason(exc: ApiException) -> str:
    """The API server's message for a refused write (its Status object), else the HTTP reason."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or exc.reason or "")


class Writer:
    """Writes the round's IPBlocks, NNCs and subnet status through the caches that watch them
    (`WatchedCollection.writing`, `put_written`), so that a round sees its own writes."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        namespace: str,
        counters: Counters,
        kick: Callable[[], None],
        nncs: WatchedCollection[NodeNetworkConfig],
        blocks: WatchedCollection[IPBlock],
        subnets: WatchedCollection[ClusterSubnet],
        states: WatchedCollection[ClusterSubnetState],
        events: ControllerEvents,
    ) -> None:
        self.kube = kube
        self.events = events
        self.namespace = namespace
        self.counters = counters
        self.kick = kick
        self.nncs = nncs
        self.blocks = blocks
        self.subnets = subnets
        self.states = states

    async def attempt(
        self,
        write: Callable[[], Awaitable[_T]],
        *,
        event: str,
        counter: str,
        retry: str,
        creating: bool = False,
        reread: Callable[[], Awaitable[None]] | None = None,
        kick: bool = True,
        subnet: str,
        **names: str,
    ) -> _T | None:
        """`write()`'s answer, or None when the API server refused it: 404 or 409, or only 409
        when `creating` (the object exists already). A refusal is logged as `event` with the
        object (`names`), the API server's reason and what happens next (`retry`), counted
        under `counter` ("" counts nothing), followed by `reread` (the object read again) and,
        with `kick`, another round. Any other error is the round's. Writes taken and refused
        are also counted for the `subnet` they are made for."""
        counts = self.counters.subnet(subnet)
        try:
            written = await write()
        except ApiException as exc:
            if exc.status not in ((409,) if creating else (404, 409)):
                raise
            counts.refusals += 1
            if counter:
                self.counters.write_conflicts[counter] += 1
            log.warning(
                event,
                status=exc.status,
                reason=refusal_reason(exc),
                retry=retry,
                subnet=subnet,
                **names,
            )
            if reread is not None:
                await reread()
            if kick:
                self.kick()
            return None
        counts.writes += 1
        return written

    def subnet_state(self, name: str) -> ClusterSubnetState:
        """The ClusterSubnetState of a subnet; {} while there is none."""
        return self.states.objects.get(WatchedCollection.key_for(name)) or {}

    async def write_blocks(
        self, subnet: Subnet, plan: Plan, blocks: dict[int, IPBlock]
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
            if current is None:
                send = partial(self.kube.create, IP_BLOCK, body)
            else:
                send = partial(self.kube.replace, IP_BLOCK, name, conditional(body, read=current))
            with self.blocks.writing(WatchedCollection.key_for(name)):
                written = await self.attempt(
                    send,
                    event="ipblock_write_refused",
                    counter="ipblock",
                    retry="re-reading the block; its addresses wait for the next round",
                    reread=partial(self._reread_block, name),
                    kick=False,  # once, after every block (below)
                    subnet=subnet.name,
                    block=name,
                )
                if written is None:
                    failed.add(index)
                    return
                # The plan's own entries, not the reply's copies (`slim_block`).
                sent = body["spec"]["allocations"]
                self.blocks.put_written(slim_block(written, entries, sent=sent), read=current)

        await bounded(partial(write, index, changes) for index, changes in sorted(touched.items()))
        if failed:
            self.kick()
        return failed

    async def _reread_block(self, name: str) -> None:
        fresh = await self.kube.get(IP_BLOCK, name)
        if fresh is None:
            self.blocks.discard(WatchedCollection.key_for(name))
        else:
            self.blocks.put(fresh)

    async def write_nncs(
        self,
        names: Iterable[str],
        *,
        subnet: Subnet,
        plan: Plan,
        nncs: dict[str, NodeNetworkConfig],
        confirmed: Callable[[str], bool],
        scaler: Scaler,
    ) -> None:
        """Patch the status of the NNCs `names` where it changes. The subnet's scaler goes to
        the NNCs it is the primary subnet of; the others (members by `spec.subnets`) get their
        container of this subnet and its release requests."""

        def writes() -> Iterator[Callable[[], Awaitable[None]]]:
            """Each patch built when a worker is free to send it (`bounded`)."""
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
                    yield partial(
                        self._patch_nnc_status,
                        name,
                        patch=patch,
                        read=nnc,
                        nc=nc,
                        subnet_name=subnet.name,
                    )

        await bounded(writes())

    async def _patch_nnc_status(
        self,
        name: str,
        *,
        patch: NodeNetworkConfig,
        read: NodeNetworkConfig,
        nc: NetworkContainer | None,
        subnet_name: str,
    ) -> None:
        await faults.pause("controller.before_nnc_write")
        with self.nncs.writing(WatchedCollection.key_for(name, namespace=self.namespace)):
            # Refused: the node changed its spec meanwhile, or another writer was first.
            updated = await self.attempt(
                partial(
                    self.kube.merge_patch, NNC, name, patch, namespace=self.namespace, status=True
                ),
                event="nnc_write_refused",
                counter="nodenetworkconfig",
                retry="re-reading the NNC and planning again",
                reread=partial(self._reread_nnc, name),
                subnet=subnet_name,
                node=name,
            )
            if updated is None:
                return
            # The IP configs written (or, with none, those read) rather than the reply's
            # copies (`slim_nnc`).
            known = [*([nc.ip_configs] if nc is not None else []), *_ip_configs_of(read)]
            self.nncs.put_written(slim_nnc(updated, *known), read=read)

    async def _reread_nnc(self, name: str) -> None:
        fresh = await self.kube.get(NNC, name, namespace=self.namespace)
        if fresh is not None:
            self.nncs.put(fresh)

    async def create_nnc(self, meta: ObjectMeta, subnet_name: str) -> None:
        body = nnc_object(
            node_name=meta["name"],
            node_uid=meta["uid"],
            namespace=self.namespace,
            subnet_name=subnet_name,
        )
        created = await self.attempt(
            partial(self.kube.create, NNC, body, namespace=self.namespace),
            event="nnc_create_refused",
            counter="",
            retry="none needed: the watch delivers the existing NNC",
            creating=True,
            kick=False,
            subnet=subnet_name,
            node=meta["name"],
        )
        if created is None:
            return
        self.nncs.put(created)
        log.info("nnc_created", node=meta["name"], subnet=subnet_name)

    async def label_nnc(self, nnc: NodeNetworkConfig, subnet_name: str) -> None:
        name = nnc["metadata"]["name"]
        with self.nncs.writing(WatchedCollection.key_for(name, namespace=self.namespace)):
            updated = await self.attempt(
                partial(
                    self.kube.merge_patch,
                    NNC,
                    name,
                    nnc_label_patch(nnc, subnet_name),
                    namespace=self.namespace,
                ),
                event="nnc_label_refused",
                counter="nodenetworkconfig",
                retry="placing the node again from the NNC the watch delivers",
                subnet=subnet_name,
                node=name,
            )
            if updated is None:
                return
            self.nncs.put_written(updated, read=nnc)
        log.info("nnc_placed", node=name, subnet=subnet_name)

    async def publish_subnet_status(
        self, cs: ClusterSubnet, plan: Plan, node_count: int, scaler: Scaler
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
            drain_left=plan.drain_left,
        )
        if {k: (cs.get("status") or {}).get(k) for k in cs_status} != cs_status:
            patch: ClusterSubnet = {"status": cs_status}
            await self._patch_cluster_status(self.subnets, CLUSTER_SUBNET, read=cs, patch=patch)
        state: ClusterSubnetState | None = self.subnet_state(name)
        if not state:
            state = await self._status_attempt(
                partial(self.kube.create, CLUSTER_SUBNET_STATE, subnet_state_object(name)),
                CLUSTER_SUBNET_STATE,
                name,
                creating=True,
            )
            if state is None:
                return
            self.states.put(state)
        if subnet_state_exhausted(state) != status.exhausted:
            log.warning("subnet_exhaustion_changed", subnet=name, exhausted=status.exhausted)
            self.events.exhaustion_changed(name, exhausted=status.exhausted)
            await self._patch_cluster_status(
                self.states,
                CLUSTER_SUBNET_STATE,
                read=state,
                patch=subnet_state_patch(exhausted=status.exhausted, at=dt.datetime.now(dt.UTC)),
            )

    async def _status_attempt(
        self,
        write: Callable[[], Awaitable[ObjectT]],
        kind: Kind[ObjectT],
        name: str,
        *,
        creating: bool = False,
    ) -> ObjectT | None:
        """A write of a subnet's status (`attempt`): refused, the subnet is planned again."""
        return await self.attempt(
            write,
            event="status_write_refused",
            counter=kind.plural,
            retry="planning again",
            creating=creating,
            subnet=name,  # a ClusterSubnet and its ClusterSubnetState are named as the subnet
            kind=kind.plural,
            name=name,
        )

    async def _patch_cluster_status(
        self,
        collection: WatchedCollection[ObjectT],
        kind: Kind[ObjectT],
        *,
        read: ObjectT,
        patch: ObjectT,
    ) -> None:
        """Merge-patch the status of a cluster-scoped object, conditional on the resourceVersion
        it was read at; another round when someone else wrote it first."""
        name = read["metadata"]["name"]
        body = conditional(patch, read=read)
        with collection.writing(WatchedCollection.key_for(name)):
            updated = await self._status_attempt(
                partial(self.kube.merge_patch, kind, name, body, status=True), kind, name
            )
            if updated is None:
                return
            collection.put_written(updated, read=read)


def _ip_configs_of(nnc: NodeNetworkConfig) -> list[tuple[IPConfig, ...]]:
    """The IP configs of a slim NNC's containers (`slim_nnc`), parsed already."""
    containers = (nnc.get("status") or {}).get("networkContainers") or ()
    return [
        assignments
        for nc in containers
        if isinstance(nc, dict) and isinstance(assignments := nc.get("ipAssignments"), tuple)
    ]
