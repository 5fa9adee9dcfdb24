"""The pods scheduled on the node and every namespace, as the node's Kubernetes source reads
them (`cns.node.kube_source`): the demand they make of each subnet, the subnets an ADD's pod
chooses (its annotation, else its namespace's), the addresses pods ask for and hold.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.core.subnet_choice import SubnetChoiceInvalid, SubnetChoiceUnknown
from cns.kube.client import KubeClient
from cns.kube.objects import annotations_of
from cns.kube.pods import (
    SUBNETS_ANNOTATION,
    counts_as_demand,
    namespace_identity,
    pod_address,
    pod_may_use_ip,
    pod_network_addresses,
    pod_subnets,
)
from cns.kube.watch import WatchedCollection
from cns.kube.wire import Namespace, ObjectT

log = structlog.get_logger("cns.node.kube_pods")

# An ADD whose pod (or namespace) no watch has delivered yet reads them from the API server, for
# at most this long in all: with the 10 s an ADD may wait for an IP, within the plugins' 15 s.
LOOKUP_SECONDS = 4.0


@dataclass(frozen=True, slots=True)
class PodDemand:
    """The pods' demand by subnet ("": the primary one), and which pods (namespace/name) count
    for the primary: one of them holding an overflow subnet's address counts there instead."""

    by_subnet: dict[str, int]
    primary_pods: frozenset[str] = frozenset()


class NodePods:
    """The pod watch (the pods scheduled on the node) and the namespace watch, each calling
    `on_change`, and what the node reads of them. Malformed annotations are said once each."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        node_name: str,
        on_change: Callable[[], None],
        timeout_seconds: int,
    ) -> None:
        self.kube = kube
        self.pods = kube.watch_pods(node_name, on_change, timeout_seconds=timeout_seconds)
        self.namespaces = kube.watch_namespaces(
            on_change, slim=namespace_identity, timeout_seconds=timeout_seconds
        )
        self._bad_annotations: set[str] = set()  # pods whose address annotation was said
        self._bad_choices: set[str] = set()  # the malformed subnet annotations said so far

    def pod_uid(self, namespace: str, name: str) -> str:
        """The UID of pod `namespace/name` on the node, "" when the watch has not got it."""
        pod = self.pods.objects.get(WatchedCollection.key_for(name, namespace=namespace))
        return str(((pod or {}).get("metadata") or {}).get("uid") or "")

    def demand(self, primary: str) -> PodDemand:
        """The pods here that will want an IP, counted in each subnet their choice names (""
        the `primary` one; a dual-stack pod in both). The network configuration's `subnets` are
        not known before an ADD: a pod that no annotation places counts for the primary subnet,
        and one whose annotation is malformed nowhere (it gets no address until it is fixed)."""
        counts: Counter[str] = Counter()
        primary_pods: set[str] = set()
        for pod in self.pods.objects.values():
            if not counts_as_demand(pod):
                continue
            meta = pod.get("metadata") or {}
            namespace = self.namespaces.objects.get(
                WatchedCollection.key_for(str(meta.get("namespace", "")))
            )
            try:
                chosen = pod_subnets(pod, namespace, ())
            except SubnetChoiceInvalid as exc:
                self._say_invalid(exc)
                continue
            subnets = ["" if name == primary else name for name in chosen or ("",)]
            counts.update(subnets)
            if "" in subnets:
                primary_pods.add(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
        return PodDemand(dict(counts), frozenset(primary_pods))

    def _say_invalid(self, exc: SubnetChoiceInvalid) -> None:
        """One log line per malformed annotation (object and value), however often it is read."""
        said = str(exc)  # names the object and the value
        if said not in self._bad_choices:
            if len(self._bad_choices) >= 1024:  # bounded: a long life sees many values
                self._bad_choices.clear()
            self._bad_choices.add(said)
            log.error("subnets_annotation_invalid", annotation=SUBNETS_ANNOTATION, error=str(exc))

    async def choose_subnets(
        self, namespace: str, name: str, configured: tuple[str, ...]
    ) -> tuple[str, ...]:
        """The subnets pod `namespace/name`'s ADD draws from (`pod_subnets`): read from the
        watches' caches, or from the API server when the pod (or its namespace) is not in them
        yet (its ADD can come before the watch event). SubnetChoiceUnknown when that read
        fails: no subnet is guessed. A call without pod names uses `configured`."""
        if not namespace or not name:
            return configured
        clock = asyncio.get_running_loop().time
        deadline = clock() + LOOKUP_SECONDS
        pod = self.pods.objects.get(WatchedCollection.key_for(name, namespace=namespace))
        if pod is None:
            pod = await self._read(
                f"pod {namespace}/{name}",
                self.kube.read_pod(name, namespace=namespace, timeout=deadline - clock()),
            )
        ns: Namespace | None = None
        if pod is None or SUBNETS_ANNOTATION not in annotations_of(pod):
            ns = self.namespaces.objects.get(WatchedCollection.key_for(namespace))
            if ns is None:
                ns = await self._read(
                    f"namespace {namespace}",
                    self.kube.read_namespace(namespace, timeout=max(0.1, deadline - clock())),
                )
        try:
            return pod_subnets(pod, ns, configured)
        except SubnetChoiceInvalid as exc:
            self._say_invalid(exc)
            raise

    async def _read(self, what: str, reading: Awaitable[ObjectT | None]) -> ObjectT | None:
        """An object an ADD must know, from the API server (None: it does not exist)."""
        try:
            return await reading
        except (ApiException, OSError, TimeoutError, aiohttp.ClientError) as exc:
            reason = (
                f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else repr(exc)
            )
            log.warning("subnet_choice_unknown", object=what, error=reason)
            raise SubnetChoiceUnknown(
                f"cannot read {what} from the API server to choose its subnets "
                f"(annotation {SUBNETS_ANNOTATION}): {reason}"
            ) from exc

    def pod_addresses(self) -> dict[str, str]:
        """Pod (namespace/name) -> the address its annotation asks for, for the pods here that
        will want an IP. An annotation that is not an address is said once and ignored."""
        wanted = {}
        for pod in self.pods.objects.values():
            if not counts_as_demand(pod):
                continue
            meta = pod.get("metadata") or {}
            name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
            try:
                address = pod_address(pod)
            except ValueError as exc:
                if name not in self._bad_annotations:
                    self._bad_annotations.add(name)
                    log.error("pod_address_annotation_invalid", pod=name, error=str(exc))
                continue
            if address is not None:
                wanted[name] = address
        return wanted

    def node_pods(self) -> dict[str, bool] | None:
        """The pods on the node, namespace/name -> whether it may still use an IP (not finished,
        not being deleted), for the leak check; None until the pod watch has listed them."""
        if not self.pods.synced.is_set():
            return None
        pods = {}
        for pod in self.pods.objects.values():
            meta = pod.get("metadata") or {}
            pods[f"{meta.get('namespace', '')}/{meta.get('name', '')}"] = pod_may_use_ip(pod)
        return pods

    def live_pod_addresses(self) -> list[tuple[str, str, tuple[str, ...]]] | None:
        """(namespace/name, uid, addresses) of each pod on the node that holds addresses of the
        pod network, for the start-up check of the state file; None until the pod watch has
        listed them."""
        if not self.pods.synced.is_set():
            return None
        found = []
        for pod in self.pods.objects.values():
            if addresses := pod_network_addresses(pod):
                meta = pod.get("metadata") or {}
                name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
                found.append((name, str(meta.get("uid", "")), addresses))
        return found
