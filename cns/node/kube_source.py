"""The daemon's control plane in a cluster: its NodeNetworkConfig, subnet state and pods.

Implements the same `NCSource` protocol as the standalone allocator. It reads (lists, then
watches) the node's NNC, the ClusterSubnetState and ClusterSubnet of its subnet, and the pods
scheduled on the node (`cns.node.kube_pods`). The subnet is the one the NNC names
(`nnc_subnet`: the controller placed the node there); the configured `subnetName` counts only
until the NNC names one, and the watches move when it does. It writes only its NNC's request
(`spec.requestedIPCount`, `spec.ipsNotInUse`, `spec.requestedIPs`, and `spec.subnets` for
further subnets), with a JSON merge patch, and only when it changes; an NNC deleted under the
node's pods it creates again, asking for the addresses they hold (`_recreate`). The status,
checked by `read_containers`, lists one network container per subnet (`subnetName`): the
primary subnet's feeds the top level of the state, each other one a lane.
While the API server is down the last state stays in force, so ADD and DEL keep working from
the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.core.events import ObjectRef
from cns.core.overflow import OverflowCandidate
from cns.core.types import IgnoredContainer, NetworkContainer, PoolRequest, Scaler
from cns.kube import NAMESPACE
from cns.kube.client import KubeClient
from cns.kube.cluster_subnet import (
    subnet_draining,
    subnet_family,
    subnet_overflow,
    subnet_scalers,
    subnet_state_exhausted,
)
from cns.kube.nnc import (
    nnc_recreation,
    nnc_subnet,
    pool_request,
    release_requests,
    request_patch,
    subnet_names,
    subnet_requests,
)
from cns.kube.nnc_containers import USABLE_VALUES, read_containers
from cns.kube.objects import CLUSTER_SUBNET, CLUSTER_SUBNET_STATE, NNC
from cns.kube.scalers import merge_scalers
from cns.kube.snapshot import SnapshotInvalid, SubnetObjects, read_snapshot
from cns.kube.watch import WatchedCollection
from cns.kube.wire import (
    ClusterSubnet,
    ClusterSubnetState,
    NodeNetworkConfig,
    ObjectMeta,
    ObjectT,
)
from cns.node.control_plane import (
    NO_SUBNETS,
    FurtherSubnetState,
    SourceState,
    StateListener,
)
from cns.node.kube_pods import NodePods, PodDemand
from cns.state.fsutil import atomic_write, describe_os_error

log = structlog.get_logger("cns.node.kube_source")

PATCH_ATTEMPTS = 5
PATCH_BACKOFF_SECONDS = (0.1, 0.2, 0.5, 1.0, 2.0)
# New entries an NNC gets left out that are logged one by one; the rest in one line.
_SAID_AT_MOST = 50
_Checked = tuple[tuple[NetworkContainer, ...], tuple[IgnoredContainer, ...]]


@dataclasses.dataclass(slots=True)
class _SubnetWatches:
    """The ClusterSubnet and ClusterSubnetState of one further subnet, and their watch tasks."""

    subnet: WatchedCollection[ClusterSubnet]
    state: WatchedCollection[ClusterSubnetState]
    tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)


class KubeSource:
    """NCSource backed by the Kubernetes API."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        node_name: str,
        subnet_name: str,
        fallback_scaler: Scaler,
        namespace: str = NAMESPACE,
        watch_timeout_seconds: int = 300,
        snapshot_path: Path | None = None,
    ) -> None:
        self.kube = kube
        self.node_name = node_name
        self.namespace = namespace
        self.fallback_scaler = fallback_scaler
        self._listener: StateListener | None = None
        self.snapshot_path = snapshot_path
        self._snapshot_written = ""
        self._delivered_addresses: dict[str, str] | None = None
        self._ignored: frozenset[IgnoredContainer] = frozenset()  # as last reported
        # The NNC last read and its checked containers (`read_containers`), read once per NNC.
        self._checked: tuple[NodeNetworkConfig, _Checked] = ({}, ((), ()))
        # The NNC's metadata as last seen: its labels and owner go into one the node re-creates.
        self._nnc_meta: ObjectMeta = {}
        self._nnc_deleted = False  # said so
        self.watch_timeout_seconds = timeout = watch_timeout_seconds
        self._group: asyncio.TaskGroup | None = None  # while `run` runs
        self._subnet_watches: list[asyncio.Task[None]] = []
        self.nnc = kube.watch(
            NNC, self._nnc_changed, namespace=namespace, name=node_name, timeout_seconds=timeout
        )
        self.pods_on_node = NodePods(
            kube, node_name=node_name, on_change=self._pods_changed, timeout_seconds=timeout
        )
        self.pods = self.pods_on_node.pods
        self.namespaces = self.pods_on_node.namespaces
        # What the daemon reads of the pods besides the state (`cns.node.kube_pods`).
        self.choose_subnets = self.pods_on_node.choose_subnets
        self.node_pods = self.pods_on_node.node_pods
        self.live_pod_addresses = self.pods_on_node.live_pod_addresses
        self._delivered_demand_by_subnet: PodDemand | None = None
        self._overflow_problem: str | None = None  # as said last (`_overflow_names`)
        self._further_watches: dict[str, _SubnetWatches] = {}
        self._follow(subnet_name)

    @property
    def nnc_ref(self) -> ObjectRef:
        """The node's NodeNetworkConfig, as the Events about it name it."""
        return ObjectRef("NodeNetworkConfig", self.node_name, self.namespace, NNC.api_version)

    def uid_of(self, ref: ObjectRef) -> str:
        """The UID of the node's NNC or of a pod on the node, as last watched ("" unknown):
        `kubectl describe` finds an object's Events by it."""
        if ref.kind == "Pod":
            return self.pods_on_node.pod_uid(ref.namespace, ref.name)
        if ref == self.nnc_ref:
            return str(self._nnc_meta.get("uid") or "")
        return ""

    def _follow(self, subnet_name: str) -> None:
        """Watch the ClusterSubnet and ClusterSubnetState named `subnet_name` (none: "")."""
        for task in self._subnet_watches:
            task.cancel()
        self.subnet_name = subnet_name
        timeout = self.watch_timeout_seconds
        self.subnet_state = self.kube.watch(
            CLUSTER_SUBNET_STATE, self._changed, name=subnet_name, timeout_seconds=timeout
        )
        self.subnet = self.kube.watch(
            CLUSTER_SUBNET, self._changed, name=subnet_name, timeout_seconds=timeout
        )
        # The namespaces are not waited for: a daemon whose RBAC lacks them (a manifest not
        # updated) still serves; until they come, a pod counts for the primary subnet unless
        # its own annotation says otherwise, and an ADD reads its namespace itself.
        self._collections = (self.nnc, self.subnet_state, self.subnet, self.pods)
        if not subnet_name:  # nothing to watch (a name-less watch would list every subnet)
            self.subnet_state.synced.set()
            self.subnet.synced.set()
            self._subnet_watches = []
        elif self._group is not None:
            self._subnet_watches = [self._start(self.subnet_state), self._start(self.subnet)]

    def _start(self, collection: WatchedCollection[ObjectT]) -> asyncio.Task[None]:
        assert self._group is not None
        return self._group.create_task(collection.run(), name=f"watch-{collection.name}")

    def _nnc_changed(self) -> None:
        """Follow the subnet the NNC names, then as any change. A deletion is said once."""
        nnc = self.nnc.first()
        if nnc:
            self._nnc_meta = nnc.get("metadata") or {}
            self._nnc_deleted = False
        elif self._nnc_meta and not self._nnc_deleted:
            self._nnc_deleted = True
            log.warning(
                "nnc_deleted",
                nnc=f"{self.namespace}/{self.node_name}",
                meaning="every network container is withdrawn: no ADD gets an address until "
                "the NNC lists it again; pods keep theirs; the node re-creates its NNC asking "
                "for the addresses its pods hold",
            )
        named = nnc_subnet(nnc)
        if named and named != self.subnet_name:
            log.info("subnet_followed", subnet=named, previous=self.subnet_name or None)
            self._follow(named)
        self._changed()

    def snapshot(
        self,
        from_snapshot: bool = False,
        *,
        demand: PodDemand | None = None,
        pod_addresses: dict[str, str] | None = None,
    ) -> SourceState:
        """Everything the objects say now. `demand` and `pod_addresses`: what `_demand` and
        `NodePods.pod_addresses` give now, when the caller has them already (each walks every
        pod)."""
        nnc = self.nnc.first()
        subnet = self.subnet.first()
        state = self.subnet_state.first()
        scaler = merge_scalers(
            self.fallback_scaler, *subnet_scalers(subnet), (nnc.get("status") or {}).get("scaler")
        )
        containers, ignored = self._containers(nnc)
        self._report_ignored(ignored)
        primary = nnc_subnet(nnc) if nnc else ""
        demand = self._demand() if demand is None else demand
        return SourceState(
            containers=tuple(nc for nc in containers if nc.subnet_name in ("", primary)),
            ignored=ignored,
            exhausted=bool(subnet_state_exhausted(state)),
            draining=subnet_draining(subnet),
            scaler=scaler,
            request=pool_request(nnc) if nnc else None,
            pod_demand=demand.by_subnet.get("", 0),
            primary_pods=demand.primary_pods,
            overflow=self._overflow_candidates(subnet),
            release_requests=release_requests(nnc) if nnc else (),
            pod_addresses=self.pods_on_node.pod_addresses()
            if pod_addresses is None
            else pod_addresses,
            from_snapshot=from_snapshot,
            gone=not nnc,
            subnets=_further(
                containers,
                primary,
                subnet_requests(nnc) if nnc else {},
                demand=demand.by_subnet,
                subnet_objects={
                    name: (w.subnet.first(), w.state.first())
                    for name, w in self._further_watches.items()
                },
                fallback_scaler=self.fallback_scaler,
            ),
        )

    def _containers(self, nnc: NodeNetworkConfig) -> _Checked:
        """`read_containers` of `nnc`, read once per NNC object (a delivery reads it twice)."""
        if nnc is not self._checked[0]:
            self._checked = (nnc, read_containers(nnc) if nnc else ((), ()))
        return self._checked[1]

    def _report_ignored(self, ignored: tuple[IgnoredContainer, ...]) -> None:
        """One log line for each container or IP assignment the NNC gets left out, when it is
        first left out, and one when it no longer is (not on every watch event). Beyond
        `_SAID_AT_MOST` new ones in one NNC, the rest are counted in one line."""
        now = frozenset(ignored)
        if now == self._ignored:
            return
        new = sorted(now - self._ignored, key=str)
        for entry in new[:_SAID_AT_MOST]:
            why = (
                {"usable": [v for v in USABLE_VALUES[entry.field] if v]}
                if entry.field in USABLE_VALUES
                else {"reason": entry.reason}
            )
            log.error(_event(entry, "ignored"), **_named(entry), value=entry.value, **why)
        if len(new) > _SAID_AT_MOST:
            log.error("nnc_entries_ignored", more=len(new) - _SAID_AT_MOST, said=_SAID_AT_MOST)
        for entry in sorted(self._ignored - now, key=str)[:_SAID_AT_MOST]:
            log.info(_event(entry, "no_longer_ignored"), **_named(entry))
        self._ignored = now

    def _demand(self) -> PodDemand:
        """The pods' demand by subnet ("": the primary one), as `NodePods.demand` counts it."""
        return self.pods_on_node.demand(self.subnet_name)

    def _synced(self) -> bool:
        return self._listener is not None and all(c.synced.is_set() for c in self._collections)

    def _changed(self) -> None:
        """An NNC or subnet object changed: keep the snapshot current, then tell the node."""
        if self._synced():
            self._save_snapshot()
            self._deliver()

    def _pods_changed(self) -> None:
        """A pod event matters only when it changes the demand: a burst of pods brings several
        status updates per pod, and the node need not re-read the NNC for each. Pods are not in
        the snapshot file; the first synced state is saved whichever watch syncs last."""
        if not self._synced():
            return
        if not self._snapshot_written:
            self._save_snapshot()
        demand, addresses = (
            self._demand(),
            self.pods_on_node.pod_addresses(),
        )
        if (demand, addresses) != (self._delivered_demand_by_subnet, self._delivered_addresses):
            self._deliver(demand, addresses)

    def _deliver(
        self, demand: PodDemand | None = None, addresses: dict[str, str] | None = None
    ) -> None:
        """Hand the node the state now (`demand`, `addresses`: the pods' figures, if the
        caller has just read them)."""
        assert self._listener is not None
        demand = self._demand() if demand is None else demand
        addresses = self.pods_on_node.pod_addresses() if addresses is None else addresses
        self._follow_further(self._further_names(demand))
        self._delivered_demand_by_subnet = demand
        self._delivered_addresses = addresses
        self._listener(self.snapshot(demand=demand, pod_addresses=addresses))

    def _further_names(self, demand: PodDemand) -> set[str]:
        """The further subnets the node holds a container of, asks for, has pods choosing
        (`demand`, as `_demand` counts it), or may send the primary's pods to (overflow)."""
        nnc = self.nnc.first()
        held = {nc.subnet_name for nc in self._containers(nnc)[0]}
        asked = set(subnet_names(nnc)) if nnc else set()
        overflow = set(self._overflow_names(self.subnet.first()))
        return (held | asked | set(demand.by_subnet) | overflow) - {"", self.subnet_name}

    def _overflow_names(self, subnet: ClusterSubnet) -> tuple[str, ...]:
        """The primary ClusterSubnet's overflow subnets; a malformed list is said once (and
        when it is mended) and followed not at all."""
        names, problem = subnet_overflow(subnet) if subnet else ((), None)
        if problem != self._overflow_problem:
            if problem is not None:
                log.error(
                    "overflow_ignored",
                    subnet=self.subnet_name,
                    field="spec.overflow",
                    reason=problem,
                    meaning="no pod of this node is sent to another subnet until it is fixed",
                )
            else:
                log.info("overflow_no_longer_ignored", subnet=self.subnet_name)
            self._overflow_problem = problem
        return names

    def _overflow_candidates(self, subnet: ClusterSubnet) -> tuple[OverflowCandidate, ...]:
        """Each overflow subnet as its own objects say: exhausted, draining, and whether its
        ClusterSubnet exists with the primary's IP family (until it is read, it has no room)."""
        family = subnet_family(subnet)
        candidates = []
        for name in self._overflow_names(subnet):
            watches = self._further_watches.get(name)
            other = watches.subnet.first() if watches else ClusterSubnet()
            state = watches.state.first() if watches else ClusterSubnetState()
            candidates.append(
                OverflowCandidate(
                    name,
                    exhausted=bool(subnet_state_exhausted(state)),
                    draining=subnet_draining(other),
                    usable=family is not None and subnet_family(other) == family,
                )
            )
        return tuple(candidates)

    def _follow_further(self, names: set[str]) -> None:
        """Watch the ClusterSubnet and ClusterSubnetState of each further subnet in `names`,
        and stop watching those of a subnet no longer among them."""
        for name in set(self._further_watches) - names:
            for task in self._further_watches.pop(name).tasks:
                task.cancel()
        timeout = self.watch_timeout_seconds
        for name in sorted(names - set(self._further_watches)):
            watches = self._further_watches[name] = _SubnetWatches(
                self.kube.watch(CLUSTER_SUBNET, self._changed, name=name, timeout_seconds=timeout),
                self.kube.watch(
                    CLUSTER_SUBNET_STATE, self._changed, name=name, timeout_seconds=timeout
                ),
            )
            if self._group is not None:
                watches.tasks = [self._start(watches.subnet), self._start(watches.state)]

    def _save_snapshot(self, nnc: NodeNetworkConfig | None = None) -> str | None:
        """Keep the last NNC and subnet objects on disk, so a restart during an API outage can
        serve from them. Written before every publish (write-ahead): the file always lists
        every release in flight, which the pool then never hands out.

        Returns why it could not be written (logged; the daemon keeps running and the next
        change or publish tries again), else None."""
        if self.snapshot_path is None:
            return None
        data = json.dumps(
            {
                "nodenetworkconfig": nnc if nnc is not None else self.nnc.first(),
                "clustersubnet": self.subnet.first(),
                "clustersubnetstate": self.subnet_state.first(),
                # Added later: a file without it is read as no further subnet's objects.
                "subnets": {
                    name: {
                        "clustersubnet": w.subnet.first(),
                        "clustersubnetstate": w.state.first(),
                    }
                    for name, w in self._further_watches.items()
                },
            },
            sort_keys=True,
        )
        if data != self._snapshot_written:
            try:
                atomic_write(self.snapshot_path, data.encode())
            except OSError as exc:
                error = describe_os_error(exc)
                log.error("kube_snapshot_write_failed", file=str(self.snapshot_path), error=error)
                return error
            self._snapshot_written = data
        return None

    def _load_snapshot(self) -> bool:
        """Put the snapshot file's objects in the caches (False: there is none, or it cannot be
        used: logged, naming the file and why; the watches then bring the state)."""
        if self.snapshot_path is None:
            return False
        try:
            snapshot = read_snapshot(
                self.snapshot_path,
                node_name=self.node_name,
                namespace=self.namespace,
                fallback_scaler=self.fallback_scaler,
            )
        except SnapshotInvalid as exc:
            log.warning(
                "kube_snapshot_ignored",
                file=str(self.snapshot_path),
                reason=str(exc),
                then="serving once the API server answers",
            )
            return False
        if snapshot is None:
            return False
        self.nnc.put(snapshot.nnc)
        self._nnc_meta = snapshot.nnc.get("metadata") or {}
        if nnc_subnet(snapshot.nnc) and nnc_subnet(snapshot.nnc) != self.subnet_name:
            self._follow(nnc_subnet(snapshot.nnc))
        self._put_subnet_objects(self.subnet_name, snapshot.primary, self.subnet, self.subnet_state)
        self._follow_further(set(snapshot.further) - {"", self.subnet_name})
        for name, watches in self._further_watches.items():
            if name in snapshot.further:
                objects = snapshot.further[name]
                self._put_subnet_objects(name, objects, watches.subnet, watches.state)
        return True

    @staticmethod
    def _put_subnet_objects(
        name: str,
        objects: SubnetObjects,
        subnet: WatchedCollection[ClusterSubnet],
        state: WatchedCollection[ClusterSubnetState],
    ) -> None:
        """The saved objects of subnet `name` (those of another subnet are not its own)."""
        if objects.subnet and objects.subnet["metadata"]["name"] == name:
            subnet.put(objects.subnet)
        if objects.state and objects.state["metadata"]["name"] == name:
            state.put(objects.state)

    async def run(self, on_state: StateListener) -> None:
        self._listener = on_state
        if self._load_snapshot():
            # Until the watches sync, serve from the last state seen (API server may be down).
            log.info("kube_snapshot_loaded", file=str(self.snapshot_path))
            on_state(self.snapshot(from_snapshot=True))
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._start(self.nnc)
            self._start(self.pods)
            self._start(self.namespaces)
            if self.subnet_name:
                self._subnet_watches = [self._start(self.subnet_state), self._start(self.subnet)]
            for watches in self._further_watches.values():
                watches.tasks = [self._start(watches.subnet), self._start(watches.state)]

    async def publish(
        self, request: PoolRequest, subnets: Mapping[str, PoolRequest] = NO_SUBNETS
    ) -> None:
        """Merge-patch the NNC spec, only when it differs from what the NNC already says: the
        primary subnet's request and, once the node asks for a further subnet, `spec.subnets`
        (one entry per further subnet, replaced whole)."""
        nnc = self.nnc.first()
        if not nnc and self.nnc.synced.is_set():
            await self._recreate(request, subnets)
            return
        asked = subnet_requests(nnc) if nnc else {}
        if nnc and pool_request(nnc) == request and asked == subnets:
            return
        patch = request_patch(request, dict(subnets) if subnets or asked else None)
        if nnc and (error := self._save_snapshot({**nnc, **patch})):
            raise RuntimeError(
                f"not published: the snapshot {self.snapshot_path} must be written first ({error})"
            )
        await self._patch_spec(patch, request, subnets)

    async def _patch_spec(
        self,
        patch: NodeNetworkConfig,
        request: PoolRequest,
        subnets: Mapping[str, PoolRequest],
        *,
        recreate: bool = True,
    ) -> None:
        """Send the spec's merge patch; an NNC that is gone (404) is re-created (`recreate`)."""
        for attempt in range(PATCH_ATTEMPTS):
            try:
                updated = await self.kube.merge_patch(
                    NNC,
                    self.node_name,
                    patch,
                    namespace=self.namespace,
                    request_timeout=30,
                )
            except ApiException as exc:
                if exc.status == 409 and attempt + 1 < PATCH_ATTEMPTS:
                    await asyncio.sleep(PATCH_BACKOFF_SECONDS[attempt])
                    continue
                if exc.status == 404 and recreate:
                    await self._recreate(request, subnets)
                    return
                if exc.status == 404:
                    raise RuntimeError(
                        f"NodeNetworkConfig {self.namespace}/{self.node_name} does not exist"
                    ) from exc
                raise
            cached = self.nnc.first()  # read again: the watch may have moved on meanwhile
            if cached:
                # Only the spec: we are its one writer, so the reply's spec is the newest. Its
                # status may be older than what the watch delivered while we waited (the
                # controller can answer the new request before this reply is read).
                self.nnc.put({**cached, "spec": updated["spec"]})
            return

    async def _recreate(self, request: PoolRequest, subnets: Mapping[str, PoolRequest]) -> None:
        """The node's NNC is gone (deleted) while the node serves from it: create it again,
        with the labels and owner it had, its spec asking for what the node wants now, the
        addresses its pods hold among `requestedIPs` (`Pool.plan`). An NNC created meanwhile
        (the controller's: 409) gets the spec as a patch instead."""
        body = nnc_recreation(
            self._nnc_meta,
            node_name=self.node_name,
            namespace=self.namespace,
            subnet_name=self.subnet_name,
            spec=request_patch(request, dict(subnets) if subnets else None)["spec"],
        )
        try:
            created = await self.kube.create(NNC, body, namespace=self.namespace)
        except ApiException as exc:
            if exc.status != 409:
                raise
            log.info("nnc_recreate_found_one", nnc=f"{self.namespace}/{self.node_name}")
            patch = request_patch(request, dict(subnets) if subnets else None)
            await self._patch_spec(patch, request, subnets, recreate=False)
            return
        log.warning(
            "nnc_recreated",
            nnc=f"{self.namespace}/{self.node_name}",
            requested_ip_count=request.requested_ip_count,
            requested_ips=list(request.requested_ips),
            subnets={name: list(r.requested_ips) for name, r in subnets.items()} or None,
        )
        if not self.nnc.first():
            self.nnc.put(created)


def _event(entry: IgnoredContainer, what: str) -> str:
    """The log event of an entry left out: of a container, or of one IP assignment."""
    return f"{'network_container' if entry.whole_container else 'ip_assignment'}_{what}"


def _named(entry: IgnoredContainer) -> dict[str, str]:
    """The log fields that name an entry left out: its container, field and assignment."""
    named = {"nc": entry.id, "field": entry.field}
    if entry.assignment:
        named["assignment"] = entry.assignment
    return named


def _further(
    containers: tuple[NetworkContainer, ...],
    primary: str,
    asked: dict[str, PoolRequest],
    *,
    demand: Mapping[str, int],
    subnet_objects: Mapping[str, tuple[ClusterSubnet, ClusterSubnetState]],
    fallback_scaler: Scaler,
) -> dict[str, FurtherSubnetState]:
    """The further subnets the NNC's status holds a network container of (one per subnet,
    `subnetName`), each with the request its `spec.subnets` entry makes, and those the node
    holds none of yet that pods here choose (their demand is what asks for them). Each with
    its pods' demand, and the exhaustion and scaler of its ClusterSubnetState and ClusterSubnet
    (`subnet_objects`; a subnet whose objects are not read yet is not exhausted and scales with
    the node's configured scaler). A subnet only asked for is not listed: the node's own
    demand keeps it."""
    names = dict.fromkeys(
        nc.subnet_name for nc in containers if nc.subnet_name not in ("", primary)
    )
    names.update((name, None) for name, count in sorted(demand.items()) if name and count)
    result = {}
    for name in names:
        subnet, state = subnet_objects.get(name) or (ClusterSubnet(), ClusterSubnetState())
        result[name] = FurtherSubnetState(
            tuple(nc for nc in containers if nc.subnet_name == name),
            exhausted=bool(subnet_state_exhausted(state)),
            scaler=merge_scalers(fallback_scaler, *subnet_scalers(subnet)) if subnet else None,
            request=asked.get(name),
            pod_demand=demand.get(name, 0),
            draining=subnet_draining(subnet),
        )
    return result
