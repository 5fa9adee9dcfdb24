"""Shared fixtures: a real `cns run` daemon in a subprocess, and the installed CNI plugins.

The harness itself (daemons, runtimes, clusters, host clean-up) is the `tests.harness` package.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.daemon import Daemon


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--baselines",
        action="store_true",
        help="also measure the baselines that benchmark figures are ratios against "
        "(docs/benchmarks.md); without it a test checks behaviour only",
    )


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    started: list[Daemon] = []

    def make(overrides: dict[str, Any] | None = None, start: bool = True) -> Daemon:
        workdir = tmp_path / f"d{len(started)}"
        workdir.mkdir()
        daemon = Daemon(workdir, overrides or {})
        started.append(daemon)
        if start:
            daemon.start()
        return daemon

    yield make
    for daemon in started:
        if daemon.proc is not None:
            daemon.proc.kill()
            daemon.proc.wait()


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`cns install-cni` into a scratch bin dir, exactly as an operator would."""
    root = tmp_path_factory.mktemp("cni")
    subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "install-cni", "--bin-dir", str(root / "bin")],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return root / "bin"
