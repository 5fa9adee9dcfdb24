"""sd_notify and the watchdog heartbeat (cns/host/sdnotify.py), alone and sent by a real daemon.

Under a real systemd: tests/e2e/test_systemd.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.host import sdnotify


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's, named in $NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def pending(sock: socket.socket) -> list[str]:
    """Every message already received, without waiting."""
    messages = []
    sock.setblocking(False)
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


def next_message(sock: socket.socket, timeout: float = 20) -> str:
    sock.settimeout(timeout)
    return sock.recv(4096).decode()


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({}, None),  # not under systemd, or no WatchdogSec=
        ({"WATCHDOG_USEC": "20000000"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "4242"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "4243"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-1"}, None),
        ({"WATCHDOG_USEC": "20s"}, None),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "main"}, None),
    ],
)
def test_watchdog_interval_reads_the_environment_as_sd_watchdog_enabled(
    environ: dict[str, str], interval: float | None
) -> None:
    assert sdnotify.watchdog_interval(environ, 4242) == interval


def test_nothing_is_sent_when_not_under_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False


async def test_the_heartbeat_comes_from_the_loop_and_stops_while_it_is_stuck(
    notify_socket: socket.socket,
) -> None:
    heartbeat = asyncio.create_task(sdnotify.watchdog_forever(0.01))
    try:
        pings = 0
        while pings < 3:
            await asyncio.sleep(0.01)
            pings += len(pending(notify_socket))
        time.sleep(0.3)  # the loop is stuck for thirty intervals: a thread would ping on
        assert pending(notify_socket) == []
        while not (pings := pending(notify_socket)):
            await asyncio.sleep(0.01)  # the loop turns again, and so do the pings
        assert set(pings) == {"WATCHDOG=1"}
    finally:
        heartbeat.cancel()


async def test_a_failed_ping_is_logged_and_the_heartbeat_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    heartbeat = asyncio.create_task(sdnotify.watchdog_forever(0.01))
    await asyncio.sleep(0.1)
    assert not heartbeat.done()
    heartbeat.cancel()
    assert "watchdog_ping_failed" in capsys.readouterr().out


def test_the_daemon_pings_the_watchdog_once_ready(
    make_daemon: Any, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # the daemon inherits it: a ping every 0.1 s
    daemon = make_daemon(start=False)
    daemon.start(wait=False)
    assert next_message(notify_socket) == "READY=1"  # no ping before: systemd would arm early
    for _ in range(3):
        assert next_message(notify_socket) == "WATCHDOG=1"
    daemon.wait_ready()
    daemon.stop()
    assert "STOPPING=1" in pending(notify_socket)
