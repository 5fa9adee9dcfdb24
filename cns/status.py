"""`cns status`: a running daemon's pool, read from its debug endpoint, as tables or JSON."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from cns.table import table


def _fetch(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def show_status(debug_url: str, *, ips: bool, as_json: bool, pod: str = "") -> int:
    """Print the pool (and with `ips` every IP and its owner; with `pod`, only that pod's
    situation); 1 if the daemon cannot be read."""
    base = debug_url.rstrip("/")
    if pod:
        return _show_pod(base, pod, as_json=as_json)
    try:
        pool = _fetch(f"{base}/debug/pool")
        listed = _fetch(f"{base}/debug/ips")["ips"] if ips else []
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"cns status: cannot read {base}/debug/pool: {exc}", file=sys.stderr)
        print(
            "  (is a daemon serving its debugListen there? Point at another with --debug-url "
            "or CNS_DEBUG_URL; `make cluster-up` prints the line to use)",
            file=sys.stderr,
        )
        return 1
    if as_json:
        print(json.dumps({"pool": pool, "ips": listed} if ips else pool, indent=2))
        return 0
    print(render_pool(pool))
    if ips:
        print()
        print(render_ips(listed))
    return 0


def render_pool(pool: dict[str, Any]) -> str:
    """The pool as two small tables: scaling figures, then IPs per state."""
    exhausted = "yes" if pool["subnetExhausted"] else "no"
    figures = [
        ("FIELD", "VALUE"),
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
                f"{name} (removed)" if lane.get("removed") else name,
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


def _show_pod(base: str, pod: str, *, as_json: bool) -> int:
    url = f"{base}/debug/pod?{urllib.parse.urlencode({'pod': pod})}"
    try:
        view = _fetch(url)
    except urllib.error.HTTPError as exc:  # 400: the daemon says what is wrong with the name
        print(f"cns status: {_error_of(exc)}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"cns status: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(view, indent=2) if as_json else render_pod(view))
    return 0


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(exc).get("error") or exc)
    except (ValueError, OSError, AttributeError):
        return str(exc)


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
