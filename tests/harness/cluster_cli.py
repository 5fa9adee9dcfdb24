"""`make cluster-up` / `make cluster-down`: the node of `kube_node`, for a person to use.

    python -m tests.harness.cluster_cli up [--dir DIR] [--subnet CIDR]
    python -m tests.harness.cluster_cli down [--dir DIR]

`up` starts a supervisor in the background (its log: DIR/cluster.log) that runs etcd,
kube-apiserver, kube-scheduler, kube-controller-manager, containerd, a kubelet, `cns controller`
and the `cns` daemon with `cns-cni`, then prints how to reach it. `down` asks the supervisor to
stop, which removes every pod, stops every process and puts the host back (`KubeNode.stop`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.harness import REPO
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_node import KubeNode

DEFAULT_DIR = Path("/var/tmp/cns-cluster")


def serve(workdir: Path, subnet: str) -> int:
    """Run the cluster until SIGTERM/SIGINT; DIR/ready says how to reach it meanwhile."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    shutil.rmtree(workdir / "node", ignore_errors=True)  # the last run's logs and state
    kube = KubeCluster.start(workdir_parent=str(workdir))
    try:
        node = KubeNode.start(kube, workdir / "node", subnet_cidr=subnet)
        try:
            shutil.copy(kube.kubeconfig, workdir / "kubeconfig")
            assert node.daemon is not None
            info = {
                "kubeconfig": str(workdir / "kubeconfig"),
                "kubectl": str(kube.bin_dir / "kubectl"),
                "node": node.name,
                "subnet": subnet,
                "cnsDebug": node.daemon.debug_url,
                "cnsSocket": str(node.daemon.socket),
                "logs": str(workdir / "node"),
            }
            (workdir / "ready").write_text(json.dumps(info, indent=2) + "\n")
            stop.wait()
        finally:
            (workdir / "ready").unlink(missing_ok=True)
            node.stop()
    finally:
        kube.stop()
    return 0


def up(workdir: Path, subnet: str, timeout: float) -> int:
    pid_file = workdir / "supervisor.pid"
    if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
        print(f"a cluster is already running from {workdir}: `make cluster-down` first")
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "ready").unlink(missing_ok=True)
    with (workdir / "cluster.log").open("ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.cluster_cli", "serve", "--dir", str(workdir),
             "--subnet", subnet],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=REPO,
        )  # fmt: skip
    pid_file.write_text(f"{supervisor.pid}\n")
    deadline = time.monotonic() + timeout
    while not (workdir / "ready").exists():
        if supervisor.poll() is not None or time.monotonic() > deadline:
            print(f"the cluster did not come up; see {workdir / 'cluster.log'}")
            if supervisor.poll() is None:
                supervisor.terminate()
            return 1
        time.sleep(0.5)
    info = json.loads((workdir / "ready").read_text())
    print(f"cluster up (node {info['node']}, pod subnet {info['subnet']}):")
    print(f"  export KUBECONFIG={info['kubeconfig']}; alias kubectl={info['kubectl']}")
    print(f"  cns debug endpoint: {info['cnsDebug']}/debug/ips")
    print(f"  logs: {info['logs']}; stop with `make cluster-down`")
    return 0


def down(workdir: Path, timeout: float) -> int:
    pid_file = workdir / "supervisor.pid"
    if not pid_file.exists():
        print(f"no cluster running from {workdir}")
        return 0
    pid = int(pid_file.read_text().strip())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink()
        print("the supervisor had already exited")
        return 0
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            print(f"the supervisor {pid} did not stop in {timeout:g} s; see cluster.log")
            return 1
        time.sleep(0.5)
    pid_file.unlink()
    print("cluster down")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.cluster_cli", description=__doc__
    )
    parser.add_argument("command", choices=("up", "down", "serve"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state and logs")
    parser.add_argument("--subnet", default="10.250.0.0/24", help="the pod subnet")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.dir, args.subnet)
    if args.command == "up":
        return up(args.dir, args.subnet, args.timeout)
    return down(args.dir, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
