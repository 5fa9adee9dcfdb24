"""Weighted division of a whole number with remainder inertia.

The subnet controller splits scarce IPs between nodes, and the simulator splits load between
members: both need whole shares that sum exactly to the total, stay within one of the exact
proportional share, and do not reshuffle the leftover units on every recomputation. The remainder
rule is Karmada's proposal (docs/design/weighted-division.md): floor shares first, then one
extra unit each to the members sorted by weight, then by what they currently hold (whoever got a
leftover unit last time keeps it), then at random among exact ties so that no name is favoured
over many divisions.
"""

from __future__ import annotations

import random
from collections.abc import Mapping


def _check(total: int, weights: Mapping[str, int], what: str) -> None:
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    for name, weight in weights.items():
        if weight < 0:
            raise ValueError(f"{what} of {name!r} must be >= 0, got {weight}")


def divide(
    total: int,
    weights: Mapping[str, int],
    current: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
) -> dict[str, int]:
    """Split `total` by `weights`; the result has exactly the keys of `weights`, in their order.

    Each member gets `floor(total * w / sum(w))`. The remainder (fewer units than there are members
    with a positive weight, since each floor drops less than one) goes one unit each to members
    sorted by weight (descending), then by `current` allocation (descending: inertia; members
    absent from `current` hold 0, names in `current` but not in `weights` are ignored), then in a
    random order among exact ties drawn from `rng`. With `rng=None` exact ties go by ascending
    name, Karmada's old behaviour: deterministic, but biased towards small names over many
    divisions, so the controller should pass an rng.

    So every share is the floor or the floor plus one of the exact share `total * w / sum(w)`
    (within 1 of it), and the shares sum to `total`. Zero-weight members get 0 and never a
    remainder unit. This is not the largest-remainder method: a heavier member gets its unit
    before a lighter one with a larger fractional part, even when its own share was whole
    (2 over 1:1:2 gives 0, 0, 2). Karmada's examples require that order (9 over 2:1:1:1 is
    4, 2, 2, 1, not 3, 2, 2, 2), and it keeps the result stable as weights change.

    Raises `ValueError` for `total < 0`, for a negative weight (naming the member), and for
    `total > 0` when no member has a positive weight (there is nobody to give the units to, and
    silently handing out fewer than `total` would break the sum). `total == 0` with all weights
    zero (or no members) gives everyone 0.
    """
    _check(total, weights, "weight")
    weight_sum = sum(weights.values())
    if weight_sum == 0:
        if total > 0:
            raise ValueError(f"cannot divide {total} among members whose weights are all zero")
        return dict.fromkeys(weights, 0)
    shares = {name: total * weight // weight_sum for name, weight in weights.items()}
    remainder = total - sum(shares.values())
    if remainder:
        held = current or {}
        order = sorted(name for name, weight in weights.items() if weight > 0)
        if rng is not None:
            rng.shuffle(order)
        # A stable sort keeps the shuffled (or name) order within exact ties.
        order.sort(key=lambda name: (-weights[name], -held.get(name, 0)))
        for name in order[:remainder]:
            shares[name] += 1
    return shares


def divide_capped(
    total: int,
    demands: Mapping[str, int],
    current: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
) -> dict[str, int]:
    """Split `total` scarce IPs among nodes by their shortfall, none above its demand.

    The result sums to `min(total, sum(demands))` and has exactly the keys of `demands`. When the
    IPs cover every demand each node gets exactly its demand (the rest stays in the subnet).
    Otherwise it is `divide(total, demands, current, rng)`, and no cap can bind, so there is
    nothing to redistribute: with `total < D = sum(demands)`, a node's exact share
    `total * d / D` is below `d`, so its floor is at most `d - 1` and floor plus one remainder
    unit is at most `d`. (A water-filling loop that caps and redistributes would never run a
    second round; the property tests check the cap.)

    Raises `ValueError` for `total < 0` and for a negative demand (naming the node).
    """
    _check(total, demands, "demand")
    if total >= sum(demands.values()):
        return dict(demands)
    return divide(total, demands, current, rng)
