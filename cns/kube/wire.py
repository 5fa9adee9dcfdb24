"""The Kubernetes objects cns reads and writes, as typed dicts: their fields as the CRDs in
config/crd (and Kubernetes, for Pods, Namespaces and Nodes) declare them.

A static type, not a check: the API server checks the custom objects against their schemas,
but an object may come from elsewhere (the snapshot file, a test, an older CRD), so every reader
in cns/kube still checks each field it reads and says which one is wrong. Every key is optional
(`total=False`) unless the code cannot do without it (`Required`): a merge patch is a partial
object of the same type, and `{}` stands for an object that does not exist (what
`WatchedCollection.first` returns while it holds none).
"""

from __future__ import annotations

from typing import Any, Required, TypedDict, TypeVar

from cns.core.allocation import Entry
from cns.core.types import IPConfig

# A JSON value whose shape cns does not read (it passes it on, or only looks for addresses).
JSON = Any


class OwnerReference(TypedDict, total=False):
    apiVersion: Required[str]
    kind: Required[str]
    name: Required[str]
    uid: Required[str]
    controller: bool
    blockOwnerDeletion: bool


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[OwnerReference]
    deletionTimestamp: str
    finalizers: list[str]
    managedFields: list[JSON]  # dropped from every cached object (`without_managed_fields`)


class KubeObject(TypedDict, total=False):
    """What every object has: its kind and its metadata."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta


# Any one kind of object: what the client and the watched collections hold.
ObjectT = TypeVar("ObjectT", bound=KubeObject)


class WireScaler(TypedDict, total=False):
    """A scaler (`status.scaler` of an NNC or a ClusterSubnet, `spec.scaler` of a
    ClusterSubnet): the fields of `cns.core.types.Scaler`, by their wire names."""

    batchSize: int
    requestThresholdPercent: int
    releaseThresholdPercent: int
    maxIPCount: int
    minIPCount: int


# NodeNetworkConfig (acn.azure.com/v1alpha): the node's request in `spec`, its addresses in
# `status`.


class IPAssignment(TypedDict):
    """One address of a network container: `name` is the IP config's id."""

    name: str
    ip: str


class WireNetworkContainer(TypedDict, total=False):
    """One entry of an NNC's `status.networkContainers`: the addresses of one subnet."""

    id: str
    assignmentMode: str
    type: str
    status: str
    primaryIP: str
    subnetName: str
    subnetAddressSpace: str
    defaultGateway: str
    nodeIP: str
    version: int
    # A tuple where the controller's cache holds them parsed already (`slim_nnc`).
    ipAssignments: list[IPAssignment] | tuple[IPConfig, ...]


class RequestFields(TypedDict, total=False):
    """A request of one subnet's addresses (`cns.core.types.PoolRequest`)."""

    requestedIPCount: int
    ipsNotInUse: list[str]
    requestedIPs: list[str]


class SubnetRequest(RequestFields, total=False):
    """One entry of an NNC's `spec.subnets`: the node's request of a further ClusterSubnet."""

    name: Required[str]


class NNCSpec(RequestFields, total=False):
    """What the node asks for: its primary subnet's request, and the further subnets'."""

    subnets: list[SubnetRequest]


class NNCStatus(TypedDict, total=False):
    """What the control plane gives the node."""

    assignedIPCount: int
    status: str  # "Updated", "SubnetFull"
    ipsToRelease: list[str]
    scaler: WireScaler
    networkContainers: list[WireNetworkContainer]


class NodeNetworkConfig(KubeObject, total=False):
    spec: NNCSpec
    status: NNCStatus


# IPBlock (acn.azure.com/v1alpha1): one block of a subnet's addresses and who holds each.


class IPBlockSpec(TypedDict, total=False):
    subnet: str
    cidr: str
    # address -> its allocation as `encode_entry` writes it; already decoded in the
    # controller's cache (`slim_block`). `decode_entry` reads an earlier map form too.
    allocations: dict[str, str] | dict[str, Entry]


class IPBlock(KubeObject, total=False):
    spec: IPBlockSpec


# ClusterSubnet and ClusterSubnetState (acn.azure.com/v1alpha1): a subnet the controller
# divides among the nodes, and whether it is exhausted.


class Exhaustion(TypedDict, total=False):
    upperPercent: int
    lowerPercent: int


class ClusterSubnetSpec(TypedDict, total=False):
    subnet: Required[str]
    gateway: str
    reservedIPs: list[str]
    exhaustion: Exhaustion
    nodeSafetyFactor: int
    nodeSelector: JSON  # checked by `cns.core.placement.parse_node_selector`
    maxBatchSize: int
    scaler: WireScaler
    draining: bool
    overflow: list[str]


class DrainNode(TypedDict):
    name: str
    addressesHeld: int


class Drain(TypedDict):
    """A draining subnet's progress: addresses nodes still hold for pods, in all and by node
    (those holding any, by name)."""

    addressesHeld: int
    nodes: list[DrainNode]


class ClusterSubnetStatus(TypedDict, total=False):
    scaler: WireScaler
    reservedIPCount: int
    capacity: int
    nodeCount: int
    utilizationPercent: float
    exhausted: bool
    batchChanges: int
    duplicateIPCount: int
    conflictIPCount: int
    draining: bool
    drain: Drain | None


class ClusterSubnet(KubeObject, total=False):
    spec: ClusterSubnetSpec
    status: ClusterSubnetStatus


class ClusterSubnetStateStatus(TypedDict, total=False):
    exhausted: bool
    timestamp: str


class ClusterSubnetState(KubeObject, total=False):
    status: ClusterSubnetStateStatus


# Pods, Namespaces and Nodes (v1): the fields cns reads.


class PodSpec(TypedDict, total=False):
    nodeName: str
    hostNetwork: bool


class PodIP(TypedDict, total=False):
    ip: str


class PodStatus(TypedDict, total=False):
    phase: str
    podIP: str
    podIPs: list[PodIP]


class Pod(KubeObject, total=False):
    spec: PodSpec
    status: PodStatus


class Namespace(KubeObject, total=False):
    """Its metadata only (its annotations choose its pods' subnets)."""


class NodeAddress(TypedDict, total=False):
    type: str  # InternalIP, ExternalIP, Hostname, ...
    address: str


class NodeCondition(TypedDict, total=False):
    type: Required[str]
    status: str  # True, False, Unknown
    reason: str
    message: str
    lastHeartbeatTime: str
    lastTransitionTime: str


class NodeStatus(TypedDict, total=False):
    addresses: list[NodeAddress]
    conditions: list[NodeCondition]


class Taint(TypedDict, total=False):
    key: Required[str]
    value: str
    effect: Required[str]  # NoSchedule, PreferNoSchedule, NoExecute
    timeAdded: str


class NodeSpec(TypedDict, total=False):
    taints: list[Taint] | None  # None in a merge patch: the last taint removed


class Node(KubeObject, total=False):
    """Its metadata (its labels choose its subnet), addresses (never granted to pods), and the
    taint and condition of IP pressure (cns/kube/node_pressure.py)."""

    spec: NodeSpec
    status: NodeStatus
