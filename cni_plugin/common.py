"""Pieces shared by the cns CNI plugins (``cns-ipam`` now, ``cns-cni`` later).

The runtime starts one plugin process per pod operation under ``python3 -I -S``, so this module
imports only what the interpreter has already loaded (``posix``, ``sys``, ``time``) plus the C
modules ``_socket`` and ``_json`` (through :mod:`cni_plugin.tinyjson`). ``os`` alone would cost
~1 ms, ``socket``/``json``/``typing`` several ms each; type hints are annotation-only.

Everything that can fail raises :class:`CniError`; :func:`run_plugin` turns it (or any unexpected
exception) into the CNI error JSON on stdout and exit status 1, never a traceback.
"""

from __future__ import annotations

import _socket
import posix
import sys
import time

from cni_plugin import tinyjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = "1.1.0"
COMMANDS = ("ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION")

# CNI error codes: 1-99 are defined by the CNI spec, 100+ by docs/api.md.
ERR_INCOMPATIBLE_VERSION = 1
ERR_UNKNOWN_CONTAINER = 3
ERR_INVALID_ENV = 4
ERR_IO = 5
ERR_DECODE = 6
ERR_INVALID_CONFIG = 7
ERR_TRY_AGAIN_LATER = 11
ERR_NOT_AVAILABLE = 50
ERR_UNREACHABLE = 100
ERR_PROTOCOL = 101
ERR_INTERNAL = 102

MAX_REPLY_BYTES = 4 << 20
# Longer than a file name on purpose: the release queue hashes names that would not fit, so a DEL
# can be queued for every container ID the daemon accepts (docs/api.md, "Validation").
MAX_CONTAINER_ID_LENGTH = 1024
MAX_IFNAME_LENGTH = 15  # IFNAMSIZ - 1
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_ID_CHARS = _ALNUM | frozenset("._-")
_HEX = b"0123456789abcdefABCDEF"
_ID_RULE = "must start with a letter or digit and contain only letters, digits, '_', '.', '-'"


class CniError(Exception):
    """A failure that the plugin reports to the runtime as a CNI error object."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(code, msg, details)
        self.code = code
        self.msg = msg
        self.details = details

    def __str__(self) -> str:
        text = f"code {self.code}: {self.msg}"
        return f"{text} ({self.details})" if self.details else text

    def to_dict(self, cni_version: str) -> dict[str, object]:
        return {
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        }


# --- output and the catch-all ------------------------------------------------------------------


class Invocation:
    """Mutable state of one plugin run; ``cni_version`` is what errors are reported with.

    The handler sets ``cni_version`` as soon as the config is parsed, so that an error found later
    is reported in the version the runtime asked for.
    """

    __slots__ = ("cni_version", "prog")

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.cni_version = LATEST_VERSION


def print_json(obj: object) -> None:
    """Write one JSON document (ASCII) and a newline to stdout and flush it."""
    out = sys.stdout
    if out is None:  # fd 1 closed: nothing to report to
        return
    out.write(tinyjson.dumps(obj) + "\n")
    out.flush()


def _describe_exception(exc: BaseException) -> str:
    """``Type: text (at file:line)`` of the innermost frame: a traceback's gist, on one line."""
    text = f"{type(exc).__name__}: {exc}"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        text += f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    return text


def dispatch(
    inv: Invocation,
    commands: Mapping[str, Callable[[CniEnv, NetConf, Any], None]],
    read_config: Callable[[dict[str, object]], Any],
) -> None:
    """The body of every cns plugin: VERSION, or parse, validate and run one command.

    ``read_config`` pulls the plugin's daemon settings out of the network config.
    """
    environ = cni_environ()
    command = read_command(environ)
    data = read_stdin()
    if command == "VERSION":
        print_json(version_info(sniff_version(data)))
        return
    conf = parse_config(data)
    inv.cni_version = conf.cni_version
    env = read_env(command, environ)
    commands[command](env, conf, read_config(conf.raw))


def run_plugin(handler: Callable[[Invocation], None], prog: str) -> int:
    """Run ``handler``; return the exit status (0 or 1) after printing any error as CNI JSON."""
    inv = Invocation(prog)
    try:
        handler(inv)
        if sys.stdout is not None:
            sys.stdout.flush()
        return 0
    except CniError as err:
        error = err
    except (Exception, KeyboardInterrupt) as exc:
        error = CniError(ERR_INTERNAL, f"{prog}: internal error", _describe_exception(exc))
    try:  # noqa: SIM105 - contextlib would cost an import
        print_json(error.to_dict(inv.cni_version))
    except Exception:  # stdout unusable; the exit status still says it failed
        pass
    return 1


# --- environment -------------------------------------------------------------------------------


def cni_environ() -> dict[str, str]:
    """The ``CNI_*`` variables of this process, decoded as UTF-8 (code 4 if one is not)."""
    env: dict[str, str] = {}
    for key, value in posix.environ.items():
        if key.startswith(b"CNI_"):
            name = key.decode("utf-8", "surrogateescape")
            try:
                env[name] = value.decode("utf-8")
            except UnicodeDecodeError:
                raise CniError(ERR_INVALID_ENV, f"{name} is not valid UTF-8") from None
    return env


def identifier_problem(value: str, max_length: int) -> str | None:
    """Why ``value`` is not an identifier, or None: the CNI container ID syntax
    ``[a-zA-Z0-9][a-zA-Z0-9_.-]*``, at most ``max_length`` characters. Shared with the daemon,
    which applies the same rule to pod names and namespaces.
    """
    if not value:
        return "is empty"
    if len(value) > max_length:
        return f"longer than {max_length} characters"
    if value[0] not in _ALNUM or not _ID_CHARS.issuperset(value):
        return _ID_RULE
    return None


def ifname_problem(value: str) -> str | None:
    """Why ``value`` is not an interface name, or None: the CNI spec's rule (non-empty, at most 15
    characters, not '.' or '..', no '/', ':' or whitespace) plus no control characters and no lone
    surrogates, which the kernel and the daemon's store cannot take either.
    """
    if not value:
        return "is empty"
    if len(value) > MAX_IFNAME_LENGTH:
        return f"longer than {MAX_IFNAME_LENGTH} characters"
    # isprintable() is False for control characters, lone surrogates and whitespace but ' '.
    if value in (".", "..") or any(c in "/: " or not c.isprintable() for c in value):
        return "must not be '.' or '..' nor contain '/', ':', whitespace or control characters"
    return None


def validate_container_id(value: str, name: str = "CNI_CONTAINERID") -> str:
    """Check a container ID per the CNI spec: ``[a-zA-Z0-9][a-zA-Z0-9_.-]*`` (code 4)."""
    if not value:
        raise CniError(ERR_INVALID_ENV, f"{name} is not set or empty")
    problem = identifier_problem(value, MAX_CONTAINER_ID_LENGTH)
    if problem is not None:
        raise CniError(ERR_INVALID_ENV, f"{name} {value[:80]!r} is invalid", problem)
    return value


def validate_ifname(value: str, name: str = "CNI_IFNAME") -> str:
    """Check an interface name with :func:`ifname_problem` (code 4)."""
    if not value:
        raise CniError(ERR_INVALID_ENV, f"{name} is not set or empty")
    problem = ifname_problem(value)
    if problem is not None:
        raise CniError(ERR_INVALID_ENV, f"{name} {value[:80]!r} is invalid", problem)
    return value


def parse_cni_args(raw: str) -> dict[str, str]:
    """Parse ``CNI_ARGS`` (``K=V;K=V``); empty items are skipped, an item without '=' is code 4."""
    args: dict[str, str] = {}
    for item in raw.split(";"):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CniError(ERR_INVALID_ENV, f"CNI_ARGS: invalid pair {item!r}", "expected K=V")
        args[key] = value
    return args


def read_command(environ: Mapping[str, str]) -> str:
    """``CNI_COMMAND``, which must be one of :data:`COMMANDS` (code 4)."""
    command = environ.get("CNI_COMMAND", "")
    if not command:
        raise CniError(ERR_INVALID_ENV, "CNI_COMMAND is not set")
    if command not in COMMANDS:
        raise CniError(
            ERR_INVALID_ENV,
            f"CNI_COMMAND {command!r} is unknown",
            "expected " + ", ".join(COMMANDS),
        )
    return command


class CniEnv:
    """The validated ``CNI_*`` environment of one invocation."""

    __slots__ = ("args", "command", "container_id", "ifname", "netns", "path")

    def __init__(
        self,
        command: str,
        container_id: str,
        netns: str,
        ifname: str,
        args: dict[str, str],
        path: list[str],
    ) -> None:
        self.command = command
        self.container_id = container_id
        self.netns = netns
        self.ifname = ifname
        self.args = args
        self.path = path

    def _arg(self, key: str) -> str | None:
        return self.args.get(key) or None

    @property
    def pod_name(self) -> str | None:
        return self._arg("K8S_POD_NAME")

    @property
    def pod_namespace(self) -> str | None:
        return self._arg("K8S_POD_NAMESPACE")

    @property
    def pod_uid(self) -> str | None:
        return self._arg("K8S_POD_UID")

    @property
    def pod_infra_container_id(self) -> str | None:
        return self._arg("K8S_POD_INFRA_CONTAINER_ID")

    @property
    def ignore_unknown(self) -> bool:
        return self.args.get("IgnoreUnknown", "").lower() in ("1", "true")


# Which variables each command needs (as libcni's skel; CNI_PATH only on request).
_NEEDS_IDS = frozenset(("ADD", "DEL", "CHECK"))
_NEEDS_NETNS = frozenset(("ADD", "CHECK"))


def read_env(
    command: str, environ: Mapping[str, str] | None = None, *, require_path: bool = False
) -> CniEnv:
    """Read and validate the ``CNI_*`` variables that ``command`` needs (code 4 naming one).

    ``CNI_CONTAINERID``/``CNI_IFNAME`` are required for ADD, DEL and CHECK, ``CNI_NETNS`` for ADD
    and CHECK only (it may be empty on DEL). GC, STATUS and VERSION need none of them.
    ``CNI_PATH`` is required for ADD/DEL/CHECK only if ``require_path`` (an IPAM plugin execs
    nothing, so it does not need it).
    """
    env = cni_environ() if environ is None else environ
    container_id = env.get("CNI_CONTAINERID", "")
    ifname = env.get("CNI_IFNAME", "")
    netns = env.get("CNI_NETNS", "")
    raw_path = env.get("CNI_PATH", "")
    if command in _NEEDS_IDS:
        validate_container_id(container_id)
        validate_ifname(ifname)
        if require_path and not raw_path:
            raise CniError(ERR_INVALID_ENV, "CNI_PATH is not set or empty")
    if command in _NEEDS_NETNS and not netns:
        raise CniError(ERR_INVALID_ENV, "CNI_NETNS is not set or empty")
    args = parse_cni_args(env.get("CNI_ARGS", ""))
    path = [p for p in raw_path.split(":") if p]
    return CniEnv(command, container_id, netns, ifname, args, path)


# --- network config on stdin -------------------------------------------------------------------


def read_stdin() -> bytes:
    """All of stdin (empty if stdin is closed); code 5 on an I/O error."""
    stdin = sys.stdin
    if stdin is None:
        return b""
    try:
        return stdin.buffer.read()
    except OSError as exc:
        raise CniError(ERR_IO, "cannot read the network config from stdin", str(exc)) from None


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.4.0"`` -> ``(0, 4, 0)``; only meaningful for supported versions."""
    return tuple(int(part) for part in version.split("."))


def sniff_version(data: bytes) -> str:
    """The supported ``cniVersion`` in ``data`` if any, else :data:`LATEST_VERSION`; never fails.

    For VERSION, whose stdin may be empty or just ``{"cniVersion": ...}``.
    """
    try:
        conf = tinyjson.loads(data.decode("utf-8"))
    except ValueError:  # includes UnicodeDecodeError
        return LATEST_VERSION
    version = conf.get("cniVersion") if isinstance(conf, dict) else None
    return version if isinstance(version, str) and version in SUPPORTED_VERSIONS else LATEST_VERSION


def version_info(cni_version: str = LATEST_VERSION) -> dict[str, object]:
    """The VERSION reply."""
    return {"cniVersion": cni_version, "supportedVersions": list(SUPPORTED_VERSIONS)}


class NetConf:
    """A validated network config: the raw object plus its mandatory fields."""

    __slots__ = ("cni_version", "name", "raw", "type")

    def __init__(self, raw: dict[str, object], cni_version: str, name: str, type_: str) -> None:
        self.raw = raw
        self.cni_version = cni_version
        self.name = name
        self.type = type_


def parse_config(data: bytes) -> NetConf:
    """Parse the network config from stdin bytes.

    Code 6 if it is not UTF-8 JSON or not an object, 7 if ``cniVersion``/``name`` is missing or
    not a string (or ``type`` is not a string), 1 if ``cniVersion`` is not supported.
    """
    try:
        conf = tinyjson.loads(data.decode("utf-8"))
    except ValueError as exc:  # includes UnicodeDecodeError
        raise CniError(ERR_DECODE, "network config on stdin is not JSON", str(exc)) from None
    if not isinstance(conf, dict):
        raise CniError(ERR_DECODE, "network config on stdin is not a JSON object")
    version = conf.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(ERR_INVALID_CONFIG, "cniVersion: missing or not a string")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            ERR_INCOMPATIBLE_VERSION,
            f"unsupported cniVersion {version!r}",
            "supported: " + ", ".join(SUPPORTED_VERSIONS),
        )
    name = conf.get("name")
    if not isinstance(name, str) or not name:
        raise CniError(ERR_INVALID_CONFIG, "name: missing or not a string")
    type_ = conf.get("type", "")
    if not isinstance(type_, str):
        raise CniError(ERR_INVALID_CONFIG, "type: not a string")
    return NetConf(conf, version, name, type_)


def require_version(cni_version: str, minimum: str, command: str) -> None:
    """Code 1 when ``command`` does not exist in ``cni_version`` (CHECK 0.4.0, GC/STATUS 1.1.0)."""
    if version_tuple(cni_version) < version_tuple(minimum):
        raise CniError(
            ERR_INCOMPATIBLE_VERSION,
            f"cniVersion {cni_version} does not support {command}",
            f"{command} needs cniVersion {minimum} or later",
        )


def config_str(section: dict[str, object], key: str, default: str, where: str) -> str:
    """A non-empty string option of a config object; code 7 naming ``where.key`` if wrong."""
    value = section.get(key, default)
    if not isinstance(value, str) or not value:
        raise CniError(ERR_INVALID_CONFIG, f"{where}.{key}: must be a non-empty string")
    return value


def config_number(
    section: dict[str, object], key: str, default: float, where: str, maximum: float
) -> float:
    """A number in (0, maximum] of a config object; code 7 naming ``where.key`` if wrong.

    The bound matters: 1e308 is positive, but no socket timeout can hold it.
    """
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= maximum:
        raise CniError(
            ERR_INVALID_CONFIG, f"{where}.{key}: must be a positive number, at most {maximum:g}"
        )
    return float(value)


# --- HTTP/1.1 over the daemon's unix socket ----------------------------------------------------


def _unreachable(socket_path: str, reason: str) -> CniError:
    return CniError(ERR_UNREACHABLE, f"cns daemon unreachable at {socket_path}: {reason}")


def _protocol(socket_path: str, msg: str, details: str = "") -> CniError:
    return CniError(ERR_PROTOCOL, f"cns daemon at {socket_path} {msg}", details)


def _split_head(buf: bytes) -> tuple[int, dict[str, str], int] | None:
    """Parse status line and headers once complete: (status, lower-cased headers, body offset).

    ValueError if they are not HTTP/1.x.
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
    return int(code), headers, end + 4


def _content_length(headers: dict[str, str]) -> int | None:
    """``Content-Length``, or None if absent or the body is chunked; ValueError if malformed."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return None
    raw = headers.get("content-length")
    if raw is None:
        return None
    if not raw.isdigit() or not raw.isascii():
        raise ValueError(f"bad Content-Length {raw[:40]!r}")
    return int(raw)


class _Truncated(ValueError):
    """A chunked body that is incomplete so far (as opposed to malformed)."""


def _dechunk(data: bytes) -> bytes:
    """Decode a chunked transfer-encoded body (trailers ignored); ValueError if malformed."""
    out: list[bytes] = []
    pos = 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            raise _Truncated("truncated chunked body")
        size_field = data[pos:eol].split(b";", 1)[0].strip()
        if not size_field or size_field.strip(_HEX):
            raise ValueError(f"bad chunk size {size_field[:20]!r}")
        size = int(size_field, 16)
        if size == 0:
            return b"".join(out)
        start = eol + 2
        end = start + size
        if len(data) < end + 2:
            raise _Truncated("truncated chunked body")
        if data[end : end + 2] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        out.append(data[start:end])
        pos = end + 2


def _complete(buf: bytearray) -> bool:
    """Whether ``buf`` holds a whole reply, so a daemon that keeps the connection open after
    replying cannot stall us; a malformed reply counts as complete (the parser reports it)."""
    try:
        head = _split_head(bytes(buf))
        if head is None:
            return False
        _, headers, offset = head
        if "chunked" in headers.get("transfer-encoding", "").lower():
            _dechunk(bytes(buf[offset:]))
            return True
        length = _content_length(headers)
    except _Truncated:
        return False
    except ValueError:
        return True
    return length is not None and len(buf) - offset >= length


def _connect(sock: _socket.socket, socket_path: str, deadline: float) -> None:
    """Connect, retrying while the daemon's listen backlog is full (EAGAIN on a unix socket)."""
    while True:
        try:
            sock.connect(socket_path)
            return
        except BlockingIOError:
            if time.monotonic() + 0.02 >= deadline:
                raise TimeoutError("listen backlog full") from None
            time.sleep(0.02)


def _exchange(socket_path: str, data: bytes, timeout: float) -> bytes:
    """Send ``data`` and read the reply until EOF (or until Content-Length is satisfied)."""
    deadline = time.monotonic() + timeout
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError as exc:
        raise _unreachable(socket_path, exc.strerror or str(exc)) from None
    try:
        sock.settimeout(timeout)
        _connect(sock, socket_path, deadline)
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
                raise _protocol(socket_path, f"sent a reply larger than {MAX_REPLY_BYTES} bytes")
        return bytes(buf)
    except TimeoutError:
        raise _unreachable(socket_path, f"no reply within {timeout:g} s") from None
    except OSError as exc:
        raise _unreachable(socket_path, exc.strerror or str(exc)) from None
    except ValueError as exc:  # e.g. an over-long or NUL-containing socket path
        raise _unreachable(socket_path, str(exc)) from None
    finally:
        sock.close()


def _parse_reply(socket_path: str, raw: bytes) -> tuple[int, object]:
    if not raw:
        # Accepted and closed without a word (crashed or shutting down): as good as unreachable.
        raise _unreachable(socket_path, "connection closed without a reply")
    try:
        head = _split_head(raw)
        if head is None:
            raise ValueError("incomplete HTTP head")
        status, headers, offset = head
        length = _content_length(headers)
        body = raw[offset:]
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = _dechunk(body)
        elif length is not None:
            if len(body) < length:
                raise ValueError(f"body truncated at {len(body)} of {length} bytes")
            body = body[:length]
    except ValueError as exc:
        raise _protocol(socket_path, "replied something that is not HTTP/1.1", str(exc)) from None
    if not body.strip():
        return status, None
    try:
        return status, tinyjson.loads(body.decode("utf-8"))
    except ValueError as exc:
        raise _protocol(
            socket_path,
            f"replied HTTP {status} with a body that is not JSON",
            f"{exc}: {body[:200]!r}",
        ) from None


def request(
    socket_path: str, method: str, path: str, body: object | None, timeout: float
) -> tuple[int, object]:
    """One HTTP/1.1 request over the daemon's unix socket: ``(status, parsed JSON body)``.

    ``body`` None sends no body (``Content-Length: 0``); an empty reply body parses as None.
    Code 100 if the daemon cannot be reached, the connection fails, or no full reply arrives
    within ``timeout`` seconds; 101 if the reply is not HTTP/1.x with a JSON body.
    """
    payload = b"" if body is None else tinyjson.dumps(body).encode("ascii")
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: cns\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    return _parse_reply(socket_path, _exchange(socket_path, head + payload, timeout))


def error_from_reply(socket_path: str, status: int, reply: object) -> CniError:
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
            return CniError(
                code, msg, details if isinstance(details, str) else tinyjson.dumps(details)
            )
    return _protocol(
        socket_path, f"replied HTTP {status} without a CNI error body", tinyjson.dumps(reply)[:300]
    )


def call_daemon(
    socket_path: str, method: str, path: str, body: object | None, timeout: float
) -> object:
    """:func:`request`, returning the body of a 2xx reply and raising the error of any other."""
    status, reply = request(socket_path, method, path, body, timeout)
    if 200 <= status < 300:
        return reply
    raise error_from_reply(socket_path, status, reply)


# --- results -----------------------------------------------------------------------------------


def _bad_result(what: str, result: object) -> CniError:
    return CniError(
        ERR_PROTOCOL,
        f"cns daemon returned a malformed result: {what}",
        tinyjson.dumps(result)[:300],
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


# --- the release queue -------------------------------------------------------------------------


def _makedirs(path: str, mode: int) -> None:
    """``os.makedirs(path, mode, exist_ok=True)`` without importing os."""
    try:
        posix.mkdir(path, mode)
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = path.rstrip("/").rpartition("/")[0]
        if not parent or parent == path:
            raise
        _makedirs(parent, mode)
        try:
            posix.mkdir(path, mode)
        except FileExistsError:  # created concurrently
            return


# A queue file's temporary name is ``.<name>.<pid>.tmp``: with pids up to 7 digits, names up to
# this length keep it within NAME_MAX (255 bytes); longer ones are hashed.
QUEUE_NAME_MAX = 255 - len(".") - len(".4194304.tmp")
QUEUE_HASHED_PREFIX = "h-"


def _sha256_hex(data: bytes) -> str:
    """SHA-256 from the small C module (~0.1 ms to import; ``hashlib`` loads OpenSSL, ~5 ms)."""
    # No type stubs for either: both hold the C implementation hashlib itself wraps.
    try:
        from _sha256 import sha256  # type: ignore[import-not-found]  # Python 3.11
    except ImportError:  # Python >= 3.12 merged the SHA-2 modules
        from _sha2 import sha256  # type: ignore[import-not-found, no-redef, unused-ignore]
    return str(sha256(data).hexdigest())


def release_queue_name(container_id: str, ifname: str) -> str:
    """The queue file name of one attachment: ``<containerID>_<ifName>.json``, or
    ``h-<sha256 of containerID NUL ifName>.json`` when that would not fit in a file name.

    The daemon derives the name from a file's content the same way and quarantines a file whose
    name disagrees, so a file can only ever release the attachment its name says.
    """
    name = f"{container_id}_{ifname}.json"
    if len(name.encode("utf-8")) <= QUEUE_NAME_MAX:
        return name
    digest = _sha256_hex(f"{container_id}\0{ifname}".encode())
    return f"{QUEUE_HASHED_PREFIX}{digest}.json"


def queue_release(queue_dir: str, container_id: str, ifname: str, now: float | None = None) -> str:
    """Durably queue a release for the daemon to apply later; returns the file's path.

    Writes ``<queue_dir>/<release_queue_name()>`` = ``{"containerID", "ifName", "queuedAt"}``
    through a temporary name in the same directory, fsync, rename and fsync of the directory, so a
    crash leaves either no file or the whole file. The directory (and missing parents) are created
    with mode 0700. Code 5 on any I/O error; code 4 if the names are not valid identifiers.
    """
    validate_container_id(container_id, "containerID")
    validate_ifname(ifname, "ifName")
    queue_dir = queue_dir.rstrip("/") or "/"
    name = release_queue_name(container_id, ifname)
    final = f"{queue_dir}/{name}"
    tmp = f"{queue_dir}/.{name}.{posix.getpid()}.tmp"
    queued_at = round(time.time() if now is None else now, 3)
    data = tinyjson.dumps({"containerID": container_id, "ifName": ifname, "queuedAt": queued_at})
    try:
        _makedirs(queue_dir, 0o700)
        fd = posix.open(
            tmp,
            posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_CLOEXEC | posix.O_NOFOLLOW,
            0o600,
        )
        try:
            view = memoryview((data + "\n").encode("ascii"))
            while view:
                view = view[posix.write(fd, view) :]
            posix.fsync(fd)
        finally:
            posix.close(fd)
        posix.replace(tmp, final)
        dir_fd = posix.open(queue_dir, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_CLOEXEC)
        try:
            posix.fsync(dir_fd)
        finally:
            posix.close(dir_fd)
    except OSError as exc:
        try:  # noqa: SIM105 - contextlib would cost an import
            posix.unlink(tmp)
        except OSError:
            pass
        raise CniError(
            ERR_IO, f"cannot write release queue file {final}", exc.strerror or str(exc)
        ) from None
    return final
