"""Pod ADD latency with Kubernetes Events on, against off, paired in one run.

A real kube-apiserver and `cns controller` (tests/harness), and two `cns run` daemons of one
ClusterSubnet on two nodes: one with `kubernetes.events: true` (the default), one with it false.
Each round runs, on each daemon in turn (the order alternating), `--adds` ADDs of pods that exist
(an address each, then their DELs) and as many ADDs asking for an address outside the subnet
(refused at once; with events on, each reports a note to the recorder, which aggregates them per
pod and writes in the background). The figure is each kind's median latency on, over off, pooled
over the rounds after the first (the pools fill in the first); the per-round ratios say how much
the machine moved.

    flock /tmp/cns-heavy.lock .venv/bin/python -m bench.performance.events_add --rounds 6
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from typing import Any

from bench.benchlib import (
    BenchError,
    exit_cleanly_on_sigterm,
    log,
    percentile,
    temp_work_dir,
)
from tests.harness import REPO
from tests.harness.daemon import Daemon
from tests.harness.kube_api import DAEMON_USER
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_scenario import Scenario

SIDES = ("on", "off")


def make_pods(cluster: KubeCluster, node: str, count: int) -> list[str]:
    names = [f"{node}-p{i}" for i in range(count)]
    for name in names:
        cluster.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
            }
        )
    return names


def timed(daemon: Daemon, url: str, body: dict[str, Any]) -> tuple[float, int, Any]:
    started = time.perf_counter()
    status, reply = daemon.call("POST", url, body)
    return time.perf_counter() - started, status, reply


def one_side(daemon: Daemon, pods: list[str], round_: int) -> dict[str, list[float]]:
    """ADD and DEL each pod, then the refused ADDs: their latencies, checked."""
    plain, refused = [], []
    for pod in pods:
        body = {"containerID": f"{pod}-r{round_}", "ifName": "eth0", "podName": pod,
                "podNamespace": "default"}  # fmt: skip
        seconds, status, reply = timed(daemon, "/v1/cni/add", body)
        if status != 200:
            raise BenchError(f"ADD of {pod} failed: {reply}")
        plain.append(seconds)
        status, reply = daemon.call("POST", "/v1/cni/del", body)
        if status != 200:
            raise BenchError(f"DEL of {pod} failed: {reply}")
    for pod in pods:
        body = {"containerID": f"{pod}-x{round_}", "ifName": "eth0", "podName": pod,
                "podNamespace": "default", "requestedIP": "192.0.2.9"}  # fmt: skip
        seconds, status, reply = timed(daemon, "/v1/cni/add", body)
        if status == 200:
            raise BenchError(f"an address outside the subnet was given: {reply}")
        refused.append(seconds)
    return {"plain": plain, "refused": refused}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--adds", type=int, default=60, help="pods per daemon and round")
    parser.add_argument("--tmp-dir", default=None)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    workdir = temp_work_dir("cns-events-add-", args.tmp_dir)
    cluster = KubeCluster.start(workdir_parent=str(workdir))
    scenario: Scenario | None = None
    try:
        cluster.apply(REPO / "config" / "crd")
        cluster.apply(REPO / "config" / "rbac.yaml")
        scenario = Scenario(cluster, workdir, "bench-events", "10.70.0.0/20")
        daemons, pods = {}, {}
        for side in SIDES:
            node = f"bench-events-{side}"
            scenario.add_node(node)
        scenario.start_controller()
        for side in SIDES:
            node = f"bench-events-{side}"
            config: dict[str, Any] = {
                "ipCooldownSeconds": 0,
                "kubernetes": {"events": side == "on"},
            }
            config["kubernetes"] |= {
                "kubeconfig": str(cluster.kubeconfig_for(DAEMON_USER)),
                "subnetName": "bench-events",
                "watchTimeoutSeconds": 300,
            }
            daemons[side] = scenario.start_daemon(node, config=config)
            pods[side] = make_pods(cluster, node, args.adds)
        pooled: dict[str, dict[str, list[float]]] = {s: {"plain": [], "refused": []} for s in SIDES}
        per_round: dict[str, list[float]] = {"plain": [], "refused": []}
        for round_ in range(args.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            got = {side: one_side(daemons[side], pods[side], round_) for side in order}
            if round_ == 0:
                continue  # the pools grow in the first round
            for side in SIDES:
                for kind, values in got[side].items():
                    pooled[side][kind] += values
            for kind in per_round:
                ratio = statistics.median(got["on"][kind]) / statistics.median(got["off"][kind])
                per_round[kind].append(ratio)
            log(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f}x" for k, v in per_round.items()))
        written = daemons["on"].metrics().get("cns_events_written_total", 0)
        lost = sum(v for k, v in daemons["on"].metrics().items() if "cns_events_lost" in k)
        for kind in ("plain", "refused"):
            on, off = pooled["on"][kind], pooled["off"][kind]
            p50_on, p50_off = statistics.median(on), statistics.median(off)
            print(
                f"{kind:8} ADD p50 {p50_on * 1e3:.2f} ms on, {p50_off * 1e3:.2f} ms off: "
                f"{p50_on / p50_off:.3f}x; p99 {percentile(on, 99) / percentile(off, 99):.3f}x; "
                f"{len(on)} ADDs a side; per-round p50 ratios "
                + " ".join(f"{r:.2f}" for r in per_round[kind])
            )
        print(f"events written {written:.0f}, lost {lost:.0f}")
        return 0
    finally:
        if scenario is not None:
            for daemon in scenario.daemons.values():
                daemon.stop()
            scenario.cleanup()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
