"""The controller's planning state kept in step with the watch caches, against one built fresh.

The caches replace an object whenever it changes; `SubnetState.sync` finds the changed ones by
reference. Random sequences of NNCs and IPBlocks created, replaced and deleted (including
objects that are not this subnet's, and entries filed in the wrong block): after each sync the
state must equal `read_state` of the same caches.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cns.controller.state import SubnetState, read_state
from cns.core.allocation import Entry, block_network
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer
from cns.kube.resources import (
    block_entries,
    block_object,
    decode_entry,
    encode_entry,
    nc_to_status,
    nnc_object,
)

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
    nncs: dict[str, dict[str, Any]] = {}
    blocks: dict[str, dict[str, Any]] = {}
    state = SubnetState(SUBNET)
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
        state.sync(nncs=dict(nncs), blocks=dict(blocks))
        fresh = read_state(SUBNET, nncs=dict(nncs), blocks=dict(blocks))
        assert state.model.differences(fresh.model) == []
        assert state.blocks == fresh.blocks


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
