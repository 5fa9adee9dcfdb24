#!/usr/bin/env python3
"""1,000 concurrent pod ADDs with and without 500 idle connections held on both listeners.

The issue-11 attack: any local user can hold connections open on the debug port, and anything
running as root can hold them on the CNI socket; before the connection caps and idle timeouts
(cns/web/listeners.py) that used up the daemon's descriptors and stopped every ADD. This
measures what such connections cost a burst of pods now, against the same burst without them, in
one run:
- One real `cns run` daemon (standalone, state on disk). `scaler.batchSize` is 1024, so the pool
  holds 1,023 free IPs before each burst and no ADD waits for the embedded allocator (checked:
  `cns_add_ip_wait_seconds_count` must not move): the figure is about connections, not about
  pool growth.
- A burst: `--adds` ADDs started at once from one asyncio client, each on its own connection to
  the unix socket as the plugin makes it (a full listen backlog is retried every 20 ms, as the
  plugin does), each timed from connect to reply. After the burst every ADD must have a 200,
  every address must be distinct and `/debug/ips` must show exactly these owners on these
  addresses; then all of them are DELeted and the pool settles back before the next burst.
- With idle connections: before the burst, two holder processes open `--idle` connections each,
  one to the unix socket and one to the debug port, send nothing, and reopen any the daemon
  closes (it closes a connection without a request after 5 s), so that many stay held for the
  whole burst. The debug listener accepts 64 of them; the others wait in the kernel's queues.
- Rounds alternate the two conditions (the order flips every round), so drift in the machine's
  own load hits both alike. Reported: ADD p50/p99 pooled per condition and their ratio (with idle
  / without), the ratio per round, burst duration, the daemon's CPU per ADD (what a burst cost
  it, whatever else the machine ran), and its peak open descriptors and RSS (sampled from /proc
  every 20 ms during each burst), against its connection caps. Before the rounds, the idle
  connections are held for `--hold-seconds` without any ADD: what holding them costs the daemon.

Run (no root needed): `.venv/bin/python -m bench.stress.load --json /tmp/cns-bench/load.json`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from typing import Any

from bench.benchlib import (
    BenchError,
    Daemon,
    log,
    machine_facts,
    metric_sum,
    open_descriptors,
    percentile,
    print_facts,
    proc_status,
    run_with_daemon,
    stop_and_check,
    write_json,
)
from bench.performance.daemon_throughput import CloseTransport
from bench.performance.debug_reader import pod
from cns.web.listeners import RESERVED_DESCRIPTORS

BATCH = 1024
SUBNET = "10.244.0.0/19"
ADD_TIMEOUT_SECONDS = 60.0
SAMPLE_SECONDS = 0.02
IDLE = "with idle connections"
BASELINE = "baseline"

# Holds `count` connections to a unix socket path or a TCP port of 127.0.0.1, sends nothing, and
# reopens any that the far end closes; says "ready" once all were opened, prints its counts as
# JSON when stdin ends. A unix connect that finds the backlog full (EAGAIN) is retried next pass.
HOLDER = """
import errno, json, resource, selectors, socket, sys
kind, target, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
address = target if kind == "unix" else ("127.0.0.1", int(target))
selector = selectors.DefaultSelector()
selector.register(sys.stdin, selectors.EVENT_READ)
held, wanted, reopened, refused, ready = set(), count, 0, 0, False
while True:
    while len(held) < wanted:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex(address) not in (0, errno.EINPROGRESS):
            s.close()
            refused += 1
            break
        held.add(s)
        selector.register(s, selectors.EVENT_READ)
    if not ready and len(held) == wanted:
        ready = True
        print("ready", flush=True)
    for key, _ in selector.select(timeout=0.05):
        if key.fileobj is sys.stdin:
            if not sys.stdin.readline():
                print(json.dumps({"held": len(held), "reopened": reopened, "refused": refused}))
                sys.exit(0)
            continue
        try:
            if key.fileobj.recv(4096):
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        selector.unregister(key.fileobj)
        key.fileobj.close()
        held.discard(key.fileobj)
        reopened += 1
"""


class Holders:
    """Two holder processes: `count` idle connections on the unix socket, `count` on the port."""

    def __init__(self, daemon: Daemon, count: int) -> None:
        targets = {"unix": str(daemon.socket), "tcp": str(daemon.port)}
        self.procs = {
            listener: subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", HOLDER, listener, target, str(count)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for listener, target in targets.items()
        }
        for listener, proc in self.procs.items():
            assert proc.stdout is not None
            if proc.stdout.readline() != "ready\n":
                raise BenchError(f"the {listener} holder did not get its connections")

    def stop(self) -> dict[str, dict[str, int]]:
        counts = {}
        for listener, proc in self.procs.items():
            out, _ = proc.communicate(timeout=60)
            counts[listener] = json.loads(out.strip().splitlines()[-1])
        return counts


class Sampler:
    """The daemon's open descriptors and RSS, every SAMPLE_SECONDS until `stop()`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fds: list[int] = []
        self.rss_kib: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.fds.append(open_descriptors(self.pid))
            self.rss_kib.append(proc_status(self.pid, "VmRSS"))
            self.done.wait(SAMPLE_SECONDS)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


@dataclass
class Burst:
    """One burst of ADDs under one condition, and what was seen around it."""

    condition: str
    round: int
    adds: list[float] = field(default_factory=list)  # seconds, successful ADDs
    addresses: dict[str, str] = field(default_factory=dict)  # container -> address
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    fds_before: int = 0
    fds_at_start: int = 0
    peak_fds: int = 0
    peak_rss_kib: int = 0
    daemon_cpu: float = 0.0
    client_cpu: float = 0.0
    waited_adds: float = 0.0
    cap_reached: dict[str, float] = field(default_factory=dict)
    holders: dict[str, dict[str, int]] = field(default_factory=dict)


async def timed_add(socket_path: str, container: str, burst: Burst) -> None:
    started = time.perf_counter()
    try:
        status, body = await asyncio.wait_for(
            CloseTransport(socket_path).call("/v1/cni/add", pod(container)), ADD_TIMEOUT_SECONDS
        )
    except (OSError, TimeoutError, ValueError) as exc:
        burst.errors.append(f"{container}: {type(exc).__name__}: {exc}")
        return
    elapsed = time.perf_counter() - started
    if status != 200:
        burst.errors.append(f"{container}: HTTP {status} {body[:200].decode(errors='replace')}")
        return
    burst.adds.append(elapsed)
    burst.addresses[container] = json.loads(body)["ips"][0]["address"].split("/")[0]


async def delete_all(socket_path: str, addresses: dict[str, str]) -> list[str]:
    """DEL every container of the burst at once; each must release the address it was given."""

    async def one(container: str, address: str) -> str | None:
        key = {"containerID": container, "ifName": "eth0"}
        status, body = await CloseTransport(socket_path).call("/v1/cni/del", key)
        if status != 200:
            return f"DEL {container}: HTTP {status} {body[:200].decode(errors='replace')}"
        released = json.loads(body).get("released")
        return None if released == address else f"DEL {container} released {released}"

    found = await asyncio.gather(*(one(c, a) for c, a in addresses.items()))
    return [problem for problem in found if problem]


def uniqueness_problems(burst: Burst, ips: list[dict[str, Any]]) -> list[str]:
    """Every address of the burst distinct, and `/debug/ips` agreeing with every reply."""
    problems = []
    replied = list(burst.addresses.values())
    if len(set(replied)) != len(replied):
        problems.append(f"{len(replied) - len(set(replied))} addresses given twice in the burst")
    owners = {ip["owner"]["containerID"]: ip["address"] for ip in ips if ip["owner"]}
    wrong = [c for c, a in burst.addresses.items() if owners.get(c) != a]
    if wrong:
        problems.append(f"{len(wrong)} ADDs not in /debug/ips as replied, e.g. {wrong[:3]}")
    if len(owners) != len(burst.addresses):
        problems.append(f"/debug/ips has {len(owners)} owners, the burst {len(burst.addresses)}")
    return problems


def settled(pool: dict[str, Any], adds: int) -> bool:
    """Nothing assigned, nothing in flight with the allocator, room for a whole burst."""
    ips = pool["ips"]
    return bool(
        ips["Assigned"] == 0
        and ips["PendingRelease"] == 0
        and ips["PendingProgramming"] == 0
        and pool["waitingAdds"] == 0
        and ips["Available"] >= adds
        and ips["Available"] == pool["requestedIPCount"]
    )


def debug_reachable(daemon: Daemon, timeout: float = 60) -> None:
    """After the holders let go the kernel may still be retrying SYNs it dropped: wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            daemon.get("/readyz")
            return
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise BenchError("debug port unreachable after the idle connections") from None
            time.sleep(0.1)


def wait_for_idle_connections(pid: int, expected: int, timeout: float = 10) -> int:
    """Until the daemon holds `expected` descriptors (it accepted the holders' connections)."""
    deadline = time.monotonic() + timeout
    while (fds := open_descriptors(pid)) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return fds


def run_burst(daemon: Daemon, args: argparse.Namespace, burst: Burst, caps: dict[str, int]) -> None:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    daemon.wait_pool(lambda p: settled(p, args.adds), "a settled pool", timeout=120)
    before = daemon.metrics()
    burst.fds_before = open_descriptors(pid)
    holders = None
    if burst.condition == IDLE:
        holders = Holders(daemon, args.idle)
        held = args.idle + min(args.idle, caps["debug"])
        burst.fds_at_start = wait_for_idle_connections(pid, burst.fds_before + held)
    else:
        burst.fds_at_start = burst.fds_before
    sampler = Sampler(pid)
    cpu, client_cpu = daemon.cpu_seconds(), time.process_time()
    started = time.perf_counter()
    socket_path = str(daemon.socket)
    names = [f"load-{burst.round}-{burst.condition[0]}-{n}" for n in range(args.adds)]

    async def all_adds() -> None:
        await asyncio.gather(*(timed_add(socket_path, name, burst) for name in names))

    try:
        asyncio.run(all_adds())
    finally:
        burst.seconds = time.perf_counter() - started
        burst.daemon_cpu = daemon.cpu_seconds() - cpu
        burst.client_cpu = time.process_time() - client_cpu
        sampler.stop()
        if holders is not None:
            burst.holders = holders.stop()
    burst.peak_fds = max(sampler.fds)
    burst.peak_rss_kib = max(sampler.rss_kib)
    debug_reachable(daemon)
    after = daemon.metrics()
    burst.waited_adds = metric_sum(after, "cns_add_ip_wait_seconds_count") - metric_sum(
        before, "cns_add_ip_wait_seconds_count"
    )
    for listener in ("socket", "debug"):
        name = f'cns_connection_cap_reached_total{{listener="{listener}"}}'
        burst.cap_reached[listener] = after.get(name, 0.0) - before.get(name, 0.0)
    burst.errors += uniqueness_problems(burst, daemon.get("/debug/ips")["ips"])
    burst.errors += asyncio.run(delete_all(socket_path, burst.addresses))


def holding_cost(
    daemon: Daemon, args: argparse.Namespace, caps: dict[str, int]
) -> dict[str, float]:
    """What the idle connections alone cost the daemon, no ADDs: its CPU over `--hold-seconds`
    while the holders keep them open (the daemon closes each after 5 s, the holder reopens it)."""
    assert daemon.proc is not None
    before = open_descriptors(daemon.proc.pid)
    holders = Holders(daemon, args.idle)
    try:
        wait_for_idle_connections(
            daemon.proc.pid, before + args.idle + min(args.idle, caps["debug"])
        )
        cpu, started = daemon.cpu_seconds(), time.monotonic()
        time.sleep(args.hold_seconds)
        cpu, seconds = daemon.cpu_seconds() - cpu, time.monotonic() - started
    finally:
        counts = holders.stop()
    debug_reachable(daemon)
    return {
        "seconds": round(seconds, 1),
        "daemonCpuPercent": round(100 * cpu / seconds, 1),
        "reopenedPerSecond": round(sum(c["reopened"] for c in counts.values()) / seconds, 1),
    }


def summarize(bursts: list[Burst]) -> dict[str, Any]:
    adds = [x for b in bursts for x in b.adds]
    ms = 1000.0
    return {
        "bursts": len(bursts),
        "adds": len(adds),
        "errors": sum(len(b.errors) for b in bursts),
        "p50Ms": round(percentile(adds, 50) * ms, 2),
        "p99Ms": round(percentile(adds, 99) * ms, 2),
        "maxMs": round(max(adds) * ms, 2) if adds else None,
        "burstSeconds": [round(b.seconds, 2) for b in bursts],
        "fdsAtBurstStart": max(b.fds_at_start for b in bursts),
        "peakFds": max(b.peak_fds for b in bursts),
        "peakRssMiB": round(max(b.peak_rss_kib for b in bursts) / 1024, 1),
        "daemonCpuPercent": round(
            100 * sum(b.daemon_cpu for b in bursts) / sum(b.seconds for b in bursts), 1
        ),
        # What a burst cost the daemon whatever else ran on the machine: CPU per ADD answered.
        "daemonCpuMsPerAdd": round(1000 * sum(b.daemon_cpu for b in bursts) / max(1, len(adds)), 3),
        "clientCpuPercent": round(
            100 * sum(b.client_cpu for b in bursts) / sum(b.seconds for b in bursts), 1
        ),
        "waitedAdds": int(sum(b.waited_adds for b in bursts)),
        "capReached": {
            listener: int(sum(b.cap_reached.get(listener, 0) for b in bursts))
            for listener in ("socket", "debug")
        },
        "holders": [b.holders for b in bursts if b.holders],
    }


def report(bursts: list[Burst], args: argparse.Namespace) -> dict[str, Any]:
    rows = {c: summarize([b for b in bursts if b.condition == c]) for c in (BASELINE, IDLE)}
    base, idle = rows[BASELINE], rows[IDLE]
    per_round = []
    for number in range(args.rounds):
        pair = {b.condition: b for b in bursts if b.round == number}
        per_round.append(
            {
                "p50": percentile(pair[IDLE].adds, 50) / percentile(pair[BASELINE].adds, 50),
                "p99": percentile(pair[IDLE].adds, 99) / percentile(pair[BASELINE].adds, 99),
            }
        )
    ratios = {
        "p50": round(idle["p50Ms"] / base["p50Ms"], 2),
        "p99": round(idle["p99Ms"] / base["p99Ms"], 2),
        "daemonCpuPerAdd": round(idle["daemonCpuMsPerAdd"] / base["daemonCpuMsPerAdd"], 2),
        "p50PerRound": [round(r["p50"], 2) for r in per_round],
        "p99PerRound": [round(r["p99"], 2) for r in per_round],
        "p50PerRoundMedian": round(percentile([r["p50"] for r in per_round], 50), 2),
        "p99PerRoundMedian": round(percentile([r["p99"] for r in per_round], 50), 2),
    }
    print(
        f"{'condition':<23} {'ADDs':>5} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'peak fds':>8} {'peak RSS':>9} {'cns CPU':>7} {'ms/ADD':>6}  burst seconds"
    )
    for condition, row in rows.items():
        print(
            f"{condition:<23} {row['adds']:>5} {row['errors']:>6} {row['p50Ms']:>8.2f} "
            f"{row['p99Ms']:>8.2f} {row['maxMs']:>8.2f} {row['peakFds']:>8} "
            f"{row['peakRssMiB']:>6.1f}MiB {row['daemonCpuPercent']:>6.0f}% "
            f"{row['daemonCpuMsPerAdd']:>6.3f}  "
            f"{' '.join(f'{s:.2f}' for s in row['burstSeconds'])}"
        )
    reopened = sum(h["reopened"] for b in bursts for h in b.holders.values())
    print(
        f"idle connections: daemon descriptors at burst start {idle['fdsAtBurstStart']} "
        f"(baseline {base['fdsAtBurstStart']}); the daemon closed {reopened} "
        f"idle connections while the holders ran (they reopened them); listener full "
        f"{idle['capReached']['socket']} times (socket), {idle['capReached']['debug']} (debug)"
    )
    print(
        f"ratio (with idle / baseline), pooled: p50 {ratios['p50']:.2f}, p99 {ratios['p99']:.2f}; "
        f"per round p50 {ratios['p50PerRound']} (median {ratios['p50PerRoundMedian']}), "
        f"p99 {ratios['p99PerRound']} (median {ratios['p99PerRoundMedian']}); "
        f"daemon CPU per ADD {ratios['daemonCpuPerAdd']:.2f}"
    )
    return {"conditions": rows, "ratio": ratios}


def descriptor_bound(caps: dict[str, int]) -> int:
    """What the daemon may hold at most: its listeners' caps and the descriptors it reserves."""
    return caps["socket"] + caps["debug"] + RESERVED_DESCRIPTORS


def raise_own_descriptor_limit(needed: int) -> None:
    """The client holds `needed` connections at once; the usual soft limit is 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise BenchError(f"RLIMIT_NOFILE hard limit {hard} is below the {needed} needed")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adds", type=int, default=1000, help="concurrent ADDs per burst")
    parser.add_argument("--idle", type=int, default=500, help="idle connections per listener")
    parser.add_argument("--rounds", type=int, default=5, help="bursts per condition")
    parser.add_argument(
        "--hold-seconds", type=float, default=20.0, help="idle connections alone, no ADDs"
    )
    parser.add_argument("--tmp-dir", help="parent of the daemon's state dir (on disk)")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    if not 1 <= args.adds <= BATCH - 1:
        parser.error(f"--adds must be in 1..{BATCH - 1} (the pool holds {BATCH - 1} free IPs)")
    if not 1 <= args.idle <= 5000 or not 1 <= args.rounds <= 20:
        parser.error("--idle must be in 1..5000 and --rounds in 1..20")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {
        "scaler": {"batchSize": BATCH, "maxIPCount": 4 * BATCH},
        "standalone": {"subnet": SUBNET, "allocationLatencyMs": 20},
    }
    return run_with_daemon("load", args.tmp_dir, overrides, lambda d: run(d, args))


def run(daemon: Daemon, args: argparse.Namespace) -> list[str]:
    """The interleaved bursts; prints the report (and writes --json), returns what went wrong."""
    raise_own_descriptor_limit(args.adds + 256)
    facts = machine_facts(daemon.state_dir.parent)
    load_before = [round(x, 2) for x in os.getloadavg()]
    daemon.start()
    metrics = daemon.metrics()
    caps = {
        listener: int(metrics[f'cns_max_connections{{listener="{listener}"}}'])
        for listener in ("socket", "debug")
    }
    log(f"{args.idle} idle connections on each listener, no ADDs, for {args.hold_seconds:g} s")
    holding = holding_cost(daemon, args, caps)
    bursts: list[Burst] = []
    for number in range(args.rounds):
        order = (BASELINE, IDLE) if number % 2 == 0 else (IDLE, BASELINE)
        for condition in order:
            log(f"round {number + 1}/{args.rounds}: {args.adds} ADDs, {condition}")
            burst = Burst(condition, number)
            run_burst(daemon, args, burst, caps)
            bursts.append(burst)
    assert daemon.proc is not None
    peak_rss_lifetime = proc_status(daemon.proc.pid, "VmHWM")
    stopped = stop_and_check(daemon)
    print("cns: concurrent ADDs with and without idle connections on both listeners")
    print_facts(facts)
    print(
        f"  load        1-min load average {load_before[0]} before, "
        f"{os.getloadavg()[0]:.2f} after (other jobs share the machine)"
    )
    print(
        f"  bursts      {args.rounds} x {args.adds} concurrent ADDs per condition; "
        f"{args.idle} idle connections on the socket and {args.idle} on the debug port; "
        f"caps: socket {caps['socket']}, debug {caps['debug']}; descriptor bound "
        f"{descriptor_bound(caps)} (caps + {RESERVED_DESCRIPTORS} reserved)"
    )
    print()
    results = report(bursts, args)
    print(
        f"the idle connections alone, no ADDs ({holding['seconds']:g} s): daemon CPU "
        f"{holding['daemonCpuPercent']:g}% of one core, {holding['reopenedPerSecond']:g} "
        "connections closed by the daemon (and reopened) per second"
    )
    print(f"daemon peak RSS over its lifetime (VmHWM): {peak_rss_lifetime / 1024:.1f} MiB")
    problems = [f"{b.condition} round {b.round}: {e}" for b in bursts for e in b.errors[:5]]
    problems += [
        f"{b.condition} round {b.round}: {b.waited_adds:g} ADDs waited for the pool"
        for b in bursts
        if b.waited_adds
    ]
    problems += [
        f"{b.condition} round {b.round}: {b.peak_fds} descriptors open, over the bound"
        for b in bursts
        if b.peak_fds > descriptor_bound(caps)
    ]
    problems += stopped
    if args.json:
        document = {
            "settings": {
                "adds": args.adds,
                "idle": args.idle,
                "rounds": args.rounds,
                "caps": caps,
                "batchSize": BATCH,
                "descriptorBound": descriptor_bound(caps),
            },
            **results,
            "holdingOnly": holding,
            "peakRssLifetimeMiB": round(peak_rss_lifetime / 1024, 1),
            "problems": problems,
        }
        write_json(args.json, "load", facts, load_before, document)
    return problems


if __name__ == "__main__":
    sys.exit(main())
