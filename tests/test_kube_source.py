"""KubeSource without an API server: the race between the NNC watch and the reply to a patch."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from cns.core.types import PoolRequest, Scaler
from cns.kube.client import KubeClient
from cns.kube.source import KubeSource


def nnc(resource_version: str, requested: int, nc_version: int) -> dict[str, Any]:
    return {
        "apiVersion": "acn.azure.com/v1alpha",
        "kind": "NodeNetworkConfig",
        "metadata": {
            "name": "node1",
            "namespace": "kube-system",
            "resourceVersion": resource_version,
        },
        "spec": {"requestedIPCount": requested, "ipsNotInUse": []},
        "status": {"networkContainers": [{"id": "nc1", "version": nc_version}]},
    }


def kube_source(api: client.ApiClient, **options: Any) -> KubeSource:
    return KubeSource(
        KubeClient(api),
        node_name="node1",
        subnet_name="pods",
        fallback_scaler=Scaler(batch_size=16),
        **options,
    )


class RacingCustomObjects:
    """The watch delivers the controller's answer (status version 3) while the reply to our
    patch, which the API server produced before that answer, is still on its way."""

    def __init__(self, source: KubeSource) -> None:
        self.source = source

    async def patch_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        answered = nnc("12", requested=63, nc_version=3)
        self.source.nnc.put(answered)
        return nnc("11", requested=63, nc_version=2)


async def test_a_late_patch_reply_does_not_roll_back_the_watched_status() -> None:
    async with client.ApiClient() as api:
        source = kube_source(api)
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        source.kube.custom = RacingCustomObjects(source)  # type: ignore[assignment]
        await source.publish(PoolRequest(requested_ip_count=63))
        (cached,) = source.nnc.objects.values()
        assert cached["spec"]["requestedIPCount"] == 63
        assert cached["status"]["networkContainers"][0]["version"] == 3


def pod(name: str, phase: str = "Pending", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", **meta},
        "spec": {"nodeName": "node1"},
        "status": {"phase": phase},
    }


async def test_pod_events_reach_the_node_only_when_the_demand_changes() -> None:
    async with client.ApiClient() as api:
        source = kube_source(api)
        delivered: list[int] = []
        source._listener = lambda state: delivered.append(state.pod_demand)
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        for collection in (source.nnc, source.subnet, source.subnet_state):
            collection.synced.set()

        def event(obj: dict[str, Any] | None, name: str) -> None:
            if obj is None:
                source.pods.discard(f"default/{name}")
            else:
                source.pods.put(obj)
            source.pods.on_change()

        source.pods.synced.set()
        event(pod("a"), "a")  # the first synced state always goes to the node
        event(pod("b"), "b")
        event(pod("b", "Running"), "b")  # status updates: same demand, not delivered
        event(pod("a", "Running"), "a")
        event(pod("a", "Running", deletionTimestamp="2026-11-22T00:00:00Z"), "a")
        event(pod("c", "Succeeded"), "c")  # a finished pod wants no IP
        event(None, "a")
        source._changed()  # an NNC change is always delivered
        assert delivered == [1, 2, 1, 1]


class RecordingCustomObjects:
    """Takes every patch of the NNC and answers with the NNC patched."""

    def __init__(self, current: dict[str, Any]) -> None:
        self.current = current
        self.patches: list[dict[str, Any]] = []

    async def patch_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        patch = args[5]
        self.patches.append(patch)
        self.current = {**self.current, "spec": {**self.current["spec"], **patch["spec"]}}
        return self.current


async def test_further_subnets_are_read_from_their_containers_and_published_in_spec_subnets() -> (
    None
):
    """One network container per subnet (`subnetName`): the primary's (the first) feeds the
    top level, the IPv6 one its lane; the node's further requests go out as `spec.subnets`."""
    dual = nnc("10", requested=15, nc_version=2)
    dual["spec"]["subnets"] = [{"name": "v6pods", "requestedIPCount": 15, "ipsNotInUse": []}]
    dual["status"]["networkContainers"] = [
        {"id": "nc4", "subnetName": "pods", "subnetAddressSpace": "10.0.0.0/24", "version": 2},
        {"id": "nc6", "subnetName": "v6pods", "subnetAddressSpace": "fd00::/64", "version": 1},
    ]
    async with client.ApiClient() as api:
        source = kube_source(api)
        source.nnc.put(dual)
        state = source.snapshot()
        assert [nc.id for nc in state.containers] == ["nc4"]
        assert list(state.subnets) == ["v6pods"]
        six = state.subnets["v6pods"]
        assert [nc.id for nc in six.containers] == ["nc6"]
        assert six.request == PoolRequest(15)
        recorder = RecordingCustomObjects(dual)
        source.kube.custom = recorder  # type: ignore[assignment]
        await source.publish(PoolRequest(15), {"v6pods": PoolRequest(15)})
        assert recorder.patches == []  # what the NNC says already
        await source.publish(PoolRequest(15), {"v6pods": PoolRequest(31, ("ip6-1",))})
        (patch,) = recorder.patches
        assert patch["spec"]["subnets"] == [
            {"name": "v6pods", "requestedIPCount": 31, "ipsNotInUse": ["ip6-1"], "requestedIPs": []}
        ]
        await source.publish(PoolRequest(15))  # no further subnet wanted any more: emptied
        assert recorder.patches[-1]["spec"]["subnets"] == []


async def test_a_node_of_one_subnet_publishes_no_spec_subnets() -> None:
    async with client.ApiClient() as api:
        source = kube_source(api)
        single = nnc("10", requested=15, nc_version=2)
        source.nnc.put(single)
        recorder = RecordingCustomObjects(single)
        source.kube.custom = recorder  # type: ignore[assignment]
        await source.publish(PoolRequest(31))
        (patch,) = recorder.patches
        assert "subnets" not in patch["spec"]
