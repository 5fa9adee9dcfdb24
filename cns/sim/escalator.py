"""Node-group autoscaling as Escalator decides it: utilisation, scale-up delta, scale-down rate.

Pure functions of one scan's figures, so the simulator (and anything else that wants to predict
node counts) runs the same decision as Escalator, and property tests can check it.
Design: docs/design/escalator.md; the thresholds and removal rates follow Escalator's
node-group options (`scale_up_threshold_percent`, `taint_upper/lower_capacity_threshold_percent`,
`slow/fast_node_removal_rate`, `scale_on_starve`).

Arithmetic is exact (`Fraction`): Escalator computes in float64, where `(u - t) / t * n` can land a
hair above a whole number and ask for one node too many (7 nodes at 360 %, threshold 70: 30
instead of 29); the exact answer is the intended one.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True, slots=True, kw_only=True)
class Resources:
    """CPU and memory: pod requests, a node's allocatable capacity, or their sums."""

    cpu_milli: int = 0
    memory_bytes: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            cpu_milli=self.cpu_milli + other.cpu_milli,
            memory_bytes=self.memory_bytes + other.memory_bytes,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            cpu_milli=self.cpu_milli - other.cpu_milli,
            memory_bytes=self.memory_bytes - other.memory_bytes,
        )

    def times(self, count: int) -> Resources:
        return Resources(cpu_milli=self.cpu_milli * count, memory_bytes=self.memory_bytes * count)

    def fits_in(self, other: Resources) -> bool:
        return self.cpu_milli <= other.cpu_milli and self.memory_bytes <= other.memory_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroupOptions:
    """One node group's scaling options (Escalator's names, in camelCase in scenario files).

    Slack is what `scale_up_threshold_percent` leaves free: at 70 the group is kept at most 70 %
    requested, so 30 % of its capacity absorbs a burst while new nodes boot.
    """

    min_nodes: int = 0
    max_nodes: int = 100
    scale_up_threshold_percent: int = 70
    taint_upper_capacity_threshold_percent: int = 40
    taint_lower_capacity_threshold_percent: int = 10
    slow_node_removal_rate: int = 1
    fast_node_removal_rate: int = 2
    scale_on_starve: bool = False

    def problems(self) -> list[str]:
        """Field-named reasons why these options cannot be used; empty when they are valid."""
        found = []
        if self.min_nodes < 0:
            found.append(f"minNodes must be >= 0, got {self.min_nodes}")
        if self.max_nodes < max(self.min_nodes, 1):
            found.append(f"maxNodes must be >= max(minNodes, 1), got {self.max_nodes}")
        if self.scale_up_threshold_percent < 1:
            found.append(
                f"scaleUpThresholdPercent must be >= 1, got {self.scale_up_threshold_percent}"
            )
        lower = self.taint_lower_capacity_threshold_percent
        upper = self.taint_upper_capacity_threshold_percent
        if not 0 <= lower <= upper:
            found.append(
                "taintLowerCapacityThresholdPercent must be in "
                f"0..taintUpperCapacityThresholdPercent, got {lower}"
            )
        if upper >= self.scale_up_threshold_percent:
            found.append(
                "taintUpperCapacityThresholdPercent must be below scaleUpThresholdPercent "
                f"(else a group could be scaled up and down at once), got {upper}"
            )
        if self.slow_node_removal_rate < 0 or self.fast_node_removal_rate < 0:
            found.append("slowNodeRemovalRate and fastNodeRemovalRate must be >= 0")
        if self.slow_node_removal_rate > self.fast_node_removal_rate:
            # As Escalator requires: else a busier group (slow removal) would shrink faster
            # than an idle one (fast removal).
            found.append(
                "slowNodeRemovalRate must be <= fastNodeRemovalRate, got "
                f"{self.slow_node_removal_rate} > {self.fast_node_removal_rate}"
            )
        return found


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def utilization_percent(requests: Resources, *, capacity: Resources) -> Fraction | None:
    """The higher of CPU and memory requests over capacity, in percent (250 % is possible).

    None when the group has no capacity but something is requested: Escalator's "scale up from
    zero" case (it uses math.MaxFloat64 as the utilisation). Nothing requested of nothing is 0 %.
    """
    if capacity.cpu_milli <= 0 or capacity.memory_bytes <= 0:
        if requests.cpu_milli > 0 or requests.memory_bytes > 0:
            return None
        return Fraction(0)
    return max(
        Fraction(100 * requests.cpu_milli, capacity.cpu_milli),
        Fraction(100 * requests.memory_bytes, capacity.memory_bytes),
    )


def scale_up_delta(nodes: int, utilization: Fraction, threshold_percent: int) -> int:
    """`ceil(nodes * (util - threshold) / threshold)`: nodes to add to get back under threshold.

    With identical nodes this is the fewest nodes that bring `requests / capacity` to at most the
    threshold: `n + d >= n * util / threshold`. Never negative (under the threshold: 0).
    """
    if threshold_percent < 1:
        raise ValueError(f"threshold_percent must be >= 1, got {threshold_percent}")
    return max(0, _ceil(nodes * (utilization - threshold_percent) / threshold_percent))


def scale_up_from_zero(
    requests: Resources, *, cached_node_capacity: Resources | None, threshold_percent: int
) -> int:
    """Nodes for an empty group: `ceil(requests / node capacity / threshold * 100)`, else 1.

    The node capacity is the one Escalator cached from the last node it saw; right after it
    starts it has none, and adds a single node to learn it.
    """
    if threshold_percent < 1:
        raise ValueError(f"threshold_percent must be >= 1, got {threshold_percent}")
    cache = cached_node_capacity
    if cache is None or cache.cpu_milli <= 0 or cache.memory_bytes <= 0:
        return 1
    return max(
        _ceil(Fraction(100 * requests.cpu_milli, cache.cpu_milli * threshold_percent)),
        _ceil(Fraction(100 * requests.memory_bytes, cache.memory_bytes * threshold_percent)),
    )


def is_starving(largest_pending: Resources | None, *, largest_available: Resources) -> bool:
    """A pending pod asks for more CPU, or more memory, than any untainted node has free.

    `largest_pending` holds the largest CPU and the largest memory request among the pods that
    could not be scheduled (None: there are none), `largest_available` the most free CPU and the
    most free memory on any untainted node. Such a pod may never fit however low the group's
    utilisation is, which is what `scale_on_starve` is for.
    """
    if largest_pending is None:
        return False
    return (
        largest_pending.cpu_milli > largest_available.cpu_milli
        or largest_pending.memory_bytes > largest_available.memory_bytes
    )


def nodes_delta(
    options: NodeGroupOptions,
    *,
    nodes: int,
    tainted: int,
    requests: Resources,
    node_capacity: Resources,
    cached_node_capacity: Resources | None,
    starving: bool,
) -> int:
    """One scan's decision: nodes to add (> 0, tainted ones are untainted first) or to taint (< 0).

    `nodes` counts every node of the group, tainted ones included; capacity is that of the
    `nodes - tainted` untainted ones, each `node_capacity`. In order:
    - fewer untainted nodes than `min_nodes`: add the difference;
    - utilisation below the lower taint threshold: taint `fast_node_removal_rate` nodes, below
      the upper one `slow_node_removal_rate`; above `scale_up_threshold_percent`: add
      `scale_up_delta` (from zero: `scale_up_from_zero`);
    - `scale_on_starve` and a starving pod: add at least one.
    Then clamped: never more untainted nodes than `max_nodes`, never fewer than `min_nodes`.
    """
    untainted = nodes - tainted
    if not 0 <= tainted <= nodes:
        raise ValueError(f"tainted must be in 0..nodes, got {tainted} of {nodes}")
    if untainted < options.min_nodes:
        delta = options.min_nodes - untainted
    else:
        capacity = node_capacity.times(untainted)
        utilization = utilization_percent(requests, capacity=capacity)
        threshold = options.scale_up_threshold_percent
        if utilization is None:
            delta = scale_up_from_zero(
                requests, cached_node_capacity=cached_node_capacity, threshold_percent=threshold
            )
        elif utilization < options.taint_lower_capacity_threshold_percent:
            delta = -options.fast_node_removal_rate
        elif utilization < options.taint_upper_capacity_threshold_percent:
            delta = -options.slow_node_removal_rate
        elif utilization > threshold:
            delta = scale_up_delta(untainted, utilization, threshold)
        else:
            delta = 0
        if options.scale_on_starve and starving:
            delta = max(delta, 1)
    if delta > 0:
        return max(0, min(delta, options.max_nodes - untainted))
    return -min(-delta, max(0, untainted - options.min_nodes))
