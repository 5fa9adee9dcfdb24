"""The reference `bridge` plugin with `cns-ipam` as its IPAM: one network config and a network
namespace per pod, as a runtime would drive them; `cleanup()` removes the namespaces and the
bridge."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.harness.cni_env import cni_env
from tests.harness.host import REFERENCE_PLUGINS, ping
from tests.harness.requirements import missing_root, require


def require_bridge() -> None:
    """Root and the reference `bridge` plugin (containernetworking-plugins)."""
    plugin = REFERENCE_PLUGINS / "bridge"
    require(
        missing_root() + ([] if plugin.exists() else [f"containernetworking-plugins ({plugin})"])
    )


class BridgeNetwork:
    """One bridge network config for `daemon`, and a netns per pod, torn down afterwards."""

    def __init__(self, daemon: Any, plugin_dir: Path, tag: str) -> None:
        self.daemon = daemon
        self.plugin_dir = plugin_dir
        self.bridge = f"cnsbr{tag}"
        self.prefix = f"cnst{tag}-"
        self.config = {
            "cniVersion": "1.0.0",
            "name": "cns-e2e",
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": True,
            "ipMasq": False,
            "ipam": {
                "type": "cns-ipam",
                "socket": str(daemon.socket),
                "releaseQueueDir": str(daemon.state_dir / "release-queue"),
            },
        }
        self.namespaces: list[str] = []

    def netns(self, n: int) -> str:
        name = f"{self.prefix}{n}"
        if name not in self.namespaces:
            subprocess.run(["ip", "netns", "add", name], check=True)
            self.namespaces.append(name)
        return name

    def cni(self, command: str, n: int, netns: bool = True) -> subprocess.CompletedProcess[str]:
        env = cni_env(
            command,
            container=f"e2e-{n}",
            netns=f"/var/run/netns/{self.netns(n)}" if netns else "",
            plugin_dirs=(REFERENCE_PLUGINS, self.plugin_dir),
            pod=f"pod-{n}",
            namespace="e2e",
        )
        return subprocess.run(
            [str(REFERENCE_PLUGINS / "bridge")],
            input=json.dumps(self.config),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def ping(self, n: int, address: str) -> subprocess.CompletedProcess[str]:
        """Ping from pod `n`, up to three tries (`host.ping`)."""
        return ping(address, netns=self.netns(n))

    def cleanup(self) -> None:
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
