"""A Node's own addresses, read with checks, and kept by the slim Node cache."""

from __future__ import annotations

import ipaddress
from typing import Any, cast

from cns.kube.node_addresses import NodeAddressProblem, node_addresses
from cns.kube.watch import node_changed, node_identity
from cns.kube.wire import Node


def _node(addresses: Any) -> Node:
    return cast(Node, {"metadata": {"name": "n1"}, "status": {"addresses": addresses}})


def test_internal_and_external_ips_are_read_and_other_kinds_ignored() -> None:
    found, problems = node_addresses(
        _node(
            [
                {"type": "InternalIP", "address": "10.0.0.5"},
                {"type": "ExternalIP", "address": "2001:db8::5"},
                {"type": "Hostname", "address": "n1"},
                {"type": "InternalDNS", "address": "n1.example"},
            ]
        )
    )
    assert found == [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("2001:db8::5")]
    assert problems == []


def test_an_entry_that_cannot_be_read_is_named_by_its_field_and_ignored() -> None:
    found, problems = node_addresses(
        _node(
            [
                "10.0.0.9",
                {"type": "InternalIP", "address": "10.0.0.300"},
                {"type": "ExternalIP", "address": 7},
                {"type": "InternalIP"},
                {"type": "InternalIP", "address": "10.0.0.6"},
            ]
        )
    )
    assert found == [ipaddress.ip_address("10.0.0.6")]
    assert [(p.node, p.field) for p in problems] == [
        ("n1", "status.addresses[0]"),
        ("n1", "status.addresses[1].address"),
        ("n1", "status.addresses[2].address"),
        ("n1", "status.addresses[3].address"),
    ]
    assert node_addresses(_node("10.0.0.1")) == (
        [],
        [NodeAddressProblem("n1", "status.addresses", "'10.0.0.1'", "not a list")],
    )
    assert node_addresses(cast(Node, {"metadata": {"name": "n1"}})) == ([], [])


def test_the_slim_node_keeps_its_addresses_and_a_change_of_them_wakes_the_controller() -> None:
    full = cast(
        Node,
        {
            "metadata": {"name": "n1", "uid": "u", "labels": {"a": "b"}, "annotations": {}},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}],
                "conditions": [{"type": "Ready"}],
            },
        },
    )
    slim = node_identity(full)
    assert slim == {
        "metadata": {"name": "n1", "uid": "u", "labels": {"a": "b"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.5"}]},
    }
    heartbeat = cast(Node, {**full, "status": {**full["status"], "conditions": []}})
    assert not node_changed(slim, node_identity(heartbeat))
    moved = cast(
        Node, {**full, "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.6"}]}}
    )
    assert node_changed(slim, node_identity(moved))
