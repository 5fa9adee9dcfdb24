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
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.benchlib import (
    BenchError,
    Daemon,
    exit_cleanly_on_sigterm,
    free_port,
    log,
    machine_facts,
    metric_sum,
    percentile,
    print_facts,
    stop_and_check,
    temp_work_dir,
)
from bench.performance.debug_reader import Phase, call, churn, pod

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
    before = daemon.metrics()
    cpu = daemon.cpu_seconds()
    started = time.monotonic()
    asyncio.run(churn(str(daemon.socket), args.clients, args.seconds, phase, tag))
    phase.seconds = time.monotonic() - started
    phase.daemon_cpu = daemon.cpu_seconds() - cpu
    if scraper is not None:
        phase.debug_served, phase.debug_failed = stop_scraper(scraper)
    waits = "cns_add_ip_wait_seconds_count"
    phase.waited_adds = metric_sum(daemon.metrics(), waits) - metric_sum(before, waits)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2, help="concurrent ADD+DEL loops")
    parser.add_argument("--resident", type=int, default=300, help="pods holding an IP")
    parser.add_argument("--rounds", type=int, default=8, help="off+on phase pairs")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one phase")
    parser.add_argument("--scrape-seconds", type=float, default=1.0, help="scrape interval")
    parser.add_argument("--tmp-dir", help="parent of the daemons' state dirs (on disk)")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 16 or not 1 <= args.rounds <= 20:
        parser.error("--clients must be in 1..16 and --rounds in 1..20")
    if not 1 <= args.seconds <= 60 or not 0.1 <= args.scrape_seconds <= 60:
        parser.error("--seconds must be in 1..60 and --scrape-seconds in 0.1..60")
    if not 0 <= args.resident <= 900:
        parser.error("--resident must be in 0..900")
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
        daemon.start()
        log(f"{condition}: assigning {args.resident} resident pods")

        async def residents(daemon: Daemon = daemon) -> list[int]:
            return [await call(str(daemon.socket), "/v1/cni/add", pod(f"resident-{n}"))
                    for n in range(args.resident)]  # fmt: skip

        if any(status != 200 for status in asyncio.run(residents())):
            raise BenchError(f"{condition}: resident ADDs failed")
        daemon.wait_pool(
            lambda p: p["ips"]["Available"] >= 2 * args.clients and p["waitingAdds"] == 0,
            "free IPs for the load clients",
        )
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
