"""The daemon's two HTTP listeners: who may hold a connection, for how long, and what gets logged.

aiohttp serves the requests; this module bounds what a client can take from the daemon:
- A cap on open connections per listener. A connection over the cap is closed as soon as it is
  accepted (counted in `cns_connections_rejected_total`), so idle clients of the debug port, which
  any local user can open, can never use up the descriptors the CNI socket needs.
- A deadline for every connection that is not inside a handler: aiohttp 3.14 arms its keep-alive
  timer at connection start as well, so `keepalive_timeout` closes a connection that has not
  delivered a complete request head within IDLE_SECONDS of opening or of its previous reply
  (slowloris and idle connections alike). Bodies have their own deadline (REQUEST_BODY_SECONDS in
  cns/api.py); a body nobody reads is drained for at most LINGER_SECONDS.
- aiohttp reports malformed requests through the stdlib logger `aiohttp.server` with a
  traceback; each listener gets its own logger whose records become one structlog event.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = structlog.get_logger("cns.server")

IDLE_SECONDS = 5.0
LINGER_SECONDS = 1.0
SOCKET_MAX_CONNECTIONS = 1024
DEBUG_MAX_CONNECTIONS = 64
# Descriptors kept for everything else: the state file, netlink sockets, the release queue,
# worker threads, the Kubernetes client's connections.
RESERVED_DESCRIPTORS = 256
REJECTION_LOG_SECONDS = 10.0


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


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    socket: int
    debug: int


def connection_caps(descriptor_limit: int) -> ConnectionCaps:
    """Caps that fit the descriptor limit with RESERVED_DESCRIPTORS left over; the debug port
    gets a small share, so the CNI socket keeps most of them whatever debug clients do."""
    debug = max(1, min(DEBUG_MAX_CONNECTIONS, descriptor_limit // 16))
    available = descriptor_limit - debug - RESERVED_DESCRIPTORS
    return ConnectionCaps(socket=max(1, min(SOCKET_MAX_CONNECTIONS, available)), debug=debug)


class ConnectionCap:
    """Counts one listener's open connections and refuses those over `limit`."""

    def __init__(self, listener: str, limit: int) -> None:
        self.listener = listener
        self.limit = limit
        self.open = 0
        self.rejected = 0
        self._logged_rejected = 0
        self._logged_at = -REJECTION_LOG_SECONDS

    def protocol_factory(self, make: web.Server) -> Any:
        def factory() -> asyncio.Protocol:
            if self.open >= self.limit:
                self._reject()
                return _Refused()
            self.open += 1
            return _Counted(make(), self)

        return factory

    def _reject(self) -> None:
        """Count it; log at most one line per REJECTION_LOG_SECONDS, however hard it is hit."""
        self.rejected += 1
        now = time.monotonic()
        if now - self._logged_at >= REJECTION_LOG_SECONDS:
            log.warning(
                "connections_rejected",
                listener=self.listener,
                limit=self.limit,
                rejected=self.rejected - self._logged_rejected,
            )
            self._logged_at, self._logged_rejected = now, self.rejected


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Counted(asyncio.Protocol):
    """Forwards everything to aiohttp's handler; gives the connection's slot back when it ends."""

    __slots__ = ("_cap", "_inner")

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
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
        self._cap.open -= 1
        self._inner.connection_lost(exc)


class CappedSite(web.BaseSite):
    """An aiohttp site (TCP or unix socket) whose connections go through a ConnectionCap."""

    __slots__ = ("_address", "cap")

    def __init__(
        self, runner: web.BaseRunner, address: tuple[str, int] | str, cap: ConnectionCap
    ) -> None:
        super().__init__(runner)
        self._address = address
        self.cap = cap

    @property
    def name(self) -> str:
        if isinstance(self._address, str):
            return f"unix:{self._address}"
        return f"http://{self._address[0]}:{self._address[1]}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        factory = self.cap.protocol_factory(server)
        if isinstance(self._address, str):
            self._server = await loop.create_unix_server(
                factory, self._address, backlog=self._backlog
            )
        else:
            host, port = self._address
            self._server = await loop.create_server(
                factory, host, port, backlog=self._backlog, reuse_address=True
            )


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
                reason=" ".join(str(exc.message).replace("^", "").split()),
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
