"""Kubernetes' own networking e2e tests (`e2e.test` v1.20.2, tests/harness/kube_e2e.py) on the
session's three-node cluster, with both plugin set-ups: `cns-cni`, and the reference `ptp` with
`cns-ipam`. The selection is `[sig-network] Networking Granular Checks: Pods` (one server pod
per node, so pod to pod and node to pod across nodes) and every other `[sig-network]`
`[Conformance]` spec that needs neither the internet nor cluster DNS (`kube_e2e.SKIPPED` names
the others with their reasons). Root only; slow (minutes per set-up).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_multinode import spread
from tests.harness import kube_e2e
from tests.harness.multinode import LAN, PLUGIN_SETUPS, MultiNodeCluster, ptp_conflist
from tests.harness.requirements import require

# Sorts before install-cni's 10-cns.conflist: containerd uses the first network configuration.
PTP_CONFLIST = "00-ptp-cns-ipam.conflist"


@contextlib.contextmanager
def plugin_setup(cluster: MultiNodeCluster, setup: str) -> Iterator[None]:
    """The cluster's pods networked by `setup` while in the block; cns-cni again after it.

    `ptp-cns-ipam` is a conflist of the node's operator next to the one install-cni wrote; the
    runtime reloads its network configuration when the directory changes. No pod of the
    workload runs while it switches: a pod's DEL goes to the configuration of the moment."""
    if setup == "cns-cni":
        yield
        return
    written = []
    try:
        for node in cluster.nodes:
            path = node.directory / "net.d" / PTP_CONFLIST
            path.write_text(json.dumps(ptp_conflist(cluster.this_node)))
            written.append(path)
        cluster.wait(lambda: probe_uses_ptp(cluster), "the runtimes use ptp + cns-ipam", 60)
        yield
    finally:
        for path in written:
            path.unlink(missing_ok=True)


def probe_uses_ptp(cluster: MultiNodeCluster) -> bool:
    """A pod on every node, networked by ptp: its default route goes via the LAN's gateway
    that cns-ipam returned (cns-cni's goes via 169.254.1.1)."""
    cluster.kube.apply(spread("probe", len(cluster.nodes)))
    try:
        pods = cluster.wait_running("app=probe", len(cluster.nodes))
        routes = [
            cluster.node(p["spec"]["nodeName"]).in_pod(p["metadata"]["name"], "ip", "route").stdout
            for p in pods
        ]
        return all(f"default via {LAN.ip}" in said for said in routes)
    finally:
        cluster.kubectl("delete", "deployment", "probe", "--wait=false")
        cluster.wait_gone("app=probe")


@pytest.fixture(scope="module")
def e2e_images(cluster: MultiNodeCluster) -> None:
    require(kube_e2e.missing_e2e(), ": run scripts/build-kubernetes-e2e.sh and -images.sh")
    for node in cluster.nodes:
        assert node.containerd is not None
        kube_e2e.import_images(node.containerd)


@pytest.mark.parametrize("setup", PLUGIN_SETUPS)
def test_kubernetes_networking_e2e(
    cluster: MultiNodeCluster, e2e_images: None, setup: str, tmp_path: Path
) -> None:
    selected = kube_e2e.selected_specs()
    assert len(selected) >= 13, selected  # the regex trap would select thousands or none
    with plugin_setup(cluster, setup):
        result = kube_e2e.run_e2e(
            kubeconfig=cluster.kubeconfig,
            kubectl=cluster.bin_dir / "kubectl",
            report_dir=tmp_path / "report",
            parallel=3,
        )
    ran = sorted(spec.name for spec in result.ran())
    assert result.returncode == 0 and not result.named("failed"), result.summary()
    assert [" ".join(name.split()) for name in ran] == [" ".join(s.split()) for s in selected]
