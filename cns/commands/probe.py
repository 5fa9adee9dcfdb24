"""`python -m cns.commands.probe SOCKET PATH`: the DaemonSet's readiness and liveness probes.

They ask the daemon's root-only debug socket, not its TCP port. Any local user may bind that port
while cns restarts or is upgraded; a kubelet probing the port would then hear whatever that user
answers: a lie that cns is well while it is not, or errors that make the kubelet restart a healthy
cns again and again, so that no pod gets an address. Standard library only, and nothing of cns
imported: the kubelet starts one every few seconds on every node.
"""

from __future__ import annotations

import socket
import sys

TIMEOUT_SECONDS = 3.0
MAX_REPLY_BYTES = 1 << 20


def probe(socket_path: str, path: str, *, timeout: float = TIMEOUT_SECONDS) -> tuple[int, bytes]:
    """The HTTP status and body of `GET path` on the unix socket (status 0: no status line)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(socket_path)
        conn.sendall(f"GET {path} HTTP/1.0\r\nHost: cns\r\n\r\n".encode("ascii"))
        reply = bytearray()
        while len(reply) <= MAX_REPLY_BYTES and (chunk := conn.recv(65536)):
            reply += chunk
    head, _, body = bytes(reply).partition(b"\r\n\r\n")
    words = head.split(b"\r\n", 1)[0].split()
    status = int(words[1]) if len(words) >= 2 and words[1].isdigit() else 0
    return status, body


def main(argv: list[str] | None = None) -> int:
    """0 when the daemon answers 200; 1 (and why, on stderr) otherwise; 2 for a wrong call."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].startswith("/"):
        print("usage: python -m cns.commands.probe SOCKET /PATH", file=sys.stderr)
        return 2
    socket_path, path = args
    try:
        status, body = probe(socket_path, path)
    except OSError as exc:
        print(f"cns.commands.probe: {socket_path}: {exc}", file=sys.stderr)
        return 1
    text = body[:512].decode("utf-8", "replace")
    if status != 200:
        print(
            f"cns.commands.probe: {path} answered {status or 'no HTTP status'}: {text}",
            file=sys.stderr,
        )
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
