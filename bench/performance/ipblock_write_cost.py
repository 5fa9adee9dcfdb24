"""The kube-apiserver's CPU per IPBlock write, by the form of the allocation entries.

The controller replaces a whole IPBlock (up to 256 entries, one per address of a /24) for every
grant or release in it, so the API server's cost per block write bounds how fast a burst of node
changes can be fulfilled. The cost follows the number of fields it validates and tracks
(managedFields). This writes blocks of ENTRIES entries, changing one entry per write (CONCURRENCY
blocks written side by side, WRITES writes in all), and reports the apiserver's CPU per write
(utime + stime from /proc) for each form, on one fresh etcd + kube-apiserver per CRD:

- `strings` under this tree's CRD: `"<node> <id> <uid>"`, what the controller writes;
- `maps` under this tree's CRD: `{node, id, uid}`, the earlier form (kept and read);
- both forms under `--baseline DIR`'s CRD (a checkout from before: where each entry was a typed
  map, or where `allocations` was tracked key by key, before `x-kubernetes-map-type: atomic`).

    .venv/bin/python -m bench.performance.ipblock_write_cost --baseline /tmp/cns-base-340a219

Prints one JSON object on stdout (and a table on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cns.kube.client import connect
from cns.kube.objects import IP_BLOCK, conditional
from tests.harness import REPO, HarnessError
from tests.harness.kube_cluster import KubeCluster, binaries, missing_binaries_message
from tests.harness.proc_stats import sample

Encode = Callable[[tuple[str, str, str]], Any]
FORMS: dict[str, Encode] = {
    "strings": lambda fields: " ".join(fields),
    "maps": lambda fields: {"node": fields[0], "id": fields[1], "uid": fields[2]},
}


def block(name: str, index: int, entries: dict[str, tuple[str, str, str]], encode: Encode) -> Any:
    allocations = {address: encode(fields) for address, fields in sorted(entries.items())}
    return {
        "apiVersion": IP_BLOCK.api_version,
        "kind": "IPBlock",
        "metadata": {"name": name},
        "spec": {"subnet": "cost", "cidr": f"10.{index}.0.0/24", "allocations": allocations},
    }


def fields(node: int) -> tuple[str, str, str]:
    return f"node-{node:05d}", str(uuid.uuid4()), str(uuid.uuid4())


async def measure(cluster: KubeCluster, form: str, args: argparse.Namespace) -> dict[str, Any]:
    """Apiserver CPU seconds per write and writes per second for one form of entries."""
    encode = FORMS[form]
    apiserver = cluster._apiserver.popen
    assert apiserver is not None
    async with await connect(str(cluster.kubeconfig)) as api:
        blocks = []
        for index in range(args.concurrency):
            name = f"cost-{form}-{index}"
            entries = {f"10.{index}.0.{a}": fields(a % 5) for a in range(args.entries)}
            written = await api.create(IP_BLOCK, block(name, index, entries, encode))
            blocks.append((name, index, entries, written))
        before = sample(apiserver.pid, time.monotonic())

        async def writer(name: str, index: int, entries: dict[str, Any], read: Any) -> None:
            for n in range(args.writes // args.concurrency):
                entries[f"10.{index}.0.{n % args.entries}"] = fields(n)
                body = conditional(block(name, index, entries, encode), read=read)
                read = await api.replace(IP_BLOCK, name, body)

        await asyncio.gather(*(writer(*one) for one in blocks))
        after = sample(apiserver.pid, time.monotonic())
    assert before is not None and after is not None
    writes = args.writes // args.concurrency * args.concurrency
    return {
        "apiserverCpuMsPerWrite": round(1000 * (after.cpu - before.cpu) / writes, 1),
        "writesPerSecond": round(writes / (after.at - before.at), 1),
    }


def run(crd: Path, forms: list[str], args: argparse.Namespace) -> dict[str, Any]:
    bin_dir = binaries()
    if bin_dir is None:
        raise HarnessError(missing_binaries_message())
    cluster = KubeCluster.start(bin_dir)
    try:
        cluster.apply(crd)
        time.sleep(3)  # the CRD's REST endpoint comes up
        return {form: asyncio.run(measure(cluster, form, args)) for form in forms}
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout whose CRD to compare with")
    parser.add_argument("--entries", type=int, default=256)
    parser.add_argument("--writes", type=int, default=320)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    results = {"this tree's CRD": run(REPO / "config/crd/ipblocks.yaml", ["strings", "maps"], args)}
    if args.baseline:
        crd = args.baseline / "config/crd/ipblocks.yaml"
        results["baseline CRD"] = run(crd, ["strings", "maps"], args)
    report = {"entries": args.entries, "writes": args.writes, "concurrency": args.concurrency}
    print(json.dumps({**report, "results": results}, indent=2))
    for crd_name, by_form in results.items():
        for form, figures in by_form.items():
            print(
                f"{crd_name:16s} {form:8s} {figures['apiserverCpuMsPerWrite']:7.1f} ms CPU/write"
                f"  {figures['writesPerSecond']:7.1f} writes/s",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
