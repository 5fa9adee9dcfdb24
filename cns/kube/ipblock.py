"""The IPBlock: one block of a subnet's addresses and the allocation of each, as the
controller writes it (`block_object`), reads it (`block_entries`) and caches it (`slim_block`).
"""

from __future__ import annotations

from collections.abc import Mapping
from sys import intern
from typing import Any, cast

from cns.core.allocation import Entry, is_record_word
from cns.kube.objects import IP_BLOCK, SUBNET_LABEL, interned, kept
from cns.kube.wire import IPBlock


def block_name(subnet_name: str, index: int) -> str:
    return f"{subnet_name}-b{index}"


def encode_entry(entry: Entry) -> str:
    """An allocation as one string, `<node> <id> <uid>` then the flags `primary`, `releasing`
    (uid `-` when unknown). One string rather than a map of fields: the API server's cost of a write
    follows the number of fields (validation, managedFields): a full /24 block of typed maps cost it
    52.8 ms of CPU per write, 16.6 ms this way (bench/performance/ipblock_write_cost.py); the CRD
    also declares the map atomic, so the server tracks it as one field (0.73x again)."""
    words = [entry.node, entry.id, entry.uid or "-"]
    if not all(map(is_record_word, words)) or entry.uid == "-":
        raise ValueError(f"an allocation field is empty, has blanks or is a bare '-': {entry}")
    words += [
        flag for flag, on in (("primary", entry.primary), ("releasing", entry.releasing)) if on
    ]
    return " ".join(words)


def decode_entry(value: object) -> Entry | None:
    """An allocation as written by `encode_entry`, or in the earlier map form
    ({node, id, uid, primary, releasing}), or already decoded (`slim_block`); None when it is
    not well formed."""
    if isinstance(value, Entry):
        return value
    if isinstance(value, dict):
        if not value.get("node") or not value.get("id"):
            return None
        return Entry(
            node=str(value["node"]),
            id=str(value["id"]),
            primary=bool(value.get("primary", False)),
            releasing=bool(value.get("releasing", False)),
            uid=str(value.get("uid") or ""),
        )
    if not isinstance(value, str):
        return None
    words = value.split()
    if len(words) < 3:
        return None
    node, entry_id, uid, *flags = words
    if not set(flags) <= {"primary", "releasing"} or len(flags) != len(set(flags)):
        return None
    return Entry(
        node=intern(node),
        id=intern(entry_id),
        primary="primary" in flags,
        releasing="releasing" in flags,
        uid="" if uid == "-" else intern(uid),
    )


def block_entries(block: IPBlock) -> dict[str, Entry]:
    """The allocations of one IPBlock; an entry that is not well formed is left out (the
    address then counts as free in this block, and the audit sees it if a node lists it)."""
    result: dict[str, Entry] = {}
    allocations = (block.get("spec") or {}).get("allocations") or {}
    if not isinstance(allocations, dict):
        return result
    for address, value in allocations.items():
        entry = decode_entry(value)
        if entry is not None:
            result[intern(str(address))] = entry
    return result


def block_spec(block: IPBlock) -> tuple[str, str]:
    """The subnet name and the CIDR an IPBlock says it covers ("" where it says nothing)."""
    spec = block.get("spec") or {}
    subnet = spec.get("subnet")
    return subnet if isinstance(subnet, str) else "", str(spec.get("cidr", ""))


def block_object(*, subnet_name: str, index: int, cidr: str, entries: dict[str, Entry]) -> IPBlock:
    """An IPBlock as the controller writes it (metadata.resourceVersion added by the caller)."""
    allocations = {address: encode_entry(entry) for address, entry in sorted(entries.items())}
    return {
        "apiVersion": IP_BLOCK.api_version,
        "kind": "IPBlock",
        "metadata": {"name": block_name(subnet_name, index), "labels": {SUBNET_LABEL: subnet_name}},
        "spec": {"subnet": subnet_name, "cidr": cidr, "allocations": allocations},
    }


def slim_block(
    block: IPBlock,
    written: dict[str, Entry] | None = None,
    *,
    sent: Mapping[str, object] | None = None,
) -> IPBlock:
    """An IPBlock as the controller's cache keeps it: name, resourceVersion, labels, subnet,
    cidr and its allocations already decoded (`block_entries`): the Entry objects are then the
    planning state's own, where the wire form kept a ~140-byte string per address besides.
    `block_entries`, `block_spec` and `conditional` read it as they read the wire form.

    Allocations equal to `written` (the entries the controller just wrote, of its plan) are
    kept as that dict rather than the reply's copy, for the reason `slim_nnc` gives. With
    `sent` (the allocations of the write's body, `block_object` of `written`), a reply holding
    just those strings is not decoded at all: a block's 256 entries cost the leader more CPU
    to decode than anything else it does with a reply."""
    meta = block.get("metadata")
    slim: dict[str, Any] = {  # built from unchecked input, shape by shape
        "metadata": kept(meta, ("name", "namespace", "uid", "resourceVersion", "labels"))
    }
    spec = block.get("spec")
    if "spec" in block:
        slim["spec"] = spec
        if isinstance(spec, dict):
            slim["spec"] = {k: interned(spec[k]) for k in ("subnet", "cidr") if k in spec}
            if "allocations" in spec:
                allocations = spec["allocations"]
                if written is not None and sent is not None and allocations == sent:
                    allocations = written
                elif isinstance(allocations, dict):
                    allocations = block_entries(block)
                    if written is not None and allocations == written:
                        allocations = written
                slim["spec"]["allocations"] = allocations
    return cast(IPBlock, slim)
