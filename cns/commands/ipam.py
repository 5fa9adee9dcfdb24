"""`cns ipam show | check | release`: the whole cluster's addresses, from an operator's kubeconfig.

`show` prints utilization per ClusterSubnet and per node; `check` compares the allocation
record, every NodeNetworkConfig and every pod (`cns.core.ipam_audit`) and exits with the bits
of the problems it found; `release --from-report` frees what a check proved leaked, each
address checked again first (docs/kubernetes.md, "cns ipam").
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from cns.core.ipam_audit import (
    ClusterView,
    Problem,
    ReportInvalid,
    check,
    exit_status,
    parse_report,
    release_refusal,
    report,
    utilization,
)
from cns.kube.client import CredentialsError, connect
from cns.kube.ipam_view import ReleaseRefused, read_cluster, release_entry
from cns.support.table import table

ERROR = 1  # the cluster could not be read, or a release was refused
MAX_REPORT_BYTES = 64 << 20


def default_kubeconfig() -> str:
    """$KUBECONFIG (its first file), else ~/.kube/config when it exists, else "" (in-cluster)."""
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        return listed.split(os.pathsep)[0]
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else ""


async def _view(kubeconfig: str, namespace: str) -> ClusterView:
    async with await connect(kubeconfig) as kube:
        return await read_cluster(kube, namespace=namespace)


async def show(*, kubeconfig: str, namespace: str, as_json: bool, blocks: bool) -> int:
    subnets, nodes = utilization(await _view(kubeconfig, namespace))
    if as_json:
        data = {
            "subnets": [{**_fields(s), "free": s.free} for s in subnets],
            "nodes": [
                {
                    **{k: v for k, v in _fields(n).items() if k != "ranges"},
                    "free": n.free,
                    **({"ranges": list(n.ranges)} if blocks else {}),
                }
                for n in nodes
            ],
        }
        print(json.dumps(data, indent=2))
        return 0
    rows: list[tuple[str, ...]] = [
        ("SUBNET", "CIDR", "CAPACITY", "RESERVED", "GRANTED", "ASSIGNED", "FREE", "USED%")
    ]
    rows += [
        (
            f"{s.name} (draining)" if s.draining else s.name,
            s.cidr,
            *map(str, (s.capacity, s.reserved, s.granted, s.assigned, s.free)),
            f"{100 * s.reserved / s.capacity:.1f}" if s.capacity else "-",
        )
        for s in subnets
    ]
    print(table(rows))
    print()
    rows = [("NODE", "SUBNET", "REQUESTED", "RESERVED", "GRANTED", "ASSIGNED", "FREE")]
    rows += [
        (n.node, n.subnet, *map(str, (n.requested, n.reserved, n.granted, n.assigned, n.free)))
        for n in nodes
    ]
    print(table(rows))
    if blocks:
        print()
        rows = [("NODE", "SUBNET", "GRANTED ADDRESSES")]
        rows += [(n.node, n.subnet, " ".join(n.ranges) or "-") for n in nodes]
        print(table(rows))
    return 0


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


async def run_check(
    *, kubeconfig: str, namespace: str, as_json: bool, output_report: str, only_problems: bool
) -> int:
    view = await _view(kubeconfig, namespace)
    findings = check(view)
    now = time.time()
    stamp = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    data = report(findings, checked_at=stamp, checked_at_epoch=now)
    if output_report:
        _write_report(Path(output_report), data)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        if findings:
            rows = [("PROBLEM", "ADDRESS", "SUBNET", "WHY")]
            rows += [(f.problem.value, f.address or "-", f.subnet or "-", f.why) for f in findings]
            print(table(rows))
        if not only_problems:
            counts = ", ".join(f"{n} {p}" for p, n in data["counts"].items() if n)
            print(
                f"checked {len(view.record)} recorded addresses, {len(view.configs)} "
                f"NodeNetworkConfigs, {len(view.pods)} pod addresses at {stamp}: "
                f"{counts or 'no problems'}"
            )
    return exit_status(findings)


def _write_report(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed over `path`)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(path)


def load_report(path: Path) -> tuple[float, list[Any]]:
    """The time and findings of a report file; ReportInvalid naming what is wrong."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_REPORT_BYTES + 1)
    except OSError as exc:
        raise ReportInvalid(f"cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_REPORT_BYTES:
        raise ReportInvalid(f"larger than {MAX_REPORT_BYTES} bytes")
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ReportInvalid(f"not JSON: {exc}") from None
    return parse_report(parsed)


async def release(
    *, kubeconfig: str, namespace: str, report_file: str, dry_run: bool, grace_seconds: float
) -> int:
    checked_at, findings = load_report(Path(report_file))
    leaks = [(f, f.record) for f in findings if f.problem is Problem.LEAKED and f.record]
    if not leaks:
        print("the report holds no leaked address: nothing to release")
        return 0
    refused = 0
    async with await connect(kubeconfig) as kube:
        view = await read_cluster(kube, namespace=namespace)
        age = time.time() - checked_at
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for finding, recorded in leaks:
            why = release_refusal(finding, view, age_seconds=age, grace_seconds=grace_seconds)
            if why is None and not dry_run:
                try:
                    await release_entry(kube, recorded, namespace=namespace, at=stamp)
                except ReleaseRefused as exc:
                    why = str(exc)
            where = f"node {recorded.entry.node}, IPBlock {recorded.block}"
            if why is not None:
                refused += 1
                print(f"refused {finding.address}: {why}", file=sys.stderr)
            elif dry_run:
                print(f"would release {finding.address} ({where})")
            else:
                print(f"released {finding.address} ({where})")
    return ERROR if refused else 0


def run(command: Callable[..., Coroutine[Any, Any, int]], name: str, **options: Any) -> int:
    """Run one `cns ipam` command; errors reading the cluster or the report are one line."""
    try:
        return asyncio.run(command(**options))
    except ReportInvalid as exc:
        print(f"{name}: report {options.get('report_file')}: {exc}", file=sys.stderr)
    except CredentialsError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
    except ApiException as exc:
        print(f"{name}: the API server answered {exc.status} {exc.reason}", file=sys.stderr)
    except OSError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
    return ERROR
