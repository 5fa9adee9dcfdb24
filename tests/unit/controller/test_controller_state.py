"""The controller's planning state kept in step with the watch caches, against one built fresh.

The caches replace an object whenever it changes; `PlanningState.sync` finds the changed ones by
reference. Random sequences of NNCs and IPBlocks created, replaced and deleted (including
objects that are not this subnet's, and entries filed in the wrong block): after each sync the
state must equal `read_state` of the same caches.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cns.controller.state import PlanningState, read_state
from cns.core.allocation import Entry, block_network
from cns.core.subnet import Subnet
from cns.core.subnet_model import SubnetModel
from cns.core.types import IPConfig, NetworkContainer
from cns.kube.ipblock import block_entries, block_object, decode_entry, encode_entry, slim_block
from cns.kube.nnc import nnc_object, slim_nnc
from cns.kube.nnc_containers import nc_to_status

SUBNET = Subnet("pods", "10.1.0.0/22")
NODES = ["a", "b", "c"]


def nnc(name: str, uid: str, count: int, offset: int, subnet: str) -> dict[str, Any]:
    obj = nnc_object(
        node_name=name, node_uid="node-uid", namespace="kube-system", subnet_name="pods"
    )
    obj["metadata"]["uid"] = uid
    obj["spec"]["requestedIPCount"] = count
    configs = tuple(IPConfig(f"{name}-{i}", f"10.1.{offset}.{10 + i}") for i in range(count))
    nc = NetworkContainer(
        id=f"{name}-nc", primary_ips=(f"10.1.{offset}.9",), subnet=subnet,
        gateway="10.1.0.1", ip_configs=configs, version=1, programmed_version=1,
    )  # fmt: skip
    obj["status"] = {"networkContainers": [nc_to_status(nc, subnet_name="pods")]}
    return obj


def block(index: int, owners: list[tuple[int, str]], subnet_name: str) -> dict[str, Any]:
    cidr = str(block_network(SUBNET.network, index))
    entries = {f"10.1.{host_block}.{20 + i}": Entry(node, f"id{i}", uid=node)
               for i, (host_block, node) in enumerate(owners)}  # fmt: skip
    return block_object(subnet_name=subnet_name, index=index, cidr=cidr, entries=entries)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_synced_state_equals_a_state_read_from_scratch(data: st.DataObject) -> None:
    slim = data.draw(st.booleans())
    nncs: dict[str, dict[str, Any]] = {}
    blocks: dict[str, dict[str, Any]] = {}
    state = PlanningState(SUBNET)
    for _ in range(data.draw(st.integers(1, 20))):
        if data.draw(st.booleans()):
            name = data.draw(st.sampled_from(NODES))
            key = f"kube-system/{name}"
            if data.draw(st.integers(0, 4)) == 0:
                nncs.pop(key, None)
            else:
                nncs[key] = nnc(
                    name,
                    data.draw(st.sampled_from(["u1", "u2"])),
                    data.draw(st.integers(0, 5)),
                    data.draw(st.integers(0, 3)),
                    data.draw(st.sampled_from([str(SUBNET.network), "10.9.0.0/16"])),
                )
        else:
            index = data.draw(st.integers(0, 3))
            key = f"/pods-b{index}"
            if data.draw(st.integers(0, 4)) == 0:
                blocks.pop(key, None)
            else:
                owners = data.draw(
                    st.lists(st.tuples(st.integers(0, 3), st.sampled_from(NODES)), max_size=6)
                )
                subnet_name = data.draw(st.sampled_from(["pods", "pods", "other"]))
                blocks[key] = block(index, owners, subnet_name)
        if slim:  # as the controller's caches keep them
            nncs = {key: slim_nnc(obj) for key, obj in nncs.items()}
            blocks = {key: slim_block(obj) for key, obj in blocks.items()}
        state.sync(nncs=dict(nncs), blocks=dict(blocks))
        fresh = read_state(SUBNET, nncs=dict(nncs), blocks=dict(blocks))
        assert state.model.differences(fresh.model) == []
        assert state.blocks == fresh.blocks
        assert state.differences(nncs=nncs, blocks=blocks) == []


def corruptions() -> dict[str, Callable[[SubnetModel], object]]:
    """Defects an incremental update could leave, each in one structure of the model."""
    address, releasing, unclean, unlisted = "10.1.0.10", "10.1.0.11", "10.1.0.12", "10.1.1.25"
    return {
        "nodes": lambda m: m.nodes.update(a=replace(m.nodes["a"], uid="u9")),
        "nodes ": lambda m: m.nodes.update(ghost=replace(m.nodes["a"], name="ghost")),
        "entries": lambda m: m.entries.update({address: Entry("a", "a-9", uid="u1")}),
        "entries ": lambda m: m.entries.pop(unlisted),
        "by_node": lambda m: m.by_node["a"].discard(address),
        "releasing": lambda m: m.releasing.discard(releasing),
        "reserved": lambda m: setattr(m, "reserved", m.reserved + 1),
        "listed": lambda m: m.listed.pop(address),
        "listed ": lambda m: m.listed.update({"10.1.2.2": m.listed[address]}),
        "unclean": lambda m: m.unclean.add(address),
        "unclean ": lambda m: m.unclean.discard(unclean),
        "free": lambda m: m.free.give_back(int(ipaddress.ip_address(address))),
        "free ": lambda m: m.free.take(int(ipaddress.ip_address("10.1.3.3"))),
    }


@pytest.mark.parametrize("defect", list(corruptions()))
def test_the_recheck_finds_every_structure_the_model_gets_wrong(defect: str) -> None:
    """`PlanningState.differences`, the controller's periodic safety net, finds a defect in any
    of the model's structures without building a second model."""
    nncs = {f"kube-system/{name}": nnc(name, "u1", 3, i, str(SUBNET.network))
            for i, name in enumerate(("a", "b"))}  # fmt: skip
    entries = {
        "10.1.0.10": Entry("a", "a-0", uid="u1"),
        "10.1.0.11": Entry("a", "a-1", uid="u1", releasing=True),
        "10.1.1.25": Entry("c", "c-0", uid="u7"),  # listed by none
    }
    blocks = {}
    for index in (0, 1):
        cidr = str(block_network(SUBNET.network, index))
        mine = {a: e for a, e in entries.items() if a.startswith(cidr[:7])}
        blocks[f"/pods-b{index}"] = block_object(
            subnet_name="pods", index=index, cidr=cidr, entries=mine
        )
    state = PlanningState(SUBNET)
    state.sync(nncs=nncs, blocks=blocks)
    assert state.differences(nncs=nncs, blocks=blocks) == []
    assert state.model.unclean  # some of each kind: clean, unclean, releasing
    corruptions()[defect](state.model)
    assert defect.strip() in state.differences(nncs=nncs, blocks=blocks)


WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=40)


@given(
    node=WORD, entry_id=WORD, uid=st.one_of(st.just(""), WORD.filter(lambda w: w != "-")),
    primary=st.booleans(),
    releasing=st.booleans(),
)  # fmt: skip
def test_an_allocation_reads_back_as_written(
    node: str, entry_id: str, uid: str, primary: bool, releasing: bool
) -> None:
    entry = Entry(node, entry_id, primary=primary, releasing=releasing, uid=uid)
    assert decode_entry(encode_entry(entry)) == entry


def test_allocations_in_the_earlier_map_form_are_read() -> None:
    legacy = {"node": "n1", "id": "g1", "uid": "u1", "releasing": True}
    assert decode_entry(legacy) == Entry("n1", "g1", releasing=True, uid="u1")
    assert decode_entry({"node": "n1"}) is None


@pytest.mark.parametrize(
    "value",
    ["", "n1", "n1 g1", "n1 g1 u1 bogus", "n1 g1 u1 primary primary", 5, None, ["n1 g1 u1"]],
)
def test_an_allocation_that_is_not_well_formed_is_left_out(value: Any) -> None:
    assert decode_entry(value) is None
    written = block_object(subnet_name="pods", index=0, cidr="10.1.0.0/24", entries={})
    written["spec"]["allocations"] = {"10.1.0.5": value, "10.1.0.6": "n1 g1 u1"}
    assert block_entries(written) == {"10.1.0.6": Entry("n1", "g1", uid="u1")}


@pytest.mark.parametrize(
    "entry",
    [Entry("a b", "g1"), Entry("n1", ""), Entry("n1", "g 1"), Entry("n1", "g1", uid="-")],
)
def test_an_allocation_with_blanks_is_never_written(entry: Entry) -> None:
    with pytest.raises(ValueError):
        encode_entry(entry)
