"""The standalone allocator's exhaustion: set above the upper threshold, cleared only when what
the node takes back then keeps it cleared (docs/design/subnet-scarcity.md, 1-2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from cns.config.daemon_config import StandaloneConfig, StandaloneSubnet
from cns.core.scaling import next_request
from cns.core.types import PoolRequest, Scaler
from cns.node.control_plane import SourceState
from cns.node.standalone import StandaloneAllocator, StandaloneSource


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


async def test_each_further_subnet_has_its_allocator_and_file_and_one_publish_feeds_all(
    tmp_path: Path,
) -> None:
    """The primary keeps its file name (existing state keeps working); an IPv6 subnet is
    granted from its own file; a publish hands each allocator its own subnet's request."""
    config = StandaloneConfig(
        name="v4pods",
        subnet="10.5.0.0/24",
        allocation_latency_ms=0,
        subnets=(StandaloneSubnet(name="v6pods", subnet="fd00:5::/64"),),
    )
    source = StandaloneSource(config, tmp_path, scaler=Scaler())
    source.load()
    states: list[SourceState] = []
    task = asyncio.create_task(source.run(states.append))
    try:
        await source.publish(PoolRequest(3), {"v6pods": PoolRequest(2), "unknown": PoolRequest(9)})
        for _ in range(100):
            last = states[-1] if states else None
            if (
                last
                and last.containers[0].ip_configs
                and last.subnets["v6pods"].containers[0].ip_configs
            ):
                break
            await asyncio.sleep(0.01)
        state = states[-1]
        (v4,) = state.containers
        (v6,) = state.subnets["v6pods"].containers
        assert (v4.subnet_name, v6.subnet_name) == ("v4pods", "v6pods")
        assert [c.address for c in v4.ip_configs] == ["10.5.0.3", "10.5.0.4", "10.5.0.5"]
        assert [c.address for c in v6.ip_configs] == ["fd00:5::3", "fd00:5::4"]
        assert (v6.gateway, v6.primary_ips) == ("fd00:5::1", ("fd00:5::2",))
        assert state.subnets["v6pods"].request == PoolRequest(2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert (
        json.loads((tmp_path / "standalone-allocator.json").read_text())["networkContainer"][
            "subnet"
        ]
        == "10.5.0.0/24"
    )
    saved = json.loads((tmp_path / "standalone-allocator-v6pods.json").read_text())
    assert saved["networkContainer"]["subnet"] == "fd00:5::/64"
    again = StandaloneSource(config, tmp_path, scaler=Scaler())
    again.load()
    assert again.snapshot() == source.snapshot()


def test_reserved_ranges_are_never_granted_and_one_added_over_a_held_ip_asks_it_back(
    tmp_path: Path,
) -> None:
    """A reservation added over a restart covers an IP the node holds: it stays granted until the
    node gives it up (asked through `release_requests`), and is never granted again."""
    config = StandaloneConfig(subnet="10.5.0.0/26", allocation_latency_ms=0)
    allocator = StandaloneSource(config, tmp_path, scaler=Scaler()).primary
    allocator.load()
    allocator.grant = allocator.fulfil(PoolRequest(4))
    assert [c.address for c in allocator.grant.nc.ip_configs] == [
        "10.5.0.3", "10.5.0.4", "10.5.0.5", "10.5.0.6",
    ]  # fmt: skip
    allocator._save(allocator.grant)

    reserving = StandaloneConfig(
        subnet="10.5.0.0/26", allocation_latency_ms=0, reserved_ips=("10.5.0.4-10.5.0.9",)
    )
    source = StandaloneSource(reserving, tmp_path, scaler=Scaler())
    source.load()
    held = {c.address: c.id for c in source.primary.grant.nc.ip_configs}
    assert set(held) == {"10.5.0.3", "10.5.0.4", "10.5.0.5", "10.5.0.6"}  # nothing taken away
    asked = source.snapshot().release_requests
    assert sorted(asked) == sorted(held[a] for a in ("10.5.0.4", "10.5.0.5", "10.5.0.6"))
    # Given back (no pod used them), the node keeps asking for 4: none of the range comes back.
    source.primary.grant = source.primary.fulfil(PoolRequest(4, asked))
    addresses = [c.address for c in source.primary.grant.nc.ip_configs]
    assert addresses == ["10.5.0.3", "10.5.0.10", "10.5.0.11", "10.5.0.12"]
    assert source.snapshot().release_requests == ()
    assert source.primary.capacity == 61 - 6


def test_reservations_read_again_at_run_time_are_delivered_at_once_and_nothing_else_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGHUP's part (`reserve_again`): a range added over held IPs is delivered to the node at
    once as release requests and never granted again; a field other than reservedIPs changed
    is said to need a restart and left as it was."""
    config = StandaloneConfig(subnet="10.5.0.0/26", allocation_latency_ms=0)
    source = StandaloneSource(config, tmp_path, scaler=Scaler())
    source.load()
    delivered: list[SourceState] = []
    source._listener = delivered.append
    source.primary.grant = source.primary.fulfil(PoolRequest(4))
    source.reserve_again(config)
    assert delivered == []  # nothing changed: nothing delivered
    reserving = StandaloneConfig(
        subnet="10.5.0.0/26", allocation_latency_ms=0, reserved_ips=("10.5.0.5/32",)
    )
    source.reserve_again(reserving)
    (state,) = delivered
    held = {c.address: c.id for c in source.primary.grant.nc.ip_configs}
    assert state.release_requests == (held["10.5.0.5"],)
    source.primary.grant = source.primary.fulfil(PoolRequest(4, (held["10.5.0.5"],)))
    assert "10.5.0.5" not in {c.address for c in source.primary.grant.nc.ip_configs}
    moved = StandaloneConfig(
        subnet="10.6.0.0/26", allocation_latency_ms=0, reserved_ips=("10.6.0.5/32",)
    )
    source.reserve_again(moved)
    assert source.primary.spec.subnet == "10.5.0.0/26"
    assert "config_change_needs_restart" in capsys.readouterr().out
