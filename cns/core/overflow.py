"""Overflow: where a node's pods go when its primary subnet is full, and what it asks for ahead.

A ClusterSubnet may name overflow subnets (`spec.overflow`, in order). A pod whose ADD draws
from the node's primary subnet takes its address from the first of them with room when, and
only when, both hold:

- the primary subnet is exhausted (its ClusterSubnetState, which the controller sets at
  `upperPercent` of the subnet reserved and clears only at `lowerPercent`: the hysteresis that
  keeps nodes from flapping between subnets as the primary's use crosses one line), and
- the node's primary lane has no free address beyond those promised to ADDs queued earlier
  (an address the node already holds is always used first), or the primary is draining (its
  free addresses go back, none is handed out).

A pod keeps the address it got for life; the choice is made once, at its ADD. Pods that
overflowed count in the overflow subnet's demand, not the primary's (`primary_demand`,
`overflow_demand`), so no address is asked for twice. While the gate is open, the pods the
primary lane cannot serve with what it holds are counted in the first overflow subnet's demand
before their ADDs come (`spill`), so those ADDs find addresses there rather than waiting a whole
round trip.

Pure and synchronous: the node (cns/node) and the simulator (cns/sim) both decide with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# At most this many overflow subnets per ClusterSubnet (the CRD says the same).
MAX_OVERFLOW_SUBNETS = 4


@dataclass(frozen=True, slots=True)
class OverflowCandidate:
    """One overflow subnet as the node sees it."""

    name: str
    exhausted: bool = False  # its own ClusterSubnetState
    draining: bool = False  # its ClusterSubnet's spec.draining
    removed: bool = False  # the node's lane of it was removed (the control plane dropped it)
    usable: bool = True  # its family is the primary subnet's (else never a pod's)

    @property
    def has_room(self) -> bool:
        return self.usable and not (self.exhausted or self.draining or self.removed)


def overflow_open(*, primary_exhausted: bool, primary_draining: bool = False) -> bool:
    """Whether the primary subnet sends its pods elsewhere when the node has none of its
    addresses free: exhausted (hysteretic, the controller's) or draining (it grants none)."""
    return primary_exhausted or primary_draining


def first_with_room(
    candidates: Sequence[OverflowCandidate], *, primary_draining: bool = False
) -> str | None:
    """The first overflow subnet, in the ClusterSubnet's order, with room; None if none has.
    A draining primary grants nothing at all, so its pods then go to the first that still
    grants: an exhausted subnet grants one address at a time until it is full."""
    found = next((c.name for c in candidates if c.has_room), None)
    if found is None and primary_draining:
        grants = (c for c in candidates if c.usable and not (c.draining or c.removed))
        found = next((c.name for c in grants), None)
    return found


def overflow_subnet(
    *,
    primary_exhausted: bool,
    primary_draining: bool = False,
    candidates: Sequence[OverflowCandidate],
) -> str | None:
    """The subnet that takes the primary's pods while the gate is open (ADDs without a free
    primary address, and the pods counted ahead: `spill`); None while it is shut."""
    if not overflow_open(primary_exhausted=primary_exhausted, primary_draining=primary_draining):
        return None
    return first_with_room(candidates, primary_draining=primary_draining)


def overflow_target(
    *,
    primary_exhausted: bool,
    primary_draining: bool = False,
    primary_free: int,
    candidates: Sequence[OverflowCandidate],
) -> str | None:
    """The subnet an ADD drawing from the primary takes its address from instead, or None (the
    primary): only while the gate is open and the primary lane has no free address for it
    (`primary_free`: beyond those promised to earlier ADDs; a draining primary's free ones are
    not handed out, they go back)."""
    if primary_free > 0 and not primary_draining:
        return None
    return overflow_subnet(
        primary_exhausted=primary_exhausted,
        primary_draining=primary_draining,
        candidates=candidates,
    )


def spill(
    *,
    primary_exhausted: bool,
    primary_draining: bool = False,
    demand: int,
    holds: int,
) -> int:
    """The primary's pods its lane cannot serve with the `holds` addresses it has (assigned and
    free), counted ahead in the first overflow subnet's demand while the gate is open; 0 while
    it is shut (the primary's own request asks for them then).

    They stay in the primary's demand too (`primary_demand` subtracts only the pods that hold
    an overflow address): an exhausted primary still grants, one address at a time, until it
    is full, and whichever subnet's address comes first serves the pod; the other's spare goes
    back by the ordinary release. The cost is addresses reserved twice for pods not yet
    started, while the gate is open (the simulator's "unused reserved" figure counts it)."""
    if not overflow_open(primary_exhausted=primary_exhausted, primary_draining=primary_draining):
        return 0
    return max(0, demand - holds)


def primary_demand(pod_demand: int, *, overflowed: int) -> int:
    """The pods the cluster counts for the primary subnet, less those that hold an overflow
    subnet's address instead (they keep it for life, so the primary need not keep one)."""
    return max(0, pod_demand - overflowed)


def overflow_demand(pod_demand: int, *, overflowed: int, spilled: int) -> int:
    """An overflow subnet's pods: those that choose it by name (`pod_demand`), those of the
    primary that hold its addresses (`overflowed`) and those counted ahead (`spilled`)."""
    return pod_demand + overflowed + spilled
