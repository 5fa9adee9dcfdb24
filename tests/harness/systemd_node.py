"""cns installed on a booted systemd machine (`nspawn`): its unit, its pods, its debug endpoint.

Shared by tests/e2e/test_systemd.py (the unit as shipped, installed by hand) and
tests/e2e/test_systemd_node_install.py (`cns install --systemd`). Pods and links carry the run's
tag; the standalone subnet is the test's own, and `host_leftovers` checks nothing outlived it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from cns.host.datapath import host_ifname
from tests.harness import REPO
from tests.harness.nspawn import VENV, Machine, booted, run
from tests.harness.ports import free_port

UNIT = "cns.service"
NETCONF = json.dumps({"cniVersion": "1.0.0", "name": "cns", "type": "cns-cni"})


def wait_for(what: str, condition: Callable[[], Any], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return result


class Node:
    """The booted machine with cns installed: its unit, its pods, its debug endpoint."""

    def __init__(
        self,
        machine: Machine,
        tag: str,
        debug_port: int,
        state: Path,
        pods: dict[str, str],
        subnet: str,
    ) -> None:
        self.machine = machine
        self.tag = tag
        self.subnet = subnet  # of the standalone allocator: this run's own
        self.netconf = NETCONF  # what the runtime passes cns-cni
        self.debug_url = f"http://127.0.0.1:{debug_port}"
        self.state = state  # /var/lib/cns, as mounted on the host
        self.pods = pods  # pod -> netns path
        self.sleepers: list[str] = []

    def configure(self, **overrides: Any) -> None:
        config = {
            "nodeName": self.tag,
            "debugListen": self.debug_url.removeprefix("http://"),
            "logFormat": "json",
            "standalone": {"subnet": self.subnet, "allocationLatencyMs": 20},
            **overrides,
        }
        self.machine.path("/etc/cns/cns.yaml").write_text(yaml.safe_dump(config))

    def systemctl(self, *args: str) -> str:
        return self.machine.run("systemctl", *args).stdout

    def main_pid(self) -> int:
        return int(self.machine.show(UNIT, "MainPID"))

    def active(self) -> bool:
        return self.machine.show(UNIT, "ActiveState") == "active"

    def restarted(self, old_pid: int) -> Callable[[], bool]:
        return lambda: self.active() and self.main_pid() not in (0, old_pid)

    def ensure_started(self) -> None:
        """The daemon serving with the standard config, whatever an earlier test left."""
        if not self.active():
            self.systemctl("stop", UNIT)  # e.g. still activating with another config
            self.configure()
            self.systemctl("start", UNIT)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.debug_url}{path}", timeout=5) as response:
            return json.load(response)

    def owners(self) -> dict[str, str]:
        """Container ID -> IP for every assigned IP."""
        return {
            ip["owner"]["containerID"]: ip["address"]
            for ip in self.get("/debug/ips")["ips"]
            if ip["owner"]
        }

    def cni_env(self, command: str, pod: str) -> dict[str, str]:
        return {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": f"{self.tag}-{pod}",
            "CNI_NETNS": self.pods[pod],
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"K8S_POD_NAME={pod};K8S_POD_NAMESPACE=systemd-test",
        }

    def cni(self, command: str, pod: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = self.cni_env(command, pod)
        return self.machine.run("/opt/cni/bin/cns-cni", env=env, input=self.netconf, check=check)

    def netns(self, pod: str, via_proc: bool = False) -> str:
        """A pod network namespace: /var/run/netns/NAME, or /proc/PID/ns/net of a process
        holding one (the path runtimes such as cri-dockerd pass)."""
        if via_proc:
            self.machine.run("sh", "-c", f"unshare -n sleep 3600 >/dev/null 2>&1 & echo $! > "
                             f"/run/{self.tag}-{pod}.pid")  # fmt: skip
            pid = self.machine.path(f"/run/{self.tag}-{pod}.pid").read_text().strip()
            self.sleepers.append(pid)
            self.pods[pod] = f"/proc/{pid}/ns/net"
        else:
            self.machine.run("ip", "netns", "add", f"{self.tag}-{pod}")
            self.pods[pod] = f"/var/run/netns/{self.tag}-{pod}"
        return self.pods[pod]

    def add(self, pod: str, via_proc: bool = False) -> str:
        """A pod through the real plugin; returns its IP."""
        self.netns(pod, via_proc)
        result = json.loads(self.cni("ADD", pod).stdout)
        return str(result["ips"][0]["address"].removesuffix("/32"))

    def in_pod(self, pod: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.machine.run("nsenter", f"--net={self.pods[pod]}", *args, check=False)

    def cleanup(self) -> None:
        """DEL every pod (the daemon may be down: DEL is then queued), drop the namespaces."""
        for pod, netns in self.pods.items():
            self.cni("DEL", pod, check=False)
            if netns.startswith("/var/run/netns/"):
                self.machine.run("ip", "netns", "del", Path(netns).name, check=False)
        for pid in self.sleepers:
            self.machine.kill(pid, "TERM", check=False)


def install_wheel(machine: Machine, workdir: Path) -> None:
    """pip-install this checkout into the machine's venv (/opt/cns), as an operator would on a
    node: a wheel built here, installed there without an index."""
    source = workdir / "src"
    for name in ("cns", "cni_plugin", "pyproject.toml", "README.md"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
         "-w", workdir / "wheel", source])  # fmt: skip
    (wheel,) = (workdir / "wheel").glob("cns-*.whl")
    shutil.copy(wheel, machine.path(f"/root/{wheel.name}"))
    machine.run(f"{VENV}/bin/pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                "--no-index", f"/root/{wheel.name}")  # fmt: skip


def host_leftovers(tag: str, pods: dict[str, str], subnet: str) -> list[str]:
    """This run's host veths and pod routes, which must not outlive the pods; removed if found."""
    found = []
    for pod in pods:
        link = host_ifname(f"{tag}-{pod}", "eth0")
        if subprocess.run(["ip", "link", "del", link], capture_output=True).returncode == 0:
            found.append(link)
    routes = subprocess.run(["ip", "-4", "route", "show", "root", subnet], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    if routes:
        found.append(routes)
        subprocess.run(["ip", "-4", "route", "flush", "root", subnet], capture_output=True)
    return found


@contextlib.contextmanager
def node_on_machine(
    request: pytest.FixtureRequest,
    *,
    tag: str,
    subnet: str,
    workdir: Path,
    install: Callable[[Machine, Path], None],
    binds: Sequence[str] = (),
    state: Path | None = None,
) -> Iterator[Node]:
    """A booted machine with cns put on it by `install`, as a `Node` whose pods are removed
    afterwards; fails if a veth or route of the run outlived them. `state`: /var/lib/cns as
    the host sees it, if bound from the host (else the machine's own)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    label = request.module.__name__.rsplit(".", 1)[-1]

    def progress(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n[{label}] {message}", file=sys.stderr, flush=True)

    pods: dict[str, str] = {}
    try:
        with booted(workdir, f"cns-{tag}", binds, progress) as machine:
            started = time.monotonic()
            install(machine, workdir)
            progress(f"cns installed in {time.monotonic() - started:.0f} s")
            here = state or machine.path("/var/lib/cns")
            node = Node(machine, tag, free_port(), here, pods, subnet)
            try:
                yield node
            finally:
                node.cleanup()
                with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                    print(machine.journal(UNIT)[-20000:])  # shown if a test failed
    finally:
        leftovers = host_leftovers(tag, pods, subnet)
    assert not leftovers, f"left on the host: {leftovers}"
