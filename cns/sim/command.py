"""`cns simulate`: run a scenario under each strategy and print the summary (docs/simulate.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cns.config.daemon_config import ConfigError
from cns.sim.engine import simulate
from cns.sim.progress import ProgressBar
from cns.sim.report import summary_rows, to_json
from cns.sim.scenario import load
from cns.sim.strategies import DEFAULT_STRATEGIES, STRATEGIES
from cns.support.table import table


def run_simulation(
    file: Path,
    *,
    strategies: list[str] | None,
    seed: int | None,
    plot: Path | None,
    as_json: bool,
    progress: bool,
) -> int:
    """Exit code 2 for a bad scenario, an unknown strategy or charts without matplotlib."""
    try:
        scenario = load(file)
    except ConfigError as exc:
        print(f"cns simulate: {exc}", file=sys.stderr)
        return 2
    names = strategies or scenario.strategies or DEFAULT_STRATEGIES
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        known = ", ".join(STRATEGIES)
        print(f"cns simulate: unknown strategy {unknown[0]!r}; known: {known}", file=sys.stderr)
        return 2
    if plot is not None:
        try:
            from cns.sim.plot import write_charts
        except ImportError as exc:
            print(f"cns simulate: --plot needs matplotlib (cns[sim]): {exc}", file=sys.stderr)
            return 2
    seed = scenario.seed if seed is None else seed
    show_progress = progress or sys.stderr.isatty()
    bar = ProgressBar(sys.stderr, len(names)) if show_progress else None
    results = []
    for index, name in enumerate(names):
        reporter = bar.run(index, name) if bar is not None else None
        results.append(simulate(scenario, STRATEGIES[name], seed, reporter))
    if bar is not None:
        bar.close()
    if plot is not None:
        for path in write_charts(results, plot, scenario.name):
            print(f"wrote {path}", file=sys.stderr)
    if as_json:
        print(json.dumps(to_json(scenario, seed, results), indent=2))
        return 0
    print(f"scenario {scenario.name}: {scenario.duration_seconds:g} simulated seconds, seed {seed}")
    print(table(summary_rows(results)))
    return 0
