"""KubeSource without an API server: the race between the NNC watch and the reply to a patch,
what the pod watch delivers, the subnets an ADD's pod chooses, the further subnets' objects."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
from kubernetes_asyncio import client

from cns.core.subnet_choice import SubnetChoiceInvalid, SubnetChoiceUnknown
from cns.core.types import PoolRequest, Scaler
from cns.kube.client import KubeClient
from cns.kube.cluster_subnet import subnet_family
from cns.kube.pods import SUBNETS_ANNOTATION
from cns.kube.snapshot import MAX_SNAPSHOT_BYTES
from cns.node.control_plane import SourceState
from cns.node.kube_source import KubeSource


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


def annotated(obj: dict[str, Any], subnets: str) -> dict[str, Any]:
    obj["metadata"]["annotations"] = {SUBNETS_ANNOTATION: subnets}
    return obj


def namespace(name: str, subnets: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": name}}
    return annotated(obj, subnets) if subnets is not None else obj


def synced_source(api: client.ApiClient, **options: Any) -> tuple[KubeSource, list[SourceState]]:
    """A source whose watches have all listed (nothing), delivering to the list returned."""
    source = kube_source(api, **options)
    delivered: list[SourceState] = []
    source._listener = delivered.append
    for collection in source._collections:
        collection.synced.set()
    return source, delivered


async def test_pods_count_in_the_subnets_they_choose() -> None:
    """Demand per subnet: the pod's annotation, else its namespace's; a dual-stack pod in both
    lanes; the primary named by name is the primary; a malformed choice counts nowhere; a
    subnet only pods choose is listed with its demand (the node asks for it ahead)."""
    async with client.ApiClient() as api:
        source, delivered = synced_source(api)
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        source.namespaces.put(namespace("team-v6", "v6pods"))
        source.namespaces.put(namespace("bad", "v6pods,v6pods"))
        source.namespaces.put(namespace("default"))
        for name, ns, choice in [
            ("plain", "default", None),
            ("primary-by-name", "default", "pods"),
            ("dual", "default", "pods, v6pods"),
            ("ns-chooses", "team-v6", None),
            ("pod-wins", "team-v6", "blue"),
            ("unknown-namespace", "nowhere", None),
            ("broken", "bad", None),
            ("broken-too", "default", "Blue"),
        ]:
            obj = pod(name)
            obj["metadata"]["namespace"] = ns
            source.pods.put(annotated(obj, choice) if choice else obj)
        finished = annotated(pod("done", "Succeeded"), "blue")
        source.pods.put(finished)
        source.pods.on_change()
        state = delivered[-1]
        assert state.pod_demand == 4  # plain, primary-by-name, dual, unknown-namespace
        assert {name: s.pod_demand for name, s in state.subnets.items()} == {
            "blue": 1,
            "v6pods": 2,
        }
        assert all(not s.containers for s in state.subnets.values())


async def test_a_malformed_annotation_is_logged_once_per_object_and_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with client.ApiClient() as api:
        source, _ = synced_source(api)
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        source.pods.put(annotated(pod("a"), "x,,y"))
        for _ in range(3):
            source.pods.on_change()
            with pytest.raises(SubnetChoiceInvalid, match="of pod default/a: name 2 is empty"):
                await source.choose_subnets("default", "a", ())
        source.pods.put(annotated(pod("a"), "x,x"))  # another value: said again
        source.pods.on_change()
        logged = capsys.readouterr().out
        assert logged.count("subnets_annotation_invalid") == 2, logged


class Response:
    def __init__(self, status: int, body: dict[str, Any] | None = None) -> None:
        self.status, self.reason, self.body = status, "Reason", body or {}

    async def read(self) -> bytes:
        return json.dumps(self.body).encode()

    def release(self) -> None:
        pass


class CoreReads:
    """The core API's reads of one pod and one namespace, counted; `failing` makes them fail."""

    def __init__(self, pods: dict[str, Response], namespaces: dict[str, Response]) -> None:
        self.pods, self.namespaces = pods, namespaces
        self.reads: list[str] = []
        self.failing: Exception | None = None

    async def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Response:
        self.reads.append(f"pod {namespace}/{name}")
        if self.failing is not None:
            raise self.failing
        return self.pods.get(f"{namespace}/{name}") or Response(404)

    async def read_namespace(self, name: str, **_: Any) -> Response:
        self.reads.append(f"namespace {name}")
        if self.failing is not None:
            raise self.failing
        return self.namespaces.get(name) or Response(404)


async def test_an_add_reads_a_pod_the_watch_has_not_delivered_yet() -> None:
    async with client.ApiClient() as api:
        source, _ = synced_source(api)
        late = annotated(pod("late"), "blue")
        reads = CoreReads(
            {"default/late": Response(200, late)},
            {"team-v6": Response(200, namespace("team-v6", "v6pods"))},
        )
        source.kube.core = reads  # type: ignore[assignment]
        source.pods.put(pod("cached"))
        source.namespaces.put(namespace("default"))
        assert await source.choose_subnets("default", "cached", ("cfg",)) == ("cfg",)
        assert reads.reads == []  # both in the caches
        assert await source.choose_subnets("default", "late", ()) == ("blue",)
        assert reads.reads == ["pod default/late"]  # its own annotation: no namespace read
        assert await source.choose_subnets("team-v6", "gone", ("cfg",)) == ("v6pods",)
        assert reads.reads[1:] == ["pod team-v6/gone", "namespace team-v6"]
        assert await source.choose_subnets("", "", ("cfg",)) == ("cfg",)  # no pod named
        reads.failing = TimeoutError()
        with pytest.raises(SubnetChoiceUnknown, match="cannot read pod default/other"):
            await source.choose_subnets("default", "other", ())
        reads.failing = None
        reads.pods["default/other"] = Response(500)
        with pytest.raises(SubnetChoiceUnknown, match="HTTP 500"):
            await source.choose_subnets("default", "other", ())


def subnet_objects(name: str, *, exhausted: bool, batch: int) -> list[dict[str, Any]]:
    return [
        {"metadata": {"name": name}, "spec": {"scaler": {"batchSize": batch}}},
        {"metadata": {"name": name}, "status": {"exhausted": exhausted}},
    ]


async def test_further_subnets_exhaustion_and_scaler_come_from_their_objects_and_snapshot(
    tmp_path: Path,
) -> None:
    """Each further subnet's ClusterSubnet and ClusterSubnetState are watched while the node
    holds, asks for or has pods choosing it; they are kept in the snapshot file, and a file
    written before they were (no `subnets` key) still loads."""
    dual = nnc("10", requested=15, nc_version=2)
    dual["status"]["networkContainers"] = [
        {"id": "nc4", "subnetName": "pods", "subnetAddressSpace": "10.0.0.0/24", "version": 2},
        {"id": "nc6", "subnetName": "v6pods", "subnetAddressSpace": "fd00::/64", "version": 1},
    ]
    snapshot = tmp_path / "kube-snapshot.json"
    async with client.ApiClient() as api:
        source, delivered = synced_source(api, snapshot_path=snapshot)
        source.nnc.put(dual)
        source.pods.put(annotated(pod("p"), "blue"))
        source._changed()
        assert set(source._further_watches) == {"v6pods", "blue"}
        six = delivered[-1].subnets["v6pods"]
        assert (six.exhausted, six.scaler) == (False, None)  # not read yet
        for name, exhausted, batch in (("v6pods", True, 1), ("blue", False, 8)):
            watches = source._further_watches[name]
            cs, css = subnet_objects(name, exhausted=exhausted, batch=batch)
            watches.subnet.put(cs)
            watches.state.put(css)
        source._changed()
        state = delivered[-1]
        six, blue = state.subnets["v6pods"], state.subnets["blue"]
        assert six.exhausted and six.scaler is not None and six.scaler.batch_size == 1
        assert not blue.exhausted and blue.scaler is not None and blue.scaler.batch_size == 8
        assert blue.pod_demand == 1 and not blue.containers

        restarted = kube_source(api, snapshot_path=snapshot)
        assert restarted._load_snapshot()
        again = restarted.snapshot(from_snapshot=True)
        assert again.subnets["v6pods"] == six  # pods are not in the file: v6pods has none
        assert set(restarted._further_watches) == {"v6pods", "blue"}
        assert (
            restarted._further_watches["blue"].subnet.first()
            == subnet_objects("blue", exhausted=False, batch=8)[0]
        )

        source.pods.discard("default/p")  # no pod chooses blue any more: its watches stop
        source._changed()
        assert set(source._further_watches) == {"v6pods"}
        assert set(delivered[-1].subnets) == {"v6pods"}

        old = json.loads(snapshot.read_text())
        del old["subnets"]
        snapshot.write_text(json.dumps(old))
        older = kube_source(api, snapshot_path=snapshot)
        assert older._load_snapshot()
        assert older.snapshot().subnets["v6pods"].exhausted is False


def wrong_snapshots() -> dict[str, tuple[Any, str]]:
    """Contents of kube-snapshot.json of the wrong shape, each with what the warning says."""
    ok = nnc("10", requested=15, nc_version=2)
    wrong_count = nnc("10", requested=15, nc_version=2)
    wrong_count["spec"]["requestedIPCount"] = "many"
    unnamed = nnc("10", requested=15, nc_version=2)
    unnamed["metadata"] = "node1"
    return {
        "array": ([], "not a JSON object but an array"),
        "null": (None, "not a JSON object but null"),
        "nnc array": ({"nodenetworkconfig": []}, "nodenetworkconfig: not an object"),
        "no nnc": ({"clustersubnet": {}}, "nodenetworkconfig: missing"),
        "unnamed": ({"nodenetworkconfig": unnamed}, "metadata.name is not a string"),
        "count": ({"nodenetworkconfig": wrong_count}, "nodenetworkconfig: cannot be read"),
        "subnet": ({"nodenetworkconfig": ok, "clustersubnet": "pods"}, "clustersubnet: not an"),
        "state": (
            {"nodenetworkconfig": ok, "clustersubnetstate": {"metadata": {"name": 7}}},
            "clustersubnetstate: metadata.name is not a string",
        ),
        "subnets": ({"nodenetworkconfig": ok, "subnets": [1]}, "subnets: not an object"),
        "further": (
            {"nodenetworkconfig": ok, "subnets": {"v6": {"clustersubnet": [1]}}},
            "subnets.v6.clustersubnet: not an object",
        ),
    }


async def test_a_snapshot_nnc_with_invalid_entries_loads_with_them_left_out(
    tmp_path: Path,
) -> None:
    """An assignment without `ip` or a container whose version is not a number made the daemon
    exit at start (KeyError, ValueError). The snapshot's NNC stands in for the API server's, so
    it goes through the same parser: the entries at fault are left out with their reasons, as
    they would be from a watch, and the rest of the file serves."""
    saved = nnc("10", requested=15, nc_version=2)
    saved["status"]["networkContainers"] = [
        {"id": "nc1", "version": 2, "subnetAddressSpace": "10.0.0.0/24",
         "ipAssignments": [{"name": "a"}, {"name": "b", "ip": "10.0.0.7"}]},
        {"id": "nc2", "version": "two", "subnetAddressSpace": "10.0.1.0/24"},
    ]  # fmt: skip
    snapshot = tmp_path / "kube-snapshot.json"
    snapshot.write_text(json.dumps({"nodenetworkconfig": saved}))
    async with client.ApiClient() as api:
        source = kube_source(api, snapshot_path=snapshot)
        assert source._load_snapshot() is True
        state = source.snapshot()
    (container,) = state.containers
    assert container.id == "nc1" and [c.address for c in container.ip_configs] == ["10.0.0.7"]
    assert {(i.id, i.field, i.assignment) for i in state.ignored} == {
        ("nc1", "ipAssignments.ip", "a"),
        ("nc2", "version", ""),
    }, state.ignored


@pytest.mark.parametrize("case", sorted(wrong_snapshots()))
async def test_a_snapshot_of_the_wrong_shape_is_ignored_naming_the_file(
    tmp_path: Path, case: str
) -> None:
    """`[]` made the daemon exit at start (AttributeError) without naming the file; any wrong
    type anywhere did the same."""
    content, reason = wrong_snapshots()[case]
    snapshot = tmp_path / "kube-snapshot.json"
    snapshot.write_text(json.dumps(content))
    async with client.ApiClient() as api:
        source = kube_source(api, snapshot_path=snapshot)
        with structlog.testing.capture_logs() as logs:
            assert source._load_snapshot() is False
        assert not source.nnc.objects and not source.subnet.objects
    (ignored,) = [line for line in logs if line["event"] == "kube_snapshot_ignored"]
    assert ignored["file"] == str(snapshot) and reason in ignored["reason"], ignored


@pytest.mark.parametrize("kind", ["not JSON", "huge", "FIFO", "directory", "symlink"])
async def test_a_snapshot_that_is_not_a_small_json_file_is_ignored_unread(
    tmp_path: Path, kind: str
) -> None:
    """Read with a bound, never through a symlink, never blocking on a FIFO."""
    snapshot = tmp_path / "kube-snapshot.json"
    if kind == "not JSON":
        snapshot.write_bytes(b"\xff{")
    elif kind == "huge":
        with snapshot.open("wb") as file:
            file.truncate(MAX_SNAPSHOT_BYTES + 1)  # sparse: nothing is written
    elif kind == "FIFO":
        os.mkfifo(snapshot)
    elif kind == "directory":
        snapshot.mkdir()
    else:
        good = tmp_path / "elsewhere.json"
        good.write_text(json.dumps({"nodenetworkconfig": nnc("10", 15, 2)}))
        snapshot.symlink_to(good)
    async with client.ApiClient() as api:
        source = kube_source(api, snapshot_path=snapshot)
        loaded: list[bool] = []
        with structlog.testing.capture_logs() as logs:
            # In a thread of its own: a read that blocked would fail here, not hang the tests.
            reader = threading.Thread(target=lambda: loaded.append(source._load_snapshot()))
            reader.daemon = True
            reader.start()
            reader.join(30)
        assert loaded == [False]
    (ignored,) = [line for line in logs if line["event"] == "kube_snapshot_ignored"]
    assert ignored["file"] == str(snapshot)
    said = {"not JSON": "not JSON", "huge": "larger than", "FIFO": "a FIFO, not a regular file",
            "directory": "a directory, not", "symlink": "a symlink, not"}  # fmt: skip
    assert said[kind] in ignored["reason"], ignored


def overflowing(name: str, cidr: str, overflow: Any = None, **spec: Any) -> dict[str, Any]:
    """A ClusterSubnet `name` of `cidr`, naming `overflow` when given."""
    body: dict[str, Any] = {"subnet": cidr, **spec}
    if overflow is not None:
        body["overflow"] = overflow
    return {"metadata": {"name": name}, "spec": body}


async def test_overflow_subnets_are_read_from_the_primary_and_their_own_objects() -> None:
    """The primary ClusterSubnet's spec.overflow is followed in order, each overflow subnet's
    objects watched (at once: set at run time, no restart) and read for its room: exhausted,
    draining, of the primary's family (an IPv6 one, or one not read yet, has none). Pods that
    choose the primary are named, so one holding an overflow address counts once."""
    async with client.ApiClient() as api:
        source, delivered = synced_source(api)
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        source.subnet.put(overflowing("pods", "10.0.0.0/24"))
        source.pods.put(pod("plain"))
        source.pods.put(annotated(pod("elsewhere"), "blue"))
        source._changed()
        assert delivered[-1].overflow == () and set(source._further_watches) == {"blue"}
        source.subnet.put(overflowing("pods", "10.0.0.0/24", ["full", "six", "more", "unread"]))
        source._changed()
        assert set(source._further_watches) == {"blue", "full", "six", "more", "unread"}
        objects = {
            "full": overflowing("full", "10.1.0.0/24"),
            "six": overflowing("six", "fd00::/64"),
            "more": overflowing("more", "10.2.0.0/24"),
        }
        for name, cs in objects.items():
            source._further_watches[name].subnet.put(cs)
        source._further_watches["full"].state.put(
            subnet_objects("full", exhausted=True, batch=1)[1]
        )
        source._changed()
        state = delivered[-1]
        assert [(c.name, c.has_room) for c in state.overflow] == [
            ("full", False),
            ("six", False),
            ("more", True),
            ("unread", False),
        ]
        assert state.overflow[0].exhausted and not state.overflow[1].usable
        assert state.primary_pods == frozenset({"default/plain"}) and state.pod_demand == 1
        assert set(state.subnets) == {"blue"}  # named for overflow: not asked for yet
        source._further_watches["more"].subnet.put(
            overflowing("more", "10.2.0.0/24", draining=True)
        )
        source._changed()
        assert delivered[-1].overflow[2].draining


@pytest.mark.parametrize(
    ("overflow", "reason"),
    [
        ("more", "is not a list of ClusterSubnet names"),
        (["more", 7], "is not a list of ClusterSubnet names"),
        (["a", "b", "c", "d", "e"], "names 5 subnets, at most 4"),
        (["More"], "is not a ClusterSubnet name"),
        (["more", "more"], "names a subnet twice"),
        (["pods"], "names the subnet itself"),
    ],
)
async def test_a_malformed_overflow_list_is_followed_not_at_all_and_said_once(
    overflow: Any, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with client.ApiClient() as api:
        source, delivered = synced_source(api)
        source.nnc.put(nnc("10", requested=15, nc_version=2))
        source.subnet.put(overflowing("pods", "10.0.0.0/24", overflow))
        source._changed()
        source._changed()
        assert delivered[-1].overflow == () and not source._further_watches
        said = [line for line in capsys.readouterr().out.splitlines() if "overflow_ignored" in line]
        assert len(said) == 1 and "spec.overflow" in said[0] and reason in said[0]
        source.subnet.put(overflowing("pods", "10.0.0.0/24", ["more"]))
        source._changed()
        assert [c.name for c in delivered[-1].overflow] == ["more"]
        assert "overflow_no_longer_ignored" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "family"),
    [
        ({"subnet": "10.2.0.0/24"}, 4),
        ({"subnet": "fd00::/64"}, 6),
        ({"subnet": "10.2.0.1/24"}, 4),  # host bits set: still readable as a family
        ({"subnet": "not-a-network"}, None),
        ({"subnet": 7}, None),
        ({"subnet": ""}, None),
        ({}, None),
        (None, None),
    ],
)
def test_an_overflow_subnets_family_is_read_or_none_never_an_error(
    spec: Any, family: int | None
) -> None:
    """What a node reads of another ClusterSubnet's `spec.subnet` to compare families: garbage
    (written past the CRD) is no family, so that subnet has no room; nothing raises."""
    cs: dict[str, Any] = {"metadata": {"name": "more"}}
    if spec is not None:
        cs["spec"] = spec
    assert subnet_family(cs) == family
