"""Deployment artefacts: the systemd unit, the installed plugin launcher, the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cns.commands.cli import configured_debug_url
from cns.commands.install import uninstall_verdict
from tests.harness import REPO
from tests.harness.requirements import unavailable


def systemd_analyze() -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        unavailable("needs systemd-analyze (scripts/test.sh installs the systemd package)")
    return analyze


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    cns = Path(sys.executable).with_name("cns")
    unit = (REPO / "systemd" / "cns.service").read_text()
    assert "ExecStart=/usr/local/bin/cns run" in unit
    local = tmp_path / "cns.service"
    local.write_text(unit.replace("/usr/local/bin/cns", str(cns)))
    result = subprocess.run(
        [analyze, "verify", str(local)], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in result.stderr.splitlines() if "cns.service" in line]
    assert result.returncode == 0 and not problems, result.stderr


def test_systemd_unit_sandbox_scores_at_most_3_5_and_explains_every_exposure() -> None:
    unit = REPO / "systemd" / "cns.service"
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    score = re.search(r"Overall exposure level for cns.service: (\d+\.\d)", result.stdout)
    assert score is not None, result.stdout
    assert float(score.group(1)) <= 3.5, result.stdout
    text = unit.read_text()
    assert f"scores it {score.group(1)}." in text  # the number the unit's comment quotes
    settings = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in text.splitlines()
                if "=" in line and not line.startswith("#")}  # fmt: skip
    assert settings["UMask"] == "0077" and settings["WatchdogSec"]
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    exposed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("✗")]
    assert exposed, result.stdout
    unexplained = [name for name in exposed if f"{name}:" not in comments]
    assert not unexplained, f"exposures without a comment in the unit: {unexplained}"


def test_installed_launcher_is_stdlib_only_and_isolated(plugin_dir: Path) -> None:
    launcher = plugin_dir / "cns-ipam"
    assert os.access(launcher, os.X_OK)
    first = launcher.read_text().splitlines()[0]
    assert first.endswith(" -IS")
    env = {"CNI_COMMAND": "VERSION", "PATH": os.environ["PATH"]}
    result = subprocess.run(
        [str(launcher)], input="", env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert "1.1.0" in json.loads(result.stdout)["supportedVersions"]
    compiled = list((plugin_dir.parent / "lib" / "cns" / "cni_plugin").rglob("*.pyc"))
    assert compiled, "install-cni precompiles the plugin"


def test_cli_help_lists_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    for command in ("run", "status", "install-cni"):
        assert command in result.stdout


def test_install_cni_writes_both_plugins_and_a_conflist(tmp_path: Path) -> None:
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "install-cni", "--bin-dir", str(bin_dir),
         "--conf-dir", str(conf_dir), "--mtu", "1450", "--socket", "/run/x/cns.sock"],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    assert os.access(bin_dir / "cns-cni", os.X_OK) and os.access(bin_dir / "cns-ipam", os.X_OK)
    conflist = json.loads((conf_dir / "10-cns.conflist").read_text())
    first, second = conflist["plugins"]
    assert (first["type"], first["mtu"], first["socket"]) == ("cns-cni", 1450, "/run/x/cns.sock")
    assert second["type"] == "portmap" and second["capabilities"] == {"portMappings": True}


def _tree(root: Path) -> dict[str, bytes | str]:
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else "<dir>"
        for path in sorted(root.rglob("*"))
    }


def test_uninstall_cni_puts_the_cni_dirs_back_and_leaves_what_is_not_ours(tmp_path: Path) -> None:
    """What the DaemonSet's preStop hook runs: after install + uninstall the dirs are as before,
    another network's conflist and plugins stay, and a second uninstall is a no-op."""
    bin_dir, conf_dir = tmp_path / "opt" / "bin", tmp_path / "net.d"
    bin_dir.mkdir(parents=True)
    conf_dir.mkdir()
    (bin_dir / "portmap").write_text("not ours")
    (conf_dir / "20-other.conflist").write_text('{"plugins": [{"type": "bridge"}]}')
    before = _tree(tmp_path)
    cli = [sys.executable, "-m", "cns.commands.cli"]
    dirs = ["--bin-dir", str(bin_dir), "--conf-dir", str(conf_dir)]
    subprocess.run([*cli, "install-cni", *dirs], check=True, cwd=REPO, capture_output=True)
    assert _tree(tmp_path) != before
    # What an install-cni killed midway leaves beside the files it writes goes too.
    (bin_dir / ".cns-cni.tmp").write_text("half a launcher")
    (conf_dir / ".10-cns.conflist.tmp").write_text("half a conflist")
    for _ in range(2):
        subprocess.run([*cli, "uninstall-cni", *dirs], check=True, cwd=REPO, capture_output=True)
        assert _tree(tmp_path) == before


def test_uninstall_cni_keeps_a_conflist_and_launchers_it_did_not_write(tmp_path: Path) -> None:
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    bin_dir.mkdir()
    conf_dir.mkdir()
    (bin_dir / "cns-cni").write_text("#!/bin/sh\n# someone else's cns-cni\n")
    (conf_dir / "10-cns.conflist").write_text('{"plugins": [{"type": "bridge"}]}')
    before = _tree(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "uninstall-cni", "--bin-dir", str(bin_dir),
         "--conf-dir", str(conf_dir)],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    assert _tree(tmp_path) == before


def test_image_tag_is_the_version_and_a_hash_of_the_inputs() -> None:
    """`make image`'s tag: the same files give the same tag (a rolling update is a new tag)."""
    script = ["bash", str(REPO / "scripts" / "build-image.sh"), "--tag"]
    tags = {subprocess.run(script, check=True, capture_output=True, text=True).stdout.strip()
            for _ in range(2)}  # fmt: skip
    (tag,) = tags
    from cns import __version__

    assert re.fullmatch(rf"{re.escape(__version__)}-[0-9a-f]{{12}}", tag), tag


@pytest.mark.parametrize(
    ("status", "deleting", "remove"),
    [
        (200, False, False),  # a roll, a restart, an eviction: a new pod follows
        (200, True, True),  # a foreground-cascade delete of the DaemonSet
        (404, False, True),  # `kubectl delete`: the DaemonSet gone at once (background cascade)
        (401, False, True),  # `kubectl delete -k`: the ServiceAccount (and its token) went first
        (403, False, True),  # ... or its RBAC did
        (None, False, False),  # no answer: keep, as a roll needs
        (500, False, False),
        (429, False, False),
    ],
)
def test_the_prestop_hook_removes_the_cni_files_only_when_the_daemonset_is_deleted(
    status: int | None, deleting: bool, remove: bool
) -> None:
    removes, why = uninstall_verdict(status, deleting)
    assert removes is remove
    assert why


def test_uninstall_cni_unless_daemonset_alive_keeps_the_files_without_an_api_answer(
    tmp_path: Path,
) -> None:
    """Outside a cluster (no service account) there is no answer: the files stay."""
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    cli = [sys.executable, "-m", "cns.commands.cli"]
    dirs = ["--bin-dir", str(bin_dir), "--conf-dir", str(conf_dir)]
    subprocess.run([*cli, "install-cni", *dirs], check=True, cwd=REPO, capture_output=True)
    installed = _tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    result = subprocess.run(
        [*cli, "uninstall-cni", *dirs, "--unless-daemonset-alive", "kube-system/cns"],
        check=True, cwd=REPO, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert "no answer" in result.stdout
    assert _tree(tmp_path) == installed


@pytest.mark.parametrize(
    ("debug_listen", "url"),
    [
        ("127.0.0.1:10123", "http://127.0.0.1:10123"),
        ("0.0.0.0:10124", "http://127.0.0.1:10124"),  # a wildcard is asked on the loopback
        ("[::1]:10125", "http://[::1]:10125"),
    ],
)
def test_cns_status_asks_the_debug_listen_of_the_default_config_file(
    tmp_path: Path, debug_listen: str, url: str
) -> None:
    """`kubectl exec ds/cns -- cns status` beside a daemon whose ConfigMap moved the port."""
    config = tmp_path / "cns.yaml"
    config.write_text(f"debugListen: '{debug_listen}'\n")
    assert configured_debug_url(config) == url
    config.write_text("debugListen: [not, an, address]\n")
    assert configured_debug_url(config) == "http://127.0.0.1:10090"
    assert configured_debug_url(tmp_path / "absent.yaml") == "http://127.0.0.1:10090"
