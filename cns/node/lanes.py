"""The node's lanes: one per subnet it has IPs of, asks for, or was asked for.

A lane is the node's share of one subnet: its own pool (the network containers of that subnet),
exhaustion, scaler, pod demand, and the request last sent. The primary lane is the node's own
subnet (key "" in the state file, named once its network containers name it); every other lane
is keyed by its subnet's name. Each lane plans its own request and has its own release
handshake; an ADD naming several subnets takes one IP of each lane at once or none.

Everything here runs on the event loop, synchronously: no lock, no await.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from cns.core.overflow import OverflowCandidate, overflow_open, overflow_subnet
from cns.core.pool import Assignment, IPRecord, Pool
from cns.core.requested import IPNetwork, parse_requested, place
from cns.core.types import NetworkContainer, OwnerKey, PoolRequest, Scaler
from cns.node.errors import AddressRefused, InternalError

log = structlog.get_logger("cns.node")


@dataclass(slots=True)
class NodeLane:
    """One subnet's share of the node (see the module's docstring)."""

    pool: Pool
    name: str = ""  # the subnet's name (the primary's is learnt from its network containers)
    exhausted: bool = False
    source_scaler: Scaler | None = None
    pod_demand: int = 0
    sent: PoolRequest | None = None
    published_at: float | None = None  # wall clock of the last publish
    # `sent` came from a snapshot file written ahead of a publish that may never have landed.
    sent_unconfirmed: bool = False
    listed: bool = False  # the control plane lists this subnet for the node
    # Listed once (or holding IPs the state file restored) and no longer: its pods keep their
    # IPs until their DEL; it hands none out, asks for none, and goes with its last IP.
    removed: bool = False
    # Its subnet is draining: its pods keep their IPs, it hands none out and asks only for
    # what its pods hold (the others go back through ipsNotInUse).
    draining: bool = False

    @property
    def has_network(self) -> bool:
        return bool(self.pool.containers)


class Lanes(dict[str, NodeLane]):
    """The lanes by state-file key, the primary lane ("") first; further lanes are made when the
    control plane lists their subnet, an ADD asks for it, or the state file holds one of its
    IPs, and go when nothing holds or wants them any more (`drop_idle`)."""

    def __init__(
        self,
        primary: Pool,
        *,
        config_scaler: Scaler,
        cooldowns: Mapping[str, tuple[float, str]],
        cooldown_seconds: float,
    ) -> None:
        super().__init__()
        self.primary = self[""] = NodeLane(primary)
        self.config_scaler = config_scaler
        self._cooldowns = cooldowns  # the state file's, read live: a new lane takes its own
        self._cooldown_seconds = cooldown_seconds
        # Set once the control plane has named a network container of the node: the primary lane
        # serves from then on (the daemon waits for it at start).
        self.has_network = asyncio.Event()
        # The primary subnet's overflow subnets and the pods that draw from it, as the control
        # plane said last (`SourceState.overflow`, `primary_pods`).
        self.overflow: tuple[OverflowCandidate, ...] = ()
        self.primary_pods: frozenset[str] = frozenset()

    def restore(self, assignments: Iterable[Assignment]) -> None:
        """The state file's assignments and cooldowns, each in its lane (made if need be),
        before any network container is known."""
        self.primary.pool.restore_cooldowns(
            self._cooldowns, now=time.time(), longest=self._cooldown_seconds
        )
        for assignment in assignments:
            self.lane(assignment.subnet).pool.restore(assignment)

    def lane(self, key: str) -> NodeLane:
        """The lane of state-file key `key`, made (empty, with the state file's cooldowns) if
        the node has none yet."""
        lane = self.get(key)
        if lane is None:
            pool = Pool(subnet=key)
            pool.restore_cooldowns(self._cooldowns, now=time.time(), longest=self._cooldown_seconds)
            lane = self[key] = NodeLane(pool, name=key)
        return lane

    def key(self, name: str) -> str:
        """The state-file key of the lane of subnet `name`: "" for the node's own subnet."""
        return "" if name in ("", self.primary.name) else name

    def label(self, key: str) -> str:
        """The subnet name of lane `key` ("" for the primary lane until the control plane names
        it)."""
        return key or self.primary.name

    def further(self) -> list[tuple[str, NodeLane]]:
        """Every lane but the primary, by key."""
        return [(k, lane) for k, lane in self.items() if k]

    def serves(self, lane: NodeLane) -> bool:
        """Whether the lane has a network to hand out of: the primary lane once the node has been
        given one, any other while it has a network container."""
        return self.has_network.is_set() if lane is self.primary else lane.has_network

    def scaler(self, lane: NodeLane) -> Scaler:
        """The control plane's scaler of the lane when it sends one, else the configured one."""
        return lane.source_scaler or self.config_scaler

    def drop_idle(self, demand: Callable[[str], int]) -> None:
        """Drop each further lane nothing needs any more: a removed one with its last IP, one
        the control plane does not list that no pod holds an IP of nor waits for (an ADD named
        a subnet the node did not get, and gave up)."""
        for key, lane in self.further():
            if lane.removed and not lane.pool.records:
                log.info("subnet_drained", subnet=key)
                del self[key]
            elif not lane.listed and not lane.pool.records and not demand(key):
                del self[key]

    # -- overflow (cns/core/overflow.py) -------------------------------------------------------

    def overflow_candidates(self) -> list[OverflowCandidate]:
        """The overflow subnets in order, a lane the control plane removed marked so."""
        return [
            replace(c, removed=True) if (lane := self.get(c.name)) and lane.removed else c
            for c in self.overflow
            if c.name != self.primary.name
        ]

    def overflow_open(self) -> bool:
        """Whether the primary subnet sends its pods on (exhausted or draining)."""
        primary = self.primary
        return overflow_open(primary_exhausted=primary.exhausted, primary_draining=primary.draining)

    def overflow_target(self) -> str | None:
        """The overflow subnet that takes the primary's pods now, if the gate is open."""
        primary = self.primary
        return overflow_subnet(
            primary_exhausted=primary.exhausted,
            primary_draining=primary.draining,
            candidates=self.overflow_candidates(),
        )

    def overflow_keys(self) -> list[str]:
        """The lane keys of the overflow subnets, in order (a list naming the primary itself
        leaves it out)."""
        return [c.name for c in self.overflow if self.key(c.name)]

    def overflowed(self, key: str) -> int:
        """Pods drawing from the primary subnet that hold an address of further lane `key`
        instead of one of the primary (sent on; a dual-stack pod holds one of each)."""
        lane = self.get(key)
        if lane is None or not key or not self.primary_pods:
            return 0
        pods, primary = self.primary_pods, self.primary.pool
        return sum(
            1
            for a in lane.pool.assignments()
            if a.owner.pod in pods and primary.lookup(a.owner.key) is None
        )

    def sent_on(self, key: OwnerKey, named: Sequence[str]) -> str | None:
        """The further lane, not among the `named` keys, in which the attachment holds an
        address while it holds none of the primary: where an earlier ADD of it was sent on.
        Known from the state file alone, before the control plane names any overflow subnet
        (after a restart), so that a repeated ADD never takes a second address."""
        if self.primary.pool.lookup(key) is not None:
            return None
        return next(
            (
                k
                for k, lane in self.further()
                if k not in named and lane.pool.lookup(key) is not None
            ),
            None,
        )

    # -- what the lanes hold -------------------------------------------------------------------

    def held_by(self, key: OwnerKey) -> list[IPRecord]:
        """The IPs the attachment holds, primary lane first."""
        return [r for lane in self.values() if (r := lane.pool.lookup(key)) is not None]

    def held_by_container(self, container_id: str) -> list[IPRecord]:
        """The IPs any interface of the container holds, in every lane."""
        return [r for lane in self.values() for r in lane.pool.held_by_container(container_id)]

    def network_of(self, record: IPRecord) -> NetworkContainer:
        for lane in self.values():
            nc = lane.pool.network_container(record.nc_id)
            if nc is not None:
                return nc
        raise InternalError(102, f"IP {record.address} belongs to unknown NC {record.nc_id}")

    # -- where an address belongs --------------------------------------------------------------

    def networks(self) -> dict[str, list[IPNetwork]]:
        """Every lane's prefixes (of its network containers), by the lane's subnet name."""
        networks: dict[str, list[IPNetwork]] = {}
        for key, lane in self.items():
            nets = networks.setdefault(self.label(key), [])
            for nc in lane.pool.containers.values():
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(nc.subnet, strict=False))
        return networks

    def place(self, keys: Sequence[str], addresses: Sequence[str]) -> dict[str, str]:
        """Lane key -> the requested address that lane gives (cns/core/requested.py, `place`).
        Misplaced when one does not fit the lanes named; AddressRefused for one no named lane
        can be told to hold yet, as some has no network container."""
        networks = self.networks()
        labels = [self.label(key) for key in keys]
        placed, unplaced = place(addresses, named=labels, networks=networks)
        if unplaced:
            lacking = next(k for k, label in zip(keys, labels, strict=True) if not networks[label])
            raise AddressRefused(
                unplaced[0],
                f"{no_network(lacking)}, so which subnet {unplaced[0]} is in is not known",
            )
        key_of = dict(zip(labels, keys, strict=True))
        return {key_of[label]: address for label, address in placed.items()}

    def wanted(self, pod_addresses: Mapping[str, str]) -> dict[str, frozenset[str]]:
        """Per lane (key), the addresses pods here ask for in their annotations that the lane is
        to ask the control plane for: those inside its network containers. One inside no lane's
        is the primary lane's if it is of that lane's family (or that is not known): an IPv6
        address waits for its lane's container rather than being asked of an IPv4 subnet."""
        if not pod_addresses:
            return {}
        networks = self.networks()
        primary = networks.get(self.primary.name, [])
        found: dict[str, set[str]] = collections.defaultdict(set)
        for value in pod_addresses.values():
            with contextlib.suppress(ValueError):
                for address in parse_requested(value):
                    ip = ipaddress.ip_address(address)
                    home = next(
                        (n for n, nets in networks.items() if any(ip in x for x in nets)), None
                    )
                    if home is None and all(net.version == ip.version for net in primary):
                        home = self.primary.name
                    if home is not None:
                        found[self.key(home)].add(address)
        return {key: frozenset(addresses) for key, addresses in found.items()}


def assignment(record: IPRecord, subnet: str = "") -> Assignment:
    """The state file's row of an assigned IP of lane `subnet`."""
    assert record.owner is not None
    return Assignment(record.id, record.address, record.nc_id, record.owner, subnet)


def no_network(key: str) -> str:
    """Why lane `key` has nothing to hand out yet."""
    if not key:
        return "no network container from the control plane yet"
    return f"the node has no network container of subnet {key} yet"
