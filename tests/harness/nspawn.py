"""A real systemd to test units under: a Debian root file system booted with systemd-nspawn.

The root (Debian bookworm, minbase, with systemd, python3 and iproute2, plus a venv in /opt/cns
holding cns's dependencies) is built once with mmdebstrap and cached in /var/cache/cns-nspawn/,
in a directory named after a hash of what it contains: a change to the package list, to
pyproject's dependencies or to the build steps builds a new one. Every boot runs on a throw-away
overlay (`--volatile=overlay`), so the cache is never written to and boots leave nothing in it.

The container shares the host's network namespace (that is what cns configures): callers use
link, netns and address names of their own and remove them. Its mount and PID namespaces are
its own: commands run inside with `Machine.run` (nsenter), files are reached with `Machine.path`.

Needs root, mmdebstrap and systemd-container (scripts/setup.sh TEST_PACKAGES installs both).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tests.harness import REPO, host
from tests.harness.requirements import missing_root, require

CACHE = Path("/var/cache/cns-nspawn")
SUITE = "bookworm"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "iproute2", "iputils-ping", "python3",
            "python3-venv")  # fmt: skip
VENV = "/opt/cns"
BUILD_STEPS_VERSION = 1  # bump when `_build` changes what it puts into the root
SYSTEM_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
TOOLS = ("mmdebstrap", "systemd-nspawn", "nsenter")

Progress = Callable[[str], None]


def missing_requirements(*tools: str) -> list[str]:
    return missing_root() + [tool for tool in (*TOOLS, *tools) if shutil.which(tool) is None]


def require_nspawn(*tools: str) -> None:
    """Fail under CI, skip otherwise, when root or a tool is missing (never skip silently)."""
    require(missing_requirements(*tools), " (scripts/setup.sh TEST_PACKAGES installs them)")


def run(args: Sequence[str | Path], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """A host command; a failure raises with its output."""
    return host.run(args, check=True, timeout=timeout)


def dependencies() -> list[str]:
    """cns's runtime dependencies, as pyproject.toml declares them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def cache_key() -> str:
    content = {
        "steps": BUILD_STEPS_VERSION,
        "suite": SUITE,
        "packages": PACKAGES,
        "dependencies": dependencies(),
        "python": list(sys.version_info[:2]),  # the wheels are built for this interpreter
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def rootfs(progress: Progress) -> Path:
    """The cached root, built first if missing. Concurrent callers wait for one build."""
    root = CACHE / f"{SUITE}-{cache_key()}"
    if root.is_dir():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():
            return root
        partial = CACHE / f".{root.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted build
        started = time.monotonic()
        _build(partial, progress)
        partial.rename(root)  # the root appears complete or not at all
        progress(f"nspawn root {root} built in {time.monotonic() - started:.0f} s")
    return root


def _build(root: Path, progress: Progress) -> None:
    progress(f"nspawn root: mmdebstrap {SUITE} ({', '.join(PACKAGES)}) into {root} ...")
    run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(PACKAGES)}",
         SUITE, root])  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cns-wheels-") as wheels:
        progress("nspawn root: wheels of cns's dependencies (pip wheel) ...")
        run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
             "-w", wheels, *dependencies()])  # fmt: skip
        progress(f"nspawn root: venv {VENV} with the dependencies ...")
        script = (
            f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --disable-pip-version-check "
            f"--no-index --find-links /mnt/wheels {' '.join(map(repr, dependencies()))}"
        )
        run(["systemd-nspawn", "-q", "-D", root, "--register=no", "--keep-unit",
             f"--bind-ro={wheels}:/mnt/wheels", "/bin/sh", "-c", script])  # fmt: skip
    (root / "mnt" / "wheels").rmdir()  # the bind's mount point


def host_paths_nspawn_creates() -> list[Path]:
    """Directories systemd-nspawn leaves on the host; the caller removes those it made."""
    base = Path("/run/systemd/nspawn")
    return [base / "locks", base / "propagate", base]


class Machine:
    """One booted container. `boot()` once, `stop()` always (in a finally)."""

    def __init__(self, root: Path, workdir: Path, name: str, binds: Sequence[str] = ()) -> None:
        self.root = root
        self.workdir = workdir
        self.name = name
        self.binds = list(binds)
        self.log = workdir / "nspawn.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def boot(self, timeout: float = 120) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                ["systemd-nspawn", "-q", "-D", str(self.root), "--boot", "--console=pipe",
                 "--register=no", "--keep-unit", "--capability=all", "--volatile=overlay",
                 f"--machine={self.name}", *self.binds],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self.leader:
            self._check_alive()
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            with contextlib.suppress(OSError):
                for pid in children.read_text().split():
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                        self.leader = int(pid)
            if time.monotonic() > deadline:
                raise AssertionError(f"no systemd in the container:\n{self.log.read_text()}")
            time.sleep(0.1)
        state = ""
        while state not in ("running", "degraded"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"container boot stuck in {state!r}:\n{self.log.read_text()}")
            time.sleep(0.2)
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"systemd-nspawn exited:\n{self.log.read_text()}")

    def run(
        self,
        *args: str,
        check: bool = True,
        env: dict[str, str] | None = None,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """A command inside the container (all its namespaces), with a clean environment."""
        return host.run(
            ["nsenter", "-t", str(self.leader), "-a", *args],
            env={**SYSTEM_ENV, **(env or {})},
            check=check,
            timeout=timeout,
            input=input,
        )

    def spawn(
        self, *args: str, env: dict[str, str] | None = None, input: str = ""
    ) -> subprocess.Popen[str]:
        """A command inside the container that runs on while the caller goes on; `input` is
        its whole stdin. Collect it with `wait()`, then read `stdout`."""
        proc = subprocess.Popen(
            ["nsenter", "-t", str(self.leader), "-a", *args],
            env={**SYSTEM_ENV, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(input)
        proc.stdin.close()
        return proc

    def kill(self, pid: int | str, signal_name: str, check: bool = True) -> None:
        """kill(1) is not in a minbase root: the shell's builtin sends the signal."""
        self.run("sh", "-c", f"kill -s {signal_name} {pid}", check=check)

    def path(self, inside: str) -> Path:
        """A path of the container's file system, as seen from the host."""
        return Path(f"/proc/{self.leader}/root{inside}")

    def cursor(self) -> str:
        """The journal's current position, for `journal(after=...)`."""
        out = self.run("journalctl", "-q", "-n", "1", "--show-cursor").stdout
        return out.rsplit("-- cursor: ", 1)[1].strip()

    def journal(self, unit: str, after: str | None = None) -> str:
        args = ["journalctl", "-q", "--no-pager", "-u", unit]
        if after:
            args.append(f"--after-cursor={after}")
        return self.run(*args).stdout

    def show(self, unit: str, prop: str) -> str:
        return self.run("systemctl", "show", "-p", prop, "--value", unit).stdout.strip()

    def stop(self, timeout: float = 60) -> None:
        """Shut the container's systemd down (SIGTERM to nspawn), SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def booted(workdir: Path, name: str, binds: Sequence[str], progress: Progress) -> Iterator[Machine]:
    """A booted machine, stopped afterwards with what nspawn left on the host removed."""
    made_by_us = [path for path in host_paths_nspawn_creates() if not path.exists()]
    machine = Machine(rootfs(progress), workdir, name, binds)
    try:
        machine.boot()
        yield machine
    finally:
        machine.stop()
        for path in made_by_us:
            with contextlib.suppress(OSError):
                path.rmdir()  # only if empty: another container may be using it
