"""Resources and liveness: what a client may hold on either listener, and for how long.

The attacker in these tests is an unprivileged local user (`nobody`): the debug port is open to
every local user, and it must never cost the pods anything.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cns.web.debug import LoopBudget
from cns.web.listeners import (
    DEBUG_MAX_CONNECTIONS,
    METRICS_MAX_CONNECTIONS,
    RESERVED_DESCRIPTORS,
    ConnectionCaps,
    connection_caps,
)
from tests.harness.ports import free_port

# Opens `count` TCP connections to the port without waiting for any of them (those beyond what
# the daemon accepts stay in the kernel's queues), says "ready", and holds them until stdin ends.
HOLDER = """
import socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
"""

LOW_LIMIT = ["prlimit", "--nofile=1024:1024", "--"]


def add(daemon: Any, n: int) -> tuple[int, Any]:
    body = {"containerID": f"c{n}", "ifName": "eth0", "netns": f"/run/netns/p{n}"}
    return daemon.call("POST", "/v1/cni/add", body)


def open_descriptors(daemon: Any) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def metric(daemon: Any, name: str, listener: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics"))}
    return next(s.value for s in families[name].samples if s.labels["listener"] == listener)


def with_metrics_listener(make_daemon: Any, start: bool = True) -> Any:
    """A daemon with its metrics listener on a loopback port of its own (`metrics_port`)."""
    port = free_port()
    daemon = make_daemon({"metrics": {"address": "127.0.0.1", "port": port}}, start=start)
    daemon.metrics_port = port
    return daemon


@pytest.mark.parametrize("listener", ["debug", "metrics"])
def test_idle_debug_connections_of_another_user_cannot_stop_adds(
    make_daemon: Any, listener: str
) -> None:
    """2,000 connections held by `nobody` on the debug port (or the metrics listener), with the
    daemon at the usual soft limit of 1,024 descriptors: they used them all up and every ADD
    stalled. Now the listener stops accepting at its cap and the socket keeps serving."""
    assert os.geteuid() == 0, "needs root to run the attacker as nobody"
    daemon = with_metrics_listener(make_daemon, start=False)
    daemon.start(prefix=LOW_LIMIT)
    port = daemon.port if listener == "debug" else daemon.metrics_port
    attacker = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
         "/usr/bin/python3", "-I", "-c", HOLDER, str(port), "2000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert attacker.stdout is not None and attacker.stdout.readline() == "ready\n"
        for n in range(20):
            status, body = add(daemon, n)
            assert status == 200, body
        assert open_descriptors(daemon) < DEBUG_MAX_CONNECTIONS + RESERVED_DESCRIPTORS
    finally:
        attacker.communicate(timeout=30)
    # The attacker's connections are gone, but the kernel may still be retrying SYNs it dropped
    # while the listen queue was full: the first reads may take a few attempts.
    deadline = time.monotonic() + 60
    while True:
        try:
            reached = metric(daemon, "cns_connection_cap_reached", listener)
            break
        except OSError:
            assert time.monotonic() < deadline, "debug port unreachable after the attack"
    assert metric(daemon, "cns_max_connections", listener) == (
        DEBUG_MAX_CONNECTIONS if listener == "debug" else METRICS_MAX_CONNECTIONS
    )
    assert reached >= 1
    assert daemon.pool()["ips"]["Assigned"] == 20


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(make_daemon: Any) -> None:
    daemon = make_daemon(start=False)
    daemon.start(prefix=["prlimit", "--nofile=512:4096", "--"])
    limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
    (line,) = [entry for entry in limits.splitlines() if entry.startswith("Max open files")]
    assert line.split()[3:5] == ["4096", "4096"]
    assert metric(daemon, "cns_max_connections", "socket") == connection_caps(4096).socket


def _trickle(address: str | tuple[str, int], start: bytes, data: bytes, outcome: list[str]) -> None:
    """Send `start`, then one byte of `data` every 0.2 s until the daemon closes the connection
    (or 60 s pass)."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.connect(address)
        sock.sendall(start)
        sock.settimeout(0.2)
        deadline = time.monotonic() + 60
        for byte in data:
            if time.monotonic() > deadline:
                outcome.append("still open")
                return
            try:
                sock.send(bytes([byte]))
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as exc:
                outcome.append(f"closed: {type(exc).__name__}")
                return
            outcome.append(f"closed: {reply[:12]!r}")
            return
        outcome.append("sent everything")


@pytest.mark.parametrize("listener", ["socket", "debug", "metrics"])
def test_slow_and_idle_connections_are_closed(make_daemon: Any, listener: str) -> None:
    daemon = with_metrics_listener(make_daemon)
    ports = {"debug": daemon.port, "metrics": daemon.metrics_port}
    address = str(daemon.socket) if listener == "socket" else ("127.0.0.1", ports[listener])
    head = b"GET /v1/cni/status HTTP/1.1\r\nHost: cns\r\nX-Slow: " + b"a" * 1000
    post = b"POST /v1/cni/add HTTP/1.1\r\nHost: cns\r\nContent-Length: 1000\r\n\r\n"
    outcomes: dict[str, list[str]] = {"slow head": [], "slow body": []}
    threads = [
        threading.Thread(target=_trickle, args=(address, b"", head, outcomes["slow head"])),
        threading.Thread(target=_trickle, args=(address, post, b" " * 1000, outcomes["slow body"])),
    ]
    family = socket.AF_UNIX if listener == "socket" else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as idle:
        idle.connect(address)
        idle.settimeout(60)
        for thread in threads:
            thread.start()
        assert idle.recv(1) == b""  # closed by the daemon, not by the timeout
    for thread in threads:
        thread.join(70)
    assert outcomes["slow head"] and outcomes["slow head"][0].startswith("closed")
    assert outcomes["slow body"] and outcomes["slow body"][0].startswith("closed")
    if listener == "socket":
        assert outcomes["slow body"] == ["closed: b'HTTP/1.1 408'"]
    assert daemon.call("GET", "/v1/cni/status")[0] == 200


def test_debug_budget_refills_at_its_share_and_allows_a_burst() -> None:
    now = [0.0]
    budget = LoopBudget(share=0.02, burst=0.05, max_wait=2.0, clock=lambda: now[0])
    assert budget.wait_seconds() == 0  # a scrape never waits
    budget.charge(0.04)
    assert budget.wait_seconds() == 0  # within the burst
    budget.charge(0.03)  # 0.02 s in debt: paid back at 2 % of wall time
    assert budget.wait_seconds() == pytest.approx(1.0)
    now[0] = 0.5
    assert budget.wait_seconds() == pytest.approx(0.5)
    now[0] = 100.0
    assert budget.wait_seconds() == 0
    budget.charge(0.05 + 0.003)  # never more than the burst is saved up
    assert budget.wait_seconds() == pytest.approx(0.15)
    budget.charge(10.0)  # however much one request took, nobody waits more than max_wait
    assert budget.wait_seconds() == pytest.approx(2.0)


def test_connection_caps_leave_descriptors_for_the_socket() -> None:
    for limit in (1024, 4096, 65536, 1 << 20):
        caps = connection_caps(limit)
        assert caps.debug <= DEBUG_MAX_CONNECTIONS and caps.debug <= limit // 16
        assert caps.metrics <= METRICS_MAX_CONNECTIONS and caps.metrics <= limit // 128
        assert caps.socket + caps.debug + caps.metrics + RESERVED_DESCRIPTORS <= limit
    # never 0, whatever the limit
    assert connection_caps(100) == ConnectionCaps(socket=1, debug=6, metrics=1)
    assert connection_caps(1024).socket == 1024 - 64 - 8 - RESERVED_DESCRIPTORS


def test_a_reader_hammering_the_debug_port_is_served_and_pods_still_get_ips(
    make_daemon: Any,
) -> None:
    daemon = make_daemon()
    stop = threading.Event()
    served = [0]

    def reader() -> None:
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as sock:
            request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
            buffer = b""
            while not stop.is_set():
                sock.sendall(request)
                while b"\r\n\r\n" not in buffer:
                    buffer += sock.recv(65536)
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                buffer = buffer[length:]
                served[0] += 1

    readers = [threading.Thread(target=reader) for _ in range(4)]
    for thread in readers:
        thread.start()
    try:
        for n in range(30):
            assert add(daemon, n)[0] == 200
    finally:
        stop.set()
        for thread in readers:
            thread.join(60)
    assert served[0] > 0
    assert daemon.pool()["ips"]["Assigned"] == 30
