"""Signals and shutdown: SIGTERM answers everybody within a bound; other signals never kill."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tests.harness import REPO

CLIENT_TIMEOUT_SECONDS = 60.0


def unit_stop_timeout() -> float:
    """The bound the daemon must stop within: systemd kills it after this."""
    unit = (REPO / "systemd/cns.service").read_text()
    match = re.search(r"^TimeoutStopSec=(\d+)s?$", unit, re.MULTILINE)
    assert match is not None, "systemd/cns.service sets no TimeoutStopSec"
    return float(match[1])


def ends_without_hanging(sock: socket.socket) -> bool:
    """Whatever the daemon sends, the connection ends (EOF or reset) before our timeout."""
    sock.settimeout(CLIENT_TIMEOUT_SECONDS)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


def exchange(path: Path, method: str, url: str, body: Any = None) -> tuple[str, Any]:
    """One request; the outcome is "200", "<status>:<code>", "closed", "refused" or "hung"."""
    payload = b"" if body is None else json.dumps(body).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CLIENT_TIMEOUT_SECONDS)
            sock.connect(str(path))
            sock.sendall(
                f"{method} {url} HTTP/1.1\r\nHost: cns\r\nContent-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + payload
            )
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except TimeoutError:
        return "hung", None
    except (FileNotFoundError, ConnectionRefusedError):
        return "refused", None
    except (ConnectionResetError, BrokenPipeError):  # closed while we still wrote: the same
        return "closed", None
    if not data:
        return "closed", None
    head, _, raw = data.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode()
    reply = json.loads(raw)
    return (status, reply) if status == "200" else (f"{status}:{reply['code']}", reply)


def test_sigterm_answers_every_client_and_stops_within_the_bound(make_daemon: Any) -> None:
    daemon = make_daemon({"scaler": {"batchSize": 64}})
    daemon.wait_pool(lambda p: p["ips"]["Available"] >= 60)
    outcomes: list[tuple[str, str, str]] = []  # (verb, containerID, outcome)
    stop_clients = threading.Event()

    def client(n: int) -> None:
        i = 0
        while not stop_clients.is_set():
            cid = f"c{n}-{i}"
            i += 1
            key = {"containerID": cid, "ifName": "eth0"}
            added, _ = exchange(daemon.socket, "POST", "/v1/cni/add", {**key, "netns": "/x"})
            outcomes.append(("add", cid, added))
            if added in ("refused", "closed", "hung"):
                return
            if i % 2:  # every other pod keeps its IP
                deleted, _ = exchange(daemon.socket, "POST", "/v1/cni/del", key)
                outcomes.append(("del", cid, deleted))

    # A client that sends a head and never its body, and one that sends nothing at all.
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(str(daemon.socket))
    slow.sendall(b"POST /v1/cni/add HTTP/1.1\r\nHost: cns\r\nContent-Length: 99\r\n\r\n{")
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(str(daemon.socket))
    clients = [threading.Thread(target=client, args=(n,)) for n in range(12)]
    for thread in clients:
        thread.start()
    while len(outcomes) < 200:
        time.sleep(0.01)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=unit_stop_timeout()) == 0
    daemon.proc = None
    stop_clients.set()
    for thread in clients:
        thread.join(CLIENT_TIMEOUT_SECONDS + 10)
    assert ends_without_hanging(slow) and ends_without_hanging(idle)

    kinds = {outcome for _, _, outcome in outcomes}
    assert "hung" not in kinds
    assert kinds <= {"200", "503:11", "closed", "refused"}, kinds
    daemon.start()
    assigned = {ip["owner"]["containerID"] for ip in daemon.ips() if ip["owner"]}
    added = {cid for verb, cid, outcome in outcomes if verb == "add" and outcome == "200"}
    deleted = {cid for verb, cid, outcome in outcomes if verb == "del" and outcome == "200"}
    assert added - deleted <= assigned  # every acknowledged ADD survived
    assert not deleted & assigned  # and every acknowledged DEL
    assert '"cns_stopped"' in daemon.log()


def test_adds_waiting_for_an_ip_are_refused_at_once_on_sigterm(make_daemon: Any) -> None:
    daemon = make_daemon({"addTimeoutSeconds": 30, "standalone": {"allocationLatencyMs": 20000}})
    replies: list[tuple[str, Any]] = []

    def waiting_add(n: int) -> None:
        body = {"containerID": f"w{n}", "ifName": "eth0", "netns": "/x"}
        replies.append(exchange(daemon.socket, "POST", "/v1/cni/add", body))

    threads = [threading.Thread(target=waiting_add, args=(n,)) for n in range(5)]
    for thread in threads:
        thread.start()
    daemon.wait_pool(lambda p: p["waitingAdds"] == 5)
    assert daemon.stop(signal.SIGTERM) == 0
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_SECONDS + 10)
    assert [outcome for outcome, _ in replies] == ["503:11"] * 5
    assert all("shutting down" in reply["msg"] for _, reply in replies)


def test_sighup_applies_the_release_queue_and_reconciles(make_daemon: Any) -> None:
    daemon = make_daemon()
    key = {"containerID": "c1", "ifName": "eth0"}
    assert exchange(daemon.socket, "POST", "/v1/cni/add", key)[0] == "200"
    queue = daemon.state_dir / "release-queue"
    queue.mkdir(exist_ok=True)
    (queue / "c1_eth0.json").write_text(json.dumps({**key, "queuedAt": time.time()}))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_pool(lambda p: p["ips"]["Assigned"] == 0)
    # The release shows in the pool before the drain commits it and logs its line.
    deadline = time.monotonic() + 10
    while '"release_queue_drained"' not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.proc.poll() is None
    events = [json.loads(line)["event"] for line in daemon.log().splitlines()]
    assert "refresh_signal_received" in events and "release_queue_drained" in events
    assert not (queue / "c1_eth0.json").exists()


def test_usr1_usr2_and_pipe_do_not_kill_the_daemon(make_daemon: Any) -> None:
    daemon = make_daemon()
    assert daemon.proc is not None
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
        daemon.proc.send_signal(sig)
    deadline = time.monotonic() + 10
    while daemon.log().count('"pool_summary"') < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.proc.poll() is None
    summaries = [json.loads(line) for line in daemon.log().splitlines() if '"pool_summary"' in line]
    assert {s["signal"] for s in summaries} == {"SIGUSR1", "SIGUSR2"}
    assert all("Assigned" in s and "requestedIPCount" in s for s in summaries)
    assert daemon.get("/healthz") == {"ok": True}
    assert daemon.stop() == 0
