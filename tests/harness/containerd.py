"""containerd 1.6 with its CRI plugin, driven the way kubelet drives it, confined to a scratch
directory: its own config, root, state and socket; the CNI network is one conflist.

`stop()` leaves nothing behind, even after a crash: no shim or pause process, mount, network
namespace, cgroup or libcni cache entry (see `leftovers()`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.harness import host
from tests.harness.cri import CriClient
from tests.harness.podman import PAUSE_IMAGE, build_pause_archive

# containerd 1.6 puts the shims' sockets here whatever its config says.
CONTAINERD_SHIM_SOCKETS = Path("/run/containerd/s")
# libcni (podman's and containerd's) caches each ADD's result here until the DEL.
LIBCNI_CACHE = Path("/var/lib/cni/results")


class Containerd:
    """containerd 1.6 with its CRI plugin, the way kubelet drives it, confined to `workdir`.

    `conflist` is the only file of its CNI `conf_dir` (None: none yet, e.g. for a DaemonSet's
    init container to write); its CNI `bin_dir` holds symlinks to the reference plugins,
    overridden by the executables of `plugin_dirs` (ours). `cni_dirs` (bin, conf) replaces the
    default workdir/cni-bin and workdir/cni-conf. `start()` imports the pause archive
    (`build_pause_archive`, built on the spot when not given). `prefix` runs containerd under
    another command (e.g. `nsenter --net=PATH`: its CNI plugins run in that namespace).
    `socket`: its gRPC socket (default: one in a short temporary directory of its own); the
    directory is removed with the rest by `stop()`.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        conflist: dict[str, Any] | None,
        plugin_dirs: Sequence[Path] = (),
        cni_dirs: tuple[Path, Path] | None = None,
        pause_archive: Path | None = None,
        pause_image: str = PAUSE_IMAGE,
        cgroup_parent: str | None = None,
        log_level: str = "info",
        prefix: Sequence[str] = (),
        socket: Path | None = None,
    ) -> None:
        self.workdir = workdir
        self.prefix = list(prefix)
        workdir.mkdir(parents=True, exist_ok=True)
        self.root = workdir / "root"
        self.state = workdir / "state"
        self.bin_dir, self.conf_dir = cni_dirs or (workdir / "cni-bin", workdir / "cni-conf")
        self.runc_root = workdir / "runc"
        self.log_path = workdir / "containerd.log"
        self.config_path = workdir / "config.toml"
        self.pause_archive = pause_archive
        self.pause_image = pause_image
        self.cgroup_parent = cgroup_parent or f"/cns-test-cri-{uuid.uuid4().hex[:8]}"
        self._socket_dir = host.short_tempdir("cns-ctrd-") if socket is None else socket.parent
        self.socket = self._socket_dir / "containerd.sock" if socket is None else socket
        self._socket_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.root, self.state, self.bin_dir, self.conf_dir, self.runc_root):
            path.mkdir(parents=True, exist_ok=True)
        for source_dir in (host.REFERENCE_PLUGINS, *plugin_dirs):
            for plugin in sorted(Path(source_dir).iterdir()):
                if plugin.is_file() and os.access(plugin, os.X_OK):
                    link = self.bin_dir / plugin.name
                    link.unlink(missing_ok=True)
                    link.symlink_to(plugin.resolve())
        if conflist is not None:
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

    def __exit__(self, *exc_info: object) -> None:
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
                [*self.prefix, "containerd", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=host.system_env(),
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
        return host.run(
            ["ctr", "--address", self.socket, *args], env=host.system_env(), check=check, timeout=60
        )

    def client(self, timeout: float = 60) -> CriClient:
        """A CRI client whose sandboxes go under this containerd's cgroup parent."""
        return CriClient(self.socket, cgroup_parent=self.cgroup_parent, timeout=timeout)

    def _ours(self, command: str) -> bool:
        return str(self.socket) in command or str(self.config_path) in command

    def _shim_socket(self, command: str) -> Path | None:
        """Its socket: CONTAINERD_SHIM_SOCKETS/sha256(ADDRESS/NAMESPACE/ID) in containerd 1.6."""
        namespace, sandbox = host.word_after("-namespace", command), host.word_after("-id", command)
        if namespace is None or sandbox is None:
            return None
        digest = hashlib.sha256(f"{self.socket}/{namespace}/{sandbox}".encode()).hexdigest()
        return CONTAINERD_SHIM_SOCKETS / digest

    def leftovers(self) -> list[str]:
        """Anything of this containerd still on the host (empty after `stop`)."""
        found = [f"process {pid}: {host.command_line(pid)}" for pid in host.processes(self._ours)]
        found += [f"mount {point}" for point in host.mounts_under(self.workdir)]
        found += [f"netns {path}" for path in sorted(self._netns) if Path(path).exists()]
        found += [f"cgroup {path}" for path in host.cgroup_dirs(self.cgroup_parent)]
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
        shims = host.processes(self._ours)
        tree = host.descendants(shims)
        held = {host.net_namespace_inode(pid) for pid in tree} - {None}
        sockets = [self._shim_socket(host.command_line(pid)) for pid in shims]
        sandbox_ids = [host.word_after("-id", host.command_line(pid)) for pid in shims]
        host.kill_and_wait([*tree, *shims])
        for socket in sockets:  # a killed shim leaves its socket behind
            if socket is not None:
                socket.unlink(missing_ok=True)
        for sandbox_id in sandbox_ids:  # and no CNI DEL ran: drop libcni's cached results
            if sandbox_id:
                for cached in LIBCNI_CACHE.glob(f"*-{sandbox_id}-*"):
                    cached.unlink(missing_ok=True)
        for name, inode in host.named_netns().items():
            if inode in held and name.startswith("cni-"):
                self._netns.add(f"/run/netns/{name}")
        for netns in self._netns:
            host.delete_netns(netns)
        host.unmount_under(self.workdir)
        host.remove_cgroup(self.cgroup_parent)
        for scratch in (self.root, self.state, self.runc_root, self.workdir / "opt"):
            shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._created_shim_dir:
            with contextlib.suppress(OSError):
                CONTAINERD_SHIM_SOCKETS.rmdir()
                CONTAINERD_SHIM_SOCKETS.parent.rmdir()
