"""The start-up check of the state file against the world, at 250 sandboxes: its CPU cost.

A node with a /24's pool (256 addresses) and 250 live sandboxes, each holding one of them, as the
runtime (CRI) and the API both report them. Measured, each the median of ROUNDS runs:

- `decide`: the pure decision (cns/core/worldcheck.py, `check_world`) with every row present
  (250 fine), and with every row lost (250 adoptions);
- `apply`: what the node does in its one synchronous step (`NodeIPAM.apply_world`: the pool's
  view, the decision, the adoptions queued for the state file, one JSON log line each), with
  every row present and with every row lost;
- `restore`: the state file's 250 rows read at start (`Store.open`), the step before;
- `baseline`: the leak check's decision (cns/core/leaks.py, `find_leaks`) on the same 250
  assignments, a step every node with a CRI socket already runs at start and every minute.

    .venv/bin/python -m bench.performance.world_check_cost

Prints one JSON object (milliseconds, and each as a ratio to the baseline).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from cns.core.leaks import find_leaks
from cns.core.pool import Pool
from cns.core.types import IPConfig, NetworkContainer, Owner, Scaler
from cns.core.worldcheck import Sighting, Source, check_world
from cns.node.control_plane import MemorySource, SourceState
from cns.node.service import NodeIPAM
from cns.state.store import Store
from cns.support.logs import configure

SANDBOXES = 250
ROUNDS = 50


def median_ms(run: Callable[[], object], setup: Callable[[], object] = lambda: None) -> float:
    samples = []
    for _ in range(ROUNDS):
        setup()
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(samples), 3)


def owner(n: int) -> Owner:
    return Owner(f"{n:064x}", "eth0", pod_name=f"pod-{n}", pod_namespace="bench")


async def measure(directory: Path) -> dict[str, float]:
    configs = tuple(IPConfig(f"ip-{n}", f"10.9.{n // 256}.{n % 256}", 1) for n in range(4, 260))
    nc = NetworkContainer("nc", ("10.9.0.2",), "10.9.0.0/23", "10.9.0.1", configs, 1, 1)
    store = Store(directory / "state.db")
    store.open()
    node = NodeIPAM(Pool(), store, MemorySource(), Scaler(), 10.0)
    node.on_state(SourceState((nc,)))
    sightings = [
        Sighting(source, configs[n].address, owner(n))
        for n in range(SANDBOXES)
        for source in (Source.CRI, Source.API)
    ]
    free = node.world_pool()

    def lose_every_row() -> None:
        for n in range(SANDBOXES):
            node.pool.release(owner(n).key)

    for n in range(SANDBOXES):
        node.pool.assign_address(owner(n), configs[n].address)
    held_pool = node.world_pool()
    held, waiting = node.leak_inputs()
    sandboxes = frozenset(owner(n).container_id for n in range(SANDBOXES))
    baseline = median_ms(
        lambda: find_leaks(
            held,
            sandboxes=sandboxes,
            pods={f"bench/pod-{n}": True for n in range(SANDBOXES)},
            waiting=waiting,
            suspects={},
            now=0.0,
            now_wall=0.0,
            grace_seconds=60.0,
        )
    )
    figures = {
        "baseline_find_leaks_ms": baseline,
        "apply_all_fine_ms": median_ms(lambda: node.apply_world(sightings)),
        "decide_all_fine_ms": median_ms(lambda: check_world(held_pool, sightings)),
        "decide_all_adopted_ms": median_ms(lambda: check_world(free, sightings)),
        "apply_all_adopted_ms": median_ms(
            lambda: node.apply_world(sightings), setup=lose_every_row
        ),
    }
    lose_every_row()
    await node.durable(node.apply_world(sightings)[1])
    store.close()

    def restore() -> None:
        again = Store(directory / "state.db")
        assert len(again.open()) == SANDBOXES
        again.close()

    figures["restore_state_file_ms"] = median_ms(restore)
    ratios = {f"{k.removesuffix('_ms')}_ratio": round(v / baseline, 2) for k, v in figures.items()}
    return {"sandboxes": SANDBOXES, **figures, **ratios}


def main() -> None:
    configure(fmt="json")  # as the daemon logs, to /dev/null: one line per adoption counts
    with tempfile.TemporaryDirectory() as directory, open(os.devnull, "w") as null:
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(null))
        print(json.dumps(asyncio.run(measure(Path(directory))), indent=2))


if __name__ == "__main__":
    main()
