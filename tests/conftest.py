"""Shared fixtures: a real `cns run` daemon in a subprocess, and the installed CNI plugins."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def private_tmp(workdir: Path) -> dict[str, str]:
    """The environment for a process a test starts: its temporary files (the Kubernetes
    client's CA file, for one) go into the test's own directory, so that a process the test
    kills with SIGKILL leaves nothing in /tmp."""
    return {**os.environ, "TMPDIR": str(workdir)}


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


class DaemonProcess:
    """A `cns run` subprocess with its own socket, state dir and debug port."""

    def __init__(self, workdir: Path, overrides: dict[str, Any]) -> None:
        self.workdir = workdir
        self.socket = workdir / "cns.sock"
        self.state_dir = workdir / "state"
        self.port = free_port()
        self.debug_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "cns.log"
        config: dict[str, Any] = {
            "nodeName": "test-node",
            "socketPath": str(self.socket),
            "stateDir": str(self.state_dir),
            "debugListen": f"127.0.0.1:{self.port}",
            "logFormat": "json",
            "standalone": {"subnet": "10.240.0.0/22", "allocationLatencyMs": 20},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        self.config_path = workdir / "cns.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(
        self, wait: bool = True, extra_args: tuple[str, ...] = (), prefix: Sequence[str] = ()
    ) -> None:
        """`prefix` runs the daemon under another command (e.g. `prlimit --nofile=...`)."""
        log = self.log_path.open("ab")
        command = [sys.executable, "-m", "cns.cli", "run", "--config", str(self.config_path)]
        self.proc = subprocess.Popen(
            [*prefix, *command, *extra_args],
            stdout=log,
            stderr=log,
            cwd=REPO,
            env=private_tmp(self.workdir),
        )
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"cns exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.debug_url}/readyz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"cns not ready after {timeout}s:\n{self.log()}")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.debug_url}{path}", timeout=5) as response:
            if response.headers.get_content_type() == "application/json":
                return json.load(response)
            return response.read().decode()

    def pool(self) -> Any:
        return self.get("/debug/pool")

    def ips(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/debug/ips")["ips"]
        return result

    def call(self, method: str, url: str, body: Any = None) -> tuple[int, Any]:
        return unix_request(self.socket, method, url, body)

    def wait_pool(self, predicate: Any, timeout: float = 10) -> Any:
        deadline = time.monotonic() + timeout
        pool = self.pool()
        while not predicate(pool):
            if time.monotonic() > deadline:
                raise AssertionError(f"pool never satisfied the condition: {pool}")
            time.sleep(0.02)
            pool = self.pool()
        return pool

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=20)
        self.proc = None
        return code

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    started: list[DaemonProcess] = []

    def make(overrides: dict[str, Any] | None = None, start: bool = True) -> DaemonProcess:
        workdir = tmp_path / f"d{len(started)}"
        workdir.mkdir()
        daemon = DaemonProcess(workdir, overrides or {})
        started.append(daemon)
        if start:
            daemon.start()
        return daemon

    yield make
    for daemon in started:
        if daemon.proc is not None:
            daemon.proc.kill()
            daemon.proc.wait()


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`cns install-cni` into a scratch bin dir, exactly as an operator would."""
    root = tmp_path_factory.mktemp("cni")
    subprocess.run(
        [sys.executable, "-m", "cns.cli", "install-cni", "--bin-dir", str(root / "bin")],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return root / "bin"


def is_root() -> bool:
    return os.geteuid() == 0
