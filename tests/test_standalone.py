"""The standalone allocator's exhaustion: set above the upper threshold, cleared only when what
the node takes back then keeps it cleared (docs/design/subnet-scarcity.md, 1-2)."""

from __future__ import annotations

from pathlib import Path

from cns.config import StandaloneConfig
from cns.core.scaling import next_request
from cns.core.types import PoolRequest, Scaler
from cns.standalone import StandaloneAllocator


class Node:
    """A node that sends the request its scaler gives for the state the allocator told it, and
    gives back what is above it; each step is one round trip."""

    def __init__(self, tmp_path: Path, scaler: Scaler) -> None:
        config = StandaloneConfig(subnet="10.5.0.0/26", allocation_latency_ms=0)  # 61 usable
        self.allocator = StandaloneAllocator(config, tmp_path / "allocator.json", scaler=scaler)
        self.allocator.load()
        self.scaler = scaler
        self.sent = 0

    def step(self, demand: int) -> bool:
        grant = self.allocator.grant
        self.sent = next_request(
            self.scaler,
            current=self.sent,
            demand=demand,
            primary_ip_count=len(grant.nc.primary_ips),
            exhausted=grant.exhausted,
        )
        leaving = tuple(c.id for c in grant.nc.ip_configs[self.sent :])
        self.allocator.grant = self.allocator.fulfil(PoolRequest(self.sent, leaving))
        return self.allocator.grant.exhausted

    def reserved(self) -> int:
        nc = self.allocator.grant.nc
        return len(nc.primary_ips) + len(nc.ip_configs)


def test_a_warm_floor_larger_than_the_subnet_does_not_make_exhaustion_flap(
    tmp_path: Path,
) -> None:
    """An idle node whose floor (63 secondary IPs) is more than the /26 holds: exhausted, it
    asks for one IP (2 reserved, under 50 %). The exhaustion used to clear then, the floor came
    back and set it again, every round trip; it now stays set."""
    node = Node(tmp_path, Scaler(min_ip_count=50))
    states = [node.step(demand=0) for _ in range(10)]
    assert all(states), states
    assert node.reserved() == 2


def test_exhaustion_clears_once_the_demand_has_fallen_enough(tmp_path: Path) -> None:
    node = Node(tmp_path, Scaler(min_ip_count=10))
    assert node.step(demand=52)  # 63 wanted, 61 usable: exhausted
    assert all(node.step(demand=52) for _ in range(3))  # batch 1: 54 reserved, over 50 %
    # 7 reserved (under 50 %), 16 once cleared (under 90 %): cleared at once, and for good
    states = [node.step(demand=5) for _ in range(6)]
    assert not any(states), states
    assert node.reserved() == 16
