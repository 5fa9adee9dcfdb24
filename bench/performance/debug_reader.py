#!/usr/bin/env python3
"""Pod ADD latency of a real `cns run` daemon with and without busy debug readers, same run.

The debug endpoint (`/debug/ips`, `/metrics`) is rendered on the daemon's event loop, the same
loop that serves the CNI socket, and any local user can read it. This measures what a reader
that never stops costs the pods:
- One daemon; `--resident` pods hold an IP for the whole run (with pod names), so `/debug/ips`
  lists a few hundred owners and `/metrics` has every request histogram filled.
- `--clients` load clients stream ADD+DEL pairs through the unix socket, one connection per
  request as the plugin does, and time every ADD. The pool never has to grow (checked:
  `cns_add_ip_wait_seconds_count` must not move).
- Rounds alternate a baseline phase (no readers) and a loaded phase (`--readers` processes,
  each looping GET /debug/ips and GET /metrics on a keep-alive connection as fast as the daemon
  answers), so drift hits both conditions alike. Latencies are pooled per condition; the report
  is the loaded/baseline ratio of p50 and p99, plus what the readers got served.

Run (no root needed): `.venv/bin/python -m bench.performance.debug_reader`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.benchlib import (
    BenchError,
    Daemon,
    log,
    machine_facts,
    metric_sum,
    percentile,
    print_facts,
    run_with_daemon,
    stop_and_check,
)
from bench.performance.daemon_throughput import CloseTransport

READ_PATHS = ("/debug/ips", "/metrics")


# --- the reader processes ---------------------------------------------------------------------

# One reader: loops over the paths on one keep-alive connection, says "ready" after its first
# round, and prints its counts on SIGTERM. Run as its own small interpreter (`-I -S`), so that its
# start-up is quick and over before the pods are timed.
READER = """
import http.client, json, signal, sys
port, paths = int(sys.argv[1]), sys.argv[2:]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
served = failed = 0
conn = None
while not stop:
    for path in paths:
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                served += 1
            else:
                failed += 1
        except (OSError, http.client.HTTPException):
            failed += 1
            conn = None
    if served == len(paths):
        print("ready", flush=True)
print(json.dumps({"served": served, "failed": failed}), flush=True)
"""


class Readers:
    """`count` reader processes hammering the debug port; `stop()` returns what they got."""

    def __init__(self, count: int, port: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", READER, str(port), *READ_PATHS],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]
        for proc in self.procs:  # every reader is up and looping before the pods are timed
            assert proc.stdout is not None
            if proc.stdout.readline() != "ready\n":
                raise BenchError("a debug reader did not start")

    def stop(self) -> tuple[int, int]:
        served = failed = 0
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            out, _ = proc.communicate(timeout=60)
            counts = json.loads(out.strip().splitlines()[-1])
            served += counts["served"]
            failed += counts["failed"]
        return served, failed


# --- the pods -----------------------------------------------------------------------------------


async def call(socket_path: str, path: str, body: dict[str, Any]) -> int:
    """One request on its own connection, as the plugin makes it; the HTTP status."""
    status, _ = await CloseTransport(socket_path).call(path, body)
    return status


def pod(name: str) -> dict[str, Any]:
    return {
        "containerID": name,
        "ifName": "eth0",
        "netns": f"/run/netns/{name}",
        "podName": name,
        "podNamespace": "bench",
    }


@dataclass
class Phase:
    condition: str
    seconds: float = 0.0
    adds: list[float] = field(default_factory=list)
    errors: int = 0
    debug_served: int = 0
    debug_failed: int = 0
    daemon_cpu: float = 0.0
    waited_adds: float = 0.0


async def churn(socket_path: str, clients: int, seconds: float, phase: Phase, tag: str) -> None:
    """`clients` loops of ADD then DEL, each ADD timed, for `seconds`."""
    deadline = time.monotonic() + seconds

    async def client(n: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            name = f"churn-{tag}-{n}-{i}"
            i += 1
            started = time.perf_counter()
            status = await call(socket_path, "/v1/cni/add", pod(name))
            elapsed = time.perf_counter() - started
            if status != 200:
                phase.errors += 1
                continue
            phase.adds.append(elapsed)
            key = {"containerID": name, "ifName": "eth0"}
            if await call(socket_path, "/v1/cni/del", key) != 200:
                phase.errors += 1

    await asyncio.gather(*(client(n) for n in range(clients)))


def timed_churn(daemon: Daemon, args: argparse.Namespace, phase: Phase, tag: str) -> None:
    """One phase's churn against the daemon, with its time, the daemon's CPU and the ADDs that
    waited for the pool (there should be none) put in `phase`."""
    waits = "cns_add_ip_wait_seconds_count"
    before = metric_sum(daemon.metrics(), waits)
    cpu = daemon.cpu_seconds()
    started = time.monotonic()
    asyncio.run(churn(str(daemon.socket), args.clients, args.seconds, phase, tag))
    phase.seconds = time.monotonic() - started
    phase.daemon_cpu = daemon.cpu_seconds() - cpu
    phase.waited_adds = metric_sum(daemon.metrics(), waits) - before


def measure_phase(daemon: Daemon, args: argparse.Namespace, phase: Phase, tag: str) -> None:
    readers = Readers(args.readers, daemon.port) if phase.condition != "baseline" else None
    timed_churn(daemon, args, phase, tag)
    if readers is not None:
        phase.debug_served, phase.debug_failed = readers.stop()


def report(phases: list[Phase], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    ms = 1000.0
    rows: dict[str, dict[str, float]] = {}
    for condition in ("baseline", f"{args.readers} readers"):
        group = [p for p in phases if p.condition == condition]
        adds = [x for p in group for x in p.adds]
        seconds = sum(p.seconds for p in group)
        rows[condition] = {
            "adds": len(adds),
            "p50": percentile(adds, 50) * ms,
            "p99": percentile(adds, 99) * ms,
            "debugPerSecond": sum(p.debug_served for p in group) / seconds,
            "debugFailed": sum(p.debug_failed for p in group),
            "cpu": 100 * sum(p.daemon_cpu for p in group) / seconds,
        }
    print(f"{'condition':<12} {'ADDs':>6} {'p50 ms':>8} {'p99 ms':>8} {'debug req/s':>12} "
          f"{'failed':>7} {'cns CPU %':>10}  p50 ms per round")  # fmt: skip
    for condition, row in rows.items():
        rounds = " ".join(
            f"{percentile(p.adds, 50) * ms:.2f}" for p in phases if p.condition == condition
        )
        print(
            f"{condition:<12} {row['adds']:>6.0f} {row['p50']:>8.3f} {row['p99']:>8.3f} "
            f"{row['debugPerSecond']:>12.1f} {row['debugFailed']:>7.0f} {row['cpu']:>10.1f}  "
            f"{rounds}"
        )
    base, loaded = rows.values()
    print(
        f"ratio (readers / baseline), all rounds pooled: p50 {loaded['p50'] / base['p50']:.2f}, "
        f"p99 {loaded['p99'] / base['p99']:.2f}"
    )
    # Each loaded phase against the baseline phase just before it: the machine's own drift
    # (other load on the same cores) cancels out within a pair.
    pairs = [
        percentile(loaded_phase.adds, 50) / percentile(base_phase.adds, 50)
        for base_phase, loaded_phase in zip(phases[::2], phases[1::2], strict=True)
    ]
    print(
        f"p50 ratio per round: {' '.join(f'{r:.2f}' for r in pairs)} "
        f"(median {percentile(pairs, 50):.2f})"
    )
    return rows


def load_arguments(description: str, *, rounds: int) -> argparse.ArgumentParser:
    """The arguments of a paired ADD latency benchmark: its load, rounds and phases."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--clients", type=int, default=2, help="concurrent ADD+DEL loops")
    parser.add_argument("--resident", type=int, default=300, help="pods holding an IP")
    parser.add_argument("--rounds", type=int, default=rounds, help="pairs of phases")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one phase")
    parser.add_argument("--tmp-dir", help="parent of the daemons' state dirs (on disk)")
    return parser


def check_load_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 1 <= args.clients <= 16 or not 1 <= args.rounds <= 20:
        parser.error("--clients must be in 1..16 and --rounds in 1..20")
    if not 1 <= args.seconds <= 60 or not 0 <= args.resident <= 900:
        parser.error("--seconds must be in 1..60 and --resident in 0..900")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = load_arguments(__doc__.split("\n\n")[0], rounds=4)
    parser.add_argument("--readers", type=int, default=8, help="debug reader processes")
    args = parser.parse_args(argv)
    check_load_arguments(parser, args)
    if not 1 <= args.readers <= 64:
        parser.error("--readers must be in 1..64")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {
        # The churn hands each new pod a released address at once: with the cooldown
        # (30 s) its hundreds of pods a second would need far more than maxIPCount.
        "ipCooldownSeconds": 0,
        "scaler": {"maxIPCount": 1000},
        "standalone": {"subnet": "10.243.0.0/22", "allocationLatencyMs": 20},
    }
    return run_with_daemon("debug-reader", args.tmp_dir, overrides, lambda d: run(d, args))


def start_with_residents(daemon: Daemon, args: argparse.Namespace) -> None:
    """Start the daemon, give `--resident` pods an IP each, and wait for free IPs enough for
    the load clients."""
    daemon.start()
    log(f"assigning {args.resident} resident pods")

    async def residents() -> list[int]:
        return [await call(str(daemon.socket), "/v1/cni/add", pod(f"resident-{n}"))
                for n in range(args.resident)]  # fmt: skip

    statuses = asyncio.run(residents())
    if any(status != 200 for status in statuses):
        raise BenchError(f"resident ADDs failed: {statuses}")
    daemon.wait_pool(
        lambda p: p["ips"]["Available"] >= 2 * args.clients and p["waitingAdds"] == 0,
        "free IPs for the load clients",
    )


def run(daemon: Daemon, args: argparse.Namespace) -> list[str]:
    """Residents, then the interleaved phases; prints the report, returns what went wrong."""
    facts = machine_facts(daemon.state_dir.parent)
    start_with_residents(daemon, args)
    phases: list[Phase] = []
    for round_ in range(args.rounds):
        for condition in ("baseline", f"{args.readers} readers"):
            log(f"round {round_ + 1}/{args.rounds}: {condition}")
            phase = Phase(condition)
            measure_phase(daemon, args, phase, f"{round_}{condition[0]}")
            phases.append(phase)
    stopped = stop_and_check(daemon)
    print("cns debug readers versus pod ADDs")
    print_facts(facts)
    print(
        f"  load        {args.clients} ADD+DEL clients, {args.resident} resident pods, "
        f"{args.readers} reader processes on {', '.join(READ_PATHS)}"
    )
    print(f"  runs        {args.rounds} x ({args.seconds:g} s baseline + {args.seconds:g} s "
          "with readers), interleaved")  # fmt: skip
    print()
    report(phases, args)
    problems = [f"{p.condition}: {p.errors} failed ADDs" for p in phases if p.errors]
    problems += [
        f"{p.condition}: {p.waited_adds:g} ADDs waited for the pool" for p in phases
        if p.waited_adds
    ]  # fmt: skip
    return problems + stopped


if __name__ == "__main__":
    sys.exit(main())
