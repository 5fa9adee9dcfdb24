"""Prometheus metrics: request latencies and waits are observed; pool gauges are read at scrape."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cns.core.leaks import LeakReason
from cns.core.types import IPState
from cns.core.worldcheck import Outcome
from cns.node.service import NodeIPAM
from cns.web.listeners import ConnectionCap, ListenerStatus
from cns.web.views import PoolFigures, lane_names, pool_figures

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    """The daemon's registry; one per daemon so tests can run several in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "cns_cni_request_duration_seconds",
            "Time to answer a CNI request on the socket, by verb and result.",
            ["verb", "result"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.add_wait_seconds = Histogram(
            "cns_add_ip_wait_seconds",
            "Time an ADD waited for the pool to grow because no IP was free.",
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "cns_state_commit_duration_seconds",
            "Time to commit one durable state transaction, fsync included; every ADD and DEL "
            "reply waits for one (a slow disk shows here first).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.release_queue_applied = Counter(
            "cns_release_queue_applied",
            "DELs applied from the on-disk release queue.",
            registry=self.registry,
        )
        self.announcements_failed = Counter(
            "cns_flat_network_announcements_failed",
            "Gratuitous ARPs or neighbour advertisements of a pod address the flat-network mode "
            "could not send (the ADD succeeded: the proxy entry answers).",
            registry=self.registry,
        )

    def observe_request(self, verb: str, result: str, seconds: float) -> None:
        self.request_seconds.labels(verb, result).observe(seconds)

    def watch(self, node: NodeIPAM) -> None:
        self.registry.register(PoolCollector(node))

    def watch_connections(self, caps: Callable[[], Iterable[ConnectionCap]]) -> None:
        self.registry.register(ConnectionCollector(caps))

    def watch_listener(self, status: ListenerStatus) -> None:
        self.registry.register(ListenerCollector(status))

    def watch_readiness(self, ready: Callable[[], bool]) -> None:
        self.registry.register(ReadinessCollector(ready))


class ReadinessCollector(Collector):
    """What /readyz answers, for Prometheus: the alert on a daemon that is not ready."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "cns_ready",
            "1 once state is restored and the CNI socket answers (/readyz), 0 until then.",
            value=int(self.ready()),
        )


class ListenerCollector(Collector):
    """Whether a listener that may fail without stopping the daemon (the debug port, the
    metrics listener) serves."""

    def __init__(self, status: ListenerStatus) -> None:
        self.listener = status.listener
        self.status = status

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "cns_listener_up",
            "1 while the listener serves, 0 while its address cannot be bound (another process "
            "holds the port: see the daemon's log and /healthz).",
            labels=["listener", "address"],
        )
        up.add_metric([self.listener, self.status.address], int(self.status.serving))
        failures = CounterMetricFamily(
            "cns_listen_failures",
            "Failed attempts to bind the listener's address.",
            labels=["listener", "address"],
        )
        failures.add_metric([self.listener, self.status.address], self.status.failures)
        yield from (up, failures)


class ConnectionCollector(Collector):
    """Each listener's open connections and how often it was full, read at scrape."""

    def __init__(self, caps: Callable[[], Iterable[ConnectionCap]]) -> None:
        self.caps = caps

    def collect(self) -> Iterator[Metric]:
        labels = ["listener"]
        open_now = GaugeMetricFamily("cns_open_connections", "Open connections.", labels=labels)
        limit = GaugeMetricFamily("cns_max_connections", "The listener's cap.", labels=labels)
        reached = CounterMetricFamily(
            "cns_connection_cap_reached",
            "Times the listener stopped accepting because it had the most connections allowed.",
            labels=labels,
        )
        for cap in self.caps():
            open_now.add_metric([cap.listener], cap.open)
            limit.add_metric([cap.listener], cap.limit)
            reached.add_metric([cap.listener], cap.reached)
        yield from (open_now, limit, reached)


class PoolCollector(Collector):
    """Pool gauges computed from the live pool at scrape time, so they are never stale."""

    def __init__(self, node: NodeIPAM) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        figures = pool_figures(node)
        ips = GaugeMetricFamily(
            "cns_pool_ips", "Secondary IPs in the pool by state.", labels=["state"]
        )
        for state in IPState:
            ips.add_metric([state.value], figures.ips[state])
        yield ips
        for name, (doc, value) in _gauges(figures).items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield from _lane_gauges(node)
        ignored = GaugeMetricFamily(
            "cns_network_containers_ignored",
            "Network containers the control plane lists that the node leaves unused, by the "
            "field and value it cannot honour or that is invalid (cns status names them).",
            labels=["field", "value"],
        )
        assignments = GaugeMetricFamily(
            "cns_ip_assignments_ignored",
            "IP assignments of usable network containers that the node leaves unused, by the "
            "field at fault and why (cns status names them).",
            labels=["field", "reason"],
        )
        by_value = collections.Counter(
            (c.field, c.value) for c in node.ignored_containers if c.whole_container
        )
        for labels, count in sorted(by_value.items()):
            ignored.add_metric(list(labels), count)
        by_reason = collections.Counter(
            (c.field, c.reason) for c in node.ignored_containers if not c.whole_container
        )
        for labels, count in sorted(by_reason.items()):
            assignments.add_metric(list(labels), count)
        yield ignored
        yield assignments
        yield CounterMetricFamily(
            "cns_pool_inconsistencies",
            "Control-plane updates that conflicted with assigned IPs.",
            value=node.inconsistencies_total,
        )
        yield CounterMetricFamily(
            "cns_overflow_adds",
            "ADDs of the primary subnet that took an overflow subnet's address (the primary "
            "exhausted or draining, none of its addresses free).",
            value=node.overflows_total,
        )
        yield GaugeMetricFamily(
            "cns_overflow_open",
            "1 while the primary subnet sends its pods to an overflow subnet when it has no "
            "free address (exhausted or draining, and it names overflow subnets).",
            value=int(bool(node.lanes.overflow) and node.lanes.overflow_open()),
        )
        yield CounterMetricFamily(
            "cns_pool_requests_published",
            "Pool requests sent to the control plane.",
            value=node.publishes_total,
        )
        releases = CounterMetricFamily(
            "cns_ip_releases", "IPs released, by reason.", labels=["reason"]
        )
        for reason, count in sorted(node.releases.items()):
            releases.add_metric([reason], count)
        yield releases
        leaks = node.leaks
        reclaimed = CounterMetricFamily(
            "cns_ip_leaks_reclaimed",
            "IPs taken back because their DEL never came, by reason.",
            labels=["reason"],
        )
        for reason in LeakReason:
            reclaimed.add_metric([reason.value], leaks.reclaimed_total[reason.value])
        yield reclaimed
        yield GaugeMetricFamily(
            "cns_ip_leak_suspects",
            "Assigned IPs whose sandbox the runtime does not list (reclaimed after the grace).",
            value=len(leaks.suspects),
        )
        if leaks.enabled:
            yield GaugeMetricFamily(
                "cns_leak_check_runtime_ok",
                "1 when the last leak check got the runtime's sandboxes, 0 when it could not.",
                value=int(leaks.checks > 0 and leaks.runtime_error is None),
            )
        world = node.world
        outcomes = CounterMetricFamily(
            "cns_state_world_check_addresses",
            "Addresses the runtime or the API says live pods hold, checked against the state "
            "file after the start, by outcome: fine, adopted (free in the state file), conflict "
            "(another owner: refused, a human must look), unknown (not in the pool: remembered).",
            labels=["outcome"],
        )
        for outcome in Outcome:
            outcomes.add_metric([outcome.value], world.outcomes[outcome.value])
        yield outcomes
        yield GaugeMetricFamily(
            "cns_state_world_check_pending",
            "1 while ADDs wait for the start-up check of the state file against the world.",
            value=int(not node.world_gate_open),
        )
        yield GaugeMetricFamily(
            "cns_state_world_addresses_remembered",
            "Addresses a live pod holds that no network container of the node has (yet).",
            value=len(world.remembered),
        )
        store = node.store
        yield CounterMetricFamily(
            "cns_state_commits", "Durable state transactions committed.", value=store.commits
        )
        failures = CounterMetricFamily(
            "cns_state_commit_failures",
            "State commits that failed, by cause: the errno (ENOSPC, EROFS, EACCES, EIO) or the "
            "SQLite error of a failed transaction, or rejected for one request's record the "
            "database refused.",
            labels=["cause"],
        )
        for cause, count in sorted(store.failures.items()):
            failures.add_metric([cause], count)
        yield failures
        yield GaugeMetricFamily(
            "cns_state_storage_ok",
            "1 while state commits succeed, 0 while the state file cannot be written "
            "(/healthz says why).",
            value=int(store.failure is None),
        )


def _gauges(figures: PoolFigures) -> dict[str, tuple[str, float]]:
    """The pool's gauges of one lane: name -> (help, value)."""
    return {
        "cns_requested_ip_count": (
            "Secondary IPs requested from the control plane.",
            figures.requested_ip_count,
        ),
        "cns_target_ip_count": (
            "The idempotent target for the current demand.",
            figures.target_ip_count,
        ),
        "cns_primary_ip_count": (
            "Primary IPs of the node's network containers.",
            figures.primary_ip_count,
        ),
        "cns_demand": ("Assigned IPs plus ADDs waiting for one (U).", figures.demand),
        "cns_waiting_adds": ("ADDs waiting for a free IP.", figures.waiting_adds),
        "cns_batch_size": (
            "Batch in effect (1 while the subnet is exhausted).",
            figures.batch_size,
        ),
        "cns_max_ip_count": ("The scaler's maxIPCount.", figures.scaler.max_ip_count),
        "cns_subnet_exhausted": ("1 while the subnet is exhausted.", int(figures.exhausted)),
        "cns_subnet_draining": (
            "1 while the subnet is draining (spec.draining): no ADD gets a new IP of it.",
            int(figures.draining),
        ),
    }


def _lane_gauges(node: NodeIPAM) -> Iterator[Metric]:
    """Every lane's pool gauges (the primary subnet's too) as `cns_lane_*{subnet}`; the
    unlabelled ones stay the primary subnet's, as before lanes."""
    ips = GaugeMetricFamily(
        "cns_lane_pool_ips", "Secondary IPs of each subnet by state.", labels=["subnet", "state"]
    )
    removed = GaugeMetricFamily(
        "cns_lane_removed",
        "1 while the subnet is no longer listed and its pods still hold IPs of it.",
        labels=["subnet"],
    )
    families: dict[str, GaugeMetricFamily] = {}
    for key, name in lane_names(node).items():
        removed.add_metric([name], int(node.lanes[key].removed))
        figures = pool_figures(node, key)
        for state in IPState:
            ips.add_metric([name, state.value], figures.ips[state])
        for gauge, (doc, value) in _gauges(figures).items():
            lane_gauge = gauge.replace("cns_", "cns_lane_", 1)
            family = families.get(lane_gauge) or GaugeMetricFamily(
                lane_gauge, f"{doc} By subnet.", labels=["subnet"]
            )
            families[lane_gauge] = family
            family.add_metric([name], value)
    yield ips
    yield removed
    yield from families.values()
