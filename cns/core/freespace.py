"""The free addresses of a subnet, kept by block so that finding and taking one costs little.

The controller grants free usable addresses block by block, lowest first within a block (which
blocks: `fitting_block`). Walking the subnet's addresses to find them cost a round seconds on a
/12 whatever changed; here every block (the allocation record's /24 or /120,
`cns.core.allocation`) is a bit mask of its taken and unusable offsets, and the blocks with no
free address left are a sorted list. The lowest free address is then a binary search in that
list plus a bit trick on one mask; taking or giving one back touches one mask. Blocks nobody
touched are not stored at all (an untouched block has only its unusable addresses taken), so
memory follows the addresses in use, not the subnet's size, and an IPv6 /64 costs what a /24
costs.

Which addresses are usable is `Subnet.is_usable`'s rule: the subnet's hosts minus the gateway,
the reserved ranges and the nodes' own (`Subnet.excluded`, `Subnet.reservations`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from cns.core.allocation import block_prefix
from cns.core.subnet import Subnet


def _unusable_spans(subnet: Subnet) -> list[tuple[int, int]]:
    """Inclusive spans of offsets from the network address that `Subnet.is_usable` rejects:
    the addresses outside `host_span`, `excluded_values`, and the reserved ranges clipped to the
    subnet."""
    network = subnet.network
    base, size = int(network.network_address), network.num_addresses
    first, last = subnet.host_span
    spans = [(0, first - base - 1)] if first > base else []
    if last < base + size - 1:
        spans.append((last - base + 1, size - 1))
    spans += [(value - base, value - base) for value in subnet.excluded_values()]
    for low, high in subnet.reservations.spans():
        if low <= base + size - 1 and high >= base:
            spans.append((max(low, base) - base, min(high, base + size - 1) - base))
    return spans


def _unusable_masks(subnet: Subnet, bits: int) -> dict[int, int]:
    """Block -> the mask of its unusable offsets, for the blocks that have any: a reserved /16
    costs a loop over the blocks it covers, not 65,536 offsets."""
    masks: dict[int, int] = {}
    low_bits = (1 << bits) - 1
    for first, last in _unusable_spans(subnet):
        for block in range(first >> bits, (last >> bits) + 1):
            start = max(first, block << bits) & low_bits
            end = min(last, (block << bits) | low_bits) & low_bits
            masks[block] = masks.get(block, 0) | ((1 << (end - start + 1)) - 1) << start
    return masks


@dataclass(slots=True)
class FreeSpace:
    """Which addresses of one subnet are free; addresses are integers (`int(ip_address)`).

    `taken` counts the usable addresses taken; unusable ones are never free and never counted.
    """

    base: int  # the network address
    block_bits: int  # a block holds 2**block_bits addresses
    block_count: int
    _fixed: dict[int, int]  # block -> mask of its unusable offsets (blocks that have any)
    _masks: dict[int, int] = field(default_factory=dict)  # block -> mask, once touched
    _full: list[int] = field(default_factory=list)  # sorted blocks with nothing free
    taken: int = 0

    @classmethod
    def of(cls, subnet: Subnet) -> FreeSpace:
        network = subnet.network
        bits = network.max_prefixlen - block_prefix(network)
        count = network.num_addresses >> bits
        fixed = _unusable_masks(subnet, bits)
        space = cls(int(network.network_address), bits, count, fixed)
        everything = (1 << (1 << bits)) - 1
        space._full = sorted(block for block, mask in fixed.items() if mask == everything)
        return space

    def copy(self) -> FreeSpace:
        """An independent copy; the unusable masks never change and are shared."""
        return FreeSpace(
            self.base,
            self.block_bits,
            self.block_count,
            self._fixed,
            dict(self._masks),
            list(self._full),
            self.taken,
        )

    def _locate(self, address: int) -> tuple[int, int] | None:
        offset = address - self.base
        if not 0 <= offset < self.block_count << self.block_bits:
            return None
        return offset >> self.block_bits, offset & ((1 << self.block_bits) - 1)

    def _mask(self, block: int) -> int:
        mask = self._masks.get(block)
        return self._fixed.get(block, 0) if mask is None else mask

    def is_usable(self, address: int) -> bool:
        where = self._locate(address)
        return where is not None and not self._fixed.get(where[0], 0) >> where[1] & 1

    def is_free(self, address: int) -> bool:
        where = self._locate(address)
        return where is not None and not self._mask(where[0]) >> where[1] & 1

    def _bit(self, address: int) -> tuple[int, int, int] | None:
        """The address's block, its bit in the block's mask, and the mask; None outside."""
        where = self._locate(address)
        if where is None:
            return None
        block, offset = where
        return block, 1 << offset, self._mask(block)

    def take(self, address: int) -> bool:
        """Mark a free usable address taken; False (and nothing changes) for any other."""
        found = self._bit(address)
        if found is None or found[2] & found[1]:
            return False
        block, bit, mask = found
        mask |= bit
        self._masks[block] = mask
        if mask == (1 << (1 << self.block_bits)) - 1:
            bisect.insort(self._full, block)
        self.taken += 1
        return True

    def give_back(self, address: int) -> bool:
        """Mark a taken usable address free; False (and nothing changes) for any other."""
        found = self._bit(address)
        if found is None or not found[2] & found[1] or self._fixed.get(found[0], 0) & found[1]:
            return False
        block, bit, mask = found
        if mask == (1 << (1 << self.block_bits)) - 1:
            del self._full[bisect.bisect_left(self._full, block)]
        mask &= ~bit
        if mask == self._fixed.get(block, 0):
            self._masks.pop(block, None)
        else:
            self._masks[block] = mask
        self.taken -= 1
        return True

    def lowest(self) -> int | None:
        """The lowest free address, None when there is none."""
        # `_full` is sorted and distinct, so `_full[i] == i` holds for a prefix of it: the first
        # index where it fails is the lowest block with a free address.
        low, high = 0, len(self._full)
        while low < high:
            middle = (low + high) // 2
            if self._full[middle] == middle:
                low = middle + 1
            else:
                high = middle
        if low >= self.block_count:
            return None
        return self.lowest_in(low)

    def block_of(self, address: int) -> int | None:
        """The number of the block holding `address`, None outside the subnet."""
        where = self._locate(address)
        return None if where is None else where[0]

    def lowest_in(self, block: int) -> int | None:
        """The lowest free address of one block, None when it has none."""
        if not 0 <= block < self.block_count:
            return None
        free = ~self._mask(block) & ((1 << (1 << self.block_bits)) - 1)
        if not free:
            return None
        return self.base + (block << self.block_bits) + (free & -free).bit_length() - 1

    def fitting_block(self, wanted: int) -> int | None:
        """A block to take `wanted` addresses from, writing as few blocks as possible: the one
        with the fewest free addresses that still holds them all, else the one with the most;
        lowest first on ties. None when no address is free.

        Every block written costs the API server a whole IPBlock object, whatever changed in
        it: the fewest blocks a grant touches, the fewer objects go out. Best fit first keeps
        the subnet's blocks filled (a fresh block is opened only when no block in use has
        room), so the number of blocks follows the addresses granted. Looked for among the
        blocks in use and the lowest untouched one (all untouched blocks are alike but for
        the few unusable addresses of the first and the last, and the reserved ranges': one
        a reservation fills is passed over), in a pass over the blocks in use: done once per
        block a round opens, not per address."""
        size = 1 << self.block_bits
        masks, fixed, everything = self._masks, self._fixed, (1 << size) - 1
        candidates = [(b, size - mask.bit_count()) for b, mask in masks.items()]
        # The lowest untouched block with a free address (a reserved range may fill some).
        untouched = next(
            b
            for b in range(len(masks) + len(fixed) + 1)
            if b not in masks and fixed.get(b, 0) != everything
        )
        if untouched < self.block_count:
            candidates.append((untouched, size - fixed.get(untouched, 0).bit_count()))
        fitting = [(free, b) for b, free in candidates if free >= wanted]
        if fitting:
            return min(fitting)[1]
        free, block = max(((free, -b) for b, free in candidates if free > 0), default=(0, 0))
        return -block if free > 0 else None
