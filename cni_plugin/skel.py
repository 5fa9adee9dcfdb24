"""What every cns CNI plugin run needs: the error type, the ``CNI_*`` environment, the network
config on stdin, the spec versions, and the catch-all that turns any failure into CNI error JSON.

Like libcni's ``pkg/skel`` and ``pkg/types``, this module is the plugins' base: ``cns-ipam``
(:mod:`cni_plugin.ipam`) and ``cns-cni`` (:mod:`cni_plugin.cni`) stand on it and on
:mod:`cni_plugin.client`, never on each other. The daemon imports it too, for the identifier rules
(``cns/web/validation.py``), so the plugins and the daemon can never disagree about them.

The runtime starts one plugin process per pod operation under ``python3 -I -S``, so this module
imports only what the interpreter has already loaded (``posix``, ``sys``) plus the C module
``_json`` (through :mod:`cni_plugin.tinyjson`). ``os`` alone would cost ~1 ms, ``json``/``typing``
several ms each; type hints are annotation-only. Each further module of the package costs about
0.1 ms per run (docs/benchmarks.md, "Plugin package modules: import cost"), which is why the
base is two modules (this one and the client) and not one per concern.

Everything that can fail raises :class:`CniError`; :func:`run_plugin` turns it (or any unexpected
exception) into the CNI error JSON on stdout and exit status 1, never a traceback.
"""

from __future__ import annotations

import posix
import sys

from cni_plugin import tinyjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = "1.1.0"
COMMANDS = ("ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION")

# The CNI error codes the plugins raise themselves: 1-99 are defined by the CNI spec, 100+ by
# docs/api.md. The daemon's codes (3, 11, 104, ...) reach the runtime as the daemon sent them.
ERR_INCOMPATIBLE_VERSION = 1
ERR_INVALID_ENV = 4
ERR_IO = 5
ERR_DECODE = 6
ERR_INVALID_CONFIG = 7
ERR_NOT_AVAILABLE = 50
ERR_UNREACHABLE = 100
ERR_PROTOCOL = 101
ERR_INTERNAL = 102

# Longer than a file name on purpose: the release queue hashes names that would not fit, so a DEL
# can be queued for every container ID the daemon accepts (docs/api.md, "Validation").
MAX_CONTAINER_ID_LENGTH = 1024
MAX_IFNAME_LENGTH = 15  # IFNAMSIZ - 1
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_ID_CHARS = _ALNUM | frozenset("._-")
_ID_RULE = "must start with a letter or digit and contain only letters, digits, '_', '.', '-'"
_IFNAME_FORBIDDEN = frozenset("/: ")


class CniError(Exception):
    """A failure that the plugin reports to the runtime as a CNI error object."""

    def __init__(self, code: int, msg: str, *, details: str = "") -> None:
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

    __slots__ = ("cni_version",)

    def __init__(self) -> None:
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
    inv = Invocation()
    try:
        handler(inv)
        if sys.stdout is not None:
            sys.stdout.flush()
        return 0
    except CniError as err:
        error = err
    except (Exception, KeyboardInterrupt) as exc:
        error = CniError(ERR_INTERNAL, f"{prog}: internal error", details=_describe_exception(exc))
    try:  # noqa: SIM105 - contextlib would cost an import
        print_json(error.to_dict(inv.cni_version))
    except Exception:  # stdout unusable; the exit status still says it failed
        pass
    return 1


# --- identifiers (shared with the daemon) ------------------------------------------------------


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


# Subnets one ADD may name: a dual-stack pod names two; a few more leave room, a long list is a
# mistake (each one is a lane the node must hold IPs of).
MAX_SUBNETS = 4
MAX_SUBNET_NAME_LENGTH = 253  # a Kubernetes object name (ClusterSubnet)


def subnets_problem(value: object) -> str | None:
    """Why ``value`` is not the list of subnet names an ADD may ask for, or None: a list of at
    most MAX_SUBNETS distinct identifiers. Shared with the daemon, which checks it again."""
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        return "must be a list of subnet names (strings)"
    if len(value) > MAX_SUBNETS:
        return f"names {len(value)} subnets, at most {MAX_SUBNETS}"
    for index, name in enumerate(value):
        problem = identifier_problem(name, MAX_SUBNET_NAME_LENGTH)
        if problem is not None:
            return f"[{index}] {problem}"
    if len(set(value)) != len(value):
        return "names a subnet twice"
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
    if value in (".", "..") or not value.isprintable() or not _IFNAME_FORBIDDEN.isdisjoint(value):
        return "must not be '.' or '..' nor contain '/', ':', whitespace or control characters"
    return None


def validate_container_id(value: str, *, field: str = "CNI_CONTAINERID") -> str:
    """Check a container ID per the CNI spec: ``[a-zA-Z0-9][a-zA-Z0-9_.-]*`` (code 4)."""
    if not value:
        raise CniError(ERR_INVALID_ENV, f"{field} is not set or empty")
    problem = identifier_problem(value, MAX_CONTAINER_ID_LENGTH)
    if problem is not None:
        raise CniError(ERR_INVALID_ENV, f"{field} {value[:80]!r} is invalid", details=problem)
    return value


def validate_ifname(value: str, *, field: str = "CNI_IFNAME") -> str:
    """Check an interface name with :func:`ifname_problem` (code 4)."""
    if not value:
        raise CniError(ERR_INVALID_ENV, f"{field} is not set or empty")
    problem = ifname_problem(value)
    if problem is not None:
        raise CniError(ERR_INVALID_ENV, f"{field} {value[:80]!r} is invalid", details=problem)
    return value


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


def parse_cni_args(raw: str) -> dict[str, str]:
    """Parse ``CNI_ARGS`` (``K=V;K=V``); empty items are skipped, an item without '=' is code 4."""
    args: dict[str, str] = {}
    for item in raw.split(";"):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CniError(
                ERR_INVALID_ENV, f"CNI_ARGS: invalid pair {item!r}", details="expected K=V"
            )
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
            details="expected " + ", ".join(COMMANDS),
        )
    return command


class CniEnv:
    """The validated ``CNI_*`` environment of one invocation: what the daemon is told."""

    __slots__ = ("container_id", "ifname", "ip_arg", "netns", "pod_name", "pod_namespace")

    def __init__(
        self,
        *,
        container_id: str,
        ifname: str,
        netns: str,
        pod_name: str | None,
        pod_namespace: str | None,
        ip_arg: str = "",
    ) -> None:
        self.container_id = container_id
        self.ifname = ifname
        self.netns = netns
        self.pod_name = pod_name
        self.pod_namespace = pod_namespace
        self.ip_arg = ip_arg  # `IP=` in CNI_ARGS: the address(es) asked for, as host-local reads it


# Which variables each command needs (as libcni's skel). CNI_PATH is never read: neither plugin
# execs another one.
_NEEDS_IDS = frozenset(("ADD", "DEL", "CHECK"))
_NEEDS_NETNS = frozenset(("ADD", "CHECK"))


def read_env(command: str, environ: Mapping[str, str]) -> CniEnv:
    """Read and validate the ``CNI_*`` variables that ``command`` needs (code 4 naming one).

    ``CNI_CONTAINERID``/``CNI_IFNAME`` are required for ADD, DEL and CHECK, ``CNI_NETNS`` for ADD
    and CHECK only (it may be empty on DEL). GC, STATUS and VERSION need none of them.
    ``CNI_ARGS`` must be well-formed for every command; the pod's name and namespace come from it.
    """
    container_id = environ.get("CNI_CONTAINERID", "")
    ifname = environ.get("CNI_IFNAME", "")
    netns = environ.get("CNI_NETNS", "")
    if command in _NEEDS_IDS:
        validate_container_id(container_id)
        validate_ifname(ifname)
    if command in _NEEDS_NETNS and not netns:
        raise CniError(ERR_INVALID_ENV, "CNI_NETNS is not set or empty")
    args = parse_cni_args(environ.get("CNI_ARGS", ""))
    return CniEnv(
        container_id=container_id,
        ifname=ifname,
        netns=netns,
        pod_name=args.get("K8S_POD_NAME") or None,
        pod_namespace=args.get("K8S_POD_NAMESPACE") or None,
        ip_arg=args.get("IP", ""),
    )


# --- network config on stdin -------------------------------------------------------------------


def read_stdin() -> bytes:
    """All of stdin (empty if stdin is closed); code 5 on an I/O error."""
    stdin = sys.stdin
    if stdin is None:
        return b""
    try:
        return stdin.buffer.read()
    except OSError as exc:
        raise CniError(
            ERR_IO, "cannot read the network config from stdin", details=str(exc)
        ) from None


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
    """A validated network config: the raw object and its ``cniVersion``."""

    __slots__ = ("cni_version", "raw")

    def __init__(self, raw: dict[str, object], *, cni_version: str) -> None:
        self.raw = raw
        self.cni_version = cni_version


def parse_config(data: bytes) -> NetConf:
    """Parse the network config from stdin bytes.

    Code 6 if it is not UTF-8 JSON or not an object, 7 if ``cniVersion``/``name`` is missing or
    not a string (or ``type`` is not a string), 1 if ``cniVersion`` is not supported.
    """
    try:
        conf = tinyjson.loads(data.decode("utf-8"))
    except ValueError as exc:  # includes UnicodeDecodeError
        raise CniError(
            ERR_DECODE, "network config on stdin is not JSON", details=str(exc)
        ) from None
    if not isinstance(conf, dict):
        raise CniError(ERR_DECODE, "network config on stdin is not a JSON object")
    version = conf.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(ERR_INVALID_CONFIG, "cniVersion: missing or not a string")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            ERR_INCOMPATIBLE_VERSION,
            f"unsupported cniVersion {version!r}",
            details="supported: " + ", ".join(SUPPORTED_VERSIONS),
        )
    name = conf.get("name")
    if not isinstance(name, str) or not name:
        raise CniError(ERR_INVALID_CONFIG, "name: missing or not a string")
    if not isinstance(conf.get("type", ""), str):
        raise CniError(ERR_INVALID_CONFIG, "type: not a string")
    return NetConf(conf, cni_version=version)


def require_version(cni_version: str, *, minimum: str, command: str) -> None:
    """Code 1 when ``command`` does not exist in ``cni_version`` (CHECK 0.4.0, GC/STATUS 1.1.0)."""
    if version_tuple(cni_version) < version_tuple(minimum):
        raise CniError(
            ERR_INCOMPATIBLE_VERSION,
            f"cniVersion {cni_version} does not support {command}",
            details=f"{command} needs cniVersion {minimum} or later",
        )


def config_str(section: dict[str, object], key: str, *, default: str, where: str) -> str:
    """A non-empty string option of a config object; code 7 naming ``where.key`` if wrong."""
    value = section.get(key, default)
    if not isinstance(value, str) or not value:
        raise CniError(ERR_INVALID_CONFIG, f"{where}.{key}: must be a non-empty string")
    return value


def config_number(
    section: dict[str, object], key: str, *, default: float, maximum: float, where: str
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
