"""Does the phase-4 batch settle with pods held steady, everywhere? A sweep of the simulator.

Every point is one `cns simulate` run (the real Pool, next_request and the controller's
plan_subnet) of one subnet and a fixed pool of nodes holding a fixed number of pods, under the
`phase4` strategy (`--strategy phase4+toggle`: the exhaustion toggle as well, as in Kubernetes
mode):
- subnets /24, /22, /20, /18, /16; node counts from 3 to 1,000;
- pods from 0 to 95 % of the subnet's capacity (at most what the nodes can schedule: maxPods
  249 a node);
- the nodes' requestThresholdPercent (mf) 0, 25, 50, 100 % (releaseThresholdPercent
  max(150, mf + 100), the least the scaler allows), batch B0 = maxBatchSize 4, 16, 64;
- pods spread evenly by the scheduler, or unevenly (half of them on a quarter of the nodes);
- reached from empty (`rising`: every pod created at 30 s), or, with `--falling`, from above
  (95 % of the capacity, or what the nodes can schedule, at 30 s, down to the count at 150 s).

The pods then stay as they are until the run ends (600 s). Per point it records the controller
rounds from the moment the pods stop changing to the round of the last batch change (0: the batch
never changed after that), which must not exceed the stated bound `round_bound(B)`; the batch
changes in the last third of the run (must be 0: the batch has settled); and the pods waiting for
an IP there (must be 0 where the pods fit: each node's pods, its primary IP and the 2 free IPs
batch 1 may keep, together no more than the capacity). Exit status 1 if any point fails one.
Usage: python -m bench.simulation.simulate_settle [--falling] [--quick] [--strategy NAME] [-j 2]
    [--out FILE]
(`--out` appends one JSON line per point as it is measured and resumes from what is there.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cns.core.subnet import Subnet
from cns.core.types import Scaler
from cns.sim.engine import Simulation
from cns.sim.report import last_third_start, late_batch_changes
from cns.sim.strategies import STRATEGIES
from cns.sim.sweep import START_SECONDS, fixed_pool, most_pods

CIDRS = ("10.0.0.0/24", "10.0.0.0/22", "10.0.0.0/20", "10.0.0.0/18", "10.0.0.0/16")
NODES = (3, 10, 29, 100, 300, 1000)
PERCENTS = (0, 10, 30, 50, 70, 85, 95)
MIN_FREE_PERCENTS = (0, 25, 50, 100)
BATCHES = (4, 16, 64)
DURATION = 600.0
FALL_AT = 150.0
SAMPLE_SECONDS = 10.0
FREE_AT_BATCH_ONE = 2  # what batch 1 may keep free: its release threshold max(ceil(Mf), 2)


def round_bound(max_batch: int) -> int:
    """The stated bound on the rounds from the pods' last change to the last batch change.

    Once every pod has its IP the batch shrinks at most once and then only grows, at most
    `log2(B)` times (docs/design/phase4.md); the controller sees each change's effect one round
    after the round that made it. Two rounds per change, and two more for the pods' own arrival
    or departure (the round that grants or releases for them, and the one after).
    """
    return 2 * (1 + max_batch.bit_length() - 1) + 2


@dataclass(frozen=True, slots=True)
class Point:
    cidr: str
    nodes: int
    percent: int
    min_free_percent: int
    batch: int
    uneven: bool
    falling: bool
    strategy: str

    def scaler(self) -> Scaler:
        release = max(150, self.min_free_percent + 100)
        return Scaler(self.batch, self.min_free_percent, release)


@dataclass(frozen=True, slots=True)
class Outcome:
    point: Point
    pods: int
    fits: bool
    settle_rounds: int  # rounds from the pods' last change to the last batch change
    changes_after_steady: int
    late_changes: int  # in the last third of the run
    late_waiting: int  # most pods waiting for an IP at a sample in the last third, or at the end
    final_batch: int

    @property
    def problems(self) -> list[str]:
        """What this point fails: the round bound, settling, or waits where the pods fit."""
        found = []
        if self.settle_rounds > round_bound(self.point.batch):
            found.append(f"{self.settle_rounds} rounds > {round_bound(self.point.batch)}")
        if self.late_changes:
            found.append(f"{self.late_changes} batch changes in the last third")
        if self.fits and self.late_waiting:
            found.append(f"{self.late_waiting} pods waiting although they fit")
        return found


def measure(point: Point) -> Outcome:
    capacity = Subnet("pods", point.cidr).capacity
    pods = min(point.percent * capacity // 100, most_pods(point.nodes, uneven=point.uneven))
    scaler = point.scaler()
    if point.falling:
        high = min(95 * capacity // 100, most_pods(point.nodes, uneven=point.uneven))
        scenario = fixed_pool(
            point.cidr,
            nodes=point.nodes,
            pods=high,
            duration_seconds=DURATION,
            changes=[(FALL_AT, pods)],
            scaler=scaler,
            uneven=point.uneven,
        )
        steady_from = FALL_AT
    else:
        scenario = fixed_pool(
            point.cidr,
            nodes=point.nodes,
            pods=pods,
            duration_seconds=DURATION,
            scaler=scaler,
            uneven=point.uneven,
        )
        steady_from = START_SECONDS
    simulation = Simulation(
        replace(scenario, sample_seconds=SAMPLE_SECONDS), STRATEGIES[point.strategy], 1
    )
    result = simulation.run()
    subnet = result.subnets["pods"]
    changes = [t for t in subnet.batch_change_times if t >= steady_from]
    settle_rounds = (
        sum(1 for t in subnet.round_times if steady_from <= t <= changes[-1]) if changes else 0
    )
    late_from = last_third_start(result)
    late = [
        w
        for t, w in zip(result.series.time, result.series.waiting_for_ip, strict=True)
        if t >= late_from
    ]
    lanes = simulation.subnets["pods"].lanes.values()
    held = sum(len(lane.node.pods) + 1 + FREE_AT_BATCH_ONE for lane in lanes)
    return Outcome(
        point=point,
        pods=pods,
        fits=held <= capacity,
        settle_rounds=settle_rounds,
        changes_after_steady=len(changes),
        late_changes=late_batch_changes(result, subnet.batch_change_times),
        late_waiting=max([result.still_waiting, *late]),
        final_batch=subnet.final_batch,
    )


def points(falling: bool, quick: bool, strategy: str) -> list[Point]:
    cidrs, nodes = (CIDRS[:3], NODES[:4]) if quick else (CIDRS, NODES)
    return [
        Point(cidr, n, percent, mf, batch, uneven, falling, strategy)
        for cidr, n, percent, mf, batch, uneven in itertools.product(
            cidrs, nodes, PERCENTS, MIN_FREE_PERCENTS, BATCHES, (False, True)
        )
    ]


def load(path: Path) -> dict[Point, Outcome]:
    """The outcomes an earlier (perhaps interrupted) run wrote to `path`, one JSON line each."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                fields = json.loads(line)
                point = Point(**fields.pop("point"))
                done[point] = Outcome(point=point, **fields)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--falling", action="store_true", help="reach each point from above")
    parser.add_argument("--quick", action="store_true", help="/24 to /20, up to 100 nodes")
    parser.add_argument("--strategy", default="phase4", choices=["phase4", "phase4+toggle"])
    parser.add_argument("-j", "--processes", type=int, default=1)
    parser.add_argument(
        "--out",
        type=Path,
        help="append each point's outcome to this file (JSON lines) as it is measured; points "
        "already in it are not measured again, so an interrupted sweep resumes",
    )
    args = parser.parse_args()
    wanted = points(args.falling, args.quick, args.strategy)
    done = load(args.out) if args.out else {}
    todo = [point for point in wanted if point not in done]
    # The heaviest points first, so the pool's last chunks are short.
    todo.sort(key=lambda p: -Subnet("pods", p.cidr).capacity * p.nodes)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(args.out.open("a")) if args.out else None
        workers = stack.enter_context(multiprocessing.Pool(args.processes))
        for outcome in workers.imap_unordered(measure, todo, chunksize=1):
            done[outcome.point] = outcome
            if out is not None:
                out.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
                out.flush()
    elapsed = time.monotonic() - started
    outcomes = sorted(
        (done[point] for point in wanted),
        key=lambda o: (Subnet("pods", o.point.cidr).capacity, o.point.nodes),
    )
    direction = "falling (from 95 %)" if args.falling else "rising (from empty)"
    print(
        f"{len(outcomes)} points of {args.strategy}, {direction}; {len(todo)} measured in this"
        f" run, {elapsed:.0f} s wall-clock, {args.processes} processes"
    )
    print(
        "round bound: "
        + ", ".join(f"B = {b}: {round_bound(b)}" for b in BATCHES)
        + " rounds from the pods' last change to the last batch change\n"
    )
    print(
        "| subnet | nodes | points (pods fit) | worst rounds to the last change | most changes "
        "| changing in the last third | pods waiting there, fit / no fit |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (cidr, nodes), group in itertools.groupby(
        outcomes, lambda o: (o.point.cidr, o.point.nodes)
    ):
        rows = list(group)
        print(
            f"| {cidr.split('/')[1]:>3} | {nodes} | {len(rows)} ({sum(o.fits for o in rows)})"
            f" | {max(o.settle_rounds for o in rows)}"
            f" | {max(o.changes_after_steady for o in rows)}"
            f" | {sum(o.late_changes > 0 for o in rows)}"
            f" | {sum(o.fits and o.late_waiting > 0 for o in rows)}"
            f" / {sum(not o.fits and o.late_waiting > 0 for o in rows)} |"
        )
    failed = [o for o in outcomes if o.problems]
    print(f"\nworst rounds to the last batch change: {max(o.settle_rounds for o in outcomes)}")
    print(
        f"most batch changes after the pods' last change: "
        f"{max(o.changes_after_steady for o in outcomes)}"
    )
    print(
        f"points failing the bound, settling or the no-wait rule: {len(failed)} of {len(outcomes)}"
    )
    for o in failed:
        print(f"  {describe(o)}: {'; '.join(o.problems)}")
    return 1 if failed else 0


def describe(o: Outcome) -> str:
    p = o.point
    return (
        f"{p.cidr} nodes={p.nodes} pods={o.pods} ({p.percent}%) mf={p.min_free_percent}"
        f" B={p.batch} {'uneven' if p.uneven else 'even'} {'falling' if p.falling else 'rising'}"
    )


if __name__ == "__main__":
    sys.exit(main())
