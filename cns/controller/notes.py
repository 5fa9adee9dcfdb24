"""What the controller tells operators as Kubernetes Events, on the ClusterSubnet (exhaustion,
duplicates) and on a node's NodeNetworkConfig (an address it holds that a node took, or that a
reservation now covers). Said once
when it appears and once when it is gone, as the log says it; the recorder (cns/kube/events.py)
aggregates and never blocks a round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cns.core.events import NO_RECORDER, NORMAL, WARNING, Note, ObjectRef, Recorder
from cns.kube.objects import CLUSTER_SUBNET, NNC

SUBNET_EXHAUSTED = "SubnetExhausted"
SUBNET_EXHAUSTION_CLEARED = "SubnetExhaustionCleared"
DUPLICATE_ADDRESS = "DuplicateAddress"
DUPLICATE_ADDRESS_WITHDRAWN = "DuplicateAddressWithdrawn"
NODE_ADDRESS_IN_USE = "NodeAddressInUse"
NODE_ADDRESS_IN_USE_RESOLVED = "NodeAddressInUseResolved"
RESERVED_ADDRESS_IN_USE = "ReservedAddressInUse"
RESERVED_ADDRESS_IN_USE_RESOLVED = "ReservedAddressInUseResolved"


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """A kind of address a pod may hold but no node is granted again, as it is told."""

    what: str  # "a node's own address"
    remedy: str  # what the operator may do
    in_use: str  # the Events' reasons
    resolved: str
    log_event: str  # the log's event; `<log_event>_resolved` once none holds it


NODE_ADDRESS = Withdrawn(
    "a node's own address", "a node and a pod now answer for it: move one of them",
    NODE_ADDRESS_IN_USE, NODE_ADDRESS_IN_USE_RESOLVED, "node_address_conflict",
)  # fmt: skip
RESERVED_ADDRESS = Withdrawn(
    "reserved (the ClusterSubnet's reservedIPs)", "end or move the pod to free it for its use",
    RESERVED_ADDRESS_IN_USE, RESERVED_ADDRESS_IN_USE_RESOLVED, "reserved_address_held",
)  # fmt: skip


def subnet_ref(name: str) -> ObjectRef:
    return ObjectRef("ClusterSubnet", name, "", CLUSTER_SUBNET.api_version)


@dataclass(frozen=True, slots=True)
class ControllerEvents:
    recorder: Recorder = NO_RECORDER
    namespace: str = ""  # the NodeNetworkConfigs'

    def nnc_ref(self, node: str) -> ObjectRef:
        return ObjectRef("NodeNetworkConfig", node, self.namespace, NNC.api_version)

    def exhaustion_changed(self, subnet: str, *, exhausted: bool) -> None:
        if exhausted:
            note = Note(
                subnet_ref(subnet),
                WARNING,
                SUBNET_EXHAUSTED,
                f"subnet {subnet} is exhausted: no free address for a node that asks; nodes "
                "ask in batches of 1 until it clears",
            )
        else:
            note = Note(
                subnet_ref(subnet),
                NORMAL,
                SUBNET_EXHAUSTION_CLEARED,
                f"subnet {subnet} has free addresses again",
            )
        self.recorder.record(note)

    def duplicate(self, subnet: str, *, address: str, nodes: Iterable[str]) -> None:
        self.recorder.record(
            Note(
                subnet_ref(subnet),
                WARNING,
                DUPLICATE_ADDRESS,
                f"address {address} is listed by nodes {', '.join(nodes)}: each is asked to "
                "release it if no pod uses it",
            )
        )

    def duplicate_withdrawn(self, subnet: str, *, address: str) -> None:
        self.recorder.record(
            Note(
                subnet_ref(subnet),
                NORMAL,
                DUPLICATE_ADDRESS_WITHDRAWN,
                f"address {address} is listed by one node again",
            )
        )

    def withdrawn_in_use(
        self, subnet: str, kind: Withdrawn, *, address: str, held_by: Iterable[str]
    ) -> None:
        """A withdrawn address a pod of `held_by` still holds: on the subnet and each holder."""
        holders = list(held_by)
        message = (
            f"address {address} of subnet {subnet} is {kind.what}, and a pod on "
            f"{', '.join(holders)} holds it: it stays with the pod until released, then is "
            f"never granted again; {kind.remedy}"
        )
        self.recorder.record(Note(subnet_ref(subnet), WARNING, kind.in_use, message))
        for node in holders:
            self.recorder.record(Note(self.nnc_ref(node), WARNING, kind.in_use, message))

    def withdrawn_released(self, subnet: str, kind: Withdrawn, *, address: str) -> None:
        self.recorder.record(
            Note(
                subnet_ref(subnet),
                NORMAL,
                kind.resolved,
                f"address {address} ({kind.what}) is no longer held by a pod",
            )
        )
