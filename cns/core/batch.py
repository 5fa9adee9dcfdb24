"""Utilization-aware batch size (docs/design/phase4.md): how many IPs a node asks for at a time.

The subnet controller shrinks the batch as the subnet fills, so that every node can still get one
more batch out of what is left, and grows it again as the subnet empties. Sizing it from the
utilization and the direction it last moved cycles with the nodes' real requests (a larger batch
can take more than one batch per node, so the batch chosen after the nodes took their IPs differs
from the one they took them for). The rule here is hysteresis on what the nodes hold instead;
docs/design/phase4.md derives it, argues why it settles and says what it gives up:

- keep the current batch `b` while what is held still leaves every node one more batch,
  `N * b <= C - U`;
- shrink when it does not, to the largest batch that fits what is held now; a smaller batch
  never makes a node ask for more, so that batch goes on fitting;
- grow only to a batch `b'` that fits even if every node goes on to hold the most its request can
  keep at `b'` (`most_free`) on top of what it holds now: `N * (b' + most_free(b')) <= C - U`.
  Then what the nodes hold after growing still fits, and the batch is kept.

With the pods steady and holding their IPs the batch shrinks at most once, then only grows, at
most once per power of two below the cap, and stops.

Everything is exact integer and `Fraction` arithmetic: the thresholds are exact powers of two and a
float `log2` that lands a hair below one would change the answer.
"""

from __future__ import annotations

from fractions import Fraction
from functools import partial

from cns.core.scaling import release_threshold
from cns.core.types import Scaler


def _pow2_floor(value: Fraction | int) -> int:
    """The largest power of two `<= value`, for `value >= 1`.

    Powers of two are integers, so `2**k <= value` exactly when `2**k <= floor(value)`: the bit
    length of the floor gives the exponent with no logarithm at all.
    """
    whole = value if isinstance(value, int) else value.numerator // value.denominator
    if whole < 1:
        raise ValueError(f"no power of two <= {value}")
    return 1 << (whole.bit_length() - 1)


def _check(
    *, capacity: int, nodes: int, node_safety_factor: Fraction | int, max_batch: int | None = None
) -> None:
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    if node_safety_factor <= 0:
        raise ValueError(f"node_safety_factor must be > 0, got {node_safety_factor}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")


def static_batch(*, capacity: int, nodes: int, node_safety_factor: Fraction | int = 2) -> int:
    """`2**beta`, `beta = floor(log2(C / (X * N)))`: the static level distribution.

    The largest power of two `b` with `b * X * N <= C`, so that after every node took one batch
    there are still `(X - 1) * N` batches in the subnet. At least 1: a subnet too small for one IP
    per node (`beta < 0`) still hands out single IPs, first come first served.

    `nodes == 0` is computed as one node: it is the batch the first node to join would get, and it
    keeps the function continuous with `nodes == 1` instead of inventing a separate cap.
    """
    _check(capacity=capacity, nodes=nodes, node_safety_factor=node_safety_factor)
    ratio = Fraction(capacity) / (node_safety_factor * max(nodes, 1))
    return 1 if ratio < 1 else _pow2_floor(ratio)


def _ceiling(
    *, capacity: int, nodes: int, node_safety_factor: Fraction | int, max_batch: int | None
) -> int:
    """The largest batch allowed at all: the static level, capped by `max_batch` rounded down to
    a power of two (so the batch still divides the subnet evenly)."""
    _check(
        capacity=capacity, nodes=nodes, node_safety_factor=node_safety_factor, max_batch=max_batch
    )
    ceiling = static_batch(capacity=capacity, nodes=nodes, node_safety_factor=node_safety_factor)
    return ceiling if max_batch is None else min(ceiling, _pow2_floor(max_batch))


def utilization_batch(
    *,
    capacity: int,
    nodes: int,
    reserved: int,
    node_safety_factor: Fraction | int = 2,
    max_batch: int | None = None,
) -> int:
    """The largest batch that leaves every node one more batch of what is free now.

    The proposal's formula for rising utilization, `2**(beta - i)` with
    `i = ceil(beta - log2((C - U) / N))`: the largest power of two `b` with `N * b <= C - U`,
    clamped to `[1, ceiling]` (the static level `static_batch`, and `max_batch` rounded down to
    a power of two). `U >= C` (nothing left), `C - U < N` (not one IP per node left) and
    `beta < 0` (`C < X * N`) all give 1. `nodes == 0` is computed as one node.
    """
    ceiling = _ceiling(
        capacity=capacity, nodes=nodes, node_safety_factor=node_safety_factor, max_batch=max_batch
    )
    if reserved < 0:
        raise ValueError(f"reserved must be >= 0, got {reserved}")
    per_node_room = Fraction(capacity - reserved, max(nodes, 1))
    if per_node_room < 1:
        return 1
    return min(_pow2_floor(per_node_room), ceiling)


def most_free(
    batch: int,
    *,
    request_threshold_percent: int,
    release_threshold_percent: int,
    min_ip_count: int = 0,
) -> int:
    """The most free secondary IPs a node's request keeps at `batch`: its release threshold,
    or its warm floor if that is more.

    A node's request (`cns.core.scaling.next_request`) is either its target, which leaves fewer
    than `max((1 + mf) * b, b + 1)` free, or the request it already had, kept only while no more
    than the release threshold `max(ceil(Mf * b), b + 1)` is free (`Mf >= 1 + mf`). A warm floor
    `minIPCount` raises the target to whole batches covering it and the primary IPs, at most
    `minIPCount + b - 1` secondary IPs, all free when the node has no pods. So whatever a node
    held before, once it has planned at `batch` it holds at most its used IPs plus this.
    """
    scaler = Scaler(
        batch_size=batch,
        request_threshold_percent=request_threshold_percent,
        release_threshold_percent=release_threshold_percent,
    )
    threshold = release_threshold(scaler, exhausted=False)
    return max(threshold, min_ip_count + batch - 1) if min_ip_count else threshold


def next_batch(
    *,
    capacity: int,
    nodes: int,
    reserved: int,
    previous_batch: int,
    node_safety_factor: Fraction | int = 2,
    max_batch: int | None = None,
    request_threshold_percent: int = 50,
    release_threshold_percent: int = 150,
    min_ip_count: int = 0,
) -> int:
    """The controller's step: the batch for reserved `U`, given the batch in force.

    Inputs are what a controller knows: the capacity C, the node count N, the IPs held U
    (primaries and secondaries), the batch it published last, and the nodes' scaler thresholds
    (`requestThresholdPercent` mf, `releaseThresholdPercent` Mf, `minIPCount`). The previous
    batch is first
    clamped like any result (a power of two in `[1, ceiling]`), since N or C may have changed.

    - **Shrink** when `N * b > C - U`: the nodes' holdings no longer leave every node one more
      batch. The answer is `utilization_batch`, the largest `b'` with `N * b' <= C - U`. After a
      shrink no node holds more than before (a coarser batch never aligns a request lower), so
      `U` does not grow and `b'` keeps fitting.
    - **Grow** to the largest `b' <= ceiling` with `N * (b' + most_free(b')) <= C - U`. Each node
      holds at least its used IPs now, and at `b'` holds at most its used IPs plus
      `most_free(b')`, so `U` can rise by at most `N * most_free(b')`: `b'` still fits after the
      nodes took their IPs, and is kept.
    - **Keep** `b` otherwise. Between the two thresholds nothing moves the batch, whichever way
      `U` last moved; that band is what makes a steady state a fixed point.

    The price of settling is the band: after a drain the batch grows back only once the subnet
    has room for the larger batch's worst case, not at the first moment it would fit on average
    (docs/design/phase4.md: the argument, its assumptions, and what the rule gives up).
    """
    if previous_batch < 1:
        raise ValueError(f"previous_batch must be >= 1, got {previous_batch}")
    ceiling = _ceiling(
        capacity=capacity, nodes=nodes, node_safety_factor=node_safety_factor, max_batch=max_batch
    )
    if reserved < 0:
        raise ValueError(f"reserved must be >= 0, got {reserved}")
    batch = min(_pow2_floor(previous_batch), ceiling)
    count = max(nodes, 1)
    room = capacity - reserved
    if count * batch > room:
        return utilization_batch(
            capacity=capacity,
            nodes=nodes,
            reserved=reserved,
            node_safety_factor=node_safety_factor,
            max_batch=max_batch,
        )
    kept = partial(
        most_free,
        request_threshold_percent=request_threshold_percent,
        release_threshold_percent=release_threshold_percent,
        min_ip_count=min_ip_count,
    )
    while batch < ceiling and count * (2 * batch + kept(2 * batch)) <= room:
        batch *= 2
    return batch


def naive_toggle_critical_nodes(
    *, capacity: int, upper: Fraction | int, lower: Fraction | int, b0: int, b1: int
) -> Fraction:
    """`C * (Tu - Tl) / (B0 - B1)`: from this node count on, the naive toggle oscillates.

    The naive scheme sets the batch to `b1` above the `upper` threshold and back to `b0` below
    `lower` (fractions of the capacity, e.g. `Fraction(9, 10)`; use `Fraction(percent, 100)` for
    the scaler's percents). Switching frees `N * (b0 - b1)` IPs; once that exceeds the gap
    `C * (upper - lower)` between the thresholds, exhaustion clears itself and comes back. A /22
    at 90 %/50 % with 16 -> 1 gives 27.3: 28 nodes or more oscillate.
    """
    if b0 <= b1:
        raise ValueError(f"b0 must be > b1 (the toggle must free IPs), got {b0} and {b1}")
    if upper < lower:
        raise ValueError(f"upper must be >= lower, got {upper} and {lower}")
    return Fraction(capacity) * (Fraction(upper) - Fraction(lower)) / (b0 - b1)
