"""Pool sizing math: the idempotent target and subnet exhaustion.

Everything here is a pure function of its arguments, so the daemon, the reference control plane
and the simulator share one implementation, and property tests can explore it exhaustively.
Design: docs/design/pool-scaling.md; the phases (1-2, 1-3) are those of
docs/design/subnet-scarcity.md.
"""

from __future__ import annotations

from fractions import Fraction

from cns.core.types import Scaler


def effective_batch(scaler: Scaler, exhausted: bool) -> int:
    """Batch 1 while the subnet is exhausted (phase 1-3), else the scaler's batch."""
    return 1 if exhausted else scaler.batch_size


def min_free_fraction(scaler: Scaler) -> Fraction:
    """`mf`, exact, so that `ceil(mf + U/B)` never suffers float rounding."""
    return Fraction(scaler.request_threshold_percent, 100)


def max_free_fraction(scaler: Scaler) -> Fraction:
    """`Mf`; never below `mf + 1`, the bound under which scaling cannot oscillate."""
    return max(Fraction(scaler.release_threshold_percent, 100), min_free_fraction(scaler) + 1)


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def target_request(scaler: Scaler, demand: int, primary_ip_count: int, exhausted: bool) -> int:
    """The secondary IP count the node should hold: `B * ceil(mf + U/B) - primaryIPCount`.

    `demand` (U) is assigned IPs plus ADDs waiting for one. Three clamps, in this order:
    at least one free secondary IP after the primary deduction, rounded up to whole batches (so a
    pod never waits because of the deduction, and under exhaustion batch 1 keeps one free IP);
    at least `minIPCount` secondary IPs, rounded up to whole batches (the warm floor, so the
    first pods of a new node never wait; dropped while the subnet is exhausted, where the one
    free IP is the floor); and the node's total never above `maxIPCount`.
    """
    batch = effective_batch(scaler, exhausted)
    floor = 0 if exhausted else scaler.min_ip_count
    batches = max(
        _ceil(min_free_fraction(scaler) + Fraction(demand, batch)),
        _ceil(Fraction(demand + 1 + primary_ip_count, batch)),
        _ceil(Fraction(floor + primary_ip_count, batch)),
    )
    wanted = batch * batches - primary_ip_count
    return max(0, min(wanted, scaler.max_ip_count - primary_ip_count))


def is_settled(scaler: Scaler, requested: int, primary_ip_count: int, exhausted: bool) -> bool:
    """True when the node's total is a whole number of batches or exactly `maxIPCount`."""
    total = requested + primary_ip_count
    return total == scaler.max_ip_count or total % effective_batch(scaler, exhausted) == 0


def release_threshold(scaler: Scaler, exhausted: bool) -> int:
    """Free IPs above which the pool shrinks: `Mf * B` rounded up, and at least `B + 1`.

    One more demand raises the target by at most one batch, or by one batch plus the one free IP
    the floor keeps; a threshold below that would release what the last pod just made us ask
    for, and a pod coming and going would flap the request (batch 1 under exhaustion included).
    """
    batch = effective_batch(scaler, exhausted)
    return max(_ceil(max_free_fraction(scaler) * batch), batch + 1)


def next_request(
    scaler: Scaler, *, current: int, demand: int, primary_ip_count: int, exhausted: bool
) -> int:
    """The request to send, given the one already sent: the target, with release hysteresis.

    Grow to the target as soon as it exceeds `current`. Shrink to it only when the free IPs
    (`current - U`) exceed `Mf * B`, so a pod coming and going at a batch boundary does not make
    the pool grow and shrink each time. A `current` that is neither batch-aligned nor at
    `maxIPCount` (the batch changed), or is above `maxIPCount`, is replaced by the target at
    once. Applying this twice without new demand gives the same answer: it is a fixed point.
    """
    target = target_request(scaler, demand, primary_ip_count, exhausted)
    if target >= current:
        return target
    over_max = current + primary_ip_count > scaler.max_ip_count
    misaligned = not is_settled(scaler, current, primary_ip_count, exhausted)
    too_many_free = current - demand > release_threshold(scaler, exhausted)
    if over_max or too_many_free or misaligned:
        return target
    return current


def next_exhausted(
    exhausted: bool, reserved: int, capacity: int, upper_percent: int, lower_percent: int
) -> bool:
    """Exhaustion with hysteresis (phase 1-2): set above the upper, cleared below the lower.

    The proposal's rule, on its own: it flaps whenever what the nodes take back once exhaustion
    clears is more than the band between the thresholds (`exhaustion_after` adds the check
    that prevents it)."""
    if capacity <= 0:
        return True
    if not exhausted and reserved * 100 > upper_percent * capacity:
        return True
    if exhausted and reserved * 100 < lower_percent * capacity:
        return False
    return exhausted


def reserved_once_cleared(scaler: Scaler, requested: int, primary_ip_count: int) -> int:
    """The addresses a node will hold once exhaustion clears, from the request it sends now.

    While exhausted, a node asks for `U + 1` secondary IPs (batch 1, no floor, one free IP) and
    keeps at most its release threshold for batch 1 above `U`, so `requested - 1` is at least
    its demand; a node still asking at the batch of before (it has not heard of the exhaustion
    yet) asks for more, and is counted for more. Its target out of exhaustion is monotone in
    the demand, so this is never less than what it will take: its batch, its warm floor, and
    its primary IPs, which count as reserved too. A request at `maxIPCount` stays there.
    """
    demand = max(0, requested - 1)
    return primary_ip_count + target_request(scaler, demand, primary_ip_count, exhausted=False)


def exhaustion_after(
    exhausted: bool,
    *,
    reserved: int,
    once_cleared: int,
    capacity: int,
    upper_percent: int,
    lower_percent: int,
) -> bool:
    """`next_exhausted`, clearing only when what the nodes take back cannot set it again.

    Clearing gives the nodes back their batch and their warm floor; if the addresses they then
    hold (`once_cleared`, the sum of `reserved_once_cleared` over the nodes) are above the upper
    threshold, the subnet would be exhausted again a round trip later, and the nodes would
    drop and restore their pools for as long as their demand stays (the floor alone on idle
    nodes, or a toggle past its critical node count). Such a subnet stays exhausted until the
    demand falls far enough; with nothing changing, exhaustion changes at most once.
    """
    new = next_exhausted(exhausted, reserved, capacity, upper_percent, lower_percent)
    if exhausted and not new and once_cleared * 100 > upper_percent * capacity:
        return True
    return new
