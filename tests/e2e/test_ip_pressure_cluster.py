"""IP pressure on the real three-node cluster: node A's pool at maxIPCount is tainted, a
Deployment that prefers A runs on B instead of waiting on A; once A's pods leave the taint goes
and the Deployment's new pods run on A. It runs on the dual-stack cluster, whose daemons have
`ipPressure` on from the start (tests/e2e/conftest.py; turning it on and off again would cost two
restarts of the DaemonSet): no other test there fills a node to maxIPCount, and an exhausted
subnet enters pressure only after an hour (`CLUSTER_IP_PRESSURE`). The cluster is left as found:
no taint, the condition False where it was set."""

from __future__ import annotations

import pytest

from tests.harness.multinode import DUAL_STACK, MultiNodeCluster
from tests.harness.pressure_scenario import pressure_condition, run, taint_keys

# Longer than any pod start here: a pod sent to A would still be waiting when A is freed.
HOLD_SECONDS = 120


@pytest.mark.parametrize("cluster", [DUAL_STACK], indirect=True)
def test_a_full_node_is_tainted_and_new_pods_land_on_another_until_it_has_room(
    cluster: MultiNodeCluster,
) -> None:
    first, second = cluster.nodes[0], cluster.nodes[1]
    outcome = run(cluster, first, second, tainted=True, hold_seconds=HOLD_SECONDS)
    assert outcome.first_nodes == [second.name, second.name], outcome
    assert outcome.later_nodes == [first.name, first.name], outcome
    assert pressure_condition(cluster, first)["status"] == "False"
    # Both changes are Events on the node's NNC, where `kubectl describe nnc` shows them.
    events = cluster.kube.request("GET", "/api/v1/namespaces/kube-system/events").json
    reasons = {
        e["reason"]
        for e in events.get("items") or []
        if e["involvedObject"].get("kind") == "NodeNetworkConfig"
        and e["involvedObject"].get("name") == first.name
    }
    assert {"PodIPPressure", "PodIPPressureCleared"} <= reasons, reasons
    for node in cluster.nodes:
        assert "acn.azure.com/pod-ip-pressure" not in taint_keys(cluster, node)
        assert pressure_condition(cluster, node).get("status", "False") == "False"
