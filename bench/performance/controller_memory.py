"""The controller's memory per address, from tracemalloc, for one or more source trees.

A controller (no API server: its watch caches are filled with `put`, as a list fills them)
holds NODES NodeNetworkConfigs with 32 to 64 addresses each, in the wire form the API server
sends (each object decoded from its own JSON, so no string is shared that a real listing would
not share), and their IPBlocks. The standby's warm-up builds the planning state; then the
periodic re-check runs once. Reported per tree: the bytes tracemalloc counts as held once the
state is built (caches + planning state), per address, and the peak during the re-check above
that.

Then the leader's side, in a second child: the same NODES NodeNetworkConfigs as a cluster's start
has them (no container yet, each asking for 32 to 64 addresses), and the leader's rounds until
every node is fulfilled, writing to an in-process stand-in for the API server (it keeps each
object as JSON text, answers as the server does, with the object written decoded afresh, and
sends each NNC and IPBlock written back as a watch event would, into the cache). Reported:
the peak during those rounds above what is held once they are done, per address granted (the
plans and the writes' replies), and the number of rounds; then, in a third child without
tracemalloc, how much the same rounds raise the process's resident memory (VmRSS; its peak,
VmHWM, reset before them), the stand-in's SQLite table included: the allocator keeps what a
round freed, so RSS stays at the peak (docs/benchmarks.md, "Controller memory at 5,000 nodes").
Each tree runs in its own
child process:

    python -m bench.performance.controller_memory --code /tmp/cns-base --label base \\
        --code . --label new [--nodes 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILD = r"""
import asyncio, gc, json, random, sys, time, tracemalloc
from kubernetes_asyncio import client
try:
    from cns.controller.recheck import RECHECK_SECONDS
except ImportError:  # a tree before the controller's split
    from cns.controller.run import RECHECK_SECONDS
from cns.controller.run import Controller
from cns.core.allocation import Entry, block_index, block_network

def served_subnets(controller):
    return controller.served if hasattr(controller, "served") else controller.lanes
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer
from cns.kube.client import KubeClient
from cns.kube.ipblock import block_object
from cns.kube.nnc import nnc_object
from cns.kube.nnc_containers import nc_to_status

NODES, CIDR = int(sys.argv[1]), sys.argv[2]
NS = "kube-system"


def wire(obj, version):
    # as a listing decodes it: fresh strings, with the fields the API server adds
    meta = obj["metadata"]
    meta.update(uid=f"uid-{meta['name']}", resourceVersion=str(version), generation=1,
                creationTimestamp="2026-11-26T10:00:00Z")
    return json.loads(json.dumps(obj))


async def main():
    tracemalloc.start()
    kube = KubeClient(client.ApiClient(client.Configuration()))
    controller = Controller(kube, namespace=NS, seed=1)
    subnet = Subnet("bench", CIDR)
    controller.subnets.put(wire({"apiVersion": "acn.azure.com/v1alpha1",
        "kind": "ClusterSubnet", "metadata": {"name": "bench"},
        "spec": {"subnet": CIDR, "gateway": subnet.gateway_address}}, 1))
    rng = random.Random(1)
    hosts = (str(h) for h in subnet.network.hosts())
    next(hosts)
    record, addresses = {}, 0
    gc.collect()
    start = tracemalloc.get_traced_memory()[0]
    for n in range(NODES):
        name = f"aks-nodepool1-{n:05d}-vmss"
        uid = f"uid-{name}"
        primary = next(hosts)
        count = rng.randrange(32, 65)
        configs = tuple(IPConfig(f"{rng.getrandbits(128):032x}", next(hosts)) for _ in range(count))
        nc = NetworkContainer(id=f"nc-{name}", primary_ips=(primary,), subnet=CIDR,
                              gateway=subnet.gateway_address, ip_configs=configs, version=1,
                              programmed_version=1)
        obj = nnc_object(node_name=name, node_uid=f"node-{name}", namespace=NS,
                         subnet_name="bench")
        obj["spec"] = {"requestedIPCount": count, "ipsNotInUse": []}
        obj["status"] = {"scaler": {"batchSize": 16, "requestThresholdPercent": 50,
                                    "releaseThresholdPercent": 150, "maxIPCount": 250,
                                    "minIPCount": 0},
                         "status": "Updated", "ipsToRelease": [], "assignedIPCount": count,
                         "networkContainers": [nc_to_status(nc, subnet_name="bench",
                                                            node_ip="10.224.0.4")]}
        controller.nncs.put(wire(obj, 100 + n))
        record[primary] = Entry(name, nc.id, primary=True, uid=uid)
        for c in configs:
            record[c.address] = Entry(name, c.id, uid=uid)
        addresses += count + 1
    by_block = {}
    for address, entry in record.items():
        by_block.setdefault(block_index(subnet.network, address), {})[address] = entry
    for index, entries in by_block.items():
        body = block_object(subnet_name="bench", index=index,
                            cidr=str(block_network(subnet.network, index)), entries=entries)
        controller.blocks.put(wire(body, 10**6 + index))
    del record, by_block, body, obj, nc, configs
    await controller._warm_once()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - start
    lane = served_subnets(controller)["bench"]
    lane.checked_at = -RECHECK_SECONDS  # the re-check is due
    tracemalloc.reset_peak()
    controller.kick()
    cpu = time.process_time()
    await controller._warm_once()
    check = getattr(lane, "check", None)  # the re-check ran alongside, as a task, before
    if check is not None:
        await check
    peak = tracemalloc.get_traced_memory()[1] - start - held
    cpu = time.process_time() - cpu
    assert controller.counters.rechecks == 2, controller.counters
    assert controller.counters.state_differences == 0
    await kube.close()
    print(json.dumps({"addresses": addresses, "held_bytes": held,
                      "bytes_per_address": round(held / addresses),
                      "recheck_peak_bytes": peak,
                      "recheck_peak_per_address": round(peak / addresses),
                      "recheck_cpu_seconds_traced": round(cpu, 2)}))


asyncio.run(main())
"""

GRANT = r"""
import asyncio, gc, json, random, sqlite3, sys, tracemalloc
from kubernetes_asyncio import client
from cns.controller.run import Controller
from cns.core.subnet import Subnet
from cns.kube.client import KubeClient
from cns.kube.nnc import nnc_object

NODES, CIDR = int(sys.argv[1]), sys.argv[2]
TRACE = sys.argv[3:] != ["rss"]
NS = "kube-system"


def rss():
    # This process's resident and peak resident memory (VmRSS, VmHWM), in bytes.
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return [int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")]


def merge(target, patch):
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


def event(collection, text):
    # What `WatchedCollection._watch_once` does with a MODIFIED event.
    obj = collection.slim(json.loads(text))
    key = collection.key(obj)
    wakes = collection._wakes(key, obj)
    collection._objects[key] = obj
    if wakes:
        collection.on_change()


class Server:
    # The custom-objects calls a leader's round makes. Objects are kept as JSON text in an
    # in-memory SQLite table: outside the interpreter's allocator, so that tracemalloc counts
    # the controller only. Each write also comes back as its watch event, once the writer
    # yields (`watched`).
    def __init__(self):
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table objects (plural, name, text, primary key (plural, name))")
        self.version, self.watched = 10, {}

    def _store(self, plural, obj):
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("uid", "uid-" + obj["metadata"]["name"])
        text = json.dumps(obj)
        self.db.execute("insert or replace into objects values (?, ?, ?)",
                        (plural, obj["metadata"]["name"], text))
        collection = self.watched.get(plural)
        if collection is not None:
            asyncio.get_running_loop().call_soon(event, collection, text)
        return json.loads(text)

    async def create_namespaced_custom_object(self, group, v, ns, plural, body):
        await asyncio.sleep(0)  # a round trip: the event loop runs meanwhile
        return self._store(plural, json.loads(json.dumps(body)))

    async def create_cluster_custom_object(self, group, v, plural, body):
        await asyncio.sleep(0)  # a round trip: the event loop runs meanwhile
        return self._store(plural, json.loads(json.dumps(body)))

    async def replace_cluster_custom_object(self, group, v, plural, name, body):
        await asyncio.sleep(0)  # a round trip: the event loop runs meanwhile
        return self._store(plural, json.loads(json.dumps(body)))

    async def _patch(self, plural, name, body):
        await asyncio.sleep(0)  # a round trip: the event loop runs meanwhile
        (text,) = self.db.execute("select text from objects where plural = ? and name = ?",
                                  (plural, name)).fetchone()
        return self._store(plural, merge(json.loads(text), body))

    async def patch_namespaced_custom_object_status(self, g, v, ns, plural, name, body, **_):
        return await self._patch(plural, name, body)

    async def patch_cluster_custom_object_status(self, g, v, plural, name, body, **_):
        return await self._patch(plural, name, body)


async def main():
    kube = KubeClient(client.ApiClient(client.Configuration()))
    server = Server()
    controller = Controller(kube, namespace=NS, seed=1)
    kube.custom = server  # after the watches took their list calls, which never run here
    server.watched = {"nodenetworkconfigs": controller.nncs, "ipblocks": controller.blocks}
    kube.before_write = lambda: None  # no lease here: this replica leads
    subnet = Subnet("bench", CIDR)
    controller.subnets.put(server._store("clustersubnets", {
        "apiVersion": "acn.azure.com/v1alpha1", "kind": "ClusterSubnet",
        "metadata": {"name": "bench"},
        "spec": {"subnet": CIDR, "gateway": subnet.gateway_address}}))
    rng = random.Random(1)
    asked = 0
    for n in range(NODES):
        name = f"aks-nodepool1-{n:05d}-vmss"
        obj = nnc_object(node_name=name, node_uid=f"node-{name}", namespace=NS,
                         subnet_name="bench")
        count = rng.randrange(32, 65)
        obj["spec"] = {"requestedIPCount": count, "ipsNotInUse": []}
        controller.nncs.put(server._store("nodenetworkconfigs", obj))
        asked += count
    del obj
    gc.collect()
    if TRACE:
        tracemalloc.start()
    else:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM from here
        before = rss()[0]
    rounds = 0
    controller.kick()
    while controller._dirty.is_set() and rounds < 1000:
        controller._dirty.clear()
        assert await controller.reconcile() == []
        rounds += 1
        if not controller._dirty.is_set():  # the round the watch events of its writes start
            assert await controller.reconcile() == []
    gc.collect()
    end, peak = tracemalloc.get_traced_memory() if TRACE else rss()
    served = controller.served if hasattr(controller, "served") else controller.lanes
    state = served["bench"].state
    granted = sum(not e.primary for e in state.model.entries.values())
    assert granted == asked, (granted, asked)
    await kube.close()
    if TRACE:
        print(json.dumps({"granted": granted, "rounds": rounds,
                          "grant_peak_above_end_bytes": peak - end,
                          "grant_peak_above_end_per_address": round((peak - end) / granted)}))
    else:
        print(json.dumps({"grant_rss_end_mib": round((end - before) / 2**20, 1),
                          "grant_rss_peak_mib": round((peak - before) / 2**20, 1)}))


asyncio.run(main())
"""


def measure(code: Path, nodes: int, cidr: str, *, rss_only: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code.resolve())}
    result: dict[str, Any] = {}
    children = [] if rss_only else [(CHILD,), (GRANT,)]
    for child, *mode in [*children, (GRANT, "rss")]:
        out = subprocess.run(
            [sys.executable, "-c", child, str(nodes), cidr, *mode],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            cwd=code,
        )
        result.update(json.loads(out.stdout.splitlines()[-1]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", action="append", type=Path, required=True)
    parser.add_argument("--label", action="append", required=True)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cidr", default="10.0.0.0/12")
    parser.add_argument(
        "--rss-only", action="store_true", help="only the resident memory of the leader's rounds"
    )
    args = parser.parse_args()
    if len(args.code) != len(args.label):
        parser.error("one --label per --code")
    results = {
        label: measure(code, args.nodes, args.cidr, rss_only=args.rss_only)
        for code, label in zip(args.code, args.label, strict=True)
    }
    base = results[args.label[0]]
    for label, result in results.items():
        for ratio, key in (
            ("ratio_bytes_per_address", "bytes_per_address"),
            ("ratio_recheck_peak", "recheck_peak_bytes"),
            ("ratio_grant_peak", "grant_peak_above_end_bytes"),
            ("ratio_grant_rss_peak", "grant_rss_peak_mib"),
        ):
            if key in result:
                result[ratio] = round(result[key] / max(1, base[key]), 3)
        print(f"{label}: {result}", file=sys.stderr)
    print(json.dumps({"nodes": args.nodes, "cidr": args.cidr, "results": results}, indent=2))


if __name__ == "__main__":
    main()
