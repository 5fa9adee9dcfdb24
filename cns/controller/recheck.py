"""A served subnet's planning state kept in step with the caches, and the periodic re-check.

Every round syncs the state with the snapshot of the caches (`PlanningState.sync`); every
RECHECK_SECONDS it is then checked against that snapshot object by object, a safety net for a
defect in the incremental updates, not part of correctness.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import structlog

from cns.controller.served import Counters, ServedSubnet
from cns.controller.state import PlanningState, read_state
from cns.core.subnet import Subnet
from cns.kube.wire import IPBlock, NodeNetworkConfig

log = structlog.get_logger("cns.controller")

# How often the planning state is checked against the caches, object by object.
RECHECK_SECONDS = 300.0
_T = TypeVar("_T")


async def to_thread_to_the_end(call: Callable[[], _T]) -> _T:
    """`call()` in a worker thread; if the caller is cancelled meanwhile, the cancellation waits
    until the thread is done: the call reads the planning state, which whatever runs next
    (a standby's warm-up after a lost term) goes on to change."""
    running = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


async def synced_state(
    served: ServedSubnet,
    subnet: Subnet,
    *,
    nncs: dict[str, NodeNetworkConfig],
    blocks: dict[str, IPBlock],
    counters: Counters,
) -> PlanningState:
    """The planning state, brought up to date with the snapshot: built from scratch (in a
    worker thread) the first time and when the subnet's spec changes, else synced.
    Every RECHECK_SECONDS it is then checked against the snapshot (`_recheck`)."""
    state = served.state
    if state is None or state.subnet != subnet:
        state = await asyncio.to_thread(partial(read_state, subnet, nncs=nncs, blocks=blocks))
        served.state, served.checked_at = state, time.monotonic()
        counters.rechecks += 1
        return state
    state.sync(nncs=nncs, blocks=blocks)
    if time.monotonic() >= served.checked_at + RECHECK_SECONDS:
        served.checked_at = time.monotonic()
        state = await _recheck(served, state, nncs=nncs, blocks=blocks, counters=counters)
    return state


async def _recheck(
    served: ServedSubnet,
    state: PlanningState,
    *,
    nncs: dict[str, NodeNetworkConfig],
    blocks: dict[str, IPBlock],
    counters: Counters,
) -> PlanningState:
    """The safety net: check the state, just synced with the snapshot, against it object by
    object (`PlanningState.differences`), in a worker thread while the round waits (nothing
    changes the model meanwhile; the event loop goes on renewing the lease). A difference
    is a defect: it is logged and counted, and a state read from scratch takes over.

    Only the differences are built, not a second state to compare with: a whole second copy
    of the subnet's state would be the controller's memory peak."""
    try:
        differences = await to_thread_to_the_end(
            partial(state.differences, nncs=nncs, blocks=blocks)
        )
    except Exception as exc:
        log.error("planning_recheck_failed", error=repr(exc), retry_in=RECHECK_SECONDS)
        return state
    counters.rechecks += 1
    if not differences:
        return state
    counters.state_differences += 1
    log.error("planning_state_differs", subnet=state.subnet.name, differences=differences)
    fresh = await to_thread_to_the_end(partial(read_state, state.subnet, nncs=nncs, blocks=blocks))
    served.state = fresh
    return fresh
