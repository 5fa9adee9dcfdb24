"""Pods across the three nodes of a real cluster (tests/harness/multinode.py, the flat-network
mode): pod start-up and pod-to-pod latency, each against a baseline measured in the same run.

- **Start-up, `cns-cni` vs `ptp` + `host-local`**: a Deployment of REPLICAS pods spread evenly
  over the nodes, from `kubectl apply` to every pod Running with an IP (seen through a pod
  watch opened before the apply). The baseline is the reference plugins on the same nodes and
  the same LAN: a `00-ptp-host-local.conflist` in each node's network configuration directory
  (it sorts first: the runtime uses it), each node a /28 of its own at the top of the LAN that
  cns never grants in this run. The order alternates between rounds; the Deployment is gone and
  its sandboxes removed before the next one starts.
- **Latency, across nodes vs on one node**: `ping -i 0.01 -c COUNT -q` from one pod to a pod on
  its own node and to a pod on another node, alternating, after three pings to each (the first
  contact waits for the neighbour resolution: up to proxy_delay, 0.8 s, where a proxy entry
  answers); the median of the per-round ratios of the average round-trip times.

    .venv/bin/python -m bench.performance.cluster_network --rounds 3 --replicas 30
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.benchlib import exit_cleanly_on_sigterm, log, machine_facts, print_facts
from tests.harness.install_node import build_image
from tests.harness.kube_node import deployment, ptp_conflist
from tests.harness.multinode import LAN, MultiNodeCluster

BASELINE_CONFLIST = "00-ptp-host-local.conflist"
RTT = re.compile(r"= [\d.]+/([\d.]+)/")


def baseline_range(index: int) -> str:
    """Node `index`'s host-local range: a /28 of the LAN's top quarter (10.123.0.192/28, ...)."""
    return str(ipaddress.ip_network(f"{LAN.network[192 + 16 * (index - 1)]}/28"))


def baseline_conflist(index: int, gateway: str, data_dir: Path) -> dict[str, Any]:
    """ptp + host-local on node `index`'s range. The gateway is the node's own address: ptp puts
    it on every pod's host veth, and the LAN's gateway there would cut the node off from the
    control plane."""
    hosts = ipaddress.ip_network(baseline_range(index))
    return ptp_conflist(str(LAN.network), data_dir, rangeStart=str(hosts[1]),
                        rangeEnd=str(hosts[-2]), gateway=gateway)  # fmt: skip


def use_baseline(cluster: MultiNodeCluster, on: bool) -> None:
    for node in cluster.nodes:
        path = node.directory / "net.d" / BASELINE_CONFLIST
        if on:
            data_dir = node.directory / "host-local"
            path.write_text(json.dumps(baseline_conflist(node.index, node.address, data_dir)))
        else:
            path.unlink(missing_ok=True)
    time.sleep(2)  # the runtime reloads its network configuration on the directory's change


def spread(name: str, replicas: int) -> dict[str, Any]:
    body = deployment(name, replicas)
    body["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
         "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"app": name}}}
    ]  # fmt: skip
    return body


def start_up(cluster: MultiNodeCluster, name: str, replicas: int, baseline: bool) -> float:
    """apply -> all Running; checks every pod's address came from the set-up measured."""
    pods_path = cluster.kube.path_for("v1", "Pod", namespace="default")
    selector = {"labelSelector": f"app={name}"}
    listing = cluster.kube.request("GET", pods_path, params=selector).raise_for_status().json
    params = {**selector, "resourceVersion": listing["metadata"]["resourceVersion"],
              "timeoutSeconds": 600}  # fmt: skip
    running: dict[str, str] = {}
    started = time.monotonic()
    cluster.kube.apply(spread(name, replicas))
    for event in cluster.kube.watch(pods_path, params, timeout=610):
        pod, status = event["object"], event["object"].get("status") or {}
        if event["type"] != "DELETED" and status.get("phase") == "Running" and status.get("podIP"):
            running[pod["metadata"]["name"]] = status["podIP"]
        if len(running) == replicas:
            break
    took = time.monotonic() - started
    top = ipaddress.ip_network(f"{LAN.network[192]}/26")
    wrong = [ip for ip in running.values() if (ipaddress.ip_address(ip) in top) != baseline]
    if len(running) < replicas or wrong:
        raise RuntimeError(
            f"{name}: {len(running)}/{replicas} Running, from the other set-up: {wrong}"
        )
    cluster.kubectl("delete", "deployment", name, "--wait=false")
    cluster.wait_gone(f"app={name}", timeout=300)
    return took


def average_rtt(
    cluster: MultiNodeCluster, source: dict[str, Any], target: str, count: int
) -> float:
    node = cluster.node(source["spec"]["nodeName"])
    said = node.in_pod(source["metadata"]["name"], "ping", "-i", "0.01", "-c", str(count), "-q",
                       target).stdout  # fmt: skip
    match = RTT.search(said)
    if match is None:
        raise RuntimeError(f"ping {target}: {said}")
    return float(match.group(1))


def latency(cluster: MultiNodeCluster, rounds: int, count: int) -> list[float]:
    """Per round, cross-node / same-node average RTT from the same source pod."""
    body = deployment("latency", 4)
    pod_spec = body["spec"]["template"]["spec"]
    pod_spec["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "In",
                                "values": ["node1", "node2"],
                            }
                        ]
                    }
                ]
            }
        }
    }
    pod_spec["topologySpreadConstraints"] = spread("latency", 4)["spec"]["template"]["spec"][
        "topologySpreadConstraints"]  # fmt: skip
    cluster.kube.apply(body)
    try:
        pods = cluster.wait_running("app=latency", 4)
        by_node: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            by_node.setdefault(pod["spec"]["nodeName"], []).append(pod)
        source, same = by_node["node1"][:2]
        other = by_node["node2"][0]
        for target in (same, other):  # neighbour resolution (proxy ARP answers late) first
            average_rtt(cluster, source, target["status"]["podIP"], 3)
        ratios = []
        for round_index in range(rounds):
            order = [same, other] if round_index % 2 == 0 else [other, same]
            rtts = {id(p): average_rtt(cluster, source, p["status"]["podIP"], count) for p in order}
            ratios.append(rtts[id(other)] / rtts[id(same)])
            log(f"latency round {round_index + 1}: same {rtts[id(same)]:.3f} ms, "
                f"across {rtts[id(other)]:.3f} ms")  # fmt: skip
        return ratios
    finally:
        cluster.kubectl("delete", "deployment", "latency", "--wait=false")
        cluster.wait_gone("app=latency")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=30)
    parser.add_argument("--pings", type=int, default=200)
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="cns-bn-", dir="/tmp"))
    print_facts(machine_facts(workdir))
    try:
        return measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure(args: argparse.Namespace, workdir: Path) -> int:
    archive = workdir / "cns.tar"
    image = (build_image(archive), archive)
    with MultiNodeCluster.start(workdir / "c", nodes=3, image=image, flat_network=True) as cluster:
        times: dict[str, list[float]] = {"cns-cni": [], "ptp-host-local": []}
        for round_index in range(args.rounds):
            order = ["cns-cni", "ptp-host-local"]
            if round_index % 2:
                order.reverse()
            for setup in order:
                baseline = setup == "ptp-host-local"
                use_baseline(cluster, baseline)
                took = start_up(cluster, f"start-{round_index}-{int(baseline)}", args.replicas,
                                baseline)  # fmt: skip
                times[setup].append(took)
                log(
                    f"round {round_index + 1} {setup}: {args.replicas} pods Running in {took:.2f} s"
                )
            use_baseline(cluster, False)
        ratios = [c / p for c, p in zip(times["cns-cni"], times["ptp-host-local"], strict=True)]
        rtt_ratios = latency(cluster, args.rounds * 2, args.pings)
    print(f"start-up of {args.replicas} pods on 3 nodes, cns-cni / ptp+host-local: "
          f"median {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}); "
          f"cns-cni {statistics.median(times['cns-cni']):.2f} s, "
          f"ptp+host-local {statistics.median(times['ptp-host-local']):.2f} s")  # fmt: skip
    print(f"pod-to-pod RTT across nodes / on one node: median {statistics.median(rtt_ratios):.2f}x "
          f"({', '.join(f'{r:.2f}' for r in rtt_ratios)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
