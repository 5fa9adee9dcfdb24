"""Where does the exhaustion toggle (B0 = 16 -> 1) really oscillate on a /22, and does phase 4?

The phase-4 proposal (docs/design/errata.md) predicts N > C * (Tu - Tl) / (B0 - B1) = 27.3 nodes,
assuming every node frees B0 - B1 = 15 IPs when the batch drops to 1. This sweep runs the
simulator (the real Pool, next_request and plan_subnet) for every node count in a range and pod
counts up to the lower threshold (above it the subnet stays exhausted even at batch 1), with the
pods spread evenly by the scheduler, and records which (nodes, pods) points keep flipping.

Next to each measurement it prints the quasi-static prediction from the real pool math: with
`p` pods a node holds `target_request(p) + 1` IPs (primary included) at B = 16 and `p + 2` at
batch 1, and the toggle oscillates iff the first sum is above 90 % of the capacity and the second
below 50 %. The same points are run with the phase-4 batch (docs/design/phase4.md); the last
column lists the points where it still changes in the second half. (docs/sim/oscillation-sweep.txt
was measured with the proposal's direction rule, which cycled at 679 points;
`bench/simulation/simulate_settle.py` is the wider sweep for the rule cns uses now.)
Usage: python -m bench.simulation.simulate_oscillation [--nodes 10:70] [--pods-step 2] [-j 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from fractions import Fraction

from cns.core.batch import naive_toggle_critical_nodes
from cns.core.scaling import target_request
from cns.core.subnet import Subnet
from cns.core.types import Scaler
from cns.sim.strategies import STRATEGIES
from cns.sim.sweep import steady

CIDR = "10.240.0.0/22"
UPPER, LOWER = 90, 50


def predicted(capacity: int, nodes: int, pods: int) -> bool:
    """The quasi-static model: pods spread as evenly as possible, every node at its target."""
    scaler = Scaler()
    per_node, extra = divmod(pods, nodes)
    counts = [per_node + 1] * extra + [per_node] * (nodes - extra)
    high = sum(target_request(scaler, p, 1, False) + 1 for p in counts)
    low = sum(p + 2 for p in counts)
    return high * 100 > UPPER * capacity and low * 100 < LOWER * capacity


def measure(point: tuple[int, int]) -> tuple[int, int, bool, bool]:
    """(nodes, pods, the toggle oscillates, the phase-4 batch still changes in steady state)"""
    nodes, pods = point
    toggle = steady(STRATEGIES["toggle"], CIDR, nodes=nodes, pods=pods)
    phase4 = steady(STRATEGIES["phase4"], CIDR, nodes=nodes, pods=pods)
    return nodes, pods, toggle.oscillates, phase4.batch_changes > 0


def ranges(values: list[int], step: int) -> str:
    """`[2, 4, 6, 10]` with step 2 -> `2-6, 10`: runs of consecutive sweep points."""
    spans: list[list[int]] = []
    for value in values:
        if spans and value - spans[-1][-1] == step:
            spans[-1].append(value)
        else:
            spans.append([value])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="10:70", help="node counts, LOW:HIGH (inclusive)")
    parser.add_argument("--pods-step", type=int, default=2)
    parser.add_argument("-j", "--processes", type=int, default=2)
    args = parser.parse_args()
    low, high = (int(x) for x in args.nodes.split(":"))
    capacity = Subnet("pods", CIDR).capacity
    pods_limit = LOWER * capacity // 100
    points = [
        (n, p) for n in range(low, high + 1) for p in range(0, pods_limit + 1, args.pods_step)
    ]
    started = time.monotonic()
    with multiprocessing.Pool(args.processes) as workers:
        measured = workers.map(measure, points, chunksize=8)
    elapsed = time.monotonic() - started

    seed = naive_toggle_critical_nodes(
        capacity=1024, upper=Fraction(UPPER, 100), lower=Fraction(LOWER, 100), b0=16, b1=1
    )
    print(f"subnet {CIDR}: capacity {capacity} (1024 addresses minus network, broadcast, gateway)")
    print(f"predicted critical node count (C = 1024): {float(seed):.1f}")
    print(f"{len(points)} runs, pods 0..{pods_limit} step {args.pods_step}, {elapsed:.0f} s\n")
    print("pod counts at which, in steady state:")
    print(
        "nodes  the toggle oscillates (measured) | (quasi-static model) | phase 4 does not settle"
    )
    disagreements = unsettled = 0
    first = None
    for nodes in range(low, high + 1):
        rows = [m for m in measured if m[0] == nodes]
        seen = [pods for _, pods, oscillates, _ in rows if oscillates]
        model = [pods for _, pods, _, _ in rows if predicted(capacity, nodes, pods)]
        cycling = [pods for _, pods, _, changing in rows if changing]
        disagreements += len(set(seen) ^ set(model))
        unsettled += len(cycling)
        if seen and first is None:
            first = nodes
        step = args.pods_step
        print(f"{nodes:5}  {ranges(seen, step)} | {ranges(model, step)} | {ranges(cycling, step)}")
    print(f"\nfirst node count at which the toggle oscillates (measured): {first}")
    print(f"points where the toggle's measurement and the model disagree: {disagreements}")
    print(f"points where the phase-4 batch does not settle: {unsettled} of {len(points)}")


if __name__ == "__main__":
    main()
