"""IP pressure on a real kube-apiserver: `cns run` (with the daemon's RBAC-limited credentials)
sets the Node condition PodIPPressure and the taint acn.azure.com/pod-ip-pressure:NoSchedule
when its pool is at maxIPCount with no free address, clears them when addresses are free again
and when it stops cleanly, keeps a crashed daemon's taint until the readings clear it, and never
removes or loses another writer's taint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cns.kube.client import connect
from cns.kube.node_pressure import CONDITION_TYPE, TAINT_KEY, Mark, NodeMarks
from tests.harness.daemon import Daemon
from tests.harness.kube_api import DAEMON_USER, STRATEGIC_PATCH
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import Scenario, installed, object_ref

kube = pytest.fixture(scope="module")(kube_cluster_fixture)

OTHER = {"key": "example.com/maintenance", "value": "yes", "effect": "NoSchedule"}
LATER = {"key": "example.com/late", "effect": "PreferNoSchedule"}
PRESSURE = {
    "ipCooldownSeconds": 0,  # a DEL frees its address at once
    "ipPressure": {
        "enabled": True,
        "enterAfterSeconds": 1,
        "leaveFreeIPs": 1,
        "leaveAfterSeconds": 1,
    },
}


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    return installed(kube)


@pytest.fixture
def scenario(cluster: KubeCluster, tmp_path: Path) -> Iterator[Scenario]:
    made = Scenario(
        cluster, tmp_path, "pressure", "10.64.0.0/24", {"batchSize": 2, "maxIPCount": 4}
    )
    try:
        yield made
    finally:
        made.cleanup()


def taints(cluster: KubeCluster, node: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = (
        cluster.get("v1", "Node", node).get("spec", {}).get("taints") or []
    )
    return found


def condition(cluster: KubeCluster, node: str) -> dict[str, Any] | None:
    conditions = cluster.get("v1", "Node", node).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == CONDITION_TYPE), None)


def keys(cluster: KubeCluster, node: str) -> list[str]:
    return [t["key"] for t in taints(cluster, node)]


def add(daemon: Daemon, container: str) -> None:
    status, body = daemon.call("POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"})
    assert status == 200, body


def delete(daemon: Daemon, container: str) -> None:
    status, body = daemon.call("POST", "/v1/cni/del", {"containerID": container, "ifName": "eth0"})
    assert status == 200, body


def fill(scenario: Scenario, daemon: Daemon) -> int:
    """ADDs until the node holds maxIPCount addresses and none is free; how many it took."""
    pool = scenario.wait(lambda: (p := daemon.pool())["ips"]["Available"] and p, "a first batch")
    count = pool["maxIPCount"] - pool["primaryIPCount"]
    for i in range(count):
        add(daemon, f"fill{i}")
    pool = daemon.pool()
    assert pool["ips"]["Available"] == 0 and pool["ips"]["Assigned"] == count, pool
    return count


def test_a_full_node_is_tainted_until_an_address_is_free_and_untainted_when_the_daemon_stops(
    scenario: Scenario, cluster: KubeCluster
) -> None:
    scenario.add_node("pr-n1")
    cluster.patch("v1", "Node", "pr-n1", {"spec": {"taints": [OTHER]}})
    scenario.start_controller()
    daemon = scenario.start_daemon("pr-n1", config=PRESSURE)
    scenario.wait(lambda: condition(cluster, "pr-n1"), "the condition False at start")
    assert condition(cluster, "pr-n1")["status"] == "False"  # type: ignore[index]
    assert keys(cluster, "pr-n1") == [OTHER["key"]]

    count = fill(scenario, daemon)
    scenario.wait(lambda: TAINT_KEY in keys(cluster, "pr-n1"), "the taint at maxIPCount")
    found = condition(cluster, "pr-n1")
    assert found is not None and found["status"] == "True", found
    assert found["reason"] == "MaxIPCountReached" and "maxIPCount" in found["message"]
    assert taints(cluster, "pr-n1")[0] == OTHER  # the other writer's taint kept as it was
    assert {"key": TAINT_KEY, "effect": "NoSchedule"} in taints(cluster, "pr-n1")

    # Another writer adds a taint while ours is on: a DEL frees an address, ours goes, theirs stays.
    cluster.patch("v1", "Node", "pr-n1", {"spec": {"taints": [*taints(cluster, "pr-n1"), LATER]}})
    delete(daemon, "fill0")
    scenario.wait(lambda: TAINT_KEY not in keys(cluster, "pr-n1"), "the taint gone after a DEL")
    assert keys(cluster, "pr-n1") == [OTHER["key"], LATER["key"]]
    assert condition(cluster, "pr-n1")["reason"] == "PodIPsAvailable"  # type: ignore[index]

    # Full again, then a crash: the taint stays on the node; the restarted daemon (its pool still
    # full) keeps it without ever removing it, and removes it and the condition on SIGTERM.
    add(daemon, "fill0")
    scenario.wait(lambda: TAINT_KEY in keys(cluster, "pr-n1"), "the taint again")
    daemon.stop(9)
    assert TAINT_KEY in keys(cluster, "pr-n1")
    daemon.start()
    scenario.wait(lambda: "ip_pressure_taint_found" in daemon.log(), "the stale taint read")
    scenario.wait(lambda: daemon.pool()["ips"]["Assigned"] == count, "the pool restored")
    scenario.wait(
        lambda: condition(cluster, "pr-n1")["reason"] == "MaxIPCountReached",  # type: ignore[index]
        "the restarted daemon's own reason",
    )
    assert TAINT_KEY in keys(cluster, "pr-n1")
    restarted = daemon.log().split("ip_pressure_taint_found")[-1]
    assert '"tainted": false' not in restarted and "tainted=False" not in restarted
    assert daemon.stop() == 0
    assert keys(cluster, "pr-n1") == [OTHER["key"], LATER["key"]]
    assert condition(cluster, "pr-n1") is None


def test_a_daemon_with_ip_pressure_off_removes_what_an_earlier_one_left(
    scenario: Scenario, cluster: KubeCluster
) -> None:
    scenario.add_node("pr-n2")
    left = {"key": TAINT_KEY, "effect": "NoSchedule"}
    cluster.patch("v1", "Node", "pr-n2", {"spec": {"taints": [OTHER, left]}})
    stale = {"type": CONDITION_TYPE, "status": "True", "reason": "MaxIPCountReached"}
    cluster.patch(
        "v1", "Node", "pr-n2", {"status": {"conditions": [stale]}},
        subresource="status", content_type=STRATEGIC_PATCH,
    )  # fmt: skip
    scenario.start_controller()
    daemon = scenario.start_daemon("pr-n2")
    scenario.wait(lambda: TAINT_KEY not in keys(cluster, "pr-n2"), "the stale taint removed")
    assert keys(cluster, "pr-n2") == [OTHER["key"]]
    scenario.wait(lambda: condition(cluster, "pr-n2") is None, "the stale condition removed")
    assert daemon.stop() == 0


async def test_a_taint_written_between_the_read_and_the_patch_is_kept(
    cluster: KubeCluster,
) -> None:
    """The taint list is written whole: conditional on the resourceVersion read, a writer that
    added its taint in between makes the patch fail with 409, and the node is read again."""
    cluster.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "pr-n3"}})
    try:
        async with await connect(str(cluster.kubeconfig_for(DAEMON_USER))) as client:
            marks = NodeMarks(client, "pr-n3")
            before = await marks.read()  # what the daemon read ...
            cluster.patch("v1", "Node", "pr-n3", {"spec": {"taints": [OTHER]}})  # ... then this
            await marks._set_taint(True, before)
            assert keys(cluster, "pr-n3") == [OTHER["key"], TAINT_KEY]
            await marks.show(Mark(status="True", reason="SubnetExhausted", message="m"))
            assert keys(cluster, "pr-n3") == [OTHER["key"], TAINT_KEY]  # no second entry
            conditions = cluster.get("v1", "Node", "pr-n3")["status"]["conditions"]
            assert [c["type"] for c in conditions] == [CONDITION_TYPE]
            stale = await marks.read()
            cluster.patch(
                "v1", "Node", "pr-n3", {"spec": {"taints": [*taints(cluster, "pr-n3"), LATER]}}
            )
            await marks._set_taint(False, stale)
            assert keys(cluster, "pr-n3") == [OTHER["key"], LATER["key"]]
    finally:
        cluster.delete([object_ref("v1", "Node", "pr-n3")])
