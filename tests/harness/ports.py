"""Free loopback ports for the processes a test or a benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now; the caller's process may still lose it to another
    (`kube_cluster` retries when a process exits with "address already in use")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
