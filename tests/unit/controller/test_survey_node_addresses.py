"""The survey serves each subnet with the nodes' own addresses excluded, reads them with checks,
and gives the planning state the same subnet object while nothing changed."""

from __future__ import annotations

from typing import Any, cast

import structlog

from cns.controller.survey import Surveyor
from cns.core.types import Scaler
from cns.kube.client import KubeClient
from cns.kube.watch import WatchedCollection, node_identity
from cns.kube.wire import ClusterSubnet, IPBlock, Node, NodeNetworkConfig


async def _never(**_: Any) -> Any:
    raise AssertionError("the survey lists nothing")


def _collection(name: str, **options: Any) -> WatchedCollection[Any]:
    return WatchedCollection(name, _never, lambda: None, **options)


def _node(name: str, *addresses: str, version: str = "1") -> Node:
    listed = [{"type": "InternalIP", "address": a} for a in addresses]
    meta = {"name": name, "resourceVersion": version}
    return cast(Node, {"metadata": meta, "status": {"addresses": listed}})


def _surveyor() -> tuple[Surveyor, WatchedCollection[Node]]:
    nodes: WatchedCollection[Node] = _collection("nodes", slim=node_identity)
    subnets: WatchedCollection[ClusterSubnet] = _collection("clustersubnets")
    subnets.put(
        cast(
            ClusterSubnet,
            {
                "metadata": {"name": "pods", "resourceVersion": "1"},
                "spec": {"subnet": "10.7.0.0/24"},
            },
        )
    )
    nncs: WatchedCollection[NodeNetworkConfig] = _collection("nncs")
    blocks: WatchedCollection[IPBlock] = _collection("ipblocks")
    surveyor = Surveyor(
        cast(KubeClient, None),
        cast(Any, None),
        subnet_name="",
        namespace="kube-system",
        default_scaler=Scaler(),
        nodes=nodes,
        nncs=nncs,
        subnets=subnets,
        blocks=blocks,
    )
    return surveyor, nodes


def test_served_subnets_exclude_node_addresses_and_stay_the_same_object_until_they_change() -> None:
    surveyor, nodes = _surveyor()
    nodes.put(_node("a", "10.7.0.5", "192.168.1.1"))
    first = surveyor.survey({}).served["pods"][1]
    assert first.node_ips == {"10.7.0.5"}
    nodes.put(_node("b", version="2"))  # a node without addresses in the subnet
    assert surveyor.survey({}).served["pods"][1] is first
    nodes.put(_node("a", "10.7.0.5", "10.7.0.6", version="3"))
    assert surveyor.survey({}).served["pods"][1].node_ips == {"10.7.0.5", "10.7.0.6"}
    nodes.discard("/a")
    assert surveyor.survey({}).served["pods"][1].node_ips == frozenset()


def test_a_malformed_node_address_is_logged_once_naming_its_field_and_ignored() -> None:
    surveyor, nodes = _surveyor()
    nodes.put(_node("a", "10.7.0.5", "10.7.0.x"))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert surveyor.survey({}).served["pods"][1].node_ips == {"10.7.0.5"}
    invalid = [e for e in logs if e["event"] == "node_address_invalid"]
    assert [(e["node"], e["field"], e["value"]) for e in invalid] == [
        ("a", "status.addresses[1].address", "'10.7.0.x'")
    ]
