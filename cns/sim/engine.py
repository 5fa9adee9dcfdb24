"""The discrete-event engine: one simulated cluster under one IP strategy.

What is real and what is simulated:
- each node holds a real `Pool` per subnet it draws from (a lane: its primary subnet's, and one
  per overflow subnet once its pods go there): a pod's CNI ADD is `Pool.assign`, its DEL
  `Pool.release` (the IP cools down for `ipCooldownSeconds`, until `Pool.expire_cooldowns`), and
  each lane's request is `Pool.plan` (the idempotent `next_request` with the warm floor, cooling
  IPs counted as demand, releases marked `PendingRelease`; `draining=True` for a draining
  subnet's lane);
- which lane an ADD takes its address from, and the demand each lane plans with, is the overflow
  rule of `cns.core.overflow` (the gate: the primary exhausted, as the controller's state reaches
  the nodes, or draining; the spill counted ahead; overflowed pods counted once);
- each subnet's control plane is the controller's own `plan_round` over a `SubnetModel` (the
  controller's incremental planning state), fed the nodes' published requests and returning
  the network containers the nodes then apply with `Pool.apply_nc`; a subnet set draining
  (`drainAtSeconds`) is planned as a ClusterSubnet with `spec.draining` (nothing granted);
- node pools scale with `cns.sim.escalator.nodes_delta`; replicas are spread over the pools with
  `cns.core.division.divide` (remainder inertia when replicas or weights change).
The simulation supplies time (a heap of events), pods, a LeastAllocated scheduler, and the
latencies between them. Ties and random choices come from `random.Random` streams seeded from the
run's seed, and nothing iterates an unordered set, so a seed gives the same run on every machine.

Timing model: a node recomputes its request at the end of the instant that changed its demand or
pool (the daemon coalesces triggers the same way, only over 0.1 s). A subnet's controller runs a
round as soon as a new request appears, but at most once per `controllerRoundSeconds`; what a
round writes reaches the nodes `allocationLatencySeconds` later.

`Simulation` wires the run's collaborators, each in its module: the `Clock`, the `Recorder`, the
`ControlPlane` (rounds), the `Fleet` (nodes, scheduler), `Cni` (ADD, DEL), the `Workload`
(deployments) and the `Autoscaler`; the objects they share are in `cns.sim.cluster`.
"""

from __future__ import annotations

import itertools
import random
from functools import partial

from cns.sim.autoscaler import Autoscaler
from cns.sim.clock import Clock, Touched
from cns.sim.cluster import DeploymentState, Level, PoolState
from cns.sim.cni import Cni
from cns.sim.control_plane import ControlPlane, new_subnet
from cns.sim.fleet import Fleet
from cns.sim.recording import Progress, Recorder, RunResult
from cns.sim.scenario import Scenario
from cns.sim.strategies import Strategy
from cns.sim.workload import Workload


class Simulation:
    """One run: build the cluster and its collaborators from the scenario, then run the clock's
    instants until the end, settling each (scheduling, then the nodes' requests) and recording."""

    def __init__(self, scenario: Scenario, strategy: Strategy, seed: int) -> None:
        self.strategy = strategy
        self.timing = scenario.timing
        self.clock = Clock(scenario.duration_seconds)
        self.touched = Touched()
        self.subnets = {
            spec.name: new_subnet(spec, scenario, strategy) for spec in scenario.subnets
        }
        for subnet in self.subnets.values():
            subnet.overflow = tuple(self.subnets[name] for name in subnet.spec.overflow)
            for other in subnet.overflow:
                other.overflow_of.append(subnet)
        self.pools = {
            spec.name: PoolState(spec, self.subnets[spec.subnet]) for spec in scenario.node_pools
        }
        self.deployments = {
            spec.name: DeploymentState(spec, spec.replicas, dict(spec.weights))
            for spec in scenario.deployments
        }
        self.record = Recorder(
            self.clock,
            sample_seconds=scenario.sample_seconds,
            subnets=self.subnets,
            pools=self.pools,
            deployments=self.deployments,
        )
        # Separate streams, so a strategy's different IP decisions do not change the workload;
        # pods and network containers draw their ids from one counter.
        ids = itertools.count(1)
        self.control = ControlPlane(
            self.clock,
            self.record,
            scenario=scenario,
            strategy=strategy,
            rng=random.Random(f"{seed}/controller"),
            ids=ids,
        )
        self.cni = Cni(self.clock, self.touched, self.record, self.timing)
        self.fleet = Fleet(
            self.pools, touched=self.touched, record=self.record, control=self.control, cni=self.cni
        )
        self.workload = Workload(
            self.deployments,
            clock=self.clock,
            touched=self.touched,
            record=self.record,
            fleet=self.fleet,
            cni=self.cni,
            rng=random.Random(f"{seed}/workload"),
            ids=ids,
        )
        self.autoscaler = Autoscaler(
            self.clock, self.touched, self.timing, fleet=self.fleet, workload=self.workload
        )
        # The ways back: rounds deliver to the nodes, started pods report to the workload, ADDs
        # join nodes to overflow subnets.
        self.control.nodes = self.fleet
        self.cni.workload = self.workload
        self.cni.lanes = self.fleet

    @property
    def cooling(self) -> Level:
        """The IPs in the reuse cooldown over the whole cluster."""
        return self.record.cooling

    def run(self, progress: Progress | None = None) -> RunResult:
        self.record.progress = progress
        self._start()
        while self.clock.run_instant():
            self._settle()
            self.record.end_of_instant()
        self.clock.now = self.clock.end
        return self.record.result(self.strategy.name)

    def _start(self) -> None:
        for pool in self.pools.values():
            for _ in range(pool.spec.initial_nodes):
                self.fleet.register_node(pool)
            if pool.spec.autoscaler is not None:
                self.autoscaler.start(pool)
        self.workload.start()
        self.record.start()
        for subnet in self.subnets.values():
            if subnet.spec.drain_at_seconds is not None:
                self.clock.at(subnet.spec.drain_at_seconds, partial(self.control.drain, subnet))

    def _settle(self) -> None:
        """End of an instant: schedule what became schedulable, then recompute touched nodes."""
        touched = self.touched
        while touched.pools or touched.nodes:
            for pool in touched.take_pools().values():
                self.fleet.schedule(pool)
            for node in touched.take_nodes().values():
                self.fleet.plan(node)


def simulate(
    scenario: Scenario,
    strategy: Strategy,
    seed: int | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Run `scenario` under `strategy`; the same seed always gives the same result."""
    return Simulation(scenario, strategy, scenario.seed if seed is None else seed).run(progress)
