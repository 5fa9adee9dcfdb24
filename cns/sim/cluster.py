"""The simulated cluster's objects: pods, nodes, node pools, subnets and deployments.

Plain records that the simulation's collaborators (`cns.sim.fleet`, `cns.sim.cni`,
`cns.sim.workload`, `cns.sim.control_plane`, `cns.sim.autoscaler`) change; each node holds a
real `Pool` and each subnet the controller's real `SubnetModel`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cns.core.pool import Pool
from cns.core.subnet import Subnet
from cns.core.subnet_model import NodeView, SubnetModel
from cns.core.types import NetworkContainer, Owner, PoolRequest, Scaler, SubnetStatus
from cns.sim.escalator import Resources
from cns.sim.scenario import DeploymentSpec, NodePoolSpec, SubnetSpec

# Pod states.
PENDING = 0  # not scheduled yet
WAITING = 1  # bound to a node, its ADD waits for an IP
BACKOFF = 2  # bound, its ADD timed out; the kubelet retries after `addRetrySeconds`
RUNNING = 3  # has its IP
GONE = 4  # deleted

NO_REQUEST = PoolRequest(0)


@dataclass(slots=True, kw_only=True)
class Level:
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
    unused: Level = field(default_factory=Level)
    cooling: Level = field(default_factory=Level)
    reserved_level: Level = field(default_factory=Level)  # `reserved` over time
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

    @property
    def utilization(self) -> float:
        return self.reserved / self.capacity if self.capacity else 1.0

    def publish_view(self, name: str) -> None:
        """What the controller sees of a node changed: tell its model."""
        view = NodeView(name, self.ncs.get(name), self.requests.get(name, NO_REQUEST))
        self.model.set_node(view)


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
