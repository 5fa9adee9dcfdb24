"""The cns daemon's client side, shared by both plugins: how to reach the daemon (from the network
config), HTTP/1.1 over its unix socket, the result conversion, and the verbs both plugins run the
same way (ADD, CHECK and DEL each through a path of its own; GC and STATUS alike).

The transport is deliberately small: one request per connection (``Connection: close``), a reply
that carries ``Content-Length`` (every reply of the daemon's aiohttp server does; tested in
``tests/unit/cni_plugin/test_cns_ipam.py``) or ends at EOF. Anything else is code 101: the daemon
never sends chunked replies, so the plugin does not decode them.
"""

from __future__ import annotations

import _socket
import time

from cni_plugin import tinyjson
from cni_plugin.skel import (
    ERR_INVALID_CONFIG,
    ERR_NOT_AVAILABLE,
    ERR_PROTOCOL,
    ERR_UNREACHABLE,
    CniError,
    config_number,
    config_str,
    print_json,
    require_version,
    subnets_problem,
    version_tuple,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cni_plugin.skel import CniEnv, NetConf

DEFAULT_SOCKET = "/run/cns/cns.sock"
DEFAULT_RELEASE_QUEUE_DIR = "/var/lib/cns/release-queue"
# The daemon may hold an ADD for up to 10 s waiting for a free IP; the client must outwait it.
DEFAULT_TIMEOUT_SECONDS = 15.0
MAX_TIMEOUT_SECONDS = 3600.0  # a runtime gives up on a plugin long before
MAX_REPLY_BYTES = 4 << 20
VALID_ATTACHMENTS_KEY = "cni.dev/valid-attachments"


class DaemonClient:
    """Where the daemon listens, where DELs are queued while it is down, and how long to wait."""

    __slots__ = ("release_queue_dir", "socket", "subnets", "timeout")

    def __init__(
        self,
        *,
        socket: str,
        release_queue_dir: str,
        timeout: float,
        subnets: tuple[str, ...] = (),
    ) -> None:
        self.socket = socket
        self.release_queue_dir = release_queue_dir
        self.timeout = timeout
        self.subnets = subnets  # what an ADD asks for: one IP of each (cns-ipam's ``subnets``)

    def get(self, path: str) -> object:
        """GET ``path``: the body of a 2xx reply; the CniError of any other (or none)."""
        return self._call(path, method="GET", body=None)

    def post(self, path: str, body: object) -> object:
        """POST ``body`` to ``path``: the body of a 2xx reply; the CniError of any other."""
        return self._call(path, method="POST", body=body)

    def _call(self, path: str, *, method: str, body: object | None) -> object:
        status, reply = self.request(path, method=method, body=body)
        if 200 <= status < 300:
            return reply
        raise self.error_from_reply(status, reply)

    def request(self, path: str, *, method: str, body: object | None) -> tuple[int, object]:
        """One HTTP/1.1 request over the daemon's unix socket: ``(status, parsed JSON body)``.

        ``body`` None sends no body (``Content-Length: 0``); an empty reply body parses as None.
        Code 100 if the daemon cannot be reached, the connection fails, or no full reply arrives
        within the timeout; 101 if the reply is not HTTP/1.x with a JSON body.
        """
        payload = b"" if body is None else tinyjson.dumps(body).encode("ascii")
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: cns\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode("ascii")
        return self._parse_reply(self._exchange(head + payload))

    def error_from_reply(self, status: int, reply: object) -> CniError:
        """The CniError carried by a non-2xx reply (docs/api.md), or code 101 if it carries none."""
        if isinstance(reply, dict):
            code = reply.get("code")
            msg = reply.get("msg")
            details = reply.get("details", "")
            if (
                isinstance(code, int)
                and not isinstance(code, bool)
                and code > 0
                and isinstance(msg, str)
            ):
                if details is None:
                    details = ""
                if not isinstance(details, str):
                    details = tinyjson.dumps(details)
                return CniError(code, msg, details=details)
        return self._protocol(
            f"replied HTTP {status} without a CNI error body", details=tinyjson.dumps(reply)[:300]
        )

    def _unreachable(self, reason: str) -> CniError:
        return CniError(ERR_UNREACHABLE, f"cns daemon unreachable at {self.socket}: {reason}")

    def _protocol(self, msg: str, *, details: str = "") -> CniError:
        return CniError(ERR_PROTOCOL, f"cns daemon at {self.socket} {msg}", details=details)

    def _connect(self, sock: _socket.socket, deadline: float) -> None:
        """Connect, retrying while the daemon's listen backlog is full (EAGAIN on a unix socket)."""
        while True:
            try:
                sock.connect(self.socket)
                return
            except BlockingIOError:
                if time.monotonic() + 0.02 >= deadline:
                    raise TimeoutError("listen backlog full") from None
                time.sleep(0.02)

    def _exchange(self, data: bytes) -> bytes:
        """Send ``data`` and read the reply until EOF (or until Content-Length is satisfied)."""
        deadline = time.monotonic() + self.timeout
        try:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        except OSError as exc:
            raise self._unreachable(exc.strerror or str(exc)) from None
        try:
            sock.settimeout(self.timeout)
            self._connect(sock, deadline)
            sock.sendall(data)
            buf = bytearray()
            while not _complete(buf):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > MAX_REPLY_BYTES:
                    raise self._protocol(f"sent a reply larger than {MAX_REPLY_BYTES} bytes")
            return bytes(buf)
        except TimeoutError:
            raise self._unreachable(f"no reply within {self.timeout:g} s") from None
        except OSError as exc:
            raise self._unreachable(exc.strerror or str(exc)) from None
        except ValueError as exc:  # e.g. an over-long or NUL-containing socket path
            raise self._unreachable(str(exc)) from None
        finally:
            sock.close()

    def _parse_reply(self, raw: bytes) -> tuple[int, object]:
        if not raw:
            # Accepted and closed without a word (crashed or shutting down): as good as unreachable.
            raise self._unreachable("connection closed without a reply")
        try:
            head = _split_head(raw)
            if head is None:
                raise ValueError("incomplete HTTP head")
            status, headers, offset = head
            length = _content_length(headers)
            body = raw[offset:]
            if length is not None:
                if len(body) < length:
                    raise ValueError(f"body truncated at {len(body)} of {length} bytes")
                body = body[:length]
        except ValueError as exc:
            raise self._protocol(
                "replied something that is not HTTP/1.1", details=str(exc)
            ) from None
        if not body.strip():
            return status, None
        try:
            return status, tinyjson.loads(body.decode("utf-8"))
        except ValueError as exc:
            raise self._protocol(
                f"replied HTTP {status} with a body that is not JSON",
                details=f"{exc}: {body[:200]!r}",
            ) from None


def daemon_client(section: dict[str, object], *, where: str) -> DaemonClient:
    """How to reach the daemon, from ``section`` (``ipam`` for cns-ipam, the plugin's own object
    for cns-cni); code 7 naming ``where.key`` if a field is wrong."""
    return DaemonClient(
        socket=config_str(section, "socket", default=DEFAULT_SOCKET, where=where),
        release_queue_dir=config_str(
            section, "releaseQueueDir", default=DEFAULT_RELEASE_QUEUE_DIR, where=where
        ),
        timeout=config_number(
            section,
            "timeoutSeconds",
            default=DEFAULT_TIMEOUT_SECONDS,
            maximum=MAX_TIMEOUT_SECONDS,
            where=where,
        ),
        subnets=_subnets(section, where=where),
    )


def _subnets(section: dict[str, object], *, where: str) -> tuple[str, ...]:
    """``subnets``: the subnets an ADD gets one address of each (code 7 naming the field)."""
    value = section.get("subnets", [])
    problem = subnets_problem(value)
    if problem is not None:
        raise CniError(ERR_INVALID_CONFIG, f"{where}.subnets: {problem}")
    assert isinstance(value, list)
    return tuple(value)


# --- HTTP/1.1 replies --------------------------------------------------------------------------


def _split_head(buf: bytes) -> tuple[int, dict[str, str], int] | None:
    """Parse status line and headers once complete: (status, lower-cased headers, body offset).

    ValueError if they are not HTTP/1.x, or use a Transfer-Encoding (the daemon never does).
    """
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    code = parts[1]
    if len(code) != 3 or not code.isdigit() or not code.isascii():
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"bad header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise ValueError(f"unsupported Transfer-Encoding {headers['transfer-encoding'][:40]!r}")
    return int(code), headers, end + 4


def _content_length(headers: dict[str, str]) -> int | None:
    """``Content-Length``, or None if absent (the body ends at EOF); ValueError if malformed."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    if not raw.isdigit() or not raw.isascii():
        raise ValueError(f"bad Content-Length {raw[:40]!r}")
    return int(raw)


def _complete(buf: bytearray) -> bool:
    """Whether ``buf`` holds a whole reply, so a daemon that keeps the connection open after
    replying cannot stall us; a malformed reply counts as complete (the parser reports it)."""
    try:
        head = _split_head(bytes(buf))
        if head is None:
            return False
        _, headers, offset = head
        length = _content_length(headers)
    except ValueError:
        return True
    return length is not None and len(buf) - offset >= length


# --- results -----------------------------------------------------------------------------------


def _bad_result(what: str, result: object) -> CniError:
    return CniError(
        ERR_PROTOCOL,
        f"cns daemon returned a malformed result: {what}",
        details=tinyjson.dumps(result)[:300],
    )


def convert_result(result: object, cni_version: str) -> dict[str, object]:
    """Turn a 1.x-shaped result (the daemon's ADD reply) into the result for ``cni_version``.

    Keeps ``interfaces``, ``ips``, ``routes`` and ``dns`` (``{}`` if absent) and drops everything
    else (``ipConfigID``, ``waitedSeconds``). For 0.3.x/0.4.0 each IP gets ``version`` "4"/"6"
    (from ':' in the address) and routes keep only ``dst``/``gw``, which is all those versions
    define; 1.0.0 has no ``version`` either; 1.1.0 routes keep their extra fields (mtu, table, ...).
    Code 101 if the result is malformed.
    """
    if not isinstance(result, dict):
        raise _bad_result("not an object", result)
    legacy = cni_version.startswith("0.")
    out: dict[str, object] = {"cniVersion": cni_version}
    interfaces = result.get("interfaces")
    if interfaces is not None:
        if not isinstance(interfaces, list) or not all(isinstance(i, dict) for i in interfaces):
            raise _bad_result("interfaces", result)
        out["interfaces"] = interfaces
    ips = result.get("ips", [])
    if not isinstance(ips, list):
        raise _bad_result("ips", result)
    out_ips: list[dict[str, object]] = []
    for ip in ips:
        if not isinstance(ip, dict):
            raise _bad_result("ips[]", result)
        address = ip.get("address")
        if not isinstance(address, str) or "/" not in address:
            raise _bad_result("ips[].address", result)
        entry: dict[str, object] = {}
        if legacy:
            entry["version"] = "6" if ":" in address else "4"
        entry["address"] = address
        gateway = ip.get("gateway")
        if gateway is not None:
            if not isinstance(gateway, str):
                raise _bad_result("ips[].gateway", result)
            entry["gateway"] = gateway
        interface = ip.get("interface")
        if interface is not None:
            if isinstance(interface, bool) or not isinstance(interface, int):
                raise _bad_result("ips[].interface", result)
            entry["interface"] = interface
        out_ips.append(entry)
    out["ips"] = out_ips
    routes = result.get("routes", [])
    if not isinstance(routes, list):
        raise _bad_result("routes", result)
    out_routes: list[dict[str, object]] = []
    for route in routes:
        if not isinstance(route, dict) or not isinstance(route.get("dst"), str):
            raise _bad_result("routes[].dst", result)
        if version_tuple(cni_version) < (1, 1, 0):
            route = {k: route[k] for k in ("dst", "gw") if route.get(k) is not None}
        out_routes.append(route)
    out["routes"] = out_routes
    dns = result.get("dns")
    if dns is None:
        dns = {}
    if not isinstance(dns, dict):
        raise _bad_result("dns", result)
    out["dns"] = dns
    return out


# --- the verbs both plugins share --------------------------------------------------------------


def requested_address(env: CniEnv, conf: NetConf) -> str:
    """The addresses the runtime asks for, comma-separated ("" for none): ``runtimeConfig.ips``
    (the CNI ``ips`` capability) or ``IP=`` in ``CNI_ARGS``, as host-local reads them; a prefix
    is dropped (the subnet gives it). Code 7 for two sources that disagree; the daemon checks
    the rest (addresses, at most one per family, one per subnet)."""
    runtime = conf.raw.get("runtimeConfig")
    listed = runtime.get("ips") if isinstance(runtime, dict) else None
    if listed is not None and (
        not isinstance(listed, list) or not all(isinstance(ip, str) for ip in listed)
    ):
        raise CniError(ERR_INVALID_CONFIG, "runtimeConfig.ips: must be a list of strings")
    found = [
        [ip.strip().split("/")[0] for ip in addresses if ip.strip()]
        for addresses in (listed or (), env.ip_arg.split(","))
    ]
    given = [addresses for addresses in found if addresses]
    if len({frozenset(addresses) for addresses in given}) > 1:
        raise CniError(
            ERR_INVALID_CONFIG,
            "runtimeConfig.ips and CNI_ARGS IP ask for different addresses: "
            f"{sorted(','.join(addresses) for addresses in given)}",
        )
    return ",".join(given[0]) if given else ""


def add_via(path: str, env: CniEnv, conf: NetConf, daemon: DaemonClient, **extra: object) -> None:
    """ADD through the daemon's ``path`` (cns-ipam: add, cns-cni: attach); print the result."""
    body: dict[str, object] = {
        "containerID": env.container_id,
        "ifName": env.ifname,
        "netns": env.netns,
        **extra,
    }
    requested = requested_address(env, conf)
    if requested:
        body["requestedIP"] = requested
    if daemon.subnets:
        body["subnets"] = list(daemon.subnets)
    if env.pod_name is not None:
        body["podName"] = env.pod_name
    if env.pod_namespace is not None:
        body["podNamespace"] = env.pod_namespace
    print_json(convert_result(daemon.post(path, body), conf.cni_version))


def release_via(path: str, env: CniEnv, daemon: DaemonClient) -> None:
    """DEL through the daemon's ``path``; if it is unreachable, queue the release and succeed."""
    body = {"containerID": env.container_id, "ifName": env.ifname}
    try:
        daemon.post(path, body)
    except CniError as err:
        if err.code != ERR_UNREACHABLE:
            raise
        # Imported here: only a DEL that finds the daemon down pays for it.
        from cni_plugin import release_queue

        release_queue.queue_release(
            daemon.release_queue_dir, container_id=env.container_id, ifname=env.ifname
        )


def check_via(path: str, env: CniEnv, conf: NetConf, daemon: DaemonClient, **extra: object) -> None:
    """CHECK through the daemon's ``path`` (cns-ipam: check, cns-cni: verify) against the
    addresses of the runtime's ``prevResult``."""
    require_version(conf.cni_version, minimum="0.4.0", command="CHECK")
    addresses = _prev_result_addresses(conf)
    body: dict[str, object] = {"containerID": env.container_id, "ifName": env.ifname, **extra}
    if addresses is not None:
        body["ips"] = addresses
    daemon.post(path, body)


def _prev_result_addresses(conf: NetConf) -> list[str] | None:
    """The addresses of CHECK's ``prevResult`` (None if it lists no ``ips``); code 7 if bad."""
    prev = conf.raw.get("prevResult")
    if not isinstance(prev, dict):
        raise CniError(
            ERR_INVALID_CONFIG, "prevResult: missing or not an object", details="CHECK needs it"
        )
    ips = prev.get("ips")
    if ips is None:
        return None
    if not isinstance(ips, list):
        raise CniError(ERR_INVALID_CONFIG, "prevResult.ips: not a list")
    addresses: list[str] = []
    for i, ip in enumerate(ips):
        address = ip.get("address") if isinstance(ip, dict) else None
        if not isinstance(address, str) or not address:
            raise CniError(
                ERR_INVALID_CONFIG, f"prevResult.ips[{i}].address: missing or not a string"
            )
        addresses.append(address)
    return addresses


def _valid_attachments(conf: NetConf) -> list[dict[str, object]]:
    """``cni.dev/valid-attachments``; missing is an error, not "none valid" (that releases all)."""
    key = VALID_ATTACHMENTS_KEY
    items = conf.raw.get(key)
    if not isinstance(items, list):
        raise CniError(ERR_INVALID_CONFIG, f"{key}: missing or not a list")
    out: list[dict[str, object]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise CniError(ERR_INVALID_CONFIG, f"{key}[{i}]: not an object")
        for field in ("containerID", "ifname"):
            if not isinstance(item.get(field), str) or not item.get(field):
                raise CniError(ERR_INVALID_CONFIG, f"{key}[{i}].{field}: missing or not a string")
        out.append({"containerID": item["containerID"], "ifname": item["ifname"]})
    return out


def cmd_gc(env: CniEnv, conf: NetConf, daemon: DaemonClient) -> None:
    require_version(conf.cni_version, minimum="1.1.0", command="GC")
    daemon.post("/v1/cni/gc", {"validAttachments": _valid_attachments(conf)})


def cmd_status(env: CniEnv, conf: NetConf, daemon: DaemonClient) -> None:
    """Succeed iff the daemon can serve ADDs; every "cannot" is code 50 (plugin not available)."""
    require_version(conf.cni_version, minimum="1.1.0", command="STATUS")
    try:
        reply = daemon.get("/v1/cni/status")
    except CniError as err:
        if err.code == ERR_UNREACHABLE:
            raise CniError(ERR_NOT_AVAILABLE, err.msg, details=err.details) from None
        raise
    if isinstance(reply, dict) and reply.get("ready") is False:
        raise CniError(ERR_NOT_AVAILABLE, f"cns daemon at {daemon.socket} is not ready")
