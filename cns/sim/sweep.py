"""Many small simulations over a grid: where the exhaustion toggle oscillates, and the proposal's
prediction to compare with (`naive_toggle_critical_nodes`; docs/design/errata.md, "The toggle's
critical node count").

The scenarios are minimal on purpose: one subnet, one fixed pool of nodes too large to limit
pods, one deployment. Whatever oscillates here does so because of the IP strategy alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cns.core.types import Scaler
from cns.sim.engine import RunResult, simulate
from cns.sim.escalator import Resources
from cns.sim.scenario import (
    DeploymentChange,
    DeploymentSpec,
    NodePoolSpec,
    NodeShape,
    Scenario,
    SubnetSpec,
    Timing,
)
from cns.sim.strategies import Strategy

BIG_NODE = NodeShape(Resources(cpu_milli=256_000, memory_bytes=1 << 40), max_pods=249)
SMALL_POD = Resources(cpu_milli=10, memory_bytes=1 << 20)
START_SECONDS = 30.0  # the nodes have their network containers by then


def fixed_pool(
    cidr: str,
    *,
    nodes: int,
    pods: int,
    duration_seconds: float,
    changes: Sequence[tuple[float, int]] = (),
    scaler: Scaler | None = None,
    upper_percent: int = 90,
    lower_percent: int = 50,
) -> Scenario:
    """`nodes` nodes on one subnet, `pods` pods from START_SECONDS on, and from each
    `(at_seconds, count)` of `changes` on, `count` pods."""
    scaler = scaler or Scaler()
    return Scenario(
        name=f"{cidr} x {nodes} nodes",
        duration_seconds=duration_seconds,
        subnets=(
            SubnetSpec(
                name="pods",
                cidr=cidr,
                upper_percent=upper_percent,
                lower_percent=lower_percent,
                max_batch=scaler.batch_size,
            ),
        ),
        node_pools=(
            NodePoolSpec(
                name="nodes", subnet="pods", node=BIG_NODE, initial_nodes=nodes, autoscaler=None
            ),
        ),
        deployments=(
            DeploymentSpec(
                name="app",
                pod=SMALL_POD,
                replicas=pods,
                weights={"nodes": 1},
                start_seconds=START_SECONDS,
                changes=tuple(DeploymentChange(at, replicas=count) for at, count in changes),
            ),
        ),
        scaler=scaler,
        timing=Timing(),
        sample_seconds=duration_seconds,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Steady:
    """How a strategy behaves with a constant pod count, after the start-up has passed."""

    nodes: int
    pods: int
    flips: int  # exhaustion flips in the second half of the run
    batch_changes: int  # batch-size changes in the second half
    result: RunResult

    @property
    def oscillates(self) -> bool:
        """Flipping back and forth with nothing changing: at least one flip there and back."""
        return self.flips >= 2


def steady(
    strategy: Strategy, cidr: str, *, nodes: int, pods: int, duration_seconds: float = 480.0
) -> Steady:
    """Run `pods` pods on `nodes` nodes, and count what still changes in the second half."""
    result = simulate(
        fixed_pool(cidr, nodes=nodes, pods=pods, duration_seconds=duration_seconds), strategy
    )
    half = duration_seconds / 2
    return Steady(
        nodes=nodes,
        pods=pods,
        flips=sum(1 for t in result.flip_times if t >= half),
        batch_changes=sum(1 for t in result.batch_change_times if t >= half),
        result=result,
    )
