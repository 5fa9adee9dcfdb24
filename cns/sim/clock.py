"""Simulated time: the event heap, and what an instant changed that its end must settle."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from cns.sim.cluster import Node, PoolState


class Clock:
    """A heap of timed actions, run in time order; actions set for the same time run in the
    order they were set, so a run never depends on how the heap breaks ties."""

    def __init__(self, end: float) -> None:
        self.now = 0.0
        self.end = end
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._sequence), action))

    def run_instant(self) -> bool:
        """Run every action of the next instant up to the end (those they set for the same
        instant too); False once none is left."""
        events = self._events
        if not events or events[0][0] > self.end:
            return False
        now = events[0][0]
        self.now = now
        while events and events[0][0] == now:
            heapq.heappop(events)[2]()
        return True


class Touched:
    """The nodes and node pools an instant changed: at its end the pools' pending pods are
    scheduled and the nodes recompute their requests (the daemon coalesces the same way)."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.pools: dict[str, PoolState] = {}

    def node(self, node: Node) -> None:
        self.nodes[node.name] = node

    def pool(self, pool: PoolState) -> None:
        self.pools[pool.spec.name] = pool

    def forget(self, node: Node) -> None:
        """A deleted node has no request left to recompute."""
        self.nodes.pop(node.name, None)

    def take_pools(self) -> dict[str, PoolState]:
        pools, self.pools = self.pools, {}
        return pools

    def take_nodes(self) -> dict[str, Node]:
        nodes, self.nodes = self.nodes, {}
        return nodes
