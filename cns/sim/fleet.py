"""The node fleet: nodes joining and leaving their pools and subnets (a node joins an overflow
subnet's control plane with a lane of its own when it first draws from it), the daemon's reconcile
step that publishes each lane's request, what the control plane delivers, and the LeastAllocated
scheduler that binds pending pods to nodes."""

from __future__ import annotations

import bisect
import heapq
from collections import deque

from cns.core.overflow import overflow_open
from cns.core.types import NetworkContainer, Scaler
from cns.sim.clock import Touched
from cns.sim.cluster import PENDING, Lane, Node, Pod, PoolState, SimulatedSubnet
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
        """The daemon's reconcile step: recompute each lane's request, publish those that
        changed. While the primary sends pods on and cannot serve some with what it holds, the
        overflow subnet that takes them is joined ahead of their ADDs."""
        if node.removed:
            return
        target = node.spill_target()
        if target is not None and node.spilled():
            self.overflow_lane(node, target)
        for lane in node.lanes():
            self._plan_lane(node, lane)

    def _plan_lane(self, node: Node, lane: Lane) -> None:
        if not lane.has_network:
            return
        request = lane.ipam.plan(
            lane.scaler,
            lane.exhausted,
            node.demand(lane),
            lane.sent,
            draining=node.keeps_only_held(lane),
        )
        if request != lane.sent:
            lane.sent = request
            lane.subnet.requests[node.name] = request
            lane.subnet.publish_view(node.name)
            self.control.request_round(lane.subnet)

    def register_node(self, pool: PoolState) -> None:
        subnet = pool.subnet
        pool.created += 1
        name = f"{pool.spec.name}-{pool.created:05d}"
        node = Node(name, pool.created, pool)
        node.primary = Lane(node, subnet, subnet.scaler, subnet.exhausted)
        pool.nodes[name] = node
        pool.seen_node = True
        self._join(node.primary)

    def overflow_lane(self, node: Node, subnet: SimulatedSubnet) -> Lane:
        """The node's lane of overflow subnet `subnet`, made (and the node made known to the
        subnet's control plane, which creates its network container) when first needed."""
        lane = node.overflow.get(subnet.spec.name)
        if lane is None:
            lane = Lane(node, subnet, subnet.scaler, subnet.exhausted)
            node.overflow[subnet.spec.name] = lane
            self._join(lane)
        return lane

    def _join(self, lane: Lane) -> None:
        subnet = lane.subnet
        subnet.lanes[lane.name] = lane
        bisect.insort(subnet.names, lane.name)
        subnet.publish_view(lane.name)
        self.control.request_round(subnet)

    def remove_node(self, node: Node) -> None:
        """The node is deleted (its pods evicted before): its network containers go, and the
        IPs cooling down on it leave with it."""
        node.removed = True
        del node.pool.nodes[node.name]
        self.touched.forget(node)
        node.pool.nodes_removed += 1
        for lane in node.lanes():
            subnet = lane.subnet
            self.record.cooling_changed(subnet, -lane.ipam.cooling_count())
            del subnet.lanes[node.name]
            subnet.names.remove(node.name)
            subnet.ncs.pop(node.name, None)
            subnet.requests.pop(node.name, None)
            subnet.model.remove_node(node.name)
            subnet.gone.add(node.name)
            self.control.request_round(subnet)

    def deliver_settings(self, subnet: SimulatedSubnet, scaler: Scaler, exhausted: bool) -> None:
        for lane in subnet.lanes.values():
            lane.scaler, lane.exhausted = scaler, exhausted
            self.touched.node(lane.node)

    def deliver_exhaustion(self, subnet: SimulatedSubnet, exhausted: bool) -> None:
        self._overflow_changed(subnet, exhausted=exhausted, draining=subnet.draining)

    def deliver_draining(self, subnet: SimulatedSubnet) -> None:
        self._overflow_changed(subnet, exhausted=subnet.seen_exhausted, draining=True)

    def _overflow_changed(
        self, subnet: SimulatedSubnet, *, exhausted: bool, draining: bool
    ) -> None:
        """The subnet's state as the nodes see it changed: where their ADDs go may change,
        both on the nodes whose primary it is (the gate) and on those it takes pods from (its
        room). ADDs waiting for the primary go on where the gate now sends them, and every lane
        of these nodes recomputes its request (the spill moves)."""
        was_open = overflow_open(
            primary_exhausted=subnet.seen_exhausted, primary_draining=subnet.draining
        )
        opens = overflow_open(primary_exhausted=exhausted, primary_draining=draining)
        if subnet.overflow and opens and not was_open:
            subnet.gate_openings += 1
        subnet.seen_exhausted, subnet.draining = exhausted, draining
        nodes = {
            lane.name: lane.node
            for primary in (subnet, *subnet.overflow_of)
            for lane in primary.lanes.values()
            if lane is lane.node.primary
        }
        for node in nodes.values():
            self.cni.send_waiters_on(node)
            self.touched.node(node)

    def deliver_nc(self, lane: Lane, nc: NetworkContainer) -> None:
        node = lane.node
        if node.removed:
            return
        lane.ipam.apply_nc(nc)
        if lane.sent is not None:
            lane.ipam.honour_release(lane.sent.ips_not_in_use)
        if not lane.has_network:
            lane.has_network = True
            if lane is node.primary:
                self.push(node)
                node.pool.capacity_freed = True
                self.touched.pool(node.pool)
        self.cni.serve_waiters(lane)
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
