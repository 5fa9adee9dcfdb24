"""A kube-apiserver that writes an audit log, and the requests per user counted from it.

How much a controller loads the API server is what the server saw: every request it answered,
by the user that made it. The policy logs each request once, at level Metadata (who, verb,
resource, code, when; no bodies), when its answer is complete. Watches appear when they end.

    cluster = AuditedCluster.start(bin_dir)
    ...
    with audit_log(cluster).open() as lines:
        counts = count_requests(lines, roles={CONTROLLER_USER: ("controller",)},
                                windows=[Window("churn", start, end)])
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness.kube_cluster import KubeCluster

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
"""


def audit_log(cluster: KubeCluster) -> Path:
    return cluster.workdir / "audit.log"


class AuditedCluster(KubeCluster):
    """KubeCluster whose apiserver logs every request (AUDIT_POLICY) to `audit_log(self)`."""

    def _prepare(self) -> None:
        super()._prepare()
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        self._apiserver.argv += [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={audit_log(self)}",
            "--audit-log-format=json",
        ]


@dataclass(frozen=True)
class Window:
    """A phase of a run, in wall-clock seconds (the audit log's clock)."""

    name: str
    start: float
    end: float


def _timestamp(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def count_requests(
    lines: Iterable[str], *, roles: Mapping[str, tuple[str, ...]], windows: list[Window]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per window and role (`roles` maps user names to the roles their requests count for):
    the requests received in that window, per second, by verb and resource, and how many were
    refused with 409 Conflict."""
    counters: dict[tuple[str, str], Counter[str]] = {}
    totals: Counter[tuple[str, str]] = Counter()
    conflicts: Counter[tuple[str, str]] = Counter()
    for line in lines:
        event = json.loads(line)
        counted = roles.get(event.get("user", {}).get("username", ""), ())
        if not counted or event.get("stage") != "ResponseComplete":
            continue
        at = _timestamp(event["requestReceivedTimestamp"])
        ref = event.get("objectRef") or {}
        what = event["verb"] + " " + ref.get("resource", "?")
        if ref.get("subresource"):
            what += "/" + ref["subresource"]
        conflict = (event.get("responseStatus") or {}).get("code") == 409
        for window in windows:
            if not window.start <= at < window.end:
                continue
            for role in counted:
                key = (window.name, role)
                totals[key] += 1
                counters.setdefault(key, Counter())[what] += 1
                conflicts[key] += conflict
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for window in windows:
        seconds = max(window.end - window.start, 1e-9)
        result[window.name] = {
            role: {
                "requests": totals[(window.name, role)],
                "perSecond": round(totals[(window.name, role)] / seconds, 2),
                "conflicts": conflicts[(window.name, role)],
                "byVerb": dict(counters.get((window.name, role), Counter()).most_common()),
            }
            for role in sorted({role for counted in roles.values() for role in counted})
        }
    return result
