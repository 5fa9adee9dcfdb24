"""The simulator's performance target: the 1,000-node, 30,000-pod, one-hour scenario in < 1 min.

Runs `bench/scenarios/large.yaml` once per strategy (default: fixed, toggle, phase4, in one
process, one after the other, as `cns simulate` does) and prints the wall-clock of each run and
of all of them, then the comparison table. Usage:
    python -m bench.performance.simulate_large [--strategy NAME ...] [--seed N]
        [--ip-cooldown-seconds S]
`--ip-cooldown-seconds` replaces the scenario's `timing.ipCooldownSeconds` (30, the daemon's
default): 0 measures the engine without the cooldown's extra work, for a before/after ratio.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from cns.sim.engine import simulate
from cns.sim.report import summary_rows
from cns.sim.scenario import load
from cns.sim.strategies import DEFAULT_STRATEGIES, STRATEGIES
from cns.support.table import table

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "large.yaml"
TARGET_SECONDS = 60.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", action="append", choices=list(STRATEGIES))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ip-cooldown-seconds", type=float)
    args = parser.parse_args()
    scenario = load(SCENARIO)
    if args.ip_cooldown_seconds is not None:
        timing = replace(scenario.timing, ip_cooldown_seconds=args.ip_cooldown_seconds)
        scenario = replace(scenario, timing=timing)
    seed = scenario.seed if args.seed is None else args.seed
    names = args.strategy or list(DEFAULT_STRATEGIES)
    print(
        f"{SCENARIO.name}: {scenario.duration_seconds:g} simulated seconds, seed {seed}, "
        f"ipCooldownSeconds {scenario.timing.ip_cooldown_seconds:g}"
    )
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.node()}")
    results = []
    started = time.perf_counter()
    for name in names:
        run_started = time.perf_counter()
        result = simulate(scenario, STRATEGIES[name], seed)
        results.append(result)
        print(
            f"{name:14} {time.perf_counter() - run_started:6.2f} s wall-clock: "
            f"peak {max(result.series.pods)} pods and {max(result.series.nodes)} nodes, "
            f"{result.pods_created} pods created in all"
        )
    total = time.perf_counter() - started
    verdict = "met" if total < TARGET_SECONDS else "NOT met"
    print(f"total {total:.2f} s for {len(names)} runs (target < {TARGET_SECONDS:g} s: {verdict})")
    print()
    print(table(summary_rows(results)))
    return 0 if total < TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
