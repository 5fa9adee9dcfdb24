"""`cns controller`: fulfils every node's NodeNetworkConfig from one ClusterSubnet.

The API server is the only source of truth: which addresses are taken is read from the NNC
statuses, every round, so a restarted controller (or a new leader) continues where the last one
stopped. Writes carry the object's resourceVersion; a conflict means the cache was stale, and the
round is simply run again. Only the leader (a Lease) reconciles.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import uuid
from typing import Any

import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from cns.controller.lease import LeaderElector, LostLeadership
from cns.controller.plan import NodeView, SubnetStatus, plan_subnet
from cns.core.subnet import Subnet
from cns.core.types import Scaler
from cns.kube.resources import (
    CLUSTER_SUBNET,
    CLUSTER_SUBNET_STATE,
    GROUP,
    MERGE_PATCH,
    NNC,
    merge_scalers,
    nc_to_status,
    network_containers,
    pool_request,
    scaler_to_wire,
)
from cns.kube.watch import WatchedCollection, custom_objects

log = structlog.get_logger("cns.controller")

ROUND_RETRY_SECONDS = 1.0


def _subnet(cs: dict[str, Any], default_scaler: Scaler) -> Subnet:
    spec = cs.get("spec") or {}
    exhaustion = spec.get("exhaustion") or {}
    return Subnet(
        name=cs["metadata"]["name"],
        cidr=str(spec["subnet"]),
        gateway=str(spec.get("gateway") or ""),
        reserved_ips=frozenset(str(ip) for ip in spec.get("reservedIPs") or ()),
        upper_percent=int(exhaustion.get("upperPercent", 90)),
        lower_percent=int(exhaustion.get("lowerPercent", 50)),
        node_safety_factor=int(spec.get("nodeSafetyFactor", 2)),
        max_batch=int(spec.get("maxBatchSize", 16)),
        request_threshold_percent=int(
            (spec.get("scaler") or {}).get(
                "requestThresholdPercent", default_scaler.request_threshold_percent
            )
        ),
    )


class Controller:
    """One subnet's control plane."""

    def __init__(
        self,
        api: client.ApiClient,
        subnet_name: str,
        namespace: str = "kube-system",
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
        self.lease_seconds = lease_seconds
        self._dirty = asyncio.Event()
        custom = self.custom
        self.nodes = WatchedCollection("nodes", self.core.list_node, self.kick)
        self.nncs = custom_objects(custom, NNC, self.kick, namespace=namespace)
        self.subnets = custom_objects(custom, CLUSTER_SUBNET, self.kick, name=subnet_name)
        self.states = custom_objects(custom, CLUSTER_SUBNET_STATE, self.kick, name=subnet_name)
        self._collections = (self.nodes, self.nncs, self.subnets, self.states)

    def kick(self) -> None:
        self._dirty.set()

    async def run(self) -> None:
        """Campaign, lead until the lease is lost, step down, campaign again; forever.

        Nothing is carried over between terms: every term starts by listing the API server.
        """
        elector = LeaderElector(
            self.api,
            f"cns-controller-{self.subnet_name}",
            self.namespace,
            self.identity,
            lease_seconds=self.lease_seconds,
            renew_deadline_seconds=self.lease_seconds * 2 / 3,
            retry_seconds=max(0.2, self.lease_seconds / 7.5),
        )
        while True:
            await elector.acquire()
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(elector.hold(), name="lease")
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
            try:
                await self.reconcile()
            except ApiException as exc:
                log.warning("round_failed", status=exc.status, reason=exc.reason, body=exc.body)
                await asyncio.sleep(ROUND_RETRY_SECONDS)
                self.kick()
            except Exception as exc:
                log.error("round_failed", error=repr(exc))
                await asyncio.sleep(ROUND_RETRY_SECONDS)
                self.kick()

    def _one(self, collection: WatchedCollection) -> dict[str, Any]:
        return next(iter(collection.objects.values()), {})

    async def reconcile(self) -> None:
        """One round: NNCs for new nodes, then fulfil, release, and publish the subnet status."""
        cs = self._one(self.subnets)
        if not cs:
            log.info("waiting_for_clustersubnet", subnet=self.subnet_name)
            return
        subnet = _subnet(cs, self.default_scaler)
        await self._ensure_nncs()
        nncs = {obj["metadata"]["name"]: obj for obj in self.nncs.objects.values()}
        views = []
        for name, nnc in sorted(nncs.items()):
            containers = [nc for nc in network_containers(nnc) if nc.subnet == str(subnet.network)]
            views.append(NodeView(name, containers[0] if containers else None, pool_request(nnc)))
        cs_status = cs.get("status") or {}
        css_status = self._one(self.states).get("status") or {}
        previous = SubnetStatus(
            exhausted=bool(css_status.get("exhausted", False)),
            reserved=int(cs_status.get("reservedIPCount") or 0),
            batch=int((cs_status.get("scaler") or {}).get("batchSize") or 0),
            batch_changes=int(cs_status.get("batchChanges") or 0),
        )
        plan = plan_subnet(subnet, views, previous, self.rng, lambda: str(uuid.uuid4()))
        status = plan.status
        computed = {"batchSize": status.batch}
        scaler = merge_scalers(self.default_scaler, (cs.get("spec") or {}).get("scaler"), computed)
        wire_scaler = scaler_to_wire(scaler)
        for name, nnc in nncs.items():
            nc = plan.changed.get(name)
            current_scaler = (nnc.get("status") or {}).get("scaler")
            if nc is None and current_scaler == wire_scaler:
                continue
            patch: dict[str, Any] = {
                "metadata": {"resourceVersion": nnc["metadata"]["resourceVersion"]},
                "status": {"scaler": wire_scaler, "status": "Updated"},
            }
            if nc is not None:
                patch["status"]["networkContainers"] = [nc_to_status(nc, subnet.name)]
                patch["status"]["assignedIPCount"] = len(nc.ip_configs)
                if plan.short_of:
                    patch["status"]["status"] = "SubnetFull"
            await self._patch_nnc_status(name, patch)
        if plan.changed:
            log.info(
                "subnet_round",
                subnet=subnet.name,
                changed=len(plan.changed),
                granted=sum(plan.granted.values()),
                released=sum(plan.released.values()),
                short_of=plan.short_of,
                reserved=status.reserved,
                capacity=plan.capacity,
                batch=status.batch,
                exhausted=status.exhausted,
            )
        await self._publish_subnet_status(cs, plan.capacity, len(views), status, wire_scaler)

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

    async def _patch_nnc_status(self, name: str, patch: dict[str, Any]) -> None:
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
            if exc.status != 409:
                raise
            # The node changed its spec meanwhile: re-read it and plan again.
            fresh = await self.custom.get_namespaced_custom_object(
                GROUP, NNC.version, self.namespace, NNC.plural, name
            )
            self.nncs.objects[WatchedCollection.key(fresh)] = fresh
            self.kick()
            return
        self.nncs.objects[WatchedCollection.key(updated)] = updated

    async def _publish_subnet_status(
        self,
        cs: dict[str, Any],
        capacity: int,
        node_count: int,
        status: SubnetStatus,
        wire_scaler: dict[str, int],
    ) -> None:
        utilization = round(100 * status.reserved / capacity, 2) if capacity else 100.0
        cs_status = {
            "scaler": {**wire_scaler, "batchSize": status.batch},
            "reservedIPCount": status.reserved,
            "capacity": capacity,
            "nodeCount": node_count,
            "utilizationPercent": utilization,
            "exhausted": status.exhausted,
            "batchChanges": status.batch_changes,
        }
        if {k: (cs.get("status") or {}).get(k) for k in cs_status} != cs_status:
            updated = await self.custom.patch_cluster_custom_object_status(
                GROUP,
                CLUSTER_SUBNET.version,
                CLUSTER_SUBNET.plural,
                self.subnet_name,
                {"status": cs_status},
                _content_type=MERGE_PATCH,  # type: ignore[call-arg]
            )
            self.subnets.objects[WatchedCollection.key(updated)] = updated
        state = self._one(self.states)
        if not state:
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
        if (state.get("status") or {}).get("exhausted") != status.exhausted:
            log.warning(
                "subnet_exhaustion_changed", subnet=self.subnet_name, exhausted=status.exhausted
            )
            stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            state = await self.custom.patch_cluster_custom_object_status(
                GROUP,
                CLUSTER_SUBNET_STATE.version,
                CLUSTER_SUBNET_STATE.plural,
                self.subnet_name,
                {"status": {"exhausted": status.exhausted, "timestamp": stamp}},
                _content_type=MERGE_PATCH,  # type: ignore[call-arg]
            )
        self.states.objects[WatchedCollection.key(state)] = state
