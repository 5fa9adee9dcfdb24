"""Shared by the benchmark scripts: a `cns run` daemon in a subprocess, stats, machine facts.

Kept separate from `tests/conftest.py` on purpose: the benchmarks must not break when the test
fixtures change, and they need things the tests do not (metrics deltas, CPU accounting, the
filesystem type of the state directory, which decides what "durable" costs).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
# A state dir on tmpfs would turn every fsync into a no-op and make the figures meaningless.
VOLATILE_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
PR_SET_PDEATHSIG = 1


class BenchError(Exception):
    """The benchmark could not run or produced invalid results; the script exits non-zero."""


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so the scripts' `finally` blocks still clean up.

    Later SIGTERMs are ignored: `timeout` and a shell can both forward one, and a second
    SystemExit in the middle of the clean-up would leave pods, mounts and sysctls behind.
    """

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _die_with_parent() -> None:
    """In the daemon child: get SIGTERM if the benchmark dies without cleaning up (SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def open_unix(
    path: str, retry_seconds: float = 0.02
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream on the daemon's unix socket, connected as the plugin connects.

    When the listen backlog is full, connect() on a unix socket fails with EAGAIN instead of
    waiting (the plugin, `cni_plugin.common._connect`, retries every 20 ms); asyncio's
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


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class Daemon:
    """A real `cns run` subprocess with its own socket, state dir, debug port and log file.

    `wrap` prefixes the interpreter arguments, e.g. `["-m", "cProfile", "-o", OUT]`, so the
    daemon can be profiled without touching `cns/`.
    """

    def __init__(self, workdir: Path, overrides: dict[str, Any], wrap: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.socket = workdir / "cns.sock"
        self.state_dir = workdir / "state"
        self.port = free_port()
        self.debug_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "cns.log"
        self.wrap = list(wrap)
        config = _merge(
            {
                "nodeName": "bench-node",
                "socketPath": str(self.socket),
                "stateDir": str(self.state_dir),
                "debugListen": f"127.0.0.1:{self.port}",
                "logFormat": "json",
                "logLevel": "info",
            },
            overrides,
        )
        self.config_path = workdir / "cns.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    *self.wrap,
                    "-m",
                    "cns.cli",
                    "run",
                    "--config",
                    str(self.config_path),
                ],
                stdout=out,
                stderr=out,
                cwd=REPO,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"cns exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.debug_url}/readyz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise BenchError(f"cns not ready after {timeout} s:\n{self.log_tail()}")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.debug_url}{path}", timeout=10) as response:
            if response.headers.get_content_type() == "application/json":
                return json.load(response)
            return response.read().decode()

    def pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.get("/debug/pool")
        return pool

    def wait_pool(self, predicate: Any, what: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            pool = self.pool()
            if predicate(pool):
                return pool
            if time.monotonic() > deadline:
                raise BenchError(f"pool never reached {what} within {timeout} s: {pool}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics"))

    def cpu_seconds(self, main_thread_only: bool = False) -> float:
        """User+system CPU of the daemon so far: all threads, or the event-loop thread only.

        The main thread runs the event loop; when it alone is near one core, the loop is the
        bottleneck, whatever the SQLite writer thread does.
        """
        assert self.proc is not None
        pid = self.proc.pid
        stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread_only else f"/proc/{pid}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int:
        """SIGTERM and wait (a clean stop flushes state and, under cProfile, writes the profile)."""
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise BenchError("cns did not stop within 30 s of SIGTERM; killed") from None
        return proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_errors(self) -> list[str]:
        """Log lines at error/critical level: any of them makes a benchmark run invalid."""
        if not self.log_path.exists():
            return []
        pattern = re.compile(r'"level": ?"(error|critical)"')
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if pattern.search(line)
        ]


@contextlib.contextmanager
def temp_daemon(name: str, tmp_dir: str | None, overrides: dict[str, Any]) -> Iterator[Daemon]:
    """A `Daemon` (not started yet) in a new directory on disk; stopped and removed on the way
    out, whatever happened."""
    workdir = Path(tempfile.mkdtemp(prefix=f"cns-{name}-", dir=durable_temp_parent(tmp_dir)))
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


def parse_metrics(text: str) -> dict[str, float]:
    """The Prometheus exposition as {"name{labels}": value}, comments dropped."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric_sum(metrics: dict[str, float], prefix: str) -> float:
    """Sum every sample whose name (with labels) starts with `prefix`."""
    return sum(value for name, value in metrics.items() if name.startswith(prefix))
