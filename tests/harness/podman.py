"""podman 4.3 with the CNI backend, confined to a scratch directory, and the busybox root
filesystem its containers (and containerd's pause image) run on: no image is ever pulled.

Tests build a conflist, hand it to `Podman.add_network`, run containers the way a user does and
check what the network plugins did. `close()` leaves nothing behind: no container, conmon
process, mount, network namespace or cgroup (see `leftovers()`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.harness import host

PAUSE_IMAGE = "localhost/cns-test/pause:1"


def busybox_rootfs(root: Path) -> Path:
    """A root filesystem with a static busybox, its applets as symlinks in /bin, and /etc/passwd.

    Enough for `podman run --rootfs` and for containerd's pause image: no image pull.
    """
    if not host.is_static_elf(host.BUSYBOX):
        raise FileNotFoundError(f"{host.BUSYBOX} is not a static binary: install busybox-static")
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    binary = bin_dir / "busybox"
    if binary.is_symlink() or not binary.exists():
        binary.unlink(missing_ok=True)
        shutil.copy2(host.BUSYBOX, binary)
    applets = host.run([host.BUSYBOX, "--list"], check=True).stdout.split()
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


class Podman:
    """podman 4.3 with the CNI backend, runc and cgroupfs, confined to `workdir`.

    `CONTAINERS_CONF` and `CONTAINERS_STORAGE_CONF` point at files written here, per call (the
    test process's environment is untouched). Networks are conflists in `network_config_dir`
    (`add_network`); CNI plugins are looked up in /usr/lib/cni, then in `plugin_dirs`.
    `prefix` runs every podman command under another (e.g. `nsenter --net=PATH`: the plugins,
    conmon and its cleanup then run in that network namespace, not the machine's).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        plugin_dirs: Sequence[Path] = (),
        rootfs: Path | None = None,
        storage_driver: str = "overlay",
        cgroup_parent: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.prefix = list(prefix)
        workdir.mkdir(parents=True, exist_ok=True)
        self.network_config_dir = workdir / "net.d"
        self.graphroot = workdir / "storage"
        # With a runroot longer than ~50 characters (pytest's tmp_path is), an attached
        # `podman run` waits 20 s after its container exits ("Exceeded conmon timeout").
        self._short_dir = host.short_tempdir("cns-podman-")
        self.runroot = self._short_dir / "run"
        self.tmp_dir = self._short_dir / "tmp"
        for path in (self.network_config_dir, self.graphroot, self.runroot, self.tmp_dir):
            path.mkdir(exist_ok=True)
        self.rootfs = rootfs or busybox_rootfs(workdir / "rootfs")
        self.cgroup_parent = cgroup_parent or f"/cns-test-podman-{uuid.uuid4().hex[:8]}"
        self.containers_conf = workdir / "containers.conf"
        self.storage_conf = workdir / "storage.conf"
        plugin_path = [str(host.REFERENCE_PLUGINS), *(str(p) for p in plugin_dirs)]
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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def env(self) -> dict[str, str]:
        return host.system_env(
            {
                "CONTAINERS_CONF": str(self.containers_conf),
                "CONTAINERS_STORAGE_CONF": str(self.storage_conf),
            }
        )

    def podman(
        self, *args: str | Path, check: bool = False, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return host.run([*self.prefix, "podman", *args], env=self.env, check=check, timeout=timeout)

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
        result = self.start(network, name, cmd, options)
        if result.returncode != 0:
            raise AssertionError(
                f"podman run -d {name} exited {result.returncode}: {result.stderr}"
            )
        sandbox = self.inspect(name).get("NetworkSettings", {}).get("SandboxKey")
        if sandbox:
            self._netns.add(sandbox)
        return result.stdout.strip()

    def start(
        self,
        network: str,
        name: str,
        cmd: Sequence[str] = ("/bin/sleep", "2147483647"),
        options: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str]:
        """`podman run -d`, its failure included (a failed ADD leaves the container created)."""
        return self.podman("run", "-d", *self._run_args(network, name, options), *cmd)

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

    def _ours(self, command: str) -> bool:
        # conmon (-b GRAPHROOT/...), `podman container cleanup --root GRAPHROOT`, ...
        return str(self.graphroot) in command or str(self.runroot) in command

    def leftovers(self) -> list[str]:
        """Anything of this podman still on the host (empty after `close`)."""
        found = [f"process {pid}: {host.command_line(pid)}" for pid in host.processes(self._ours)]
        found += [f"mount {point}" for point in host.mounts_under(self.workdir)]
        found += [f"mount {point}" for point in host.mounts_under(self._short_dir)]
        found += [f"netns {path}" for path in sorted(self._netns) if Path(path).exists()]
        found += [f"cgroup {path}" for path in host.cgroup_dirs(self.cgroup_parent)]
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
        host.kill_and_wait(host.wait_gone(self._ours, timeout=10))
        for netns in self._netns:
            host.delete_netns(netns)
        host.unmount_under(self.workdir)
        host.unmount_under(self._short_dir)
        host.remove_cgroup(self.cgroup_parent)
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
    host.run(["tar", "-C", rootfs, "-cf", rootfs_tar, "."], check=True)
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
