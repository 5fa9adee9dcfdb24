"""The container runtime's own list of pod sandboxes, over its CRI socket (gRPC).

Only `RuntimeService/ListPodSandbox` is called, with an empty filter: the runtime answers with
every sandbox it has, running or stopped, until the sandbox is removed. The leak check needs no
more than their ids, so the request is sent and the reply decoded by hand (a few lines of the
protobuf wire format) instead of generating and shipping the whole CRI API. `runtime.v1` is
asked first; a runtime that only has the older `runtime.v1alpha2` (containerd before 1.7 serves
both) is asked that instead, with the same messages.
"""

from __future__ import annotations

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

    async def list_sandbox_ids(self) -> frozenset[str]:
        """Every sandbox id the runtime has; RuntimeUnavailable when it cannot say."""
        import grpc

        for service in (self._service, *(s for s in SERVICES if s != self._service)):
            call = self._open().unary_unary(f"/{service}/ListPodSandbox")
            try:
                reply = await call(b"", timeout=self.timeout_seconds)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                raise RuntimeUnavailable(
                    f"CRI {self.socket_path}: {exc.code().name}: {exc.details()}"
                ) from exc
            self._service = service
            try:
                return sandbox_ids(reply)
            except (WireError, UnicodeDecodeError) as exc:
                raise RuntimeUnavailable(
                    f"CRI {self.socket_path}: unreadable ListPodSandbox reply: {exc}"
                ) from exc
        raise RuntimeUnavailable(f"CRI {self.socket_path}: serves no CRI version cns knows")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
