#!/usr/bin/env python3
"""A long churn soak of a real `cns run` daemon: do its memory, descriptors and state file stay
flat while pods come and go at a steady rate?

- One daemon (standalone, the default scaler: batch 16, the embedded allocator answering after
  200 ms like a remote control plane; state on disk). `--population` pods are ADDed first and
  kept: from then on each step DELs the oldest pod and ADDs a new one, `--rate` steps a second
  spread over `--workers` clients, each request on its own connection to the unix socket as the
  plugin makes it. The population is constant, so every figure below should be too.
- Every `--sample-every` seconds: the daemon's RSS (VmRSS), open descriptors, threads,
  `state.db` and `state.db-wal` sizes, the IPs it holds by state (`/debug/pool`), its CPU, and
  whether `/debug/ips` shows any address twice.
- At the end the churn stops, `/debug/ips` must show exactly the live pods on the addresses
  their ADDs were given; then every pod is DELeted and nothing may stay assigned. Any failed
  request, duplicate address or error in the daemon's log makes the run fail.

Over the second half of the run (the first half is warm-up: caches, SQLite's WAL reaching its
checkpoint size), each series gets a least-squares slope per hour and is called flat when that
slope is within its threshold (THRESHOLDS, printed with the results).

Run (no root needed): `.venv/bin/python -m bench.stress.soak --json /tmp/cns-bench/soak.json`
(default 1,800 s; `--seconds 120` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.benchlib import (
    BenchError,
    Daemon,
    log,
    machine_facts,
    metric_sum,
    open_descriptors,
    print_facts,
    proc_status,
    run_with_daemon,
    stop_and_check,
    write_json,
)
from bench.performance.daemon_throughput import CloseTransport
from bench.performance.debug_reader import pod

SUBNET = "10.245.0.0/22"
MIB = 1024 * 1024
# What "flat" means, per hour of the fitted line over the second half. At the default 20 steps
# a second (72,000 ADD+DEL pairs an hour) a leak of one 64-byte object per pair is 4.4 MiB/h, one
# descriptor per 7,200 pairs is 10/h, one IP per 7,200 DELs is 10/h. The margins are for the
# noise of a sample: requests in flight hold a descriptor and an IP for a moment.
THRESHOLDS = {
    "rssMiB": 4.0,
    "fds": 10.0,
    "stateMiB": 1.0,
    "assigned": 10.0,
}


@dataclass
class Sample:
    t: float  # seconds since the churn started
    rss_kib: int
    fds: int
    threads: int
    db_bytes: int
    wal_bytes: int
    assigned: int
    held: int  # every IP in the pool, whatever its state
    cpu_seconds: float
    steps: int
    errors: int
    duplicate_addresses: int


@dataclass
class Churn:
    """The clients' shared state: the live pods (oldest first) and what went wrong."""

    live: deque[tuple[str, str]] = field(default_factory=deque)  # (container, address)
    steps: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    late_steps: int = 0  # steps that started more than one interval after their slot
    next_name: int = 0

    def name(self) -> str:
        self.next_name += 1
        return f"soak-{self.next_name}"


async def add(socket_path: str, churn: Churn) -> None:
    container = churn.name()
    status, body = await CloseTransport(socket_path).call("/v1/cni/add", pod(container))
    if status != 200:
        churn.errors[f"ADD {status}: {body[:160].decode(errors='replace')}"] += 1
        return
    churn.live.append((container, json.loads(body)["ips"][0]["address"].split("/")[0]))


async def delete(socket_path: str, churn: Churn, container: str, address: str) -> None:
    key = {"containerID": container, "ifName": "eth0"}
    status, body = await CloseTransport(socket_path).call("/v1/cni/del", key)
    if status != 200:
        churn.errors[f"DEL {status}: {body[:160].decode(errors='replace')}"] += 1
    elif json.loads(body).get("released") != address:
        churn.errors["DEL released another address"] += 1


async def run_churn(socket_path: str, args: argparse.Namespace, churn: Churn) -> None:
    """`--workers` clients, each taking every `workers`-th slot of a `--rate` per second clock."""
    interval = args.workers / args.rate
    began = time.monotonic()
    deadline = began + args.seconds

    async def worker(index: int) -> None:
        slot = began + index / args.rate
        while slot < deadline:
            now = time.monotonic()
            if now < slot:
                await asyncio.sleep(slot - now)
            elif now - slot > interval:
                churn.late_steps += 1
            slot += interval
            if churn.live:  # only a failed ADD could leave it empty: counted as an error
                await delete(socket_path, churn, *churn.live.popleft())
            await add(socket_path, churn)
            churn.steps += 1

    await asyncio.gather(*(worker(i) for i in range(args.workers)))


def take_sample(daemon: Daemon, began: float, churn: Churn) -> Sample:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    pool = daemon.pool()
    addresses = Counter(ip["address"] for ip in daemon.get("/debug/ips")["ips"])
    db = daemon.state_dir / "state.db"
    wal = daemon.state_dir / "state.db-wal"
    return Sample(
        t=round(time.monotonic() - began, 1),
        rss_kib=proc_status(pid, "VmRSS"),
        fds=open_descriptors(pid),
        threads=proc_status(pid, "Threads"),
        db_bytes=db.stat().st_size,
        wal_bytes=wal.stat().st_size if wal.exists() else 0,
        assigned=pool["ips"]["Assigned"],
        held=sum(pool["ips"].values()),
        cpu_seconds=daemon.cpu_seconds(),
        steps=churn.steps,
        errors=sum(churn.errors.values()),
        duplicate_addresses=sum(1 for count in addresses.values() if count > 1),
    )


class Sampler:
    """Samples every `every` seconds on its own thread while the churn runs on the loop."""

    def __init__(self, daemon: Daemon, churn: Churn, every: float) -> None:
        self.daemon, self.churn, self.every = daemon, churn, every
        self.samples: list[Sample] = []
        self.failure: str | None = None
        self.began = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(take_sample(self.daemon, self.began, self.churn))
            except (OSError, ValueError, BenchError) as exc:
                self.failure = f"sampling failed: {type(exc).__name__}: {exc}"
                return
            if self.done.wait(self.every):
                return

    def stop(self) -> list[Sample]:
        self.done.set()
        self.thread.join(timeout=60)
        self.samples.append(take_sample(self.daemon, self.began, self.churn))
        return self.samples


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, in value per hour."""
    n = len(points)
    if n < 2:
        return float("nan")
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return float("nan")
    return 3600 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


SERIES: dict[str, Callable[[Sample], float]] = {
    "rssMiB": lambda s: s.rss_kib / 1024,
    "fds": lambda s: s.fds,
    "stateMiB": lambda s: (s.db_bytes + s.wal_bytes) / MIB,
    "assigned": lambda s: s.assigned,
}


def trends(samples: list[Sample], seconds: float) -> dict[str, dict[str, Any]]:
    """Per series over the second half: first/last/min/max, the slope per hour, flat or not."""
    half = [s for s in samples if s.t >= seconds / 2]
    out = {}
    for name, value in SERIES.items():
        values = [value(s) for s in half]
        slope = slope_per_hour([(s.t, value(s)) for s in half])
        out[name] = {
            "samples": len(half),
            "fittedChange": round(slope * (half[-1].t - half[0].t) / 3600, 3),
            "first": round(values[0], 2),
            "last": round(values[-1], 2),
            "min": round(min(values), 2),
            "max": round(max(values), 2),
            "slopePerHour": round(slope, 3),
            "threshold": THRESHOLDS[name],
            "flat": abs(slope) <= THRESHOLDS[name],
        }
    return out


def final_check(daemon: Daemon, churn: Churn) -> list[str]:
    """After the churn: `/debug/ips` holds exactly the live pods, as replied; then DEL them all."""
    problems = []
    owners = {
        ip["owner"]["containerID"]: ip["address"]
        for ip in daemon.get("/debug/ips")["ips"]
        if ip["owner"]
    }
    expected = dict(churn.live)
    if owners != expected:
        wrong = sorted(set(owners.items()) ^ set(expected.items()))[:5]
        problems.append(f"/debug/ips disagrees with the live pods: {wrong}")
    socket_path = str(daemon.socket)

    async def delete_all() -> None:
        while churn.live:
            await delete(socket_path, churn, *churn.live.popleft())

    asyncio.run(delete_all())
    left = [ip for ip in daemon.get("/debug/ips")["ips"] if ip["owner"]]
    if left:
        problems.append(f"{len(left)} IPs still assigned after every pod was deleted: {left[:3]}")
    return problems


def print_report(samples: list[Sample], found: dict[str, dict[str, Any]]) -> None:
    print(f"{'t (s)':>7} {'steps':>7} {'RSS MiB':>8} {'fds':>5} {'threads':>7} {'db KiB':>7} "
          f"{'wal KiB':>8} {'assigned':>8} {'held':>5} {'cns CPU s':>9}")  # fmt: skip
    every = max(1, len(samples) // 30)
    for sample in samples[::every] + ([samples[-1]] if (len(samples) - 1) % every else []):
        print(
            f"{sample.t:>7.0f} {sample.steps:>7} {sample.rss_kib / 1024:>8.1f} {sample.fds:>5} "
            f"{sample.threads:>7} {sample.db_bytes / 1024:>7.0f} {sample.wal_bytes / 1024:>8.0f} "
            f"{sample.assigned:>8} {sample.held:>5} {sample.cpu_seconds:>9.1f}"
        )
    print()
    print("second half of the run, least-squares slope per hour (flat: |slope| <= threshold):")
    for name, row in found.items():
        verdict = "flat" if row["flat"] else "NOT FLAT"
        print(
            f"  {name:<9} slope {row['slopePerHour']:>+9.3f}/h  threshold {row['threshold']:>5g}/h"
            f"  fitted change {row['fittedChange']:>+8.3f}  range {row['min']:g}..{row['max']:g}"
            f"  {verdict}"
        )


def run(daemon: Daemon, args: argparse.Namespace) -> list[str]:
    facts = machine_facts(daemon.state_dir.parent)
    load_before = [round(x, 2) for x in os.getloadavg()]
    daemon.start()
    churn = Churn()
    socket_path = str(daemon.socket)
    log(f"adding {args.population} pods")

    async def populate() -> None:
        for _ in range(args.population):
            await add(socket_path, churn)

    asyncio.run(populate())
    if churn.errors:
        raise BenchError(f"populating failed: {dict(churn.errors)}")
    before = daemon.metrics()
    log(f"churning {args.rate:g} DEL+ADD steps/s for {args.seconds:g} s")
    sampler = Sampler(daemon, churn, args.sample_every)
    asyncio.run(run_churn(socket_path, args, churn))
    samples = sampler.stop()
    after = daemon.metrics()
    waited = metric_sum(after, "cns_add_ip_wait_seconds_count") - metric_sum(
        before, "cns_add_ip_wait_seconds_count"
    )
    problems = [sampler.failure] if sampler.failure else []
    problems += final_check(daemon, churn)
    problems += stop_and_check(daemon)
    found = trends(samples, args.seconds)
    print("cns churn soak")
    print_facts(facts)
    print(
        f"  load        1-min load average {load_before[0]} before, {os.getloadavg()[0]:.2f} "
        "after (other jobs share the machine)"
    )
    print(
        f"  churn       {args.population} pods, {args.rate:g} DEL+ADD steps/s by "
        f"{args.workers} clients for {args.seconds:g} s: {churn.steps} steps "
        f"({churn.steps / args.seconds:.2f}/s), {churn.late_steps} late, "
        f"{waited:g} ADDs waited for the pool"
    )
    print()
    print_report(samples, found)
    problems += [f"{count} x {error}" for error, count in churn.errors.items()]
    problems += [
        f"t={s.t}: an address twice in /debug/ips" for s in samples if s.duplicate_addresses
    ]
    not_flat = [name for name, row in found.items() if not row["flat"]]
    if not_flat:
        problems.append(f"not flat over the second half: {', '.join(not_flat)}")
    if args.json:
        results = {
            "settings": {
                "seconds": args.seconds,
                "rate": args.rate,
                "population": args.population,
                "workers": args.workers,
                "sampleEvery": args.sample_every,
            },
            "steps": churn.steps,
            "lateSteps": churn.late_steps,
            "waitedAdds": waited,
            "secondHalf": found,
            "samples": [asdict(s) for s in samples],
            "problems": problems,
        }
        write_json(args.json, "soak", facts, load_before, results)
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1800.0, help="length of the churn")
    parser.add_argument("--rate", type=float, default=20.0, help="DEL+ADD steps per second")
    parser.add_argument("--population", type=int, default=100, help="pods kept at all times")
    parser.add_argument("--workers", type=int, default=4, help="concurrent clients")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--tmp-dir", help="parent of the daemon's state dir (on disk)")
    parser.add_argument("--json", help="also write the results (every sample) as JSON here")
    args = parser.parse_args(argv)
    if not 60 <= args.seconds <= 86400 or not 1 <= args.sample_every <= args.seconds / 10:
        parser.error("--seconds in 60..86400, --sample-every in 1..seconds/10")
    if not 0 < args.rate <= 500 or not 1 <= args.workers <= 64:
        parser.error("--rate in (0, 500], --workers in 1..64")
    if not args.workers <= args.population <= 200:
        parser.error("--population in workers..200 (the default maxIPCount is 250)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {"standalone": {"subnet": SUBNET}}
    return run_with_daemon("soak", args.tmp_dir, overrides, lambda d: run(d, args))


if __name__ == "__main__":
    sys.exit(main())
