"""Kubernetes' own networking e2e tests (`e2e.test` v1.20.2, tests/harness/kube_e2e.py) on the
three-node cluster of each plugin set-up (tests/e2e/conftest.py): `cns-cni`, and the reference
`ptp` with `cns-ipam`. The selection is `[sig-network] Networking Granular Checks: Pods` (one
server pod per node, so pod to pod and node to pod across nodes) and every other
`[sig-network]` `[Conformance]` spec that needs neither the internet nor cluster DNS
(`kube_e2e.SKIPPED` names the others with their reasons). Root only; minutes per set-up.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.harness import kube_e2e
from tests.harness.multinode import MultiNodeCluster
from tests.harness.requirements import require


def test_kubernetes_networking_e2e(cluster_of_each_setup: MultiNodeCluster, tmp_path: Path) -> None:
    cluster = cluster_of_each_setup
    require(kube_e2e.missing_e2e(), ": run scripts/build-kubernetes-e2e.sh and -images.sh")
    selected = kube_e2e.selected_specs()
    assert len(selected) == 13, selected  # the regex trap would select thousands, or none
    runtimes = [node.containerd for node in cluster.nodes]
    assert None not in runtimes
    with ThreadPoolExecutor() as pool:  # every node's at once: 220 MB each
        list(pool.map(kube_e2e.import_images, runtimes))
    result = kube_e2e.run_e2e(
        kubeconfig=cluster.kubeconfig,
        kubectl=cluster.bin_dir / "kubectl",
        report_dir=tmp_path / "report",
        parallel=6,
    )
    ran = sorted(spec.name for spec in result.ran())
    assert result.returncode == 0 and not result.named("failed"), result.summary()
    assert [" ".join(name.split()) for name in ran] == [" ".join(s.split()) for s in selected]
