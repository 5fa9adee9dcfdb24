"""CPU time of what a controller round does around the planning, before and after.

Besides planning the nodes that changed, every round looks at the whole cluster once: it
creates the NNCs of new nodes and splits its caches into what it plans from. Serving every
ClusterSubnet adds to that: placing nodes in subnets, checking that subnets do not overlap
(also against ranges the NNCs still hold), and splitting NNCs and IPBlocks by subnet. This
measures that per-round cost with NODES NNCs (32 to 64 addresses each, as the API server sends
them) and their IPBlocks in the caches, nothing to create: the steady state, where it is pure
overhead on every round.

Each tree given with --code runs in a child process of its own (PYTHONPATH), in one invocation;
the first is the baseline of the ratios printed.

    python -m bench.performance.controller_round_overhead --code /tmp/base --code . [--nodes 5000]
                                              [--subnets 1] [--rounds 50]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import asyncio, ipaddress, json, random, statistics, sys, time
from kubernetes_asyncio import client
import cns
from cns.controller.run import Controller
from cns.kube.client import KubeClient

nodes, subnets, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
GROUP = "acn.azure.com"

def objects():
    rng = random.Random(1)
    cs, nncs, node_objs, blocks = [], [], [], []
    per_subnet = -(-nodes // subnets)
    for s in range(subnets):
        network = ipaddress.ip_network(f"10.{16 * s}.0.0/12")
        cs.append({"metadata": {"name": f"pods-{s}", "resourceVersion": "1",
                                "creationTimestamp": f"2026-01-01T00:00:{s:02d}Z"},
                   "spec": {"subnet": str(network),
                            **({"nodeSelector": {"matchLabels": {"pool": str(s)}}}
                               if subnets > 1 else {})}})
        hosts = network.hosts()
        next(hosts)
        entries = {}
        for n in range(s * per_subnet, min(nodes, (s + 1) * per_subnet)):
            name = f"node-{n:05d}"
            labels = {"pool": str(s)} if subnets > 1 else {}
            node_objs.append({"metadata": {"name": name, "uid": f"uid-{n}", "labels": labels,
                                           "resourceVersion": "1"}})
            primary = str(next(hosts))
            ips = [{"name": f"{name}-{i}", "ip": str(next(hosts))}
                   for i in range(rng.randrange(32, 65))]
            nncs.append({
                "metadata": {"name": name, "namespace": "kube-system", "uid": f"nnc-{n}",
                             "resourceVersion": str(n + 2),
                             "labels": {f"{GROUP}/subnet": f"pods-{s}"}},
                "spec": {"requestedIPCount": len(ips)},
                "status": {"networkContainers": [{
                    "id": f"{name}-nc", "primaryIP": primary, "subnetName": f"pods-{s}",
                    "subnetAddressSpace": str(network), "defaultGateway": "",
                    "version": 1, "ipAssignments": ips}]},
            })
            for ip in [primary] + [c["ip"] for c in ips]:
                entries[ip] = f"{name} x nnc-{n}"
        by_block = {}
        for ip, entry in entries.items():
            index = (int(ipaddress.ip_address(ip)) - int(network.network_address)) >> 8
            by_block.setdefault(index, {})[ip] = entry
        for index, allocations in by_block.items():
            cidr = ipaddress.ip_network((int(network.network_address) + (index << 8), 24))
            blocks.append({"metadata": {"name": f"pods-{s}-b{index}", "resourceVersion": "1",
                                        "labels": {f"{GROUP}/subnet": f"pods-{s}"}},
                           "spec": {"subnet": f"pods-{s}", "cidr": str(cidr),
                                    "allocations": allocations}})
    return cs, nncs, node_objs, blocks

async def main():
    async with client.ApiClient() as api:
        try:
            controller = Controller(KubeClient(api), identity="bench")
        except TypeError:  # a tree before one controller served every subnet
            controller = Controller(KubeClient(api), subnet_name="pods-0", identity="bench")
        cs, nncs, node_objs, blocks = objects()
        for collection, objs in ((controller.subnets, cs), (controller.nncs, nncs),
                                 (controller.nodes, node_objs), (controller.blocks, blocks)):
            for obj in objs:
                collection.put(obj)
        split = hasattr(controller, "surveyor")
        surveyed = split or hasattr(controller, "_survey")
        print(f"{cns.__file__}: {'per-subnet' if surveyed else 'one subnet'}", file=sys.stderr)
        times = []
        for _ in range(rounds):
            started = time.process_time()
            if split:
                surveyor = controller.surveyor
                index = surveyor.nnc_index()
                survey = surveyor.survey(index)
                await surveyor.place_nodes(survey, index)
                surveyor.snapshot(survey, index)
            elif surveyed:
                index = controller._nnc_index()
                survey = controller._survey(index)
                await controller._place_nodes(survey, index)
                controller._snapshot(survey, index)
            else:
                await controller._ensure_nncs()
                controller._snapshot()
            times.append(time.process_time() - started)
        print(json.dumps({"median_s": statistics.median(times), "max_s": max(times),
                          "rounds": rounds}))

asyncio.run(main())
"""


def measure(code: Path, nodes: int, subnets: int, rounds: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(code.resolve())}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(nodes), str(subnets), str(rounds)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=code.resolve(),  # `-c` puts the working directory first on sys.path
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, action="append", required=True)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--subnets", type=int, default=1, help="served by one controller")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    results = []
    for code in args.code:
        print(f"measuring {code} ...", file=sys.stderr, flush=True)
        results.append((str(code), measure(code, args.nodes, args.subnets, args.rounds)))
    base = results[0][1]["median_s"]
    for code, result in results:
        print(
            json.dumps(
                {
                    "code": code,
                    "nodes": args.nodes,
                    "subnets": args.subnets,
                    **result,
                    "ratio_to_first": round(result["median_s"] / base, 3),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
