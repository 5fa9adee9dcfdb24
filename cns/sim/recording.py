"""What a run measures: the counters and levels the collaborators update, the samples taken
every `sampleSeconds`, and the `RunResult` that `cns.sim.report` turns into tables and JSON."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cns.sim.clock import Clock
from cns.sim.cluster import DeploymentState, Level, PoolState, SimulatedSubnet

Progress = Callable[[float], None]


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
    overflow_pods: list[int] = field(default_factory=list)  # live pods on an overflow address


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
    # Overflow and draining (the scenario's `overflow` and `drainAtSeconds`), and the pods
    # given its addresses: how many, how many of those waited and how long.
    overflow: tuple[str, ...]
    drain_at_seconds: float | None
    pods_assigned: int
    waits: list[float]  # as RunResult.waits, of the pods that waited for one of its addresses
    overflowed_out: int  # its nodes' pods given an overflow subnet's address
    overflowed_in: int  # other subnets' pods given one of its addresses
    gate_openings: int  # times its nodes saw the overflow gate open (exhausted or draining)


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


class Recorder:
    """The run's counters, levels and samples. The collaborators report what happened; the
    recorder reads the cluster (subnets, node pools, deployments) only to sample and to sum up."""

    def __init__(
        self,
        clock: Clock,
        *,
        sample_seconds: float,
        subnets: dict[str, SimulatedSubnet],
        pools: dict[str, PoolState],
        deployments: dict[str, DeploymentState],
    ) -> None:
        self.clock = clock
        self.sample_seconds = sample_seconds
        self.subnets = subnets
        self.pools = pools
        self.deployments = deployments
        self.progress: Progress | None = None
        self.unused = Level()
        self.cooling = Level()
        self.pods_delayed_by_cooldown = 0
        self.waits: list[float] = []
        self.failed_pods = 0
        self.failed_adds = 0
        self.pods_created = 0
        self.waiting_for_ip = 0  # bound pods without an IP, in an ADD or in its retry back-off
        self.unscheduled = 0
        self.peak_waiting_for_ip = 0
        self.peak_unscheduled = 0
        self.series = Series()
        self.flip_times: list[float] = []
        self.batch_change_times: list[float] = []
        self.pods_on_overflow = 0  # live pods holding an overflow subnet's address
        self._sample_due = False

    def start(self) -> None:
        self.clock.at(0.0, self._sample)

    def _sample(self) -> None:
        """Samples are taken at the end of their instant, once pods are scheduled."""
        self._sample_due = True
        now = self.clock.now
        if now + self.sample_seconds <= self.clock.end:
            self.clock.at(now + self.sample_seconds, self._sample)

    def end_of_instant(self) -> None:
        # Peaks at the end of an instant: pods created and scheduled at once never pended.
        self.peak_unscheduled = max(self.peak_unscheduled, self.unscheduled)
        self.peak_waiting_for_ip = max(self.peak_waiting_for_ip, self.waiting_for_ip)
        if self._sample_due:
            self._record_sample()

    def unused_changed(self, subnet: SimulatedSubnet, delta: int) -> None:
        subnet.unused.add(self.clock.now, delta)
        self.unused.add(self.clock.now, delta)

    def waited(self, subnet: SimulatedSubnet, seconds: float) -> None:
        """A pod's wait for one of the subnet's addresses ended (it got one, or was deleted)."""
        self.waits.append(seconds)
        subnet.waits.append(seconds)

    def cooling_changed(self, subnet: SimulatedSubnet, delta: int) -> None:
        subnet.cooling.add(self.clock.now, delta)
        self.cooling.add(self.clock.now, delta)

    def _mean_utilization(self, subnet: SimulatedSubnet) -> float:
        if not subnet.capacity:
            return 1.0
        return subnet.reserved_level.area / self.clock.end / subnet.capacity

    def _record_sample(self) -> None:
        self._sample_due = False
        series = self.series
        series.time.append(self.clock.now)
        for name, subnet in self.subnets.items():
            series.utilization.setdefault(name, []).append(subnet.utilization)
            series.batch.setdefault(name, []).append(subnet.effective_batch)
            series.exhausted.setdefault(name, []).append(int(subnet.status.exhausted))
        series.pods.append(sum(len(d.pods) for d in self.deployments.values()))
        series.unscheduled.append(self.unscheduled)
        series.waiting_for_ip.append(self.waiting_for_ip)
        series.nodes.append(sum(len(pool.nodes) for pool in self.pools.values()))
        series.unused_ips.append(self.unused.value)
        series.cooling_ips.append(self.cooling.value)
        series.overflow_pods.append(self.pods_on_overflow)
        if self.progress is not None:
            self.progress(self.clock.now / self.clock.end)

    def result(self, strategy: str) -> RunResult:
        end = self.clock.end
        for level in (self.unused, self.cooling):
            level.add(end, 0)
        for subnet in self.subnets.values():
            subnet.unused.add(end, 0)
            subnet.cooling.add(end, 0)
            subnet.reserved_level.add(end, 0)
        waits = list(self.waits)
        subnet_waits = {name: list(subnet.waits) for name, subnet in self.subnets.items()}
        still_waiting = 0
        for deployment in self.deployments.values():
            for pod in deployment.pods:
                if pod.wait_started is not None:
                    assert pod.lane is not None  # it waits in the lane its ADD chose
                    waits.append(end - pod.wait_started)
                    subnet_waits[pod.lane.subnet.spec.name].append(end - pod.wait_started)
                    still_waiting += 1
        subnets = {}
        for name, subnet in self.subnets.items():
            subnets[name] = SubnetResult(
                capacity=subnet.capacity,
                peak_utilization=subnet.peak_utilization,
                mean_utilization=self._mean_utilization(subnet),
                final_utilization=subnet.utilization,
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
                mean_unused_ips=subnet.unused.area / end,
                peak_cooling_ips=subnet.cooling.peak,
                mean_cooling_ips=subnet.cooling.area / end,
                overflow=subnet.spec.overflow,
                drain_at_seconds=subnet.spec.drain_at_seconds,
                pods_assigned=subnet.pods_assigned,
                waits=subnet_waits[name],
                overflowed_out=subnet.overflowed_out,
                overflowed_in=subnet.overflowed_in,
                gate_openings=subnet.gate_openings,
            )
        return RunResult(
            strategy=strategy,
            duration_seconds=end,
            pods_created=self.pods_created,
            waits=waits,
            still_waiting=still_waiting,
            peak_waiting_for_ip=self.peak_waiting_for_ip,
            peak_unscheduled=self.peak_unscheduled,
            failed_pods=self.failed_pods,
            failed_adds=self.failed_adds,
            peak_unused_ips=self.unused.peak,
            mean_unused_ips=self.unused.area / end,
            peak_cooling_ips=self.cooling.peak,
            mean_cooling_ips=self.cooling.area / end,
            pods_delayed_by_cooldown=self.pods_delayed_by_cooldown,
            nodes_added=sum(pool.nodes_added for pool in self.pools.values()),
            nodes_removed=sum(pool.nodes_removed for pool in self.pools.values()),
            final_nodes=sum(len(pool.nodes) for pool in self.pools.values()),
            subnets=subnets,
            series=self.series,
            flip_times=self.flip_times,
            batch_change_times=self.batch_change_times,
        )
