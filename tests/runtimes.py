"""Real container runtimes calling a CNI network: podman 4.3 (CNI backend) and containerd 1.6 (CRI).

A reusable harness, not a conftest: tests build a conflist, hand it to `Podman` or `Containerd`,
drive pods the way a user or kubelet does, and check what the network plugins did. Every runtime
lives in a scratch directory with its own config, storage, state and socket, and leaves nothing
behind when it is closed: no container, shim or conmon process, mount, network namespace or
cgroup (see `leftovers()`). No image is pulled: containers run on a busybox root filesystem made
from Debian's `busybox-static`, and containerd's pause image is built from it locally.

Needs root and, from Debian: podman, runc, busybox-static, containerd, containernetworking-plugins;
from PyPI (containerd only): grpcio and grpcio-tools. `require_runtime_root()` checks them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import pytest

REFERENCE_PLUGINS = Path("/usr/lib/cni")
BUSYBOX = Path("/bin/busybox")
PROTO = Path(__file__).resolve().parent / "cri" / "api.proto"
PAUSE_IMAGE = "localhost/cns-test/pause:1"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# containerd 1.6 puts the shims' sockets here whatever its config says.
CONTAINERD_SHIM_SOCKETS = Path("/run/containerd/s")
# libcni (podman's and containerd's) caches each ADD's result here until the DEL.
LIBCNI_CACHE = Path("/var/lib/cni/results")

TOOLS = {
    "podman": ("podman", "runc", "conmon"),
    # podman builds containerd's pause image (import + save), no registry involved.
    "containerd": ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "podman", "conmon"),
}
PYTHON_MODULES = {"podman": (), "containerd": ("grpc", "grpc_tools")}


# --- environment checks ---------------------------------------------------------------------


def _which(tool: str) -> str | None:
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


def missing_requirements(*runtimes: str) -> list[str]:
    """What this machine lacks to run the given runtimes ("podman", "containerd"; default both)."""
    wanted = runtimes or tuple(TOOLS)
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root")
    tools = sorted({tool for runtime in wanted for tool in TOOLS[runtime]})
    missing += [tool for tool in tools if _which(tool) is None]
    for plugin in ("ptp", "host-local", "loopback", "portmap"):
        if not (REFERENCE_PLUGINS / plugin).exists():
            missing.append(f"{REFERENCE_PLUGINS / plugin} (containernetworking-plugins)")
    if not is_static_elf(BUSYBOX):
        missing.append(f"a static {BUSYBOX} (busybox-static)")
    for runtime in wanted:
        for module in PYTHON_MODULES[runtime]:
            if importlib.util.find_spec(module) is None:
                missing.append(f"python module {module}")
    return missing


def require(missing: Sequence[str], hint: str = "") -> None:
    """Like `require_root()`: fail under CI, skip otherwise, when something is missing."""
    if not missing:
        return
    why = f"needs {', '.join(missing)}{hint}"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must provide them")
    pytest.skip(why)


def require_runtime_root(*runtimes: str) -> None:
    require(missing_requirements(*runtimes))


# --- host helpers (all scoped to paths and processes this harness created) ------------------


def run(
    args: Sequence[str | Path],
    *,
    env: dict[str, str] | None = None,
    check: bool = False,
    timeout: float = 120,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
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


def _system_env(extra: dict[str, str] | None = None) -> dict[str, str]:
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


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _flag(cmdline: str, flag: str) -> str | None:
    """The word after `flag` in a command line."""
    words = cmdline.split()
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
        cmdline = _cmdline(pid)
        if cmdline and predicate(cmdline) and not _is_zombie(pid):
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

    The first packet to a veth that just came up is occasionally lost (see test_e2e_bridge).
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


# --- root filesystem -------------------------------------------------------------------------


def busybox_rootfs(root: Path) -> Path:
    """A root filesystem with a static busybox, its applets as symlinks in /bin, and /etc/passwd.

    Enough for `podman run --rootfs` and for containerd's pause image: no image pull.
    """
    if not is_static_elf(BUSYBOX):
        raise FileNotFoundError(f"{BUSYBOX} is not a static binary: install busybox-static")
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    binary = bin_dir / "busybox"
    if binary.is_symlink() or not binary.exists():
        binary.unlink(missing_ok=True)
        shutil.copy2(BUSYBOX, binary)
    applets = run([BUSYBOX, "--list"], check=True).stdout.split()
    for applet in applets:
        # `--list` names "busybox" too: a symlink busybox -> busybox would replace the binary.
        if applet == "busybox" or "/" in applet:
            continue
        link = bin_dir / applet
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to("busybox")
    for name in ("etc", "proc", "sys", "dev", "tmp", "root", "run"):
        (root / name).mkdir(exist_ok=True)
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    )
    (root / "etc" / "group").write_text("root:x:0:\nnobody:x:65534:\n")
    return root


# --- podman ----------------------------------------------------------------------------------


class Podman:
    """podman 4.3 with the CNI backend, runc and cgroupfs, confined to `workdir`.

    `CONTAINERS_CONF` and `CONTAINERS_STORAGE_CONF` point at files written here, per call (the
    test process's environment is untouched). Networks are conflists in `network_config_dir`
    (`add_network`); CNI plugins are looked up in /usr/lib/cni, then in `plugin_dirs`.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        plugin_dirs: Sequence[Path] = (),
        rootfs: Path | None = None,
        storage_driver: str = "overlay",
        cgroup_parent: str | None = None,
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.network_config_dir = workdir / "net.d"
        self.graphroot = workdir / "storage"
        # With a runroot longer than ~50 characters (pytest's tmp_path is), an attached
        # `podman run` waits 20 s after its container exits ("Exceeded conmon timeout").
        self._short_dir = short_tempdir("cns-podman-")
        self.runroot = self._short_dir / "run"
        self.tmp_dir = self._short_dir / "tmp"
        for path in (self.network_config_dir, self.graphroot, self.runroot, self.tmp_dir):
            path.mkdir(exist_ok=True)
        self.rootfs = rootfs or busybox_rootfs(workdir / "rootfs")
        self.cgroup_parent = cgroup_parent or f"/cns-test-podman-{uuid.uuid4().hex[:8]}"
        self.containers_conf = workdir / "containers.conf"
        self.storage_conf = workdir / "storage.conf"
        plugin_path = [str(REFERENCE_PLUGINS), *(str(p) for p in plugin_dirs)]
        self.containers_conf.write_text(
            "[containers]\n"
            # The default nofile (1048576) is above this machine's hard limit: setrlimit fails.
            'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n'
            "[network]\n"
            'network_backend = "cni"\n'
            f"cni_plugin_dirs = {json.dumps(plugin_path)}\n"
            f"network_config_dir = {json.dumps(str(self.network_config_dir))}\n"
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f"events_logfile_path = {json.dumps(str(workdir / 'events.log'))}\n"
            # crun 1.8 fails on this cgroup layout ("cgroups in hybrid mode not supported").
            'runtime = "runc"\n'
            f"tmp_dir = {json.dumps(str(self.tmp_dir))}\n"
        )
        self.storage_conf.write_text(
            "[storage]\n"
            f"driver = {json.dumps(storage_driver)}\n"
            f"graphroot = {json.dumps(str(self.graphroot))}\n"
            f"runroot = {json.dumps(str(self.runroot))}\n"
        )
        self._netns: set[str] = set()
        self._closed = False

    def __enter__(self) -> Podman:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def env(self) -> dict[str, str]:
        return _system_env(
            {
                "CONTAINERS_CONF": str(self.containers_conf),
                "CONTAINERS_STORAGE_CONF": str(self.storage_conf),
            }
        )

    def podman(
        self, *args: str | Path, check: bool = False, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return run(["podman", *args], env=self.env, check=check, timeout=timeout)

    def add_network(self, conflist: dict[str, Any]) -> str:
        """Write `conflist` as a network; returns its name for `--network`."""
        name: str = conflist["name"]
        path = self.network_config_dir / f"{name}.conflist"
        path.write_text(json.dumps(conflist, indent=2))
        return name

    def _run_args(self, network: str, name: str | None, options: Sequence[str]) -> list[str]:
        args = ["--network", network, "--cgroup-parent", self.cgroup_parent]
        if name:
            args += ["--name", name]
        return [*args, *options, "--rootfs", str(self.rootfs)]

    def run(
        self,
        network: str,
        cmd: Sequence[str],
        name: str | None = None,
        options: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str]:
        """`podman run --rm --network NET --rootfs ROOTFS CMD`: a container that exits."""
        return self.podman("run", "--rm", *self._run_args(network, name, options), *cmd)

    def run_detached(
        self,
        network: str,
        name: str,
        cmd: Sequence[str] = ("/bin/sleep", "2147483647"),
        options: Sequence[str] = (),
    ) -> str:
        """Start a long-running container; returns its id. Remove it with `rm` (or `close`)."""
        result = self.podman("run", "-d", *self._run_args(network, name, options), *cmd, check=True)
        sandbox = self.inspect(name).get("NetworkSettings", {}).get("SandboxKey")
        if sandbox:
            self._netns.add(sandbox)
        return result.stdout.strip()

    def exec(self, name: str, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return self.podman("exec", name, *cmd)

    def inspect(self, name: str) -> dict[str, Any]:
        result = self.podman("container", "inspect", name, check=True)
        info: dict[str, Any] = json.loads(result.stdout)[0]
        return info

    def ip(self, name: str, network: str | None = None) -> str:
        """The container's IPv4 address on `network` (default: its only network)."""
        networks: dict[str, Any] = self.inspect(name)["NetworkSettings"]["Networks"]
        key = network or next(iter(networks))
        address: str = networks[key]["IPAddress"]
        return address

    def netns(self, name: str) -> str:
        path: str = self.inspect(name)["NetworkSettings"]["SandboxKey"]
        return path

    def rm(self, *names: str) -> subprocess.CompletedProcess[str]:
        """`podman rm -f -t 0`: stop at once (sleep as PID 1 ignores SIGTERM) and remove."""
        return self.podman("rm", "-f", "-t", "0", *names)

    def containers(self) -> list[str]:
        result = self.podman("ps", "-a", "--format", "{{.Names}}", check=True)
        return result.stdout.split()

    def _ours(self, cmdline: str) -> bool:
        # conmon (-b GRAPHROOT/...), `podman container cleanup --root GRAPHROOT`, ...
        return str(self.graphroot) in cmdline or str(self.runroot) in cmdline

    def leftovers(self) -> list[str]:
        """Anything of this podman still on the host (empty after `close`)."""
        found = [f"process {pid}: {_cmdline(pid)}" for pid in processes(self._ours)]
        found += [f"mount {point}" for point in mounts_under(self.workdir)]
        found += [f"mount {point}" for point in mounts_under(self._short_dir)]
        found += [f"netns {path}" for path in sorted(self._netns) if Path(path).exists()]
        found += [f"cgroup {path}" for path in cgroup_dirs(self.cgroup_parent)]
        return found

    def close(self) -> None:
        """Remove every container and image, then whatever a crash could have left."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.podman("rm", "-a", "-f", "-t", "0", timeout=60)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.podman("rmi", "-a", "-f", timeout=60)
        # conmon runs `podman container cleanup` after its container exits: let it finish.
        kill_and_wait(wait_gone(self._ours, timeout=10))
        for netns in self._netns:
            delete_netns(netns)
        unmount_under(self.workdir)
        unmount_under(self._short_dir)
        remove_cgroup(self.cgroup_parent)
        for scratch in (self.graphroot, self._short_dir):
            shutil.rmtree(scratch, ignore_errors=True)


def build_pause_archive(workdir: Path, image: str = PAUSE_IMAGE) -> Path:
    """containerd's sandbox image, without a registry: busybox rootfs tar -> `podman import`
    (ENTRYPOINT sleep) -> `podman save --format docker-archive`. Returns the archive's path
    (reused if it exists: build it once per session)."""
    archive = workdir / "pause.tar"
    if archive.exists():
        return archive
    workdir.mkdir(parents=True, exist_ok=True)
    rootfs = busybox_rootfs(workdir / "pause-rootfs")
    rootfs_tar = workdir / "pause-rootfs.tar"
    run(["tar", "-C", rootfs, "-cf", rootfs_tar, "."], check=True)
    with Podman(workdir / "podman-build", rootfs=rootfs, storage_driver="vfs") as podman:
        podman.podman(
            "import",
            "--change",
            'ENTRYPOINT ["/bin/sleep","2147483647"]',
            rootfs_tar,
            image,
            check=True,
        )
        partial = workdir / "pause.tar.partial"
        podman.podman("save", "--format", "docker-archive", "-o", partial, image, check=True)
        partial.rename(archive)
    rootfs_tar.unlink()
    return archive


# --- containerd ------------------------------------------------------------------------------


class Containerd:
    """containerd 1.6 with its CRI plugin, the way kubelet drives it, confined to `workdir`.

    `conflist` is the only file of its CNI `conf_dir`; its CNI `bin_dir` holds symlinks to the
    reference plugins, overridden by the executables of `plugin_dirs` (ours). `start()` imports
    the pause archive (`build_pause_archive`, built on the spot when not given).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        conflist: dict[str, Any],
        plugin_dirs: Sequence[Path] = (),
        pause_archive: Path | None = None,
        pause_image: str = PAUSE_IMAGE,
        cgroup_parent: str | None = None,
        log_level: str = "info",
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.root = workdir / "root"
        self.state = workdir / "state"
        self.bin_dir = workdir / "cni-bin"
        self.conf_dir = workdir / "cni-conf"
        self.runc_root = workdir / "runc"
        self.log_path = workdir / "containerd.log"
        self.config_path = workdir / "config.toml"
        self.pause_archive = pause_archive
        self.pause_image = pause_image
        self.cgroup_parent = cgroup_parent or f"/cns-test-cri-{uuid.uuid4().hex[:8]}"
        self._socket_dir = short_tempdir("cns-ctrd-")
        self.socket = self._socket_dir / "containerd.sock"
        for path in (self.root, self.state, self.bin_dir, self.conf_dir, self.runc_root):
            path.mkdir(exist_ok=True)
        for source_dir in (REFERENCE_PLUGINS, *plugin_dirs):
            for plugin in sorted(Path(source_dir).iterdir()):
                if plugin.is_file() and os.access(plugin, os.X_OK):
                    link = self.bin_dir / plugin.name
                    link.unlink(missing_ok=True)
                    link.symlink_to(plugin.resolve())
        self.set_conflist(conflist)
        q = json.dumps
        cri = '[plugins."io.containerd.grpc.v1.cri"'
        self.config_path.write_text(
            "version = 2\n"
            f"root = {q(str(self.root))}\n"
            f"state = {q(str(self.state))}\n"
            "disabled_plugins = ["
            '"io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", '
            '"io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]\n'
            f"[debug]\n  level = {q(log_level)}\n"
            "[grpc]\n"
            f"  address = {q(str(self.socket))}\n"
            '[plugins."io.containerd.internal.v1.opt"]\n'
            f"  path = {q(str(workdir / 'opt'))}\n"
            f"{cri}]\n"
            f"  sandbox_image = {q(pause_image)}\n"
            # Without it RunPodSandbox fails after CNI ADD: root lacks CAP_SYS_RESOURCE here
            # ("runc create failed: ... can't get final child's PID from pipe: EOF").
            "  restrict_oom_score_adj = true\n"
            f"{cri}.cni]\n"
            f"  bin_dir = {q(str(self.bin_dir))}\n"
            f"  conf_dir = {q(str(self.conf_dir))}\n"
            "  max_conf_num = 1\n"
            f"{cri}.containerd.runtimes.runc]\n"
            '  runtime_type = "io.containerd.runc.v2"\n'
            f"{cri}.containerd.runtimes.runc.options]\n"
            f"  Root = {q(str(self.runc_root))}\n"
            "  SystemdCgroup = false\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self._created_shim_dir = False
        self._netns: set[str] = set()

    def set_conflist(self, conflist: dict[str, Any]) -> None:
        """Make `conflist` the only network; a running containerd reloads it by itself."""
        for old in self.conf_dir.glob("*.conflist"):
            old.unlink()
        self.conflist = conflist
        (self.conf_dir / f"10-{conflist['name']}.conflist").write_text(
            json.dumps(conflist, indent=2)
        )

    def __enter__(self) -> Containerd:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def log(self, tail: int = 60) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])

    def start(self, timeout: float = 30) -> None:
        if self.pause_archive is None:
            self.pause_archive = build_pause_archive(self.workdir / "pause")
        self._created_shim_dir = not CONTAINERD_SHIM_SOCKETS.exists()
        self._launch(timeout)
        self.ctr("-n", "k8s.io", "images", "import", self.pause_archive, check=True)

    def _launch(self, timeout: float) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                ["containerd", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_system_env(),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"containerd exited {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists() and self.ctr("version").returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd not serving after {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def ctr(self, *args: str | Path, check: bool = False) -> subprocess.CompletedProcess[str]:
        return run(
            ["ctr", "--address", self.socket, *args], env=_system_env(), check=check, timeout=60
        )

    def client(self, timeout: float = 60) -> CriClient:
        """A CRI client whose sandboxes go under this containerd's cgroup parent."""
        return CriClient(self.socket, cgroup_parent=self.cgroup_parent, timeout=timeout)

    def _ours(self, cmdline: str) -> bool:
        return str(self.socket) in cmdline or str(self.config_path) in cmdline

    def _shim_socket(self, cmdline: str) -> Path | None:
        """Its socket: CONTAINERD_SHIM_SOCKETS/sha256(ADDRESS/NAMESPACE/ID) in containerd 1.6."""
        namespace, sandbox = _flag(cmdline, "-namespace"), _flag(cmdline, "-id")
        if namespace is None or sandbox is None:
            return None
        digest = hashlib.sha256(f"{self.socket}/{namespace}/{sandbox}".encode()).hexdigest()
        return CONTAINERD_SHIM_SOCKETS / digest

    def leftovers(self) -> list[str]:
        """Anything of this containerd still on the host (empty after `stop`)."""
        found = [f"process {pid}: {_cmdline(pid)}" for pid in processes(self._ours)]
        found += [f"mount {point}" for point in mounts_under(self.workdir)]
        found += [f"netns {path}" for path in sorted(self._netns) if Path(path).exists()]
        found += [f"cgroup {path}" for path in cgroup_dirs(self.cgroup_parent)]
        return found

    def stop(self) -> None:
        """Remove every sandbox, stop containerd, then whatever a crash could have left:
        shims and their processes, their network namespaces, mounts, cgroups, state."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            # It died: a restart on the same root/state reattaches to the running shims, so
            # the sandboxes can be removed through CRI, with their CNI DEL.
            with contextlib.suppress(AssertionError):
                self._launch(timeout=30)
        if self.proc.poll() is None:
            with contextlib.suppress(Exception), self.client(timeout=30) as cri:
                for sandbox in cri.list_pod_sandboxes():
                    with contextlib.suppress(Exception):
                        netns = cri.netns(sandbox.id)
                        if netns:
                            self._netns.add(netns)
                    with contextlib.suppress(Exception):
                        cri.stop(sandbox.id)
                    with contextlib.suppress(Exception):
                        cri.remove(sandbox.id)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        # Shims outlive containerd by design: kill them and what runs under them (by pid),
        # remembering the network namespaces their pause processes held.
        shims = processes(self._ours)
        tree = descendants(shims)
        held = {net_namespace_inode(pid) for pid in tree} - {None}
        sockets = [self._shim_socket(_cmdline(pid)) for pid in shims]
        sandbox_ids = [_flag(_cmdline(pid), "-id") for pid in shims]
        kill_and_wait([*tree, *shims])
        for socket in sockets:  # a killed shim leaves its socket behind
            if socket is not None:
                socket.unlink(missing_ok=True)
        for sandbox_id in sandbox_ids:  # and no CNI DEL ran: drop libcni's cached results
            if sandbox_id:
                for cached in LIBCNI_CACHE.glob(f"*-{sandbox_id}-*"):
                    cached.unlink(missing_ok=True)
        for name, inode in named_netns().items():
            if inode in held and name.startswith("cni-"):
                self._netns.add(f"/run/netns/{name}")
        for netns in self._netns:
            delete_netns(netns)
        unmount_under(self.workdir)
        remove_cgroup(self.cgroup_parent)
        for scratch in (self.root, self.state, self.runc_root, self.workdir / "opt"):
            shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._created_shim_dir:
            with contextlib.suppress(OSError):
                CONTAINERD_SHIM_SOCKETS.rmdir()
                CONTAINERD_SHIM_SOCKETS.parent.rmdir()


# --- CRI client ------------------------------------------------------------------------------

_STUB_PACKAGE = "cns_cri_v1"
_stubs: tuple[ModuleType, ModuleType] | None = None
_stubs_lock = threading.Lock()


def cri_stubs(proto: Path = PROTO) -> tuple[ModuleType, ModuleType]:
    """(api_pb2, api_pb2_grpc) generated from tests/cri/api.proto with grpc_tools.protoc.

    Generated once into a temp dir keyed by the proto's hash and the generator's versions, and
    imported as the package `cns_cri_v1` (its own name: no clash with another `api_pb2`).
    """
    global _stubs
    with _stubs_lock:
        if _stubs is not None:
            return _stubs
        from grpc_tools import protoc  # type: ignore[import-untyped,unused-ignore]

        versions = ",".join(
            importlib.metadata.version(dist) for dist in ("grpcio-tools", "protobuf")
        )
        source = proto.read_bytes()
        key = hashlib.sha256(source + versions.encode()).hexdigest()[:16]
        cache_root = Path(tempfile.gettempdir()) / "cns-cri-stubs"
        cache_root.mkdir(exist_ok=True)
        target = cache_root / key
        if not (target / _STUB_PACKAGE / "api_pb2_grpc.py").exists():
            scratch = Path(tempfile.mkdtemp(dir=cache_root, prefix=".gen-"))
            (scratch / _STUB_PACKAGE).mkdir()
            (scratch / _STUB_PACKAGE / "api.proto").write_bytes(source)
            well_known = Path(protoc.__file__).parent / "_proto"
            code = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{scratch}",
                    f"-I{well_known}",
                    f"--python_out={scratch}",
                    f"--grpc_python_out={scratch}",
                    f"{_STUB_PACKAGE}/api.proto",
                ]
            )
            if code != 0:
                shutil.rmtree(scratch, ignore_errors=True)
                raise RuntimeError(f"grpc_tools.protoc failed ({code}) on {proto}")
            try:
                scratch.rename(target)
            except OSError:  # another process generated it meanwhile
                shutil.rmtree(scratch, ignore_errors=True)
        sys.path.insert(0, str(target))
        try:
            pb2 = importlib.import_module(f"{_STUB_PACKAGE}.api_pb2")
            pb2_grpc = importlib.import_module(f"{_STUB_PACKAGE}.api_pb2_grpc")
        finally:
            sys.path.remove(str(target))
        _stubs = (pb2, pb2_grpc)
        return _stubs


class CriClient:
    """CRI v1 `runtime.v1.RuntimeService` over a unix socket, pod sandboxes only."""

    def __init__(self, socket: Path, *, cgroup_parent: str = "", timeout: float = 60) -> None:
        import grpc  # type: ignore[import-untyped,unused-ignore]

        self.pb, grpc_stubs = cri_stubs()
        self.cgroup_parent = cgroup_parent
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.stub = grpc_stubs.RuntimeServiceStub(self.channel)

    def __enter__(self) -> CriClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def version(self) -> Any:
        return self.stub.Version(self.pb.VersionRequest(version="v1"), timeout=self.timeout)

    def run_pod_sandbox(
        self,
        name: str,
        namespace: str,
        uid: str,
        *,
        attempt: int = 0,
        port_mappings: Sequence[tuple[int, int]] = (),
    ) -> str:
        """RunPodSandbox as kubelet sends it for a pod on the pod network; returns its id.

        `port_mappings`: (container_port, host_port) TCP pairs, for the portmap plugin.
        """
        pb = self.pb
        linux = pb.LinuxPodSandboxConfig(
            cgroup_parent=f"{self.cgroup_parent}/pod{uid}" if self.cgroup_parent else "",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.CONTAINER)
            ),
        )
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, namespace=namespace, uid=uid, attempt=attempt
            ),
            hostname=name[:63],
            port_mappings=[
                pb.PortMapping(protocol=pb.TCP, container_port=inner, host_port=outer)
                for inner, outer in port_mappings
            ],
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace},
            linux=linux,
        )
        response = self.stub.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config), timeout=self.timeout
        )
        sandbox_id: str = response.pod_sandbox_id
        return sandbox_id

    def status(self, sandbox_id: str, verbose: bool = False) -> Any:
        """The PodSandboxStatusResponse (`.status`, and `.info` when verbose)."""
        request = self.pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose)
        return self.stub.PodSandboxStatus(request, timeout=self.timeout)

    def ready(self, sandbox_id: str) -> bool:
        return bool(self.status(sandbox_id).status.state == self.pb.SANDBOX_READY)

    def pod_ip(self, sandbox_id: str) -> str:
        ip: str = self.status(sandbox_id).status.network.ip
        return ip

    def info(self, sandbox_id: str) -> dict[str, Any]:
        """containerd's verbose `info` JSON: pid, runtimeSpec, cniResult, ..."""
        raw = self.status(sandbox_id, verbose=True).info.get("info", "{}")
        info: dict[str, Any] = json.loads(raw)
        return info

    def netns(self, sandbox_id: str) -> str | None:
        """Path of the sandbox's network namespace (None once it is stopped)."""
        spec = self.info(sandbox_id).get("runtimeSpec", {})
        for namespace in spec.get("linux", {}).get("namespaces", []):
            if namespace.get("type") == "network":
                path = namespace.get("path")
                return str(path) if path and Path(path).exists() else None
        return None

    def stop(self, sandbox_id: str) -> None:
        self.stub.StopPodSandbox(
            self.pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=self.timeout
        )

    def remove(self, sandbox_id: str) -> None:
        self.stub.RemovePodSandbox(
            self.pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=self.timeout
        )

    def list_pod_sandboxes(self) -> list[Any]:
        response = self.stub.ListPodSandbox(self.pb.ListPodSandboxRequest(), timeout=self.timeout)
        return list(response.items)
