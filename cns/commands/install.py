"""`cns install-cni`: the CNI plugins where a container runtime finds them, and the node's conflist;
`cns uninstall-cni` takes exactly those files away again. `cns install-seccomp-profile`: the
DaemonSet's seccomp profile where the kubelet finds it.

The plugins are stdlib-only code that runs once per pod (cni_plugin/): their package is copied
into a directory of its own and precompiled, and each plugin gets a small launcher in the CNI
bin directory that runs it isolated from the site packages of whichever Python it finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

PLUGINS = {"cns-ipam": "cni_plugin.ipam", "cns-cni": "cni_plugin.cni"}
CONFLIST = "10-cns.conflist"
# The launcher's second line: how `uninstall_cni` knows a file in the bin dir is ours.
LAUNCHER_MARK = "Written by `cns install-cni`"
# config/seccomp-daemon.json, shipped in the package, and its name in the kubelet's directory.
SECCOMP_PROFILE = "seccomp-daemon.json"
SECCOMP_PROFILE_NAME = "daemon.json"


def default_python() -> str:
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def default_lib_dir(bin_dir: Path) -> Path:
    """BIN/../lib/cns: next to the CNI bin directory, on the same file system."""
    return bin_dir.parent / "lib" / "cns"


def launcher(*, python: str, lib_dir: Path, module: str) -> str:
    """A shebang passes one argument: `-IS` (isolated, no site) must be a single word."""
    return (
        f"#!{python} -IS\n"
        f'"""{LAUNCHER_MARK}: a stdlib-only CNI plugin, started once per pod."""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(lib_dir)!r})\n"
        f"from {module} import main\n"
        "sys.exit(main())\n"
    )


def under(root: Path, path: Path) -> Path:
    """Where `path` of the target system is from here: below `root` when staging a root file
    system (`cns install --systemd --root DIR`), itself when installing on this host."""
    if root == Path("/"):
        return path
    return root / path.relative_to(path.anchor)


def temporary(path: Path) -> Path:
    """The name a file is written under before its rename: one fixed name per file, so that a
    run killed midway leaves one stray file that the next run overwrites (and uninstall removes)."""
    return path.with_name(f".{path.name}.tmp")


def replace_file(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write `path` under a temporary name, then rename it: a runtime never runs half a file.
    Returns whether anything changed: the same content and mode are left alone, so that a
    re-run touches nothing (not even a modification time, which compileall would act on)."""
    data = text.encode()
    with contextlib.suppress(FileNotFoundError):
        if stat.S_IMODE(path.stat().st_mode) == mode and path.read_bytes() == data:
            return False
    tmp = temporary(path)
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)
    return True


def shipped(name: str) -> str:
    """A file shipped in the package (cns/data/: the unit, the default config, the profile)."""
    return (resources.files("cns") / "data" / name).read_text()


def install_seccomp_profile(directory: Path) -> tuple[Path, bool]:
    """The daemon container's seccomp profile in `directory` (the kubelet's seccomp dir, whose
    `cns/daemon.json` config/daemonset.yaml names), and whether this call changed it. An init
    container writes it before the container that uses it starts; by rename, so a runtime
    never loads half a profile, and the same bytes again touch nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SECCOMP_PROFILE_NAME
    return path, replace_file(path, shipped(SECCOMP_PROFILE))


def cni_files(*, bin_dir: Path, lib_dir: Path) -> list[Path]:
    """What `install_cni` creates: one launcher per plugin, and the plugin package's directory."""
    return [*(bin_dir / name for name in PLUGINS), lib_dir / "cni_plugin"]


def install_cni(
    *, bin_dir: Path, lib_dir: Path, python: str, root: Path = Path("/")
) -> dict[Path, bool]:
    """Copy the plugin package to `lib_dir` and write one launcher per plugin into `bin_dir`,
    both paths of the system below `root`. Returns each of `cni_files` (as seen from here) and
    whether this call changed it."""
    import cni_plugin

    package = Path(cni_plugin.__file__).parent
    *launchers, target = (under(root, path) for path in cni_files(bin_dir=bin_dir, lib_dir=lib_dir))
    target.mkdir(parents=True, exist_ok=True)
    changed = {target: False}
    for source in sorted(package.glob("*.py")):
        changed[target] |= replace_file(target / source.name, source.read_text())
    # Precompile for the plugin's interpreter: a read-only dir would otherwise recompile per pod.
    # Staging a root: its interpreter if it runs here, the paths recorded as the target's.
    compiler = under(root, Path(python))
    if not os.access(compiler, os.X_OK):
        compiler = Path(sys.executable)  # a pyc of another version is merely ignored
    strip = [] if root == Path("/") else ["-s", str(root), "-p", "/"]
    subprocess.run([str(compiler), "-m", "compileall", "-q", *strip, str(target)], check=True)
    under(root, bin_dir).mkdir(parents=True, exist_ok=True)
    for path, module in zip(launchers, PLUGINS.values(), strict=True):
        text = launcher(python=python, lib_dir=lib_dir, module=module)
        changed[path] = replace_file(path, text, mode=0o755)
    return changed


def conflist(*, name: str, socket_path: str, release_queue_dir: str, mtu: int) -> dict[str, Any]:
    """The node's network: cns-cni first, then the reference portmap for hostPort mappings."""
    return {
        "cniVersion": "1.0.0",
        "name": name,
        "plugins": [
            {
                "type": "cns-cni",
                # The runtime may pass the address a pod asks for (runtimeConfig.ips).
                "capabilities": {"ips": True},
                "socket": socket_path,
                "releaseQueueDir": release_queue_dir,
                "mtu": mtu,
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
        ],
    }


def write_conflist(conf_dir: Path, body: dict[str, Any]) -> tuple[Path, bool]:
    """The conflist in `conf_dir`, and whether this call changed it."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    path = conf_dir / CONFLIST
    return path, replace_file(path, json.dumps(body, indent=2) + "\n")


def _is_launcher(path: Path) -> bool:
    try:
        with path.open(errors="replace") as file:
            return LAUNCHER_MARK in file.read(4096)
    except OSError:
        return False


def _is_cns_conflist(path: Path) -> bool:
    try:
        body = json.loads(path.read_text())
        return bool(body["plugins"][0]["type"] == "cns-cni")
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return False


def remove_file(path: Path) -> None:
    """`path`, and the temporary file a killed write may have left beside it (that one even
    when `path` itself is gone: FileNotFoundError)."""
    with contextlib.suppress(FileNotFoundError):
        temporary(path).unlink()
    path.unlink()


def remove_conflist(conf_dir: Path) -> list[Path]:
    """The conflist in `conf_dir` if it is a cns network (another network's stays); first of
    an uninstall's steps, so that no runtime picks cns once its daemon stops."""
    path = conf_dir / CONFLIST
    if not _is_cns_conflist(path):
        return []
    remove_file(path)
    return [path]


def uninstall_cni(*, bin_dir: Path, lib_dir: Path, conf_dir: Path | None) -> list[Path]:
    """Remove what `install_cni` and `write_conflist` wrote, and only that: the launchers (a file
    of the same name that is not ours stays), the plugin package, the directories made for it once
    empty, and the conflist if it is a cns network (`remove_conflist`); with each file the
    temporary a killed install left. Idempotent: what is gone is skipped. Returns what it
    removed."""
    removed = [] if conf_dir is None else remove_conflist(conf_dir)
    for name in PLUGINS:
        path = bin_dir / name
        if _is_launcher(path):
            remove_file(path)
            removed.append(path)
    package = lib_dir / "cni_plugin"
    if package.is_dir():
        shutil.rmtree(package)
        removed.append(package)
    # `lib_dir` once empty, and BIN/../lib (install-cni's mkdir made it) when that is the layout.
    parents = [lib_dir, lib_dir.parent] if lib_dir == default_lib_dir(bin_dir) else [lib_dir]
    for directory in parents:
        try:
            directory.rmdir()
        except OSError:  # not empty (something else lives there), or gone
            break
        removed.append(directory)
    return removed


# The API server's statuses for a token it does not accept (the ServiceAccount or its token
# deleted) and for a token whose account may no longer read the DaemonSet (its RBAC deleted).
REJECTED = frozenset({401, 403})


def uninstall_verdict(status: int | None, deleting: bool) -> tuple[bool, str]:
    """Whether the preStop hook of a DaemonSet pod removes the node's CNI files, from what the
    API server said of the pod's DaemonSet: `status` of the GET (None: no answer) and whether
    the object has a deletionTimestamp. Returns (remove, why).

    A pod stops for an upgrade, a restart, an eviction, and for an uninstall; only the last one
    must take the files away. Telling them apart by the DaemonSet, not by timing: while it
    exists a new pod follows on this node, whose init container writes the files again, and
    removing them would leave the node without a network configuration in between (sandboxes
    fail, the node turns NotReady). `kubectl delete -k config/` deletes the ServiceAccount and
    RBAC before the DaemonSet (kustomize's order) and the DaemonSet with a background cascade
    (gone at once, its pods garbage-collected after): the pod then sees 401/403 or 404. With a
    foreground cascade the DaemonSet still exists, with a deletionTimestamp.

    No answer keeps the files: a roll needs them, and with the conflist in place the plugin
    still takes the DELs of the node's pods (it queues them for the daemon) where a runtime
    without one cannot tear a pod's network down. An uninstall during an API outage leaves the
    files, which `cns uninstall-cni` without the check removes."""
    if status == 200:
        if deleting:
            return True, "the DaemonSet is being deleted"
        return False, "the DaemonSet exists: a new pod follows on this node (upgrade or restart)"
    if status == 404:
        return True, "the DaemonSet is gone"
    if status in REJECTED:
        return True, f"the service account was refused ({status}): its account or RBAC is gone"
    if status is None:
        return False, "no answer from the API server: kept, as a roll needs"
    return False, f"the API server answered {status}: kept, as a roll needs"


async def ask_daemonset(namespace: str, name: str, *, timeout: float) -> tuple[int | None, bool]:
    """GET the DaemonSet with the pod's service account: (HTTP status or None when there is no
    answer within `timeout`, whether it has a deletionTimestamp). The preStop hook's time counts
    against the pod's grace period: the daemon's own drain comes after it."""
    import aiohttp
    from kubernetes_asyncio.client.exceptions import ApiException

    from cns.kube.client import CredentialsError, connect

    try:
        kube = await connect("")
    except CredentialsError:
        return None, False
    async with kube:
        try:
            found = await asyncio.wait_for(
                kube.apps.read_namespaced_daemon_set(name, namespace), timeout
            )
        except ApiException as exc:
            return int(exc.status), False
        except (OSError, TimeoutError, aiohttp.ClientError):
            return None, False
    return 200, found.metadata.deletion_timestamp is not None
