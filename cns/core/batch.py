"""Utilization-aware batch size (docs/design/phase4.md): how many IPs a node asks for at a time.

The subnet controller shrinks the batch as the subnet fills, so that every node can still get one
more batch out of what is left, and grows it again as the subnet empties. A single formula would
oscillate: halving the batch releases `N * B / 2` IPs, which can drop utilization back under the
threshold that halved it. So falling utilization uses a batch one power of two smaller than rising
utilization would at the same point, which opens a band in which neither direction moves the batch.

Everything is exact integer and `Fraction` arithmetic: the thresholds are exact powers of two and a
float `log2` that lands a hair below one would change the answer. Design: docs/design/phase4.md;
docs/design/errata.md, "Phase 4" (falling utilization: one power of two *smaller*, the prose
and final formula; the code sample's "larger" never settles).
"""

from __future__ import annotations

from fractions import Fraction


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
    capacity: int, nodes: int, node_safety_factor: Fraction | int, max_batch: int | None = None
) -> None:
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    if node_safety_factor <= 0:
        raise ValueError(f"node_safety_factor must be > 0, got {node_safety_factor}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")


def static_batch(capacity: int, nodes: int, node_safety_factor: Fraction | int = 2) -> int:
    """`2**beta`, `beta = floor(log2(C / (X * N)))`: the static level distribution.

    The largest power of two `b` with `b * X * N <= C`, so that after every node took one batch
    there are still `(X - 1) * N` batches in the subnet. At least 1: a subnet too small for one IP
    per node (`beta < 0`) still hands out single IPs, first come first served.

    `nodes == 0` is computed as one node: it is the batch the first node to join would get, and it
    keeps the function continuous with `nodes == 1` instead of inventing a separate cap.
    """
    _check(capacity, nodes, node_safety_factor)
    ratio = Fraction(capacity) / (node_safety_factor * max(nodes, 1))
    return 1 if ratio < 1 else _pow2_floor(ratio)


def utilization_batch(
    capacity: int,
    nodes: int,
    reserved: int,
    falling: bool,
    node_safety_factor: Fraction | int = 2,
    max_batch: int | None = None,
    free_fraction: Fraction = Fraction(0),
) -> int:
    """The batch for utilization `U = reserved`, rising (`falling=False`) or falling.

    Rising: `2**(beta - i)` with `i = ceil(beta - log2((C - U) / N))`, i.e. the largest power of
    two `b` with `N * b <= C - U` (every node can still take one more batch), clamped to
    `[1, 2**beta]`.

    `free_fraction` is the nodes' minimum free fraction `mf`. The proposal's model has every node
    hold one batch free; a real node asks for `B * ceil(mf + p/B)`, so it holds between `mf * B`
    and `(1 + mf) * B` free, and a larger batch can take up to `(1 + mf) * b` more IPs per node.
    The room is therefore divided by `1 + mf`: without it a /22 with 29 nodes and 300 pods
    cycles 16 -> 2 -> 8 -> 16 for ever (docs/simulate.md). The default 0 is the proposal's model.

    Falling: one power of two smaller, `2**(beta - i - 1)`, so that the IPs a
    batch increase takes back do not push `U` over the threshold that had halved it.

    Clamps, all applied to the result so it is always a power of two:
    - never above `2**beta` (`static_batch`), the static level distribution. For falling
      utilization this caps the exponent `beta - i - 1` at `beta` rather than clamping `i >= 0`
      first: with plenty of room a draining subnet returns to the static level instead of
      staying at half of it forever (both settle; see `tests/test_batch.py`);
    - never below 1: `U >= C` (nothing left), `C - U < N` (not one IP per node left) and
      `beta < 0` (`C < X * N`) all give 1;
    - never above `max_batch` when given, rounded down to a power of two so the batch still
      divides the subnet evenly.

    `nodes == 0` is computed as one node, as in `static_batch`.
    """
    _check(capacity, nodes, node_safety_factor, max_batch)
    if reserved < 0:
        raise ValueError(f"reserved must be >= 0, got {reserved}")
    ceiling = static_batch(capacity, nodes, node_safety_factor)
    if max_batch is not None:
        ceiling = min(ceiling, _pow2_floor(max_batch))
    if free_fraction < 0:
        raise ValueError(f"free_fraction must be >= 0, got {free_fraction}")
    per_node_room = Fraction(capacity - reserved, max(nodes, 1)) / (1 + free_fraction)
    if per_node_room < 1:
        return 1
    batch = _pow2_floor(per_node_room)
    if falling:
        batch = max(1, batch // 2)
    return min(batch, ceiling)


def next_batch(
    capacity: int,
    nodes: int,
    reserved: int,
    previous_reserved: int,
    previous_batch: int,
    node_safety_factor: Fraction | int = 2,
    max_batch: int | None = None,
    free_fraction: Fraction = Fraction(0),
) -> int:
    """The controller's step: the direction is the sign of the last change of `U`.

    `reserved > previous_reserved` uses the rising batch, `<` the falling one. When `U` did not
    change the previous batch is kept: between the falling and the rising level either answer is
    consistent with the hysteresis, and only keeping it makes a settled controller (its last
    recomputation changed nothing, so `U` did not move) a fixed point. The kept batch is still
    clamped like any other result (a power of two in `[1, min(2**beta, max_batch)]`), since the
    node count or the capacity may have changed without `U` changing.
    """
    if previous_batch < 1:
        raise ValueError(f"previous_batch must be >= 1, got {previous_batch}")
    if reserved != previous_reserved:
        return utilization_batch(
            capacity,
            nodes,
            reserved,
            reserved < previous_reserved,
            node_safety_factor,
            max_batch,
            free_fraction,
        )
    _check(capacity, nodes, node_safety_factor, max_batch)
    ceiling = static_batch(capacity, nodes, node_safety_factor)
    if max_batch is not None:
        ceiling = min(ceiling, _pow2_floor(max_batch))
    return min(_pow2_floor(previous_batch), ceiling)


def naive_toggle_critical_nodes(
    capacity: int, upper: Fraction | int, lower: Fraction | int, b0: int, b1: int
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
