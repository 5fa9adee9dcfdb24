"""Reserved addresses of a subnet as integer intervals: single addresses, CIDRs and ranges.

`reservedIPs` takes `10.240.0.5`, `10.240.0.0/28` and `10.240.0.10-10.240.0.20` (as Calico's
IPReservation and host-local's rangeStart/rangeEnd do). A /16 reserved must not become 65,536
strings, so the entries are kept as sorted, merged, inclusive intervals of integers: membership is
a binary search, and the count inside a span is a sum over the intervals that meet it. Pure.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ReservationError(ValueError):
    """An entry that is not an address, a CIDR or a `first-last` range of one family."""


def parse_entry(entry: str) -> tuple[int, int, int]:
    """(version, first, last) of one entry, inclusive. ReservationError names the entry."""
    text = entry.strip()
    try:
        if "/" in text:
            network = ipaddress.ip_network(text, strict=False)
            return network.version, int(network.network_address), int(network.broadcast_address)
        if "-" in text:
            low_text, high_text = (part.strip() for part in text.split("-", 1))
            low, high = ipaddress.ip_address(low_text), ipaddress.ip_address(high_text)
            if low.version != high.version:
                raise ReservationError(f"{entry!r}: a range's two ends are of one family")
            if int(low) > int(high):
                raise ReservationError(f"{entry!r}: a range's first address is above its last")
            return low.version, int(low), int(high)
        address = ipaddress.ip_address(text)
        return address.version, int(address), int(address)
    except ReservationError:
        raise
    except ValueError as exc:
        raise ReservationError(
            f"{entry!r}: not an address, a CIDR or a first-last range ({exc})"
        ) from exc


@dataclass(frozen=True, slots=True)
class Reservations:
    """Sorted, disjoint, non-adjacent inclusive intervals of one IP version."""

    version: int
    firsts: tuple[int, ...] = ()
    lasts: tuple[int, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str], *, network: Network) -> Reservations:
        """The entries reserved in `network`, merged. An entry of the other family, or one that
        names no address of the network, is an error naming it: it reserves nothing there,
        which is never what its writer meant (a typo in a subnet's reservation would
        otherwise leave the addresses it meant to protect grantable)."""
        low, high = int(network.network_address), int(network.broadcast_address)
        spans = []
        for entry in entries:
            version, first, last = parse_entry(entry)
            if version != network.version:
                raise ReservationError(
                    f"{entry!r}: an IPv{version} entry in the IPv{network.version} subnet {network}"
                )
            if last < low or first > high:
                raise ReservationError(f"{entry!r}: no address of the subnet {network}")
            spans.append((first, last))
        return cls.of_spans(spans, version=network.version)

    @classmethod
    def of_spans(cls, spans: Iterable[tuple[int, int]], *, version: int) -> Reservations:
        merged: list[list[int]] = []
        for first, last in sorted(spans):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        return cls(version, tuple(f for f, _ in merged), tuple(la for _, la in merged))

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address):
            return False
        return address.version == self.version and self.holds(int(address))

    def holds(self, value: int) -> bool:
        """Whether the address of this version whose integer is `value` is reserved."""
        index = bisect.bisect_right(self.firsts, value) - 1
        return index >= 0 and value <= self.lasts[index]

    def spans(self) -> Iterator[tuple[int, int]]:
        return zip(self.firsts, self.lasts, strict=True)

    def count_between(self, low: int, high: int) -> int:
        """How many reserved addresses lie in [low, high] (of this version)."""
        return sum(
            min(last, high) - max(first, low) + 1
            for first, last in self.spans()
            if first <= high and last >= low
        )
