"""The controller's metrics and health endpoint (`cns controller --metrics-listen HOST:PORT`).

Values are read from the controller at scrape time, so nothing on the round's path has to know
about Prometheus.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cns.controller.run import Controller

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
