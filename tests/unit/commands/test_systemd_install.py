"""`cns install --systemd` without a systemd: the unit it renders, the checks it makes before
writing anything, and whole installs staged into a temporary root (`--root`), where systemctl
works offline (enable/disable). tests/e2e/test_systemd_node_install.py runs it under a real systemd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cns.commands import systemd_install as sd
from cns.commands.install import shipped
from tests.harness import REPO
from tests.harness.requirements import unavailable

CNS = Path("/opt/cns/bin/cns")  # the executable the staged unit starts
WANTS = "etc/systemd/system/multi-user.target.wants/cns.service"


def layout(root: Path, **fields: object) -> sd.Layout:
    fields = {"config": Path("/etc/cns/cns.yaml"), "executable": CNS, **fields}
    return sd.Layout(root=root, **fields)  # type: ignore[arg-type]


def check(layout: sd.Layout, **overrides: object) -> list[str]:
    arguments: dict[str, object] = {
        "euid": 0, "booted": True, "systemctl": "/usr/bin/systemctl", "start": True,
        "installing": True, **overrides,
    }  # fmt: skip
    return sd.preflight(layout, **arguments)  # type: ignore[arg-type]


def test_the_unit_is_the_shipped_one_with_its_exec_start_naming_the_installed_cns() -> None:
    unit = (REPO / "systemd" / "cns.service").read_text()
    assert shipped("cns.service") == unit  # the package's data is the repository's unit
    rendered = sd.render_unit(unit, Path("/opt/cns/bin/cns"))
    assert "ExecStart=/opt/cns/bin/cns run --config /etc/cns/cns.yaml\n" in rendered
    before = [line for line in unit.splitlines() if not line.startswith("ExecStart=")]
    after = [line for line in rendered.splitlines() if not line.startswith("ExecStart=")]
    assert before == after


@pytest.mark.parametrize("path", ["/opt/my cns/bin/cns", "/opt/%n/cns", "/opt/$HOME/cns"])
def test_a_path_systemd_would_split_or_expand_is_refused(path: str) -> None:
    with pytest.raises(sd.InstallError, match="ExecStart"):
        sd.render_unit(shipped("cns.service"), Path(path))


def test_a_unit_without_the_shipped_exec_start_is_refused() -> None:
    with pytest.raises(sd.InstallError, match="ExecStart=/usr/local/bin/cns"):
        sd.render_unit("[Service]\nExecStart=/bin/true\n", CNS)


def test_the_plan_names_every_file_install_writes_conflist_first() -> None:
    plan = layout(Path("/srv/root"), bin_dir=Path("/usr/libexec/cni"))
    assert plan.files() == [
        Path("/etc/cni/net.d/10-cns.conflist"),
        Path("/etc/systemd/system/cns.service"),
        Path("/usr/libexec/cni/cns-ipam"),
        Path("/usr/libexec/cni/cns-cni"),
        Path("/usr/libexec/lib/cns/cni_plugin"),
        Path("/etc/cns/cns.yaml"),
    ]
    assert plan.here(plan.unit) == Path("/srv/root/etc/systemd/system/cns.service")
    assert layout(Path("/")).here(Path("/etc/cns")) == Path("/etc/cns")


def test_preflight_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "opt/cns/bin").mkdir(parents=True)
    (tmp_path / "opt/cns/bin/cns").touch(mode=0o755)
    staged = layout(tmp_path)
    assert check(staged) == []
    assert check(staged, euid=1000) == []  # staging a root of one's own needs no root
    live = layout(Path("/"), executable=Path(sys.executable))
    assert "must run as root" in check(live, euid=1000)[0]
    (booted,) = check(live, booted=False)
    assert "systemd is not running as PID 1 (no /run/systemd/system)" in booted
    assert check(live, booted=False, start=False) == []  # --no-start: the files only
    (systemctl,) = check(live, systemctl=None)
    assert "systemctl not found" in systemctl
    home, _ = check(layout(Path("/"), executable=Path("/root/venv/bin/cns")))  # and missing
    assert "/root/venv/bin/cns is below /root" in home and "ProtectHome=yes" in home
    (missing,) = check(layout(tmp_path, executable=Path("/usr/bin/cns")))
    assert f"{tmp_path}/usr/bin/cns: no cns executable there" in missing
    # uninstall neither needs the executable nor a running systemd
    assert check(layout(tmp_path, executable=Path("/usr/bin/cns")), installing=False) == []
    (tmp_path / "etc").write_text("a file where a directory should be")
    problems = check(staged)
    assert problems and all(f"cannot write {tmp_path}/etc/" in problem for problem in problems)


def cns(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cns.commands.cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def staged_root(tmp_path: Path) -> Path:
    if shutil.which("systemctl") is None:
        unavailable("needs systemctl (the systemd package; scripts/test.sh installs it)")
    root = tmp_path / "root"
    (root / CNS.parent.relative_to("/")).mkdir(parents=True)
    (root / CNS.relative_to("/")).write_text("#!/bin/sh\n")
    (root / CNS.relative_to("/")).chmod(0o755)
    return root


def install(root: Path, *args: str) -> list[str]:
    done = cns("install", "--systemd", "--root", root, "--cns", CNS, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_a_staged_install_writes_everything_and_a_second_run_changes_nothing(
    tmp_path: Path,
) -> None:
    root = staged_root(tmp_path)
    lines = install(root)
    files = [root / path.relative_to("/") for path in layout(root).files()]
    for path in files:
        assert path.exists() and any(line.startswith(f"installed {path}") for line in lines)
    unit = (root / "etc/systemd/system/cns.service").read_text()
    assert f"ExecStart={CNS} run --config /etc/cns/cns.yaml" in unit
    assert os.readlink(root / WANTS) == "/etc/systemd/system/cns.service"  # enabled offline
    assert (root / "etc/cns/cns.yaml").read_text() == (REPO / "config/cns.yaml").read_text()
    launcher = (root / "opt/cni/bin/cns-cni").read_text()
    assert "sys.path.insert(0, '/opt/cni/lib/cns')" in launcher  # the target's path, not ours
    assert list((root / "opt/cni/lib/cns/cni_plugin").rglob("*.pyc"))
    conflist = json.loads((root / "etc/cni/net.d/10-cns.conflist").read_text())
    assert conflist["plugins"][0]["socket"] == "/run/cns/cns.sock"
    assert conflist["plugins"][0]["releaseQueueDir"] == "/var/lib/cns/release-queue"

    mtimes = {path: path.lstat().st_mtime_ns for path in root.rglob("*")}
    again = install(root)
    assert [line.split()[0] for line in again if not line.startswith("running ")] == (
        ["unchanged"] * len(files)
    ), again
    assert {path: path.lstat().st_mtime_ns for path in root.rglob("*")} == mtimes


def test_an_operators_config_is_kept_and_names_the_conflists_socket(tmp_path: Path) -> None:
    root = staged_root(tmp_path)
    config = root / "etc/cns/cns.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(yaml.safe_dump({"socketPath": "/run/cns/other.sock", "stateDir": "/srv/c"}))
    before = config.read_text()
    lines = install(root, "--mtu", "1450")
    assert f"kept {config}: an operator's config is never overwritten" in "\n".join(lines)
    (warning,) = [line for line in lines if line.startswith("warning: ")]
    assert warning.startswith("warning: /srv/c is outside /var/lib/cns"), warning
    assert "ReadWritePaths=" in warning
    assert config.read_text() == before
    (first, _) = json.loads((root / "etc/cni/net.d/10-cns.conflist").read_text())["plugins"]
    assert (first["socket"], first["releaseQueueDir"], first["mtu"]) == (
        "/run/cns/other.sock", "/srv/c/release-queue", 1450,
    )  # fmt: skip

    config.write_text("socketPath: [not, a, path]\n")
    done = cns("install", "--systemd", "--root", root, "--cns", CNS)
    assert done.returncode == 1 and f"cns install: {config}: " in done.stderr


def test_a_different_unit_is_replaced_and_a_killed_install_is_finished(tmp_path: Path) -> None:
    root = staged_root(tmp_path)
    install(root, "--no-start")
    assert not (root / WANTS).exists()  # --no-start: not enabled
    unit = root / "etc/systemd/system/cns.service"
    unit.write_text("[Service]\nExecStart=/usr/local/bin/cns run\n")
    # What a run killed midway leaves: a temporary file, a missing conflist and launcher.
    (root / "etc/cni/net.d/10-cns.conflist").unlink()
    (root / "opt/cni/bin/cns-cni").unlink()
    (root / "opt/cni/bin/.cns-cni.tmp").write_text("half a launcher")
    lines = install(root)
    assert f"replaced {unit}: it differed from cns's unit (ExecStart={CNS})" in lines
    assert f"installed {root}/opt/cni/bin/cns-cni" in lines
    assert f"installed {root}/etc/cni/net.d/10-cns.conflist" in lines
    assert f"ExecStart={CNS} run" in unit.read_text()
    assert not (root / "opt/cni/bin/.cns-cni.tmp").exists()  # the rename took it
    assert (root / WANTS).is_symlink()


def test_uninstall_removes_what_install_wrote_and_keeps_the_state_and_an_edited_config(
    tmp_path: Path,
) -> None:
    root = staged_root(tmp_path)
    before = {path.relative_to(root) for path in root.rglob("*")}
    install(root)
    (root / "var/lib/cns").mkdir(parents=True)
    (root / "var/lib/cns/state.db").write_text("assignments")
    (root / "etc/systemd/system/.cns.service.tmp").write_text("left by a killed install")
    (root / "opt/cni/bin/.cns-ipam.tmp").write_text("left by a killed install")
    lines = install(root, "--uninstall")
    assert f"kept {root}/var/lib/cns: the state" in "\n".join(lines)
    assert not (root / WANTS).exists()
    assert not (root / "etc/systemd/system/.cns.service.tmp").exists()
    left = {path.relative_to(root) for path in root.rglob("*")} - before
    # what stays: the state, and the directories a node has anyway (emptied); not the
    # BIN/../lib that install made for the plugin package (as `cns uninstall-cni`)
    assert left == {
        Path(p) for p in ("var", "var/lib", "var/lib/cns", "var/lib/cns/state.db", "etc",
                          "etc/systemd", "etc/systemd/system", "etc/cni", "etc/cni/net.d",
                          "opt/cni", "opt/cni/bin")
    }  # fmt: skip
    again = install(root, "--uninstall")
    assert [line.split()[0] for line in again if line.startswith(("absent", "removed"))] == (
        ["absent"] * 6
    ), again

    install(root)
    config = root / "etc/cns/cns.yaml"
    config.write_text(config.read_text() + "logLevel: debug\n")
    lines = install(root, "--uninstall")
    assert f"kept {config}: it is not the default" in "\n".join(lines)
    assert config.exists() and not (root / "etc/systemd/system/cns.service").exists()


def test_install_refuses_to_run_unprivileged_on_this_host(tmp_path: Path) -> None:
    """Not root, no --root: nothing is checked further, nothing written, exit code 1."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        unavailable("needs root and setpriv (util-linux) to run the command as nobody")
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
         "cns.commands.cli", "install", "--systemd", "--cns", sys.executable],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cns install: must run as root" in done.stderr
    assert "cannot write /etc/systemd/system" in done.stderr
    assert done.stdout == ""
