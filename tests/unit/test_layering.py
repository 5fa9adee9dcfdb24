"""The import contracts of pyproject.toml (`lint-imports`, run by scripts/test.sh): they cover
every module, and they fail when an import breaks them, so their passing means something."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.harness import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def _layer_modules(contract_id: str) -> set[str]:
    """The modules a layers contract names, with its container's name in front."""
    (contract,) = [c for c in _contracts() if c["id"] == contract_id]
    layers = contract["layers"]
    assert isinstance(layers, list)
    containers = contract.get("containers", [""])
    assert isinstance(containers, list)
    return {
        f"{container}.{name.strip()}" if container else name.strip()
        for container in containers
        for layer in layers
        for name in layer.replace("|", ":").split(":")
        if name.strip()
    }


def _modules(package: str) -> set[str]:
    names = set()
    for path in (REPO / package).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("contract_id", "package"),
    [
        ("layers", "cns"),
        ("node-inside", "cns/node"),
        ("controller-inside", "cns/controller"),
        ("sim-inside", "cns/sim"),
    ],
)
def test_every_module_is_in_a_layer(contract_id: str, package: str) -> None:
    """A module no layer names escapes the contract: a new module must be placed in one (the
    folders in the contract of folders, each module of cns/node, cns/controller and cns/sim in
    its folder's own contract)."""
    layers = _layer_modules(contract_id)
    unplaced = []
    for module in sorted(_modules(package)):
        inside = any(module == layer or module.startswith(layer + ".") for layer in layers)
        is_package_of_layers = any(layer.startswith(module + ".") for layer in layers)
        if not inside and not is_package_of_layers:
            unplaced.append(module)
    assert unplaced == [], f"modules in no layer of contract {contract_id!r} in pyproject.toml"


def test_the_contracts_hold_and_can_fail(tmp_path: Path) -> None:
    """A copy of the tree passes; the same copy with an upward import in the core, one inside
    cns/node, one inside cns/controller and a third-party import in a plugin breaks all four
    contracts, naming each import."""
    for name in ("cns", "cni_plugin"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for name in ("__init__.py", "layering.py"):
        shutil.copy(REPO / "tests" / name, tmp_path / "tests" / name)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")

    clean = _lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "5 kept, 0 broken" in clean.stdout

    with (tmp_path / "cns" / "core" / "types.py").open("a") as types:
        types.write("\nfrom cns.node import service  # upward: core -> service\n")
    with (tmp_path / "cni_plugin" / "tinyjson.py").open("a") as tinyjson:
        tinyjson.write("\nimport yaml  # not in the stdlib\n")
    with (tmp_path / "cns" / "node" / "lanes.py").open("a") as lanes:
        lanes.write("\nfrom cns.node import service  # upward: lanes -> service\n")
    with (tmp_path / "cns" / "controller" / "lease.py").open("a") as lease:
        lease.write("\nfrom cns.controller import run  # upward: lease -> term\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "1 kept, 4 broken" in broken.stdout
    assert "cns.core.types -> cns.node.service" in broken.stdout
    assert "cns.node.lanes -> cns.node.service" in broken.stdout
    assert "cns.controller.lease -> cns.controller.run" in broken.stdout
    assert "cni_plugin.tinyjson imports yaml" in broken.stdout
