"""Nobody else's port stops the CNI socket (issue 25, case 11).

A local user who binds the debug port before cns starts (a restart, an upgrade) used to keep
cns from starting at all, and answered the `/healthz` and `/debug/*` that `cns status` read. Now
the daemon serves pods whatever happens to that port, reports it, takes the port once it is free,
and serves the debug endpoint on a root-only unix socket that `cns status` reads first.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.daemon import Daemon, parse_metrics, unix_request
from tests.harness.requirements import missing_root, require

SQUATTER = """
import http.server, json, sys
class Lie(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"ok": True, "ready": True, "squatter": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Lie)
print("listening", flush=True)
server.serve_forever()
"""


@pytest.fixture
def squatted(make_daemon: Any) -> Iterator[tuple[Daemon, subprocess.Popen[str]]]:
    """A daemon not started yet, and a process of user `nobody` on its debug port."""
    require(missing_root())
    daemon = make_daemon({}, start=False)
    squatter = subprocess.Popen(
        ["/usr/bin/python3", "-I", "-c", SQUATTER, str(daemon.port)],
        user="nobody",
        group="nogroup",
        extra_groups=[],
        cwd="/",
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "listening\n"
        yield daemon, squatter
    finally:
        squatter.kill()
        squatter.wait()


def debug_text(daemon: Daemon, path: str) -> str:
    """A debug endpoint's reply body through the daemon's debug socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.debug_socket))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: cns\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2].decode()


def on_port(daemon: Daemon, path: str) -> Any:
    with urllib.request.urlopen(f"{daemon.debug_url}{path}", timeout=5) as response:
        return json.load(response)


def wait_for(predicate: Any, what: str, daemon: Daemon, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{daemon.log_tail()}"
        time.sleep(0.05)


def ready_on_socket(daemon: Daemon) -> bool:
    try:
        return unix_request(daemon.debug_socket, "GET", "/readyz")[0] == 200
    except OSError:
        return False


def cns_status(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CNS_DEBUG_URL"}
    return subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "status",
         "--config", str(daemon.config_path), *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_a_squatted_debug_port_stops_neither_the_socket_nor_cns_status(
    squatted: tuple[Daemon, subprocess.Popen[str]],
) -> None:
    daemon, squatter = squatted
    assert on_port(daemon, "/healthz")["squatter"]  # the port answers, and it is not cns
    daemon.start(wait=False)
    wait_for(lambda: ready_on_socket(daemon), "readiness on the debug socket", daemon)
    for n in range(3):
        status, body = daemon.call(
            "POST", "/v1/cni/add", {"containerID": f"c{n}", "ifName": "eth0"}
        )
        assert status == 200, body
    mode = os.stat(daemon.debug_socket)
    assert stat.S_ISSOCK(mode.st_mode) and stat.S_IMODE(mode.st_mode) == 0o600
    assert mode.st_uid == 0

    status, health = unix_request(daemon.debug_socket, "GET", "/healthz")
    assert status == 200 and health["ok"], health
    port = health["debugListen"]
    assert port["address"] == f"127.0.0.1:{daemon.port}" and not port["serving"], port
    assert "Address already in use" in port["error"], port
    status, ready = unix_request(daemon.debug_socket, "GET", "/readyz")
    assert ready["ready"] and not ready["debugListen"]["serving"], ready
    metrics = parse_metrics(debug_text(daemon, "/metrics"))
    labels = f'{{address="127.0.0.1:{daemon.port}",listener="debug"}}'
    assert metrics[f"cns_listener_up{labels}"] == 0
    assert metrics[f"cns_listen_failures_total{labels}"] >= 1
    assert '"event": "debug_listen_failed"' in daemon.log()

    # `cns status` reads the daemon through its socket, and says so; the squatter never answers.
    shown = cns_status(daemon, "--json")
    assert shown.returncode == 0, shown.stderr
    pool = json.loads(shown.stdout)
    assert pool["ips"]["Assigned"] == 3 and "squatter" not in pool, pool
    assert f"read unix:{daemon.debug_socket}" in shown.stderr
    table = cns_status(daemon)
    assert table.returncode == 0, table.stderr
    assert f"endpoint                 unix:{daemon.debug_socket}" in table.stdout
    assert "Assigned            3" in table.stdout

    # Once the port is free, the daemon takes it.
    squatter.kill()
    squatter.wait()

    def served_by_cns() -> bool:
        try:
            return bool(on_port(daemon, "/healthz") == {"ok": True})
        except OSError:
            return False

    wait_for(served_by_cns, "debug port served by cns", daemon)
    assert on_port(daemon, "/debug/pool")["ips"]["Assigned"] == 3
    metrics = parse_metrics(debug_text(daemon, "/metrics"))
    assert metrics[f"cns_listener_up{labels}"] == 1
    assert '"event": "debug_listen_serving"' in daemon.log()
    assert daemon.stop() == 0
    assert not daemon.debug_socket.exists() and not daemon.socket.exists()


def test_a_daemon_still_waiting_for_its_debug_port_stops_cleanly(
    squatted: tuple[Daemon, subprocess.Popen[str]],
) -> None:
    daemon, _squatter = squatted
    daemon.start(wait=False)
    wait_for(lambda: ready_on_socket(daemon), "readiness on the debug socket", daemon)
    assert daemon.call("POST", "/v1/cni/add", {"containerID": "c0", "ifName": "eth0"})[0] == 200
    assert daemon.stop() == 0
    assert '"event": "cns_stopped"' in daemon.log()
    assert not daemon.debug_socket.exists() and not daemon.socket.exists()


def kubelet_probe(daemon: Daemon, path: str) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's exec probe, as the kubelet runs it in the container."""
    return subprocess.run(
        [sys.executable, "-m", "cns.commands.probe", str(daemon.debug_socket), path],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_the_kubelets_probes_hear_cns_not_the_squatter(
    squatted: tuple[Daemon, subprocess.Popen[str]],
) -> None:
    """The DaemonSet's probes used to ask the debug port: with a squatter there, the kubelet
    heard the squatter's answer, a lie that cns is well (or errors that restart a healthy cns
    again and again). They ask the root-only debug socket: cns answers, and nobody once cns is
    gone, whatever the port says."""
    daemon, _squatter = squatted
    daemon.start(wait=False)
    wait_for(lambda: ready_on_socket(daemon), "readiness on the debug socket", daemon)
    for path in ("/healthz", "/readyz"):
        probed = kubelet_probe(daemon, path)
        assert probed.returncode == 0, probed.stderr
        answer = json.loads(probed.stdout)
        assert "squatter" not in answer and not answer["debugListen"]["serving"], answer
    assert daemon.stop() == 0
    assert on_port(daemon, "/healthz")["squatter"]  # a probe of the port would still pass
    for path in ("/healthz", "/readyz"):
        probed = kubelet_probe(daemon, path)
        assert probed.returncode == 1 and str(daemon.debug_socket) in probed.stderr, probed


def test_the_probe_fails_on_any_answer_but_200(tmp_path: Any) -> None:
    """A daemon that answers 503 (not ready) or no HTTP at all fails the probe."""
    path = str(tmp_path / "debug.sock")
    for reply, expected in (
        (b"HTTP/1.1 503 Service Unavailable\r\n\r\n{}", "answered 503"),
        (b"garbage", "no HTTP status"),
        (b"HTTP/1.1 200 OK\r\n\r\n{}", ""),
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen(1)

            def answer(server: socket.socket = server, reply: bytes = reply) -> None:
                conn, _ = server.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(reply)

            thread = threading.Thread(target=answer)
            thread.start()
            probed = subprocess.run(
                [sys.executable, "-m", "cns.commands.probe", path, "/healthz"],
                cwd=REPO, capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            thread.join()
        os.unlink(path)
        assert probed.returncode == (1 if expected else 0), probed
        assert expected in probed.stderr, probed.stderr
