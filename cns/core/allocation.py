"""The subnet's allocation record: which node holds which address, kept in fixed-size blocks.

The network containers in the nodes' NodeNetworkConfigs are what the nodes use; they are not a
safe place to decide from. Every NNC is a separate object, so a write that is conditional on one
NNC's resourceVersion says nothing about the address being free in all the others: two
controllers (a leader and a stale one) can each grant the same free address to a different node
and both writes land. The record closes that gap: every address a control plane hands out is
first claimed here, in the block object that covers it, by a write conditional on the block's
resourceVersion, so of two writers claiming one address only one can win (Calico's IPAM blocks
work the same way). The NNCs then follow the record. docs/design/controller-safety.md has the
protocol and the argument.

Blocks are aligned /24s (IPv4) or /120s (IPv6), or the whole subnet when it is smaller: at most
256 entries, a few tens of kB per object, far below the API server's object size limit, and a
round touches only the blocks whose addresses change.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

BLOCK_PREFIX = {4: 24, 6: 120}


@dataclass(frozen=True, slots=True)
class Entry:
    """One claimed address.

    `id` is the name the node knows the address by (the IPConfig's name, or the network
    container's id for a primary IP). Matching ids is what makes a release refer to exactly this
    grant and not to an earlier grant of the same address (an ABA problem otherwise).
    `uid` is that of the node's NodeNetworkConfig object when the address was granted: a grant
    is only ever completed into that object, so a NodeNetworkConfig deleted and created again
    under the same name can never receive an address that was freed meanwhile.
    `releasing` is set before the address is removed from the node's network container, and the
    entry is dropped only once the container no longer lists it.
    """

    node: str
    id: str
    primary: bool = False
    releasing: bool = False
    uid: str = ""


Record = Mapping[str, Entry]  # address -> entry; a missing address is free


def is_record_word(value: str) -> bool:
    """Whether `value` can stand as an entry's node, id or uid: not empty, no blanks (the
    record's wire form, `cns.kube.ipblock.encode_entry`, separates the fields by blanks)."""
    return bool(value) and value.split() == [value]


def block_prefix(network: Network) -> int:
    return max(network.prefixlen, BLOCK_PREFIX[network.version])


def block_index(network: Network, address: str) -> int:
    """The number of the block that holds `address`, counted from the subnet's first address."""
    offset = int(ipaddress.ip_address(address)) - int(network.network_address)
    if not 0 <= offset < network.num_addresses:
        raise ValueError(f"{address} is not in {network}")
    return offset >> (network.max_prefixlen - block_prefix(network))


def block_network(network: Network, index: int) -> Network:
    size = 1 << (network.max_prefixlen - block_prefix(network))
    start = ipaddress.ip_address(int(network.network_address) + index * size)
    return ipaddress.ip_network(f"{start}/{block_prefix(network)}")


def apply_changes(record: dict[str, Entry], changes: Mapping[str, Entry | None]) -> None:
    """Bring `record` up to date with `changes` (an entry, or None to free the address)."""
    for address, entry in changes.items():
        if entry is None:
            record.pop(address, None)
        else:
            record[address] = entry
