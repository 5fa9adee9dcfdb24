"""What a test needs from the machine: root, tools, plugins, Python modules.

A test that lacks something fails under CI (`$CI` set: CI must provide everything) and skips
elsewhere, with the reason: it never passes silently.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import NoReturn

import pytest

from tests.harness.host import BUSYBOX, REFERENCE_PLUGINS, is_static_elf, which

RUNTIME_TOOLS = {
    "podman": ("podman", "runc", "conmon"),
    # podman builds containerd's pause image (import + save), no registry involved.
    "containerd": ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "podman", "conmon"),
}
RUNTIME_PYTHON_MODULES = {"podman": (), "containerd": ("grpc", "grpc_tools")}


def unavailable(why: str) -> NoReturn:
    """Fail under CI, skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must provide it", pytrace=False)
    pytest.skip(why)


def require(missing: Sequence[str], hint: str = "") -> None:
    """`unavailable("needs A, B" + hint)` when anything is missing."""
    if missing:
        unavailable(f"needs {', '.join(missing)}{hint}")


def is_root() -> bool:
    return os.geteuid() == 0


def missing_root() -> list[str]:
    return [] if is_root() else ["root"]


def missing_runtime_requirements(*runtimes: str) -> list[str]:
    """What this machine lacks to run the given runtimes ("podman", "containerd"; default both).

    From Debian: podman, runc, busybox-static, containerd, containernetworking-plugins; from
    PyPI (containerd only): grpcio and grpcio-tools.
    """
    wanted = runtimes or tuple(RUNTIME_TOOLS)
    missing = missing_root()
    tools = sorted({tool for runtime in wanted for tool in RUNTIME_TOOLS[runtime]})
    missing += [tool for tool in tools if which(tool) is None]
    for plugin in ("ptp", "host-local", "loopback", "portmap"):
        if not (REFERENCE_PLUGINS / plugin).exists():
            missing.append(f"{REFERENCE_PLUGINS / plugin} (containernetworking-plugins)")
    if not is_static_elf(BUSYBOX):
        missing.append(f"a static {BUSYBOX} (busybox-static)")
    for runtime in wanted:
        for module in RUNTIME_PYTHON_MODULES[runtime]:
            if importlib.util.find_spec(module) is None:
                missing.append(f"python module {module}")
    return missing


def require_runtime_root(*runtimes: str) -> None:
    require(missing_runtime_requirements(*runtimes))
