"""IP pressure on the real three-node cluster: node A's pool at maxIPCount is tainted, a
Deployment that prefers A runs on B instead of waiting on A; once A's pods leave the taint goes
and the Deployment's new pods run on A. The cluster is left as found (the ConfigMap restored and
the daemons restarted with it, which removes every condition of theirs)."""

from __future__ import annotations

from tests.harness.multinode import MultiNodeCluster
from tests.harness.pressure_scenario import (
    configured,
    pressure_condition,
    run,
    taint_keys,
)

# Longer than any pod start here: a pod sent to A would still be waiting when A is freed.
HOLD_SECONDS = 120


def test_a_full_node_is_tainted_and_new_pods_land_on_another_until_it_has_room(
    cluster: MultiNodeCluster,
) -> None:
    first, second = cluster.nodes[0], cluster.nodes[1]
    with configured(cluster, enabled=True):
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
        assert pressure_condition(cluster, node) == {}
