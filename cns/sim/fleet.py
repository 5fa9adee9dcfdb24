"""The node fleet: nodes joining and leaving their pools and subnets, the daemon's reconcile step
that publishes a node's request, what the control plane delivers, and the LeastAllocated
scheduler that binds pending pods to nodes."""

from __future__ import annotations

import bisect
import heapq
from collections import deque

from cns.core.types import NetworkContainer, Scaler
from cns.sim.clock import Touched
from cns.sim.cluster import PENDING, Node, Pod, PoolState, SimulatedSubnet
from cns.sim.cni import Cni
from cns.sim.control_plane import ControlPlane
from cns.sim.recording import Recorder


class Fleet:
    """Every node pool and its nodes (`pools`, keyed by pool name)."""

    def __init__(
        self,
        pools: dict[str, PoolState],
        *,
        touched: Touched,
        record: Recorder,
        control: ControlPlane,
        cni: Cni,
    ) -> None:
        self.pools = pools
        self.touched = touched
        self.record = record
        self.control = control
        self.cni = cni

    # -- nodes -----------------------------------------------------------------------------------

    def plan(self, node: Node) -> None:
        """The daemon's reconcile step: recompute the request, publish it if it changed."""
        if not node.has_network or node.removed:
            return
        request = node.ipam.plan(node.scaler, node.exhausted, len(node.pods), node.sent)
        if request != node.sent:
            node.sent = request
            node.subnet.requests[node.name] = request
            node.subnet.publish_view(node.name)
            self.control.request_round(node.subnet)

    def register_node(self, pool: PoolState) -> None:
        subnet = pool.subnet
        pool.created += 1
        name = f"{pool.spec.name}-{pool.created:05d}"
        node = Node(name, pool.created, pool, subnet, subnet.scaler, subnet.exhausted)
        pool.nodes[name] = node
        pool.seen_node = True
        subnet.nodes[name] = node
        bisect.insort(subnet.names, name)
        subnet.publish_view(name)
        self.control.request_round(subnet)

    def remove_node(self, node: Node) -> None:
        """The node is deleted (its pods evicted before): its network container goes, and the
        IPs cooling down on it leave with it."""
        pool, subnet = node.pool, node.subnet
        node.removed = True
        self.record.cooling_changed(subnet, -node.ipam.cooling_count())
        del pool.nodes[node.name]
        del subnet.nodes[node.name]
        subnet.names.remove(node.name)
        subnet.ncs.pop(node.name, None)
        subnet.requests.pop(node.name, None)
        subnet.model.remove_node(node.name)
        subnet.gone.add(node.name)
        self.touched.forget(node)
        pool.nodes_removed += 1
        self.control.request_round(subnet)

    def deliver_settings(self, subnet: SimulatedSubnet, scaler: Scaler, exhausted: bool) -> None:
        for node in subnet.nodes.values():
            node.scaler, node.exhausted = scaler, exhausted
            self.touched.node(node)

    def deliver_nc(self, node: Node, nc: NetworkContainer) -> None:
        if node.removed:
            return
        node.ipam.apply_nc(nc)
        if node.sent is not None:
            node.ipam.honour_release(node.sent.ips_not_in_use)
        if not node.has_network:
            node.has_network = True
            self.push(node)
            node.pool.capacity_freed = True
            self.touched.pool(node.pool)
        self.cni.serve_waiters(node)
        self.touched.node(node)

    # -- the scheduler ---------------------------------------------------------------------------

    @staticmethod
    def schedulable(node: Node) -> bool:
        """Ready (its network container arrived: cns writes the CNI configuration only then, so
        the kubelet reports the node NotReady before), not tainted, not deleted."""
        return node.has_network and node.tainted_at is None and not node.removed

    @staticmethod
    def push(node: Node) -> None:
        """The node's load changed: a new entry in its pool's heap (the old ones go stale)."""
        node.version += 1
        heap = node.pool.heap
        heapq.heappush(heap, (node.score(), node.index, node.version, node))
        if len(heap) > 4 * len(node.pool.nodes) + 64:
            live = [(n.score(), n.index, n.version, n) for n in node.pool.nodes.values()]
            heapq.heapify(live)
            node.pool.heap = live

    def _place(self, pool: PoolState, pod: Pod) -> Node | None:
        """The least allocated node the pod fits on (ties: the oldest node), or None."""
        heap = pool.heap
        while heap:
            _, _, version, node = heap[0]
            if version != node.version or not self.schedulable(node):
                heapq.heappop(heap)
                continue
            if node.fits(pod):
                return node
            break
        fitting = [n for n in pool.nodes.values() if self.schedulable(n) and n.fits(pod)]
        return min(fitting, key=lambda n: (n.score(), n.index), default=None)

    def schedule(self, pool: PoolState) -> None:
        """A scheduler pass: pods in creation order; a shape that fits nowhere is not retried in
        the same pass. After a pass that freed no capacity, only new pods are tried."""
        queues = (pool.blocked, pool.arrivals) if pool.capacity_freed else (pool.arrivals,)
        pool.capacity_freed = False
        blocked: deque[Pod] = deque() if len(queues) == 2 else pool.blocked
        no_room: set[tuple[int, int]] = set()
        for queue in queues:
            for pod in queue:
                if pod.state != PENDING:
                    continue
                request = pod.deployment.spec.pod
                shape = (request.cpu_milli, request.memory_bytes)
                node = None if shape in no_room else self._place(pool, pod)
                if node is None:
                    no_room.add(shape)
                    blocked.append(pod)
                else:
                    self._bind(pod, node)
        pool.blocked = blocked
        pool.arrivals = deque()

    def _bind(self, pod: Pod, node: Node) -> None:
        request = pod.deployment.spec.pod
        pod.node = node
        node.pods[pod.id] = pod
        node.cpu_used += request.cpu_milli
        node.memory_used += request.memory_bytes
        node.pool.pending -= 1
        self.record.unscheduled -= 1
        node.subnet.pod_events += 1
        self.push(node)
        self.touched.node(node)
        self.cni.add(pod)
