"""The release-queue file format, for both sides: the plugin writes an entry when a DEL finds the
daemon unreachable, and the daemon (``cns/state/release_queue_reader.py``) reads the directory
and applies them.

One entry per attachment: ``<containerID>_<ifName>.json``, or ``h-<sha256>.json`` when that name
would not fit in a file name, holding ``{"containerID", "ifName", "queuedAt"}``. A file can only
ever release the attachment its name says: :func:`decode_entry` refuses a file whose name is not
the one :func:`entry_name` derives from its content. Keeping writer and reader in one module means
they cannot drift apart; keeping it stdlib-only (and off the plugin's path unless the daemon is
down: ``cni_plugin.client`` imports it lazily) means the plugin can use it.

How the daemon treats the directory itself (regular files only, never blocking, quarantine) is
``cns/state/release_queue_reader.py``'s business: that directory is untrusted, this module only
knows bytes.
"""

from __future__ import annotations

import posix
import time

from cni_plugin import tinyjson
from cni_plugin.skel import (
    ERR_IO,
    MAX_CONTAINER_ID_LENGTH,
    CniError,
    identifier_problem,
    ifname_problem,
    validate_container_id,
    validate_ifname,
)

# A queue file's temporary name is ``.<name>.<pid>.tmp``: with pids up to 7 digits, names up to
# this length keep it within NAME_MAX (255 bytes); longer ones are hashed.
NAME_MAX = 255 - len(".") - len(".4194304.tmp")
HASHED_PREFIX = "h-"
SUFFIX = ".json"
# The largest entry the plugin writes is ~1.1 KB (a 1024-character container ID); the daemon reads
# no more than this from any file.
MAX_ENTRY_BYTES = 4096


class BadEntry(ValueError):
    """Why a queue file is not an entry the daemon may apply: `kind` names the class of problem
    (the daemon counts files by it), the message the details."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class QueuedRelease:
    """The attachment one entry releases, and when the plugin queued it (wall clock): the
    entry is meant for the attachment as it was then, not for a later ADD of the same names."""

    __slots__ = ("container_id", "ifname", "queued_at")

    def __init__(self, *, container_id: str, ifname: str, queued_at: float) -> None:
        self.container_id = container_id
        self.ifname = ifname
        self.queued_at = queued_at


def _sha256_hex(data: bytes) -> str:
    """SHA-256 from the small C module (~0.1 ms to import; ``hashlib`` loads OpenSSL, ~5 ms)."""
    # No type stubs for either: both hold the C implementation hashlib itself wraps.
    try:
        from _sha256 import sha256  # type: ignore[import-not-found]  # Python 3.11
    except ImportError:  # Python >= 3.12 merged the SHA-2 modules
        from _sha2 import sha256  # type: ignore[import-not-found, no-redef, unused-ignore]
    return str(sha256(data).hexdigest())


def entry_name(*, container_id: str, ifname: str) -> str:
    """The file name of one attachment's entry: ``<containerID>_<ifName>.json``, or
    ``h-<sha256 of containerID NUL ifName>.json`` when that would not fit in a file name.
    """
    name = f"{container_id}_{ifname}{SUFFIX}"
    if len(name.encode("utf-8")) <= NAME_MAX:
        return name
    digest = _sha256_hex(f"{container_id}\0{ifname}".encode())
    return f"{HASHED_PREFIX}{digest}{SUFFIX}"


def encode_entry(*, container_id: str, ifname: str, queued_at: float) -> bytes:
    """An entry's content: one line of ASCII JSON."""
    entry = {"containerID": container_id, "ifName": ifname, "queuedAt": round(queued_at, 3)}
    return (tinyjson.dumps(entry) + "\n").encode("ascii")


def decode_entry(name: str, data: bytes) -> QueuedRelease:
    """The attachment the file ``name`` holding ``data`` releases; BadEntry unless the content is
    an entry naming a valid attachment and when it was queued, and ``name`` is exactly
    :func:`entry_name` of it."""
    try:
        content = tinyjson.loads(data.decode("utf-8"))
    except ValueError as exc:  # includes UnicodeDecodeError and nesting too deep
        raise BadEntry(f"not JSON: {exc}", kind="not JSON") from None
    if not isinstance(content, dict):
        raise BadEntry("not a JSON object", kind="not an entry")
    container_id, ifname = content.get("containerID"), content.get("ifName")
    if not isinstance(container_id, str) or not isinstance(ifname, str):
        raise BadEntry("containerID and ifName must be strings", kind="not an entry")
    queued_at = content.get("queuedAt")
    if isinstance(queued_at, bool) or not isinstance(queued_at, int | float):
        raise BadEntry("queuedAt must be a number (seconds since the epoch)", kind="not an entry")
    if not 0 < queued_at < 1e11:  # also NaN and infinities
        raise BadEntry(f"queuedAt: {queued_at} is not a time", kind="not an entry")
    for field, problem in (
        ("containerID", identifier_problem(container_id, MAX_CONTAINER_ID_LENGTH)),
        ("ifName", ifname_problem(ifname)),
    ):
        if problem is not None:
            raise BadEntry(f"{field}: {problem}", kind=f"invalid {field}")
    expected = entry_name(container_id=container_id, ifname=ifname)
    if name != expected:
        raise BadEntry(
            f"file name does not match its content (expected {expected})", kind="name mismatch"
        )
    return QueuedRelease(container_id=container_id, ifname=ifname, queued_at=float(queued_at))


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


def queue_release(
    queue_dir: str, *, container_id: str, ifname: str, now: float | None = None
) -> str:
    """Durably queue a release for the daemon to apply later; returns the file's path.

    Writes ``<queue_dir>/<entry_name()>`` through a temporary name in the same directory, fsync,
    rename and fsync of the directory, so a crash leaves either no file or the whole file. The
    directory (and missing parents) are created with mode 0700. Code 5 on any I/O error; code 4
    if the names are not valid identifiers.
    """
    validate_container_id(container_id, field="containerID")
    validate_ifname(ifname, field="ifName")
    queue_dir = queue_dir.rstrip("/") or "/"
    name = entry_name(container_id=container_id, ifname=ifname)
    final = f"{queue_dir}/{name}"
    tmp = f"{queue_dir}/.{name}.{posix.getpid()}.tmp"
    data = encode_entry(
        container_id=container_id, ifname=ifname, queued_at=time.time() if now is None else now
    )
    try:
        _makedirs(queue_dir, 0o700)
        fd = posix.open(
            tmp,
            posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_CLOEXEC | posix.O_NOFOLLOW,
            0o600,
        )
        try:
            view = memoryview(data)
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
            ERR_IO, f"cannot write release queue file {final}", details=exc.strerror or str(exc)
        ) from None
    return final
