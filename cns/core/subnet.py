"""A pod subnet as a control plane hands it out: usable addresses and capacity.

Shared by the reference controller and the standalone allocator, so both agree on which
addresses exist: the subnet's hosts, minus the gateway, the reserved ranges (`reservedIPs`:
addresses, CIDRs and first-last ranges) and the nodes' own addresses.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from cns.core.allocation import block_prefix
from cns.core.reservations import ReservationError, Reservations
from cns.core.types import Scaler

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# The most allocation blocks (/24, /120: `cns.core.allocation`) the reserved ranges may touch:
# the controller keeps a mask per such block (`cns.core.freespace`), so an IPv6 reservation of
# a /64 would cost 2**56 of them. 4,096 blocks: an IPv4 /12, an IPv6 /108.
MAX_RESERVED_BLOCKS = 4096


def host_address_problem(ip: Address, network: Network) -> str | None:
    """Why `ip` is not a host address of `network`, or None: outside it, its network address
    (in IPv6 the Subnet-Router anycast address, which every router of the link answers), or its
    IPv4 broadcast address (in a /31 or /32 every address is a host's). A gateway there would
    be no single host, and pods would send their traffic to all of them or none."""
    if ip.version != network.version or ip not in network:
        return f"{ip} is not in subnet {network}"
    if ip == network.network_address and (network.version == 6 or network.prefixlen <= 30):
        return f"{ip} is the network address of {network}, not a host address"
    if network.version == 4 and network.prefixlen <= 30 and ip == network.broadcast_address:
        return f"{ip} is the broadcast address of {network}, not a host address"
    return None


@dataclass(frozen=True, slots=True)
class Subnet:
    """A ClusterSubnet's spec (the standalone allocator uses the addressing part).

    `reserved_ips` are the spec's entries as written; `reservations` their merged ranges, checked
    at construction (ReservationError, a ValueError naming the entry)."""

    name: str
    cidr: str
    gateway: str = ""
    reserved_ips: frozenset[str] = frozenset()
    upper_percent: int = 90
    lower_percent: int = 50
    node_safety_factor: int = 2
    max_batch: int = 16
    # The nodes' requestThresholdPercent (mf) and releaseThresholdPercent (Mf): how many free
    # IPs a node may hold at a batch, which the phase-4 batch must leave room for.
    request_threshold_percent: int = 50
    release_threshold_percent: int = 150
    min_ip_count: int = 0  # the nodes' warm floor: free IPs a node may hold with no pods
    max_ip_count: int = 250  # the nodes' maxIPCount, which caps what they take back
    # The nodes' batch when an operator sets it (`spec.scaler.batchSize` outranks the batch the
    # controller publishes); 0: they scale at the controller's phase-4 batch.
    pinned_batch: int = 0
    # The nodes' own addresses inside the subnet (their Node objects' InternalIP and
    # ExternalIP), canonical: never granted, like the reserved ones (`with_node_addresses`).
    node_ips: frozenset[str] = frozenset()
    # Draining (`spec.draining`): nothing more is granted from it, to any node; what nodes hold
    # stays theirs until they give it back (docs/kubernetes.md, "Draining a subnet").
    draining: bool = False
    reservations: Reservations = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        network = self.network
        reserved = Reservations.parse(self.reserved_ips, network=network)
        bits = network.max_prefixlen - block_prefix(network)
        blocks = sum((last >> bits) - (first >> bits) + 1 for first, last in reserved.spans())
        if blocks > MAX_RESERVED_BLOCKS:
            raise ReservationError(
                f"reservedIPs touch {blocks} blocks of /{block_prefix(network)} in {network}, "
                f"more than {MAX_RESERVED_BLOCKS}: reserve less, or make the subnet smaller"
            )
        object.__setattr__(self, "reservations", reserved)

    def with_node_addresses(self, addresses: Iterable[Address]) -> Subnet:
        """This subnet with the host addresses among `addresses` excluded from what it grants:
        a pod given a node's own address would answer for the node, or the node for it."""
        network = self.network
        inside = frozenset(str(ip) for ip in addresses if host_address_problem(ip, network) is None)
        return replace(self, node_ips=inside)

    @property
    def excluded(self) -> frozenset[str]:
        """The single addresses of the subnet never granted, as spelt: the gateway and the
        nodes' own (the reserved ranges are `reservations`)."""
        return frozenset({self.gateway_address, *self.node_ips})

    def node_scaler(self, batch: int) -> Scaler:
        """The scaler the nodes use at `batch`: the controller's own view of their targets,
        for what they will hold once exhaustion clears (`reserved_once_cleared`)."""
        return Scaler(
            batch_size=batch,
            request_threshold_percent=self.request_threshold_percent,
            release_threshold_percent=self.release_threshold_percent,
            max_ip_count=self.max_ip_count,
            min_ip_count=self.min_ip_count,
        )

    @property
    def network(self) -> Network:
        return ipaddress.ip_network(self.cidr)

    @property
    def gateway_address(self) -> str:
        return self.gateway or str(next(self.network.hosts()))

    def usable(self) -> Iterator[str]:
        """Addresses that may be handed to nodes, in order."""
        excluded, reserved = self.excluded, self.reservations
        for host in self.network.hosts():
            address = str(host)
            if address not in excluded and host not in reserved:
                yield address

    def is_usable(self, address: str) -> bool:
        """Whether `usable()` yields `address`, without walking the subnet."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if host_address_problem(ip, self.network) is not None:
            return False
        return address not in self.excluded and ip not in self.reservations

    @property
    def host_span(self) -> tuple[int, int]:
        """The first and last host address, as integers: the network's addresses less its
        network address (IPv4 up to /30; IPv6: the Subnet-Router anycast) and IPv4 broadcast
        (`host_address_problem`'s rule)."""
        network = self.network
        first, last = int(network.network_address), int(network.broadcast_address)
        if network.version == 4 and network.prefixlen <= 30:
            return first + 1, last - 1
        if network.version == 6:
            return first + 1, last
        return first, last

    def excluded_values(self) -> set[int]:
        """`excluded` as integers, those inside the network: only an address's canonical
        spelling excludes it, since `is_usable` compares them as strings."""
        network = self.network
        values = set()
        for text in self.excluded:
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue
            if str(ip) == text and ip.version == network.version and ip in network:
                values.add(int(ip))
        return values

    @property
    def capacity(self) -> int:
        """How many addresses `usable()` yields, counted without walking the subnet."""
        first, last = self.host_span
        reservations = self.reservations
        others = sum(
            1
            for value in self.excluded_values()
            if first <= value <= last and not reservations.holds(value)
        )
        return max(0, last - first + 1 - reservations.count_between(first, last) - others)
