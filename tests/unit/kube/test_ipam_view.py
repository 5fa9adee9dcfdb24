"""Reading the cluster for `cns ipam` (`cns.kube.ipam_view`): garbage in an NNC, an IPBlock or
a pod is named by object and field, and what can be read still is."""

from __future__ import annotations

from typing import Any

from cns.core.allocation import Entry
from cns.core.ipam_audit import Granted, Recorded, Unreadable
from cns.kube.ipam_view import node_config, pod_holdings, recorded_entries


def _nnc(status: Any, spec: Any = None) -> Any:
    return {"metadata": {"name": "n1", "uid": "u1"}, "spec": spec or {"requestedIPCount": 2},
            "status": status}  # fmt: skip


def _container(*assignments: dict[str, str]) -> dict[str, Any]:
    return {"id": "nc-1", "primaryIP": "10.9.0.4", "subnetAddressSpace": "10.9.0.0/24",
            "defaultGateway": "10.9.0.1", "ipAssignments": list(assignments)}  # fmt: skip


def test_an_nncs_grants_are_read_and_a_bad_assignment_is_named() -> None:
    unreadable: list[Unreadable] = []
    good, bad_ip = {"name": "ip-a", "ip": "10.9.0.5"}, {"name": "ip-b", "ip": "not-an-ip"}
    nnc = _nnc({"networkContainers": [_container(good, bad_ip)]})
    config = node_config(nnc, unreadable)
    assert config.granted == (
        Granted("n1", "10.9.0.4", "nc-1", primary=True),
        Granted("n1", "10.9.0.5", "ip-a"),
    )
    assert config.requested == 2
    (bad,) = unreadable
    assert (bad.kind, bad.name) == ("NodeNetworkConfig", "n1")
    assert bad.field.startswith("status.networkContainers[id=nc-1].ipAssignments[name=ip-b].")
    assert "not-an-ip" in bad.why


def test_an_nnc_whose_fields_are_the_wrong_shape_is_named_field_by_field() -> None:
    unreadable: list[Unreadable] = []
    config = node_config(_nnc({"networkContainers": "lots"}, {"requestedIPCount": "x"}), unreadable)
    assert config.granted == ()
    assert [(u.field, u.why) for u in unreadable] == [
        ("spec.requestedIPCount", "'x' is not a count"),
        ("status.networkContainers", "not a list"),
    ]
    unreadable.clear()
    node_config(_nnc(["not", "an", "object"]), unreadable)
    assert [u.field for u in unreadable] == ["status"]


def test_an_ipblocks_entries_are_read_and_each_bad_one_is_named() -> None:
    unreadable: list[Unreadable] = []
    block = {"metadata": {"name": "s-b0"}, "spec": {"subnet": "s", "cidr": "10.9.0.0/24",
             "allocations": {"10.9.0.5": "n1 ip-a u1", "10.9.0.6": "one-word",
                             "10.9.1.7": "n1 ip-b u1", "10.9.0.x": "n1 ip-c u1"}}}  # fmt: skip
    assert recorded_entries(block, unreadable) == [
        Recorded("10.9.0.5", "s", "s-b0", Entry("n1", "ip-a", uid="u1"))
    ]
    assert sorted((u.field, u.why) for u in unreadable) == [
        (
            "spec.allocations[10.9.0.6]",
            "'one-word' is not '<node> <id> <uid> [primary] [releasing]'",
        ),
        ("spec.allocations[10.9.0.x]", "the key is not an IP address"),
        ("spec.allocations[10.9.1.7]", "not in the block's 10.9.0.0/24"),
    ]
    unreadable.clear()
    assert recorded_entries({"metadata": {"name": "b"}, "spec": {"cidr": "x"}}, unreadable) == []
    assert [u.field for u in unreadable] == ["spec.cidr"]


def test_a_pods_addresses_are_read_and_a_bad_one_is_named() -> None:
    unreadable: list[Unreadable] = []
    listed = [{"ip": "10.9.0.5"}, {"ip": "nope"}]
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "n1"},
           "status": {"phase": "Succeeded", "podIPs": listed}}  # fmt: skip
    (held,) = pod_holdings(pod, unreadable)
    assert (held.pod, held.node, held.address, held.live) == ("ns/p", "n1", "10.9.0.5", False)
    assert [(u.kind, u.name, u.field) for u in unreadable] == [
        ("Pod", "ns/p", "status.podIPs[1].ip")
    ]
    host = {**pod, "spec": {"nodeName": "n1", "hostNetwork": True}}
    assert pod_holdings(host, unreadable) == []
