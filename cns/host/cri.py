"""The container runtime's own list of pod sandboxes, over its CRI socket (gRPC).

`RuntimeService/ListPodSandbox` is called with an empty filter: the runtime answers with every
sandbox it has, running or stopped, until the sandbox is removed. The leak check needs no more
than their ids; the start-up check of the state file (cns/node/startup_check.py) also asks
`PodSandboxStatus` of each ready sandbox for its addresses. The requests are sent and the
replies decoded by hand (a few lines of the protobuf wire format) instead of generating and
shipping the whole CRI API. `runtime.v1` is
asked first; a runtime that only has the older `runtime.v1alpha2` (containerd before 1.7 serves
both) is asked that instead, with the same messages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc is imported when a CRI socket is configured, not before
    import grpc.aio

SERVICES = ("runtime.v1.RuntimeService", "runtime.v1alpha2.RuntimeService")
_MAX_REPLY_BYTES = 64 * 1024 * 1024


class RuntimeUnavailable(Exception):
    """The runtime could not be asked, or its answer could not be read; the message says why."""


class WireError(ValueError):
    """Bytes that are not the protobuf message they should be."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise WireError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one protobuf message, in wire order: varints as int,
    length-delimited fields as bytes; fixed 32/64-bit fields are read and returned as int."""
    out: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, wire_type = tag >> 3, tag & 7
        value: int | bytes
        if wire_type == 0:
            value, at = _varint(data, at)
        elif wire_type == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise WireError(f"field {number} runs past the end of the message")
            value, at = data[at : at + length], at + length
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if at + size > len(data):
                raise WireError(f"field {number} runs past the end of the message")
            value, at = int.from_bytes(data[at : at + size], "little"), at + size
        else:
            raise WireError(f"field {number} has wire type {wire_type}, not one CRI uses")
        if number == 0:
            raise WireError("field number 0")
        out.append((number, value))
    return out


def sandbox_ids(reply: bytes) -> frozenset[str]:
    """The ids in a `ListPodSandboxResponse` (field 1: PodSandbox; its field 1: id)."""
    ids = set()
    for number, item in fields(reply):
        if number != 1 or not isinstance(item, bytes):
            continue
        for inner, value in fields(item):
            if inner == 1 and isinstance(value, bytes):
                ids.add(value.decode())
    return frozenset(ids)


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A sandbox as ListPodSandbox names it: id, whether it is ready, and its pod."""

    id: str
    ready: bool
    pod_namespace: str
    pod_name: str


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise WireError("a string field is not length-delimited")
    return value.decode()


def _metadata(data: bytes) -> tuple[str, str]:
    """(namespace, name) of a PodSandboxMetadata (name 1, namespace 3)."""
    found = {number: _text(value) for number, value in fields(data) if number in (1, 3)}
    return found.get(3, ""), found.get(1, "")


def sandboxes(reply: bytes) -> list[Sandbox]:
    """The sandboxes of a `ListPodSandboxResponse` (PodSandbox: id 1, metadata 2, state 3,
    where SANDBOX_READY is 0, the default, so a ready sandbox carries no state field)."""
    found = []
    for number, item in fields(reply):
        if number != 1 or not isinstance(item, bytes):
            continue
        sandbox_id, state, pod = "", 0, ("", "")
        for inner, value in fields(item):
            if inner == 1:
                sandbox_id = _text(value)
            elif inner == 2 and isinstance(value, bytes):
                pod = _metadata(value)
            elif inner == 3 and isinstance(value, int):
                state = value
        found.append(Sandbox(sandbox_id, state == 0, *pod))
    return found


def sandbox_addresses(reply: bytes) -> tuple[bool, tuple[str, ...]]:
    """Whether the sandbox of a `PodSandboxStatusResponse` is ready, and its addresses
    (status 1 -> state 3, network 5 -> ip 1 and additional_ips 2 -> ip 1)."""
    ready, addresses = True, []
    for number, status in fields(reply):
        if number != 1 or not isinstance(status, bytes):
            continue
        for inner, value in fields(status):
            if inner == 3 and isinstance(value, int):
                ready = value == 0
            elif inner == 5 and isinstance(value, bytes):
                for net, item in fields(value):
                    if net == 1:
                        addresses.append(_text(item))
                    elif net == 2 and isinstance(item, bytes):
                        addresses += [_text(ip) for n, ip in fields(item) if n == 1]
    return ready, tuple(a for a in addresses if a)


def _status_request(sandbox_id: str) -> bytes:
    """A `PodSandboxStatusRequest` naming one sandbox (field 1), not verbose."""
    encoded = sandbox_id.encode()
    length, size = bytearray(), len(encoded)
    while True:
        length.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    return b"\x0a" + bytes(length) + encoded


@dataclass(frozen=True, slots=True)
class LiveSandbox:
    """A ready sandbox, its pod and the addresses the runtime says it has."""

    sandbox: Sandbox
    addresses: tuple[str, ...]


class CriSandboxes:
    """Asks the runtime behind a CRI unix socket which sandboxes exist."""

    def __init__(self, socket_path: str, *, timeout_seconds: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_seconds = timeout_seconds
        self._channel: grpc.aio.Channel | None = None
        self._service = SERVICES[0]

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            import grpc.aio

            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.max_receive_message_length", _MAX_REPLY_BYTES)],
            )
        return self._channel

    async def _list(self) -> bytes:
        """The ListPodSandbox reply of whichever CRI version the runtime serves."""
        import grpc

        for service in (self._service, *(s for s in SERVICES if s != self._service)):
            call = self._open().unary_unary(f"/{service}/ListPodSandbox")
            try:
                reply: bytes = await call(b"", timeout=self.timeout_seconds)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                raise self._unavailable(exc) from exc
            self._service = service
            return reply
        raise RuntimeUnavailable(f"CRI {self.socket_path}: serves no CRI version cns knows")

    def _unavailable(self, exc: grpc.aio.AioRpcError) -> RuntimeUnavailable:
        return RuntimeUnavailable(f"CRI {self.socket_path}: {exc.code().name}: {exc.details()}")

    def _unreadable(self, what: str, exc: Exception) -> RuntimeUnavailable:
        return RuntimeUnavailable(f"CRI {self.socket_path}: unreadable {what} reply: {exc}")

    async def list_sandbox_ids(self) -> frozenset[str]:
        """Every sandbox id the runtime has; RuntimeUnavailable when it cannot say."""
        reply = await self._list()
        try:
            return sandbox_ids(reply)
        except (WireError, UnicodeDecodeError) as exc:
            raise self._unreadable("ListPodSandbox", exc) from exc

    async def live_sandboxes(self) -> list[LiveSandbox]:
        """Every ready sandbox with its addresses (one PodSandboxStatus each, all at once); one
        removed meanwhile is left out. RuntimeUnavailable when the runtime cannot say."""
        try:
            listed = [s for s in sandboxes(await self._list()) if s.ready]
        except (WireError, UnicodeDecodeError) as exc:
            raise self._unreadable("ListPodSandbox", exc) from exc
        found = await asyncio.gather(*(self._status(s) for s in listed))
        return [live for live in found if live is not None]

    async def _status(self, sandbox: Sandbox) -> LiveSandbox | None:
        import grpc

        call = self._open().unary_unary(f"/{self._service}/PodSandboxStatus")
        try:
            reply = await call(_status_request(sandbox.id), timeout=self.timeout_seconds)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None  # removed since it was listed
            raise self._unavailable(exc) from exc
        try:
            ready, addresses = sandbox_addresses(reply)
        except (WireError, UnicodeDecodeError) as exc:
            raise self._unreadable("PodSandboxStatus", exc) from exc
        return LiveSandbox(sandbox, addresses) if ready else None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
