"""systemd readiness notification (Type=notify) without a libsystemd dependency."""

from __future__ import annotations

import os
import socket


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
