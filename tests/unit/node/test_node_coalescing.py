"""NodeIPAM's reconcile pause: only a change to what the plan depends on restarts it."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from cns.config.daemon_config import Coalescing
from cns.core.pool import Pool
from cns.core.types import Owner, Scaler
from cns.node.control_plane import MemorySource
from cns.node.service import NodeIPAM
from cns.state.store import Store

KICKS = 40
KICK_INTERVAL_SECONDS = 0.01


async def kicks_seen_when_the_pause_ends(ipam: NodeIPAM, change_demand: bool) -> int:
    """Kick KICKS times (changing the demand each time, or not) while the pause runs."""
    kicks = 0

    async def kicker() -> None:
        nonlocal kicks
        for _ in range(KICKS):
            await asyncio.sleep(KICK_INTERVAL_SECONDS)
            if change_demand:
                ipam.primary.pod_demand += 1
            kicks += 1
            ipam.kick()

    task = asyncio.create_task(kicker())
    await ipam.publisher.until_quiet()
    seen = kicks
    await task
    return seen


def pausing_node(tmp_path: Path, coalescing: Coalescing) -> NodeIPAM:
    return NodeIPAM(
        Pool(),
        Store(tmp_path / "state.db"),
        MemorySource(),
        Scaler(batch_size=16),
        5.0,
        coalescing=coalescing,
    )


@pytest.fixture
def ipam(tmp_path: Path) -> NodeIPAM:
    # The pause (0.2 s) is 20 kick intervals; the cap is far beyond the kicker's 0.4 s.
    return pausing_node(tmp_path, Coalescing(quiet_seconds=0.2, max_delay_seconds=30.0))


async def test_triggers_that_change_nothing_do_not_hold_the_request_back(ipam: NodeIPAM) -> None:
    # ADDs for pods the pod watch already counted: the demand stays, the pause ends on time.
    ipam.primary.pod_demand = 30
    assert await kicks_seen_when_the_pause_ends(ipam, change_demand=False) < KICKS


async def test_a_growing_demand_keeps_the_burst_in_one_request(ipam: NodeIPAM) -> None:
    # Pods still being bound: every change restarts the pause, which ends after the last one.
    assert await kicks_seen_when_the_pause_ends(ipam, change_demand=True) == KICKS


async def test_an_add_waiting_for_an_ip_ends_the_pause(ipam: NodeIPAM) -> None:
    # No network yet, so the ADD waits; the demand keeps changing, yet the pause ends at once.
    add = asyncio.create_task(ipam.add(Owner("c1", "eth0")))
    await asyncio.sleep(0)
    assert ipam.waiting_count() == 1
    assert await kicks_seen_when_the_pause_ends(ipam, change_demand=True) < KICKS
    add.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await add


async def test_an_add_that_starts_waiting_during_the_pause_ends_it(tmp_path: Path) -> None:
    # A pause far longer than the kicks: only the ADD that queues mid-pause can end it early.
    ipam = pausing_node(tmp_path, Coalescing(quiet_seconds=30.0, max_delay_seconds=60.0))
    pause = asyncio.create_task(kicks_seen_when_the_pause_ends(ipam, change_demand=False))
    await asyncio.sleep(5 * KICK_INTERVAL_SECONDS)
    assert not pause.done()
    add = asyncio.create_task(ipam.add(Owner("c1", "eth0")))
    assert await pause < KICKS
    assert ipam.waiting_count() == 1
    add.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await add
