"""A real `cns run` daemon in a subprocess, for the tests and the benchmarks alike.

daemon = Daemon(workdir, {"standalone": {"subnet": "10.240.8.0/24"}})
daemon.start()
status, body = daemon.call("POST", "/v1/cni/add", {"containerID": "c1", "ifName": "eth0"})
daemon.wait_pool(lambda pool: pool["ips"]["Assigned"] == 1, "one Assigned IP")
assert daemon.stop() == 0
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO, HarnessError
from tests.harness.ports import free_port
from tests.harness.process import die_with_parent, private_tmp, tail

# What a test's daemon runs with unless it says otherwise: a small standalone pool that fills
# quickly (20 ms per allocation, like a fast control plane).
TEST_DEFAULTS: Mapping[str, Any] = {
    "nodeName": "test-node",
    "standalone": {"subnet": "10.240.0.0/22", "allocationLatencyMs": 20},
}
ERROR_LINE = re.compile(r'"level": ?"(error|critical)"')


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` laid over it; mappings are merged key by key, at every depth."""
    result = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def unix_request(path: Path, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """One HTTP request over the daemon's unix socket, as the plugins make it."""
    payload = b"" if body is None else json.dumps(body).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(
            f"{method} {url} HTTP/1.1\r\nHost: cns\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, raw = data.partition(b"\r\n\r\n")
    if not head:
        raise ConnectionResetError(f"{path}: connection closed without a reply")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(raw) if raw else None


def parse_metrics(text: str) -> dict[str, float]:
    """The Prometheus exposition as {"name{labels}": value}, comments dropped."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric_sum(metrics: Mapping[str, float], prefix: str) -> float:
    """Sum every sample whose name (with labels) starts with `prefix`."""
    return sum(value for name, value in metrics.items() if name.startswith(prefix))


class Daemon:
    """A `cns run` subprocess with its own socket, state dir, debug port and log file.

    Its config is `defaults` (the tests' unless given) with `overrides` merged over them.
    `wrap` prefixes the interpreter arguments (e.g. `["-m", "cProfile", "-o", OUT]`: profile the
    daemon without touching `cns/`); `start(prefix=...)` runs it under another command (e.g.
    `prlimit --nofile=...`). Started from the main thread, it gets SIGTERM if the test or
    benchmark dies without stopping it.
    """

    def __init__(
        self,
        workdir: Path,
        overrides: Mapping[str, Any],
        *,
        defaults: Mapping[str, Any] = TEST_DEFAULTS,
        wrap: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.socket = workdir / "cns.sock"
        self.debug_socket = workdir / "debug.sock"  # the default: beside the CNI socket
        self.state_dir = workdir / "state"
        self.port = free_port()
        self.debug_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "cns.log"
        self.wrap = list(wrap)
        plumbing = {
            "socketPath": str(self.socket),
            "stateDir": str(self.state_dir),
            "debugListen": f"127.0.0.1:{self.port}",
            "logFormat": "json",
        }
        self.config_path = workdir / "cns.yaml"
        self.config_path.write_text(yaml.safe_dump(merged(merged(plumbing, defaults), overrides)))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(
        self,
        *,
        wait: bool = True,
        timeout: float = 30,
        extra_args: Sequence[str] = (),
        prefix: Sequence[str] = (),
    ) -> None:
        """Start it; with `wait`, return once `/readyz` answers (HarnessError if it exits)."""
        command = [sys.executable, *self.wrap, "-m", "cns.commands.cli", "run"]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*prefix, *command, "--config", str(self.config_path), *extra_args],
                stdout=log,
                stderr=log,
                cwd=REPO,
                env=private_tmp(self.workdir),
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise HarnessError(f"cns exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.debug_url}/readyz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise HarnessError(f"cns not ready after {timeout} s:\n{self.log_tail()}")

    def wait_socket(self, timeout: float = 30) -> None:
        """Wait for the API socket: readiness when the debug port is out of reach (a daemon
        started in another network namespace listens on that namespace's loopback)."""
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise HarnessError(f"cns exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise HarnessError(f"no socket {self.socket} after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def get(self, path: str) -> Any:
        """A debug endpoint: parsed JSON, or the text (e.g. `/metrics`)."""
        with urllib.request.urlopen(f"{self.debug_url}{path}", timeout=10) as response:
            if response.headers.get_content_type() == "application/json":
                return json.load(response)
            return response.read().decode()

    def pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.get("/debug/pool")
        return pool

    def ips(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/debug/ips")["ips"]
        return result

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics"))

    def call(self, method: str, url: str, body: Any = None) -> tuple[int, Any]:
        """One request to the API on the unix socket: (HTTP status, JSON body)."""
        return unix_request(self.socket, method, url, body)

    def ipam(
        self, plugin_dir: Path, command: str, container: str, *, netns: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """The real `cns-ipam` executable (from `cns install-cni` into `plugin_dir`) run as a
        runtime runs it against this daemon: the network configuration on stdin, the CNI
        variables in its environment, interface eth0 (cns-ipam does not open `netns`)."""
        config = {"cniVersion": "1.0.0", "name": "net", "type": "bridge", "ipam": {
            "type": "cns-ipam", "socket": str(self.socket),
            "releaseQueueDir": str(self.state_dir / "release-queue")}}  # fmt: skip
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container, "CNI_IFNAME": "eth0",
               "CNI_NETNS": netns, "CNI_PATH": str(plugin_dir)}  # fmt: skip
        return subprocess.run(
            [str(plugin_dir / "cns-ipam")],
            input=json.dumps(config),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def wait_pool(
        self,
        predicate: Callable[[dict[str, Any]], Any],
        what: str = "the condition",
        timeout: float = 30,
    ) -> dict[str, Any]:
        """Poll `/debug/pool` until `predicate` holds; return that pool view."""
        deadline = time.monotonic() + timeout
        pool = self.pool()
        while not predicate(pool):
            if time.monotonic() > deadline:
                raise HarnessError(f"pool never reached {what} within {timeout} s: {pool}")
            time.sleep(0.02)
            pool = self.pool()
        return pool

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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send `sig` and return the exit code (0 if it was not running). A clean stop flushes
        state and, under cProfile, writes the profile; SIGKILL after `timeout` is an error."""
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                name = signal.Signals(sig).name
                raise HarnessError(
                    f"cns did not exit within {timeout} s of {name}; killed"
                ) from None
        return proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def log_errors(self) -> list[str]:
        """Log lines at error/critical level: any of them makes a benchmark run invalid."""
        return [line for line in self.log().splitlines() if ERROR_LINE.search(line)]
