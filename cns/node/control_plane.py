"""The narrow interface between the daemon and whatever hands the node its IPs.

The embedded standalone allocator implements it, and so does the Kubernetes adapter
(NodeNetworkConfig spec out, status in), so the daemon cannot tell them apart. `MemorySource`
holds a control plane in memory, for tests of the node service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from cns.core.overflow import OverflowCandidate
from cns.core.types import IgnoredContainer, NetworkContainer, PoolRequest, Scaler


@dataclass(frozen=True, slots=True)
class FurtherSubnetState:
    """What the control plane tells the node of one further subnet (a lane beside the primary):
    the same figures `SourceState` has for the primary subnet."""

    containers: tuple[NetworkContainer, ...] = ()
    exhausted: bool = False
    scaler: Scaler | None = None
    request: PoolRequest | None = None
    pod_demand: int = 0
    draining: bool = False  # its ClusterSubnet's `spec.draining`


# What a node that asks for no further subnet publishes beside its primary request.
NO_SUBNETS: Mapping[str, PoolRequest] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SourceState:
    """Everything the control plane tells the node, as one snapshot.

    The top-level fields are the primary subnet's (they mirror the Azure-compatible top level of
    the NodeNetworkConfig); `subnets` holds every further subnet by name (dual-stack: the IPv6
    one)."""

    containers: tuple[NetworkContainer, ...]
    exhausted: bool = False
    scaler: Scaler | None = None
    request: PoolRequest | None = None
    # Pods scheduled on the node that will want an IP (docs/design/subnet-scarcity.md,
    # 3-1); 0 when unknown.
    pod_demand: int = 0
    # The primary subnet is draining (its ClusterSubnet's `spec.draining`): no new address.
    draining: bool = False
    # IP ids the control plane asks the node to give up (e.g. an address it found on two
    # nodes): the node releases those no pod of its own uses, through ipsNotInUse.
    release_requests: tuple[str, ...] = ()
    # Pod (namespace/name) -> the address it asks for in its annotation (Kubernetes mode).
    pod_addresses: Mapping[str, str] = field(default_factory=dict)
    # Network containers left out of `containers`, one entry per field at fault.
    ignored: tuple[IgnoredContainer, ...] = ()
    # Read back from the daemon's own snapshot file, not (yet) from the control plane. The file
    # is written ahead of each publish, so its `request` may never have reached the control
    # plane: the node must not take it for what it published.
    from_snapshot: bool = False
    subnets: Mapping[str, FurtherSubnetState] = field(default_factory=dict)
    # The control plane holds no record of the node at all (its NodeNetworkConfig was
    # deleted): every network container is withdrawn, and the node's subnets stay, asking for
    # the addresses its pods hold, until the record is back.
    gone: bool = False
    # The overflow subnets the primary subnet's ClusterSubnet names, in its order, each as the
    # node reads its own ClusterSubnet and ClusterSubnetState (cns/core/overflow.py).
    overflow: tuple[OverflowCandidate, ...] = ()
    # The pods (namespace/name) counted in `pod_demand`: those that draw from the primary
    # subnet. One that holds an overflow subnet's address counts there instead.
    primary_pods: frozenset[str] = frozenset()


StateListener = Callable[[SourceState], None]


# The subnets a pod's ADD draws from: (pod namespace, pod name, the network configuration's
# `subnets`) -> names (none: the primary subnet). Raises the errors of cns/core/subnet_choice.py.
SubnetChooser = Callable[[str, str, tuple[str, ...]], Awaitable[tuple[str, ...]]]


async def configured_subnets(
    namespace: str, name: str, configured: tuple[str, ...]
) -> tuple[str, ...]:
    """The chooser of a node without annotations (standalone): the network configuration's."""
    return configured


class NCSource(Protocol):
    """A control plane as the node sees it: told what the node wants, streams what it has."""

    async def run(self, on_state: StateListener) -> None:
        """Deliver the current state at once, then every change, until cancelled."""

    async def publish(
        self, request: PoolRequest, subnets: Mapping[str, PoolRequest] = NO_SUBNETS
    ) -> None:
        """Record the node's request (`requestedIPCount` and `ipsNotInUse`) for the primary
        subnet and, in the same write, each further subnet's by name (a subnet left out is no
        longer wanted)."""


class MemorySource:
    """A control plane held in memory, played by its caller: the NCSource of the unit tests.

    What the node publishes is kept in `published`; `tell` hands the node a new state, on the
    caller's stack, so it has been applied when `tell` returns. A control plane that cannot be
    reached (`reachable = False`) fails publishes as a remote one would; those are kept in
    `unheard`. The further subnets' requests of each publish heard are in `published_subnets`.
    """

    def __init__(self, state: SourceState | None = None) -> None:
        self.state = state if state is not None else SourceState(())
        self.published: list[PoolRequest] = []
        self.unheard: list[PoolRequest] = []
        self.published_subnets: list[Mapping[str, PoolRequest]] = []
        self.reachable = True
        self._listeners: list[StateListener] = []

    async def run(self, on_state: StateListener) -> None:
        on_state(self.state)
        self._listeners.append(on_state)
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._listeners.remove(on_state)

    async def publish(
        self, request: PoolRequest, subnets: Mapping[str, PoolRequest] = NO_SUBNETS
    ) -> None:
        if not self.reachable:
            self.unheard.append(request)
            raise ConnectionError("control plane unreachable")
        self.published.append(request)
        self.published_subnets.append(dict(subnets))

    def tell(self, state: SourceState) -> None:
        """The control plane's new state, delivered to every running `run` at once."""
        self.state = state
        for on_state in list(self._listeners):
            on_state(state)
