"""The ClusterSubnet (a subnet the controller divides among the nodes) and its
ClusterSubnetState (whether it is exhausted): read as the planner's `Subnet` and the status
recorded last, and written.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Mapping
from typing import cast

from cns.core.overflow import MAX_OVERFLOW_SUBNETS
from cns.core.subnet import Subnet
from cns.core.types import Scaler, SubnetStatus
from cns.kube.objects import CLUSTER_SUBNET_STATE
from cns.kube.pods import subnet_names_problem
from cns.kube.scalers import merge_scalers, scaler_to_wire
from cns.kube.wire import (
    ClusterSubnet,
    ClusterSubnetSpec,
    ClusterSubnetState,
    ClusterSubnetStatus,
    Drain,
    WireScaler,
)


def cluster_subnet(cs: ClusterSubnet, default_scaler: Scaler) -> Subnet:
    """A ClusterSubnet's spec as the planner's Subnet, with the request and release thresholds
    the nodes will use.

    Those are the thresholds of the scaler the controller publishes in `status.scaler`: the same
    merge of `spec.scaler` over its default scaler (a field set to 0, or a combination the scaler
    refuses, is ignored the same way as on the nodes). The phase-4 batch's grow bound is only as
    good as these thresholds (docs/design/phase4.md, "The rule"). The batch is pinned when the
    scaler the controller publishes has the same batch whatever batch it computed: set by
    `spec.scaler`, the nodes take that one, and count on it once the exhaustion clears.
    """
    spec = cs.get("spec") or cast(ClusterSubnetSpec, {})  # without `subnet`: a KeyError below
    exhaustion = spec.get("exhaustion") or {}
    thresholds = merge_scalers(default_scaler, spec.get("scaler"))
    one, two = (
        merge_scalers(default_scaler, spec.get("scaler"), {"batchSize": computed}).batch_size
        for computed in (1, 2)
    )
    return Subnet(
        name=cs["metadata"]["name"],
        cidr=str(spec["subnet"]),
        gateway=str(spec.get("gateway") or ""),
        reserved_ips=frozenset(str(ip) for ip in spec.get("reservedIPs") or ()),
        upper_percent=int(exhaustion.get("upperPercent", 90)),
        lower_percent=int(exhaustion.get("lowerPercent", 50)),
        node_safety_factor=int(spec.get("nodeSafetyFactor", 2)),
        max_batch=int(spec.get("maxBatchSize", 16)),
        request_threshold_percent=thresholds.request_threshold_percent,
        release_threshold_percent=thresholds.release_threshold_percent,
        min_ip_count=thresholds.min_ip_count,
        max_ip_count=thresholds.max_ip_count,
        pinned_batch=one if one == two else 0,
        draining=spec_draining(spec),
    )


def spec_draining(spec: ClusterSubnetSpec) -> bool:
    """`spec.draining`, a boolean when set: anything else is refused (ValueError), so that a
    subnet is never drained, nor kept granting, on a misspelt value such as the string "false"."""
    draining = spec.get("draining", False)
    if not isinstance(draining, bool):
        raise ValueError(f"spec.draining: {draining!r} is not a boolean (true or false)")
    return draining


def subnet_draining(cs: ClusterSubnet) -> bool:
    """Whether a node treats the ClusterSubnet as draining: `spec.draining` true. Any other
    value is the controller's to refuse (`spec_draining`: it then serves the subnet not at
    all); the node does not drain on it."""
    spec = cs.get("spec")
    return spec is not None and spec.get("draining") is True


def subnet_family(cs: ClusterSubnet) -> int | None:
    """The IP version of a ClusterSubnet's `spec.subnet` as a node reads it (an overflow
    subnet takes only pods of its primary's family); None when it has none to read."""
    spec = cs.get("spec")
    try:
        return ipaddress.ip_network(str(spec["subnet"]), strict=False).version if spec else None
    except (KeyError, ValueError):
        return None


def subnet_overflow(cs: ClusterSubnet) -> tuple[tuple[str, ...], str | None]:
    """The overflow subnets a ClusterSubnet names (`spec.overflow`, in order) and why the list
    is not followed, if it is not: a node follows none of a malformed list (not a list of at
    most MAX_OVERFLOW_SUBNETS ClusterSubnet names, none twice, not the subnet itself) rather
    than guess which entries were meant."""
    spec = cs.get("spec")
    names = spec.get("overflow") if spec is not None else None
    if names is None:
        return (), None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return (), f"spec.overflow: {names!r} is not a list of ClusterSubnet names"
    problem = subnet_names_problem(names, at_most=MAX_OVERFLOW_SUBNETS)
    if problem is None and cs["metadata"]["name"] in names:
        problem = "names the subnet itself"
    if problem is not None:
        return (), f"spec.overflow: {problem}"
    return tuple(names), None


def subnet_scalers(subnet: ClusterSubnet) -> tuple[WireScaler | None, WireScaler | None]:
    """A ClusterSubnet's `spec.scaler` (the operator's) and `status.scaler` (the controller's),
    in the order `merge_scalers` takes them; None where it sets none."""
    spec, status = subnet.get("spec"), subnet.get("status")
    return spec.get("scaler") if spec else None, status.get("scaler") if status else None


def subnet_state_exhausted(state: ClusterSubnetState) -> bool | None:
    """A ClusterSubnetState's `status.exhausted`; None while it has never been written."""
    exhausted = (state.get("status") or {}).get("exhausted")
    return None if exhausted is None else bool(exhausted)


def recorded_status(*, subnet: ClusterSubnet, state: ClusterSubnetState) -> SubnetStatus:
    """What the control plane wrote last into a ClusterSubnet's and its state's status."""
    status = subnet.get("status") or {}
    return SubnetStatus(
        exhausted=bool(subnet_state_exhausted(state)),
        reserved=int(status.get("reservedIPCount") or 0),
        batch=int((status.get("scaler") or {}).get("batchSize") or 0),
        batch_changes=int(status.get("batchChanges") or 0),
    )


def cluster_subnet_status(
    status: SubnetStatus,
    *,
    scaler: Scaler,
    capacity: int,
    node_count: int,
    duplicates: int,
    conflicts: int,
    drain_left: Mapping[str, int] | None = None,
) -> ClusterSubnetStatus:
    """A ClusterSubnet's `status`, whole: what `recorded_status` reads back, plus figures for
    operators (`kubectl get clustersubnet` prints batch, reserved and capacity). `drain_left`:
    a draining subnet's addresses still held by node (`status.drain`; null otherwise, which
    removes it). The nodes are a list, not a map: a merge patch replaces a list whole, where it
    would keep a map's keys that are left out (a node that is done would stay listed)."""
    utilization = round(100 * status.reserved / capacity, 2) if capacity else 100.0
    drain: Drain | None = None
    if drain_left is not None:
        drain = {
            "addressesHeld": sum(drain_left.values()),
            "nodes": [
                {"name": node, "addressesHeld": count} for node, count in sorted(drain_left.items())
            ],
        }
    return {
        "scaler": {**scaler_to_wire(scaler), "batchSize": status.batch},
        "reservedIPCount": status.reserved,
        "capacity": capacity,
        "nodeCount": node_count,
        "utilizationPercent": utilization,
        "exhausted": status.exhausted,
        "batchChanges": status.batch_changes,
        "duplicateIPCount": duplicates,
        "conflictIPCount": conflicts,
        "draining": drain_left is not None,
        "drain": drain,
    }


def subnet_state_object(name: str) -> ClusterSubnetState:
    """A new ClusterSubnetState, with no status yet."""
    return {
        "apiVersion": CLUSTER_SUBNET_STATE.api_version,
        "kind": "ClusterSubnetState",
        "metadata": {"name": name},
    }


def subnet_state_patch(*, exhausted: bool, at: dt.datetime) -> ClusterSubnetState:
    """The merge patch of a ClusterSubnetState's status when the exhaustion changes at `at`."""
    return {"status": {"exhausted": exhausted, "timestamp": at.strftime("%Y-%m-%dT%H:%M:%SZ")}}
