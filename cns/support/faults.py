"""Fault injection for tests: pauses at named points, so that hostile timing is reproducible.

Inactive unless the environment variable `CNS_FAULTS` is set, e.g.
`CNS_FAULTS="controller.after_plan=0.5-2.5,controller.before_nnc_write=0-0.3"`: at each named
point the process sleeps a random time in that range (seconds). `controller.skip_fencing=1`
turns the leader's fencing off, so that a test can show the allocation protocol alone keeps two
writers apart. Production never sets it; the reliability tests use it to stretch the windows in
which a replica that lost its lease still has writes to make (docs/design/controller-safety.md).
"""

from __future__ import annotations

import asyncio
import os
import random

_rng = random.Random()


def _parse(text: str) -> dict[str, tuple[float, float]]:
    points = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, span = item.partition("=")
        low, _, high = span.partition("-")
        points[name] = (float(low), float(high or low))
    return points


_POINTS = _parse(os.environ.get("CNS_FAULTS", ""))


def active(point: str) -> bool:
    """Whether a switch-type fault (`name=1`) is set."""
    return _POINTS.get(point, (0.0, 0.0))[0] > 0


async def pause(point: str) -> None:
    """Sleep the configured time at `point`; nothing when it is not configured."""
    span = _POINTS.get(point)
    if span is not None:
        await asyncio.sleep(_rng.uniform(*span))
