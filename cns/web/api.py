"""The CNI-facing socket API (v1): JSON over HTTP on a unix socket. See docs/api.md."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from cns.core.requested import parse_requested
from cns.core.subnet_choice import SubnetChoiceInvalid, SubnetChoiceUnknown
from cns.core.types import Owner, OwnerKey
from cns.node.attachments import Attachments, refuse_host_namespace
from cns.node.control_plane import SubnetChooser, configured_subnets
from cns.node.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    IPAMError,
    NotFound,
    Unavailable,
)
from cns.node.service import AddResult, NodeIPAM
from cns.web import validation

log = structlog.get_logger("cns.web.api")

NODE_KEY = web.AppKey("node", NodeIPAM)
ATTACH_KEY = web.AppKey("attachments", Attachments)
OBSERVE_KEY = web.AppKey("observe", object)
CHOOSER_KEY: web.AppKey[SubnetChooser] = web.AppKey("choose_subnets")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Observer = Callable[[str, str, float], None]
Rule = Callable[[str], str | None]

# The plugins send head and body in one write; a body still incomplete after this is a client
# that stalled or is trickling it on purpose, and it must not hold a connection.
REQUEST_BODY_SECONDS = 5.0
MAX_BODY_BYTES = 1 << 20
MAX_LOGGED_MESSAGE = 512  # characters of an error's message (and details) in its log line


class BodyTimeout(IPAMError):
    """The request body did not arrive within REQUEST_BODY_SECONDS: the transport's own failure."""


# The HTTP status of each kind of failure (docs/api.md, "Errors"). The service and the
# attachments report CNI codes only; this is the one place where they meet HTTP.
HTTP_STATUS: dict[type[IPAMError], int] = {
    InvalidRequest: 400,
    NotFound: 404,
    BodyTimeout: 408,
    Conflict: 409,
    InternalError: 500,
    Unavailable: 503,
}


def http_status(exc: IPAMError) -> int:
    """The status of `exc`'s kind (its nearest listed class); 500 for a kind not listed."""
    for kind in type(exc).__mro__:
        if kind in HTTP_STATUS:
            return HTTP_STATUS[kind]
    return 500


def _error(exc: IPAMError) -> web.Response:
    return web.json_response(exc.body(), status=http_status(exc))


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object in the body: code 6 when it is not one (malformed, not UTF-8, nested too
    deeply for the parser) or does not arrive within REQUEST_BODY_SECONDS. A body that arrived
    with the head (the plugins send both in one write) is read without arming that timer: a
    timer per request is a heap entry and a cancelled handle on the loop for nothing."""
    if request.content.is_eof():  # the whole body came with the head: reading cannot wait
        raw = await request.read()
    else:
        try:
            async with asyncio.timeout(REQUEST_BODY_SECONDS):
                raw = await request.read()
        except TimeoutError:
            raise BodyTimeout(
                6, f"request body not received within {REQUEST_BODY_SECONDS:g} s"
            ) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # includes UnicodeDecodeError and json.JSONDecodeError
        raise InvalidRequest(6, "request body is not JSON", str(exc)) from exc
    except RecursionError:
        raise InvalidRequest(6, "request body is not JSON", "nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequest(6, "request body must be a JSON object")
    return data


def _check(field: str, problem: str | None) -> None:
    if problem is not None:
        raise InvalidRequest(4, f"{field}: {problem}")


def _identifier(data: dict[str, Any], field: str, rule: Rule, where: str = "") -> str:
    """A required identifier: code 4 naming the field when missing or breaking its rule."""
    value = data.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(4, f"{where}{field} is required and must be a non-empty string")
    _check(where + field, rule(value))
    return value


def _optional_string(data: dict[str, Any], field: str, rule: Rule) -> str:
    """An optional string: code 7 when it is not a string, 4 when it breaks its rule."""
    value = data.get(field, "")
    if not isinstance(value, str):
        raise InvalidRequest(7, f"{field} must be a string")
    if value:
        _check(field, rule(value))
    return value


def _ips(data: dict[str, Any]) -> list[str]:
    """CHECK's optional `ips`: the addresses the runtime's prevResult holds."""
    ips = data.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise InvalidRequest(7, "ips must be a list of strings")
    return ips


def _key(data: dict[str, Any], ifname_field: str = "ifName", where: str = "") -> OwnerKey:
    return OwnerKey(
        _identifier(data, "containerID", validation.container_id_problem, where),
        _identifier(data, ifname_field, validation.ifname_problem, where),
    )


def _netns(data: dict[str, Any]) -> str:
    return _optional_string(data, "netns", validation.netns_problem)


@functools.lru_cache(maxsize=64)
def _prefix_and_version(subnet: str) -> tuple[int, int]:
    """A subnet's prefix length and IP version. A node has a handful of subnets, and parsing
    one costs more than building the rest of the reply, so each is parsed once."""
    network = ipaddress.ip_network(subnet)
    return network.prefixlen, network.version


def add_reply(result: AddResult) -> dict[str, Any]:
    """The 1.x-shaped IPAM result the plugins convert for the caller's cniVersion: every
    address with its subnet's prefix length and gateway, and one default route per family (the
    first subnet's of that family)."""
    ips: list[dict[str, str]] = []
    routes: dict[str, dict[str, str]] = {}
    for record, nc in result.ips:
        prefixlen, version = _prefix_and_version(nc.subnet)
        ips.append({"address": f"{record.address}/{prefixlen}", "gateway": nc.gateway})
        default = "0.0.0.0/0" if version == 4 else "::/0"
        routes.setdefault(default, {"dst": default, "gw": nc.gateway})
    return {
        "ips": ips,
        "routes": list(routes.values()),
        "ipConfigID": result.record.id,
        "waitedSeconds": round(result.waited_seconds, 6),
    }


def _subnets(data: dict[str, Any]) -> tuple[str, ...]:
    """ADD's optional `subnets`: the names of the subnets to get one IP of each (none: the
    node's primary subnet); code 7 naming the field when it is not a short list of distinct
    names."""
    if "subnets" not in data:
        return ()
    value = data["subnets"]
    problem = validation.subnets_problem(value)
    if problem is not None:
        raise InvalidRequest(7, f"subnets: {problem}")
    return tuple(value)


def _requested_ip(data: dict[str, Any]) -> str:
    """ADD's optional `requestedIP`: the address the pod asks for, or one per family separated
    by a comma (the CNI `ips` capability, or `IP=` in CNI_ARGS), canonical; code 7 naming the
    field when it is not (cns/core/requested.py says what is accepted)."""
    value = data.get("requestedIP", "")
    if not isinstance(value, str):
        raise InvalidRequest(7, "requestedIP must be a string")
    try:
        return ",".join(parse_requested(value))
    except ValueError as exc:
        raise InvalidRequest(7, f"requestedIP: {exc}") from None


async def _chosen_subnets(
    request: web.Request, owner: Owner, data: dict[str, Any]
) -> tuple[str, ...]:
    """The subnets the ADD draws from: the request's `subnets` (the network configuration's),
    unless an annotation of the pod or its namespace chooses (Kubernetes mode). Code 7 naming
    the annotation when it is malformed; 11 when the pod cannot be looked up now."""
    configured = _subnets(data)
    try:
        return await request.app[CHOOSER_KEY](owner.pod_namespace, owner.pod_name, configured)
    except SubnetChoiceInvalid as exc:
        raise InvalidRequest(7, str(exc), "fix or remove the annotation") from None
    except SubnetChoiceUnknown as exc:
        raise Unavailable(11, str(exc), "retry the ADD once the API server answers") from None


async def handle_add(request: web.Request) -> web.Response:
    data = await _body(request)
    owner = _owner(data)
    netns = _netns(data)
    if netns:  # cns-ipam does not touch the namespace; the main plugin chained with it would
        refuse_host_namespace(netns)
    requested = _requested_ip(data)
    subnets = await _chosen_subnets(request, owner, data)
    result = await request.app[NODE_KEY].add(owner, requested, subnets)
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
        raise InvalidRequest(7, "validAttachments must be a list")
    valid = set()
    for index, item in enumerate(attachments):
        if not isinstance(item, dict):
            raise InvalidRequest(7, f"validAttachments[{index}] must be an object")
        valid.add(_key(item, "ifname", f"validAttachments[{index}]."))
    released = await request.app[NODE_KEY].gc(valid)
    await request.app[ATTACH_KEY].reap()  # interfaces of released attachments go too
    return web.json_response({"released": released})


def _owner(data: dict[str, Any]) -> Owner:
    key = _key(data)
    return Owner(
        key.container_id,
        key.ifname,
        _optional_string(data, "podName", validation.pod_name_problem),
        _optional_string(data, "podNamespace", validation.pod_namespace_problem),
    )


async def handle_attach(request: web.Request) -> web.Response:
    data = await _body(request)
    owner = _owner(data)
    mtu = data.get("mtu", 1500)
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65535:
        raise InvalidRequest(7, "mtu must be an integer in 576..65535")
    netns, requested = _netns(data), _requested_ip(data)
    subnets = await _chosen_subnets(request, owner, data)
    result = await request.app[ATTACH_KEY].add(owner, netns, mtu, requested, subnets)
    return web.json_response(result)


async def handle_detach(request: web.Request) -> web.Response:
    key = _key(await _body(request))
    released = await request.app[ATTACH_KEY].delete(key)
    return web.json_response({"released": released})


async def handle_verify(request: web.Request) -> web.Response:
    data = await _body(request)
    key = _key(data)
    await request.app[ATTACH_KEY].check(key, _netns(data), _ips(data))
    return web.json_response({})


async def handle_status(request: web.Request) -> web.Response:
    ready, reason = request.app[NODE_KEY].status()
    if not ready:
        raise Unavailable(50, f"cns cannot serve ADD now: {reason}")
    return web.json_response({"ready": True})


VERBS = frozenset(("add", "del", "check", "gc", "status", "attach", "detach", "verify"))


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a CNI error body and time every call."""
    started = time.perf_counter()
    verb = request.path.rsplit("/", 1)[-1]
    if verb not in VERBS:  # a metric label per unknown path would grow without bound
        verb = "other"
    result = "ok"
    try:
        response = await handler(request)
    except IPAMError as exc:
        result = f"error{exc.code}"
        response = _error(exc)
        # The runtime shows the plugin's error to whoever looks at the pod; the node's operator
        # reads the daemon's log. Messages quote at most a bounded part of the input.
        log.warning(
            "cni_request_failed",
            verb=verb,
            code=exc.code,
            msg=exc.msg[:MAX_LOGGED_MESSAGE],
            details=exc.details[:MAX_LOGGED_MESSAGE] or None,
        )
    except ConnectionError as exc:
        # The client went away mid-body: not an internal error. The reply goes nowhere, but
        # aiohttp logs a traceback for an exception that leaves here.
        log.info("api_request_aborted", path=request.path, reason=str(exc) or repr(exc))
        result = "aborted"
        response = _error(InvalidRequest(6, "request body incomplete: the client went away"))
    except web.HTTPException as exc:
        result = f"http{exc.status}"
        response = web.json_response(
            {"code": 7, "msg": f"{request.method} {request.path}: {exc.reason}"},
            status=exc.status,
        )
    except Exception as exc:
        log.exception("api_internal_error", path=request.path)
        result = "error102"
        response = _error(InternalError(102, "internal error in cns", repr(exc)))
    observe: Any = request.app[OBSERVE_KEY]
    if observe is not None:
        observe(verb, result, time.perf_counter() - started)
    return response


def build_app(
    node: NodeIPAM,
    attachments: Attachments,
    observe: Observer | None,
    choose_subnets: SubnetChooser = configured_subnets,
) -> web.Application:
    app = web.Application(middlewares=[errors_and_metrics], client_max_size=MAX_BODY_BYTES)
    app[NODE_KEY] = node
    app[ATTACH_KEY] = attachments
    app[OBSERVE_KEY] = observe
    app[CHOOSER_KEY] = choose_subnets
    app.router.add_post("/v1/cni/add", handle_add)
    app.router.add_post("/v1/cni/del", handle_del)
    app.router.add_post("/v1/cni/check", handle_check)
    app.router.add_post("/v1/cni/gc", handle_gc)
    app.router.add_get("/v1/cni/status", handle_status)
    app.router.add_post("/v1/cni/attach", handle_attach)
    app.router.add_post("/v1/cni/detach", handle_detach)
    app.router.add_post("/v1/cni/verify", handle_verify)
    return app
