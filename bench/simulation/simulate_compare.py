"""A baseline revision's IP strategies against this tree's, on the shipped scenarios, in one run.

Each scenario of `bench/scenarios/` (or those named with `--scenario`) is simulated with
`cns simulate --json`, once per strategy, by two codes: a baseline revision (default `main`,
exported with `git archive` into a temporary directory) and this tree. Every run is its own
Python process with `PYTHONPATH` pointing at its code, on the same scenario file and seed, so the
baseline's figures are measured in the same invocation, on the same machine, as this tree's.

`fixed` and `toggle` do not use the phase-4 batch, so both codes must give them the same figures;
the script checks that (a difference means the comparison is not like for like) and prints them
once. Per scenario it prints a Markdown table: pods that waited for an IP, their p99 wait, failed
ADDs, pods still waiting at the end, utilization at the first wait, unused reserved IPs (mean and
peak), batch changes (per simulated hour, and in the last third where the code reports it),
exhaustion flips, the critical node count the run measured (a toggle study's); then the ratio of
phase-4 batch changes, baseline over this tree.

With `--require-fewer-changes N` (the phase-4 settling issue asks 10 for `large.yaml`) it exits 1
unless, in every scenario, this tree's phase-4 batch changes at least N times less often than the
baseline's and no more pods wait for an IP.

Usage: python -m bench.simulation.simulate_compare [--baseline REF] [--scenario NAME ...] [-j 2]
                                        [--require-fewer-changes N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.benchlib import REPO, export_revision

SCENARIOS = REPO / "bench" / "scenarios"
STRATEGIES = ("fixed", "toggle", "phase4", "phase4+toggle")
BATCH_STRATEGIES = ("phase4", "phase4+toggle")  # the ones the two codes can differ in
THIS = "this tree"
ONLY_HERE = ("  in the last third", "critical node count measured")  # not reported by older code


@dataclass(frozen=True, slots=True)
class Run:
    code: str  # THIS or the baseline's name
    scenario: Path
    strategy: str


def simulate(run: Run, code: Path) -> dict[str, Any]:
    """One `cns simulate --json` of one strategy, with `code` first on the import path."""
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "cns.commands.cli", "simulate", str(run.scenario), "--json"]
    done = subprocess.run(
        [*command, "--strategy", run.strategy],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=code,
    )
    document: dict[str, Any] = json.loads(done.stdout)
    figures: dict[str, Any] = document["strategies"][run.strategy]
    figures["durationSeconds"] = document["durationSeconds"]
    return figures


def first_wait(figures: dict[str, Any]) -> str:
    first = figures["firstWait"]
    if first is None:
        return "never"
    return f"{first['utilizationPercent']:.1f} % (t={first['atSeconds']:.0f} s)"


ROWS = (
    ("pods that waited for an IP", lambda f: str(f["podsWaited"])),
    ("  wait p99 (s)", lambda f: f"{f['waitSeconds']['p99']:.1f}"),
    ("pods whose ADD failed", lambda f: str(f["failedPods"])),
    ("still waiting at end", lambda f: str(f["stillWaitingAtEnd"])),
    ("utilization at first wait", first_wait),
    ("unused reserved IPs, mean", lambda f: f"{f['unusedIPs']['mean']:.1f}"),
    ("unused reserved IPs, peak", lambda f: str(f["unusedIPs"]["peak"])),
    ("batch-size changes", lambda f: str(f["batchChanges"])),
    ("  per simulated hour", lambda f: f"{changes_per_hour(f):.0f}"),
    ("  in the last third", lambda f: str(f.get("batchChangesLastThird", "-"))),
    ("exhaustion flips", lambda f: str(f["exhaustionFlips"])),
    ("critical node count measured", lambda f: critical_nodes(f)),
)


def critical_nodes(figures: dict[str, Any]) -> str:
    """The fewest nodes at which a subnet's exhaustion oscillated; "-" where the code does not
    report it, "none" where it never did."""
    counts = [s.get("criticalNodes", "-") for s in figures["subnets"].values()]
    if "-" in counts:
        return "-"
    found = [count for count in counts if count is not None]
    return str(min(found)) if found else "none"


def changes_per_hour(figures: dict[str, Any]) -> float:
    return float(figures["batchChanges"]) * 3600 / float(figures["durationSeconds"])


def like_for_like(figures: dict[str, Any]) -> list[Any]:
    """What must not differ between the two codes for a strategy without the phase-4 batch: the
    table's figures, the pods created and the sampled unused IPs."""
    series = figures["series"]
    shared = [cell for label, cell in ROWS if label not in ONLY_HERE]
    return [cell(figures) for cell in shared] + [figures["podsCreated"], series["unusedIPs"]]


def table(
    scenario: str, baseline: str, results: dict[tuple[str, str], dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """The Markdown table of one scenario, and the problems found in it."""
    columns = [(THIS, "fixed"), (THIS, "toggle")] + [
        (code, strategy) for strategy in BATCH_STRATEGIES for code in (baseline, THIS)
    ]
    problems = []
    for strategy in ("fixed", "toggle"):
        if like_for_like(results[baseline, strategy]) != like_for_like(results[THIS, strategy]):
            problems.append(f"{scenario}: {strategy} differs between {baseline} and this tree")
    header = ["", *(s if s in ("fixed", "toggle") else f"{s} ({c})" for c, s in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, cell in ROWS:
        lines.append("| " + " | ".join([label, *(cell(results[c]) for c in columns)]) + " |")
    return lines, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--scenario", action="append", help="name in bench/scenarios (repeatable)")
    parser.add_argument("-j", "--processes", type=int, default=2)
    parser.add_argument("--require-fewer-changes", type=float, metavar="N")
    args = parser.parse_args()
    names = args.scenario or sorted(p.stem for p in SCENARIOS.glob("*.yaml"))
    scenarios = [SCENARIOS / f"{name}.yaml" for name in names]
    with tempfile.TemporaryDirectory(prefix="cns-baseline-") as tmp:
        commit = export_revision(args.baseline, Path(tmp), "cns")
        codes = {args.baseline: Path(tmp), THIS: REPO}
        runs = [
            Run(code, scenario, strategy)
            for scenario, code, strategy in itertools.product(scenarios, codes, STRATEGIES)
        ]
        started = time.monotonic()
        with ThreadPoolExecutor(args.processes) as pool:
            figures = list(pool.map(lambda run: simulate(run, codes[run.code]), runs))
        elapsed = time.monotonic() - started
    print(f"baseline {args.baseline} = {commit[:12]}; this tree = {REPO}")
    print(f"{len(runs)} simulations, {elapsed:.0f} s wall-clock, {args.processes} at a time\n")
    problems = []
    for scenario in scenarios:
        results = {
            (run.code, run.strategy): f
            for run, f in zip(runs, figures, strict=True)
            if run.scenario == scenario
        }
        lines, found = table(scenario.stem, args.baseline, results)
        problems += found
        print(f"{scenario.stem}:\n")
        print("\n".join(lines))
        for strategy in BATCH_STRATEGIES:
            before = results[args.baseline, strategy]
            after = results[THIS, strategy]
            ratio = before["batchChanges"] / max(after["batchChanges"], 1)
            print(
                f"\n{strategy}: batch changes {before['batchChanges']} -> {after['batchChanges']}"
                f" ({ratio:.1f}x fewer; 0 counted as 1), pods that waited"
                f" {before['podsWaited']} -> {after['podsWaited']}"
            )
            if args.require_fewer_changes is not None and strategy == "phase4":
                if ratio < args.require_fewer_changes:
                    problems.append(f"{scenario.stem}: only {ratio:.1f}x fewer batch changes")
                if after["podsWaited"] > before["podsWaited"]:
                    problems.append(f"{scenario.stem}: more pods waited for an IP")
        print()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
