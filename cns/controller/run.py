"""`cns controller`: fulfils every node's NodeNetworkConfig from one ClusterSubnet.

The API server is the only source of truth, read through watches; only the leader (a Lease)
writes. A round plans from one snapshot of the caches (`plan_subnet`, in a worker thread so that
the event loop keeps renewing the lease however long planning takes) and writes in an order that
makes a stale writer's grant fail instead of land (docs/design/controller-safety.md):

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
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from cns import faults
from cns.controller.lease import LeaderElector, LostLeadership
from cns.controller.plan import NodeView, Plan, SubnetStatus, plan_subnet
from cns.core.allocation import Entry, apply_changes, block_index, block_network
from cns.core.subnet import Subnet
from cns.core.types import Scaler
from cns.kube.resources import (
    CLUSTER_SUBNET,
    CLUSTER_SUBNET_STATE,
    GROUP,
    IP_BLOCK,
    MERGE_PATCH,
    NAMESPACE,
    NNC,
    SUBNET_LABEL,
    block_entries,
    block_object,
    merge_scalers,
    nc_to_status,
    network_containers,
    pool_request,
    scaler_to_wire,
)
from cns.kube.watch import WatchedCollection, custom_objects

log = structlog.get_logger("cns.controller")

ROUND_RETRY_SECONDS = 1.0
WRITE_CONCURRENCY = 16


def subnet_from_spec(cs: dict[str, Any], default_scaler: Scaler) -> Subnet:
    """The ClusterSubnet's spec, with the request and release thresholds the nodes will use.

    Those are the thresholds of the scaler this controller publishes in `status.scaler`: the
    same merge of `spec.scaler` over its default scaler (a field set to 0, or a combination the
    scaler refuses, is ignored the same way as on the nodes). The phase-4 batch's grow bound is
    only as good as these thresholds (docs/design/phase4.md).
    """
    spec = cs.get("spec") or {}
    exhaustion = spec.get("exhaustion") or {}
    thresholds = merge_scalers(default_scaler, spec.get("scaler"))
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
    )


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
    round_seconds_total: float = 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a round plans from: the nodes, the allocation record and its blocks by index."""

    views: list[NodeView]
    record: dict[str, Entry]
    blocks: dict[int, dict[str, Any]]


def read_snapshot(
    subnet: Subnet, nncs: list[dict[str, Any]], blocks: list[dict[str, Any]]
) -> Snapshot:
    """The wire objects of one round as the planner's types. An IPBlock that is not one of this
    subnet's blocks, and an entry filed in a block that does not cover its address, are
    ignored: only the block of an address can claim it."""
    network = subnet.network
    views = []
    for nnc in sorted(nncs, key=lambda obj: str(obj["metadata"]["name"])):
        containers = [nc for nc in network_containers(nnc) if nc.subnet == str(network)]
        meta = nnc["metadata"]
        nc = containers[0] if containers else None
        views.append(NodeView(meta["name"], nc, pool_request(nnc), str(meta.get("uid") or "")))
    record: dict[str, Entry] = {}
    by_index: dict[int, dict[str, Any]] = {}
    for block in blocks:
        spec = block.get("spec") or {}
        cidr = str(spec.get("cidr", ""))
        try:
            index = block_index(network, cidr.split("/")[0])
        except ValueError:
            continue
        if spec.get("subnet") != subnet.name or str(block_network(network, index)) != cidr:
            continue
        by_index[index] = block
        for address, entry in block_entries(block).items():
            with contextlib.suppress(ValueError):
                if block_index(network, address) == index:
                    record[address] = entry
    return Snapshot(views, record, by_index)


async def _bounded(calls: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run the calls concurrently, at most WRITE_CONCURRENCY at a time; the first error wins."""
    limit = asyncio.Semaphore(WRITE_CONCURRENCY)

    async def one(call: Callable[[], Awaitable[None]]) -> None:
        async with limit:
            await call()

    try:
        async with asyncio.TaskGroup() as group:
            for call in calls:
                group.create_task(one(call))
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None


class Controller:
    """One subnet's control plane."""

    def __init__(
        self,
        api: client.ApiClient,
        subnet_name: str,
        namespace: str = NAMESPACE,
        identity: str = "",
        default_scaler: Scaler | None = None,
        seed: int | None = None,
        lease_seconds: int = 15,
    ) -> None:
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.subnet_name = subnet_name
        self.namespace = namespace
        self.identity = identity or f"cns-controller-{uuid.uuid4().hex[:8]}"
        self.default_scaler = default_scaler or Scaler()
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.elector = LeaderElector(
            api,
            f"cns-controller-{subnet_name}",
            namespace,
            self.identity,
            lease_seconds=lease_seconds,
            renew_deadline_seconds=lease_seconds * 2 / 3,
            retry_seconds=max(0.2, lease_seconds / 7.5),
        )
        self._dirty = asyncio.Event()
        self._reported: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        custom = self.custom
        self.nodes = WatchedCollection("nodes", self.core.list_node, self.kick)
        self.nncs = custom_objects(custom, NNC, self.kick, namespace=namespace)
        self.subnets = custom_objects(custom, CLUSTER_SUBNET, self.kick, name=subnet_name)
        self.states = custom_objects(custom, CLUSTER_SUBNET_STATE, self.kick, name=subnet_name)
        self.blocks = custom_objects(
            custom, IP_BLOCK, self.kick, labels=f"{SUBNET_LABEL}={subnet_name}"
        )
        self._collections = (self.nodes, self.nncs, self.subnets, self.states, self.blocks)

    def kick(self) -> None:
        self._dirty.set()

    async def run(self) -> None:
        """Campaign, lead until the lease is lost, step down, campaign again; forever.

        Nothing is carried over between terms: every term starts by listing the API server.
        """
        while True:
            await self.elector.acquire()
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self.elector.hold(), name="lease")
                    for collection in self._collections:
                        collection.synced.clear()
                        group.create_task(collection.run(), name=f"watch-{collection.name}")
                    group.create_task(self._reconcile_forever(), name="reconcile")
            except* LostLeadership as lost:
                log.warning("leadership_lost", reason=str(lost.exceptions[0]))

    async def _reconcile_forever(self) -> None:
        for collection in self._collections:
            await collection.synced.wait()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            started = time.perf_counter()
            try:
                await self.reconcile()
            except LostLeadership:
                self.counters.fenced += 1
                raise
            except ApiException as exc:
                log.warning("round_failed", status=exc.status, reason=exc.reason, body=exc.body)
                await asyncio.sleep(ROUND_RETRY_SECONDS)
                self.kick()
            except Exception as exc:
                log.error("round_failed", error=repr(exc))
                await asyncio.sleep(ROUND_RETRY_SECONDS)
                self.kick()
            self.counters.rounds += 1
            self.counters.round_seconds = time.perf_counter() - started
            self.counters.round_seconds_total += self.counters.round_seconds

    def _one(self, collection: WatchedCollection) -> dict[str, Any]:
        return next(iter(collection.objects.values()), {})

    async def reconcile(self) -> None:
        """One round: NNCs for new nodes, then plan from one snapshot and write it in order."""
        cs = self._one(self.subnets)
        if not cs:
            log.info("waiting_for_clustersubnet", subnet=self.subnet_name)
            return
        subnet = subnet_from_spec(cs, self.default_scaler)
        await self._ensure_nncs()
        # The snapshot: the watch replaces objects rather than changing them, so these dicts
        # stay as read (with their resourceVersions) while the round runs. Reading them, like
        # planning, runs in a worker thread: the event loop goes on renewing the lease.
        nncs = {obj["metadata"]["name"]: obj for obj in self.nncs.objects.values()}
        snapshot = await asyncio.to_thread(
            read_snapshot, subnet, list(nncs.values()), list(self.blocks.objects.values())
        )
        record, blocks, views = snapshot.record, snapshot.blocks, snapshot.views
        uids = {view.name: view.uid for view in views}
        current = await self._current_uids(
            {e.node for e in record.values() if e.uid != uids.get(e.node)}
        )
        cs_status = cs.get("status") or {}
        state = self._one(self.states)
        previous = SubnetStatus(
            exhausted=bool((state.get("status") or {}).get("exhausted", False)),
            reserved=int(cs_status.get("reservedIPCount") or 0),
            batch=int((cs_status.get("scaler") or {}).get("batchSize") or 0),
            batch_changes=int(cs_status.get("batchChanges") or 0),
        )
        plan = await asyncio.to_thread(
            plan_subnet, subnet, views, record, previous, self.rng, _new_id, current
        )
        await faults.pause("controller.after_plan")
        self._report_audit(plan)
        failed = await self._write_blocks(subnet, plan, blocks)
        network = subnet.network

        def confirmed(address: str) -> bool:
            return block_index(network, address) not in failed

        computed = {"batchSize": plan.status.batch}
        scaler = merge_scalers(self.default_scaler, (cs.get("spec") or {}).get("scaler"), computed)
        wire_scaler = scaler_to_wire(scaler)
        await self._write_nncs(subnet, plan, nncs, confirmed, wire_scaler)
        if plan.node_changes or failed:
            log.info(
                "subnet_round",
                subnet=subnet.name,
                changed=len(plan.node_changes),
                granted=sum(plan.granted.values()),
                released=sum(plan.released.values()),
                short_of=plan.short_of,
                reserved=plan.status.reserved,
                capacity=plan.capacity,
                batch=plan.status.batch,
                exhausted=plan.status.exhausted,
                blocks_refused=len(failed),
            )
        await self._publish_subnet_status(cs, plan, len(views), wire_scaler)

    async def _current_uids(self, nodes: set[str]) -> dict[str, str | None]:
        """For nodes holding addresses granted to another NNC object than the cache shows (or
        none): the uid their NNC has now, None if deleted. A direct read, since a cache may lag:
        only an object that is really gone lets its addresses go."""
        current: dict[str, str | None] = {}
        for node in sorted(nodes):
            nnc = await self._read_nnc(node)
            current[node] = None if nnc is None else str(nnc["metadata"].get("uid") or "")
        return current

    async def _read_nnc(self, name: str) -> dict[str, Any] | None:
        """The NNC as the API server has it now (not the cache); None if it does not exist."""
        try:
            nnc: dict[str, Any] = await self.custom.get_namespaced_custom_object(
                GROUP, NNC.version, self.namespace, NNC.plural, name
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None
        return nnc

    def _report_audit(self, plan: Plan) -> None:
        """Log each duplicate or conflict once when it appears, and count it."""
        duplicates, conflicts = frozenset(plan.duplicates), frozenset(plan.conflicts)
        reported_duplicates, reported_conflicts = self._reported
        for address in sorted(duplicates - reported_duplicates):
            log.error(
                "duplicate_address",
                address=address,
                nodes=list(plan.duplicates[address]),
                action="asking every node that lists it to release it if no pod uses it",
            )
        for address in sorted(conflicts - reported_conflicts):
            listed_by, recorded_for = plan.conflicts[address]
            log.error(
                "address_conflict",
                address=address,
                listed_by=listed_by,
                recorded_for=recorded_for or None,
                action="asking the node that lists it to release it if no pod uses it",
            )
        for address in sorted((reported_duplicates | reported_conflicts) - duplicates - conflicts):
            log.info("address_conflict_resolved", address=address)
        self.counters.duplicates_found += len(duplicates - reported_duplicates)
        self.counters.duplicates = len(duplicates)
        self.counters.conflicts = len(conflicts)
        self._reported = (duplicates, conflicts)

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
            body = block_object(subnet.name, index, str(block_network(network, index)), entries)
            name = body["metadata"]["name"]
            self.elector.fence()
            try:
                if current is None:
                    written = await self.custom.create_cluster_custom_object(
                        GROUP, IP_BLOCK.version, IP_BLOCK.plural, body
                    )
                else:
                    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                    written = await self.custom.replace_cluster_custom_object(
                        GROUP, IP_BLOCK.version, IP_BLOCK.plural, name, body
                    )
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                failed.add(index)
                self.counters.write_conflicts["ipblock"] += 1
                log.info("ipblock_write_refused", block=name, status=exc.status)
                await self._refresh_block(name)
                return
            self._cache_written(self.blocks, current, written)

        await _bounded(partial(write, index, changes) for index, changes in sorted(touched.items()))
        if failed:
            self.kick()
        return failed

    async def _refresh_block(self, name: str) -> None:
        try:
            fresh = await self.custom.get_cluster_custom_object(
                GROUP, IP_BLOCK.version, IP_BLOCK.plural, name
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.blocks.objects.pop(f"/{name}", None)
            return
        self.blocks.objects[WatchedCollection.key(fresh)] = fresh

    @staticmethod
    def _cache_written(
        collection: WatchedCollection, read: dict[str, Any] | None, written: Any
    ) -> None:
        """Put our own write into the cache, unless the watch already has a newer object."""
        if not isinstance(written, dict):
            return
        key = WatchedCollection.key(written)
        if collection.objects.get(key) is read:
            collection.objects[key] = written

    async def _write_nncs(
        self,
        subnet: Subnet,
        plan: Plan,
        nncs: dict[str, dict[str, Any]],
        confirmed: Callable[[str], bool],
        wire_scaler: dict[str, int],
    ) -> None:
        writes: list[Callable[[], Awaitable[None]]] = []
        for name, nnc in sorted(nncs.items()):
            change = plan.node_changes.get(name)
            nc = change.container(confirmed) if change is not None else None
            status = nnc.get("status") or {}
            asked = list(plan.release_requests.get(name, ()))
            if (
                nc is None
                and status.get("scaler") == wire_scaler
                and list(status.get("ipsToRelease") or ()) == asked
            ):
                continue
            patch: dict[str, Any] = {
                "metadata": {"resourceVersion": nnc["metadata"]["resourceVersion"]},
                "status": {"scaler": wire_scaler, "status": "Updated", "ipsToRelease": asked},
            }
            if nc is not None:
                patch["status"]["networkContainers"] = [nc_to_status(nc, subnet.name)]
                patch["status"]["assignedIPCount"] = len(nc.ip_configs)
                if plan.short_of:
                    patch["status"]["status"] = "SubnetFull"
            writes.append(partial(self._patch_nnc_status, name, patch, nnc))
        await _bounded(writes)

    async def _patch_nnc_status(
        self, name: str, patch: dict[str, Any], read: dict[str, Any]
    ) -> None:
        await faults.pause("controller.before_nnc_write")
        self.elector.fence()
        try:
            updated = await self.custom.patch_namespaced_custom_object_status(
                GROUP,
                NNC.version,
                self.namespace,
                NNC.plural,
                name,
                patch,
                _content_type=MERGE_PATCH,  # type: ignore[call-arg]
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            # The node changed its spec meanwhile, or another writer was first: read it again
            # and plan again.
            self.counters.write_conflicts["nodenetworkconfig"] += 1
            log.info("nnc_write_refused", node=name, status=exc.status)
            fresh = await self._read_nnc(name)
            if fresh is not None:
                self.nncs.objects[WatchedCollection.key(fresh)] = fresh
            self.kick()
            return
        self._cache_written(self.nncs, read, updated)

    async def _ensure_nncs(self) -> None:
        have = {obj["metadata"]["name"] for obj in self.nncs.objects.values()}
        for node in list(self.nodes.objects.values()):
            meta = node["metadata"]
            if meta["name"] in have:
                continue
            body = {
                "apiVersion": NNC.api_version,
                "kind": "NodeNetworkConfig",
                "metadata": {
                    "name": meta["name"],
                    "namespace": self.namespace,
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Node",
                            "name": meta["name"],
                            "uid": meta["uid"],
                        }
                    ],
                },
                "spec": {"requestedIPCount": 0},
            }
            self.elector.fence()
            try:
                created = await self.custom.create_namespaced_custom_object(
                    GROUP, NNC.version, self.namespace, NNC.plural, body
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                continue
            self.nncs.objects[WatchedCollection.key(created)] = created
            log.info("nnc_created", node=meta["name"])

    async def _publish_subnet_status(
        self, cs: dict[str, Any], plan: Plan, node_count: int, wire_scaler: dict[str, int]
    ) -> None:
        status = plan.status
        capacity = plan.capacity
        utilization = round(100 * status.reserved / capacity, 2) if capacity else 100.0
        cs_status = {
            "scaler": {**wire_scaler, "batchSize": status.batch},
            "reservedIPCount": status.reserved,
            "capacity": capacity,
            "nodeCount": node_count,
            "utilizationPercent": utilization,
            "exhausted": status.exhausted,
            "batchChanges": status.batch_changes,
            "duplicateIPCount": len(plan.duplicates),
            "conflictIPCount": len(plan.conflicts),
        }
        if {k: (cs.get("status") or {}).get(k) for k in cs_status} != cs_status:
            updated = await self._patch_cluster_status(CLUSTER_SUBNET, cs, {"status": cs_status})
            if updated is not None:
                self._cache_written(self.subnets, cs, updated)
        state = self._one(self.states)
        if not state:
            self.elector.fence()
            try:
                state = await self.custom.create_cluster_custom_object(
                    GROUP,
                    CLUSTER_SUBNET_STATE.version,
                    CLUSTER_SUBNET_STATE.plural,
                    {
                        "apiVersion": CLUSTER_SUBNET_STATE.api_version,
                        "kind": "ClusterSubnetState",
                        "metadata": {"name": self.subnet_name},
                    },
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.kick()
                return
            self.states.objects[WatchedCollection.key(state)] = state
        if (state.get("status") or {}).get("exhausted") != status.exhausted:
            log.warning(
                "subnet_exhaustion_changed", subnet=self.subnet_name, exhausted=status.exhausted
            )
            stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            updated = await self._patch_cluster_status(
                CLUSTER_SUBNET_STATE,
                state,
                {"status": {"exhausted": status.exhausted, "timestamp": stamp}},
            )
            if updated is not None:
                self._cache_written(self.states, state, updated)

    async def _patch_cluster_status(
        self, kind: Any, read: dict[str, Any], patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch the status of a cluster-scoped object, conditional on the resourceVersion
        it was read at; None (and another round) when someone else wrote it first."""
        name = read["metadata"]["name"]
        body = {"metadata": {"resourceVersion": read["metadata"]["resourceVersion"]}, **patch}
        self.elector.fence()
        try:
            updated: dict[str, Any] = await self.custom.patch_cluster_custom_object_status(
                GROUP, kind.version, kind.plural, name, body,
                _content_type=MERGE_PATCH,  # type: ignore[call-arg]
            )  # fmt: skip
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            self.counters.write_conflicts[kind.plural] += 1
            log.info("status_write_refused", kind=kind.plural, name=name, status=exc.status)
            self.kick()
            return None
        return updated


def _new_id() -> str:
    return str(uuid.uuid4())
