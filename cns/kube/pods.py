"""Pods and Namespaces: the address a pod asks for, the subnets its ADD draws from (its own
annotation, else its namespace's), and whether it counts as demand for an address.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

from cni_plugin.skel import MAX_SUBNET_NAME_LENGTH, MAX_SUBNETS
from cns.core.requested import POD_ADDRESS_ANNOTATION, parse_requested
from cns.core.subnet_choice import SubnetChoiceInvalid
from cns.kube.objects import GROUP, annotations_of
from cns.kube.wire import KubeObject, Namespace, ObjectMeta, Pod


def pod_address(pod: Pod) -> str | None:
    """The address a pod asks for in its `acn.azure.com/ip-address` annotation, or one per
    family separated by a comma (`10.240.0.9,fd00::9`), canonical; None without one.
    ValueError saying what is wrong when the annotation is not that."""
    value = annotations_of(pod).get(POD_ADDRESS_ANNOTATION)
    if value is None:
        return None
    return ",".join(parse_requested(str(value))) or None


SUBNETS_ANNOTATION = f"{GROUP}/subnets"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class AnnotationInvalid(SubnetChoiceInvalid):
    """An `acn.azure.com/subnets` annotation that names no usable list of subnets: `problem`
    says why, `where` which object carries it (`pod NS/NAME` or `namespace NS`)."""

    def __init__(self, where: str, value: str, problem: str) -> None:
        super().__init__(f"annotation {SUBNETS_ANNOTATION}={value[:300]!r} of {where}: {problem}")
        self.where = where
        self.value = value


def subnets_annotation_problem(value: str) -> str | None:
    """Why an `acn.azure.com/subnets` value is not a list of subnets, or None: comma-separated
    ClusterSubnet names (DNS-1123 subdomains, spaces around a name allowed), at least one, at
    most MAX_SUBNETS (the network configuration's own limit), none twice."""
    return subnet_names_problem([name.strip() for name in value.split(",")], at_most=MAX_SUBNETS)


def subnet_names_problem(names: list[str], *, at_most: int) -> str | None:
    """Why `names` is not a list of ClusterSubnet names (DNS-1123 subdomains), at most
    `at_most`, none twice; None when it is."""
    if len(names) > at_most:
        return f"names {len(names)} subnets, at most {at_most}"
    for index, name in enumerate(names):
        if not name:
            return f"name {index + 1} is empty"
        if len(name) > MAX_SUBNET_NAME_LENGTH or not all(
            _DNS_LABEL.fullmatch(label) for label in name.split(".")
        ):
            return (
                f"{name[:64]!r} is not a ClusterSubnet name (a DNS-1123 subdomain: lower-case "
                f"letters, digits, '-' and '.', at most {MAX_SUBNET_NAME_LENGTH} characters)"
            )
    if len(set(names)) != len(names):
        return "names a subnet twice"
    return None


def annotated_subnets(obj: KubeObject, where: str) -> tuple[str, ...] | None:
    """The subnets an object's `acn.azure.com/subnets` annotation names, in its order; None
    without the annotation. AnnotationInvalid (naming `where`) when it is malformed."""
    value = annotations_of(obj).get(SUBNETS_ANNOTATION)
    if value is None:
        return None
    text = str(value)
    problem = subnets_annotation_problem(text)
    if problem is not None:
        raise AnnotationInvalid(where, text, problem)
    return tuple(name.strip() for name in text.split(","))


def pod_subnets(
    pod: Pod | None, namespace: Namespace | None, configured: tuple[str, ...]
) -> tuple[str, ...]:
    """The subnets a pod's ADD draws from, chosen as Calico chooses its IP pools: the pod's
    annotation, else its namespace's, else the network configuration's `subnets`; () means the
    node's primary subnet. None for an object that does not exist (or is not known). A
    malformed annotation is AnnotationInvalid, never a fall back to the next choice: the pod
    would land in a subnet nobody chose."""
    if pod is not None:
        meta = pod.get("metadata") or {}
        where = f"pod {meta.get('namespace', '')}/{meta.get('name', '')}"
        if (chosen := annotated_subnets(pod, where)) is not None:
            return chosen
    if namespace is not None:
        where = f"namespace {(namespace.get('metadata') or {}).get('name', '')}"
        if (chosen := annotated_subnets(namespace, where)) is not None:
            return chosen
    return configured


def namespace_identity(namespace: Namespace) -> Namespace:
    """A Namespace as the daemon keeps it: name, resourceVersion and the one annotation it
    reads (labels, finalizers and status are nothing to it; every node holds every namespace)."""
    meta: Mapping[str, Any] = namespace.get("metadata") or {}
    kept = cast(ObjectMeta, {key: meta[key] for key in ("name", "resourceVersion") if key in meta})
    annotations = annotations_of(namespace)
    if SUBNETS_ANNOTATION in annotations:
        kept["annotations"] = {SUBNETS_ANNOTATION: annotations[SUBNETS_ANNOTATION]}
    return {"metadata": kept}


def pod_may_use_ip(pod: Pod) -> bool:
    """Not finished (Succeeded, Failed) and not being deleted: its sandbox may still want the IP
    it has, or be re-created and want one."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def pod_network_addresses(pod: Pod) -> tuple[str, ...]:
    """The addresses the API says a pod holds on the pod network (`status.podIPs`, else
    `status.podIP`), for a pod that may still use them (`counts_as_demand`): none for a
    host-network pod (its are the node's), nor for a finished pod or one being deleted (its DEL
    may have come already: the API's status lags behind it, and the leak check would take the
    address back anyway)."""
    if not counts_as_demand(pod):
        return ()
    status = pod.get("status") or {}
    listed = status.get("podIPs") or [{"ip": status.get("podIP") or ""}]
    found = [item.get("ip") for item in listed if isinstance(item, dict)]
    return tuple(dict.fromkeys(ip for ip in found if isinstance(ip, str) and ip))


def counts_as_demand(pod: Pod) -> bool:
    """A pod on the node that will want an IP from us (docs/design/subnet-scarcity.md, 3-1).

    Not host-network pods, finished pods, or pods being deleted (one that already has its IP is
    counted as assigned until its DEL; one that has none will never ask).
    """
    return not (pod.get("spec") or {}).get("hostNetwork") and pod_may_use_ip(pod)
