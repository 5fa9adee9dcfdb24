"""CPU time of one controller round for a few changed nodes among many, before and after.

A subnet (default a /12) with NODES nodes (default 5,000) holding 32 to 64 addresses each, all
granted, recorded and listed; then one node asks for 16 more. "before" is the whole-subnet
round `plan_subnet` of the source tree given with --baseline (e.g. the base commit, exported
with `git archive`), run in a child process; "after" is this tree's incremental round: the
model told about the one node (`SubnetModel.set_node`) and `plan_round` over what changed.
Both run in the same invocation and the ratio is printed with the figures.

    python -m bench.performance.controller_round --baseline /tmp/base [--nodes 5000]
        [--cidr 10.0.0.0/12] [--changed 1]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

# The state is built with the API both trees share: Subnet, NodeView, Entry and the types (the
# planner is cns/core/subnet_plan.py since issue 26, cns/controller/plan.py in trees before it).
STATE = """
import ipaddress, random, time
try:
    from cns.core.subnet_plan import NodeView, plan_subnet
except ImportError:
    from cns.controller.plan import NodeView, plan_subnet
from cns.core.allocation import Entry
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, SubnetStatus

def build(nodes, cidr):
    subnet = Subnet("bench", cidr)
    rng = random.Random(1)
    hosts = (str(h) for h in subnet.network.hosts())
    next(hosts)  # the gateway
    views, record = [], {}
    for n in range(nodes):
        name = f"node-{n:05d}"
        primary = next(hosts)
        count = rng.randrange(32, 65)
        configs = tuple(IPConfig(f"{name}-{i}", next(hosts)) for i in range(count))
        nc = NetworkContainer(id=f"{name}-nc", primary_ips=(primary,), subnet=cidr,
                              gateway=subnet.gateway_address, ip_configs=configs,
                              version=1, programmed_version=1)
        record[primary] = Entry(name, nc.id, primary=True, uid=name)
        for c in configs:
            record[c.address] = Entry(name, c.id, uid=name)
        views.append(NodeView(name, nc, PoolRequest(count), uid=name))
    return subnet, views, record

def changed_nodes(nodes, changing):
    # spread over the subnet, the first one in the middle
    return sorted({(nodes // 2 + i * (nodes // changing)) % nodes for i in range(changing)})
"""

BEFORE = """
import json, sys, time
from dataclasses import replace
nodes, cidr, changing = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
subnet, views, record = build(nodes, cidr)
for index in changed_nodes(nodes, changing):
    view = views[index]
    views[index] = replace(view, request=PoolRequest(view.request.requested_ip_count + 16))
ids = iter(range(10**9))
started = time.process_time()
plan = plan_subnet(subnet, views, record, SubnetStatus(), random.Random(1), lambda: str(next(ids)))
seconds = time.process_time() - started
print(json.dumps({"seconds": seconds, "granted": plan.granted}))
"""


def after(nodes: int, cidr: str, changing: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(STATE, namespace)
    from cns.core.subnet_model import SubnetModel
    from cns.core.subnet_plan import plan_round
    from cns.core.types import PoolRequest, SubnetStatus

    subnet, views, record = namespace["build"](nodes, cidr)
    started = time.process_time()
    model = SubnetModel.build(subnet, views, record)
    model.settle(model.take_changed())
    build_seconds = time.process_time() - started
    ids = iter(range(10**9))
    started = time.process_time()
    for index in namespace["changed_nodes"](nodes, changing):
        view = views[index]
        model.set_node(replace(view, request=PoolRequest(view.request.requested_ip_count + 16)))
    plan = plan_round(
        model,
        changed=model.take_changed(),
        previous=SubnetStatus(),
        rng=random.Random(1),
        new_id=lambda: str(next(ids)),
    )
    seconds = time.process_time() - started
    return {"seconds": seconds, "granted": plan.granted, "build_seconds": build_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="source tree of 'before'")
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--cidr", default="10.0.0.0/12")
    parser.add_argument("--changed", type=int, default=1, help="nodes asking for 16 more")
    args = parser.parse_args()
    ipaddress.ip_network(args.cidr)
    env = {**os.environ, "PYTHONPATH": str(args.baseline)}
    child = subprocess.run(
        [sys.executable, "-c", STATE + BEFORE, str(args.nodes), args.cidr, str(args.changed)],
        env=env,
        cwd=args.baseline,
        capture_output=True,
        text=True,
        check=True,
    )
    before = json.loads(child.stdout)
    now = after(args.nodes, args.cidr, args.changed)
    assert before["granted"] == now["granted"], (before["granted"], now["granted"])
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "cidr": args.cidr,
                "changed_nodes": args.changed,
                "before_round_cpu_seconds": round(before["seconds"], 4),
                "after_round_cpu_seconds": round(now["seconds"], 6),
                "ratio_before_over_after": round(before["seconds"] / now["seconds"]),
                "after_model_build_cpu_seconds": round(now["build_seconds"], 2),
                # the whole process: the snapshot's objects, the model and the interpreter
                "after_max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
