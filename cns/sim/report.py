"""What a run measured, as a per-strategy summary: rows for a table, and JSON for machines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cns.sim.recording import RunResult
from cns.sim.scenario import Scenario


def nearest_rank(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of `values` (0 for none): the smallest value with at least
    `fraction` (0..1) of them at or below it, so p100 is the maximum and every answer was observed.
    Not the interpolated percentile the benchmarks quote (bench/benchlib.py): a simulated wait is
    reported only as a value some pod really waited."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _round(value: float) -> float:
    return round(value, 3)


def last_third_start(result: RunResult) -> float:
    """Where the last third of the run begins: the stretch a steady scenario must be settled in."""
    return result.duration_seconds * 2 / 3


def late_batch_changes(result: RunResult, times: Sequence[float]) -> int:
    """Batch changes in the last third of the run: 0 when the batch has settled there (if the
    scenario holds its pods steady then, any other number is the batch cycling)."""
    start = last_third_start(result)
    return sum(1 for t in times if t >= start)


def _waits(waits: Sequence[float]) -> dict[str, float]:
    return {
        "p50": _round(nearest_rank(waits, 0.5)),
        "p99": _round(nearest_rank(waits, 0.99)),
        "max": _round(nearest_rank(waits, 1.0)),
    }


def has_overflow(result: RunResult) -> bool:
    """The scenario names overflow subnets or drains one: the table shows what they did."""
    return any(s.overflow or s.drain_at_seconds is not None for s in result.subnets.values())


def summary(result: RunResult) -> dict[str, Any]:
    """The figures the table shows, plus per-subnet detail."""
    first: tuple[float, str, float] | None = None
    for name, subnet in result.subnets.items():
        at, utilization = subnet.first_wait_at, subnet.first_wait_utilization
        if at is not None and utilization is not None and (first is None or at < first[0]):
            first = (at, name, utilization)
    return {
        "strategy": result.strategy,
        "podsCreated": result.pods_created,
        "podsWaited": len(result.waits),
        "waitSeconds": _waits(result.waits),
        "stillWaitingAtEnd": result.still_waiting,
        "peakPods": max(result.series.pods, default=0),
        "peakUnscheduledPods": result.peak_unscheduled,
        "peakWaitingForIP": result.peak_waiting_for_ip,
        "failedPods": result.failed_pods,
        "failedAdds": result.failed_adds,
        "unusedIPs": {"peak": result.peak_unused_ips, "mean": _round(result.mean_unused_ips)},
        "coolingIPs": {"peak": result.peak_cooling_ips, "mean": _round(result.mean_cooling_ips)},
        "podsDelayedByCooldown": result.pods_delayed_by_cooldown,
        "podsOverflowed": sum(s.overflowed_out for s in result.subnets.values()),
        "overflowGateOpenings": sum(s.gate_openings for s in result.subnets.values()),
        "peakPodsOnOverflow": max(result.series.overflow_pods, default=0),
        "utilization": _utilization(result),
        "firstWait": None
        if first is None
        else {
            "atSeconds": _round(first[0]),
            "subnet": first[1],
            "utilizationPercent": _round(100 * first[2]),
        },
        "batchChanges": sum(s.batch_changes for s in result.subnets.values()),
        "batchChangesLastThird": late_batch_changes(result, result.batch_change_times),
        "exhaustionFlips": sum(s.exhaustion_flips for s in result.subnets.values()),
        "nodesAdded": result.nodes_added,
        "nodesRemoved": result.nodes_removed,
        "finalNodes": result.final_nodes,
        "subnets": {
            name: {
                "capacity": subnet.capacity,
                "peakUtilizationPercent": _round(100 * subnet.peak_utilization),
                "meanUtilizationPercent": _round(100 * subnet.mean_utilization),
                "finalUtilizationPercent": _round(100 * subnet.final_utilization),
                "firstWaitUtilizationPercent": None
                if subnet.first_wait_utilization is None
                else _round(100 * subnet.first_wait_utilization),
                "exhaustionFlips": subnet.exhaustion_flips,
                "batchChanges": subnet.batch_changes,
                "batchChangesLastThird": late_batch_changes(result, subnet.batch_change_times),
                "criticalNodes": subnet.critical_nodes,
                "finalBatch": subnet.final_batch,
                "controllerRounds": subnet.rounds,
                "unusedIPs": {
                    "peak": subnet.peak_unused_ips,
                    "mean": _round(subnet.mean_unused_ips),
                },
                "coolingIPs": {
                    "peak": subnet.peak_cooling_ips,
                    "mean": _round(subnet.mean_cooling_ips),
                },
                "overflow": list(subnet.overflow),
                "drainAtSeconds": subnet.drain_at_seconds,
                "podsAssigned": subnet.pods_assigned,
                "podsWaited": len(subnet.waits),
                "waitSeconds": _waits(subnet.waits),
                "podsOverflowedOut": subnet.overflowed_out,
                "podsOverflowedIn": subnet.overflowed_in,
                "overflowGateOpenings": subnet.gate_openings,
            }
            for name, subnet in result.subnets.items()
        },
    }


def _utilization(result: RunResult) -> dict[str, Any] | None:
    """The most used subnet (reserved / capacity), its peak and time-weighted mean: what the
    reuse cooldown and the warm floor cost shows here, their IPs being reserved like any other
    (a peak is often the cold start's; the mean shows a steady cost)."""
    if not result.subnets:
        return None
    name, subnet = max(result.subnets.items(), key=lambda item: (item[1].mean_utilization, item[0]))
    return {
        "subnet": name,
        "peakPercent": _round(100 * subnet.peak_utilization),
        "meanPercent": _round(100 * subnet.mean_utilization),
    }


def to_json(scenario: Scenario, seed: int, results: Sequence[RunResult]) -> dict[str, Any]:
    """The whole comparison: per strategy its summary and its sampled time series."""
    return {
        "scenario": scenario.name,
        "seed": seed,
        "durationSeconds": scenario.duration_seconds,
        "strategies": {
            result.strategy: {
                **summary(result),
                "series": _series(result),
            }
            for result in results
        },
    }


def _series(result: RunResult) -> dict[str, Any]:
    series = result.series
    return {
        "time": [_round(t) for t in series.time],
        "utilizationPercent": {
            name: [_round(100 * u) for u in values] for name, values in series.utilization.items()
        },
        "batch": series.batch,
        "exhausted": series.exhausted,
        "pods": series.pods,
        "unscheduled": series.unscheduled,
        "waitingForIP": series.waiting_for_ip,
        "nodes": series.nodes,
        "unusedIPs": series.unused_ips,
        "coolingIPs": series.cooling_ips,
        "podsOnOverflow": series.overflow_pods,
    }


def summary_rows(results: Sequence[RunResult]) -> list[tuple[str, ...]]:
    """One row per figure, one column per strategy: the table `cns simulate` prints."""
    summaries = [summary(result) for result in results]

    def row(label: str, cell: Any) -> tuple[str, ...]:
        return (label, *(cell(s) for s in summaries))

    def first_wait(s: dict[str, Any]) -> str:
        first = s["firstWait"]
        if first is None:
            return "never waited"
        return (
            f"{first['utilizationPercent']:.1f}% ({first['subnet']}, t={first['atSeconds']:.0f}s)"
        )

    def utilization(s: dict[str, Any]) -> str:
        used = s["utilization"]
        if used is None:
            return "-"
        return f"{used['peakPercent']:.1f}% / {used['meanPercent']:.1f}% ({used['subnet']})"

    def seconds(key: str) -> Any:
        return lambda s: f"{s['waitSeconds'][key]:.1f}"

    rows = [
        ("", *(s["strategy"] for s in summaries)),
        row("pods created / peak live", lambda s: f"{s['podsCreated']} / {s['peakPods']}"),
        row("pods that waited for an IP", lambda s: str(s["podsWaited"])),
        row("  wait p50 (s)", seconds("p50")),
        row("  wait p99 (s)", seconds("p99")),
        row("  wait max (s)", seconds("max")),
        row("  still waiting at end", lambda s: str(s["stillWaitingAtEnd"])),
        row("peak pods waiting for an IP", lambda s: str(s["peakWaitingForIP"])),
        row("peak unscheduled pods", lambda s: str(s["peakUnscheduledPods"])),
        row("pods whose ADD failed", lambda s: f"{s['failedPods']} ({s['failedAdds']} ADDs)"),
        row("unused reserved IPs, peak", lambda s: str(s["unusedIPs"]["peak"])),
        row("unused reserved IPs, mean", lambda s: f"{s['unusedIPs']['mean']:.1f}"),
        row("  of which in cooldown, peak", lambda s: str(s["coolingIPs"]["peak"])),
        row("  of which in cooldown, mean", lambda s: f"{s['coolingIPs']['mean']:.1f}"),
        row("pods delayed by cooldown", lambda s: str(s["podsDelayedByCooldown"])),
        row("subnet utilization, peak / mean", utilization),
        row("utilization at first wait", first_wait),
        row("batch-size changes", lambda s: str(s["batchChanges"])),
        row("  in the last third", lambda s: str(s["batchChangesLastThird"])),
        row("exhaustion flips", lambda s: str(s["exhaustionFlips"])),
        row("nodes added / removed", lambda s: f"{s['nodesAdded']} / {s['nodesRemoved']}"),
        row("nodes at end", lambda s: str(s["finalNodes"])),
    ]
    if any(has_overflow(result) for result in results):
        rows += _overflow_rows(summaries)
    return rows


def _overflow_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """What overflow and draining did, and per subnet the pods given its addresses, those of
    them that waited, and its unused reserved IPs: where the room went."""

    def row(label: str, cell: Any) -> tuple[str, ...]:
        return (label, *(cell(s) for s in summaries))

    def subnet_cell(name: str) -> Any:
        def cell(s: dict[str, Any]) -> str:
            subnet = s["subnets"][name]
            unused = subnet["unusedIPs"]
            return (
                f"{subnet['podsAssigned']} / {subnet['podsWaited']} / "
                f"{unused['peak']} / {unused['mean']:.1f}"
            )

        return cell

    rows = [
        row("pods that overflowed", lambda s: str(s["podsOverflowed"])),
        row("  peak pods on an overflow IP", lambda s: str(s["peakPodsOnOverflow"])),
        row("overflow gate openings", lambda s: str(s["overflowGateOpenings"])),
        row("per subnet: pods given an IP /", lambda s: ""),
        row("  waited / unused peak / mean", lambda s: ""),
    ]
    rows += [row(f"  {name}", subnet_cell(name)) for name in summaries[0]["subnets"]]
    return rows
