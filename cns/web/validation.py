"""What the socket API accepts in its identifiers (docs/api.md, "Validation"); pure.

Every value checked here ends up in the state file, a log line, a release-queue file name or a
netlink request. Anything that is not refused at the door can fail a later step that other
requests share (a lone surrogate cannot be encoded for SQLite, and one failed group commit fails
every ADD in it), so the daemon refuses it with a message naming the field.

The container ID and interface name rules are the CNI plugins' own (`cni_plugin.skel`, stdlib
only), so the plugins and the daemon can never disagree about them; pod names and namespaces
follow the same character rule with Kubernetes' length limits (a pod name is a DNS subdomain of at
most 253 characters, a namespace a DNS label of at most 63), leniently: upper case and '_' are
accepted because podman passes container names there.
"""

from __future__ import annotations

from cni_plugin.skel import (
    MAX_CONTAINER_ID_LENGTH,
    identifier_problem,
    ifname_problem,
    subnets_problem,
)

MAX_POD_NAME_LENGTH = 253
MAX_POD_NAMESPACE_LENGTH = 63
MAX_NETNS_BYTES = 4095  # PATH_MAX minus the terminating NUL

__all__ = [
    "MAX_CONTAINER_ID_LENGTH",
    "container_id_problem",
    "ifname_problem",
    "netns_problem",
    "pod_name_problem",
    "pod_namespace_problem",
    "subnets_problem",
]


def container_id_problem(value: str) -> str | None:
    """Why `value` is not a container ID (`[a-zA-Z0-9][a-zA-Z0-9_.-]*`, <= 1024), or None."""
    return identifier_problem(value, MAX_CONTAINER_ID_LENGTH)


def pod_name_problem(value: str) -> str | None:
    return identifier_problem(value, MAX_POD_NAME_LENGTH)


def pod_namespace_problem(value: str) -> str | None:
    return identifier_problem(value, MAX_POD_NAMESPACE_LENGTH)


def netns_problem(value: str) -> str | None:
    """Why `value` is not a network namespace path, or None: printable (no NUL, no control
    characters, no lone surrogates) and at most PATH_MAX bytes."""
    too_long = f"longer than {MAX_NETNS_BYTES} bytes"
    if len(value) > MAX_NETNS_BYTES:  # checked first: never scan a megabyte of it
        return too_long
    if not value.isprintable():  # every character printable: one C loop, no generator
        return "contains NUL, control characters or invalid Unicode"
    if len(value.encode("utf-8")) > MAX_NETNS_BYTES:
        return too_long
    return None
