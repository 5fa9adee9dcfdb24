"""systemd/cns.service under a real systemd (a Debian root booted with systemd-nspawn).

The unit is installed exactly as the repository ships it, with cns pip-installed so that
/usr/local/bin/cns exists, and `cns-cni` installed with `cns install-cni`. Proven here:

1. READY=1 comes only once the socket answers; a daemon that cannot get ready stays
   "activating", and the watchdog, not yet armed, does not kill it;
2. a hung event loop is restarted by the watchdog: a stopped process (SIGSTOP) and a loop really
   stuck in a system call (the state file system frozen with fsfreeze while a commit is under
   way: other threads run on, so a heartbeat from a thread would not notice);
3. `kill -9` is followed by a restart (Restart=always) that keeps every assignment;
4. `cns-cni` pods get working interfaces under the sandbox.

The container shares the host's network namespace: pods and links carry this run's tag, the
pod subnet is 10.248.0.0/24, and everything is removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cns.host.datapath import host_ifname
from tests.harness import REPO
from tests.harness.nspawn import Machine, require_nspawn, run
from tests.harness.ports import free_port
from tests.harness.systemd_node import (
    NETCONF,
    UNIT,
    Node,
    install_wheel,
    node_on_machine,
    wait_for,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

SUBNET = "10.248.0.0/24"
CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21}


def install_cns(machine: Machine, workdir: Path) -> None:
    """cns pip-installed with /usr/local/bin/cns, the unit copied in by hand, as shipped."""
    install_wheel(machine, workdir)
    machine.run("ln", "-s", "/opt/cns/bin/cns", "/usr/local/bin/cns")
    machine.run("cns", "install-cni", "--bin-dir", "/opt/cni/bin")
    shutil.copy(REPO / "systemd" / "cns.service", machine.path("/etc/systemd/system/cns.service"))
    machine.path("/etc/cns").mkdir()
    machine.run("systemctl", "daemon-reload")


@contextlib.contextmanager
def freezable_state_dir(workdir: Path) -> Iterator[Path]:
    """An ext4 file system on a loop device for /var/lib/cns: fsfreeze can stop its writes."""
    image, mount = workdir / "state.img", workdir / "state"
    mount.mkdir()
    with image.open("wb") as file:
        file.truncate(64 << 20)
    run(["mkfs.ext4", "-q", "-F", image])
    run(["mount", "-o", "loop", image, mount])
    try:
        yield mount
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", mount], capture_output=True)
        run(["umount", mount])  # a loop mount frees its loop device
        image.unlink()


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    require_nspawn("mkfs.ext4", "fsfreeze")
    with (
        tempfile.TemporaryDirectory(prefix="cns-systemd-") as tmp,
        freezable_state_dir(Path(tmp)) as state,
        node_on_machine(request, tag=f"sd{os.getpid() % 100000}", subnet=SUBNET,
                        workdir=Path(tmp), install=install_cns,
                        binds=[f"--bind={state}:/var/lib/cns"], state=state) as node,
    ):  # fmt: skip
        yield node


def watchdog_seconds(node: Node, pid: int) -> float:
    """The watchdog timeout systemd gave the process, from its environment."""
    environ = node.machine.run("cat", f"/proc/{pid}/environ").stdout.split("\0")
    (usec,) = [entry.split("=", 1)[1] for entry in environ if entry.startswith("WATCHDOG_USEC=")]
    return int(usec) / 1_000_000


def test_ready_only_once_the_socket_answers(node: Node) -> None:
    machine = node.machine
    if node.active():
        node.systemctl("stop", UNIT)
    # Cannot get ready: Kubernetes mode with no API server, so no network container (ever).
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "none", "cluster": {"server": f"https://127.0.0.1:{free_port()}",
                                                  "insecure-skip-tls-verify": True}}],
        "users": [{"name": "cns", "user": {"token": "no-such-token"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "cns"}}],
        "current-context": "none",
    }  # fmt: skip
    machine.path("/etc/cns/kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    node.configure(
        mode="kubernetes",
        kubernetes={"kubeconfig": "/etc/cns/kubeconfig"},
        stateDir="/var/lib/cns/not-ready",
        socketPath="/run/cns/not-ready.sock",
    )
    cursor = machine.cursor()
    node.systemctl("start", "--no-block", UNIT)
    pid = wait_for("the daemon's process", node.main_pid)

    def not_ready() -> bool:
        try:
            node.get("/readyz")
        except urllib.error.HTTPError as exc:
            return exc.code == 503
        except OSError:
            return False
        return False

    wait_for("the debug endpoint to say not ready", not_ready)
    # Past the watchdog timeout: no heartbeat is due before READY=1, and none is missed.
    deadline = time.monotonic() + watchdog_seconds(node, pid) + 5
    while time.monotonic() < deadline:
        assert machine.show(UNIT, "ActiveState") == "activating"
        assert node.main_pid() == pid
        time.sleep(1)
    assert machine.show(UNIT, "SubState") == "start"
    assert not machine.path("/run/cns/not-ready.sock").exists()
    assert "Watchdog timeout" not in machine.journal(UNIT, after=cursor)
    node.systemctl("stop", UNIT)
    shutil.rmtree(node.state / "not-ready")

    # `systemctl start` returns once READY=1 arrived: at that moment the socket serves an ADD.
    node.configure()
    node.netns("ready")
    started = machine.run(
        "sh", "-c", f"systemctl start {UNIT} && systemctl is-active {UNIT} && exec "
        "/opt/cni/bin/cns-cni", env=node.cni_env("ADD", "ready"), input=NETCONF, check=False,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    active, result = started.stdout.split("\n", 1)
    assert active == "active"
    assert json.loads(result)["ips"][0]["address"].startswith("10.248.0.")


def test_a_hung_event_loop_is_restarted_by_the_watchdog(node: Node) -> None:
    machine = node.machine
    node.ensure_started()
    node.add("before-hang")
    owners = node.owners()

    # A stopped process: no thread of it runs.
    pid = node.main_pid()
    cursor = machine.cursor()
    machine.kill(pid, "STOP")
    try:
        wait_for("the watchdog restart after SIGSTOP", node.restarted(pid))
    finally:
        machine.kill(pid, "CONT", check=False)  # if no watchdog killed it, it serves on
    journal = machine.journal(UNIT, after=cursor)
    assert "Watchdog timeout" in journal and f"Killing process {pid} (cns) with signal SIGABRT" in (
        journal
    )
    assert "Failed with result 'watchdog'" in journal
    assert node.owners() == owners
    node.add("after-stop")
    owners = node.owners()

    # A loop stuck in a system call: the state file system is frozen while an ADD commits.
    # The daemon's other threads keep running; only the loop is stuck in the commit's write.
    pid = node.main_pid()
    node.netns("frozen")
    cursor = machine.cursor()
    run(["fsfreeze", "--freeze", node.state])
    try:
        stuck = machine.spawn(
            "/opt/cni/bin/cns-cni", env=node.cni_env("ADD", "frozen"), input=NETCONF
        )
        wait_for("systemd's watchdog timeout", lambda: "Watchdog timeout" in machine.journal(
            UNIT, after=cursor))  # fmt: skip
    finally:
        run(["fsfreeze", "--unfreeze", node.state])
    wait_for("the watchdog restart of the stuck loop", node.restarted(pid))
    code = stuck.wait(timeout=60)
    assert stuck.stdout is not None
    assert code != 0, f"a stuck daemon acknowledged an ADD: {stuck.stdout.read()}"
    journal = machine.journal(UNIT, after=cursor)
    assert f"Killing process {pid} (cns) with signal SIGABRT" in journal
    # faulthandler's stack of the loop thread: it was in the state commit
    assert "cns/state/store.py" in journal.split("Fatal Python error: Aborted", 1)[1]
    assert {k: v for k, v in node.owners().items() if not k.endswith("-frozen")} == owners
    assert node.cni("ADD", "frozen").returncode == 0  # serving again


def test_kill_9_is_followed_by_a_restart_that_keeps_every_assignment(node: Node) -> None:
    machine = node.machine
    node.ensure_started()
    for pod in ("k1", "k2", "k3"):
        node.add(pod)
    owners = node.owners()
    assert len(owners) >= 3
    pid = node.main_pid()
    cursor = machine.cursor()
    machine.kill(pid, "KILL")
    wait_for("the restart after kill -9", node.restarted(pid))
    journal = machine.journal(UNIT, after=cursor)
    assert "Main process exited, code=killed, status=9/KILL" in journal
    assert "Scheduled restart job" in journal
    assert node.owners() == owners
    ping = node.in_pod("k1", "ping", "-c1", "-W2", owners[f"{node.tag}-k2"])
    assert ping.returncode == 0, ping.stdout + ping.stderr


def test_cns_cni_pods_get_working_interfaces_under_the_sandbox(node: Node) -> None:
    machine = node.machine
    node.ensure_started()
    pid = node.main_pid()
    status = machine.path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert int(fields["CapBnd"], 16) == sum(1 << bit for bit in CAPABILITIES.values())
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
    mounts = machine.path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    proc_sys = [line.split()[5] for line in mounts if line.split()[4] == "/proc/sys"]
    assert proc_sys[-1].split(",")[0] == "ro"  # ProtectKernelTunables=: the top mount is ro

    a = node.add("a")
    b = node.add("b")
    c = node.add("c", via_proc=True)  # netns given as /proc/<pid>/ns/net
    for pod, address in (("a", a), ("b", b), ("c", c)):
        eth0 = node.in_pod(pod, "ip", "-4", "-o", "addr", "show", "eth0").stdout
        assert f"{address}/32" in eth0, eth0
        routes = node.in_pod(pod, "ip", "-4", "route").stdout
        assert "default via 169.254.1.1 dev eth0" in routes, routes
        link = host_ifname(f"{node.tag}-{pod}", "eth0")
        assert Path(f"/proc/sys/net/ipv4/conf/{link}/proxy_arp").read_text().strip() == "1"
    for pod, target in (("a", b), ("b", c), ("c", a)):
        ping = node.in_pod(pod, "ping", "-c1", "-W2", target)
        assert ping.returncode == 0, f"{pod} -> {target}: {ping.stdout}{ping.stderr}"
    ping = machine.run("ping", "-c1", "-W2", a, check=False)  # the host reaches the pod
    assert ping.returncode == 0, ping.stdout + ping.stderr

    node.cni("DEL", "c")
    link = host_ifname(f"{node.tag}-c", "eth0")
    assert subprocess.run(["ip", "link", "show", link], capture_output=True).returncode != 0
    assert c not in node.owners().values()
