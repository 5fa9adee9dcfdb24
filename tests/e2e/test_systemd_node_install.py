"""`cns install --systemd` on a node run by a real systemd (a Debian root booted with
systemd-nspawn, tests/harness/nspawn.py), as an operator runs it: cns pip-installed into a venv,
then that venv's `cns install --systemd`, nothing copied in by hand.

Proven, in the order an operator lives it: the install starts the service (active: READY=1
came) with the unit, the plugins and the conflist in place, and a pod ADD through the installed
`cns-cni` with the installed conflist gets a working interface; a second run changes nothing
(no file, no reload, no restart); a unit that differs is replaced and the running daemon
restarted with it; uninstall leaves no unit, plugin or conflist behind and keeps the state and
the operator's config.

The container shares the host's network namespace: pods and links carry this run's tag, the
pod subnet is 10.249.0.0/24 (the operator's config, written before the install), and
everything is removed at the end.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.nspawn import VENV, Machine, require_nspawn
from tests.harness.systemd_node import UNIT, Node, install_wheel, node_on_machine

pytestmark = [pytest.mark.root, pytest.mark.slow]

SUBNET = "10.249.0.0/24"
CNS = f"{VENV}/bin/cns"
INSTALLED = ("/etc/systemd/system/cns.service", "/opt/cni/bin/cns-cni", "/opt/cni/bin/cns-ipam",
             "/opt/cni/lib/cns/cni_plugin", "/etc/cni/net.d/10-cns.conflist")  # fmt: skip


def install_venv(machine: Machine, workdir: Path) -> None:
    """cns pip-installed into /opt/cns and an operator's config: no unit, plugin or conflist."""
    install_wheel(machine, workdir)
    machine.path("/etc/cns").mkdir()


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    require_nspawn()
    with (
        tempfile.TemporaryDirectory(prefix="cns-node-install-") as tmp,
        node_on_machine(request, tag=f"si{os.getpid() % 100000}", subnet=SUBNET,
                        workdir=Path(tmp), install=install_venv) as node,
    ):  # fmt: skip
        node.configure()
        yield node


def cns_install(node: Node, *args: str) -> list[str]:
    """The operator's command, timed; its output lines."""
    started = time.monotonic()
    done = node.machine.run(CNS, "install", "--systemd", *args, check=False, timeout=300)
    print(f"cns install --systemd {' '.join(args)}: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_install_run_again_replace_the_unit_and_uninstall(node: Node) -> None:
    machine = node.machine
    config = machine.path("/etc/cns/cns.yaml").read_text()

    # The install: every file, the service enabled and active (Type=notify: READY=1 came).
    lines = cns_install(node)
    for path in INSTALLED:
        assert machine.path(path).exists(), path
    assert "kept /etc/cns/cns.yaml: an operator's config is never overwritten" in "\n".join(lines)
    assert machine.path("/etc/cns/cns.yaml").read_text() == config
    assert node.systemctl("is-enabled", UNIT).strip() == "enabled"
    assert node.systemctl("is-active", UNIT).strip() == "active"
    assert machine.show(UNIT, "ExecStart").startswith(f"{{ path={CNS} ; argv[]={CNS} run")
    assert lines[-1] == "installed /etc/cni/net.d/10-cns.conflist"  # last: once cns serves

    # A pod through the installed plugin with the installed conflist, as a runtime runs it.
    conflist = json.loads(machine.path("/etc/cni/net.d/10-cns.conflist").read_text())
    node.netconf = json.dumps({"cniVersion": conflist["cniVersion"], "name": conflist["name"],
                               **conflist["plugins"][0]})  # fmt: skip
    address = node.add("a")
    assert address in node.in_pod("a", "ip", "-4", "-o", "addr", "show", "eth0").stdout
    ping = machine.run("ping", "-c1", "-W2", address, check=False)  # the host reaches the pod
    assert ping.returncode == 0, ping.stdout + ping.stderr
    version = machine.run("/opt/cni/bin/cns-ipam", env={"CNI_COMMAND": "VERSION"}, input="")
    assert "1.0.0" in json.loads(version.stdout)["supportedVersions"]

    # Again: nothing written, nothing reloaded, the daemon not restarted.
    pid = node.main_pid()
    cursor = machine.cursor()
    again = cns_install(node)

    no_op = ("unchanged ", "kept /etc/cns/cns.yaml", f"{UNIT} is active")
    assert [line for line in again if not line.startswith(no_op)] == [], again
    assert node.main_pid() == pid
    assert "Reloading" not in machine.run("journalctl", "-q", "--no-pager",
                                          f"--after-cursor={cursor}").stdout  # fmt: skip

    # Killed after the unit's rename, before the reload: systemd still runs the daemon under
    # the unit it loaded; the next run finds the file as it should be, and reloads, restarts.
    unit = machine.path("/etc/systemd/system/cns.service")
    rendered = unit.read_text()
    unit.write_text(rendered.replace("RestartSec=2", "RestartSec=5"))
    machine.run("systemctl", "daemon-reload")
    unit.write_text(rendered)
    assert machine.show(UNIT, "NeedDaemonReload") == "yes"
    lines = cns_install(node)
    assert any(line.endswith("systemctl daemon-reload") for line in lines), lines
    assert machine.show(UNIT, "NeedDaemonReload") == "no"
    assert machine.show(UNIT, "RestartUSec") == "2s"
    assert node.main_pid() not in (0, pid) and node.active()
    pid = node.main_pid()

    # A unit that differs (an older cns's, an operator's edit): replaced, the daemon restarted.
    unit.write_text(unit.read_text().replace("RestartSec=2", "RestartSec=5"))
    machine.run("systemctl", "daemon-reload")
    cursor = machine.cursor()
    lines = cns_install(node)
    assert "Reloading" in machine.run("journalctl", "-q", "--no-pager",
                                      f"--after-cursor={cursor}").stdout  # fmt: skip
    assert any(line.startswith("replaced /etc/systemd/system/cns.service") for line in lines)
    assert "RestartSec=2" in unit.read_text()
    assert node.main_pid() not in (0, pid) and node.active()
    assert node.owners()[f"{node.tag}-a"] == address  # the restart kept the assignment

    # Uninstall: the pods go first (their DELs need the daemon), then everything install wrote.
    node.cleanup()
    lines = cns_install(node, "--uninstall")
    for path in INSTALLED:
        assert not machine.path(path).exists(), path
    assert machine.show(UNIT, "LoadState") == "not-found"
    assert machine.run("systemctl", "is-active", UNIT, check=False).stdout.strip() == "inactive"
    assert not machine.path("/etc/systemd/system/multi-user.target.wants/cns.service").exists()
    assert machine.path("/var/lib/cns/state.db").exists()
    assert machine.path("/etc/cns/cns.yaml").read_text() == config
    assert "kept /var/lib/cns: the state" in "\n".join(lines)
    assert "kept /etc/cns/cns.yaml: it is not the default" in "\n".join(lines)
