"""The host as the runtime and node harnesses leave it: inspection and clean-up.

Mounts, processes, network namespaces, cgroups and links, each looked up or removed only by
paths, names and pids the caller created; `run` for host commands; `ping` and a host test address
for pods to reach. Also what the runtimes need from the host: the reference CNI plugins and a
static busybox.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REFERENCE_PLUGINS = Path("/usr/lib/cni")
BUSYBOX = Path("/bin/busybox")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The machine's sysctls a pod network changes (IPv6 forwarding changes how the node treats
# router advertisements): tests that build one in a scratch namespace check they stay as found.
MACHINE_SYSCTLS = [
    Path("/proc/sys/net/ipv4/ip_forward"),
    Path("/proc/sys/net/ipv6/conf/all/forwarding"),
    Path("/proc/sys/net/ipv6/conf/all/accept_ra"),
    Path("/proc/sys/net/ipv6/conf/default/disable_ipv6"),
]


def which(tool: str) -> str | None:
    """`tool` on $PATH or the system path (sudo and CI may strip /usr/sbin from $PATH)."""
    return shutil.which(tool, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}")


def is_static_elf(path: Path) -> bool:
    """True for an ELF64 executable without a program interpreter (no dynamic loader)."""
    try:
        with path.open("rb") as file:
            header = file.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
                return False
            endian = "<" if header[5] == 1 else ">"
            (phoff,) = struct.unpack_from(f"{endian}Q", header, 0x20)
            phentsize, phnum = struct.unpack_from(f"{endian}HH", header, 0x36)
            file.seek(phoff)
            table = file.read(phentsize * phnum)
    except OSError:
        return False
    for index in range(phnum):
        (p_type,) = struct.unpack_from(f"{endian}I", table, index * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def run(
    args: Sequence[str | Path],
    *,
    env: dict[str, str] | None = None,
    check: bool = False,
    timeout: float = 120,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """A host command, its output captured as text; `check`: exiting non-zero fails the test."""
    result = subprocess.run(
        [str(arg) for arg in args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result


def system_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{env.get('PATH', '')}:{SYSTEM_PATH}".strip(":")
    env.update(extra or {})
    return env


def _unescape_mount_path(field: str) -> str:
    return (
        field.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root`, deepest first."""
    prefix = str(root.resolve()) if root.exists() else str(root)
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = _unescape_mount_path(line.split()[4])
            if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(root: Path) -> None:
    for point in mounts_under(root):
        if run(["umount", point]).returncode != 0:
            run(["umount", "-l", point])


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def word_after(flag: str, command: str) -> str | None:
    """The word after `flag` in a command line."""
    words = command.split()
    if flag in words[:-1]:
        return words[words.index(flag) + 1]
    return None


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def processes(predicate: Callable[[str], bool]) -> list[int]:
    """Live processes (zombies excluded) whose command line satisfies `predicate`."""
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        command = command_line(pid)
        if command and predicate(command) and not _is_zombie(pid):
            pids.append(pid)
    return pids


def descendants(pids: Sequence[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            children.setdefault(_ppid(int(entry.name)), []).append(int(entry.name))
    found: list[int] = []
    stack = list(pids)
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_and_wait(pids: Sequence[int], timeout: float = 10) -> None:
    """SIGKILL these processes (by pid) and wait until each is gone or a zombie."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_is_zombie(pid) for pid in pids):
        time.sleep(0.05)


def wait_gone(predicate: Callable[[str], bool], timeout: float) -> list[int]:
    """Wait for matching processes to exit by themselves; return those still running."""
    deadline = time.monotonic() + timeout
    left = processes(predicate)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes(predicate)
    return left


def net_namespace_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def named_netns() -> dict[str, int]:
    """`ip netns` names with the inode of the namespace each one pins."""
    found = {}
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir():
        for entry in netns_dir.iterdir():
            with contextlib.suppress(OSError):
                found[entry.name] = entry.stat().st_ino
    return found


def delete_netns(path_or_name: str) -> None:
    name = Path(path_or_name).name
    if (Path("/run/netns") / name).exists():
        run(["ip", "netns", "delete", name])


def cgroup_dirs(parent: str) -> list[Path]:
    """The cgroup directory `parent` in every hierarchy where it exists, cgroup v1 or v2."""
    relative = parent.strip("/")
    base = Path("/sys/fs/cgroup")
    if not relative or not base.is_dir():
        return []
    bases = [base, *(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())]
    return [hierarchy / relative for hierarchy in bases if (hierarchy / relative).is_dir()]


def remove_cgroup(parent: str) -> None:
    """Remove the (empty) cgroup tree `parent` from every hierarchy."""
    for top in cgroup_dirs(parent):
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: w[0].count("/"), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


@contextlib.contextmanager
def host_test_address(address: str, ifname: str) -> Iterator[str]:
    """A host address on a link of its own, for pods to ping "the host" whatever the plugin.

    A `dummy` link, or a port-less `bridge` where the kernel has no dummy driver (this VM's).
    Pods reach it through their default route; the packets never leave the machine.
    """
    run(["ip", "link", "del", ifname])
    if run(["ip", "link", "add", ifname, "type", "dummy"]).returncode != 0:
        run(["ip", "link", "add", ifname, "type", "bridge"], check=True)
    try:
        run(["ip", "addr", "add", f"{address}/32", "dev", ifname], check=True)
        run(["ip", "link", "set", ifname, "up"], check=True)
        yield address
    finally:
        run(["ip", "link", "del", ifname])


def ping(
    address: str, *, netns: str | None = None, tries: int = 3
) -> subprocess.CompletedProcess[str]:
    """`ping -c1 -W2` from the host (or inside `netns`), up to `tries` times.

    One run in several hundred pods lost the first packet right after the veth came up, with a
    unique address and a stable bridge MAC; a pod without a working network still fails every
    try.
    """
    prefix = ["ip", "netns", "exec", Path(netns).name] if netns else []
    result = run([*prefix, "ping", "-c1", "-W2", address])
    for _ in range(tries - 1):
        if result.returncode == 0:
            break
        result = run([*prefix, "ping", "-c1", "-W2", address])
    return result


def host_routes(address: str) -> str:
    """The host's routes to exactly `address` (a /32), e.g. a pod route left behind."""
    return run(["ip", "-4", "route", "show", "exact", f"{address}/32"]).stdout.strip()


def short_tempdir(prefix: str) -> Path:
    """A short directory for unix sockets (sun_path is 108 bytes; pytest's tmp_path can be long)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
