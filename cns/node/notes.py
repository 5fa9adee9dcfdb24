"""What the node tells operators as Kubernetes Events: on a pod, why its ADD waits or is
refused; on the node's NodeNetworkConfig, what changed in its pool. The recorder behind
(cns/core/events.py, written by cns/kube/events.py) aggregates repeats into one Event with a
count and never blocks; standalone, no recorder runs and these calls do nothing.

The reasons are the API: `kubectl get events --field-selector reason=WaitingForIPAddress`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cns.core.events import NO_RECORDER, NORMAL, WARNING, Note, ObjectRef, Recorder
from cns.core.subnet_choice import SubnetChoiceInvalid
from cns.core.types import Owner
from cns.node.control_plane import SubnetChooser

WAITING_FOR_IP = "WaitingForIPAddress"
REQUESTED_ADDRESS_REFUSED = "RequestedIPAddressRefused"
SUBNET_ANNOTATION_INVALID = "SubnetAnnotationInvalid"
SUBNET_EXHAUSTED = "SubnetExhausted"
SUBNET_EXHAUSTION_CLEARED = "SubnetExhaustionCleared"
BATCH_CHANGED = "BatchChanged"
LEAKED_IP_RECLAIMED = "LeakedIPReclaimed"
RELEASE_REFUSED = "IPReleaseRefused"
IP_PRESSURE = "PodIPPressure"
IP_PRESSURE_CLEARED = "PodIPPressureCleared"


def pod_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef("Pod", name, namespace)


@dataclass(frozen=True, slots=True)
class NodeEvents:
    """The node's notes; `nnc` is its NodeNetworkConfig (None: notes about it go nowhere)."""

    recorder: Recorder = NO_RECORDER
    nnc: ObjectRef | None = None

    def _pod(self, owner: Owner, type_: str, reason: str, message: str) -> None:
        if owner.pod_name:
            self.recorder.record(
                Note(pod_ref(owner.pod_namespace, owner.pod_name), type_, reason, message)
            )

    def _node(self, type_: str, reason: str, message: str) -> None:
        if self.nnc is not None:
            self.recorder.record(Note(self.nnc, type_, reason, message))

    def waiting(self, owner: Owner, *, code: str, message: str) -> None:
        """The ADD waits: `code` and `message` are the wait reason `/debug/pod` shows."""
        self._pod(owner, WARNING, WAITING_FOR_IP, f"waiting for an IP address ({code}): {message}")

    def address_refused(self, owner: Owner, message: str) -> None:
        """The address the pod asks for is taken, outside its subnets, or not an address."""
        self._pod(owner, WARNING, REQUESTED_ADDRESS_REFUSED, message)

    def subnets_invalid(self, namespace: str, name: str, message: str) -> None:
        self.recorder.record(
            Note(pod_ref(namespace, name), WARNING, SUBNET_ANNOTATION_INVALID, message)
        )

    def telling_invalid_subnets(self, choose: SubnetChooser) -> SubnetChooser:
        """`choose`, and a malformed subnet annotation told to the pod as an Event too."""

        async def chosen(namespace: str, name: str, configured: tuple[str, ...]) -> tuple[str, ...]:
            try:
                return await choose(namespace, name, configured)
            except SubnetChoiceInvalid as exc:
                self.subnets_invalid(namespace, name, str(exc))
                raise

        return chosen

    def exhaustion_changed(self, subnet: str, *, exhausted: bool) -> None:
        named = f"subnet {subnet}" if subnet else "the node's subnet"
        if exhausted:
            self._node(
                WARNING,
                SUBNET_EXHAUSTED,
                f"{named} is exhausted: the control plane has no more addresses for this node; "
                "ADDs wait for addresses pods elsewhere free",
            )
        else:
            self._node(NORMAL, SUBNET_EXHAUSTION_CLEARED, f"{named} has free addresses again")

    def batch_changed(self, subnet: str, *, before: int, after: int) -> None:
        named = f"subnet {subnet}" if subnet else "the node's subnet"
        self._node(
            NORMAL, BATCH_CHANGED, f"the batch of {named} is now {after} addresses (was {before})"
        )

    def leak_reclaimed(self, *, address: str, pod: str, why: str) -> None:
        of = f" of pod {pod}" if pod else ""
        self._node(
            NORMAL,
            LEAKED_IP_RECLAIMED,
            f"address {address}{of} reclaimed: its sandbox is gone ({why}) and no DEL came",
        )

    def release_refused(self, *, address: str) -> None:
        self._node(
            WARNING,
            RELEASE_REFUSED,
            f"the control plane asks back address {address}, which a pod here uses: kept",
        )

    def ip_pressure_changed(self, *, pressed: bool, cause: str, subnets: list[str]) -> None:
        """The node's PodIPPressure condition and taint set or cleared (cns/node/ip_pressure.py)."""
        if pressed:
            named = ", ".join(subnets) or "the node's subnet"
            self._node(
                WARNING,
                IP_PRESSURE,
                f"tainted acn.azure.com/pod-ip-pressure:NoSchedule: no address soon for another "
                f"pod ({cause or 'found set at start'}: {named})",
            )
        else:
            self._node(NORMAL, IP_PRESSURE_CLEARED, "addresses free again: the taint is removed")
