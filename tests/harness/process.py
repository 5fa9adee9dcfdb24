"""Child processes of a test or a benchmark: tied to its life, logged to a file, restartable."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child once its parent is gone, so
    a test or benchmark killed with SIGKILL leaves no process behind.

    The kernel sends it when the spawning *thread* exits, not the process: from any thread but
    the main one this returns None (a child started from `asyncio.to_thread` or a thread pool
    must not die with that thread).
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    # Looked up here: a dlopen in the child could hang on a loader lock another thread held.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:  # pragma: no cover - runs in the child between fork and exec
        with contextlib.suppress(Exception):
            prctl(PR_SET_PDEATHSIG, sig)

    return arm


def private_tmp(workdir: Path) -> dict[str, str]:
    """The environment for a process a test starts: its temporary files (the Kubernetes
    client's CA file, for one) go into the test's own directory, so that a process the test
    kills with SIGKILL leaves nothing in /tmp."""
    return {**os.environ, "TMPDIR": str(workdir)}


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log (read from its last 64 KiB), for error messages."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - 64 * 1024))
            text = file.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ManagedProcess:
    """A long-running child (etcd, an apiserver, a kubelet, `cns controller`) in its own session,
    appending to one log over restarts; SIGKILLed if the test process dies first."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    starts: int = field(default=0)
    env: dict[str, str] | None = None

    def spawn(self, cwd: Path) -> None:
        self.starts += 1
        with self.log.open("ab") as log:
            log.write(f"\n===== start #{self.starts}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (at once if `timeout` is 0)."""
        popen, self.popen = self.popen, None
        if popen is None or popen.poll() is not None:
            return
        if timeout > 0:
            popen.terminate()
            try:
                popen.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                pass
        popen.kill()
        popen.wait(10)

    def exited_because_port_taken(self) -> bool:
        return (
            self.popen is not None
            and self.popen.poll() is not None
            and "address already in use" in tail(self.log, 30)
        )
