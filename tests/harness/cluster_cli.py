"""`make cluster-up` / `make cluster-down`: the node of `kube_node`, for a person to use.

    python -m tests.harness.cluster_cli up [--dir DIR] [--subnet CIDR]
    python -m tests.harness.cluster_cli down [--dir DIR]

`up` starts a supervisor in the background (its log: DIR/cluster.log) that runs etcd,
kube-apiserver, kube-scheduler, kube-controller-manager, containerd, a kubelet, `cns controller`
and the `cns` daemon with `cns-cni`, then prints how to reach it. While it runs, DIR/env is a
shell snippet to `source` (KUBECONFIG, CNS_DEBUG_URL for `cns status`, kubectl on PATH). `down`
asks the supervisor to stop, which removes every pod, stops every process and puts the host back
(`KubeNode.stop`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cns.commands.cli import DEBUG_URL_ENV
from tests.harness import REPO
from tests.harness.kube_api import MERGE_PATCH
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
            publish_node_address(kube, node.name)
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
            (workdir / "env").write_text(shell_env(info))
            (workdir / "ready").write_text(json.dumps(info, indent=2) + "\n")
            stop.wait()
        finally:
            (workdir / "ready").unlink(missing_ok=True)
            (workdir / "env").unlink(missing_ok=True)
            node.stop()
    finally:
        kube.stop()
    return 0


def publish_node_address(kube: KubeCluster, node: str) -> None:
    """Give the Node the address its kubelet serves on, 127.0.0.1, as its InternalIP.

    kubelet 1.20 refuses a loopback `--node-ip` ("nodeIP can't be loopback address", in its log
    every status update) and then publishes no address at all: `kubectl get nodes -o wide` shows
    INTERNAL-IP <none> and the API server has nowhere to dial for `kubectl exec` and `logs`. Since
    that refusal happens before it touches the addresses, its status updates leave this one in
    place. InternalIP only: given a Hostname address the API server would dial the node's name,
    which does not resolve.
    """
    address = {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}
    path = f"/api/v1/nodes/{node}/status"
    kube.request("PATCH", path, {"status": address}, MERGE_PATCH).raise_for_status()


def shell_env(info: dict[str, str]) -> str:
    """DIR/env: what a shell needs for `kubectl` and `cns status` to reach this cluster."""
    kubectl_dir = str(Path(info["kubectl"]).parent)
    return (
        f"export KUBECONFIG={shlex.quote(info['kubeconfig'])}\n"
        f"export {DEBUG_URL_ENV}={shlex.quote(info['cnsDebug'])}\n"
        f'export PATH={shlex.quote(kubectl_dir)}:"$PATH"\n'
    )


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
    cns = Path(sys.executable).parent / "cns"
    print(f"cluster up (node {info['node']}, pod subnet {info['subnet']}); in your shell:")
    print(f"  source {workdir / 'env'}   # KUBECONFIG, {DEBUG_URL_ENV}, kubectl on PATH")
    print(f"  kubectl get nodes -o wide; {cns} status")
    print(f"  (or: {cns} status --debug-url {info['cnsDebug']})")
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
