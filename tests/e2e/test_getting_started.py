"""What the README promises a newcomer: the install scripts install what the quick tour runs, the
tour works as written and leaves the host as it was, `cns status` finds a daemon that is not on
the default port, and the Kubernetes build says what it is doing while it takes minutes.

(`make cluster-up` and the walkthrough of docs/kubernetes.md are run in tests/e2e/test_node_e2e.py.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.requirements import is_root

REFERENCE_PLUGINS = Path("/usr/lib/cni")


def readme_section(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def shell_blocks(markdown: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", markdown, re.S)


def commands_run(script: str) -> set[str]:
    """The programs a shell snippet runs: first words of its commands (after `VAR=value`
    assignments), and what `ip netns exec NAME` runs. Heredoc bodies and builtins are skipped."""
    found: set[str] = set()
    in_heredoc = ""
    for line in re.sub(r"\\\n", " ", script).splitlines():
        if in_heredoc:
            in_heredoc = "" if line.strip() == in_heredoc else in_heredoc
            continue
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        in_heredoc = heredoc.group(1) if heredoc else ""
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in (";", "&&", "||", "|"):
                command.append(token)
                continue
            while command and re.match(r"^[A-Za-z_]\w*=", command[0]):
                command.pop(0)
            if command and command[0] not in ("export", "cd", "source", "."):
                found.add(command[0])
                if command[:3] == ["ip", "netns", "exec"] and len(command) > 4:
                    found.add(command[4])
            command = []
    return found


def owning_packages(program: str) -> set[str]:
    """Debian packages that ship `program` (a path, or a name looked up as */bin/NAME, which
    also finds it across the /bin -> /usr/bin merge)."""
    pattern = program if program.startswith("/") else f"*bin/{program}"
    listing = subprocess.run(["dpkg", "-S", pattern], capture_output=True, text=True).stdout
    owners = set()
    for line in listing.splitlines():
        packages, path = line.split(": ", 1)
        if program.startswith("/") or path.endswith(f"bin/{program}"):
            owners.update(p.strip().split(":")[0] for p in packages.split(","))
    return owners


def is_essential(package: str) -> bool:
    query = ["dpkg-query", "-W", "-f=${Essential}", package]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip() == "yes"


def setup_array(name: str) -> list[str]:
    script = f'source scripts/setup.sh; printf "%s\\n" "${{{name}[@]}}"'
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)
    return result.stdout.split()


def test_commands_run_reads_a_snippet_like_a_shell() -> None:
    snippet = (
        "A=1 B=2 /usr/lib/cni/bridge < x  # comment ping\n"
        "cat > f <<'EOF'\nnot-a-command here\nEOF\n"
        "ip netns exec pod1 ping -c1 10.0.0.1; export X=1 \\\n  Y=2\n.venv/bin/cns status\n"
        'A="x;y" ip link del z && rm -r f | nsenter --net=/proc/1/ns/net ls\n'
    )
    expected = {"/usr/lib/cni/bridge", "cat", "ip", "ping", ".venv/bin/cns", "rm", "nsenter"}
    assert commands_run(snippet) == expected


def test_run_sh_installs_every_program_the_quick_tour_runs() -> None:
    """A fresh Debian has neither `ping` nor the reference plugins; the tour used them anyway."""
    if not Path("/usr/bin/dpkg").exists():
        pytest.skip("needs a Debian system (dpkg) to know which package ships a program")
    installed = set(setup_array("RUN_PACKAGES"))
    assert "python3-venv" in installed
    assert installed <= set(setup_array("TEST_PACKAGES"))
    run_sh = (REPO / "scripts" / "run.sh").read_text()
    assert 'install_system_packages "${RUN_PACKAGES[@]}"' in run_sh
    programs = set()
    for block in shell_blocks(readme_section("## A quick tour")):
        programs |= commands_run(block)
    programs -= {".venv/bin/cns"}  # this repository's own
    assert {"ip", "ping", "/usr/lib/cni/bridge"} <= programs
    for program in sorted(programs):
        owners = owning_packages(program)
        assert owners, f"{program}: no installed package ships it"
        assert owners & installed or any(map(is_essential, owners)), (program, owners)


@pytest.fixture
def host_netns() -> Any:
    """A network namespace standing in for the host: links and sysctls stay in it."""
    if not (is_root() and (REFERENCE_PLUGINS / "bridge").exists()):
        why = "needs root and containernetworking-plugins (/usr/lib/cni/bridge)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must provide both")
        pytest.skip(why)
    name = f"tourhost-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_netns(netns: str, *command: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *command], check=True, capture_output=True, text=True
    ).stdout


def test_quick_tour_runs_as_written_and_puts_ip_forward_back(
    make_daemon: Any, tmp_path: Path, host_netns: str
) -> None:
    """The README's tour (attach, ping, `cns status`, clean up) against a real daemon, inside a
    namespace standing in for the host whose forwarding starts off: the clean-up must turn off
    again what `bridge` with isGateway turned on, and leave no link behind."""
    daemon = make_daemon()
    tag = uuid.uuid4().hex[:6]
    pod, bridge = f"tourpod-{tag}", f"tour{tag}"
    script = "\n".join(shell_blocks(readme_section("## A quick tour")))
    ipam = (
        f'"ipam": {{"type": "cns-ipam", "socket": "{daemon.socket}", '
        f'"releaseQueueDir": "{daemon.state_dir / "release-queue"}"}}'
    )
    for old, new in (
        ("/tmp/", f"{tmp_path}/"),
        ('"ipam": {"type": "cns-ipam"}', ipam),  # the test daemon, not /run/cns
        ("/opt/cni", str(tmp_path / "opt" / "cni")),
        ("pod1", pod),
        ('"cns0"', f'"{bridge}"'),
        ("cns0", bridge),
        # The daemon's debug port is in the test's own network namespace, not the tour's.
        (".venv/bin/cns status", f"nsenter --net=/proc/{os.getpid()}/ns/net .venv/bin/cns status"),
        (
            ".venv/bin/cns",
            f"{shlex.quote(sys.executable)} -m cns.commands.cli",
        ),  # the code under test
    ):
        assert old in script, f"the README's tour no longer has {old!r}"
        script = script.replace(old, new)
    (tmp_path / "tour.sh").write_text(f"cd {shlex.quote(str(REPO))}\n{script}")
    forwarding = "/proc/sys/net/ipv4/ip_forward"
    in_netns(host_netns, "sh", "-c", f"echo 0 > {forwarding}")
    env = {**os.environ, "CNS_DEBUG_URL": daemon.debug_url}
    try:
        tour = subprocess.run(
            ["ip", "netns", "exec", host_netns, "bash", "-e", str(tmp_path / "tour.sh")],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        output = tour.stdout + tour.stderr
        assert tour.returncode == 0, output
        assert '"address": "10.240.0.3/22"' in tour.stdout, output
        assert "1 packets transmitted, 1 received" in tour.stdout, output
        assert re.search(r"^10\.240\.0\.3 +Assigned +demo1 +eth0 +default/demo$", tour.stdout, re.M)
        assert in_netns(host_netns, "cat", forwarding).strip() == "0"
        assert len(in_netns(host_netns, "ip", "-o", "link").splitlines()) == 1  # lo only
        assert pod not in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
        assert daemon.get("/debug/pool")["ips"]["Assigned"] == 0
        assert not (tmp_path / "opt" / "cni" / "bin" / "cns-ipam").exists()
    finally:
        subprocess.run(["ip", "netns", "del", pod], capture_output=True, check=False)


def cns_status(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cns.commands.cli", "status", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)


def test_cns_status_finds_the_daemon_through_cns_debug_url(make_daemon: Any) -> None:
    """`make cluster-up`'s daemon listens on a free port: `source DIR/env` sets CNS_DEBUG_URL."""
    daemon = make_daemon()
    env = {k: v for k, v in os.environ.items() if k != "CNS_DEBUG_URL"}
    found = cns_status("--json", env={**env, "CNS_DEBUG_URL": daemon.debug_url})
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["requestedIPCount"] == 15
    # --debug-url wins over the environment.
    flag = cns_status("--json", "--debug-url", daemon.debug_url, env={**env, "CNS_DEBUG_URL": "x"})
    assert flag.returncode == 0, flag.stderr
    # Nothing listening: exit 1, the URL it tried and how to point it elsewhere.
    refused = cns_status(env={**env, "CNS_DEBUG_URL": "http://127.0.0.1:1"})
    assert refused.returncode == 1
    assert "cannot read http://127.0.0.1:1/debug/pool" in refused.stderr
    assert "--debug-url" in refused.stderr and "CNS_DEBUG_URL" in refused.stderr


def test_debug_url_has_help_text() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "status", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    help_line = re.search(r"--debug-url URL\s+(.*?)\n\s+--ips", result.stdout, re.S)
    assert help_line, result.stdout
    assert "CNS_DEBUG_URL" in help_line.group(1) and "10090" in help_line.group(1)


def fake_build(tmp_path: Path, body: str) -> Path:
    """A copy of scripts/setup.sh next to a stand-in for scripts/build-kubernetes.sh."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((REPO / "scripts" / "setup.sh").read_text())
    (tmp_path / "scripts" / "build-kubernetes.sh").write_text(body)
    return tmp_path


def build_kubernetes(root: Path, every: int = 1) -> subprocess.CompletedProcess[str]:
    script = "set -euo pipefail; source scripts/setup.sh; build_kubernetes"
    env = {**os.environ, "CNS_KUBE_CACHE": str(root / "cache"), "CNS_PROGRESS_SECONDS": str(every)}
    return subprocess.run(
        ["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )


def test_build_kubernetes_reports_progress_while_it_builds(tmp_path: Path) -> None:
    """The first build runs for 8-9 minutes with its output in a log: test.sh said nothing."""
    root = fake_build(
        tmp_path,
        "echo fetching sources; sleep 2.5; echo '+++ Building go targets: cmd/kubelet'; sleep 2.5\n"
        "echo 'built: etcd kubelet'\n",
    )
    result = build_kubernetes(root)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "8-9 minutes" in lines[0] and "3.8 GB" in lines[0] and "build.log" in lines[0]
    progress = [line for line in lines if line.startswith("  still building (")]
    assert progress, result.stdout
    assert any(line.endswith("Building go targets: cmd/kubelet") for line in progress)
    assert lines[-1] == "  built: etcd kubelet"
    # The reporter stopped with the build: the pipe closed, so run() returned at all; and the
    # log holds the whole build output.
    assert (root / "cache" / "build.log").read_text().endswith("built: etcd kubelet\n")


def test_build_kubernetes_failure_shows_the_log_and_fails(tmp_path: Path) -> None:
    root = fake_build(tmp_path, "echo step one; echo 'go: compile error' >&2; exit 3\n")
    result = build_kubernetes(root)
    assert result.returncode == 3
    assert "step one\ngo: compile error" in result.stdout


def test_quiet_when_cached(tmp_path: Path) -> None:
    root = fake_build(tmp_path, "echo 'cached: /var/cache/cns-kubernetes/bin'\n")
    result = build_kubernetes(root, every=30)
    assert result.returncode == 0
    assert len(result.stdout.splitlines()) == 2
    assert result.stdout.splitlines()[1] == "  cached: /var/cache/cns-kubernetes/bin"
    assert "still building" not in result.stdout
