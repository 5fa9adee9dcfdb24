"""The DaemonSet's cns container runs under config/seccomp-daemon.json (a Localhost profile that
its init container writes into the kubelet's seccomp directory): containerd's RuntimeDefault as it
is for a container without CAP_SYS_ADMIN, plus setns(2), the one call the daemon holds that
capability for. Pinned here: what it refuses although the capability would allow it, what the
daemon needs it to allow, and how `cns install-seccomp-profile` writes it. The running container
is probed in tests/e2e/test_install_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness import REPO

PROFILE = REPO / "config" / "seccomp-daemon.json"
CLONE_NEWNS = 0x00020000
# Every CLONE_NEW* flag: clone(2) with any of them set creates a namespace.
CLONE_NEW_ANY = 0x7E020000

# What CAP_SYS_ADMIN admits under RuntimeDefault and the daemon never calls: mounting (the old
# and the new mount API), the host's names, new namespaces, BPF, perf, the kernel log, quotas,
# file handles; and what RuntimeDefault refuses anyway (pivot_root, modules, reboot, chroot).
REFUSED = {
    "mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "sethostname", "setdomainname", "unshare", "bpf",
    "perf_event_open", "syslog", "fanotify_init", "lookup_dcookie", "quotactl", "quotactl_fd",
    "name_to_handle_at", "open_by_handle_at", "init_module", "finit_module", "delete_module",
    "kexec_load", "reboot", "chroot", "ptrace", "process_vm_writev", "acct", "swapon",
}  # fmt: skip
# What the daemon calls: setns into a pod's network namespace and the ioctl that checks its type,
# netlink and unix sockets, SQLite's files and locks, the event loop, threads, and the hooks'
# and probes' processes (fork, execve).
USED = {
    "setns", "ioctl", "socket", "bind", "connect", "listen", "accept4", "sendto", "recvfrom",
    "sendmsg", "recvmsg", "setsockopt", "getsockopt", "getsockname", "openat", "close", "read",
    "write", "pread64", "pwrite64", "lseek", "fstat", "newfstatat", "statx", "fsync",
    "fdatasync", "fcntl", "flock", "ftruncate", "rename", "renameat2", "unlink", "unlinkat",
    "mkdir", "getdents64", "mmap", "munmap", "mprotect", "brk", "futex", "epoll_create1",
    "epoll_ctl", "epoll_wait", "epoll_pwait", "eventfd2", "pipe2", "rt_sigaction",
    "rt_sigprocmask", "rt_sigreturn", "clock_gettime", "getrandom", "fork", "vfork", "execve",
    "wait4", "exit_group", "set_robust_list", "rseq", "prlimit64", "getpid", "kill", "uname",
}  # fmt: skip


def _load() -> dict[str, Any]:
    profile: dict[str, Any] = json.loads(PROFILE.read_text())
    return profile


def _rules(profile: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [rule for rule in profile["syscalls"] if name in rule["names"]]


def _allowed_always(profile: dict[str, Any], name: str) -> bool:
    return any(r["action"] == "SCMP_ACT_ALLOW" and not r.get("args") for r in _rules(profile, name))


def test_the_profile_is_an_oci_filter_that_refuses_what_it_does_not_name() -> None:
    profile = _load()
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"  # EPERM, as RuntimeDefault
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"])
    actions = {rule["action"] for rule in profile["syscalls"]}
    assert actions == {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}
    for rule in profile["syscalls"]:
        assert set(rule) <= {"names", "action", "args", "errnoRet"}, rule
        assert rule["names"] and all(isinstance(name, str) for name in rule["names"]), rule


def test_it_refuses_the_mount_and_host_name_calls_cap_sys_admin_would_allow() -> None:
    profile = _load()
    named = {name for rule in profile["syscalls"] for name in rule["names"]}
    # clone3 is named only to fail with ENOSYS (glibc then uses clone), as without SYS_ADMIN.
    assert REFUSED & named == set()
    (clone3,) = _rules(profile, "clone3")
    assert clone3 == {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}


def test_clone_is_allowed_for_threads_and_processes_but_not_for_a_new_namespace() -> None:
    (clone,) = _rules(_load(), "clone")
    (arg,) = clone["args"]
    assert arg == {"index": 0, "value": CLONE_NEW_ANY, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    thread_flags = 0x003D0F00  # CPython's threads, by glibc's pthread_create
    assert thread_flags & arg["value"] == arg["valueTwo"]
    assert CLONE_NEWNS & arg["value"] != arg["valueTwo"]


def test_it_allows_every_call_the_daemon_makes() -> None:
    profile = _load()
    assert {name for name in USED if not _allowed_always(profile, name)} == set()


def test_install_seccomp_profile_writes_it_by_rename_and_a_rerun_touches_nothing(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "seccomp" / "cns"
    directory.mkdir(parents=True)
    # What a run killed before its rename leaves: the next run writes over it.
    (directory / ".daemon.json.tmp").write_text('{"defaultAction": "SCMP_ACT_')
    command = [
        sys.executable,
        "-m",
        "cns.commands.cli",
        "install-seccomp-profile",
        "--dir",
        str(directory),
    ]
    said = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    profile = directory / "daemon.json"
    assert said == f"installed {profile}\n"
    assert os.listdir(directory) == ["daemon.json"]
    assert profile.read_bytes() == PROFILE.read_bytes()
    assert profile.stat().st_mode & 0o777 == 0o644
    before = profile.stat()
    subprocess.run(command, check=True, capture_output=True)
    after = profile.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
