"""Each subnet's control plane: the controller's own `plan_round` over the subnet's
`SubnetModel`, run as soon as a node publishes a new request but at most once per
`controllerRoundSeconds`; what a round writes reaches the nodes `allocationLatencySeconds` later.
A subnet set draining (`drainAtSeconds`) plans from then on as the controller plans a ClusterSubnet
with `spec.draining`: it grants nothing."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from functools import partial
from typing import Protocol

from cns.core.subnet import Subnet
from cns.core.subnet_model import SubnetModel
from cns.core.subnet_plan import plan_round
from cns.core.types import NetworkContainer, Scaler, SubnetStatus
from cns.sim.clock import Clock
from cns.sim.cluster import Lane, SimulatedSubnet
from cns.sim.recording import Recorder
from cns.sim.scenario import Scenario, SubnetSpec
from cns.sim.strategies import Strategy


def new_subnet(spec: SubnetSpec, scenario: Scenario, strategy: Strategy) -> SimulatedSubnet:
    """The subnet with its controller's model, its nodes to use what the strategy makes of the
    empty status."""
    subnet = Subnet(
        name=spec.name,
        cidr=spec.cidr,
        upper_percent=spec.upper_percent,
        lower_percent=spec.lower_percent,
        node_safety_factor=spec.node_safety_factor,
        max_batch=spec.max_batch,
        reserved_ips=frozenset(spec.reserved_ips),
        request_threshold_percent=scenario.scaler.request_threshold_percent,
        release_threshold_percent=scenario.scaler.release_threshold_percent,
        min_ip_count=scenario.scaler.min_ip_count,
        max_ip_count=scenario.scaler.max_ip_count,
    )
    status = SubnetStatus()
    scaler, exhausted = strategy.node_settings(scenario.scaler, status)
    state = SimulatedSubnet(spec, subnet, scaler, exhausted, status)
    state.model = SubnetModel(subnet)
    return state


class Deliveries(Protocol):
    """The node side, which receives what a round wrote once the allocation latency passed."""

    def deliver_settings(self, subnet: SimulatedSubnet, scaler: Scaler, exhausted: bool) -> None:
        """The subnet's scaler and exhaustion reach its nodes."""

    def deliver_nc(self, lane: Lane, nc: NetworkContainer) -> None:
        """A node's network container of the lane's subnet reaches it."""

    def deliver_exhaustion(self, subnet: SimulatedSubnet, exhausted: bool) -> None:
        """The subnet's exhausted state (its ClusterSubnetState) reaches the nodes that decide
        overflow with it."""

    def deliver_draining(self, subnet: SimulatedSubnet) -> None:
        """The nodes see the subnet's ClusterSubnet set draining."""


class ControlPlane:
    """Runs the subnets' rounds. `nodes` (the fleet) is connected once it exists, since the
    fleet in turn asks for rounds."""

    nodes: Deliveries

    def __init__(
        self,
        clock: Clock,
        record: Recorder,
        *,
        scenario: Scenario,
        strategy: Strategy,
        rng: random.Random,
        ids: itertools.count[int],
    ) -> None:
        self.clock = clock
        self.record = record
        self.scenario = scenario
        self.strategy = strategy
        self.rng = rng
        self.ids = ids
        self.timing = scenario.timing

    def _new_id(self) -> str:
        return str(next(self.ids))

    def request_round(self, subnet: SimulatedSubnet) -> None:
        if subnet.round_at is None:
            subnet.round_at = max(
                self.clock.now, subnet.last_round + self.timing.controller_round_seconds
            )
            self.clock.at(subnet.round_at, partial(self.round, subnet))

    def drain(self, subnet: SimulatedSubnet) -> None:
        """`spec.draining` is set: the controller grants nothing more from the subnet, its next
        round takes back what nodes give up, and the nodes (watching the ClusterSubnet as the
        controller does) see it at once."""
        subnet.subnet = replace(subnet.subnet, draining=True)
        subnet.model.subnet = subnet.subnet
        self.request_round(subnet)
        self.nodes.deliver_draining(subnet)

    def round(self, subnet: SimulatedSubnet) -> None:
        """One controller round (`plan_round`, over the nodes that changed); its writes reach
        the nodes after the allocation latency."""
        now = self.clock.now
        subnet.round_at = None
        subnet.last_round = now
        subnet.rounds += 1
        subnet.round_times.append(now)
        previous = subnet.status
        model = subnet.model
        changed = model.take_changed()
        plan = plan_round(
            model,
            changed=changed,
            previous=previous,
            rng=self.rng,
            new_id=self._new_id,
            current_uids=dict.fromkeys(subnet.gone),  # deleted with their Node:
            nodes_gone=subnet.gone,  # their addresses are free
        )
        model.apply(plan.record)
        subnet.gone.clear()
        subnet.status = plan.status
        arrival = now + self.timing.allocation_latency_seconds
        if plan.status.exhausted != previous.exhausted:
            subnet.exhaustion_flips += 1
            self.record.flip_times.append(now)
            self._flipped(subnet)
        scaler, exhausted = self.strategy.node_settings(self.scenario.scaler, plan.status)
        if (scaler, exhausted) != (subnet.scaler, subnet.exhausted):
            old_batch = subnet.effective_batch
            subnet.scaler, subnet.exhausted = scaler, exhausted
            if subnet.effective_batch != old_batch:
                subnet.batch_changes += 1
                subnet.batch_change_times.append(now)
                self.record.batch_change_times.append(now)
            self.clock.at(arrival, partial(self.nodes.deliver_settings, subnet, scaler, exhausted))
        for name, nc in plan.changed.items():
            subnet.ncs[name] = nc
            subnet.publish_view(name)
            self.clock.at(arrival, partial(self.nodes.deliver_nc, subnet.lanes[name], nc))
        if subnet.watched and plan.status.exhausted != previous.exhausted:
            # After the containers: a node uses the addresses it is given before sending pods on.
            self.clock.at(
                arrival, partial(self.nodes.deliver_exhaustion, subnet, plan.status.exhausted)
            )
        model.settle(changed)
        secondary = plan.status.reserved - len(subnet.ncs)
        self.record.unused_changed(subnet, secondary - subnet.reserved_secondary)
        subnet.reserved_level.add(now, plan.status.reserved - subnet.reserved)
        subnet.reserved, subnet.reserved_secondary = plan.status.reserved, secondary
        subnet.peak_utilization = max(subnet.peak_utilization, subnet.utilization)
        # Released addresses are grantable from the next round on; a node left without a
        # network container (no address even for its primary) is retried too.
        if (plan.released and plan.short_of) or len(subnet.ncs) < len(subnet.names):
            self.request_round(subnet)

    @staticmethod
    def _flipped(subnet: SimulatedSubnet) -> None:
        """An exhaustion flip that undoes the previous one with the subnet's pods and nodes
        unchanged in between is the strategy reacting to itself: an oscillation. The fewest
        nodes at which one happened is the critical node count a toggle study measures."""
        now = (len(subnet.names), subnet.pod_events)
        if now == subnet.last_flip:
            nodes = now[0]
            subnet.critical_nodes = min(nodes, subnet.critical_nodes or nodes)
        subnet.last_flip = now
