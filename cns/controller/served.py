"""What the controller keeps between rounds: for each subnet it serves, and its counts."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from cns.controller.state import PlanningState
from cns.core.allocation import Entry
from cns.core.types import Scaler, SubnetStatus


@dataclass(slots=True)
class SubnetCounts:
    """One served subnet's rounds and writes, for the metrics endpoint."""

    rounds: int = 0
    writes: int = 0  # writes the API server took
    refusals: int = 0  # conditional writes it refused (404, 409)


@dataclass(slots=True)
class Counters:
    """What the controller counts, for its metrics endpoint and its tests."""

    rounds: int = 0
    duplicates: int = 0  # addresses in two containers, last round
    duplicates_found: int = 0  # addresses newly found in two containers, ever
    conflicts: int = 0  # addresses listed against the record, last round
    node_address_conflicts: int = 0  # nodes' own addresses a pod holds, last round
    reserved_addresses_held: int = 0  # reserved addresses a pod holds, last round
    write_conflicts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fenced: int = 0  # rounds stopped because the lease could not be proven
    round_seconds: float = 0.0  # the last round's
    rechecks: int = 0  # planning states built from scratch
    state_differences: int = 0  # rechecks that found the incremental state wrong (a defect)
    round_seconds_total: float = 0.0
    # By subnet served: one entry each, dropped with the subnet (`forget_subnets`).
    subnets: dict[str, SubnetCounts] = field(default_factory=dict)

    def subnet(self, name: str) -> SubnetCounts:
        counts = self.subnets.get(name)
        if counts is None:
            counts = self.subnets[name] = SubnetCounts()
        return counts

    def forget_subnets(self, served: Iterable[str]) -> None:
        """Keep the counts of the subnets `served` only (the metrics' series stay bounded)."""
        keep = set(served)
        for name in self.subnets.keys() - keep:
            del self.subnets[name]


@dataclass(slots=True, eq=False)
class ServedSubnet:
    """What the controller keeps between rounds for one subnet it serves."""

    name: str
    # The subnet's own draws (the division of scarce addresses): what one subnet's rounds draw
    # changes nothing in another's, also for a node that is a member of both.
    rng: random.Random
    state: PlanningState | None = None  # None until first built from the caches
    checked_at: float = 0.0
    written_scaler: Scaler | None = None
    asked: set[str] = field(default_factory=set)
    reported: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    # The nodes' own addresses and the reserved ones a pod holds, with the nodes holding
    # each, as last reported.
    node_held: dict[str, tuple[str, ...]] = field(default_factory=dict)
    reserved_held: dict[str, tuple[str, ...]] = field(default_factory=dict)
    keeping: set[str] = field(default_factory=set)  # nodes whose addresses wait for an NNC
    # Releasing entries a direct read found gone from their node's NNC
    # (`SubnetRounds._released_unlisted`).
    unlisted: dict[str, Entry] = field(default_factory=dict)
    # The status the last round computed (batch, exhaustion): None until one ran.
    status: SubnetStatus | None = None
