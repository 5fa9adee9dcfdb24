#!/usr/bin/env python3
"""Durable ADD+DEL pair throughput of a real `cns run` daemon over its unix socket.

Why this shape:
- The daemon replies to an ADD or DEL only after the change is committed to SQLite (WAL,
  `synchronous=FULL`), so the state dir must be on a real disk: it is checked, and its filesystem
  type printed. Concurrent requests share commits (group commit); the `cns_state_commits` delta
  next to the pair count shows how many pairs each fsync carried.
- The load generator is one asyncio process speaking hand-made HTTP/1.1, one connection per
  request with `Connection: close`, exactly like the stdlib `cns-ipam` plugin, so it costs far
  less CPU per request than the daemon's aiohttp stack and is not the bottleneck on 2 cores (its
  CPU use is printed next to the daemon's, so that claim is checked on every run). A keep-alive
  variant is measured separately and labelled as such: it shows what connection set-up costs.
- The pool is pre-warmed (batch large enough for the highest concurrency) so ADDs never wait for
  the embedded allocator; `cns_add_ip_wait_seconds_count` and `cns_pool_requests_published` must
  not move during a level.
- Every reply must be 200, no IP may be handed to two holders at once, every DEL must release the
  IP its ADD got, and `/debug/pool` must show 0 Assigned after each level; otherwise exit 1.

Run (no root needed): `.venv/bin/python -m bench.performance.daemon_throughput`
Profile the daemon: `--py-spy /path/to/py-spy` (sampling, all threads) or `--cprofile` (main
thread only, slows the daemon down; read it for proportions, not absolute figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.benchlib import (
    BenchError,
    Daemon,
    durable_temp_parent,
    exit_cleanly_on_sigterm,
    log,
    machine_facts,
    metric_sum,
    open_unix,
    percentile,
    print_facts,
)

TARGET_PAIRS_PER_SECOND = 2500.0
REQUEST_TIMEOUT_SECONDS = 30.0


@dataclass
class LevelResult:
    """One (mode, concurrency) measurement."""

    mode: str
    concurrency: int
    seconds: float
    pairs: int
    add_latencies: list[float] = field(default_factory=list)
    del_latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    commits: float = 0.0
    waited_adds: float = 0.0
    publishes: float = 0.0
    daemon_cpu: float = 0.0
    loop_cpu: float = 0.0
    client_cpu: float = 0.0
    assigned_after: int = -1

    @property
    def pairs_per_second(self) -> float:
        return self.pairs / self.seconds if self.seconds else 0.0


def summarize(runs: list[LevelResult]) -> dict[str, Any]:
    """Repeats of one (mode, concurrency): median pairs/s with its range; latencies pooled."""
    first = runs[0]
    seconds = sum(r.seconds for r in runs)
    pairs = sum(r.pairs for r in runs)
    commits = sum(r.commits for r in runs)
    rates = [r.pairs_per_second for r in runs]
    adds = [x for r in runs for x in r.add_latencies]
    dels = [x for r in runs for x in r.del_latencies]
    errors: Counter[str] = Counter()
    for r in runs:
        errors.update(r.errors)
    ms = 1000.0
    return {
        "mode": first.mode,
        "concurrency": first.concurrency,
        "repeats": len(runs),
        "seconds": round(seconds, 3),
        "pairs": pairs,
        "pairsPerSecond": round(percentile(rates, 50), 1),
        "pairsPerSecondMin": round(min(rates), 1),
        "pairsPerSecondMax": round(max(rates), 1),
        "addP50Ms": round(percentile(adds, 50) * ms, 3),
        "addP99Ms": round(percentile(adds, 99) * ms, 3),
        "delP50Ms": round(percentile(dels, 50) * ms, 3),
        "delP99Ms": round(percentile(dels, 99) * ms, 3),
        "commits": int(commits),
        "pairsPerCommit": round(pairs / commits, 2) if commits else None,
        "daemonCpuPercent": round(100 * sum(r.daemon_cpu for r in runs) / seconds, 1),
        "daemonLoopThreadCpuPercent": round(100 * sum(r.loop_cpu for r in runs) / seconds, 1),
        "clientCpuPercent": round(100 * sum(r.client_cpu for r in runs) / seconds, 1),
        "waitedAdds": int(sum(r.waited_adds for r in runs)),
        "poolRequestsPublished": int(sum(r.publishes for r in runs)),
        "errors": dict(errors),
        "assignedAfter": [r.assigned_after for r in runs],
    }


def _request_bytes(path: str, body: dict[str, Any], keepalive: bool) -> bytes:
    """The request exactly as `cni_plugin.client.DaemonClient` writes it (keep-alive aside)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    connection = "keep-alive" if keepalive else "close"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: cns\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: {connection}\r\n\r\n"
    )
    return head.encode() + payload


def _status_and_body(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"not an HTTP reply: {raw[:80]!r}")
    return int(parts[1]), body


class CloseTransport:
    """One unix connection per request, closed by the daemon after the reply: the plugin's way."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        reader, writer = await open_unix(self.socket_path)
        try:
            writer.write(_request_bytes(path, body, keepalive=False))
            raw = await reader.read()  # until EOF: the server closes after replying
        finally:
            writer.close()
        return _status_and_body(raw)

    async def close(self) -> None:
        return None


class KeepAliveTransport:
    """One persistent connection per client (NOT what the plugin does; shows set-up cost)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await open_unix(self.socket_path)
        self.writer.write(_request_bytes(path, body, keepalive=True))
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body_bytes = await self.reader.readexactly(length)
        status = int(head.split(b" ", 2)[1])
        if b"connection: close" in head.lower():
            await self.close()
        return status, body_bytes

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


Transport = CloseTransport | KeepAliveTransport


class Level:
    """Shared state of the clients of one level: results, and the IPs currently held."""

    def __init__(self, result: LevelResult, socket_path: str, deadline: float) -> None:
        self.result = result
        self.socket_path = socket_path
        self.deadline = deadline
        self.held: dict[str, str] = {}  # address -> containerID, while a client holds it

    def fail(self, what: str) -> None:
        self.result.errors[what] += 1

    async def client(self, index: int) -> None:
        """Loop ADD then DEL of a new container until the deadline."""
        result = self.result
        transport: Transport = (
            KeepAliveTransport(self.socket_path)
            if result.mode == "keepalive"
            else CloseTransport(self.socket_path)
        )
        clock = time.perf_counter
        n = 0
        try:
            while clock() < self.deadline:
                container = f"tp-{result.mode}-{result.concurrency}-{index}-{n}"
                n += 1
                add = {
                    "containerID": container,
                    "ifName": "eth0",
                    "netns": f"/var/run/netns/{container}",
                    "podName": container,
                    "podNamespace": "bench",
                }
                started = clock()
                status, body = await transport.call("/v1/cni/add", add)
                result.add_latencies.append(clock() - started)
                if status != 200:
                    self.fail(f"add:{status}:{body[:120].decode(errors='replace')}")
                    continue
                address = json.loads(body)["ips"][0]["address"].split("/")[0]
                other = self.held.get(address)
                if other is not None:
                    self.fail(f"duplicate:{address} held by {other} given to {container}")
                self.held[address] = container
                # Hold it across one loop turn, so an ADD reply handing it out again meanwhile is
                # seen; forget it before the DEL is sent, as from then on that would be legal.
                await asyncio.sleep(0)
                del self.held[address]
                started = clock()
                status, body = await transport.call(
                    "/v1/cni/del", {"containerID": container, "ifName": "eth0"}
                )
                result.del_latencies.append(clock() - started)
                if status != 200:
                    self.fail(f"del:{status}:{body[:120].decode(errors='replace')}")
                    continue
                released = json.loads(body).get("released")
                if released != address:
                    self.fail(f"del-released:{released!r} expected {address}")
                    continue
                result.pairs += 1
        except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as exc:
            self.fail(f"client:{type(exc).__name__}:{exc}")
        finally:
            await transport.close()


async def run_level(daemon: Daemon, mode: str, concurrency: int, duration: float) -> LevelResult:
    """Measure one level; counters are read before and after so their deltas belong to it."""
    before = daemon.metrics()
    daemon_cpu = daemon.cpu_seconds()
    loop_cpu = daemon.cpu_seconds(main_thread_only=True)
    client_cpu = time.process_time()
    started = time.perf_counter()
    result = LevelResult(mode, concurrency, 0.0, 0)
    level = Level(result, str(daemon.socket), started + duration)
    clients = [asyncio.create_task(level.client(i)) for i in range(concurrency)]
    done, pending = await asyncio.wait(clients, timeout=duration + REQUEST_TIMEOUT_SECONDS)
    if pending:
        result.errors["level-timeout"] += len(pending)
        for task in pending:
            task.cancel()
        await asyncio.wait(pending)
    for task in done:
        if task.exception() is not None:
            result.errors[f"client-crash:{task.exception()!r}"] += 1
    result.seconds = time.perf_counter() - started
    result.client_cpu = time.process_time() - client_cpu
    result.daemon_cpu = daemon.cpu_seconds() - daemon_cpu
    result.loop_cpu = daemon.cpu_seconds(main_thread_only=True) - loop_cpu
    after = daemon.metrics()
    for attr, prefix in (
        ("commits", "cns_state_commits"),
        ("waited_adds", "cns_add_ip_wait_seconds_count"),
        ("publishes", "cns_pool_requests_published"),
    ):
        setattr(result, attr, metric_sum(after, prefix) - metric_sum(before, prefix))
    result.assigned_after = int(daemon.pool()["ips"]["Assigned"])
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'mode':<10}{'conc':>5}{'pairs/s':>9}{'(min-max)':>12}{'ADD p50':>9}{'ADD p99':>9}"
        f"{'DEL p50':>9}{'DEL p99':>9}{'pairs/cm':>9}{'cns CPU':>8}{'loop':>6}{'load':>6}"
    )
    print(header)
    print("-" * len(header))
    for s in rows:
        spread = f"{s['pairsPerSecondMin']:.0f}-{s['pairsPerSecondMax']:.0f}"
        print(
            f"{s['mode']:<10}{s['concurrency']:>5}{s['pairsPerSecond']:>9.0f}{spread:>12}"
            f"{s['addP50Ms']:>7.2f}ms{s['addP99Ms']:>7.2f}ms"
            f"{s['delP50Ms']:>7.2f}ms{s['delP99Ms']:>7.2f}ms"
            f"{s['pairsPerCommit'] or 0:>9.2f}"
            f"{s['daemonCpuPercent']:>7.0f}%{s['daemonLoopThreadCpuPercent']:>5.0f}%"
            f"{s['clientCpuPercent']:>5.0f}%"
        )


def _package(frame: str) -> str:
    """`func (aiohttp/web_protocol.py:577)` -> `aiohttp`; `<frozen ...>` and bare files as is."""
    location = frame.rpartition(" (")[2].rstrip(")")
    path = location.rpartition(":")[0] or location
    return path.split("/", 1)[0] if "/" in path else path


def collapsed_top(path: Path, limit: int) -> str:
    """Where the daemon's CPU goes, from py-spy's collapsed output (`--format raw --threads`).

    Per thread: the share of active samples; for the event-loop thread (the one that saturates a
    core), the top functions by self and inclusive time and the self time per package.
    """
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    main_total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        thread, *frames = stack.split(";")
        name = thread.rpartition(": ")[2]
        threads[name] += count
        if name != "MainThread" or not frames:
            continue
        main_total += count
        own[frames[-1]] += count
        packages[_package(frames[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    total = sum(threads.values())
    if not total or not main_total:
        return "py-spy: no samples"
    lines = [f"py-spy: {total} active samples; share per thread:"]
    lines += [f"  {100 * c / total:5.1f}%  {t}" for t, c in threads.most_common()]
    lines += ["", f"event-loop thread (MainThread, {main_total} samples), self time per package:"]
    lines += [f"  {100 * c / main_total:5.1f}%  {p}" for p, c in packages.most_common(12)]
    lines += ["", "MainThread self %  function"]
    lines += [f"  {100 * c / main_total:5.1f}  {f}" for f, c in own.most_common(limit)]
    lines += ["", "MainThread inclusive %  function (cns/ and aiohttp/ frames only)"]
    interesting = [(f, c) for f, c in inclusive.most_common() if _package(f) in ("cns", "aiohttp")]
    lines += [f"  {100 * c / main_total:5.1f}  {f}" for f, c in interesting[:limit]]
    return "\n".join(lines)


async def measure(daemon: Daemon, args: argparse.Namespace) -> dict[tuple[str, int], list[Any]]:
    """Every level `repeat` times, rounds interleaved so slow drift spreads over all levels."""
    runs: dict[tuple[str, int], list[LevelResult]] = {}
    top = max(args.levels)
    # SIGTERM cancels the measurement (clients included) instead of unwinding through asyncio.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    if args.warmup > 0:
        log(f"warm-up: {args.warmup:g} s at concurrency {top} (discarded)")
        warm = await run_level(daemon, "close", top, args.warmup)
        if warm.errors:
            raise BenchError(f"errors during warm-up: {dict(warm.errors)}")
    for round_ in range(args.repeat):
        for mode in args.modes:
            for concurrency in args.levels:
                log(
                    f"round {round_ + 1}/{args.repeat}: {mode}, {concurrency} client(s) "
                    f"for {args.duration:g} s"
                )
                result = await run_level(daemon, mode, concurrency, args.duration)
                runs.setdefault((mode, concurrency), []).append(result)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,8,64", help="concurrent clients, comma-separated")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all levels")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds (0: none)")
    parser.add_argument(
        "--modes", default="close,keepalive", help="close (the plugin's way) and/or keepalive"
    )
    parser.add_argument("--tmp-dir", help="parent of the temp state dir (default /var/tmp)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    parser.add_argument(
        "--cooldown",
        type=float,
        default=0.0,
        help="ipCooldownSeconds (default 0: every released IP is reusable at once, so a small "
        "pool serves the whole run; with N s the pool must hold N s of releases)",
    )
    parser.add_argument(
        "--max-ip-count", type=int, default=0, help="scaler.maxIPCount (default max(1000, 4 B))"
    )
    parser.add_argument("--json", help="also write the results as JSON to this file")
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--py-spy", metavar="BIN", help="record the daemon with this py-spy")
    profile.add_argument("--cprofile", action="store_true", help="run the daemon under cProfile")
    parser.add_argument("--profile-out", help="where profiles go (default: a kept temp dir)")
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.levels or min(args.levels) < 1 or max(args.levels) > 1000:
        parser.error("--levels must be integers in 1..1000")
    if not set(args.modes) <= {"close", "keepalive"} or not args.modes:
        parser.error("--modes takes close and/or keepalive")
    if not 1 <= args.repeat <= 20:
        parser.error("--repeat must be in 1..20")
    if not 0.5 <= args.duration <= 120:
        parser.error("--duration must be in 0.5..120 s (the load must stay bounded)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    top = max(args.levels)
    workdir: Path | None = None
    daemon: Daemon | None = None
    spy: subprocess.Popen[bytes] | None = None
    profile_dir = Path(args.profile_out) if args.profile_out else None
    try:
        parent = durable_temp_parent(args.tmp_dir)
        workdir = Path(tempfile.mkdtemp(prefix="cns-throughput-", dir=parent))
        if (args.py_spy or args.cprofile) and profile_dir is None:
            profile_dir = Path(tempfile.mkdtemp(prefix="cns-profile-"))
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
        wrap: list[str] = []
        if args.cprofile:
            assert profile_dir is not None
            wrap = ["-m", "cProfile", "-o", str(profile_dir / "daemon.prof")]
        # Batch >= 4x the top concurrency: the initial pool already covers every concurrent
        # ADD, so the measured loop never waits for (or triggers) allocation.
        batch = max(64, 4 * top)
        max_ip_count = args.max_ip_count or max(1000, 4 * batch)
        daemon = Daemon(
            workdir,
            {
                "logLevel": args.log_level,
                "ipCooldownSeconds": args.cooldown,
                "scaler": {"batchSize": batch, "maxIPCount": max_ip_count},
                "standalone": {"subnet": "10.242.0.0/16", "allocationLatencyMs": 0},
            },
            wrap=wrap,
        )
        facts = machine_facts(daemon.state_dir.parent)
        log(f"starting cns (state {daemon.state_dir}, {facts['stateDirFs']})")
        daemon.start()
        pool = daemon.wait_pool(
            lambda p: p["ips"]["Available"] >= top and p["waitingAdds"] == 0,
            f"{top}+ Available IPs",
        )
        log(f"pool pre-warmed: {pool['ips']['Available']} Available, batch {batch}")
        if args.py_spy:
            assert profile_dir is not None and daemon.proc is not None
            spy = subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "--pid",
                    str(daemon.proc.pid),
                    "--format",
                    "raw",
                    "--rate",
                    "100",
                    "--threads",
                    "--function",
                    "--output",
                    str(profile_dir / "daemon.collapsed"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            time.sleep(1.0)  # let it attach before load starts

        runs = asyncio.run(measure(daemon, args))

        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            spy.wait(timeout=60)
        errors = daemon.log_errors()
        code = daemon.stop()
        if code != 0:
            raise BenchError(f"cns exited {code} on SIGTERM:\n{daemon.log_tail()}")

        rows = [summarize(level_runs) for level_runs in runs.values()]
        print("cns daemon throughput: durable ADD+DEL pairs over the unix socket")
        print_facts(facts)
        print(
            f"  config      batchSize {batch}, maxIPCount {max_ip_count}, "
            f"ipCooldownSeconds {args.cooldown:g}, allocationLatencyMs 0, logLevel {args.log_level}"
        )
        print(f"  runs        {args.repeat} x {args.duration:g} s per level, rounds interleaved")
        print()
        print_table(rows)
        print()
        print("pairs/s = median over the rounds (min-max); latencies pooled over all rounds")
        print("close = one connection per request (the plugin's way); keepalive = one per client")
        print("pairs/cm = pairs per SQLite commit (each commit = one WAL fsync)")
        print("cns CPU = daemon CPU time (all threads) over wall time; loop = its event-loop")
        print("thread alone; load = the load generator (this process)")
        print(f"(100% = one core busy; this machine has {os.cpu_count()} cores)")

        problems = []
        for (mode, concurrency), level_runs in runs.items():
            for n, r in enumerate(level_runs, 1):
                label = f"{mode}/{concurrency} round {n}"
                if r.errors:
                    problems.append(f"{label}: {dict(r.errors.most_common(5))}")
                if r.assigned_after != 0:
                    problems.append(f"{label}: {r.assigned_after} Assigned after the level")
                if r.waited_adds or r.publishes:
                    log(f"note: {label}: {r.waited_adds:g} ADDs waited, {r.publishes:g} publishes")
                if r.pairs == 0:
                    problems.append(f"{label}: no pair completed")
        if errors:
            problems.append(f"daemon logged {len(errors)} error(s), first: {errors[0][:300]}")

        close = [row for row in rows if row["mode"] == "close"]
        if close:
            best = max(close, key=lambda row: row["pairsPerSecond"])
            rate = best["pairsPerSecond"]
            verdict = "MET" if rate >= TARGET_PAIRS_PER_SECOND else "NOT MET"
            print(
                f"\ntarget >= {TARGET_PAIRS_PER_SECOND:.0f} durable pairs/s (close mode, best "
                f"level, median): {rate:.0f} at {best['concurrency']} clients -> {verdict}"
            )
        if args.json:
            report = {"machine": facts, "batchSize": batch, "results": rows}
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"results JSON: {args.json}")
        if profile_dir is not None:
            if args.cprofile:
                prof = profile_dir / "daemon.prof"
                print(f"\ncProfile of the daemon's main thread: {prof}")
                stats = pstats.Stats(str(prof), stream=sys.stdout)
                stats.sort_stats("tottime").print_stats(25)
            if args.py_spy:
                collapsed = profile_dir / "daemon.collapsed"
                print(f"\n{collapsed_top(collapsed, 30)}\n(collapsed stacks: {collapsed})")
        if problems:
            raise BenchError("invalid run:\n  " + "\n  ".join(problems))
        return 0
    except asyncio.CancelledError:
        print("daemon_throughput: interrupted by SIGTERM", file=sys.stderr)
        return 143
    except (BenchError, OSError) as exc:  # OSError: e.g. the debug endpoint went away
        print(f"daemon_throughput: FAILED: {exc}", file=sys.stderr)
        if daemon is not None and daemon.proc is not None:
            print(daemon.log_tail(), file=sys.stderr)
        return 1
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait()
        if daemon is not None and daemon.proc is not None:
            daemon.proc.kill()
            daemon.proc.wait()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
