"""Two `cns controller` replicas at cluster scale on a real kube-apiserver: are addresses ever
granted to two nodes?

A field test of docs/design/controller-safety.md: 1,000 nodes, a /12 ClusterSubnet, a 3 s lease.
A fleet of simulated daemons writes NNC specs as real daemons do (tests/harness/fleet.py), a watch
checks the whole subnet after every NNC event, and optionally a chaos loop freezes the leader with
SIGSTOP for longer than the lease. The controllers run from `--code` (a checkout), so the same
command measures an older commit:

    git worktree add /tmp/cns-old <commit>
    .venv/bin/python -m bench.stress.controller_chaos --code /tmp/cns-old --label old
    .venv/bin/python -m bench.stress.controller_chaos --label new

Prints one JSON object: duplicates seen (distinct addresses, and events showing one), lease
transitions, NNC events checked, how many nodes were fulfilled at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.harness import REPO
from tests.harness.controller import controller_command
from tests.harness.fleet import DuplicateWatch, Fleet, addresses, chaos
from tests.harness.kube_api import CS_API, KUBE_SYSTEM, LEASE_API, NNC_API
from tests.harness.kube_cluster import KubeCluster, binaries
from tests.harness.process import private_tmp


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cidr", default="10.0.0.0/12")
    parser.add_argument("--lease", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--chaos", action="store_true", help="freeze the leader with SIGSTOP")
    parser.add_argument("--code", default=str(REPO), help="checkout the controllers run from")
    parser.add_argument("--faults", default="", help="CNS_FAULTS for the controllers")
    parser.add_argument("--label", default="")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true", help="keep the controllers' logs")
    parser.add_argument(
        "--settle", type=float, default=300, help="after the churn, seconds to fulfil every node"
    )
    args = parser.parse_args()
    bin_dir = binaries()
    if bin_dir is None:
        print("kube-apiserver/etcd missing: run scripts/build-kubernetes.sh", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="cns-chaos-"))
    cluster = KubeCluster.start(bin_dir)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cluster.apply(REPO / "config" / "crd")
        cluster.apply(REPO / "config" / "rbac.yaml")
        subnet = "chaos"
        cluster.create(
            {
                "apiVersion": CS_API,
                "kind": "ClusterSubnet",
                "metadata": {"name": subnet},
                "spec": {"subnet": args.cidr},
            }
        )
        names = [f"node-{i:05d}" for i in range(args.nodes)]
        log(f"creating {len(names)} Node objects")
        with ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda n: cluster.create(
                        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}
                    ),
                    names,
                )
            )
        env = {**private_tmp(workdir), "CNS_FAULTS": args.faults}
        for index in range(2):
            command = controller_command(
                cluster, subnet=subnet, identity=f"replica-{index}", lease_seconds=args.lease
            )
            with (workdir / f"controller{index}.log").open("ab") as out:
                procs.append(
                    subprocess.Popen(command, stdout=out, stderr=out, cwd=args.code, env=env)
                )
        log("waiting for an NNC per node")
        cluster.wait_for(
            lambda: (
                len(cluster.get(NNC_API, "NodeNetworkConfig", namespace=KUBE_SYSTEM)["items"])
                == len(names)
            ),
            timeout=600,
            interval=2,
            what="every NNC",
        )
        checker = DuplicateWatch(cluster)
        checker.start()
        fleet = Fleet(cluster, names, seed=args.seed)
        fleet.start()
        log(f"churn for {args.seconds:g} s" + (" with chaos" if args.chaos else ""))
        started = time.monotonic()
        freezes = 0
        if args.chaos:
            freezes = chaos(cluster, f"cns-controller-{subnet}", procs, started + args.seconds)
        else:
            time.sleep(args.seconds)
        fleet.stop.set()
        fleet.join()
        held_after_churn = sum(len(a) for a in checker.held.values())
        log(f"settling: every node asks for 31 (up to {args.settle:g} s)")
        settled = fleet.settle(request=31, timeout=args.settle)
        time.sleep(max(10, 3 * args.lease))  # in-flight writes land; rounds catch up
        checker.stop.set()
        checker.join(timeout=30)
        lease = cluster.get(LEASE_API, "Lease", f"cns-controller-{subnet}", KUBE_SYSTEM)
        final: dict[str, list[str]] = {}
        for nnc in cluster.get(NNC_API, "NodeNetworkConfig", namespace=KUBE_SYSTEM)["items"]:
            final[nnc["metadata"]["name"]] = addresses(nnc)
        owners: dict[str, int] = {}
        for held in final.values():
            for address in held:
                owners[address] = owners.get(address, 0) + 1
        report = {
            "label": args.label,
            "nodes": args.nodes,
            "cidr": args.cidr,
            "leaseSeconds": args.lease,
            "churnSeconds": args.seconds,
            "chaos": args.chaos,
            "freezes": freezes,
            "faults": args.faults,
            "nncEventsChecked": checker.events,
            "fleetWrites": fleet.writes,
            "leaseTransitions": lease["spec"].get("leaseTransitions", 0),
            "addressesHeldAfterChurn": held_after_churn,
            "settleSeconds": None if settled is None else round(settled, 1),
            "unfulfilledNodesAtEnd": len(fleet.unfulfilled(31)),
            "duplicateAddressesSeen": len({d.split(" ")[0] for d in checker.duplicates}),
            "eventsShowingADuplicate": len(checker.duplicates),
            "duplicateAddressesAtEnd": sum(1 for count in owners.values() if count > 1),
        }
        if args.keep_logs:
            report["controllerLogs"] = str(workdir)
        print(json.dumps(report, indent=1))
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        cluster.stop()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
