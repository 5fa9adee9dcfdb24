"""What the node shows of its pool: /debug/pool, /debug/ips, the pool gauges of /metrics and the
SIGUSR1/SIGUSR2 summary line.

All of them render one reading of the service, `PoolFigures`, each in its own shape: a figure
such as the target or the demand is computed here once and means the same in every view. Pure
reads of the service: nothing here changes it.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cns.core.leaks import LeakLedger, Suspect
from cns.core.pool import IPRecord, Pool
from cns.core.scaling import effective_batch, target_request
from cns.core.types import IPState, Scaler
from cns.core.worldcheck import Finding, WorldLedger
from cns.node.explain import utc_text
from cns.node.service import NodeIPAM


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """The pool's numbers at one instant."""

    scaler: Scaler  # in effect: the control plane's, else the configured one
    batch_size: int  # in effect: 1 while the subnet is exhausted
    requested_ip_count: int  # last sent to the control plane (0 before the first)
    target_ip_count: int  # the idempotent target for the current demand
    primary_ip_count: int
    demand: int  # U: assigned plus waiting, or the pods scheduled here if more
    waiting_adds: int
    pod_demand: int
    exhausted: bool
    draining: bool  # the subnet grants nothing more: the target is what pods hold
    ips: dict[IPState, int]  # secondary IPs per state

    def ips_by_state(self) -> dict[str, int]:
        return {state.value: self.ips[state] for state in IPState}


def pool_figures(node: NodeIPAM, key: str = "") -> PoolFigures:
    """The figures of lane `key` ("": the primary subnet's)."""
    lane = node.lanes[key]
    pool = lane.pool
    scaler = node.lane_scaler(lane)
    demand = node.demand(key)
    primary_ip_count = pool.primary_ip_count
    return PoolFigures(
        scaler=scaler,
        batch_size=effective_batch(scaler, lane.exhausted),
        requested_ip_count=lane.sent.requested_ip_count if lane.sent else 0,
        # As the plan computes it: IPs in cooldown count as used (Pool.plan).
        target_ip_count=pool.held_for_pods()
        if node.publisher.keeps_only_held(key)
        else target_request(
            scaler, demand + pool.cooling_count(), primary_ip_count, lane.exhausted
        ),
        primary_ip_count=primary_ip_count,
        demand=demand,
        waiting_adds=node.waiting_count(key),
        pod_demand=lane.pod_demand,
        exhausted=lane.exhausted,
        draining=lane.draining,
        ips=pool.counts(),
    )


def lane_names(node: NodeIPAM) -> dict[str, str]:
    """Each lane's key and the name its subnet is shown by (the primary's may be unknown)."""
    return {key: lane.name or key for key, lane in node.lanes.items()}


def pool_view(node: NodeIPAM) -> dict[str, Any]:
    """GET /debug/pool (README, "Observing it"): the primary subnet's figures at the top level,
    as before lanes; on a node with further subnets, the primary's name (`subnet`) and each
    further subnet's figures under `subnets`, by name."""
    view: dict[str, Any] = {}
    for field, value in _lane_view(node, "").items():
        view[field] = value
        if field == "minIPCount":
            view["ipCooldownSeconds"] = node.cooldown_seconds
        elif field == "ips":
            view["leakCheck"] = leak_check_view(node.leaks)
            view["worldCheck"] = world_check_view(node.world, gate_open=node.world_gate_open)
    view["ignoredNetworkContainers"] = ignored_view(node)
    if node.lanes.overflow:
        view["overflow"] = overflow_view(node)
    further = {name: _lane_view(node, key) for key, name in lane_names(node).items() if key}
    if further:
        view["subnet"] = node.primary.name
        view["subnets"] = further
    return view


def overflow_view(node: NodeIPAM) -> dict[str, Any]:
    """The primary subnet's overflow subnets, in order, with their room; whether it sends its
    pods on now (`open`: exhausted or draining) and to which (`target`); ADDs sent so far."""
    lanes = node.lanes
    return {
        "open": lanes.overflow_open(),
        "target": lanes.overflow_target(),
        "podsSentTotal": node.overflows_total,
        "subnets": [
            {
                "name": c.name,
                "hasRoom": c.has_room,
                "exhausted": c.exhausted,
                "draining": c.draining,
                "sameFamily": c.usable,
                "overflowedPods": lanes.overflowed(c.name),
            }
            for c in lanes.overflow_candidates()
        ],
    }


def _lane_view(node: NodeIPAM, key: str) -> dict[str, Any]:
    figures = pool_figures(node, key)
    scaler = figures.scaler
    pool = node.lanes[key].pool
    return {
        "batchSize": figures.batch_size,
        "scalerBatchSize": scaler.batch_size,
        "requestThresholdPercent": scaler.request_threshold_percent,
        "releaseThresholdPercent": scaler.release_threshold_percent,
        "maxIPCount": scaler.max_ip_count,
        "minIPCount": scaler.min_ip_count,
        "requestedIPCount": figures.requested_ip_count,
        "targetIPCount": figures.target_ip_count,
        "ipsNotInUse": list(pool.ips_not_in_use()),
        "primaryIPCount": figures.primary_ip_count,
        "demand": figures.demand,
        "waitingAdds": figures.waiting_adds,
        "podDemand": figures.pod_demand,
        "subnetExhausted": figures.exhausted,
        "subnetDraining": figures.draining,
        # No longer listed: its pods keep their IPs until their DEL, no ADD gets one.
        **({"removed": True} if node.lanes[key].removed else {}),
        "ips": figures.ips_by_state(),
        "networkContainers": [
            {
                "id": nc.id,
                "subnet": nc.subnet,
                "gateway": nc.gateway,
                "primaryIPs": list(nc.primary_ips),
                "version": nc.version,
            }
            for nc in pool.containers.values()
        ],
    }


def summary(node: NodeIPAM) -> dict[str, Any]:
    """The pool in a few numbers, for one log line (SIGUSR1/SIGUSR2)."""
    figures = pool_figures(node)
    return {
        **figures.ips_by_state(),
        "requestedIPCount": figures.requested_ip_count,
        "targetIPCount": figures.target_ip_count,
        "demand": figures.demand,
        "waitingAdds": figures.waiting_adds,
        "subnetExhausted": figures.exhausted,
    }


@functools.lru_cache(maxsize=1 << 14)
def _address_order(address: str) -> tuple[int, int]:
    """Sort key of an address; cached, as parsing is most of the cost of rendering /debug/ips."""
    parsed = ipaddress.ip_address(address)
    return parsed.version, int(parsed)


class BadFilter(ValueError):
    """A query parameter of a debug view that cannot be used; says which and why."""


@dataclass(frozen=True, slots=True)
class IPFilter:
    """Which IPs /debug/ips lists: all of these that are given."""

    state: IPState | None = None
    pod: str = ""  # namespace/name
    container: str = ""  # a container ID or its first characters

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> IPFilter:
        """From the query parameters; BadFilter naming the parameter at fault."""
        unknown = sorted(set(query) - {"state", "pod", "container"})
        if unknown:
            raise BadFilter(f"unknown parameter(s) {', '.join(unknown)}: use state, pod, container")
        state = None
        if "state" in query:
            try:
                state = IPState(query["state"])
            except ValueError:
                choices = ", ".join(s.value for s in IPState)
                raise BadFilter(f"state: {query['state']!r} is not one of {choices}") from None
        pod = query.get("pod", "")
        if "pod" in query:
            pod = parse_pod(pod)
        container = query.get("container", "")
        if "container" in query and not container:
            raise BadFilter("container: empty (give a container ID or its first characters)")
        return cls(state, pod, container)

    def admits(self, record: IPRecord) -> bool:
        owner = record.owner
        if self.state is not None and record.state is not self.state:
            return False
        if self.pod and (owner is None or owner.pod != self.pod):
            return False
        return not self.container or (
            owner is not None and owner.container_id.startswith(self.container)
        )


def parse_pod(text: str) -> str:
    """`namespace/name` as given; BadFilter unless it is exactly that."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise BadFilter(f"pod: {text!r} is not NAMESPACE/NAME")
    return text


def _leak_fields(ip_id: str, leaks: LeakLedger, suspects: Mapping[str, Suspect]) -> dict[str, Any]:
    """`leakSuspect` while the leak check suspects the IP, `reclaimed` once it took it back."""
    fields: dict[str, Any] = {}
    if (suspect := suspects.get(ip_id)) is not None:
        since = utc_text(suspect.since_wall)
        fields["leakSuspect"] = {"reason": suspect.reason.value, "since": since}
    if (reclaimed := leaks.reclaimed.get(ip_id)) is not None:
        held = reclaimed.held
        fields["reclaimed"] = {
            "reason": reclaimed.reason.value,
            "at": utc_text(reclaimed.at_wall),
            "suspectedSeconds": round(reclaimed.suspected_seconds, 1),
            "containerID": held.key.container_id,
            "ifName": held.key.ifname,
            "pod": held.pod or None,
        }
    return fields


def leak_check_view(leaks: LeakLedger) -> dict[str, Any]:
    """The leak check in a few figures (in /debug/pool)."""
    return {
        "enabled": leaks.enabled,
        "checks": leaks.checks,
        "runtimeError": leaks.runtime_error,
        "suspects": len(leaks.suspects),
        "reclaimed": dict(sorted(leaks.reclaimed_total.items())),
    }


def ignored_view(node: NodeIPAM) -> list[dict[str, Any]]:
    """What the control plane lists that the node leaves unused (docs/azure-compat.md):
    containers, and IP assignments (`assignment`), each with why when it is invalid
    (`reason`)."""
    return [
        {
            "id": c.id,
            "field": c.field,
            "value": c.value,
            **({"reason": c.reason} if c.reason else {}),
            **({"assignment": c.assignment} if c.assignment else {}),
        }
        for c in node.ignored_containers
    ]


def _finding_view(finding: Finding) -> dict[str, Any]:
    holder = finding.entry.holder if finding.entry is not None else None
    return {
        "address": finding.address,
        "outcome": finding.outcome.value,
        "sources": list(dict.fromkeys(s.source.value for s in finding.sightings)),
        "pod": finding.owner.pod or None,
        "containerID": finding.owner.container_id,
        "heldBy": None if holder is None else {"containerID": holder.container_id,
                                               "ifName": holder.ifname,
                                               "pod": holder.pod or None},
        "why": finding.why,
    }  # fmt: skip


def world_check_view(world: WorldLedger, *, gate_open: bool) -> dict[str, Any]:
    """The start-up check of the state file against the world (in /debug/pool): its state,
    each source's, the outcomes counted, and every address that was not fine."""
    return {
        "state": world.state,
        "addsWaiting": not gate_open,
        "sources": dict(world.sources),
        "seconds": world.seconds,
        "outcomes": dict(sorted(world.outcomes.items())),
        "findings": [_finding_view(f) for f in world.findings],
        "remembered": sorted(world.remembered),
    }


def node_ips_view(node: NodeIPAM, only: IPFilter = IPFilter()) -> list[dict[str, Any]]:
    """GET /debug/ips: every lane's IPs, the primary subnet's first."""
    return [row for lane in node.lanes.values() for row in ips_view(lane.pool, only, node.leaks)]


def ips_view(
    pool: Pool, only: IPFilter = IPFilter(), leaks: LeakLedger | None = None
) -> list[dict[str, Any]]:
    """GET /debug/ips: every IP (that `only` admits) in address order, with state and owner, and
    what the leak check thinks of it."""
    leaks = leaks if leaks is not None else LeakLedger()
    suspects = {s.held.ip_id: s for s in leaks.suspects.values()}
    rows = []
    records = (r for r in pool.records.values() if only.admits(r))
    for record in sorted(records, key=lambda r: _address_order(r.address)):
        owner = record.owner
        rows.append(
            {
                "id": record.id,
                "address": record.address,
                "nc": record.nc_id,
                "state": record.state.value,
                **({"subnet": pool.subnet} if pool.subnet else {}),
                **(
                    {"cooldownEndsAt": utc_text(end)}
                    if (end := pool.cooldown_end(record.id))
                    else {}
                ),
                **_leak_fields(record.id, leaks, suspects),
                "owner": None
                if owner is None
                else {
                    "containerID": owner.container_id,
                    "ifName": owner.ifname,
                    "podName": owner.pod_name,
                    "podNamespace": owner.pod_namespace,
                },
            }
        )
    return rows


def pod_view(node: NodeIPAM, pod: str) -> dict[str, Any]:
    """GET /debug/pod?pod=NAMESPACE/NAME: one pod's IPs and its ADDs waiting for one, and, when
    it waits (or would, if its ADD came now), why, with the figures behind it."""
    ips = node_ips_view(node, IPFilter(pod=pod))
    now = time.time()
    waiting = [
        {
            "containerID": owner.container_id,
            "ifName": owner.ifname,
            "since": utc_text(since),
            "waitedSeconds": round(max(0.0, now - since), 3),
        }
        for owner, since in node.waiters_of(pod)
    ]
    if waiting:
        state = "waiting"
    elif ips:
        state = "assigned"
    else:
        state = "unknown"
    view: dict[str, Any] = {"pod": pod, "state": state, "ips": ips, "waiting": waiting}
    if waiting or (state == "unknown" and not node.pool.available_count()):
        reason = node.pod_wait_reason(pod)
        view["reason"] = {"code": reason.code, "message": reason.message, **reason.figures}
    return view
