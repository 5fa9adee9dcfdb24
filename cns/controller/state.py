"""One subnet's planning state for a leadership term, kept in step with the watch caches.

The caches (`cns.kube.watch.WatchedCollection`) replace an object whenever it changes and never
change one in place, so "did this NodeNetworkConfig or IPBlock change since the last round" is
an identity check: `sync` walks the caches comparing references (microseconds for thousands of
objects), parses only the objects that are new, and tells the model (`SubnetModel`) what they
changed. The controller's own writes come back the same way (`put_written` puts the reply in
the cache), so the model follows what the API server holds and nothing else: a write that was
refused changes nothing here.

`read_state` builds the same state from scratch; now and then the controller checks the state
against the caches object by object (`PlanningState.differences`) as a safety net, and replaces
it with one read from scratch if it finds it wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from cns.core.allocation import Entry, block_index, block_network
from cns.core.subnet import Subnet
from cns.core.subnet_model import NodeView, SubnetModel
from cns.kube.ipblock import block_entries, block_name, block_spec
from cns.kube.nnc import subnet_request
from cns.kube.nnc_containers import network_containers
from cns.kube.wire import IPBlock, NodeNetworkConfig


def node_view(subnet: Subnet, nnc: NodeNetworkConfig) -> NodeView:
    """A NodeNetworkConfig as a subnet's planner sees it: its container of this subnet and its
    request of it (the spec's own fields for its primary subnet, its `spec.subnets` entry for a
    further one). A node is a member of each subnet it takes addresses from, in that subnet's
    model under its name: the member is the pair (NNC, subnet)."""
    network = str(subnet.network)
    containers = [nc for nc in network_containers(nnc) if nc.subnet == network]
    meta = nnc["metadata"]
    nc = containers[0] if containers else None
    request = subnet_request(nnc, subnet.name)
    return NodeView(meta["name"], nc, request, str(meta.get("uid") or ""))


def block_record(
    subnet: Subnet,
    block: IPBlock,
    placed: Mapping[int, Mapping[str, Entry]] | None = None,
) -> tuple[int, dict[str, Entry]] | None:
    """The index and entries of one of this subnet's IPBlocks; None for any other object. An
    entry filed in a block that does not cover its address is ignored: only the block of an
    address can claim it. `placed`: entries already found in their block, by block index
    (`PlanningState.sync` passes the ones it holds): their addresses are not placed again, since
    a write changes a few of a block's 256 entries and parsing every address was most of the
    CPU a synced block cost."""
    network = subnet.network
    subnet_name, cidr = block_spec(block)
    try:
        index = block_index(network, cidr.split("/")[0])
    except ValueError:
        return None
    name = (block.get("metadata") or {}).get("name")
    if subnet_name != subnet.name or str(block_network(network, index)) != cidr:
        return None
    if name != block_name(subnet.name, index):  # only the block's own object can claim it
        return None
    known = placed.get(index, {}) if placed is not None else {}
    entries = {}
    for address, entry in block_entries(block).items():
        if address in known:
            entries[address] = entry
            continue
        with contextlib.suppress(ValueError):
            if block_index(network, address) == index:
                entries[address] = entry
    return index, entries


class PlanningState:
    """The model of one subnet plus what it was built from (see the module docstring)."""

    def __init__(self, subnet: Subnet) -> None:
        self.subnet = subnet
        self.model = SubnetModel(subnet)
        self.blocks: dict[int, IPBlock] = {}  # index -> the IPBlock object
        self._nncs: dict[str, NodeNetworkConfig] = {}  # name -> the object the model has
        self._block_objects: dict[str, IPBlock] = {}  # cache key -> object seen
        self._block_index: dict[str, int] = {}  # cache key -> index, for this subnet's blocks
        self._block_entries: dict[int, dict[str, Entry]] = {}

    def sync(self, *, nncs: Mapping[str, NodeNetworkConfig], blocks: Mapping[str, IPBlock]) -> None:
        """Bring the model up to date with the caches (keys as the caches have them)."""
        by_name = {str(obj["metadata"]["name"]): obj for obj in nncs.values()}
        for name in [name for name in self._nncs if name not in by_name]:
            del self._nncs[name]
            self.model.remove_node(name)
        for name, obj in by_name.items():
            if self._nncs.get(name) is not obj:
                view = node_view(self.subnet, obj)  # may raise: then it is tried again next time
                self._nncs[name] = obj
                self.model.set_node(view)
        for key in [key for key in self._block_objects if key not in blocks]:
            del self._block_objects[key]
            self._forget_block(key)
        for key, block in blocks.items():
            if self._block_objects.get(key) is not block:
                parsed = block_record(self.subnet, block, self._block_entries)  # may raise
                self._block_objects[key] = block
                if parsed is None or parsed[0] != self._block_index.get(key):
                    self._forget_block(key)
                if parsed is not None:
                    index, entries = parsed
                    self.blocks[index] = block
                    self._block_index[key] = index
                    self._set_block(index, entries)

    def _forget_block(self, key: str) -> None:
        index = self._block_index.pop(key, None)
        if index is not None:
            self.blocks.pop(index, None)
            self._set_block(index, {})

    def _set_block(self, index: int, entries: dict[str, Entry]) -> None:
        old = self._block_entries.get(index, {})
        for address in old.keys() - entries.keys():
            self.model.set_entry(address, None)
        for address, entry in entries.items():
            self.model.set_entry(address, entry)
        self._block_entries[index] = entries

    def differences(
        self, *, nncs: Mapping[str, NodeNetworkConfig], blocks: Mapping[str, IPBlock]
    ) -> list[str]:
        """What the model, synced with this snapshot of the caches, gets wrong about it: empty
        when it is right. Each NNC and IPBlock is parsed again, one at a time, and compared
        with what the model holds for it; then the model's derived structures are checked
        against its nodes and entries (`SubnetModel.inconsistencies`). The safety net of the
        incremental updates, without a second model built from scratch (`read_state`) to
        compare with: that would hold a whole second copy of the subnet's state for a moment
        (hundreds of bytes an address: the controller's memory peak every 5 minutes). Raises
        where `sync` would (an object that does not parse)."""
        model = self.model
        found = []
        names = 0
        for obj in nncs.values():
            view = node_view(self.subnet, obj)
            names += 1
            if model.nodes.get(view.name) != view:
                found.append("nodes")
                break
        if "nodes" not in found and names != len(model.nodes):
            found.append("nodes")
        # Two objects claiming one block: the last one wins, as in `read_state`.
        recorded: dict[int, int] = {}  # block -> entries recorded, or -1: one differs
        for block in blocks.values():
            parsed = block_record(self.subnet, block)
            if parsed is not None:
                index, entries = parsed
                same = all(model.entries.get(a) == entry for a, entry in entries.items())
                recorded[index] = len(entries) if same else -1
        if -1 in recorded.values() or sum(recorded.values()) != len(model.entries):
            found.append("entries")
        return found + model.inconsistencies()


def read_state(
    subnet: Subnet, *, nncs: Mapping[str, NodeNetworkConfig], blocks: Mapping[str, IPBlock]
) -> PlanningState:
    """The state of one snapshot of the caches, built from scratch: every object parsed once,
    the model built in one pass (`SubnetModel.build`); every node counts as changed."""
    state = PlanningState(subnet)
    views = []
    for obj in nncs.values():
        state._nncs[str(obj["metadata"]["name"])] = obj
        views.append(node_view(subnet, obj))
    record: dict[str, Entry] = {}
    for key, block in blocks.items():
        state._block_objects[key] = block
        parsed = block_record(subnet, block)
        if parsed is not None:
            index, entries = parsed
            state.blocks[index] = block  # two objects claiming one block: the last one wins
            state._block_index[key] = index
            state._block_entries[index] = entries
    for entries in state._block_entries.values():
        record.update(entries)
    state.model = SubnetModel.build(subnet, views, record)
    return state
