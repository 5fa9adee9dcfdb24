"""Crash-safe file writes (temp file, fsync, rename, fsync the directory) and OS error text."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new content."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk must not keep a half-written copy
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the renames and creations in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def describe_os_error(exc: OSError) -> str:
    """`ENOSPC (No space left on device)`: the errno's name first, so logs and replies can be
    searched for the cause."""
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name} ({exc.strerror or exc})"


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its `st_mode`, for messages."""
    for test, kind in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return kind
    return "not a regular file"
