"""Read-only debug and metrics endpoint, on loopback by default."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cns.metrics import Metrics
from cns.node import NodeIPAM

NODE_KEY = web.AppKey("node", NodeIPAM)
METRICS_KEY = web.AppKey("metrics", Metrics)
SERVING_KEY = web.AppKey("serving", dict)


async def pool(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE_KEY].pool_view())


async def ips(request: web.Request) -> web.Response:
    return web.json_response({"ips": request.app[NODE_KEY].ips_view()})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


async def healthz(request: web.Request) -> web.Response:
    """503 while state cannot be committed (the reason names the errno and the path); it turns
    200 again by itself once a commit or the storage probe succeeds."""
    failure = request.app[NODE_KEY].store.failure
    if failure is not None:
        return web.json_response({"ok": False, "reason": str(failure)}, status=503)
    return web.json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    """Ready once state is restored and the socket answers; CNI STATUS is reported alongside."""
    if not request.app[SERVING_KEY].get("socket"):
        return web.json_response({"ready": False, "reason": "socket not serving yet"}, status=503)
    can_assign, reason = request.app[NODE_KEY].status()
    return web.json_response({"ready": True, "canAssign": can_assign, "reason": reason})


def build_app(node: NodeIPAM, registry: Metrics, serving: dict[str, bool]) -> web.Application:
    app = web.Application()
    app[NODE_KEY] = node
    app[METRICS_KEY] = registry
    app[SERVING_KEY] = serving
    app.router.add_get("/debug/pool", pool)
    app.router.add_get("/debug/ips", ips)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
