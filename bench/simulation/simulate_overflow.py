"""What an overflow subnet changes when the first subnet fills: the same scenario with and without
its `overflow:` line, under each strategy, as ratios (with / without).

`bench/scenarios/overflow-fills.yaml` grows a workload past a /25 that overflows into
a /24; `overflow-fills-alone.yaml` is the same file without the overflow line. Both are run with
`cns simulate --json` (one process each, the scenario's seed), and the figures the question needs
are set side by side: pods that waited for an IP, still waiting at the end, pods whose ADD
failed, and the unused reserved IPs (reserved by nodes, assigned to no pod; over both subnets).
A ratio is exact (Fraction) until printed; "-" where the run without overflow has 0.
Usage: python -m bench.simulation.simulate_overflow [--seed N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
WITH, WITHOUT = SCENARIOS / "overflow-fills.yaml", SCENARIOS / "overflow-fills-alone.yaml"
STRATEGIES = ("fixed", "toggle", "phase4", "phase4+toggle")
# (label, the figure from a strategy's JSON summary)
FIGURES: tuple[tuple[str, Any], ...] = (
    ("pods that waited for an IP", lambda s: s["podsWaited"]),
    ("  wait p99 (s)", lambda s: Fraction(str(s["waitSeconds"]["p99"]))),
    ("  still waiting at end", lambda s: s["stillWaitingAtEnd"]),
    ("pods whose ADD failed", lambda s: s["failedPods"]),
    ("unused reserved IPs, mean", lambda s: Fraction(str(s["unusedIPs"]["mean"]))),
    ("unused reserved IPs, peak", lambda s: s["unusedIPs"]["peak"]),
    ("pods that overflowed", lambda s: s["podsOverflowed"]),
)


def run(path: Path, seed: int | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "cns.commands.cli", "simulate", str(path), "--json"]
    command += [arg for name in STRATEGIES for arg in ("--strategy", name)]
    if seed is not None:
        command += ["--seed", str(seed)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    strategies: dict[str, Any] = json.loads(out)["strategies"]
    return strategies


def number(value: Fraction | int) -> str:
    value = Fraction(value)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.1f}"


def ratio(with_overflow: Fraction | int, without: Fraction | int) -> str:
    if not without:
        return "-"
    return f"{float(Fraction(with_overflow) / Fraction(without)):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="default: the scenario's")
    args = parser.parse_args()
    with_overflow, without = run(WITH, args.seed), run(WITHOUT, args.seed)
    header = ["", *(f"{name}: with / without / ratio" for name in STRATEGIES)]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for label, figure in FIGURES:
        cells = [label]
        for name in STRATEGIES:
            a, b = figure(with_overflow[name]), figure(without[name])
            cells.append(f"{number(a)} / {number(b)} / {ratio(a, b)}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
