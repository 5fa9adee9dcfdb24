"""Kubernetes Events from the real `cns run` and `cns controller` on a real kube-apiserver, each
with its RBAC-limited credentials (config/rbac.yaml): a pod waiting for an address gets one
Warning Event saying why (the text `/debug/pod` shows), whose count rises with each try; the
subnet's exhaustion is an Event on the ClusterSubnet and on the NNC; the recorder's full outbox
drops and counts; an API server that is down blocks no ADD.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from cns.core.events import WARNING, Note, ObjectRef
from cns.kube.client import connect
from cns.kube.events import EventRecorder
from tests.harness.daemon import Daemon
from tests.harness.kube_api import DAEMON_USER, KUBE_SYSTEM
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import Scenario, installed, scenarios

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    return installed(kube)


@pytest.fixture
def scenario_factory(cluster: KubeCluster, tmp_path: Path) -> Iterator[Any]:
    yield from scenarios(cluster, tmp_path)


def make_pod(
    cluster: KubeCluster, node: str, name: str, annotations: dict[str, str] | None = None
) -> str:
    """A pod bound to `node` (its ADD is the test's); its UID."""
    meta = {"name": name, "namespace": "default", "annotations": annotations or {}}
    made = cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        }
    )
    return str(made["metadata"]["uid"])


def add(daemon: Daemon, container: str, pod: str = "", **extra: str) -> tuple[int, Any]:
    body = {"containerID": container, "ifName": "eth0", **extra}
    if pod:
        body |= {"podName": pod, "podNamespace": "default"}
    return daemon.call("POST", "/v1/cni/add", body)


def events(cluster: KubeCluster, namespace: str, **fields: str) -> list[dict[str, Any]]:
    """The Events of `namespace` matching the field selector `fields` (dots as `__`)."""
    selector = ",".join(f"{k.replace('__', '.')}={v}" for k, v in fields.items())
    found = cluster.get("v1", "Event", namespace=namespace, params={"fieldSelector": selector})
    return list(found["items"])


@pytest.mark.slow
def test_a_waiting_pod_gets_one_event_saying_why_and_the_exhausted_subnet_is_reported(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    scenario: Scenario = scenario_factory("ev-subnet", "10.64.0.0/28")
    node = "ev-n1"
    scenario.add_node(node)
    scenario.start_controller()
    daemon = scenario.start_daemon(node, config={"addTimeoutSeconds": 2})
    # Fill the subnet: ADDs until one waits its whole bound (code 11).
    for i in range(20):
        status, body = add(daemon, f"fill-{i}")
        if status != 200:
            assert body["code"] == 11, body
            break
    else:
        pytest.fail("a /28 gave 20 addresses")
    uid = make_pod(cluster, node, "waiter")
    tries = 3
    for attempt in range(tries):
        status, body = add(daemon, f"waiter-{attempt}", "waiter")
        assert status != 200 and body["code"] == 11, body
    why = daemon.get("/debug/pod?pod=default/waiter")["reason"]

    def waiting_event() -> dict[str, Any] | None:
        found = events(cluster, "default", involvedObject__name="waiter")
        return found[0] if found and found[0]["count"] == tries else None

    event = cluster.wait_for(waiting_event, timeout=30, what="the waiting Event counted")
    assert len(events(cluster, "default", involvedObject__name="waiter")) == 1  # no flood
    assert (event["type"], event["reason"]) == (WARNING, "WaitingForIPAddress")
    assert why["message"] in event["message"] and why["code"] in event["message"]
    assert event["involvedObject"] == {
        "kind": "Pod",
        "name": "waiter",
        "namespace": "default",
        "apiVersion": "v1",
        "uid": uid,
    }
    assert event["source"] == {"component": "cns", "host": node}
    assert event["reportingComponent"] == "cns" and event["reportingInstance"] == node
    assert event["lastTimestamp"] >= event["firstTimestamp"]
    # `kubectl describe pod` finds it by the pod's UID.
    assert (
        events(cluster, "default", involvedObject__uid=uid)[0]["metadata"]["name"]
        == (event["metadata"]["name"])
    )

    # The controller says the subnet is exhausted on the ClusterSubnet; the node on its NNC.
    subnet_events = cluster.wait_for(
        lambda: events(
            cluster, "default", involvedObject__kind="ClusterSubnet", reason="SubnetExhausted"
        ),
        timeout=30,
        what="the controller's SubnetExhausted Event",
    )
    assert subnet_events[0]["involvedObject"]["name"] == "ev-subnet"
    assert subnet_events[0]["source"]["component"] == "cns-controller"
    nnc_events = cluster.wait_for(
        lambda: events(
            cluster, KUBE_SYSTEM, involvedObject__kind="NodeNetworkConfig", reason="SubnetExhausted"
        ),
        timeout=30,
        what="the node's SubnetExhausted Event on its NNC",
    )
    assert nnc_events[0]["involvedObject"]["name"] == node
    assert nnc_events[0]["involvedObject"]["uid"] == scenario.nnc(node)["metadata"]["uid"]
    assert daemon.metrics()["cns_events_written_total"] >= 3


@pytest.mark.slow
def test_an_out_of_subnet_address_is_refused_with_an_event_and_the_api_down_blocks_no_add(
    scenario_factory: Any, cluster: KubeCluster
) -> None:
    scenario: Scenario = scenario_factory("ev-down", "10.65.0.0/24")
    node = "ev-n2"
    scenario.add_node(node)
    scenario.start_controller()
    daemon = scenario.start_daemon(node, config={"addTimeoutSeconds": 5})
    pods = [f"down-{i}" for i in range(6)]
    for pod in pods:
        make_pod(cluster, node, pod)
    scenario.wait(lambda: daemon.pool()["ips"]["Available"] >= len(pods), "free addresses")
    status, body = add(daemon, "refused-0", pods[0], requestedIP="192.0.2.5")
    assert status != 200 and "192.0.2.5" in body["msg"], body
    refused = cluster.wait_for(
        lambda: events(cluster, "default", involvedObject__name=pods[0]),
        timeout=30,
        what="the refused address's Event",
    )
    assert refused[0]["reason"] == "RequestedIPAddressRefused"
    assert "192.0.2.5" in refused[0]["message"]
    # A malformed subnet annotation: code 7, and the pod's Event names the annotation.
    make_pod(cluster, node, "bad-subnets", {"acn.azure.com/subnets": "Not_A_Subnet"})
    status, body = add(daemon, "bad-subnets-0", "bad-subnets")
    assert body["code"] == 7 and "acn.azure.com/subnets" in body["msg"], body
    invalid = cluster.wait_for(
        lambda: events(cluster, "default", involvedObject__name="bad-subnets"),
        timeout=30,
        what="the invalid annotation's Event",
    )
    assert invalid[0]["reason"] == "SubnetAnnotationInvalid"
    assert "Not_A_Subnet" in invalid[0]["message"]

    cluster.stop_apiserver()
    try:
        # Every ADD is answered while notes pile up for a writer that cannot reach the API.
        for i, pod in enumerate(pods[1:]):
            status, body = add(daemon, f"refused-{i + 1}", pod, requestedIP="192.0.2.6")
            assert status != 200 and "192.0.2.6" in body["msg"], body
            status, body = add(daemon, f"ok-{i}", pod)
            assert status == 200, body
        daemon.wait_pool(
            lambda _: daemon.metrics().get('cns_events_lost_total{why="write-failed"}', 0) >= 1,
            "a lost write counted",
        )
    finally:
        cluster.start_apiserver()
    assert '"event_lost"' in daemon.log()
    # The API back: the next note's write lands.
    status, body = add(daemon, "refused-after", pods[0], requestedIP="192.0.2.7")
    assert status != 200
    cluster.wait_for(
        lambda: any("192.0.2.7" in e["message"] for e in events(cluster, "default")),
        timeout=30,
        what="an Event written once the API server is back",
    )


@pytest.mark.slow
def test_a_full_outbox_drops_and_counts_and_the_rest_is_written(cluster: KubeCluster) -> None:
    async def run() -> tuple[EventRecorder, list[dict[str, Any]]]:
        kube = await connect(str(cluster.kubeconfig_for(DAEMON_USER)))
        async with kube:
            recorder = EventRecorder(kube, component="cns", host="outbox-node", capacity=2)
            with capture_logs() as logs:
                for i in range(10):  # ten objects: ten aggregates; no writer runs meanwhile
                    about = ObjectRef("Pod", f"outbox-{i}", "default")
                    recorder.record(Note(about, WARNING, "WaitingForIPAddress", f"try {i}"))
            await recorder.drain()
            return recorder, logs

    recorder, logs = asyncio.run(run())
    assert (recorder.outbox.dropped, recorder.written, recorder.failed) == (8, 2, 0)
    assert [entry["event"] for entry in logs] == ["event_lost"]  # one line per spell
    assert logs[0]["why"] == "outbox-full"
    written = [e for e in events(cluster, "default") if e["source"].get("host") == "outbox-node"]
    assert sorted(e["involvedObject"]["name"] for e in written) == ["outbox-0", "outbox-1"]
