"""A pod subnet as a control plane hands it out: usable addresses and capacity.

Shared by the reference controller and the standalone allocator, so both agree on which
addresses exist: the subnet's hosts, minus the gateway and any reserved addresses.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from cns.core.types import Scaler

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


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
    """A ClusterSubnet's spec (the standalone allocator uses the addressing part)."""

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

    def with_node_addresses(self, addresses: Iterable[Address]) -> Subnet:
        """This subnet with the host addresses among `addresses` excluded from what it grants:
        a pod given a node's own address would answer for the node, or the node for it."""
        network = self.network
        inside = frozenset(str(ip) for ip in addresses if host_address_problem(ip, network) is None)
        return replace(self, node_ips=inside)

    @property
    def excluded(self) -> frozenset[str]:
        """The addresses of the subnet never granted, as spelt: the gateway, the reserved
        addresses and the nodes' own."""
        return frozenset({self.gateway_address, *self.reserved_ips, *self.node_ips})

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
        excluded = self.excluded
        for host in self.network.hosts():
            address = str(host)
            if address not in excluded:
                yield address

    def is_usable(self, address: str) -> bool:
        """Whether `usable()` yields `address`, without walking the subnet."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if host_address_problem(ip, self.network) is not None:
            return False
        return address not in self.excluded

    @property
    def capacity(self) -> int:
        network = self.network
        hosts = network.num_addresses
        if network.version == 4 and network.prefixlen <= 30:
            hosts -= 2
        elif network.version == 6:
            hosts -= 1
        others = self.reserved_ips | (self.node_ips - {self.gateway_address})
        inside = sum(1 for ip in others if ipaddress.ip_address(ip) in network)
        return max(0, hosts - 1 - inside)
