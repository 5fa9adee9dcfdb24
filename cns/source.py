"""The narrow interface between the daemon and whatever hands the node its IPs.

The embedded standalone allocator implements it today; the Kubernetes adapter (NodeNetworkConfig
spec out, status in) implements the same protocol, so the daemon cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cns.core.types import NetworkContainer, PoolRequest, Scaler


@dataclass(frozen=True, slots=True)
class SourceState:
    """Everything the control plane tells the node, as one snapshot."""

    containers: tuple[NetworkContainer, ...]
    exhausted: bool = False
    scaler: Scaler | None = None
    request: PoolRequest | None = None
    # Pods scheduled on the node that will want an IP (docs/design/subnet-scarcity.md,
    # 3-1); 0 when unknown.
    pod_demand: int = 0
    # IP ids the control plane asks the node to give up (e.g. an address it found on two
    # nodes): the node releases those no pod of its own uses, through ipsNotInUse.
    release_requests: tuple[str, ...] = ()
    # Read back from the daemon's own snapshot file, not (yet) from the control plane. The file
    # is written ahead of each publish, so its `request` may never have reached the control
    # plane: the node must not take it for what it published.
    from_snapshot: bool = False


StateListener = Callable[[SourceState], None]


class NCSource(Protocol):
    """A control plane as the node sees it: told what the node wants, streams what it has."""

    async def run(self, on_state: StateListener) -> None:
        """Deliver the current state at once, then every change, until cancelled."""

    async def publish(self, request: PoolRequest) -> None:
        """Record the node's request (`requestedIPCount` and `ipsNotInUse`)."""
