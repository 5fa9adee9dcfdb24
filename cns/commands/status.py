"""`cns status`: a running daemon's pool, read from its debug endpoint, as tables or JSON.

The daemon serves the endpoint twice: on a root-only unix socket, which only cns can have
bound, and on debugListen's TCP port, which any local user may have taken before cns started.
`cns status` reads the socket when it may, and always says which endpoint answered.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any

from cns.support.table import table

TIMEOUT_SECONDS = 5.0


class EndpointError(Exception):
    """The endpoint answered with an error status; `body` is its JSON, if any."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("cns", timeout=TIMEOUT_SECONDS)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_SECONDS)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The daemon's debug endpoint: its unix socket (`socket`) or an http://HOST:PORT `url`."""

    url: str = ""
    socket: str = ""

    def __str__(self) -> str:
        return f"unix:{self.socket}" if self.socket else self.url.rstrip("/")

    def _connection(self) -> tuple[http.client.HTTPConnection, str]:
        if self.socket:
            return _UnixConnection(self.socket), ""
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{self.url!r} is not an http://HOST:PORT URL")
        return http.client.HTTPConnection(parts.netloc, timeout=TIMEOUT_SECONDS), parts.path

    def get(self, path: str) -> Any:
        """GET `path` (with its query) as JSON; EndpointError for an error status, OSError or
        ValueError when nothing readable answers."""
        connection, prefix = self._connection()
        try:
            connection.request("GET", prefix.rstrip("/") + path)
            response = connection.getresponse()
            raw = response.read()
        except http.client.HTTPException as exc:
            raise OSError(f"{self}: {exc!r}") from exc
        finally:
            connection.close()
        if response.status >= 400:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            raise EndpointError(response.status, body)
        return json.loads(raw)


def read_first(endpoints: list[Endpoint], path: str) -> tuple[Endpoint, Any]:
    """GET `path` from the first of `endpoints` that can be connected to (one that answers with
    an error status ends the search: EndpointError); OSError listing every failure when none
    can. Each endpoint skipped is reported on stderr."""
    failures = []
    for endpoint in endpoints:
        try:
            data = endpoint.get(path)
        except (OSError, ValueError) as exc:
            failures.append(f"cannot read {endpoint}{path}: {exc}")
            continue
        for failure in failures:
            print(f"cns status: {failure}; read {endpoint} instead", file=sys.stderr)
        return endpoint, data
    raise OSError("; ".join(failures))


def show_status(endpoints: list[Endpoint], *, ips: bool, as_json: bool, pod: str = "") -> int:
    """Print the pool (and with `ips` every IP and its owner; with `pod`, only that pod's
    situation) read from the first of `endpoints` that answers, and which one that was; 1 if
    none can be read."""
    if pod:
        return _show_pod(endpoints, pod, as_json=as_json)
    try:
        endpoint, pool = read_first(endpoints, "/debug/pool")
        listed = endpoint.get("/debug/ips")["ips"] if ips else []
    except (EndpointError, OSError, ValueError) as exc:
        _cannot_read(exc)
        return 1
    if as_json:
        print(f"cns status: read {endpoint}", file=sys.stderr)
        print(json.dumps({"pool": pool, "ips": listed} if ips else pool, indent=2))
        return 0
    print(render_pool(pool, endpoint=str(endpoint)))
    if ips:
        print()
        print(render_ips(listed))
    return 0


def _cannot_read(exc: Exception) -> None:
    print(f"cns status: {exc}", file=sys.stderr)
    print(
        "  (is a daemon running? Its debug socket is root's only. Point at another endpoint "
        "with --debug-socket, --debug-url or CNS_DEBUG_URL; `make cluster-up` prints the line "
        "to use)",
        file=sys.stderr,
    )


def render_pool(pool: dict[str, Any], *, endpoint: str = "") -> str:
    """The pool as two small tables: scaling figures (first, the endpoint they were read from),
    then IPs per state."""
    exhausted = "yes" if pool["subnetExhausted"] else "no"
    figures = [
        ("FIELD", "VALUE"),
        *([("endpoint", endpoint)] if endpoint else []),
        ("batchSize", f"{pool['batchSize']} (scaler {pool['scalerBatchSize']})"),
        ("requestThresholdPercent", str(pool["requestThresholdPercent"])),
        ("releaseThresholdPercent", str(pool["releaseThresholdPercent"])),
        ("maxIPCount", str(pool["maxIPCount"])),
        ("primaryIPCount", str(pool["primaryIPCount"])),
        ("demand", f"{pool['demand']} ({pool['waitingAdds']} waiting, {pool['podDemand']} pods)"),
        ("requestedIPCount", str(pool["requestedIPCount"])),
        ("targetIPCount", str(pool["targetIPCount"])),
        ("ipsNotInUse", str(len(pool["ipsNotInUse"]))),
        ("subnetExhausted", exhausted),
        ("subnetDraining", "yes" if pool.get("subnetDraining") else "no"),
        *([("overflow", overflow_text(pool["overflow"]))] if pool.get("overflow") else []),
        ("leakCheck", leak_check_text(pool.get("leakCheck"))),
        ("ignoredNCs", ignored_text(pool.get("ignoredNetworkContainers"))),
    ]
    states = [("STATE", "IPS"), *((k, str(v)) for k, v in pool["ips"].items())]
    text = table(figures) + "\n\n" + table(states)
    if pool.get("subnets"):
        text += "\n\n" + render_lanes(pool)
    return text


def render_lanes(pool: dict[str, Any]) -> str:
    """One row per subnet of the node (the primary first): what each lane asks for and holds."""
    lanes = {pool.get("subnet") or "(primary)": pool, **pool["subnets"]}
    rows = [("SUBNET", "REQUESTED", "TARGET", "DEMAND", "WAITING", "EXHAUSTED", "AVAILABLE",
             "ASSIGNED")]  # fmt: skip
    for name, lane in lanes.items():
        rows.append(
            (
                lane_title(name, lane),
                str(lane["requestedIPCount"]),
                str(lane["targetIPCount"]),
                str(lane["demand"]),
                str(lane["waitingAdds"]),
                "yes" if lane["subnetExhausted"] else "no",
                str(lane["ips"]["Available"]),
                str(lane["ips"]["Assigned"]),
            )
        )
    return table(rows)


def overflow_text(overflow: dict[str, Any]) -> str:
    """The overflow subnets in order, the one taking pods now marked ("more (taking pods),
    spare (exhausted); 3 pods sent")."""

    def said(subnet: dict[str, Any]) -> str:
        name = subnet["name"]
        if name == overflow["target"]:
            return f"{name} (taking pods)"
        for why, field in (("exhausted", "exhausted"), ("draining", "draining")):
            if subnet[field]:
                return f"{name} ({why})"
        return name if subnet["sameFamily"] else f"{name} (not usable)"

    return f"{', '.join(map(said, overflow['subnets']))}; {overflow['podsSentTotal']} pods sent"


def lane_title(name: str, lane: dict[str, Any]) -> str:
    """The subnet's name, and "(removed)" or "(draining)" when it hands out no IP."""
    if lane.get("removed"):
        return f"{name} (removed)"
    return f"{name} (draining)" if lane.get("subnetDraining") else name


def leak_check_text(check: dict[str, Any] | None) -> str:
    """`off`, or the suspects and what was reclaimed ("2 suspects, reclaimed pod-gone 3")."""
    if not check or not check.get("enabled"):
        return "off"
    reclaimed = ", ".join(f"{reason} {n}" for reason, n in check["reclaimed"].items())
    text = f"{check['suspects']} suspects, reclaimed {reclaimed or 'none'}"
    if check.get("runtimeError"):
        text += f"; runtime unavailable: {check['runtimeError']}"
    return text


def ignored_text(ignored: list[dict[str, Any]] | None) -> str:
    """`none`, or each network container (or IP assignment) the daemon leaves unused and why
    ("nc-2 type=overlay", "nc-1 ipAssignments.ip=garbage (not an address)")."""
    if not ignored:
        return "none"
    return ", ".join(
        f"{c['id']} {c['field']}={c['value']}" + (f" ({c['reason']})" if c.get("reason") else "")
        for c in ignored
    )


def render_ips(ips: list[dict[str, Any]]) -> str:
    rows = [("ADDRESS", "STATE", "CONTAINER", "IFNAME", "POD")]
    for ip in ips:
        owner = ip["owner"] or {}
        pod = f"{owner.get('podNamespace', '')}/{owner.get('podName', '')}".strip("/")
        rows.append(
            (
                ip["address"],
                ip["state"],
                owner.get("containerID", "")[:12],
                owner.get("ifName", ""),
                pod,
            )
        )
    return table(rows)


def _show_pod(endpoints: list[Endpoint], pod: str, *, as_json: bool) -> int:
    path = f"/debug/pod?{urllib.parse.urlencode({'pod': pod})}"
    try:
        endpoint, view = read_first(endpoints, path)
    except EndpointError as exc:  # 400: the daemon says what is wrong with the name
        error = exc.body.get("error") if isinstance(exc.body, dict) else None
        print(f"cns status: {error or exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        _cannot_read(exc)
        return 1
    print(f"cns status: read {endpoint}", file=sys.stderr)
    print(json.dumps(view, indent=2) if as_json else render_pod(view))
    return 0


STATES = {
    "assigned": "has its IP",
    "waiting": "is waiting for an IP",
    "unknown": "has no IP from cns on this node and no ADD waiting (has the runtime called "
    "the CNI plugin for it here yet?)",
}


def render_pod(view: dict[str, Any]) -> str:
    """One pod's situation in one screen: its IP, or what it waits for and the numbers."""
    lines = [f"pod {view['pod']} {STATES.get(view['state'], view['state'])}"]
    for ip in view["ips"]:
        owner = ip["owner"] or {}
        lines.append(
            f"  {ip['address']}  {ip['state']}  container {owner.get('containerID', '')[:12]}"
            f"  {owner.get('ifName', '')}"
        )
    for waiter in view["waiting"]:
        lines.append(
            f"  ADD for container {waiter['containerID'][:12]} {waiter['ifName']} waiting "
            f"{waiter['waitedSeconds']:.1f} s (since {waiter['since']})"
        )
    reason = view.get("reason")
    if reason:
        lines.append("")
        lines.append(f"why: {reason['message']}")
        figures = [("FIGURE", "VALUE")] + [
            (key, str(value))
            for key, value in reason.items()
            if key not in ("code", "message") and value is not None
        ]
        lines.append(table(figures))
    return "\n".join(lines)
