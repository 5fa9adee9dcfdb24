"""The daemon's two HTTP listeners: who may hold a connection, for how long, and what gets logged.

aiohttp serves the requests; this module bounds what a client can take from the daemon:
- A cap on open connections per listener: at the cap the listener stops accepting (counted in
  `cns_connection_cap_reached_total`) until a connection closes, so clients of the debug port,
  which any local user can open, and of the metrics listener, which any host that reaches the
  node can open, can never use up the descriptors the CNI socket needs.
- A deadline for every connection that is not inside a handler: aiohttp 3.14 arms its keep-alive
  timer at connection start as well, so `keepalive_timeout` closes a connection that has not
  delivered a complete request head within IDLE_SECONDS of opening or of its previous reply
  (slowloris and idle connections alike). Bodies have their own deadline (REQUEST_BODY_SECONDS in
  cns/web/api.py); a body nobody reads is drained for at most LINGER_SECONDS.
- aiohttp reports malformed requests through the stdlib logger `aiohttp.server` with a
  traceback; each listener gets its own logger whose records become one structlog event.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = structlog.get_logger("cns.web.listeners")

IDLE_SECONDS = 5.0
LINGER_SECONDS = 1.0
SOCKET_MAX_CONNECTIONS = 1024
DEBUG_MAX_CONNECTIONS = 64
# The metrics listener (metrics.address) serves Prometheus servers, a pair or a few.
METRICS_MAX_CONNECTIONS = 8
# The debug endpoint's unix socket is root's only (`cns status`, probes): a few suffice.
DEBUG_SOCKET_MAX_CONNECTIONS = 8
# Descriptors kept for everything else: the state file, netlink sockets, the release queue,
# worker threads, the Kubernetes client's connections.
RESERVED_DESCRIPTORS = 256
CAP_LOG_SECONDS = 10.0
# aiohttp's parser errors quote the client's bytes (up to a whole read, 64 KiB and more): a
# log line must not carry that much of what any local user sent.
MAX_REASON_CHARACTERS = 200
ACCEPT_RETRY_SECONDS = 1.0


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("descriptor_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    return soft


@dataclass(slots=True)
class ListenerStatus:
    """Whether a listener the daemon can do without (the debug port, the metrics listener) is
    serving, and why not.

    The port is one any local user may bind first; its state is reported (/healthz, /readyz,
    metrics) rather than allowed to stop the daemon."""

    address: str
    listener: str  # its name in logs and metrics: "debug", "metrics"
    serving: bool = False
    error: str = ""
    failures: int = 0  # failed attempts to listen

    def view(self) -> dict[str, object]:
        return {"address": self.address, "serving": self.serving, "error": self.error or None}


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    socket: int
    debug: int
    metrics: int


def connection_caps(descriptor_limit: int) -> ConnectionCaps:
    """Caps that fit the descriptor limit with RESERVED_DESCRIPTORS left over; the debug port
    and the metrics listener get small shares, so the CNI socket keeps most of them whatever
    their clients do."""
    debug = max(1, min(DEBUG_MAX_CONNECTIONS, descriptor_limit // 16))
    metrics = max(1, min(METRICS_MAX_CONNECTIONS, descriptor_limit // 128))
    available = descriptor_limit - debug - metrics - RESERVED_DESCRIPTORS
    return ConnectionCaps(
        socket=max(1, min(SOCKET_MAX_CONNECTIONS, available)), debug=debug, metrics=metrics
    )


class ConnectionCap:
    """One listener's open connections (from accept to close) against its limit."""

    def __init__(self, listener: str, limit: int) -> None:
        self.listener = listener
        self.limit = limit
        self.open = 0
        self.reached = 0  # times the listener stopped accepting because it was full
        self._logged_at = -CAP_LOG_SECONDS
        self._logged_reached = 0

    @property
    def full(self) -> bool:
        return self.open >= self.limit

    def note_reached(self) -> None:
        """Count it; log at most one line per CAP_LOG_SECONDS, however hard it is hit."""
        self.reached += 1
        now = time.monotonic()
        if now - self._logged_at >= CAP_LOG_SECONDS:
            log.warning(
                "connection_cap_reached",
                listener=self.listener,
                limit=self.limit,
                times=self.reached - self._logged_reached,
            )
            self._logged_at, self._logged_reached = now, self.reached


class _Counted(asyncio.Protocol):
    """Forwards everything to aiohttp's handler; gives the connection's slot back when it ends."""

    __slots__ = ("_inner", "_release", "made")

    def __init__(self, inner: asyncio.Protocol, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release = release
        self.made = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self._inner.connection_lost(exc)


class CappedSite(web.BaseSite):
    """An aiohttp site (TCP or unix socket) that accepts at most `cap.limit` connections at once.

    It runs its own accept loop rather than asyncio's: at the cap it stops accepting, and clients
    wait in the kernel's listen backlog (or are refused when that is full) at no cost to the
    event loop. Accepting them only to close them again would let a client that connects in a
    loop keep the loop busy, which is what the cap is there to prevent.
    """

    __slots__ = ("_accepting", "_address", "_connecting", "_listener", "_loop", "cap")

    def __init__(
        self, runner: web.BaseRunner, address: tuple[str, int] | str, cap: ConnectionCap
    ) -> None:
        super().__init__(runner)
        self._address = address
        self.cap = cap
        self._listener: socket.socket | None = None
        self._accepting = False
        self._connecting: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def name(self) -> str:
        if isinstance(self._address, str):
            return f"unix:{self._address}"
        return f"http://{self._address[0]}:{self._address[1]}"

    async def start(self) -> None:
        """Bind and listen; on OSError the site is left unregistered, so it may be tried again
        with a new site without leaving one behind per attempt."""
        await super().start()
        self._loop = asyncio.get_running_loop()
        try:
            listener = self._bind()
        except OSError:
            await super().stop()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._resume()

    def _bind(self) -> socket.socket:
        if isinstance(self._address, str):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(self._address)
                listener.listen(self._backlog)
            except OSError:
                listener.close()
                raise
            return listener
        host, port = self._address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=self._backlog)

    async def stop(self) -> None:
        """Stop accepting; connections already accepted are left to the runner's shutdown."""
        self._pause()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await super().stop()

    def _resume(self) -> None:
        if not self._accepting and self._listener is not None and not self.cap.full:
            assert self._loop is not None
            self._loop.add_reader(self._listener.fileno(), self._accept)
            self._accepting = True

    def _pause(self) -> None:
        if self._accepting and self._listener is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._listener.fileno())
            self._accepting = False

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        while not self.cap.full:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # out of descriptors or memory: back off, as asyncio does
                log.error("accept_failed", listener=self.cap.listener, error=str(exc))
                self._pause()
                self._loop.call_later(ACCEPT_RETRY_SECONDS, self._resume)
                return
            conn.setblocking(False)
            self._serve(conn)
        self._pause()
        self.cap.note_reached()

    def _serve(self, conn: socket.socket) -> None:
        assert self._loop is not None
        server = self._runner.server
        assert server is not None
        self.cap.open += 1
        protocol = _Counted(server(), self._release)
        task = self._loop.create_task(self._loop.connect_accepted_socket(lambda: protocol, conn))
        self._connecting.add(task)

        def done(task: asyncio.Task[Any]) -> None:
            self._connecting.discard(task)
            if not protocol.made:  # failed before the connection existed: nothing will end it
                conn.close()
                self._release()

        task.add_done_callback(done)

    def _release(self) -> None:
        self.cap.open -= 1
        self._resume()


def bounded_reason(text: str) -> str:
    """One line, at most MAX_REASON_CHARACTERS of it, saying how long it was if cut."""
    reason = " ".join(text.replace("^", "").split())
    if len(reason) <= MAX_REASON_CHARACTERS:
        return reason
    return f"{reason[:MAX_REASON_CHARACTERS]}... ({len(reason)} characters)"


class _StructlogBridge(logging.Handler):
    """aiohttp's server log records as one structlog event each, naming the listener."""

    def __init__(self, listener: str) -> None:
        super().__init__(logging.DEBUG)
        self.listener = listener

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(exc, HttpProcessingError):
            # "Error handling request from %s": the one argument is the peer.
            log.warning(
                "http_bad_request",
                listener=self.listener,
                peer=str(args[0]) if args else "",
                status=exc.code,
                reason=bounded_reason(str(exc.message)),
            )
        else:
            log.error(
                "http_server_error",
                listener=self.listener,
                message=record.getMessage(),
                exc_info=record.exc_info,
            )


def http_logger(listener: str) -> logging.Logger:
    """The stdlib logger to hand aiohttp for one listener (see _StructlogBridge)."""
    logger = logging.getLogger(f"cns.http.{listener}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(_StructlogBridge(listener))
    return logger


def runner_options(listener: str, shutdown_seconds: float) -> dict[str, Any]:
    """AppRunner keyword arguments shared by both listeners."""
    return {
        "access_log": None,
        "handle_signals": False,
        "keepalive_timeout": IDLE_SECONDS,
        "lingering_time": LINGER_SECONDS,
        "logger": http_logger(listener),
        "shutdown_timeout": shutdown_seconds,
    }
