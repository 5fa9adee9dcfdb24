"""The CNI variables a container runtime sets around a plugin run (the CNI spec's "Parameters"),
for the tests and benchmarks that run the real plugin executables as a runtime does."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def cni_env(
    command: str,
    *,
    container: str,
    netns: str,
    plugin_dirs: Iterable[Path | str],
    pod: str,
    namespace: str,
) -> dict[str, str]:
    """`CNI_*` for a pod's `eth0`, with the runtime's PATH; CNI_ARGS as the kubelet's (with
    `IgnoreUnknown=1`, as containerd passes it)."""
    return {
        "PATH": os.environ["PATH"],
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container,
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": ":".join(str(d) for d in plugin_dirs),
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAME={pod};K8S_POD_NAMESPACE={namespace}",
    }
