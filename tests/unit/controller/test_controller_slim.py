"""The controller's watch caches keep NNCs and IPBlocks slimmed (`slim_nnc`, `slim_block`): every
function that reads a cached object must answer from the slim object what it answers from the
object the API server sent, including raising where it raises. Random objects, well formed and
not (fields missing, of the wrong type, extra fields nothing reads)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cns.controller.state import block_record, node_view
from cns.controller.survey import NNCSeen
from cns.core.allocation import Entry
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, Scaler
from cns.kube.ipblock import block_entries, block_spec, encode_entry, slim_block
from cns.kube.nnc import (
    further_subnets,
    nnc_label_patch,
    nnc_status_patch,
    nnc_subnet,
    pool_request,
    release_requests,
    slim_nnc,
    subnet_request,
    subnet_requests,
)
from cns.kube.nnc_containers import network_containers
from cns.kube.objects import SUBNET_LABEL, conditional
from cns.kube.watch import WatchedCollection

SUBNET = Subnet("pods", "10.1.0.0/22")
OTHER = Subnet("other", "10.2.0.0/24")

junk: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.integers(-1, 3), st.text("ab", max_size=2), st.just([])
)
names = st.sampled_from(["a", "b", "n1", "x y"])
addresses = st.sampled_from(["10.1.0.5", "10.1.1.7", "10.1.3.255", "10.2.0.9", "fd00::1"])


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value, or a value of the wrong type one time in eight."""
    return st.integers(0, 7).flatmap(lambda roll: junk if roll == 0 else value)


def rarely_none(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.integers(0, 7).flatmap(lambda roll: st.none() if roll == 0 else value)


@st.composite
def fields(draw: st.DrawFn, shape: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """A dict with any subset of the fields of `shape`, plus one nothing reads at times."""
    obj = {key: draw(value) for key, value in shape.items() if draw(st.integers(0, 7))}
    if draw(st.booleans()):
        obj["unread"] = draw(junk)
    return obj


assignment = fields({"name": maybe(names), "ip": maybe(addresses)})
container = fields(
    {
        "id": maybe(names),
        "primaryIP": maybe(addresses),
        "subnetName": maybe(st.sampled_from(["pods", "other", ""])),
        "subnetAddressSpace": maybe(st.sampled_from(["10.1.0.0/22", "10.2.0.0/24", "bad"])),
        "defaultGateway": maybe(st.just("10.1.0.1")),
        "nodeIP": st.just("10.0.0.4"),
        "version": maybe(st.integers(0, 3)),
        "ipAssignments": maybe(st.lists(assignment, max_size=3)),
        # Azure's: a container of a type or mode the node cannot use is left out.
        "type": maybe(st.sampled_from(["vnet", "overlay", ""])),
        "assignmentMode": maybe(st.sampled_from(["dynamic", "static"])),
        "subnetID": st.just("/subscriptions/s/resourceGroups/g/.../subnets/pods"),
    }
)
subnet_entry = fields(
    {
        "name": maybe(st.sampled_from(["pods", "other", "ghost"])),
        "requestedIPCount": maybe(st.integers(0, 64)),
        "ipsNotInUse": maybe(st.lists(names, max_size=2)),
        "requestedIPs": maybe(st.lists(addresses, max_size=2)),
    }
)
scaler = st.one_of(
    st.just({"batchSize": 10, "requestThresholdPercent": 50, "releaseThresholdPercent": 150,
             "maxIPCount": 250, "minIPCount": 0}),
    fields({"batchSize": maybe(st.integers(0, 32)), "maxIPCount": maybe(st.integers(0, 9))}),
)  # fmt: skip
nnc_objects = st.builds(
    lambda meta, labels, spec, status: {
        "apiVersion": "acn.azure.com/v1alpha",
        "kind": "NodeNetworkConfig",
        "metadata": {**meta, **({"labels": labels} if labels is not None else {})},
        **({"spec": spec} if spec is not None else {}),
        **({"status": status} if status is not None else {}),
    },
    fields(
        {
            "name": names,
            "namespace": st.just("kube-system"),
            "uid": maybe(st.sampled_from(["u1", "u2"])),
            "resourceVersion": st.sampled_from(["1", "22"]),
            "generation": st.just(3),
            "managedFields": st.just([{"manager": "kubectl"}]),
            "ownerReferences": st.just([{"kind": "Node", "name": "a"}]),
        }
    ),
    rarely_none(maybe(st.dictionaries(st.sampled_from([SUBNET_LABEL, "other"]), maybe(names)))),
    rarely_none(
        maybe(
            fields(
                {
                    "requestedIPCount": maybe(st.integers(0, 64)),
                    "ipsNotInUse": maybe(st.lists(names, max_size=2)),
                    "requestedIPs": maybe(st.lists(addresses, max_size=2)),
                    "subnets": maybe(st.lists(maybe(subnet_entry), max_size=3)),
                }
            )
        )
    ),
    rarely_none(
        maybe(
            fields(
                {
                    "scaler": maybe(scaler),
                    "status": st.just("Updated"),
                    "assignedIPCount": st.integers(0, 3),
                    "ipsToRelease": maybe(st.lists(names, max_size=2)),
                    "networkContainers": maybe(st.lists(maybe(container), max_size=2)),
                }
            )
        )
    ),
)

entries = st.builds(
    lambda node, ident, primary, releasing, uid: Entry(node, ident, primary, releasing, uid),
    st.sampled_from(["a", "b"]),
    st.sampled_from(["g1", "g2"]),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["", "u1"]),
)
allocation = st.one_of(
    entries.map(encode_entry),
    entries.map(lambda e: {"node": e.node, "id": e.id, "uid": e.uid, "releasing": e.releasing}),
    st.sampled_from(["a", "a g1", "a g1 u1 bogus", "a g1 u1 primary primary", ""]),
    junk,
)
block_objects = st.builds(
    lambda meta, spec: {"apiVersion": "acn.azure.com/v1alpha1", "kind": "IPBlock",
                        "metadata": meta, **({"spec": spec} if spec is not None else {})},
    fields({"name": st.sampled_from(["pods-b0", "pods-b1", "other-b0"]),
            "resourceVersion": st.sampled_from(["1", "22"]),
            "labels": st.just({SUBNET_LABEL: "pods"}),
            "managedFields": st.just([{"manager": "cns"}])}),
    rarely_none(maybe(fields({
        "subnet": maybe(st.sampled_from(["pods", "other"])),
        "cidr": maybe(st.sampled_from(["10.1.0.0/24", "10.1.1.0/24", "10.2.0.0/24", "x"])),
        "allocations": maybe(st.dictionaries(addresses, allocation, max_size=4)),
    }))),
)  # fmt: skip


def answer(read: Callable[[dict[str, Any]], Any], obj: dict[str, Any]) -> Any:
    """What a reader answers, or the type of what it raises."""
    try:
        return ("answer", read(obj))
    except Exception as exc:
        return ("raises", type(exc))


NC = NetworkContainer(
    id="nc", primary_ips=("10.1.0.4",), subnet="10.1.0.0/22", gateway="10.1.0.1",
    ip_configs=(IPConfig("g1", "10.1.0.5"),), version=2, programmed_version=2,
)  # fmt: skip

OTHER_NC = NetworkContainer(
    id="nc2", primary_ips=("10.2.0.4",), subnet="10.2.0.0/24", gateway="10.2.0.1",
    ip_configs=(IPConfig("h1", "10.2.0.5"),), version=1, programmed_version=1,
)  # fmt: skip

NNC_READERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "key": WatchedCollection.key,
    "nnc_subnet": nnc_subnet,
    "seen": lambda obj: (lambda s: (s.name, s.subnet, s.held, s.further, s.asked))(NNCSeen.of(obj)),
    "subnet_requests": subnet_requests,
    "subnet_request_other": lambda obj: subnet_request(obj, "other"),
    "further_subnets": further_subnets,
    "node_view": lambda obj: node_view(SUBNET, obj),
    "node_view_other": lambda obj: node_view(OTHER, obj),
    "network_containers": network_containers,
    "pool_request": pool_request,
    "release_requests": release_requests,
    "label_patch": lambda obj: nnc_label_patch(obj, "pods"),
    "conditional": lambda obj: conditional({"spec": {}}, read=obj),
    "status_patch_same": lambda obj: nnc_status_patch(
        obj, scaler=Scaler(), release=[], nc=None, subnet_name="pods", subnet_full=False
    ),
    "status_patch_release": lambda obj: nnc_status_patch(
        obj,
        scaler=Scaler(batch_size=10),
        release=["a"],
        nc=None,
        subnet_name="pods",
        subnet_full=False,
    ),
    "status_patch_nc": lambda obj: nnc_status_patch(
        obj, scaler=Scaler(), release=[], nc=NC, subnet_name="pods", subnet_full=True
    ),
    "status_patch_further": lambda obj: nnc_status_patch(
        obj, scaler=None, release=["b"], nc=OTHER_NC, subnet_name="other", subnet_full=True
    ),
    "status_patch_further_same": lambda obj: nnc_status_patch(
        obj, scaler=None, release=[], nc=None, subnet_name="other", subnet_full=False
    ),
}

BLOCK_READERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "key": WatchedCollection.key,
    "block_spec": block_spec,
    "block_entries": block_entries,
    "block_record": lambda obj: block_record(SUBNET, obj),
    "block_record_other": lambda obj: block_record(OTHER, obj),
    "conditional": lambda obj: conditional({"spec": {}}, read=obj),
}


def same_answers(
    readers: dict[str, Callable[[dict[str, Any]], Any]],
    slim: Callable[[dict[str, Any]], dict[str, Any]],
    obj: dict[str, Any],
) -> None:
    sent = copy.deepcopy(obj)
    slimmed = slim(obj)
    assert obj == sent, "slimming changed the object it was given"
    for name, read in readers.items():
        assert answer(read, slimmed) == answer(read, obj), name
    assert slim(slimmed) == slimmed, "slimming a slim object changes it"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=nnc_objects)
def test_a_slim_nnc_reads_as_the_nnc_it_was_made_from(obj: dict[str, Any]) -> None:
    same_answers(NNC_READERS, slim_nnc, obj)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=block_objects)
def test_a_slim_ipblock_reads_as_the_ipblock_it_was_made_from(obj: dict[str, Any]) -> None:
    same_answers(BLOCK_READERS, slim_block, obj)


def test_a_slim_nnc_keeps_only_what_the_controller_reads_and_shares_the_model_s_objects() -> None:
    """A full NNC as the API server sends it: the slim one keeps no managedFields, owner
    references or fields the controller never reads, and its IP configs are the very objects
    the planning state's NodeView holds."""
    nc = {
        "id": "nc", "primaryIP": "10.1.0.4", "subnetName": "pods",
        "subnetAddressSpace": "10.1.0.0/22", "defaultGateway": "10.1.0.1", "nodeIP": "10.0.0.4",
        "version": 1, "ipAssignments": [{"name": "g1", "ip": "10.1.0.5"}],
    }  # fmt: skip
    obj = json.loads(
        json.dumps(
            {
                "metadata": {
                    "name": "a", "namespace": "kube-system", "uid": "u1", "resourceVersion": "7",
                    "labels": {SUBNET_LABEL: "pods"}, "managedFields": [{"manager": "x"}],
                    "ownerReferences": [{"kind": "Node"}], "creationTimestamp": "2026-01-01",
                },
                "spec": {"requestedIPCount": 16, "ipsNotInUse": ["g0"], "requestedIPs": []},
                "status": {"status": "Updated", "assignedIPCount": 1, "ipsToRelease": [],
                           "scaler": {"batchSize": 16}, "networkContainers": [nc]},
            }
        )
    )  # fmt: skip
    slim = slim_nnc(obj)
    assert set(slim["metadata"]) == {"name", "namespace", "uid", "resourceVersion", "labels"}
    assert set(slim["status"]) == {"ipsToRelease", "scaler", "networkContainers"}
    assert slim["status"]["networkContainers"][0]["nodeIP"] == "10.0.0.4"  # written back
    view = node_view(SUBNET, slim)
    assert view.nc is not None
    assert view.nc.ip_configs is slim["status"]["networkContainers"][0]["ipAssignments"]
    other = slim_nnc(json.loads(json.dumps(obj)))
    assert other["status"]["scaler"] is slim["status"]["scaler"]  # one dict for every NNC


def test_a_slim_ipblock_holds_the_decoded_entries() -> None:
    entry = Entry("a", "g1", uid="u1")
    block = {
        "metadata": {"name": "pods-b0", "resourceVersion": "3", "managedFields": []},
        "spec": {"subnet": "pods", "cidr": "10.1.0.0/24",
                 "allocations": {"10.1.0.5": encode_entry(entry), "10.1.0.6": "bogus"}},
    }  # fmt: skip
    slim = slim_block(block)
    assert slim["spec"]["allocations"] == {"10.1.0.5": entry}
    assert block_entries(slim) == block_entries(block) == {"10.1.0.5": entry}
    assert slim["metadata"] == {"name": "pods-b0", "resourceVersion": "3"}


def test_a_write_s_reply_is_cached_with_the_objects_written_when_it_holds_just_those() -> None:
    """The reply to the controller's own write, slimmed with what was written, keeps the
    written IP configs and entries (the plan's objects) instead of parsing copies of them: a
    round that grants every node its addresses would otherwise hold each twice."""
    written = (IPConfig("g1", "10.1.0.5"), IPConfig("g2", "10.1.0.6"))
    reply = {
        "metadata": {"name": "a", "resourceVersion": "9"},
        "status": {"networkContainers": [{"id": "nc", "ipAssignments": [
            {"name": c.id, "ip": c.address} for c in written]}]},
    }  # fmt: skip
    slim = slim_nnc(json.loads(json.dumps(reply)), written)
    assert slim["status"]["networkContainers"][0]["ipAssignments"] is written
    assert slim == slim_nnc(reply)
    other = slim_nnc(reply, written[:1])  # the server holds something else: its own
    assert other["status"]["networkContainers"][0]["ipAssignments"] == written
    assert other["status"]["networkContainers"][0]["ipAssignments"] is not written

    entries = {"10.1.0.5": Entry("a", "g1", uid="u1")}
    block = {
        "metadata": {"name": "pods-b0", "resourceVersion": "3"},
        "spec": {"subnet": "pods", "cidr": "10.1.0.0/24",
                 "allocations": {a: encode_entry(e) for a, e in entries.items()}},
    }  # fmt: skip
    assert slim_block(block, entries)["spec"]["allocations"] is entries
    assert slim_block(block, {})["spec"]["allocations"] == entries
    assert slim_block(block, {})["spec"]["allocations"] is not entries
    # Told what the write sent, a reply holding just that is not decoded; one that holds
    # anything else is read as the server has it.
    sent = dict(block["spec"]["allocations"])
    assert slim_block(block, entries, sent=sent)["spec"]["allocations"] is entries
    other = {"10.1.0.5": encode_entry(Entry("b", "g2", uid="u2"))}
    moved = block | {"spec": block["spec"] | {"allocations": other}}
    reread = slim_block(moved, entries, sent=sent)
    assert reread["spec"]["allocations"] == {"10.1.0.5": Entry("b", "g2", uid="u2")}
