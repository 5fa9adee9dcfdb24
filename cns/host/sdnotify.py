"""systemd notifications (Type=notify, WatchdogSec=) without a libsystemd dependency."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("cns.host.sdnotify")


def notify(message: str) -> bool:
    """Send `message` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(message.encode())
    return True


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between two WATCHDOG=1 pings; None when systemd expects none.

    Reads $WATCHDOG_USEC and $WATCHDOG_PID as sd_watchdog_enabled(3) does: a timeout meant for
    another process (a different WATCHDOG_PID) or an unparsable one means no watchdog. The ping
    comes every half timeout, so one late ping is not yet a missed one.
    """
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
        owner = int(environ.get("WATCHDOG_PID", str(pid)))
    except ValueError:
        return None
    if usec <= 0 or owner != pid:
        return None
    return usec / 2_000_000


def ping_watchdog() -> None:
    """One heartbeat. A failed send is logged, never raised: systemd acts if pings stop."""
    try:
        notify("WATCHDOG=1")
    except OSError as exc:
        log.warning("watchdog_ping_failed", error=str(exc))


async def watchdog_forever(interval: float) -> None:
    """Ping systemd from the event loop itself, so a loop that stops turning stops the pings
    and systemd restarts the daemon (a thread would keep pinging for a stuck loop)."""
    while True:
        ping_watchdog()
        await asyncio.sleep(interval)
