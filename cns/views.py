"""What the node shows of its pool: /debug/pool, /debug/ips, the pool gauges of /metrics and the
SIGUSR1/SIGUSR2 summary line.

All of them render one reading of the service, `PoolFigures`, each in its own shape: a figure
such as the target or the demand is computed here once and means the same in every view. Pure
reads of the service: nothing here changes it.
"""

from __future__ import annotations

import datetime as dt
import functools
import ipaddress
from dataclasses import dataclass
from typing import Any

from cns.core.pool import Pool
from cns.core.scaling import effective_batch, target_request
from cns.core.types import IPState, Scaler
from cns.node import NodeIPAM


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
    ips: dict[IPState, int]  # secondary IPs per state

    def ips_by_state(self) -> dict[str, int]:
        return {state.value: self.ips[state] for state in IPState}


def pool_figures(node: NodeIPAM) -> PoolFigures:
    scaler = node.scaler
    demand = node.demand()
    primary_ip_count = node.pool.primary_ip_count
    return PoolFigures(
        scaler=scaler,
        batch_size=effective_batch(scaler, node.exhausted),
        requested_ip_count=node.sent.requested_ip_count if node.sent else 0,
        # As the plan computes it: IPs in cooldown count as used (Pool.plan).
        target_ip_count=target_request(
            scaler, demand + node.pool.cooling_count(), primary_ip_count, node.exhausted
        ),
        primary_ip_count=primary_ip_count,
        demand=demand,
        waiting_adds=node.waiting_count(),
        pod_demand=node.pod_demand,
        exhausted=node.exhausted,
        ips=node.pool.counts(),
    )


def pool_view(node: NodeIPAM) -> dict[str, Any]:
    """GET /debug/pool (README, "Observing it")."""
    figures = pool_figures(node)
    scaler = figures.scaler
    return {
        "batchSize": figures.batch_size,
        "scalerBatchSize": scaler.batch_size,
        "requestThresholdPercent": scaler.request_threshold_percent,
        "releaseThresholdPercent": scaler.release_threshold_percent,
        "maxIPCount": scaler.max_ip_count,
        "minIPCount": scaler.min_ip_count,
        "ipCooldownSeconds": node.cooldown_seconds,
        "requestedIPCount": figures.requested_ip_count,
        "targetIPCount": figures.target_ip_count,
        "ipsNotInUse": list(node.pool.ips_not_in_use()),
        "primaryIPCount": figures.primary_ip_count,
        "demand": figures.demand,
        "waitingAdds": figures.waiting_adds,
        "podDemand": figures.pod_demand,
        "subnetExhausted": figures.exhausted,
        "ips": figures.ips_by_state(),
        "networkContainers": [
            {
                "id": nc.id,
                "subnet": nc.subnet,
                "gateway": nc.gateway,
                "primaryIPs": list(nc.primary_ips),
                "version": nc.version,
            }
            for nc in node.pool.containers.values()
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


def _cooldown_field(end: float | None) -> dict[str, str]:
    if end is None:
        return {}
    at = dt.datetime.fromtimestamp(end, dt.UTC)
    return {"cooldownEndsAt": at.isoformat(timespec="milliseconds").replace("+00:00", "Z")}


def ips_view(pool: Pool) -> list[dict[str, Any]]:
    """GET /debug/ips: every IP in address order, with its state and owner."""
    rows = []
    for record in sorted(pool.records.values(), key=lambda r: _address_order(r.address)):
        owner = record.owner
        rows.append(
            {
                "id": record.id,
                "address": record.address,
                "nc": record.nc_id,
                "state": record.state.value,
                **_cooldown_field(pool.cooldown_end(record.id)),
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
