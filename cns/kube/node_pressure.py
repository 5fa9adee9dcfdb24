"""IP pressure as the scheduler sees it: the Node condition `PodIPPressure` and the taint
`acn.azure.com/pod-ip-pressure:NoSchedule`, written by the node's own daemon.

Other writers share the Node: the kubelet (its own conditions and taints), the node lifecycle
controller (`node.kubernetes.io/*` taints), operators (`kubectl taint`). So:

- the condition goes through the status subresource as a strategic merge patch of one entry of
  `status.conditions` (merged by `type`): no other condition is touched, nothing to race;
- the taint list has no merge key, so it is written whole, as a merge patch conditional on the
  resourceVersion read just before (409 if anyone changed the node since: read again and redo,
  as Kubernetes' own `PatchNodeTaints` does). Only the entry of `TAINT_KEY` is added or removed;
  every other taint is written back as it was read.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.kube.client import MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeClient
from cns.kube.wire import Node, NodeCondition, Taint

log = structlog.get_logger("cns.kube.node_pressure")

CONDITION_TYPE = "PodIPPressure"
TAINT_KEY = "acn.azure.com/pod-ip-pressure"
TAINT_EFFECT = "NoSchedule"
CONFLICT_ATTEMPTS = 8  # a kubelet's status updates change the node every few seconds at most
REQUEST_SECONDS = 10.0


class NodeGone(Exception):
    """The daemon's Node does not exist (deleted under it): nothing to mark."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mark:
    """What the node shows: the condition's status, reason and message; tainted when True."""

    status: str  # True, False
    reason: str
    message: str

    @property
    def tainted(self) -> bool:
        return self.status == "True"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def our_taint(node: Node) -> bool:
    return any(t.get("key") == TAINT_KEY for t in node.get("spec", {}).get("taints") or [])


def our_condition(node: Node) -> NodeCondition | None:
    conditions = node.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)


def with_our_taint(taints: list[Taint], tainted: bool) -> list[Taint]:
    """`taints` without the entry of TAINT_KEY, and with it (once) when `tainted`."""
    others = [t for t in taints if t.get("key") != TAINT_KEY]
    return [*others, {"key": TAINT_KEY, "effect": TAINT_EFFECT}] if tainted else others


class NodeMarks:
    """The condition and the taint of one Node (the daemon's own)."""

    def __init__(self, kube: KubeClient, node_name: str) -> None:
        self.kube = kube
        self.node_name = node_name

    async def read(self) -> Node:
        node = await self.kube.read_node(self.node_name, timeout=REQUEST_SECONDS)
        if node is None:
            raise NodeGone(self.node_name)
        return node

    async def tainted(self) -> bool:
        """Whether the node carries the taint now (left by a daemon that crashed, at start)."""
        return our_taint(await self.read())

    async def show(self, mark: Mark) -> None:
        """Set the condition (its transition time moved only when its status changes), then add
        or remove the taint."""
        node = await self.read()
        old = our_condition(node)
        now = _now()
        since = now
        if old is not None and old.get("status") == mark.status:
            since = old.get("lastTransitionTime", now)
        condition: NodeCondition = {
            "type": CONDITION_TYPE,
            "status": mark.status,
            "reason": mark.reason,
            "message": mark.message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }
        await self._patch_status({"status": {"conditions": [condition]}})
        await self._set_taint(mark.tainted, node)

    async def clear(self) -> None:
        """No taint and no condition: the node as if cns had never marked it (a daemon that
        stops, or runs with ipPressure off)."""
        node = await self.read()
        if our_condition(node) is not None:
            delete = {"type": CONDITION_TYPE, "$patch": "delete"}
            await self._patch_status({"status": {"conditions": [delete]}})  # type: ignore[list-item]
        await self._set_taint(False, node)

    async def _patch_status(self, patch: Node) -> None:
        found = await self.kube.patch_node(
            self.node_name,
            patch,
            content_type=STRATEGIC_MERGE_PATCH,
            status=True,
            timeout=REQUEST_SECONDS,
        )
        if found is None:
            raise NodeGone(self.node_name)

    async def _set_taint(self, tainted: bool, node: Node) -> None:
        """Add or remove the taint of TAINT_KEY, conditional on the resourceVersion read; on a
        conflict read the node again and redo it on what another writer left."""
        for _ in range(CONFLICT_ATTEMPTS):
            taints = list(node.get("spec", {}).get("taints") or [])
            wanted = with_our_taint(taints, tainted)
            if wanted == taints:
                return
            patch: Node = {
                "metadata": {
                    "resourceVersion": node.get("metadata", {}).get("resourceVersion", "")
                },
                "spec": {"taints": wanted or None},
            }
            try:
                found = await self.kube.patch_node(
                    self.node_name, patch, content_type=MERGE_PATCH, timeout=REQUEST_SECONDS
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                log.info("node_taint_conflict", node=self.node_name, tainted=tainted)
                node = await self.read()
                continue
            if found is None:
                raise NodeGone(self.node_name)
            log.info("node_taint_written", node=self.node_name, key=TAINT_KEY, tainted=tainted)
            return
        raise ApiException(status=409, reason=f"node {self.node_name} kept changing")
