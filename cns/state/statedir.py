"""The state directory's two guards: one daemon per directory, and never a silent fresh start.

Two daemons sharing a `stateDir` would each think they own the same addresses; a daemon that
finds its assignments gone and starts empty would hand out addresses running pods still use.
Both are refused at start-up, before anything reads or writes the directory. Starting over is an
explicit operator decision (`cns run --reset-state`) that keeps the old files under another name.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import stat
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import structlog

from cns.state.fsutil import describe_os_error, fsync_dir
from cns.state.store import RESET_HINT, STATE_FILE_SUFFIXES, StateError, refuse_irregular_state_file

log = structlog.get_logger("cns.state.statedir")

LOCK_NAME = "cns.lock"
# Files only a node that handed out addresses has: the allocator's grant, the cluster snapshot.
IN_USE_EVIDENCE = ("standalone-allocator.json", "kube-snapshot.json")
_HOLDER_BYTES = 4096


class StateDirLock:
    """An exclusive `flock` on `<stateDir>/cns.lock`, held for the daemon's lifetime.

    The kernel drops it when the process dies, however it dies, so a lock file left by a dead
    daemon never blocks the next one. The file says who holds it, for the refusal message.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateDirLock:
        """Lock the directory (creating it if absent) and narrow its files' modes.

        A link as the state directory is the operator's choice (a data disk mounted elsewhere);
        one that points nowhere is a disk that did not mount, never a fresh node.
        """
        path = state_dir / LOCK_NAME
        if state_dir.is_symlink() and not state_dir.exists():
            raise StateError(
                f"state directory {state_dir} is a symbolic link to {os.readlink(state_dir)}, "
                "which does not exist: mount the volume it points into, or fix the link"
            )
        try:
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StateError(
                f"cannot lock state directory {state_dir} ({path}): {describe_os_error(exc)}; "
                "the state directory must be writable"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StateError(
                f"state directory {state_dir} is in use by {holder or 'another process'}; "
                "only one cns may own a state directory: stop that one, or give this one "
                "another stateDir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({_command_line()})\n".encode(), 0)
        try:
            tighten_modes(state_dir)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def tighten_modes(state_dir: Path) -> None:
    """Make every regular file in the state directory 0600 or narrower (logged): the
    assignments are the node's business, whatever mode the directory was created with."""
    for entry in os.scandir(state_dir):
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode) or not mode & 0o077:
            continue
        narrowed = stat.S_IMODE(mode) & 0o700
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.fchmod(fd, narrowed)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StateError(
                f"cannot make {entry.path} readable by its owner only (mode "
                f"{stat.S_IMODE(mode):04o}): {describe_os_error(exc)}"
            ) from exc
        log.warning(
            "state_file_mode_tightened",
            path=entry.path,
            mode=f"{stat.S_IMODE(mode):04o}",
            now=f"{narrowed:04o}",
        )


def _read_holder(fd: int) -> str:
    raw = os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in raw).strip()


def _command_line() -> str:
    try:
        args = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        return shlex.join(arg.decode("utf-8", "replace") for arg in args)
    except OSError:
        return shlex.join(sys.argv)


def lost_state(state_file: str, sizes: Mapping[str, int]) -> str | None:
    """Why starting empty would forget assignments, or None if this is a fresh node.

    `sizes` maps the names present in the state directory to their sizes. A state file is never
    empty once created (it appears by rename, initialised), and its journal files or the
    allocator's grant exist only after it did. Queued DELs are no evidence: the plugin queues
    them whenever the daemon is down, also on a node whose daemon never ran.
    """
    size = sizes.get(state_file)
    if size == 0:
        return "is empty (0 bytes): its assignments are lost"
    if size is not None:
        return None
    for name in [state_file + suffix for suffix in STATE_FILE_SUFFIXES[1:]] + list(IN_USE_EVIDENCE):
        if name in sizes:
            return f"is missing, but {name} shows that this node assigned addresses"
    return None


def _sizes(state_dir: Path) -> dict[str, int]:
    try:
        return {
            entry.name: entry.stat(follow_symlinks=False).st_size for entry in os.scandir(state_dir)
        }
    except FileNotFoundError:
        return {}


def refuse_lost_state(state_dir: Path, state_file: Path) -> None:
    """Raise StateError (naming the file and what to do) if start-up would forget assignments:
    also when a state file is not a regular file (a link into a volume that did not mount)."""
    refuse_irregular_state_file(state_file)
    try:
        problem = lost_state(state_file.name, _sizes(state_dir))
    except OSError as exc:
        raise StateError(
            f"cannot read state directory {state_dir}: {describe_os_error(exc)}"
        ) from exc
    if problem is not None:
        raise StateError(
            f"state file {state_file} {problem}; refusing to start empty: {RESET_HINT}"
        )


def reset_state(state_file: Path, now: datetime | None = None) -> list[Path]:
    """Move the node's state files aside (never delete them); returns their new names.

    Only the node's assignments go: the allocator's file stands for the control plane, which a
    node reset does not touch, and the release queue only ever frees addresses.
    """
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
    moved = []
    for suffix in STATE_FILE_SUFFIXES:
        path = state_file.with_name(state_file.name + suffix)
        if not os.path.lexists(path):  # a dangling link is moved aside too
            continue
        target = path.with_name(f"{path.name}.reset-{stamp}")
        try:
            os.rename(path, target)
        except OSError as exc:
            raise StateError(f"cannot move {path} aside: {describe_os_error(exc)}") from exc
        moved.append(target)
    if moved:
        fsync_dir(state_file.parent)
    return moved
