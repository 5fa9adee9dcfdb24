"""The `cns controller` command line, with the RBAC-limited credentials of config/rbac.yaml."""

from __future__ import annotations

import sys

from tests.harness.kube_api import CONTROLLER_USER
from tests.harness.kube_cluster import KubeCluster


def controller_command(
    kube: KubeCluster,
    *,
    subnet: str,
    identity: str,
    lease_seconds: int,
    metrics_port: int | None = None,
    user: str = CONTROLLER_USER,
) -> list[str]:
    """`cns controller` for `subnet` (every ClusterSubnet: "") as the controller's service
    account (or as `user`, which must then be granted the same roles), logging JSON."""
    command = [
        sys.executable, "-m", "cns.commands.cli", "controller",
        *(("--subnet", subnet) if subnet else ()),
        "--kubeconfig", str(kube.kubeconfig_for(user)),
        "--identity", identity,
        "--lease-seconds", str(lease_seconds),
        "--log-format", "json",
    ]  # fmt: skip
    if metrics_port is not None:
        command += ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
    return command
