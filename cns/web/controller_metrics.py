"""The controller's metrics and health endpoint (`cns controller --metrics-listen HOST:PORT`).

Values are read from the controller at scrape time, so nothing on the round's path has to know
about Prometheus. Each served ClusterSubnet has one series per `cns_clustersubnet_*` metric,
labelled `subnet`; its gauges come from the leader only (a standby's planning state may lag, and
two replicas' copies would be summed twice), its counters from every replica (rounds and writes
are a replica's own).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cns.controller.run import Controller
from cns.controller.served import ServedSubnet

CONTROLLER_KEY = web.AppKey("controller", Controller)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)


class ControllerCollector(Collector):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        counters = self.controller.counters
        gauges = {
            "cns_controller_leader": (
                "1 while this replica holds the lease and may write.",
                int(self.controller.elector.can_write()),
            ),
            "cns_controller_duplicate_addresses": (
                "Addresses in two nodes' network containers, last round (should be 0).",
                counters.duplicates,
            ),
            "cns_controller_address_conflicts": (
                "Addresses a node lists against the allocation record, last round (should be 0).",
                counters.conflicts,
            ),
            "cns_controller_node_address_conflicts": (
                "Nodes' own addresses (InternalIP, ExternalIP) a pod holds, last round "
                "(should be 0).",
                counters.node_address_conflicts,
            ),
            "cns_controller_reserved_addresses_held": (
                "Reserved addresses (a ClusterSubnet's reservedIPs) a pod holds, granted before "
                "the reservation, last round: each is freed when its pod ends.",
                counters.reserved_addresses_held,
            ),
            "cns_controller_last_round_seconds": (
                "Duration of the last round.",
                counters.round_seconds,
            ),
        }
        yield from _families(GaugeMetricFamily, gauges)
        totals = {
            "cns_controller_rounds": ("Rounds run while leading.", counters.rounds),
            "cns_controller_round_seconds": (
                "Time spent in rounds.",
                counters.round_seconds_total,
            ),
            "cns_controller_duplicate_addresses_found": (
                "Addresses found in two nodes' network containers (each counted once).",
                counters.duplicates_found,
            ),
            "cns_controller_fenced_rounds": (
                "Rounds stopped because the lease could no longer be proven.",
                counters.fenced,
            ),
            "cns_controller_planning_rechecks": (
                "Planning states built from scratch (term start, spec change, periodic check).",
                counters.rechecks,
            ),
            "cns_controller_planning_state_differences": (
                "Periodic checks that found the incremental planning state wrong (should be 0).",
                counters.state_differences,
            ),
        }
        yield from _families(CounterMetricFamily, totals)
        refused = CounterMetricFamily(
            "cns_controller_write_conflicts",
            "Conditional writes refused because the object changed since it was read.",
            labels=["kind"],
        )
        for kind, count in sorted(counters.write_conflicts.items()):
            refused.add_metric([kind], count)
        yield refused
        yield from _subnet_counters(self.controller)
        if self.controller.elector.can_write():
            yield from _subnet_gauges(self.controller.served.values())


SUBNET_GAUGES = {
    "cns_clustersubnet_capacity": "Addresses of the subnet that can be granted to nodes.",
    "cns_clustersubnet_reserved": (
        "Addresses the allocation record holds for nodes, those being released excluded "
        "(status.reservedIPCount: utilization is reserved / capacity)."
    ),
    "cns_clustersubnet_granted": (
        "Addresses the allocation record (IPBlocks) holds for nodes, those being released included."
    ),
    "cns_clustersubnet_assigned": (
        "Secondary addresses in the nodes' network containers of the subnet, summed over the "
        "nodes (each NNC's assignedIPCount)."
    ),
    "cns_clustersubnet_requested": (
        "Secondary addresses the nodes ask for (requestedIPCount), summed over the nodes."
    ),
    "cns_clustersubnet_free": "Addresses neither recorded nor listed by a node: grantable now.",
    "cns_clustersubnet_nodes": "Nodes taking addresses from the subnet.",
    "cns_clustersubnet_duplicate_addresses": (
        "Addresses in two nodes' network containers, last round (should be 0)."
    ),
    "cns_clustersubnet_address_conflicts": (
        "Addresses a node lists against the allocation record, last round (should be 0)."
    ),
    "cns_clustersubnet_exhausted": "1 while the subnet is exhausted (batch 1), last round.",
    "cns_clustersubnet_batch_size": "The batch the nodes scale by, last round.",
}
SUBNET_COUNTERS = {
    "cns_clustersubnet_rounds": "Rounds run for the subnet while leading.",
    "cns_clustersubnet_writes": "Writes for the subnet the API server took.",
    "cns_clustersubnet_write_refusals": (
        "Conditional writes for the subnet the API server refused (the object changed since "
        "it was read: read again, planned again)."
    ),
}


def _subnet_gauges(served: Iterable[ServedSubnet]) -> Iterator[Metric]:
    families = {
        name: GaugeMetricFamily(name, doc, labels=["subnet"]) for name, doc in SUBNET_GAUGES.items()
    }
    for subnet in sorted(served, key=lambda s: s.name):
        if subnet.state is None or subnet.status is None:
            continue  # no round yet: nothing this replica could vouch for
        model = subnet.state.model
        capacity = model.subnet.capacity
        views = model.nodes.values()
        figures = {
            "cns_clustersubnet_capacity": capacity,
            "cns_clustersubnet_reserved": model.reserved,
            "cns_clustersubnet_granted": len(model.entries),
            "cns_clustersubnet_assigned": sum(len(v.nc.ip_configs) for v in views if v.nc),
            "cns_clustersubnet_requested": sum(v.request.requested_ip_count for v in views),
            "cns_clustersubnet_free": capacity - model.free.taken,
            "cns_clustersubnet_nodes": len(model.nodes),
            "cns_clustersubnet_duplicate_addresses": len(subnet.reported[0]),
            "cns_clustersubnet_address_conflicts": len(subnet.reported[1]),
            "cns_clustersubnet_exhausted": int(subnet.status.exhausted),
            "cns_clustersubnet_batch_size": subnet.status.batch,
        }
        for name, value in figures.items():
            families[name].add_metric([subnet.name], value)
    yield from families.values()


def _subnet_counters(controller: Controller) -> Iterator[Metric]:
    families = {
        name: CounterMetricFamily(name, doc, labels=["subnet"])
        for name, doc in SUBNET_COUNTERS.items()
    }
    for name, counts in sorted(controller.counters.subnets.items()):
        families["cns_clustersubnet_rounds"].add_metric([name], counts.rounds)
        families["cns_clustersubnet_writes"].add_metric([name], counts.writes)
        families["cns_clustersubnet_write_refusals"].add_metric([name], counts.refusals)
    yield from families.values()


def _families(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily],
    table: dict[str, tuple[str, float]],
) -> Iterator[Metric]:
    for name, (doc, value) in table.items():
        yield family(name, doc, value=value)


async def metrics(request: web.Request) -> web.Response:
    response = web.Response(body=generate_latest(request.app[REGISTRY_KEY]))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


async def healthz(request: web.Request) -> web.Response:
    controller = request.app[CONTROLLER_KEY]
    role = "leader" if controller.elector.can_write() else "standby"
    return web.json_response({"ok": True, "role": role, "identity": controller.identity})


def build_app(controller: Controller) -> web.Application:
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller))
    app = web.Application()
    app[CONTROLLER_KEY] = controller
    app[REGISTRY_KEY] = registry
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
