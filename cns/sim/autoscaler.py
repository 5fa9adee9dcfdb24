"""Escalator's scans of the node pools that have one (`cns.sim.escalator` decides how many nodes
to add or remove): booting nodes, tainting the oldest and deleting them after their grace."""

from __future__ import annotations

from functools import partial

from cns.sim.clock import Clock, Touched
from cns.sim.cluster import PENDING, Node, PoolState
from cns.sim.escalator import Resources, is_starving, nodes_delta
from cns.sim.fleet import Fleet
from cns.sim.scenario import Timing
from cns.sim.workload import Workload


class Autoscaler:
    def __init__(
        self,
        clock: Clock,
        touched: Touched,
        timing: Timing,
        *,
        fleet: Fleet,
        workload: Workload,
    ) -> None:
        self.clock = clock
        self.touched = touched
        self.timing = timing
        self.fleet = fleet
        self.workload = workload

    def start(self, pool: PoolState) -> None:
        self.clock.at(self.timing.escalator_scan_seconds, partial(self._scan, pool))

    def _scan(self, pool: PoolState) -> None:
        """One Escalator scan of a node pool (its scale lock holds while new nodes boot)."""
        now = self.clock.now
        self.clock.at(now + self.timing.escalator_scan_seconds, partial(self._scan, pool))
        autoscaler = pool.spec.autoscaler
        assert autoscaler is not None
        if pool.booting or now < pool.locked_until:
            return
        nodes = list(pool.nodes.values())
        tainted = [n for n in nodes if n.tainted_at is not None]
        shape = pool.spec.node.allocatable
        starving = False
        if autoscaler.options.scale_on_starve and pool.pending:
            starving = is_starving(
                self._largest_pending(pool), largest_available=self._largest_free(pool)
            )
        delta = nodes_delta(
            autoscaler.options,
            nodes=len(nodes),
            tainted=len(tainted),
            requests=pool.requested,
            node_capacity=shape,
            cached_node_capacity=shape if pool.seen_node else None,
            starving=starving,
        )
        if delta > 0:
            for node in sorted(tainted, key=lambda n: n.tainted_at or 0.0, reverse=True)[:delta]:
                node.tainted_at = None
                self.fleet.push(node)
                pool.capacity_freed = True
                self.touched.pool(pool)
                delta -= 1
            for _ in range(delta):
                pool.booting += 1
                self.clock.at(now + self.timing.node_start_seconds, partial(self._booted, pool))
            if delta:
                pool.locked_until = now + autoscaler.scale_up_cool_down_seconds
            return
        if delta < 0:
            untainted = [n for n in nodes if n.tainted_at is None]
            for node in untainted[:-delta]:  # the oldest first, as Escalator
                node.tainted_at = now
        for node in tainted:
            assert node.tainted_at is not None
            age = now - node.tainted_at
            if age >= autoscaler.hard_delete_grace_seconds or (
                not node.pods and age >= autoscaler.soft_delete_grace_seconds
            ):
                self._remove(node)

    def _remove(self, node: Node) -> None:
        """Escalator deletes the node: its pods are evicted, then the node goes."""
        for pod in list(node.pods.values()):
            self.workload.delete_pod(pod)
            self.workload.reconcile(pod.deployment, node.pool.spec.name)
        self.fleet.remove_node(node)

    @staticmethod
    def _largest_pending(pool: PoolState) -> Resources | None:
        cpu = memory = 0
        for queue in (pool.blocked, pool.arrivals):
            for pod in queue:
                if pod.state == PENDING:
                    request = pod.deployment.spec.pod
                    cpu = max(cpu, request.cpu_milli)
                    memory = max(memory, request.memory_bytes)
        return Resources(cpu_milli=cpu, memory_bytes=memory) if cpu or memory else None

    def _largest_free(self, pool: PoolState) -> Resources:
        shape = pool.spec.node.allocatable
        cpu = memory = 0
        for node in pool.nodes.values():
            if self.fleet.schedulable(node):
                cpu = max(cpu, shape.cpu_milli - node.cpu_used)
                memory = max(memory, shape.memory_bytes - node.memory_used)
        return Resources(cpu_milli=cpu, memory_bytes=memory)

    def _booted(self, pool: PoolState) -> None:
        pool.booting -= 1
        pool.nodes_added += 1
        self.fleet.register_node(pool)
