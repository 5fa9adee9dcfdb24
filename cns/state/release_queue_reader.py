"""Reading the release queue: DELs the plugins wrote to disk while the daemon was unreachable.

The entry format (file name and content) belongs to `cni_plugin.release_queue`, which the plugin
writes with; this module decides what to do with a directory whose content is untrusted: a stray
tool, a restore from backup or a hostile root process can leave anything there. So an entry is
applied only if it is a regular file (never through a symlink, never a FIFO, socket or device:
opening a FIFO blocks, and reading one froze the whole daemon), at most MAX_ENTRY_BYTES, and
`decode_entry` accepts it (valid JSON naming a valid attachment, and a file name that is exactly
the one the plugin derives from that content, so a file can only ever release the attachment its
name says). Anything else is moved to `quarantine/` (at most MAX_QUARANTINED entries; beyond that
it is deleted); the daemon logs one line per drain counting them by reason, with a few examples.

An entry that was applied (or found outdated, see `Node.drain_release_queue`) is deleted; one
that cannot be (a read-only directory, an immutable file) is returned as `Unremovable` for the
daemon to remember, so that it is never applied again.

The functions here block on the filesystem; the daemon runs them in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cni_plugin.release_queue import MAX_ENTRY_BYTES, SUFFIX, BadEntry, decode_entry
from cns.core.types import OwnerKey
from cns.state.fsutil import file_kind

QUARANTINE_DIR = "quarantine"
MAX_QUARANTINED = 100
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    key: OwnerKey
    queued_at: float  # wall clock, as the plugin wrote it


@dataclass(frozen=True, slots=True)
class Quarantined:
    name: str
    kind: str  # the class of problem (BadEntry.kind), which the daemon counts by
    reason: str
    outcome: str  # "quarantined", "deleted (quarantine full)" or "left in place: <error>"


@dataclass(frozen=True, slots=True)
class Unremovable:
    """A done entry that could not be deleted, and why."""

    entry: Entry
    error: str


def parse_entry(name: str, data: bytes) -> Entry:
    """The entry a queue file holds; BadEntry unless content and name agree."""
    release = decode_entry(name, data)
    return Entry(name, OwnerKey(release.container_id, release.ifname), release.queued_at)


def _read_entry(dir_fd: int, name: str) -> bytes:
    """The bytes of one entry; BadEntry if it is not a small regular file. Never blocks."""
    if not name.endswith(SUFFIX):
        raise BadEntry(
            "not a queue entry name (<containerID>_<ifName>.json or h-<sha256>.json)",
            kind="not an entry name",
        )
    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    if not stat.S_ISREG(mode):
        raise BadEntry(f"{file_kind(mode)}, not a regular file", kind="not a regular file")
    fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)  # O_NOFOLLOW/O_NONBLOCK: it may be swapped
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadEntry(
                f"{file_kind(info.st_mode)}, not a regular file", kind="not a regular file"
            )
        if info.st_size > MAX_ENTRY_BYTES:
            raise BadEntry(
                f"larger than {MAX_ENTRY_BYTES} bytes ({info.st_size})", kind="too large"
            )
        data = os.read(fd, MAX_ENTRY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ENTRY_BYTES:
        raise BadEntry(f"larger than {MAX_ENTRY_BYTES} bytes", kind="too large")
    return data


class _Quarantine:
    """QUARANTINE_DIR during one `collect`: made, opened and counted once, not once per file
    (a queue of 50,000 bad files listed the quarantine 50,000 times)."""

    def __init__(self, dir_fd: int) -> None:
        self._dir_fd = dir_fd
        self._fd = -1
        self._held = 0

    def take(self, name: str) -> str:
        """Move bad entry `name` in, or delete it when the quarantine already holds enough."""
        try:
            if self._fd < 0:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(QUARANTINE_DIR, 0o700, dir_fd=self._dir_fd)
                self._fd = os.open(QUARANTINE_DIR, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self._dir_fd)
                self._held = len(os.listdir(self._fd))
            if self._held < MAX_QUARANTINED:
                os.rename(name, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._fd)
                self._held += 1
                return "quarantined"
            if stat.S_ISDIR(os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_mode):
                os.rmdir(name, dir_fd=self._dir_fd)
            else:
                os.unlink(name, dir_fd=self._dir_fd)
            return "deleted (quarantine full)"
        except OSError as exc:
            return f"left in place: {exc.strerror or exc}"

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


def collect(directory: Path) -> tuple[list[Entry], list[Quarantined]]:
    """Read every entry: the ones to apply, and the bad ones (already moved away). A queue
    that is not a readable directory is one bad entry, named ".", left in place."""
    try:
        dir_fd = os.open(directory, _DIR_FLAGS)
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        reason = f"the queue is not a readable directory: {exc.strerror or exc}"
        return [], [Quarantined(".", "unreadable", reason, "left in place")]
    entries: list[Entry] = []
    bad: list[Quarantined] = []
    quarantine = _Quarantine(dir_fd)
    try:
        for name in sorted(os.listdir(dir_fd)):
            if name.startswith(".") or name == QUARANTINE_DIR:
                continue  # a plugin's temporary file, still being written
            try:
                entries.append(parse_entry(name, _read_entry(dir_fd, name)))
            except FileNotFoundError:
                continue  # removed meanwhile
            except BadEntry as exc:
                bad.append(Quarantined(name, exc.kind, str(exc), quarantine.take(name)))
            except OSError as exc:
                reason = exc.strerror or str(exc)
                bad.append(Quarantined(name, "unreadable", reason, quarantine.take(name)))
    finally:
        quarantine.close()
        os.close(dir_fd)
    return entries, bad


def remove(directory: Path, entries: list[Entry]) -> list[Unremovable]:
    """Delete done entries (after their releases are committed); returns the ones that could
    not be deleted, for the daemon to remember. Never raises. (Moving such an entry aside is
    no way out: a rename needs what the unlink lacked, a writable directory and a file that is
    neither immutable nor a mount point.)"""
    unremovable: list[Unremovable] = []
    for entry in entries:
        try:
            (directory / entry.name).unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            unremovable.append(Unremovable(entry, exc.strerror or str(exc)))
    return unremovable
