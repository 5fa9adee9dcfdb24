"""The discrete-event engine: one simulated cluster under one IP strategy.

What is real and what is simulated:
- each node holds a real `Pool`: a pod's CNI ADD is `Pool.assign`, its DEL `Pool.release` (the IP
  cools down for `ipCooldownSeconds`, until `Pool.expire_cooldowns`), and the request is
  `Pool.plan` (the idempotent `next_request` with the warm floor, cooling IPs counted as demand,
  releases marked `PendingRelease`);
- each subnet's control plane is the controller's own `plan_round` over a `SubnetModel` (the
  controller's incremental planning state), fed the nodes' published requests and returning
  the network containers the nodes then apply with `Pool.apply_nc`;
- node pools scale with `cns.sim.escalator.nodes_delta`; replicas are spread over the pools with
  `cns.core.division.divide` (remainder inertia when replicas or weights change).
The simulation supplies time (a heap of events), pods, a LeastAllocated scheduler, and the
latencies between them. Ties and random choices come from `random.Random` streams seeded from the
run's seed, and nothing iterates an unordered set, so a seed gives the same run on every machine.

Timing model: a node recomputes its request at the end of the instant that changed its demand or
pool (the daemon coalesces triggers the same way, only over 0.1 s). A subnet's controller runs a
round as soon as a new request appears, but at most once per `controllerRoundSeconds`; what a
round writes reaches the nodes `allocationLatencySeconds` later.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from cns.core.division import divide
from cns.core.pool import Pool
from cns.core.subnet import Subnet
from cns.core.subnet_model import NodeView, SubnetModel
from cns.core.subnet_plan import plan_round
from cns.core.types import IPState, NetworkContainer, Owner, PoolRequest, Scaler, SubnetStatus
from cns.sim.escalator import Resources, is_starving, nodes_delta
from cns.sim.scenario import DeploymentSpec, NodePoolSpec, Scenario, SubnetSpec
from cns.sim.strategies import Strategy

Progress = Callable[[float], None]

# Pod states.
PENDING = 0  # not scheduled yet
WAITING = 1  # bound to a node, its ADD waits for an IP
BACKOFF = 2  # bound, its ADD timed out; the kubelet retries after `addRetrySeconds`
RUNNING = 3  # has its IP
GONE = 4  # deleted

NO_REQUEST = PoolRequest(0)


@dataclass(slots=True, kw_only=True)
class _Level:
    """A count of IPs in some condition (reserved; reserved but unassigned; in cooldown): the
    current value, its peak and its time integral (for the time-weighted mean)."""

    value: int = 0
    peak: int = 0
    area: float = 0.0
    since: float = 0.0

    def add(self, now: float, delta: int) -> None:
        self.area += self.value * (now - self.since)
        self.since = now
        self.value += delta
        self.peak = max(self.peak, self.value)


@dataclass(slots=True, eq=False, repr=False)
class Pod:
    id: int
    deployment: DeploymentState
    pool: PoolState
    generation: int
    owner: Owner
    state: int = PENDING
    node: Node | None = None
    attempt: int = 0  # ADD attempts, to ignore timers of an earlier attempt
    wait_started: float | None = None
    failed_adds: int = 0
    delayed_by_cooldown: bool = False
    ready: bool = False
    slot: int = -1  # index in its deployment's `pods` list


@dataclass(slots=True, eq=False, repr=False)
class Node:
    name: str
    index: int
    pool: PoolState
    subnet: SimulatedSubnet
    scaler: Scaler
    exhausted: bool
    ipam: Pool = field(default_factory=Pool)
    pods: dict[int, Pod] = field(default_factory=dict)
    waiting: deque[tuple[Pod, int]] = field(default_factory=deque)
    cpu_used: int = 0
    memory_used: int = 0
    sent: PoolRequest | None = None
    has_network: bool = False
    tainted_at: float | None = None
    removed: bool = False
    version: int = 0  # bumped on every change of its load: stale scheduler heap entries

    def fits(self, pod: Pod) -> bool:
        shape = self.pool.spec.node
        request = pod.deployment.spec.pod
        return (
            len(self.pods) < shape.max_pods
            and self.cpu_used + request.cpu_milli <= shape.allocatable.cpu_milli
            and self.memory_used + request.memory_bytes <= shape.allocatable.memory_bytes
        )

    def score(self) -> int:
        """LeastAllocated: the sum of the CPU and memory fractions in use, scaled to an integer
        (every node of a pool has the same allocatable, so the scale is common)."""
        allocatable = self.pool.spec.node.allocatable
        return self.cpu_used * allocatable.memory_bytes + self.memory_used * allocatable.cpu_milli


@dataclass(slots=True, eq=False, repr=False)
class SimulatedSubnet:
    spec: SubnetSpec
    subnet: Subnet
    scaler: Scaler  # what nodes currently use (the strategy's view of the status)
    exhausted: bool
    status: SubnetStatus = field(default_factory=SubnetStatus)
    nodes: dict[str, Node] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # sorted: the controller lists NNCs by name
    ncs: dict[str, NetworkContainer] = field(default_factory=dict)
    requests: dict[str, PoolRequest] = field(default_factory=dict)
    # The controller's state (allocation record, containers, requests), and nodes deleted
    # since the last round.
    model: SubnetModel = field(init=False)
    gone: set[str] = field(default_factory=set)
    round_at: float | None = None
    last_round: float = -math.inf
    # metrics
    unused: _Level = field(default_factory=_Level)
    cooling: _Level = field(default_factory=_Level)
    reserved_level: _Level = field(default_factory=_Level)  # `reserved` over time
    reserved: int = 0
    reserved_secondary: int = 0
    assigned: int = 0
    peak_utilization: float = 0.0
    first_wait_utilization: float | None = None
    first_wait_at: float | None = None
    exhaustion_flips: int = 0
    batch_changes: int = 0
    rounds: int = 0
    round_times: list[float] = field(default_factory=list)
    batch_change_times: list[float] = field(default_factory=list)
    # Pods bound to or deleted from the subnet's nodes so far, and at the last exhaustion flip
    # (with the node count then): a flip back with neither changed is an oscillation.
    pod_events: int = 0
    last_flip: tuple[int, int] | None = None
    critical_nodes: int | None = None

    @property
    def capacity(self) -> int:
        return self.subnet.capacity

    @property
    def effective_batch(self) -> int:
        return 1 if self.exhausted else self.scaler.batch_size


@dataclass(slots=True, eq=False, repr=False)
class PoolState:
    spec: NodePoolSpec
    subnet: SimulatedSubnet
    nodes: dict[str, Node] = field(default_factory=dict)  # registered, in creation order
    heap: list[tuple[int, int, int, Node]] = field(default_factory=list)
    blocked: deque[Pod] = field(default_factory=deque)  # pending, did not fit last pass
    arrivals: deque[Pod] = field(default_factory=deque)  # pending, not tried yet
    pending: int = 0
    capacity_freed: bool = False
    requested: Resources = field(default_factory=Resources)
    booting: int = 0
    locked_until: float = -math.inf
    seen_node: bool = False
    nodes_added: int = 0
    nodes_removed: int = 0
    created: int = 0


@dataclass(slots=True, eq=False, repr=False, kw_only=True)
class PodSet:
    """One deployment's pods on one node pool: current generation and older ones (rollout)."""

    new: dict[int, Pod] = field(default_factory=dict)
    old: dict[int, Pod] = field(default_factory=dict)
    new_ready: int = 0
    old_ready: int = 0


@dataclass(slots=True, eq=False, repr=False)
class DeploymentState:
    spec: DeploymentSpec
    replicas: int
    weights: dict[str, int]
    targets: dict[str, int] = field(default_factory=dict)
    generation: int = 0
    by_pool: dict[str, PodSet] = field(default_factory=dict)
    pods: list[Pod] = field(default_factory=list)  # every live pod, for O(1) random picks


@dataclass(slots=True, kw_only=True)
class Series:
    """Samples every `sampleSeconds`; per-subnet lists are keyed by subnet name."""

    time: list[float] = field(default_factory=list)
    utilization: dict[str, list[float]] = field(default_factory=dict)
    batch: dict[str, list[int]] = field(default_factory=dict)
    exhausted: dict[str, list[int]] = field(default_factory=dict)
    pods: list[int] = field(default_factory=list)  # live pods
    unscheduled: list[int] = field(default_factory=list)
    waiting_for_ip: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    unused_ips: list[int] = field(default_factory=list)
    cooling_ips: list[int] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class SubnetResult:
    capacity: int
    peak_utilization: float
    mean_utilization: float  # time-weighted
    final_utilization: float
    first_wait_at: float | None
    first_wait_utilization: float | None
    exhaustion_flips: int
    batch_changes: int
    final_batch: int
    rounds: int
    round_times: list[float]
    batch_change_times: list[float]
    critical_nodes: int | None  # fewest nodes at which exhaustion oscillated (None: never)
    peak_unused_ips: int
    mean_unused_ips: float
    peak_cooling_ips: int  # of the unused IPs, those in the reuse cooldown
    mean_cooling_ips: float


@dataclass(slots=True, kw_only=True)
class RunResult:
    """Everything one strategy's run measured; `cns.sim.report` turns it into tables and JSON."""

    strategy: str
    duration_seconds: float
    pods_created: int
    waits: list[float]  # seconds, one per pod that waited for an IP (still waiting: so far)
    still_waiting: int
    peak_waiting_for_ip: int
    peak_unscheduled: int
    failed_pods: int
    failed_adds: int
    peak_unused_ips: int
    mean_unused_ips: float
    peak_cooling_ips: int
    mean_cooling_ips: float
    # Pods whose ADD waited while their node held IPs in cooldown (the daemon's wait reason
    # `cooldown`): without the cooldown they would have had one of those IPs at once.
    pods_delayed_by_cooldown: int
    nodes_added: int
    nodes_removed: int
    final_nodes: int
    subnets: dict[str, SubnetResult]
    series: Series
    flip_times: list[float]
    batch_change_times: list[float]


class Simulation:
    """One run: build the cluster from the scenario, then process events until the end."""

    def __init__(self, scenario: Scenario, strategy: Strategy, seed: int) -> None:
        self.scenario = scenario
        self.strategy = strategy
        self.timing = scenario.timing
        self.end = scenario.duration_seconds
        # Separate streams, so a strategy's different IP decisions do not change the workload.
        self.workload_rng = random.Random(f"{seed}/workload")
        self.controller_rng = random.Random(f"{seed}/controller")
        self.now = 0.0
        self.progress: Progress | None = None
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()
        self._ids = itertools.count(1)
        self._dirty_nodes: dict[str, Node] = {}
        self._dirty_pools: dict[str, PoolState] = {}
        self.unused = _Level()
        self.cooling = _Level()
        self.pods_delayed_by_cooldown = 0
        self.waits: list[float] = []
        self.failed_pods = 0
        self.failed_adds = 0
        self.pods_created = 0
        self.waiting_for_ip = 0  # bound pods without an IP, in an ADD or in its retry back-off
        self.unscheduled = 0
        self.peak_waiting_for_ip = 0
        self.peak_unscheduled = 0
        self._sample_due = False
        self.series = Series()
        self.flip_times: list[float] = []
        self.batch_change_times: list[float] = []
        self.subnets = {spec.name: self._subnet_state(spec) for spec in scenario.subnets}
        self.pools = {
            spec.name: PoolState(spec, self.subnets[spec.subnet]) for spec in scenario.node_pools
        }
        self.deployments = {
            spec.name: DeploymentState(spec, spec.replicas, dict(spec.weights))
            for spec in scenario.deployments
        }

    # -- the event loop ------------------------------------------------------------------------

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._sequence), action))

    def run(self, progress: Progress | None = None) -> RunResult:
        self.progress = progress
        self._start()
        events = self._events
        while events and events[0][0] <= self.end:
            now = events[0][0]
            self.now = now
            while events and events[0][0] == now:
                heapq.heappop(events)[2]()
            self._settle()
            # Peaks at the end of an instant: pods created and scheduled at once never pended.
            self.peak_unscheduled = max(self.peak_unscheduled, self.unscheduled)
            self.peak_waiting_for_ip = max(self.peak_waiting_for_ip, self.waiting_for_ip)
            if self._sample_due:
                self._record_sample()
        self.now = self.end
        return self._result()

    def _settle(self) -> None:
        """End of an instant: schedule what became schedulable, then recompute dirty nodes."""
        while self._dirty_pools or self._dirty_nodes:
            pools, self._dirty_pools = self._dirty_pools, {}
            for pool in pools.values():
                self._schedule(pool)
            nodes, self._dirty_nodes = self._dirty_nodes, {}
            for node in nodes.values():
                self._plan(node)

    def _start(self) -> None:
        for pool in self.pools.values():
            for _ in range(pool.spec.initial_nodes):
                self._register_node(pool)
            if pool.spec.autoscaler is not None:
                self._at(self.timing.escalator_scan_seconds, partial(self._scan, pool))
        for deployment in self.deployments.values():
            spec = deployment.spec
            self._at(spec.start_seconds, partial(self._scale_deployment, deployment, None, None))
            for change in spec.changes:
                at = max(change.at_seconds, spec.start_seconds)
                action = partial(
                    self._scale_deployment, deployment, change.replicas, change.weights
                )
                self._at(at, action)
            for at in spec.rollouts_at_seconds:
                self._at(max(at, spec.start_seconds), partial(self._rollout, deployment))
            if spec.crash_loops_per_minute > 0:
                self._at(
                    spec.start_seconds + self._crash_gap(spec), partial(self._crash, deployment)
                )
        self._at(0.0, self._sample)

    def _sample(self) -> None:
        """Samples are taken at the end of their instant, once pods are scheduled."""
        self._sample_due = True
        if self.now + self.scenario.sample_seconds <= self.end:
            self._at(self.now + self.scenario.sample_seconds, self._sample)

    # -- subnets and their controller ----------------------------------------------------------

    def _subnet_state(self, spec: SubnetSpec) -> SimulatedSubnet:
        subnet = Subnet(
            name=spec.name,
            cidr=spec.cidr,
            upper_percent=spec.upper_percent,
            lower_percent=spec.lower_percent,
            node_safety_factor=spec.node_safety_factor,
            max_batch=spec.max_batch,
            request_threshold_percent=self.scenario.scaler.request_threshold_percent,
            release_threshold_percent=self.scenario.scaler.release_threshold_percent,
            min_ip_count=self.scenario.scaler.min_ip_count,
            max_ip_count=self.scenario.scaler.max_ip_count,
        )
        status = SubnetStatus()
        scaler, exhausted = self.strategy.node_settings(self.scenario.scaler, status)
        state = SimulatedSubnet(spec, subnet, scaler, exhausted, status)
        state.model = SubnetModel(subnet)
        return state

    def _new_id(self) -> str:
        return str(next(self._ids))

    def _request_round(self, subnet: SimulatedSubnet) -> None:
        if subnet.round_at is None:
            subnet.round_at = max(
                self.now, subnet.last_round + self.timing.controller_round_seconds
            )
            self._at(subnet.round_at, partial(self._round, subnet))

    def _round(self, subnet: SimulatedSubnet) -> None:
        """One controller round (`plan_round`, over the nodes that changed); its writes reach
        the nodes after the allocation latency."""
        subnet.round_at = None
        subnet.last_round = self.now
        subnet.rounds += 1
        subnet.round_times.append(self.now)
        previous = subnet.status
        model = subnet.model
        changed = model.take_changed()
        plan = plan_round(
            model,
            changed=changed,
            previous=previous,
            rng=self.controller_rng,
            new_id=self._new_id,
            current_uids=dict.fromkeys(subnet.gone),  # deleted with their Node:
            nodes_gone=subnet.gone,  # their addresses are free
        )
        model.apply(plan.record)
        subnet.gone.clear()
        subnet.status = plan.status
        arrival = self.now + self.timing.allocation_latency_seconds
        if plan.status.exhausted != previous.exhausted:
            subnet.exhaustion_flips += 1
            self.flip_times.append(self.now)
            self._flipped(subnet)
        scaler, exhausted = self.strategy.node_settings(self.scenario.scaler, plan.status)
        if (scaler, exhausted) != (subnet.scaler, subnet.exhausted):
            old_batch = subnet.effective_batch
            subnet.scaler, subnet.exhausted = scaler, exhausted
            if subnet.effective_batch != old_batch:
                subnet.batch_changes += 1
                subnet.batch_change_times.append(self.now)
                self.batch_change_times.append(self.now)
            self._at(arrival, partial(self._deliver_settings, subnet, scaler, exhausted))
        for name, nc in plan.changed.items():
            subnet.ncs[name] = nc
            self._publish_view(subnet, name)
            self._at(arrival, partial(self._deliver_nc, subnet.nodes[name], nc))
        model.settle(changed)
        secondary = plan.status.reserved - len(subnet.ncs)
        self._unused_changed(subnet, secondary - subnet.reserved_secondary)
        subnet.reserved_level.add(self.now, plan.status.reserved - subnet.reserved)
        subnet.reserved, subnet.reserved_secondary = plan.status.reserved, secondary
        subnet.peak_utilization = max(subnet.peak_utilization, self._utilization(subnet))
        # Released addresses are grantable from the next round on; a node left without a
        # network container (no address even for its primary) is retried too.
        if (plan.released and plan.short_of) or len(subnet.ncs) < len(subnet.names):
            self._request_round(subnet)

    @staticmethod
    def _publish_view(subnet: SimulatedSubnet, name: str) -> None:
        """What the controller sees of a node changed: tell its model."""
        view = NodeView(name, subnet.ncs.get(name), subnet.requests.get(name, NO_REQUEST))
        subnet.model.set_node(view)

    def _flipped(self, subnet: SimulatedSubnet) -> None:
        """An exhaustion flip that undoes the previous one with the subnet's pods and nodes
        unchanged in between is the strategy reacting to itself: an oscillation. The fewest
        nodes at which one happened is the critical node count a toggle study measures."""
        now = (len(subnet.names), subnet.pod_events)
        if now == subnet.last_flip:
            nodes = now[0]
            subnet.critical_nodes = min(nodes, subnet.critical_nodes or nodes)
        subnet.last_flip = now

    def _unused_changed(self, subnet: SimulatedSubnet, delta: int) -> None:
        subnet.unused.add(self.now, delta)
        self.unused.add(self.now, delta)

    def _cooling_changed(self, subnet: SimulatedSubnet, delta: int) -> None:
        subnet.cooling.add(self.now, delta)
        self.cooling.add(self.now, delta)

    def _utilization(self, subnet: SimulatedSubnet) -> float:
        return subnet.reserved / subnet.capacity if subnet.capacity else 1.0

    def _mean_utilization(self, subnet: SimulatedSubnet) -> float:
        if not subnet.capacity:
            return 1.0
        return subnet.reserved_level.area / self.end / subnet.capacity

    def _deliver_settings(self, subnet: SimulatedSubnet, scaler: Scaler, exhausted: bool) -> None:
        for node in subnet.nodes.values():
            node.scaler, node.exhausted = scaler, exhausted
            self._dirty_nodes[node.name] = node

    def _deliver_nc(self, node: Node, nc: NetworkContainer) -> None:
        if node.removed:
            return
        node.ipam.apply_nc(nc)
        if node.sent is not None:
            node.ipam.honour_release(node.sent.ips_not_in_use)
        if not node.has_network:
            node.has_network = True
            self._push(node)
            node.pool.capacity_freed = True
            self._dirty_pools[node.pool.spec.name] = node.pool
        self._serve_waiters(node)
        self._dirty_nodes[node.name] = node

    # -- nodes -----------------------------------------------------------------------------------

    def _plan(self, node: Node) -> None:
        """The daemon's reconcile step: recompute the request, publish it if it changed."""
        if not node.has_network or node.removed:
            return
        request = node.ipam.plan(node.scaler, node.exhausted, len(node.pods), node.sent)
        if request != node.sent:
            node.sent = request
            node.subnet.requests[node.name] = request
            self._publish_view(node.subnet, node.name)
            self._request_round(node.subnet)

    def _register_node(self, pool: PoolState) -> None:
        subnet = pool.subnet
        pool.created += 1
        name = f"{pool.spec.name}-{pool.created:05d}"
        node = Node(name, pool.created, pool, subnet, subnet.scaler, subnet.exhausted)
        pool.nodes[name] = node
        pool.seen_node = True
        subnet.nodes[name] = node
        bisect.insort(subnet.names, name)
        self._publish_view(subnet, name)
        self._request_round(subnet)

    def _remove_node(self, node: Node) -> None:
        """Escalator deletes the node: its pods are evicted, its network container goes."""
        pool, subnet = node.pool, node.subnet
        for pod in list(node.pods.values()):
            self._delete_pod(pod)
            self._reconcile(pod.deployment, pool.spec.name)
        node.removed = True
        self._cooling_changed(subnet, -node.ipam.cooling_count())  # they leave with the node
        del pool.nodes[node.name]
        del subnet.nodes[node.name]
        subnet.names.remove(node.name)
        subnet.ncs.pop(node.name, None)
        subnet.requests.pop(node.name, None)
        subnet.model.remove_node(node.name)
        subnet.gone.add(node.name)
        self._dirty_nodes.pop(node.name, None)
        pool.nodes_removed += 1
        self._request_round(subnet)

    def _schedulable(self, node: Node) -> bool:
        """Ready (its network container arrived: cns writes the CNI configuration only then, so
        the kubelet reports the node NotReady before), not tainted, not deleted."""
        return node.has_network and node.tainted_at is None and not node.removed

    def _push(self, node: Node) -> None:
        node.version += 1
        heap = node.pool.heap
        heapq.heappush(heap, (node.score(), node.index, node.version, node))
        if len(heap) > 4 * len(node.pool.nodes) + 64:
            live = [(n.score(), n.index, n.version, n) for n in node.pool.nodes.values()]
            heapq.heapify(live)
            node.pool.heap = live

    # -- pods and their IPs ----------------------------------------------------------------------

    def _place(self, pool: PoolState, pod: Pod) -> Node | None:
        """The least allocated node the pod fits on (ties: the oldest node), or None."""
        heap = pool.heap
        while heap:
            _, _, version, node = heap[0]
            if version != node.version or not self._schedulable(node):
                heapq.heappop(heap)
                continue
            if node.fits(pod):
                return node
            break
        fitting = [n for n in pool.nodes.values() if self._schedulable(n) and n.fits(pod)]
        return min(fitting, key=lambda n: (n.score(), n.index), default=None)

    def _schedule(self, pool: PoolState) -> None:
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
        self.unscheduled -= 1
        node.subnet.pod_events += 1
        self._push(node)
        self._dirty_nodes[node.name] = node
        self._add(pod)

    def _add(self, pod: Pod) -> None:
        """The CNI ADD: an IP now, or wait (bounded) for the pool to grow."""
        node = pod.node
        assert node is not None
        pod.attempt += 1
        if node.has_network and node.ipam.assign(pod.owner)[0] is not None:
            self._got_ip(pod)
            return
        pod.state = WAITING
        if not pod.delayed_by_cooldown and node.has_network and node.ipam.cooling_count():
            pod.delayed_by_cooldown = True
            self.pods_delayed_by_cooldown += 1
        if pod.wait_started is None:
            pod.wait_started = self.now
            self.waiting_for_ip += 1
            subnet = node.subnet
            if subnet.first_wait_at is None:
                subnet.first_wait_at = self.now
                subnet.first_wait_utilization = self._utilization(subnet)
        node.waiting.append((pod, pod.attempt))
        self._at(
            self.now + self.timing.add_timeout_seconds, partial(self._timeout, pod, pod.attempt)
        )

    def _release(self, node: Node, pod: Pod) -> None:
        """The CNI DEL, as the daemon's: with `ipCooldownSeconds`, the IP cools down (counted
        in the node's demand by `Pool.plan`) and is handed out again only once it has ended."""
        cooldown = self.timing.ip_cooldown_seconds
        cool_until = self.now + cooldown if cooldown else 0.0
        record = node.ipam.release(pod.owner.key, cool_until=cool_until)
        node.subnet.assigned -= 1
        self._unused_changed(node.subnet, 1)
        if cool_until:
            self._at(cool_until, partial(self._end_cooldowns, node))
        if record is not None and record.state is IPState.COOLDOWN:
            self._cooling_changed(node.subnet, 1)

    def _end_cooldowns(self, node: Node) -> None:
        """The daemon's `end_cooldowns`: IPs whose cooldown is due become Available, waiting
        ADDs get them, and the node recomputes its request (its demand fell)."""
        if node.removed:
            return
        ended = node.ipam.expire_cooldowns(now=self.now, longest=self.timing.ip_cooldown_seconds)
        if ended:
            self._cooling_changed(node.subnet, -len(ended))
            self._serve_waiters(node)
            self._dirty_nodes[node.name] = node

    def _serve_waiters(self, node: Node) -> None:
        while node.waiting and node.ipam.available_count():
            pod, attempt = node.waiting.popleft()
            if pod.state != WAITING or pod.attempt != attempt:
                continue
            node.ipam.assign(pod.owner)
            self._got_ip(pod)

    def _got_ip(self, pod: Pod) -> None:
        node = pod.node
        assert node is not None
        pod.state = RUNNING
        node.subnet.assigned += 1
        self._unused_changed(node.subnet, -1)
        if pod.wait_started is not None:
            self.waits.append(self.now - pod.wait_started)
            pod.wait_started = None
            self.waiting_for_ip -= 1
        self._at(self.now + self.timing.pod_start_seconds, partial(self._ready, pod))

    def _timeout(self, pod: Pod, attempt: int) -> None:
        if pod.state != WAITING or pod.attempt != attempt:
            return
        pod.state = BACKOFF
        pod.failed_adds += 1
        self.failed_adds += 1
        if pod.failed_adds == 1:
            self.failed_pods += 1
        self._at(self.now + self.timing.add_retry_seconds, partial(self._retry, pod, attempt))

    def _retry(self, pod: Pod, attempt: int) -> None:
        if pod.state == BACKOFF and pod.attempt == attempt:
            self._add(pod)

    def _ready(self, pod: Pod) -> None:
        if pod.state != RUNNING:
            return
        pod.ready = True
        pods = pod.deployment.by_pool[pod.pool.spec.name]
        if pod.id in pods.new:
            pods.new_ready += 1
        else:
            pods.old_ready += 1
        if pods.old:
            self._reconcile(pod.deployment, pod.pool.spec.name)

    def _create_pod(self, deployment: DeploymentState, pool: PoolState) -> None:
        pod_id = next(self._ids)
        name = f"{deployment.spec.name}-{pod_id}"
        owner = Owner(
            container_id=f"sandbox-{pod_id}", ifname="eth0", pod_name=name, pod_namespace="default"
        )
        pod = Pod(pod_id, deployment, pool, deployment.generation, owner)
        pod.slot = len(deployment.pods)
        deployment.pods.append(pod)
        deployment.by_pool[pool.spec.name].new[pod_id] = pod
        pool.arrivals.append(pod)
        pool.pending += 1
        self.unscheduled += 1
        pool.requested = pool.requested + deployment.spec.pod
        self.pods_created += 1
        self._dirty_pools[pool.spec.name] = pool

    def _delete_pod(self, pod: Pod) -> None:
        state, pod.state = pod.state, GONE
        deployment, pool = pod.deployment, pod.pool
        pods = deployment.by_pool[pool.spec.name]
        if pods.new.pop(pod.id, None) is not None:
            pods.new_ready -= pod.ready
        else:
            del pods.old[pod.id]
            pods.old_ready -= pod.ready
        last = deployment.pods.pop()
        if last is not pod:
            deployment.pods[pod.slot] = last
            last.slot = pod.slot
        pool.requested = pool.requested - deployment.spec.pod
        if pod.wait_started is not None:
            self.waits.append(self.now - pod.wait_started)
            self.waiting_for_ip -= 1
        node = pod.node
        if node is None:
            pool.pending -= 1
            self.unscheduled -= 1
            return
        node.subnet.pod_events += 1
        if state == RUNNING:
            self._release(node, pod)
        del node.pods[pod.id]
        request = deployment.spec.pod
        node.cpu_used -= request.cpu_milli
        node.memory_used -= request.memory_bytes
        self._push(node)
        self._dirty_nodes[node.name] = node
        pool.capacity_freed = True
        self._dirty_pools[pool.spec.name] = pool

    # -- workloads -------------------------------------------------------------------------------

    def _scale_deployment(
        self, deployment: DeploymentState, replicas: int | None, weights: dict[str, int] | None
    ) -> None:
        """Replicas or weights changed (or the deployment starts): divide with inertia."""
        if replicas is not None:
            deployment.replicas = replicas
        if weights is not None:
            deployment.weights = dict(weights)
        previous = deployment.targets
        deployment.targets = divide(
            deployment.replicas, weights=deployment.weights, current=previous, rng=self.workload_rng
        )
        for name in deployment.targets:
            deployment.by_pool.setdefault(name, PodSet())
        for name in list(deployment.by_pool):
            self._reconcile(deployment, name)

    def _rollout(self, deployment: DeploymentState) -> None:
        """A new pod template: every pod is replaced, `maxSurgePercent` at a time."""
        deployment.generation += 1
        for name, pods in deployment.by_pool.items():
            unready = [pod for pod in pods.new.values() if not pod.ready]
            pods.old.update(pods.new)
            pods.old_ready += pods.new_ready
            pods.new, pods.new_ready = {}, 0
            for pod in unready:  # they serve nothing: replaced at once, so `old` is all ready
                self._delete_pod(pod)
            self._reconcile(deployment, name)

    def _reconcile(self, deployment: DeploymentState, pool_name: str) -> None:
        """The Deployment and ReplicaSet controllers for one pool (maxUnavailable 0).

        Without a rollout: create or delete (newest first) to the pool's share. During one: new
        pods up to the share plus the surge, and old (ready) ones deleted as new ones become
        ready, so that ready pods never drop below the share.
        """
        target = deployment.targets.get(pool_name, 0)
        pods = deployment.by_pool[pool_name]
        pool = self.pools[pool_name]
        removable = pods.old_ready + pods.new_ready - target
        for pod in list(itertools.islice(pods.old.values(), max(0, removable))):
            self._delete_pod(pod)
        wanted = target - len(pods.new)
        if pods.old:
            surge = math.ceil(target * deployment.spec.max_surge_percent / 100)
            wanted = min(wanted, target + surge - len(pods.new) - len(pods.old))
        for _ in range(wanted):
            self._create_pod(deployment, pool)
        while len(pods.new) > target:
            self._delete_pod(pods.new[next(reversed(pods.new))])

    def _crash_gap(self, spec: DeploymentSpec) -> float:
        return self.workload_rng.expovariate(spec.crash_loops_per_minute / 60)

    def _crash(self, deployment: DeploymentState) -> None:
        """A crash-looping pod is deleted and its ReplicaSet creates a replacement."""
        self._at(self.now + self._crash_gap(deployment.spec), partial(self._crash, deployment))
        if not deployment.pods:
            return
        pod = deployment.pods[self.workload_rng.randrange(len(deployment.pods))]
        if pod.state == RUNNING:
            self._delete_pod(pod)
            self._reconcile(deployment, pod.pool.spec.name)

    # -- the autoscaler --------------------------------------------------------------------------

    def _scan(self, pool: PoolState) -> None:
        """One Escalator scan of a node pool (its scale lock holds while new nodes boot)."""
        self._at(self.now + self.timing.escalator_scan_seconds, partial(self._scan, pool))
        autoscaler = pool.spec.autoscaler
        assert autoscaler is not None
        if pool.booting or self.now < pool.locked_until:
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
                self._push(node)
                pool.capacity_freed = True
                self._dirty_pools[pool.spec.name] = pool
                delta -= 1
            for _ in range(delta):
                pool.booting += 1
                self._at(self.now + self.timing.node_start_seconds, partial(self._booted, pool))
            if delta:
                pool.locked_until = self.now + autoscaler.scale_up_cool_down_seconds
            return
        if delta < 0:
            untainted = [n for n in nodes if n.tainted_at is None]
            for node in untainted[:-delta]:  # the oldest first, as Escalator
                node.tainted_at = self.now
        for node in tainted:
            assert node.tainted_at is not None
            age = self.now - node.tainted_at
            if age >= autoscaler.hard_delete_grace_seconds or (
                not node.pods and age >= autoscaler.soft_delete_grace_seconds
            ):
                self._remove_node(node)

    def _largest_pending(self, pool: PoolState) -> Resources | None:
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
            if self._schedulable(node):
                cpu = max(cpu, shape.cpu_milli - node.cpu_used)
                memory = max(memory, shape.memory_bytes - node.memory_used)
        return Resources(cpu_milli=cpu, memory_bytes=memory)

    def _booted(self, pool: PoolState) -> None:
        pool.booting -= 1
        pool.nodes_added += 1
        self._register_node(pool)

    # -- measurements ----------------------------------------------------------------------------

    def _record_sample(self) -> None:
        self._sample_due = False
        series = self.series
        series.time.append(self.now)
        for name, subnet in self.subnets.items():
            series.utilization.setdefault(name, []).append(self._utilization(subnet))
            series.batch.setdefault(name, []).append(subnet.effective_batch)
            series.exhausted.setdefault(name, []).append(int(subnet.status.exhausted))
        series.pods.append(sum(len(d.pods) for d in self.deployments.values()))
        series.unscheduled.append(self.unscheduled)
        series.waiting_for_ip.append(self.waiting_for_ip)
        series.nodes.append(sum(len(pool.nodes) for pool in self.pools.values()))
        series.unused_ips.append(self.unused.value)
        series.cooling_ips.append(self.cooling.value)
        if self.progress is not None:
            self.progress(self.now / self.end)

    def _result(self) -> RunResult:
        for level in (self.unused, self.cooling):
            level.add(self.end, 0)
        for subnet in self.subnets.values():
            subnet.unused.add(self.end, 0)
            subnet.cooling.add(self.end, 0)
            subnet.reserved_level.add(self.end, 0)
        waits = list(self.waits)
        still_waiting = 0
        for deployment in self.deployments.values():
            for pod in deployment.pods:
                if pod.wait_started is not None:
                    waits.append(self.end - pod.wait_started)
                    still_waiting += 1
        subnets = {}
        for name, subnet in self.subnets.items():
            subnets[name] = SubnetResult(
                capacity=subnet.capacity,
                peak_utilization=subnet.peak_utilization,
                mean_utilization=self._mean_utilization(subnet),
                final_utilization=self._utilization(subnet),
                first_wait_at=subnet.first_wait_at,
                first_wait_utilization=subnet.first_wait_utilization,
                exhaustion_flips=subnet.exhaustion_flips,
                batch_changes=subnet.batch_changes,
                final_batch=subnet.effective_batch,
                rounds=subnet.rounds,
                round_times=subnet.round_times,
                batch_change_times=subnet.batch_change_times,
                critical_nodes=subnet.critical_nodes,
                peak_unused_ips=subnet.unused.peak,
                mean_unused_ips=subnet.unused.area / self.end,
                peak_cooling_ips=subnet.cooling.peak,
                mean_cooling_ips=subnet.cooling.area / self.end,
            )
        return RunResult(
            strategy=self.strategy.name,
            duration_seconds=self.end,
            pods_created=self.pods_created,
            waits=waits,
            still_waiting=still_waiting,
            peak_waiting_for_ip=self.peak_waiting_for_ip,
            peak_unscheduled=self.peak_unscheduled,
            failed_pods=self.failed_pods,
            failed_adds=self.failed_adds,
            peak_unused_ips=self.unused.peak,
            mean_unused_ips=self.unused.area / self.end,
            peak_cooling_ips=self.cooling.peak,
            mean_cooling_ips=self.cooling.area / self.end,
            pods_delayed_by_cooldown=self.pods_delayed_by_cooldown,
            nodes_added=sum(pool.nodes_added for pool in self.pools.values()),
            nodes_removed=sum(pool.nodes_removed for pool in self.pools.values()),
            final_nodes=sum(len(pool.nodes) for pool in self.pools.values()),
            subnets=subnets,
            series=self.series,
            flip_times=self.flip_times,
            batch_change_times=self.batch_change_times,
        )


def simulate(
    scenario: Scenario,
    strategy: Strategy,
    seed: int | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Run `scenario` under `strategy`; the same seed always gives the same result."""
    return Simulation(scenario, strategy, scenario.seed if seed is None else seed).run(progress)
