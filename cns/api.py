"""The CNI-facing socket API (v1): JSON over HTTP on a unix socket. See docs/api.md."""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from cns.attachments import Attachments
from cns.core.types import Owner, OwnerKey
from cns.node import AddResult, IPAMError, NodeIPAM

log = structlog.get_logger("cns.api")

NODE_KEY = web.AppKey("node", NodeIPAM)
ATTACH_KEY = web.AppKey("attachments", Attachments)
OBSERVE_KEY = web.AppKey("observe", object)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Observer = Callable[[str, str, float], None]


def _error(exc: IPAMError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        data = await request.json(loads=json.loads)
    except ValueError as exc:
        raise IPAMError(400, 6, "request body is not JSON", str(exc)) from exc
    if not isinstance(data, dict):
        raise IPAMError(400, 6, "request body must be a JSON object")
    return data


def _identifier(data: dict[str, Any], field: str) -> str:
    value = data.get(field)
    if not isinstance(value, str) or not value:
        raise IPAMError(400, 4, f"{field} is required and must be a non-empty string")
    return value


def _optional_string(data: dict[str, Any], field: str) -> str:
    value = data.get(field, "")
    if not isinstance(value, str):
        raise IPAMError(400, 7, f"{field} must be a string")
    return value


def _ips(data: dict[str, Any]) -> list[str]:
    """CHECK's optional `ips`: the addresses the runtime's prevResult holds."""
    ips = data.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise IPAMError(400, 7, "ips must be a list of strings")
    return ips


def _key(data: dict[str, Any]) -> OwnerKey:
    return OwnerKey(_identifier(data, "containerID"), _identifier(data, "ifName"))


def add_reply(result: AddResult) -> dict[str, Any]:
    """The 1.x-shaped IPAM result the plugins convert for the caller's cniVersion."""
    network = ipaddress.ip_network(result.network.subnet)
    default = "0.0.0.0/0" if network.version == 4 else "::/0"
    gateway = result.network.gateway
    return {
        "ips": [{"address": f"{result.record.address}/{network.prefixlen}", "gateway": gateway}],
        "routes": [{"dst": default, "gw": gateway}],
        "ipConfigID": result.record.id,
        "waitedSeconds": round(result.waited_seconds, 6),
    }


async def handle_add(request: web.Request) -> web.Response:
    data = await _body(request)
    owner = _owner(data)
    _optional_string(data, "netns")
    result = await request.app[NODE_KEY].add(owner)
    return web.json_response(add_reply(result))


async def handle_del(request: web.Request) -> web.Response:
    key = _key(await _body(request))
    record = await request.app[NODE_KEY].delete(key)
    return web.json_response({"released": None if record is None else record.address})


async def handle_check(request: web.Request) -> web.Response:
    data = await _body(request)
    key = _key(data)
    request.app[NODE_KEY].check(key, _ips(data))
    return web.json_response({})


async def handle_gc(request: web.Request) -> web.Response:
    data = await _body(request)
    attachments = data.get("validAttachments")
    if not isinstance(attachments, list):
        raise IPAMError(400, 7, "validAttachments must be a list")
    valid = set()
    for index, item in enumerate(attachments):
        if not isinstance(item, dict):
            raise IPAMError(400, 7, f"validAttachments[{index}] must be an object")
        container = item.get("containerID")
        ifname = item.get("ifname")
        if not isinstance(container, str) or not isinstance(ifname, str):
            raise IPAMError(
                400, 7, f"validAttachments[{index}] needs string containerID and ifname"
            )
        valid.add(OwnerKey(container, ifname))
    released = await request.app[NODE_KEY].gc(valid)
    await request.app[ATTACH_KEY].reap()  # interfaces of released attachments go too
    return web.json_response({"released": released})


def _owner(data: dict[str, Any]) -> Owner:
    key = _key(data)
    return Owner(
        key.container_id,
        key.ifname,
        _optional_string(data, "podName"),
        _optional_string(data, "podNamespace"),
    )


async def handle_attach(request: web.Request) -> web.Response:
    data = await _body(request)
    owner = _owner(data)
    mtu = data.get("mtu", 1500)
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65535:
        raise IPAMError(400, 7, "mtu must be an integer in 576..65535")
    result = await request.app[ATTACH_KEY].add(owner, _optional_string(data, "netns"), mtu)
    return web.json_response(result)


async def handle_detach(request: web.Request) -> web.Response:
    key = _key(await _body(request))
    released = await request.app[ATTACH_KEY].delete(key)
    return web.json_response({"released": released})


async def handle_verify(request: web.Request) -> web.Response:
    data = await _body(request)
    key = _key(data)
    await request.app[ATTACH_KEY].check(key, _optional_string(data, "netns"), _ips(data))
    return web.json_response({})


async def handle_status(request: web.Request) -> web.Response:
    ready, reason = request.app[NODE_KEY].status()
    if not ready:
        raise IPAMError(503, 50, f"cns cannot serve ADD now: {reason}")
    return web.json_response({"ready": True})


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a CNI error body and time every call."""
    started = time.perf_counter()
    verb = request.path.rsplit("/", 1)[-1]
    result = "ok"
    try:
        response = await handler(request)
    except IPAMError as exc:
        result = f"error{exc.code}"
        response = _error(exc)
    except web.HTTPException as exc:
        result = f"http{exc.status}"
        response = web.json_response(
            {"code": 7, "msg": f"{request.method} {request.path}: {exc.reason}"},
            status=exc.status,
        )
    except Exception as exc:
        log.exception("api_internal_error", path=request.path)
        result = "error102"
        response = _error(IPAMError(500, 102, "internal error in cns", repr(exc)))
    observe: Any = request.app[OBSERVE_KEY]
    if observe is not None:
        observe(verb, result, time.perf_counter() - started)
    return response


def build_app(
    node: NodeIPAM, attachments: Attachments, observe: Observer | None
) -> web.Application:
    app = web.Application(middlewares=[errors_and_metrics], client_max_size=1 << 20)
    app[NODE_KEY] = node
    app[ATTACH_KEY] = attachments
    app[OBSERVE_KEY] = observe
    app.router.add_post("/v1/cni/add", handle_add)
    app.router.add_post("/v1/cni/del", handle_del)
    app.router.add_post("/v1/cni/check", handle_check)
    app.router.add_post("/v1/cni/gc", handle_gc)
    app.router.add_get("/v1/cni/status", handle_status)
    app.router.add_post("/v1/cni/attach", handle_attach)
    app.router.add_post("/v1/cni/detach", handle_detach)
    app.router.add_post("/v1/cni/verify", handle_verify)
    return app
