"""The benchmark scripts' shared helpers, on this repository (the scripts compare trees exported
from it: a helper that fails makes every comparison fail before it measures anything)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.benchlib import BenchError, export_revision
from tests.harness import REPO


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout


def test_export_revision_unpacks_the_paths_of_a_commit(tmp_path: Path) -> None:
    # On Debian's Python 3.11.2 the earlier `tarfile.extractall(filter="data")` raised TypeError.
    tree = tmp_path / "tree"
    commit = export_revision("HEAD", tree, "cns", "cni_plugin")
    assert commit == _git("rev-parse", "HEAD").decode().strip()
    assert (tree / "cns" / "__init__.py").read_bytes() == _git("show", "HEAD:cns/__init__.py")
    assert (tree / "cni_plugin" / "ipam.py").read_bytes() == _git("show", "HEAD:cni_plugin/ipam.py")
    assert sorted(p.name for p in tree.iterdir()) == ["cni_plugin", "cns"]


def test_export_revision_says_what_it_could_not_export(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="no-such-dir"):
        export_revision("HEAD", tmp_path / "tree", "no-such-dir")
