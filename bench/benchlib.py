"""Shared by the benchmark scripts: a `cns run` daemon in a subprocess, stats, machine facts.

The daemon (CPU accounting included), ports and metrics parsing are the test harness's
(`tests.harness`), with the benchmarks' own defaults; here is what only the benchmarks need:
percentiles, a clean-up on SIGTERM, the filesystem type of the state directory (which decides
what "durable" costs), the machine facts docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.harness import REPO, HarnessError
from tests.harness import daemon as harness_daemon
from tests.harness.daemon import metric_sum, parse_metrics
from tests.harness.ports import free_port

__all__ = [
    "REPO",
    "VOLATILE_FILESYSTEMS",
    "BenchError",
    "Daemon",
    "add_output_arguments",
    "code_version",
    "durable_temp_parent",
    "exit_cleanly_on_sigterm",
    "export_revision",
    "filesystem_type",
    "free_port",
    "install_cni",
    "log",
    "machine_facts",
    "metric_sum",
    "open_descriptors",
    "open_unix",
    "parse_metrics",
    "percentile",
    "plugin_daemon",
    "print_facts",
    "proc_status",
    "run_with_daemon",
    "stop_and_check",
    "temp_daemon",
    "temp_work_dir",
    "write_json",
]

# A state dir on tmpfs would turn every fsync into a no-op and make the figures meaningless.
VOLATILE_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
# The daemon's config unless a benchmark says otherwise: none of the tests' standalone settings.
BENCH_DEFAULTS: Mapping[str, Any] = {"nodeName": "bench-node", "logLevel": "info"}

# The benchmark could not run or produced invalid results; the script exits non-zero. The same
# class as the harness's error, so a daemon that does not start is reported the same way.
BenchError = HarnessError


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so the scripts' `finally` blocks still clean up.

    Later SIGTERMs are ignored: `timeout` and a shell can both forward one, and a second
    SystemExit in the middle of the clean-up would leave pods, mounts and sysctls behind.
    """

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def open_unix(
    path: str, retry_seconds: float = 0.02
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream on the daemon's unix socket, connected as the plugin connects.

    When the listen backlog is full, connect() on a unix socket fails with EAGAIN instead of
    waiting (the plugin, `cni_plugin.client.DaemonClient._connect`, retries every 20 ms); asyncio's
    `open_unix_connection` turns that into EINVAL, so a burst of clients would fail where the
    plugin waits its turn.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        while True:
            try:
                sock.connect(path)
                break
            except BlockingIOError:
                await asyncio.sleep(retry_seconds)
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile (the numpy default), so p50 equals the usual median."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def filesystem_type(path: Path) -> str:
    """The mounted filesystem type (`ext4`, `tmpfs`, ...); `stat -f` would say `ext2/ext3`."""
    result = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)],
        capture_output=True,
        text=True,
    )
    fstype = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
    if not fstype:
        result = subprocess.run(
            ["df", "--output=fstype", str(path)], capture_output=True, text=True, check=True
        )
        fstype = result.stdout.split()[-1]
    return fstype


def durable_temp_parent(requested: str | None) -> Path:
    """Where temp state dirs go: on disk, preferably the filesystem the repo lives on.

    /tmp is tmpfs on many systems, so the default is /var/tmp; the choice is checked, not assumed.
    """
    parent = Path(requested) if requested else Path("/var/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    fstype = filesystem_type(parent)
    if fstype in VOLATILE_FILESYSTEMS:
        raise BenchError(
            f"{parent} is on {fstype}: fsync is free there, so durable-state figures would be "
            "fiction; pass a directory on disk (e.g. --tmp-dir under /work)"
        )
    if os.stat(parent).st_dev != os.stat(REPO).st_dev:
        log(f"note: {parent} ({fstype}) is not on the same filesystem as {REPO}")
    return parent


def temp_work_dir(prefix: str, requested: str | None) -> Path:
    """A new directory for one run under `durable_temp_parent(requested)`."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=durable_temp_parent(requested)))


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """`--json` and `--tmp-dir`, which every benchmark that writes state to disk takes."""
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--tmp-dir", help="parent of the temp dirs, on disk (default /var/tmp)")


def install_cni(bin_dir: Path) -> Path:
    """`cns install-cni` of this checkout into `bin_dir` (the plugins' code beside it, in
    `bin_dir/../lib/cns`); returns `bin_dir`."""
    subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "install-cni", "--bin-dir", str(bin_dir)],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return bin_dir


def code_version() -> str:
    """The commit the figures come from, and whether cns/ or cni_plugin/ differed from it."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if not head:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "cns", "cni_plugin"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{head} (uncommitted changes in cns/ or cni_plugin/)" if dirty else head


def export_revision(revision: str, into: Path, *paths: str) -> str:
    """`git archive` of `paths` at `revision`, unpacked into `into`; the commit's id.

    Unpacked by tar, not `tarfile`: Debian's Python 3.11.2 has no extraction filters, and the
    archive is this repository's own."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, *paths],
        stdout=subprocess.PIPE,
    )
    assert archive.stdout is not None
    unpacked = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or unpacked.returncode != 0:
        raise BenchError(f"could not export {paths} of {revision} into {into}")
    return commit


def machine_facts(path: Path) -> dict[str, str]:
    """What docs/benchmarks.md must say about the machine the figures came from."""
    model = "unknown"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    statf = subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code_version(),
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "stateDirFs": f"{filesystem_type(path)} (stat -f: {statf})",
        "stateDir": str(path),
        "sameFsAsRepo": "yes" if os.stat(path).st_dev == os.stat(REPO).st_dev else "no",
    }


def write_json(
    path: str,
    benchmark: str,
    facts: dict[str, str],
    load_before: list[float],
    results: dict[str, Any],
) -> None:
    """The results as one JSON document, with the command, the machine and its load around them."""
    document = {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": facts,
        "loadAverageBefore": load_before,
        "loadAverageAfter": [round(x, 2) for x in os.getloadavg()],
        **results,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def print_facts(facts: dict[str, str]) -> None:
    for key, value in facts.items():
        print(f"  {key:<11} {value}")


class Daemon(harness_daemon.Daemon):
    """The harness's `cns run` daemon with the benchmarks' defaults (`BENCH_DEFAULTS`)."""

    def __init__(self, workdir: Path, overrides: dict[str, Any], wrap: Sequence[str] = ()) -> None:
        super().__init__(workdir, overrides, defaults=BENCH_DEFAULTS, wrap=wrap)


def plugin_daemon(workdir: Path, subnet: str) -> Daemon:
    """A daemon (not started yet) in `workdir/cns` for the plugins' ADD benchmarks: `subnet`
    (a /16) in batches of 16 with a 5 ms allocation latency, so no ADD waits for the pool."""
    (workdir / "cns").mkdir()
    overrides = {
        "scaler": {"batchSize": 16, "maxIPCount": 1000},
        "standalone": {"subnet": subnet, "allocationLatencyMs": 5},
    }
    return Daemon(workdir / "cns", overrides)


@contextlib.contextmanager
def temp_daemon(name: str, tmp_dir: str | None, overrides: dict[str, Any]) -> Iterator[Daemon]:
    """A `Daemon` (not started yet) in a new directory on disk; stopped and removed on the way
    out, whatever happened."""
    workdir = temp_work_dir(f"cns-{name}-", tmp_dir)
    try:
        daemon = Daemon(workdir, overrides)
        try:
            yield daemon
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def stop_and_check(daemon: Daemon) -> list[str]:
    """Stop the daemon (SIGTERM); what its exit status and its log say is wrong with the run."""
    code = daemon.stop()
    errors = daemon.log_errors()
    problems = [f"daemon logged {len(errors)} error(s), first: {errors[0][:300]}"] if errors else []
    if code != 0:
        problems.append(f"cns exited {code} on SIGTERM")
    return problems


def run_with_daemon(
    name: str, tmp_dir: str | None, overrides: dict[str, Any], run: Callable[[Daemon], list[str]]
) -> int:
    """A benchmark's main: `run` gets a `temp_daemon` and returns the run's problems; exit status
    0, or 1 with the problems on stderr. SIGTERM cleans up like an error does."""
    exit_cleanly_on_sigterm()
    try:
        with temp_daemon(name, tmp_dir, overrides) as daemon:
            problems = run(daemon)
    except BenchError as exc:
        problems = [str(exc)]
    if problems:
        print(f"{name}: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_status(pid: int, name: str) -> int:
    """A number from /proc/PID/status: `VmRSS`, `VmHWM` (KiB), `Threads`, ..."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise BenchError(f"no {name} in /proc/{pid}/status")
