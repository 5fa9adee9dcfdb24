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
from cns.sim.engine import simulate
from cns.sim.escalator import Resources
from cns.sim.recording import RunResult
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
    uneven: bool = False,
) -> Scenario:
    """`nodes` nodes on one subnet, `pods` pods from START_SECONDS on, and from each
    `(at_seconds, count)` of `changes` on, `count` pods.

    The scheduler spreads pods evenly (within one). `uneven` puts half the pods on a quarter of
    the nodes (pool `dense`, at least one node) and half on the rest (pool `nodes`), so that a
    dense node holds about three times the pods of another and the nodes' requests differ
    (`dense_nodes` and `most_pods` say how many nodes and pods that is).
    """
    scaler = scaler or Scaler()
    dense = dense_nodes(nodes) if uneven else 0
    sizes = ((("dense", dense),) if dense else ()) + (("nodes", nodes - dense),)
    pools = tuple(
        NodePoolSpec(name=name, subnet="pods", node=BIG_NODE, initial_nodes=size, autoscaler=None)
        for name, size in sizes
    )
    return Scenario(
        name=f"{cidr} x {nodes} nodes" + (" (uneven)" if uneven else ""),
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
        node_pools=pools,
        deployments=(
            DeploymentSpec(
                name="app",
                pod=SMALL_POD,
                replicas=pods,
                weights={pool.name: 1 for pool in pools},
                start_seconds=START_SECONDS,
                changes=tuple(DeploymentChange(at, replicas=count) for at, count in changes),
            ),
        ),
        scaler=scaler,
        timing=Timing(),
        sample_seconds=duration_seconds,
    )


def dense_nodes(nodes: int) -> int:
    """The nodes of the `dense` pool of an uneven `fixed_pool`: a quarter, at least one, and
    never all of them."""
    if nodes < 2:
        raise ValueError(f"an uneven spread needs at least 2 nodes, got {nodes}")
    return max(1, nodes // 4)


def most_pods(nodes: int, *, uneven: bool = False) -> int:
    """The most pods a `fixed_pool` can schedule: `maxPods` a node, and with an uneven spread
    twice what the dense pool holds (it gets half of them)."""
    if uneven:
        return 2 * dense_nodes(nodes) * BIG_NODE.max_pods
    return nodes * BIG_NODE.max_pods


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
