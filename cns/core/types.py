"""Value types shared by the pool, the scaler, the adapters and the control plane.

They are frozen dataclasses (OwnerKey a NamedTuple) so that anything handed across a layer
cannot be changed behind the receiver's back; the pool keeps its own mutable records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class IPState(enum.StrEnum):
    """Lifecycle of one secondary IP on the node (names match Azure CNS)."""

    AVAILABLE = "Available"
    ASSIGNED = "Assigned"
    PENDING_RELEASE = "PendingRelease"
    PENDING_PROGRAMMING = "PendingProgramming"
    # Released by a pod less than `ipCooldownSeconds` ago: not handed out again yet, so that
    # traffic still in flight for the old pod does not reach a new one.
    COOLDOWN = "Cooldown"


class OwnerKey(NamedTuple):
    """What identifies an attachment to the CNI: the container and its interface.

    Immutable like the dataclasses here, but a tuple: the key of the pool's and the node's
    indexes is hashed and compared several times per request, and a tuple does both in C."""

    container_id: str
    ifname: str


@dataclass(frozen=True, slots=True)
class Owner:
    """An attachment plus the pod it belongs to, when the runtime told us."""

    container_id: str
    ifname: str
    pod_name: str = ""
    pod_namespace: str = ""
    # The attachment's key, made once: the pool and the node look an owner up by it several
    # times per request.
    key: OwnerKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", OwnerKey(self.container_id, self.ifname))

    @property
    def pod(self) -> str:
        """`namespace/name`, or "" when the runtime named no pod."""
        return f"{self.pod_namespace}/{self.pod_name}" if self.pod_name else ""

    def conflicts_with(self, other: Owner) -> bool:
        """Both name a pod, and not the same one: the same attachment cannot belong to both."""
        return bool(self.pod_name and other.pod_name) and (
            (self.pod_name, self.pod_namespace) != (other.pod_name, other.pod_namespace)
        )


@dataclass(frozen=True, slots=True)
class IPConfig:
    """One secondary IP as the control plane hands it out.

    `version` is the network-container version in which the IP first appeared; the IP stays
    `PendingProgramming` until the control plane reports that version as programmed.
    """

    id: str
    address: str
    version: int = 0


@dataclass(frozen=True, slots=True)
class NetworkContainer:
    """The node's share of a pod subnet: a primary IP plus secondary IP configs."""

    id: str
    primary_ips: tuple[str, ...]
    subnet: str
    gateway: str
    ip_configs: tuple[IPConfig, ...] = ()
    version: int = 0
    programmed_version: int = 0
    # The pod subnet's name (the wire's `subnetName`): which lane of the node the NC feeds;
    # "" for the primary subnet when the control plane does not name it.
    subnet_name: str = ""


@dataclass(frozen=True, slots=True)
class Scaler:
    """Pool scaling parameters, as in the NodeNetworkConfig `status.scaler`."""

    batch_size: int = 16
    request_threshold_percent: int = 50
    release_threshold_percent: int = 150
    max_ip_count: int = 250
    # The warm floor: secondary IPs a node holds even without pods (0: none).
    min_ip_count: int = 0

    def problems(self) -> list[str]:
        """Field-named reasons why this scaler cannot be used; empty when it is valid."""
        found = []
        if self.batch_size < 1:
            found.append(f"batchSize must be >= 1, got {self.batch_size}")
        if not 0 <= self.request_threshold_percent <= 100:
            found.append(
                f"requestThresholdPercent must be in 0..100, got {self.request_threshold_percent}"
            )
        if self.release_threshold_percent < self.request_threshold_percent + 100:
            found.append(
                "releaseThresholdPercent must be >= requestThresholdPercent + 100 "
                f"(else the pool oscillates), got {self.release_threshold_percent}"
            )
        if self.max_ip_count < 1:
            found.append(f"maxIPCount must be >= 1, got {self.max_ip_count}")
        if not 0 <= self.min_ip_count < self.max_ip_count:
            found.append(
                f"minIPCount must be in 0..maxIPCount-1 ({self.max_ip_count - 1}), "
                f"got {self.min_ip_count}"
            )
        return found


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """What the node asks of the control plane (the NodeNetworkConfig spec)."""

    requested_ip_count: int
    ips_not_in_use: tuple[str, ...] = field(default_factory=tuple)
    # Addresses pods on the node ask for (their annotation) that the node does not hold: the
    # control plane grants each one that is free in the subnet (`spec.requestedIPs`).
    requested_ips: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class SubnetStatus:
    """What the control plane computed last time (ClusterSubnet status, ClusterSubnetState)."""

    exhausted: bool = False
    reserved: int = 0
    batch: int = 0
    batch_changes: int = 0


@dataclass(frozen=True, slots=True)
class IgnoredContainer:
    """A network container the control plane lists that the node does not use, or one entry
    of its `ipAssignments` (`assignment` names it): its `field` says `value`, which the node's
    data path cannot honour (docs/azure-compat.md) or which is invalid (`reason` says why).
    Kept in the state so that the node shows it (`cns status`, /debug, /metrics) rather than
    nothing at all."""

    id: str
    field: str
    value: str
    reason: str = ""
    assignment: str = ""  # the ipAssignments entry's name ("" for the container's own field)

    @property
    def whole_container(self) -> bool:
        """The container is left out (not only one of its IP assignments)."""
        return not self.field.startswith("ipAssignments")
