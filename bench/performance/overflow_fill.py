#!/usr/bin/env python3
"""A node's primary subnet fills while pods keep coming: with and without an overflow subnet,
on a real control plane (issue 29's figures on a real cluster).

Run (needs the binaries of scripts/build-kubernetes.sh; no root):

    .venv/bin/python -m bench.performance.overflow_fill > overflow-fill.json

A real kube-apiserver + etcd, the real `cns controller` (one per subnet, as sharded in
production) and a real `cns run` daemon in `mode: kubernetes` on one node, twice, in the same
run: once with the node's primary ClusterSubnet (a /27) alone, once naming an overflow subnet (a
/25, placed on no node). Each run schedules --pods pods on the node one every --interval
seconds (a Pod object bound to the node, then its ADD through the daemon's socket as the
runtime sends it) and retries a failed ADD every --retry seconds as the kubelet does, until the
pod has an address or the run ends (--run-seconds). Then it lets the pools settle and counts:

- pods that waited: those whose first ADD did not get an address at once (its reply took over
  --waited-after seconds, or failed); and those that never got one;
- how long pods waited for their address (from their first ADD), median and worst;
- unused reserved addresses: the addresses the node's network containers hold (both subnets,
  primary IPs left out) that no pod holds, once settled;
- where the addresses came from (primary, overflow).

Prints progress on stderr and one JSON report on stdout, with the ratios with/without overflow.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.benchlib import exit_cleanly_on_sigterm, log, machine_facts, percentile, temp_work_dir
from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.daemon import Daemon
from tests.harness.kube_api import CS_API
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_scenario import Scenario, subnet_objects
from tests.harness.process import private_tmp

PRIMARY = "10.90.{run}.0/27"
OVERFLOW = "10.90.{run}.128/25"


@dataclass
class PodOutcome:
    """One pod's way to its address."""

    first_add_seconds: float | None = None  # how long its first ADD took (None: it failed)
    address: str = ""
    waited_seconds: float | None = None  # from its first ADD to its address (None: never)
    attempts: int = 0


@dataclass
class RunResult:
    overflow: bool
    pods: dict[str, PodOutcome] = field(default_factory=dict)
    unused_reserved: int = 0
    reserved: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=60)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--retry", type=float, default=2.0)
    parser.add_argument("--add-timeout", type=float, default=5.0)
    parser.add_argument("--run-seconds", type=float, default=60.0)
    parser.add_argument("--waited-after", type=float, default=1.0)
    parser.add_argument("--settle-seconds", type=float, default=10.0)
    parser.add_argument("--tmp-dir", default=None)
    return parser.parse_args(argv)


def pod_object(node: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
    }


def start_controller(cluster: KubeCluster, workdir: Path, subnet: str) -> subprocess.Popen[bytes]:
    command = controller_command(cluster, subnet=subnet, identity=subnet, lease_seconds=3)
    out = (workdir / f"controller-{subnet}.log").open("ab")
    return subprocess.Popen(command, stdout=out, stderr=out, cwd=REPO, env=private_tmp(workdir))


def lifecycle(
    daemon: Daemon, name: str, outcome: PodOutcome, *, args: argparse.Namespace, end: float
) -> None:
    """A pod's ADDs until it has an address (retried as the kubelet retries a sandbox)."""
    body = {"containerID": name, "ifName": "eth0", "netns": f"/var/run/netns/{name}",
            "podName": name, "podNamespace": "default"}  # fmt: skip
    first = time.monotonic()
    while time.monotonic() < end:
        outcome.attempts += 1
        started = time.monotonic()
        status, reply = daemon.call("POST", "/v1/cni/add", body)
        took = time.monotonic() - started
        if outcome.attempts == 1 and status == 200:
            outcome.first_add_seconds = took
        if status == 200:
            outcome.address = str(reply["ips"][0]["address"]).split("/")[0]
            outcome.waited_seconds = time.monotonic() - first
            return
        time.sleep(args.retry)


def run_once(
    cluster: KubeCluster, workdir: Path, args: argparse.Namespace, *, overflow: bool
) -> RunResult:
    run = 1 if overflow else 0
    primary, spare, node = f"fill-a{run}", f"fill-b{run}", f"fill-n{run}"
    rundir = workdir / f"run{run}"
    rundir.mkdir()
    scenario = Scenario(cluster, rundir, primary, PRIMARY.format(run=run), {"batchSize": 8})
    cluster.create({
        "apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": spare},
        "spec": {"subnet": OVERFLOW.format(run=run),
                 "nodeSelector": {"matchLabels": {"pool": "none"}}},
    })  # fmt: skip
    if overflow:
        cluster.patch(CS_API, "ClusterSubnet", primary, {"spec": {"overflow": [spare]}})
    result = RunResult(overflow)
    controllers = []
    try:
        scenario.add_node(node)
        scenario.start_controller()
        controllers.append(start_controller(cluster, rundir, spare))
        daemon = scenario.start_daemon(node, config={"addTimeoutSeconds": args.add_timeout})
        end = time.monotonic() + args.run_seconds
        threads = []
        for i in range(args.pods):
            name = f"fill{run}-{i}"
            cluster.create(pod_object(node, name))
            outcome = result.pods[name] = PodOutcome()
            thread = threading.Thread(
                target=lifecycle, args=(daemon, name, outcome), kwargs={"args": args, "end": end}
            )
            thread.start()
            threads.append(thread)
            time.sleep(args.interval)
        for thread in threads:
            thread.join()
        log(f"run {'with' if overflow else 'without'} overflow: ADDs done; settling")
        time.sleep(args.settle_seconds)
        view = daemon.pool()
        lanes = [view, *(view.get("subnets") or {}).values()]
        result.reserved = sum(sum(lane["ips"].values()) for lane in lanes)
        assigned = sum(lane["ips"]["Assigned"] for lane in lanes)
        result.unused_reserved = result.reserved - assigned
        addresses = [o.address for o in result.pods.values() if o.address]
        assert len(addresses) == len(set(addresses)), "an address on two pods"
        every = scenario.all_nc_addresses()
        assert len(every) == len(set(every)), "an address in two containers"
        return result
    finally:
        for name in result.pods:
            path = cluster.path_for("v1", "Pod", name, "default")
            cluster.request("DELETE", path, {"gracePeriodSeconds": 0})
        for proc in controllers:
            proc.terminate()
            proc.wait(timeout=15)
        scenario.cleanup()
        cluster.delete(subnet_objects(cluster, spare, []))


def summary(result: RunResult, args: argparse.Namespace) -> dict[str, Any]:
    outcomes = list(result.pods.values())
    waited = [
        o
        for o in outcomes
        if o.first_add_seconds is None or o.first_add_seconds > args.waited_after
    ]
    never = [o for o in outcomes if not o.address]
    waits = sorted(o.waited_seconds for o in outcomes if o.waited_seconds is not None)
    overflow_net = ipaddress.ip_network(OVERFLOW.format(run=int(result.overflow)))
    from_overflow = sum(
        1 for o in outcomes if o.address and ipaddress.ip_address(o.address) in overflow_net
    )
    return {
        "overflow": result.overflow,
        "pods": len(outcomes),
        "podsThatWaited": len(waited),
        "podsNeverServed": len(never),
        "addressesFromOverflow": from_overflow,
        "waitSecondsMedian": round(percentile(waits, 50), 3) if waits else None,
        "waitSecondsMax": round(waits[-1], 3) if waits else None,
        "reservedAddresses": result.reserved,
        "unusedReservedAddresses": result.unused_reserved,
    }


def ratio(with_: float, without: float) -> float | None:
    return round(with_ / without, 3) if without else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir = temp_work_dir("cns-overflow-fill-", args.tmp_dir)
    facts = machine_facts(workdir)
    log("starting kube-apiserver and etcd")
    cluster = KubeCluster.start(workdir_parent=str(workdir))
    try:
        cluster.apply(REPO / "config" / "crd")
        cluster.apply(REPO / "config" / "rbac.yaml")
        runs = [summary(run_once(cluster, workdir, args, overflow=o), args) for o in (False, True)]
    finally:
        cluster.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    without, with_ = runs
    report = {
        "machine": facts,
        "arguments": vars(args),
        "runs": runs,
        "ratios": {
            "podsThatWaited": ratio(with_["podsThatWaited"], without["podsThatWaited"]),
            "podsNeverServed": ratio(with_["podsNeverServed"], without["podsNeverServed"]),
            "unusedReservedAddresses": ratio(
                with_["unusedReservedAddresses"], without["unusedReservedAddresses"]
            ),
        },
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
