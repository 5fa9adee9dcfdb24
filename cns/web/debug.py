"""Read-only debug and metrics endpoint, on loopback by default, and the metrics-only listener.

Any local user can read the debug endpoint, any host that reaches the node the metrics listener
(`metrics.address`: it serves GET /metrics and nothing else, so no pod names or addresses leave
the node). Their replies are rendered on the event loop that serves the CNI socket (/debug/ips
and /metrics take a millisecond or more with a few hundred IPs). So their requests share one
budget (`shared_budget`): served one at a time and, together, given at most LOOP_SHARE of the
loop's time, so a reader that never stops is slowed down instead of the pods
(bench/performance/debug_reader.py, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cns.node.service import NodeIPAM
from cns.web import views
from cns.web.listeners import ListenerStatus
from cns.web.node_metrics import Metrics

NODE_KEY = web.AppKey("node", NodeIPAM)
METRICS_KEY = web.AppKey("metrics", Metrics)
SERVING_KEY = web.AppKey("serving", dict)
DEBUG_PORT_KEY = web.AppKey("debug_port", ListenerStatus)

LOOP_SHARE = 0.01
# A scrape or a `cns status` never waits: this much loop time can be spent at once.
BURST_SECONDS = 0.05
# No request waits longer than this, however much was spent before it.
MAX_WAIT_SECONDS = 1.0
# What one request costs beyond its handler (parsing, writing the reply), charged at least.
MIN_REQUEST_SECONDS = 0.0003


class LoopBudget:
    """A token bucket of event-loop seconds: refills at `share` per second, holds `burst`, and
    never owes more than `max_wait` seconds of refill (so a reader that stops is forgotten)."""

    def __init__(
        self, *, share: float, burst: float, max_wait: float, clock: Callable[[], float]
    ) -> None:
        self.share = share
        self.burst = burst
        self.max_wait = max_wait
        self._clock = clock
        self._credit = burst
        self._updated = clock()

    def wait_seconds(self) -> float:
        """How long until the bucket is no longer in debt (0: go ahead)."""
        now = self._clock()
        self._credit = min(self.burst, self._credit + (now - self._updated) * self.share)
        self._updated = now
        return max(0.0, -self._credit / self.share)

    def charge(self, seconds: float) -> None:
        self._credit = max(self._credit - seconds, -self.max_wait * self.share)


def budget_middleware(budget: LoopBudget) -> Middleware:
    """Serve debug requests one at a time, each once the budget allows, and charge it.

    The charge is the handler's CPU time on the loop's thread, not its wall time: on a busy
    machine a render can take far longer than it costs, and the readers should not pay for that.
    """
    lock = asyncio.Lock()

    @web.middleware
    async def within_budget(request: web.Request, handler: Handler) -> web.StreamResponse:
        async with lock:  # one at a time: the others wait at no cost to the loop
            delay = budget.wait_seconds()
            if delay:
                await asyncio.sleep(delay)
            started = time.thread_time()
            try:
                return await handler(request)
            finally:
                budget.charge(max(time.thread_time() - started, MIN_REQUEST_SECONDS))

    return within_budget


async def pool(request: web.Request) -> web.Response:
    return web.json_response(views.pool_view(request.app[NODE_KEY]))


async def ips(request: web.Request) -> web.Response:
    """Every IP, or those the query admits: `?state=`, `?pod=NAMESPACE/NAME`, `?container=`
    (a container ID or its first characters); 400 naming the parameter that cannot be used."""
    try:
        only = views.IPFilter.parse(request.query)
    except views.BadFilter as exc:
        return web.json_response({"error": str(exc)}, status=400)
    node = request.app[NODE_KEY]
    # What the control plane listed that no pod gets (an invalid address, say) beside them.
    ignored = views.ignored_view(node)
    return web.json_response(
        {"ips": views.node_ips_view(node, only), **({"ignored": ignored} if ignored else {})}
    )


async def pod(request: web.Request) -> web.Response:
    """One pod: its IPs, its ADDs waiting, and why it waits (`cns status --pod`)."""
    try:
        unknown = sorted(set(request.query) - {"pod"})
        if unknown:
            raise views.BadFilter(f"unknown parameter(s) {', '.join(unknown)}: use pod")
        name = views.parse_pod(request.query.get("pod", ""))
    except views.BadFilter as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(views.pod_view(request.app[NODE_KEY], name))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


def _debug_port_trouble(request: web.Request) -> dict[str, object]:
    """`debugListen` while the debug port is not served (whoever holds it, and what binding it
    said); nothing while it is."""
    status = request.app[DEBUG_PORT_KEY]
    return {} if status.serving else {"debugListen": status.view()}


async def healthz(request: web.Request) -> web.Response:
    """503 while state cannot be committed (the reason names the errno and the path); it turns
    200 again by itself once a commit or the storage probe succeeds. While the debug port
    cannot be bound, `debugListen` says why; that is no reason to restart cns (whoever holds the
    port would still hold it), so it does not turn this 503."""
    failure = request.app[NODE_KEY].store.failure
    if failure is not None:
        body = {"ok": False, "reason": str(failure), **_debug_port_trouble(request)}
        return web.json_response(body, status=503)
    return web.json_response({"ok": True, **_debug_port_trouble(request)})


async def readyz(request: web.Request) -> web.Response:
    """Ready once state is restored and the CNI socket answers, whatever the debug port does
    (`debugListen` while it cannot be bound); CNI STATUS is reported alongside."""
    trouble = _debug_port_trouble(request)
    if not request.app[SERVING_KEY].get("socket"):
        body = {"ready": False, "reason": "socket not serving yet", **trouble}
        return web.json_response(body, status=503)
    can_assign, reason = request.app[NODE_KEY].status()
    return web.json_response({"ready": True, "canAssign": can_assign, "reason": reason, **trouble})


def shared_budget() -> Middleware:
    """The one budget of the debug endpoint and the metrics listener together."""
    budget = LoopBudget(
        share=LOOP_SHARE, burst=BURST_SECONDS, max_wait=MAX_WAIT_SECONDS, clock=time.monotonic
    )
    return budget_middleware(budget)


def build_app(
    node: NodeIPAM,
    registry: Metrics,
    serving: dict[str, bool],
    debug_port: ListenerStatus,
    within_budget: Middleware,
) -> web.Application:
    app = web.Application(middlewares=[within_budget])
    app[NODE_KEY] = node
    app[METRICS_KEY] = registry
    app[SERVING_KEY] = serving
    app[DEBUG_PORT_KEY] = debug_port
    app.router.add_get("/debug/pool", pool)
    app.router.add_get("/debug/ips", ips)
    app.router.add_get("/debug/pod", pod)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def build_metrics_app(registry: Metrics, within_budget: Middleware) -> web.Application:
    """GET /metrics only (no HEAD, no other path: 405 and 404), within the debug endpoint's
    budget. Request heads are bounded by aiohttp's limits (8 KiB a line), and no handler reads
    a body."""
    app = web.Application(middlewares=[within_budget])
    app[METRICS_KEY] = registry
    app.router.add_route("GET", "/metrics", metrics)
    return app
