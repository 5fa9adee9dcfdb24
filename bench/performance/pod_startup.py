"""Pod start-up on a real node: `cns-cni` versus `ptp + host-local`, same node, same run (root).

Brings up the node of tests/harness/kube_node.py (etcd, kube-apiserver, scheduler,
controller-manager, containerd, kubelet, cns controller and daemon) and then, for each round and
each CNI (the order alternates between rounds), makes that CNI the node's only network,
`kubectl apply`s a Deployment of REPLICAS pods and measures:
- apply -> all Running: from the start of `kubectl apply` until every pod reports Running with
  an IP (seen through a pod watch opened before the apply);
- per-pod network set-up: containerd's own debug log brackets each sandbox's CNI ADD between
  "begin cni setup" and "cni result" (nanosecond timestamps), i.e. the whole plugin chain as
  the runtime runs it, for every pod.
The Deployment is deleted, its IPs released and its sandbox namespaces gone before the next one,
which starts after a 5 s pause (`settle`), so every round starts from the same quiet node.

    .venv/bin/python -m bench.performance.pod_startup --rounds 3 --replicas 50 \\
        --json /tmp/cns-bench/pods.json
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.benchlib import (
    add_output_arguments,
    exit_cleanly_on_sigterm,
    log,
    machine_facts,
    percentile,
    print_facts,
    temp_work_dir,
)
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_node import KUBELET_API_QPS_1_20, KubeNode, deployment, ptp_conflist

CNS_SUBNET = "10.250.0.0/23"
PTP_SUBNET = "10.251.0.0/23"
SETTLE_SECONDS = 5.0
LOG_LINE = re.compile(
    r'time="([^"]+)".*msg="(begin cni setup|cni result)[^"]*".*podsandboxid=(\w+)'
)


def parse_time(stamp: str) -> float:
    """containerd's RFC 3339 time with nanoseconds -> epoch seconds (microsecond precision)."""
    head, _, rest = stamp.partition(".")
    fraction = re.match(r"\d+", rest)
    zone = rest[fraction.end() :] if fraction else rest
    micros = (fraction.group(0) if fraction else "0")[:6].ljust(6, "0")
    zone = "+00:00" if zone == "Z" else zone
    return datetime.datetime.fromisoformat(f"{head}.{micros}{zone}").timestamp()


def network_setup_seconds(log_path: Path, offset: int) -> dict[str, float]:
    """Sandbox id -> CNI ADD duration, from the containerd log written after byte `offset`."""
    begun: dict[str, float] = {}
    took: dict[str, float] = {}
    with log_path.open("rb") as file:
        file.seek(offset)
        for raw in file:
            match = LOG_LINE.search(raw.decode(errors="replace"))
            if not match:
                continue
            stamp, what, sandbox = match.groups()
            if what == "begin cni setup":
                begun[sandbox] = parse_time(stamp)
            elif sandbox in begun:
                took[sandbox] = parse_time(stamp) - begun.pop(sandbox)
    return took


def one_deployment(
    node: KubeNode, name: str, replicas: int, subnet: str, manifest: Path
) -> tuple[float, list[float]]:
    assert node.containerd is not None
    offset = node.containerd.log_path.stat().st_size
    manifest.write_text(json.dumps(deployment(name, replicas)))
    # A watch opened before the apply sees every pod become Running, without polling load.
    pods_path = node.kube.path_for("v1", "Pod", namespace="default")
    selector = {"labelSelector": f"app={name}"}
    listing = node.kube.request("GET", pods_path, params=selector).raise_for_status().json
    watch_params = {
        **selector,
        "resourceVersion": listing["metadata"]["resourceVersion"],
        "timeoutSeconds": 600,
    }
    running: dict[str, str] = {}
    started = time.monotonic()
    node.kubectl("apply", "-f", str(manifest))
    for event in node.kube.watch(pods_path, watch_params, timeout=610):
        pod, status = event["object"], event["object"].get("status") or {}
        if event["type"] != "DELETED" and status.get("phase") == "Running" and status.get("podIP"):
            running[pod["metadata"]["name"]] = status["podIP"]
        if len(running) == replicas:
            break
    else:
        raise RuntimeError(f"{name}: {len(running)} of {replicas} pods Running after 600 s")
    all_running = time.monotonic() - started
    network = ipaddress.ip_network(subnet)
    strays = [ip for ip in running.values() if ipaddress.ip_address(ip) not in network]
    if strays:
        raise RuntimeError(f"{name}: pods outside {subnet} (wrong CNI loaded?): {strays}")
    setups = list(network_setup_seconds(node.containerd.log_path, offset).values())
    if len(setups) < replicas:
        raise RuntimeError(f"{name}: containerd logged {len(setups)} CNI ADDs for {replicas} pods")
    node.kubectl("delete", "deployment", name, "--wait=false")
    node.wait_gone(f"app={name}", timeout=300)
    return all_running, setups


def settle() -> None:
    """Start every round from the same quiet node: the last round's sandbox namespaces gone
    (the kernel tears them down under the RTNL lock that every CNI ADD needs), then a pause."""
    deadline = time.monotonic() + 120
    while "cni-" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        if time.monotonic() > deadline:
            raise RuntimeError("sandbox network namespaces still present 120 s after the round")
        time.sleep(1.0)
    time.sleep(SETTLE_SECONDS)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50": percentile(ordered, 50),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=50)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir = temp_work_dir("cns-pods-", args.tmp_dir)
    facts = machine_facts(workdir)
    kube = KubeCluster.start(workdir_parent=str(workdir))
    try:
        log("starting the node")
        # The kubelet's 1.20 rate limit, as in docs/benchmarks.md, "Pod start-up on a real node".
        node = KubeNode.start(
            kube,
            workdir / "node",
            subnet_cidr=CNS_SUBNET,
            max_pods=args.replicas + 10,
            kubelet_api_qps=KUBELET_API_QPS_1_20,
        )
        try:
            assert node.containerd is not None and node.daemon is not None
            networks = {
                "cns-cni": (node.containerd.conflist, CNS_SUBNET),
                "ptp + host-local": (ptp_conflist(PTP_SUBNET, workdir / "host-local"), PTP_SUBNET),
            }
            running: dict[str, list[float]] = {name: [] for name in networks}
            setup: dict[str, list[float]] = {name: [] for name in networks}
            order = list(networks)
            for round_index in range(args.rounds):
                for cni in order if round_index % 2 == 0 else order[::-1]:
                    conflist, subnet = networks[cni]
                    node.containerd.set_conflist(conflist)
                    time.sleep(2.0)  # containerd reloads its CNI config on the file event
                    name = f"bench-{round_index}-{'cns' if cni == 'cns-cni' else 'ptp'}"
                    log(f"round {round_index + 1}/{args.rounds}: {cni}, {args.replicas} pods")
                    seconds, setups = one_deployment(
                        node, name, args.replicas, subnet, workdir / f"{name}.json"
                    )
                    running[cni].append(seconds)
                    setup[cni].extend(setups)
                    daemon = node.daemon
                    node.wait(lambda d=daemon: not [i for i in d.ips() if i["state"] == "Assigned"],
                         "cns released every IP", timeout=120)  # fmt: skip
                    settle()
        finally:
            node.stop()
    finally:
        kube.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    results = {
        cni: {
            "applyToAllRunningSeconds": running[cni],
            "applyToAllRunning": summary(running[cni]),
            "networkSetupSeconds": summary(setup[cni]),
        }
        for cni in running
    }
    print_facts(facts)
    print(f"pod start-up, {args.rounds} rounds x {args.replicas} pods per CNI, same node:")
    print(f"  {'CNI':<18} {'apply->Running (each round)':<32} {'net set-up p50':>15} "
          f"{'p99':>9} {'max':>9} {'pods':>6}")  # fmt: skip
    for cni, result in results.items():
        rounds = " ".join(f"{s:.2f}s" for s in result["applyToAllRunningSeconds"])
        net = result["networkSetupSeconds"]
        print(f"  {cni:<18} {rounds:<32} {net['p50'] * 1000:>12.1f} ms {net['p99'] * 1000:>6.1f} ms"
              f" {net['max'] * 1000:>6.1f} ms {net['count']:>6}")  # fmt: skip
    cns, ptp = results["cns-cni"], results["ptp + host-local"]
    targets = (
        ("apply->all Running", "applyToAllRunning"),
        ("network set-up", "networkSetupSeconds"),
    )
    for label, key in targets:
        for pct in ("p50", "p99"):
            ours, theirs = cns[key][pct], ptp[key][pct]
            verdict = "met" if ours <= theirs else "NOT MET"
            print(f"target: cns-cni no slower at {pct}, {label}: {ours * 1000:.1f} ms vs "
                  f"{theirs * 1000:.1f} ms -> {verdict}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"facts": facts, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
