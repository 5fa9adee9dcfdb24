"""`cns install --systemd`: a node run as a plain systemd host, installed by one command.

It writes the unit (the package's, its ExecStart naming the `cns` that runs this command), the
default config only where there is none (an operator's is never overwritten), the CNI plugins
and the conflist (`cns.commands.install`, as `cns install-cni` writes them), then starts the
service.
Every file is written under a temporary name and renamed, and only when it differs, so a second
run changes nothing and a run killed midway is finished by the next one. The conflist comes
last, once the daemon serves: a runtime that sees the network can ADD at once. Uninstall goes
the other way (conflist first) and keeps the state directory and an operator's config.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cns.commands import install
from cns.config.daemon_config import Config, ConfigError, load

UNIT = "cns.service"
# The unit as shipped (systemd/cns.service) starts this; the install names the real executable.
SHIPPED_EXECUTABLE = "/usr/local/bin/cns"
# ProtectHome=yes: the service cannot see these, so it cannot run a `cns` installed below them.
HIDDEN_FROM_THE_SERVICE = (Path("/home"), Path("/root"), Path("/run/user"))
SYSTEMD_BOOTED = Path("/run/systemd/system")  # sd_booted(3): systemd is PID 1
# A path systemd takes as is in ExecStart= (no quoting, no specifiers, no variables).
PLAIN_PATH = re.compile(r"/[A-Za-z0-9._+/-]*")

Say = Callable[[str], None]


class InstallError(Exception):
    """What the operator must fix, naming the path or the command; nothing more was done."""


@dataclass(frozen=True)
class Layout:
    """Where everything goes, as paths of the target system (below `root` when staging)."""

    root: Path
    config: Path
    executable: Path
    bin_dir: Path = Path("/opt/cni/bin")
    conf_dir: Path = Path("/etc/cni/net.d")
    unit_dir: Path = Path("/etc/systemd/system")
    python: str = "/usr/bin/python3"
    mtu: int = 1500

    @property
    def unit(self) -> Path:
        return self.unit_dir / UNIT

    @property
    def lib_dir(self) -> Path:
        return install.default_lib_dir(self.bin_dir)

    @property
    def conflist(self) -> Path:
        return self.conf_dir / install.CONFLIST

    def here(self, path: Path) -> Path:
        """`path` of the target as seen from this process."""
        return install.under(self.root, path)

    def files(self) -> list[Path]:
        """Every path install writes (target paths), in the order uninstall removes them."""
        cni = install.cni_files(bin_dir=self.bin_dir, lib_dir=self.lib_dir)
        return [self.conflist, self.unit, *cni, self.config]


def render_unit(template: str, executable: Path) -> str:
    """The shipped unit with its ExecStart naming `executable` instead of /usr/local/bin/cns."""
    if not PLAIN_PATH.fullmatch(str(executable)):
        raise InstallError(
            f"{executable}: the unit's ExecStart= needs a path of letters, digits and ._+-/ only"
        )
    prefix = f"ExecStart={SHIPPED_EXECUTABLE} "
    lines = template.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    if len(starts) != 1:
        raise InstallError(f"the shipped unit has no single line starting {prefix!r}")
    lines[starts[0]] = f"ExecStart={executable} " + lines[starts[0]].removeprefix(prefix)
    return "".join(lines)


def default_executable() -> Path | None:
    """The `cns` script installed beside this interpreter (a venv's bin/), else on $PATH."""
    beside = Path(sys.executable).with_name("cns")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("cns")
    return Path(found) if found else None


def _writable(directory: Path) -> bool:
    """Whether `directory` can be created (if missing) and written: its nearest existing
    ancestor is a directory this process may write (access(2): also says EROFS)."""
    while not directory.exists() and not directory.is_symlink():
        directory = directory.parent
    return directory.is_dir() and os.access(directory, os.W_OK)


def preflight(
    layout: Layout, *, euid: int, booted: bool, systemctl: str | None, start: bool, installing: bool
) -> list[str]:
    """Why installing (or uninstalling) cannot work here, each naming the path or the command:
    checked before anything is written, so a refused run leaves the system as it was."""
    problems = []
    if layout.root == Path("/") and euid != 0:
        problems.append("must run as root: it writes /etc and /opt and starts a system service")
    if start and systemctl is None:
        problems.append("systemctl not found on $PATH (--no-start only writes the files)")
    elif start and layout.root == Path("/") and not booted:
        problems.append(
            f"systemd is not running as PID 1 (no {SYSTEMD_BOOTED}): --no-start only writes "
            "the files, --root DIR stages a root file system"
        )
    for path in (*layout.files(), layout.lib_dir):
        if not _writable(layout.here(path).parent):
            problems.append(f"cannot write {layout.here(path).parent}: not a directory this "
                            f"process (uid {euid}) may write")  # fmt: skip
    if not installing:
        return list(dict.fromkeys(problems))
    hidden = [d for d in HIDDEN_FROM_THE_SERVICE if layout.executable.is_relative_to(d)]
    if hidden:
        problems.append(
            f"{layout.executable} is below {hidden[0]}, which the unit hides from the service "
            "(ProtectHome=yes): install cns elsewhere, e.g. python3 -m venv /opt/cns"
        )
    if not os.access(layout.here(layout.executable), os.X_OK):
        problems.append(f"{layout.here(layout.executable)}: no cns executable there (--cns PATH)")
    return list(dict.fromkeys(problems))


class Systemd:
    """systemctl for the target: the running systemd, or `--root` (offline: enable/disable
    only). Absent (None) when the files alone are written."""

    def __init__(self, systemctl: str, root: Path, say: Say) -> None:
        self.systemctl = systemctl
        self.root = root
        self.say = say

    @property
    def live(self) -> bool:
        return self.root == Path("/")

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A change (announced, a failure raises), or a query (`check=False`: neither)."""
        command = [self.systemctl, *([] if self.live else [f"--root={self.root}"]), *args]
        if check:
            self.say(f"running {' '.join(command)}")
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if check and done.returncode != 0:
            hint = " (journalctl -u cns says why)" if self.live else ""
            raise InstallError(
                f"{' '.join(command)} failed ({done.returncode}){hint}: {done.stderr.strip()}"
            )
        return done

    def enabled_and_active(self) -> bool:
        enabled = self("is-enabled", UNIT, check=False).stdout.strip() == "enabled"
        return enabled and self("is-active", UNIT, check=False).stdout.strip() == "active"

    def stale(self) -> bool:
        """Whether systemd's loaded copy of the unit is older than the file."""
        shown = self("show", "--property=NeedDaemonReload", "--value", UNIT, check=False)
        return shown.stdout.strip() == "yes"


def _network(layout: Layout) -> Config:
    """The config the daemon will run with: the conflist must name its socket and queue."""
    try:
        return load(layout.here(layout.config))
    except ConfigError as exc:
        raise InstallError(f"{layout.here(layout.config)}: {exc}") from exc


def install_systemd(layout: Layout, systemd: Systemd | None, say: Say, *, start: bool) -> None:
    """Install (or finish, or repeat) the node install. With `systemd`, a changed unit is
    reloaded and, if `start`, the service enabled and started (offline: enabled)."""
    cni = install.install_cni(
        bin_dir=layout.bin_dir, lib_dir=layout.lib_dir, python=layout.python, root=layout.root
    )
    for path, changed in cni.items():
        say(f"{'installed' if changed else 'unchanged'} {path}")

    config = layout.here(layout.config)
    default = install.shipped("cns.yaml")
    if config.exists():
        same = config.read_text() == default
        say(f"unchanged {config}" if same else f"kept {config}: an operator's config is never "
            "overwritten (the default is in the cns package: cns/data/cns.yaml)")  # fmt: skip
    else:
        config.parent.mkdir(parents=True, exist_ok=True)
        install.replace_file(config, default)
        say(f"installed {config} (the default: standalone, subnet 10.240.0.0/22; edit it)")
    network = _network(layout)
    for path, writable in ((network.state_dir, "/var/lib/cns"), (network.socket_path, "/run/cns")):
        if not path.is_relative_to(writable):
            say(f"warning: {path} is outside {writable}, which is all the unit lets cns write "
                "there: add ReadWritePaths= in a drop-in (systemctl edit cns)")  # fmt: skip

    unit = layout.here(layout.unit)
    existed = unit.exists()
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit_changed = install.replace_file(unit, render_unit(install.shipped(UNIT), layout.executable))
    if unit_changed and existed:
        say(f"replaced {unit}: it differed from cns's unit (ExecStart={layout.executable})")
    else:
        say(f"{'installed' if unit_changed else 'unchanged'} {unit}")

    # A run killed after the rename left systemd with the old unit loaded: it says so.
    if systemd is not None and systemd.live and (unit_changed or systemd.stale()):
        systemd("daemon-reload")
        if existed and start:
            systemd("try-restart", UNIT)  # a running daemon takes the new unit
    if systemd is not None and start and systemd.live:
        # `enable` reloads systemd even when there is nothing to enable: asked first.
        if not systemd.enabled_and_active():
            # Type=notify: returns once READY=1 came, i.e. once the socket answers ADDs.
            systemd("enable", "--now", UNIT)
        say(f"{UNIT} is {systemd('is-active', UNIT, check=False).stdout.strip()}")
    elif systemd is not None and start:
        systemd("enable", UNIT)

    body = install.conflist(
        name="cns",
        socket_path=str(network.socket_path),
        release_queue_dir=str(network.release_queue_dir),
        mtu=layout.mtu,
    )
    path, changed = install.write_conflist(layout.here(layout.conf_dir), body)
    say(f"{'installed' if changed else 'unchanged'} {path}")


def _remove(path: Path, say: Say) -> None:
    """`path` (a file of this install's own: the unit, the config) and the temporary file a
    killed write may have left beside it."""
    try:
        install.remove_file(path)
    except FileNotFoundError:
        say(f"absent {path}")
    else:
        say(f"removed {path}")


def _say_removed(paths: list[Path], removed: list[Path], say: Say) -> None:
    """What `install.uninstall_cni` did with each of `paths`: a file it left is not cns's."""
    for path in paths:
        if path in removed:
            say(f"removed {path}")
        elif path.exists() or path.is_symlink():
            say(f"kept {path}: not written by cns")
        else:
            say(f"absent {path}")


def uninstall_systemd(layout: Layout, systemd: Systemd | None, say: Say) -> None:
    """Stop and disable the service, remove what install wrote; keep the state and a config
    that is not the default. The conflist goes first: no runtime picks cns once it stops.
    The CNI files go the way the DaemonSet's `cns uninstall-cni` removes them."""
    config = layout.here(layout.config)
    state: Path | None = None
    with contextlib.suppress(InstallError):
        state = _network(layout).state_dir if config.exists() else Config().state_dir
    conflist = layout.here(layout.conflist)
    _say_removed([conflist], install.remove_conflist(conflist.parent), say)
    unit = layout.here(layout.unit)
    if systemd is not None and unit.exists():
        systemd("disable", *(["--now"] if systemd.live else []), UNIT)
    _remove(unit, say)
    if systemd is not None and systemd.live:
        systemd("daemon-reload")
        systemd("reset-failed", UNIT, check=False)  # forget a failed run, if any
    bin_dir, lib_dir = layout.here(layout.bin_dir), layout.here(layout.lib_dir)
    removed = install.uninstall_cni(bin_dir=bin_dir, lib_dir=lib_dir, conf_dir=None)
    _say_removed(install.cni_files(bin_dir=bin_dir, lib_dir=lib_dir), removed, say)
    if not config.exists() or config.read_text() == install.shipped("cns.yaml"):
        _remove(config, say)
        with contextlib.suppress(OSError):
            config.parent.rmdir()  # only if empty
    else:
        say(f"kept {config}: it is not the default (an operator's edits are never removed)")
    if state is not None and layout.here(state).exists():
        say(f"kept {layout.here(state)}: the state (assignments, release queue); remove it by "
            "hand once no pod on this node holds an address")  # fmt: skip
