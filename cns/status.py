"""`cns status`: a running daemon's pool, read from its debug endpoint, as tables or JSON."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

from cns.table import table


def _fetch(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def show_status(debug_url: str, *, ips: bool, as_json: bool) -> int:
    """Print the pool (and with `ips` every IP and its owner); 1 if the daemon cannot be read."""
    base = debug_url.rstrip("/")
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
    ]
    states = [("STATE", "IPS"), *((k, str(v)) for k, v in pool["ips"].items())]
    return table(figures) + "\n\n" + table(states)


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
