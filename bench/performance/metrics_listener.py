#!/usr/bin/env python3
"""Pod ADD latency with the metrics listener on and scraped, against it off, paired, same run.

The metrics listener (`metrics.address`) renders /metrics on the event loop that serves the CNI
socket, like the debug endpoint. This measures what Prometheus scraping it costs the pods:
- Two daemons alike but for the listener: "off" has none; "on" has it on a loopback port and a
  scraper process GETs /metrics there every `--scrape-seconds` (default 1 s: 30 times the
  PodMonitor's 30 s interval) for as long as its ADDs are timed. Each holds `--resident` pods.
- `--clients` load clients stream ADD+DEL pairs through a daemon's unix socket, one connection
  per request as the plugin does, and time every ADD (`debug_reader.churn`); the pool never has
  to grow (checked).
- Rounds alternate an "off" phase and an "on" phase, so drift hits both conditions alike. The
  report: p50 and p99 of each condition, pooled, their ratio, and the p50 ratio of each pair.

Run (no root needed): `.venv/bin/python -m bench.performance.metrics_listener`
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from bench.benchlib import (
    BenchError,
    Daemon,
    exit_cleanly_on_sigterm,
    free_port,
    log,
    machine_facts,
    percentile,
    print_facts,
    stop_and_check,
    temp_work_dir,
)
from bench.performance.debug_reader import (
    Phase,
    check_load_arguments,
    load_arguments,
    start_with_residents,
    timed_churn,
)

# GET /metrics every `interval` seconds on a new connection, as Prometheus does by default;
# prints its counts on SIGTERM.
SCRAPER = """
import http.client, json, signal, sys, time
port, interval = int(sys.argv[1]), float(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
served = failed = 0
print("ready", flush=True)
while not stop:
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        response.read()
        conn.close()
        served += response.status == 200
        failed += response.status != 200
    except (OSError, http.client.HTTPException):
        failed += 1
    time.sleep(max(0.0, interval - (time.monotonic() - started)))
print(json.dumps({"served": served, "failed": failed}), flush=True)
"""
CONDITIONS = ("off", "on")


def start_scraper(port: int, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", SCRAPER, str(port), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline() != "ready\n":
        raise BenchError("the scraper did not start")
    return proc


def stop_scraper(proc: subprocess.Popen[str]) -> tuple[int, int]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    counts = json.loads(out.strip().splitlines()[-1])
    return counts["served"], counts["failed"]


def measure_phase(daemon: Daemon, args: argparse.Namespace, phase: Phase, tag: str) -> None:
    port = getattr(daemon, "metrics_port", None)
    scraper = start_scraper(port, args.scrape_seconds) if port is not None else None
    timed_churn(daemon, args, phase, tag)
    if scraper is not None:
        phase.debug_served, phase.debug_failed = stop_scraper(scraper)


def report(phases: list[Phase]) -> None:
    ms = 1000.0
    rows = {}
    print(f"{'listener':<9} {'ADDs':>6} {'p50 ms':>8} {'p99 ms':>8} {'scrapes':>8} "
          f"{'failed':>7} {'cns CPU %':>10}")  # fmt: skip
    for condition in CONDITIONS:
        group = [p for p in phases if p.condition == condition]
        adds = [x for p in group for x in p.adds]
        seconds = sum(p.seconds for p in group)
        rows[condition] = (percentile(adds, 50) * ms, percentile(adds, 99) * ms)
        print(
            f"{condition:<9} {len(adds):>6} {rows[condition][0]:>8.3f} {rows[condition][1]:>8.3f} "
            f"{sum(p.debug_served for p in group):>8} {sum(p.debug_failed for p in group):>7} "
            f"{100 * sum(p.daemon_cpu for p in group) / seconds:>10.1f}"
        )
    (off50, off99), (on50, on99) = rows["off"], rows["on"]
    print(f"ratio (on / off), all rounds pooled: p50 {on50 / off50:.2f}, p99 {on99 / off99:.2f}")
    pairs = [
        percentile(on.adds, 50) / percentile(off.adds, 50)
        for off, on in zip(phases[::2], phases[1::2], strict=True)
    ]
    print(
        f"p50 ratio per pair: {' '.join(f'{r:.2f}' for r in pairs)} "
        f"(median {percentile(pairs, 50):.2f})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = load_arguments(__doc__.split("\n\n")[0], rounds=8)
    parser.add_argument("--scrape-seconds", type=float, default=1.0, help="scrape interval")
    args = parser.parse_args(argv)
    check_load_arguments(parser, args)
    if not 0.1 <= args.scrape_seconds <= 60:
        parser.error("--scrape-seconds must be in 0.1..60")
    return args


def make_daemons(workdir: Path) -> dict[str, Daemon]:
    """The two daemons, alike but for the metrics listener (and their subnets)."""
    daemons = {}
    for n, condition in enumerate(CONDITIONS):
        (workdir / condition).mkdir()
        overrides: dict[str, object] = {
            # The churn hands each new pod a released address at once: with the cooldown
            # (30 s) its hundreds of pods a second would need far more than maxIPCount.
            "ipCooldownSeconds": 0,
            "scaler": {"maxIPCount": 1000},
            "standalone": {"subnet": f"10.24{4 + n}.0.0/22", "allocationLatencyMs": 20},
        }
        port = free_port() if condition == "on" else None
        if port is not None:
            overrides["metrics"] = {"address": "127.0.0.1", "port": port}
        daemon = Daemon(workdir / condition, overrides)
        if port is not None:
            daemon.metrics_port = port  # type: ignore[attr-defined]
        daemons[condition] = daemon
    return daemons


def run(daemons: dict[str, Daemon], args: argparse.Namespace) -> list[str]:
    facts = machine_facts(next(iter(daemons.values())).state_dir.parent)
    for condition, daemon in daemons.items():
        log(f"metrics listener {condition}")
        start_with_residents(daemon, args)
    phases: list[Phase] = []
    for round_ in range(args.rounds):
        for condition in CONDITIONS:
            log(f"round {round_ + 1}/{args.rounds}: metrics listener {condition}")
            phase = Phase(condition)
            measure_phase(daemons[condition], args, phase, f"{round_}{condition}")
            phases.append(phase)
    stopped = [problem for daemon in daemons.values() for problem in stop_and_check(daemon)]
    print("cns metrics listener (scraped) versus pod ADDs")
    print_facts(facts)
    print(f"  load        {args.clients} ADD+DEL clients, {args.resident} resident pods; "
          f"/metrics scraped every {args.scrape_seconds:g} s while 'on' is timed")  # fmt: skip
    print(f"  runs        {args.rounds} x ({args.seconds:g} s off + {args.seconds:g} s on), "
          "interleaved")  # fmt: skip
    print()
    report(phases)
    problems = [f"{p.condition}: {p.errors} failed ADDs" for p in phases if p.errors]
    problems += [f"{p.condition}: {p.waited_adds:g} ADDs waited for the pool"
                 for p in phases if p.waited_adds]  # fmt: skip
    problems += [
        f"{p.condition}: {p.debug_failed} failed scrapes" for p in phases if p.debug_failed
    ]
    return problems + stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir = temp_work_dir("cns-metrics-listener-", args.tmp_dir)
    daemons = make_daemons(workdir)
    try:
        problems = run(daemons, args)
    except BenchError as exc:
        problems = [str(exc)]
    finally:
        for daemon in daemons.values():
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if problems:
        print(f"metrics-listener: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
