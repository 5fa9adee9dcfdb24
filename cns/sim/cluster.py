"""The simulated cluster's objects: pods, nodes and their lanes, node pools, subnets and
deployments.

Plain records that the simulation's collaborators (`cns.sim.fleet`, `cns.sim.cni`,
`cns.sim.workload`, `cns.sim.control_plane`, `cns.sim.autoscaler`) change; each node's lane holds
a real `Pool` and each subnet the controller's real `SubnetModel`. What a node decides about
overflow subnets (where an ADD goes, what each lane asks for) is `cns.core.overflow`, applied
here to the node's lanes as the daemon applies it to its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cns.core.overflow import (
    OverflowCandidate,
    overflow_demand,
    overflow_open,
    overflow_subnet,
    overflow_target,
    primary_demand,
    spill,
)
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
    lane: Lane | None = None  # where its ADD draws from, then its address is: for life
    attempt: int = 0  # ADD attempts, to ignore timers of an earlier attempt
    wait_started: float | None = None
    failed_adds: int = 0
    delayed_by_cooldown: bool = False
    ready: bool = False
    slot: int = -1  # index in its deployment's `pods` list


@dataclass(slots=True, eq=False, repr=False)
class Lane:
    """A node's addresses of one subnet: a real `Pool`, a network container and a request of
    that subnet's control plane, and the ADDs waiting for one of its IPs. Every node has the lane
    of its primary subnet; one of an overflow subnet is made when the node first draws from it
    (the daemon's lanes, cns/node/lanes.py)."""

    node: Node
    subnet: SimulatedSubnet
    scaler: Scaler
    exhausted: bool  # what the strategy makes of the subnet's state: batch 1 while set
    ipam: Pool = field(default_factory=Pool)
    waiting: deque[tuple[Pod, int]] = field(default_factory=deque)
    sent: PoolRequest | None = None
    has_network: bool = False

    @property
    def name(self) -> str:
        """The node's name: the lane is the node in its subnet's control plane."""
        return self.node.name


@dataclass(slots=True, eq=False, repr=False)
class Node:
    name: str
    index: int
    pool: PoolState
    primary: Lane = field(init=False)
    overflow: dict[str, Lane] = field(default_factory=dict)  # by subnet, in the order first used
    pods: dict[int, Pod] = field(default_factory=dict)
    cpu_used: int = 0
    memory_used: int = 0
    tainted_at: float | None = None
    removed: bool = False
    version: int = 0  # bumped on every change of its load: stale scheduler heap entries

    @property
    def subnet(self) -> SimulatedSubnet:
        return self.primary.subnet

    @property
    def has_network(self) -> bool:
        """Its primary subnet's network container arrived (the CNI config is written then)."""
        return self.primary.has_network

    def lanes(self) -> list[Lane]:
        """The primary lane first, then the overflow lanes in the order they were made."""
        return [self.primary, *self.overflow.values()]

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

    # -- overflow (cns/core/overflow.py), as this node sees its subnets ---------------------------

    def overflow_gate_open(self) -> bool:
        """Whether the primary subnet sends its pods on: exhausted (the controller's state, as
        delivered) or draining."""
        primary = self.subnet
        return overflow_open(
            primary_exhausted=primary.seen_exhausted, primary_draining=primary.draining
        )

    def _candidates(self) -> list[OverflowCandidate]:
        return [
            OverflowCandidate(s.spec.name, exhausted=s.seen_exhausted, draining=s.draining)
            for s in self.subnet.overflow
        ]

    def add_target(self) -> SimulatedSubnet | None:
        """The overflow subnet an ADD drawing from the primary takes its address from now, or
        None (the primary's). A waiting ADD holds no address, so it is asked again."""
        primary = self.subnet
        if not primary.overflow:
            return None
        name = overflow_target(
            primary_exhausted=primary.seen_exhausted,
            primary_draining=primary.draining,
            primary_free=self.primary.ipam.available_count(),
            candidates=self._candidates(),
        )
        return primary.overflow_by_name[name] if name is not None else None

    def spill_target(self) -> SimulatedSubnet | None:
        """The overflow subnet that takes the primary's pods while the gate is open: the one
        whose demand counts them ahead (`spilled`)."""
        primary = self.subnet
        if not primary.overflow:
            return None
        name = overflow_subnet(
            primary_exhausted=primary.seen_exhausted,
            primary_draining=primary.draining,
            candidates=self._candidates(),
        )
        return self.subnet.overflow_by_name[name] if name is not None else None

    def overflowed(self) -> int:
        """Pods here holding an overflow subnet's address (every pod draws from the primary)."""
        return sum(lane.ipam.assigned_count() for lane in self.overflow.values())

    def spilled(self) -> int:
        """The primary's pods its lane cannot serve with what it holds, while the gate is open."""
        primary = self.subnet
        ipam = self.primary.ipam
        return spill(
            primary_exhausted=primary.seen_exhausted,
            primary_draining=primary.draining,
            demand=primary_demand(len(self.pods), overflowed=self.overflowed()),
            holds=ipam.assigned_count() + ipam.available_count(),
        )

    def demand(self, lane: Lane) -> int:
        """U of `lane`: for the primary, the pods bound here less those holding an overflow
        address (counted there, once); for an overflow lane, the pods holding or waiting for one
        of its addresses, or more: those it holds plus the primary's spill while it takes them."""
        if lane is self.primary:
            return primary_demand(len(self.pods), overflowed=self.overflowed())
        own = sum(1 for pod in self.pods.values() if pod.lane is lane)
        spilled = self.spilled() if self.spill_target() is lane.subnet else 0
        return max(own, overflow_demand(0, overflowed=lane.ipam.assigned_count(), spilled=spilled))

    def keeps_only_held(self, lane: Lane) -> bool:
        """The lane asks only for what its pods hold, no spare: its subnet is draining, or it is
        an overflow lane while the primary does not send pods on (no pod here names it)."""
        if lane.subnet.draining:
            return True
        return lane is not self.primary and not self.overflow_gate_open()


@dataclass(slots=True, eq=False, repr=False)
class SimulatedSubnet:
    spec: SubnetSpec
    subnet: Subnet
    scaler: Scaler  # what nodes currently use (the strategy's view of the status)
    exhausted: bool
    status: SubnetStatus = field(default_factory=SubnetStatus)
    lanes: dict[str, Lane] = field(default_factory=dict)  # by node name
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
    # Overflow: the subnets its nodes' pods go on to (`spec.overflow`, in order), those that
    # send theirs here, whether it drains, and its exhausted state as the nodes have it (the
    # controller's, delivered after the allocation latency; kept only where overflow uses it).
    overflow: tuple[SimulatedSubnet, ...] = ()
    overflow_of: list[SimulatedSubnet] = field(default_factory=list)
    draining: bool = False
    seen_exhausted: bool = False
    # metrics of overflow and of the pods given its addresses
    waits: list[float] = field(default_factory=list)  # of the pods that waited for its address
    pods_assigned: int = 0
    overflowed_out: int = 0  # its nodes' pods given an overflow subnet's address
    overflowed_in: int = 0  # other subnets' pods given one of its addresses
    gate_openings: int = 0  # times its nodes saw the overflow gate open

    @property
    def overflow_by_name(self) -> dict[str, SimulatedSubnet]:
        return {subnet.spec.name: subnet for subnet in self.overflow}

    @property
    def watched(self) -> bool:
        """Its exhausted state matters to overflow: it has overflow subnets or is one."""
        return bool(self.overflow or self.overflow_of)

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
