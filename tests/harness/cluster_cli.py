"""`make cluster-up` / `make cluster-down`: the node of `kube_node`, or the nodes of
`multinode` (`--nodes N`, N > 1), for a person to use.

    python -m tests.harness.cluster_cli up [--dir DIR] [--subnet CIDR]
    python -m tests.harness.cluster_cli up --nodes 3 [--plugin ptp-cns-ipam] [--no-flat-network]
                                           [--dual-stack]
    python -m tests.harness.cluster_cli down [--dir DIR] [--keep-logs]

`up` starts a supervisor in the background (its log: DIR/cluster.log) that runs etcd,
kube-apiserver, kube-scheduler, kube-controller-manager, containerd, a kubelet, `cns controller`
and the `cns` daemon with `cns-cni`, then prints how to reach it. While it runs, DIR/env is a
shell snippet to `source` (KUBECONFIG, CNS_DEBUG_URL for `cns status`, kubectl on PATH). `down`
asks the supervisor to stop, which removes every pod, stops every process and puts the host back
(`KubeNode.stop`, `MultiNodeCluster.stop`), then removes what `up` made in DIR (`--keep-logs`: all
but the logs) and DIR once empty. With `--nodes N` the supervisor first builds the cns
image (`make image`) and installs it as an operator would (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any

from cns.commands.cli import DEBUG_URL_ENV
from tests.harness import REPO
from tests.harness.install_node import build_image
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_node import KubeNode, publish_node_address
from tests.harness.multinode import LAN, PLUGIN_SETUPS, MultiNodeCluster

DEFAULT_DIR = Path("/var/tmp/cns-cluster")
# What `up` and its supervisor make in DIR: `down` removes exactly these (DIR may be the user's).
MADE = ("supervisor.pid", "cluster.log", "env", "ready", "kubeconfig", "images", "overlay",
        "this-node", "node", "node[0-9]*", "cns-kube-*", "kube-scheduler.log",
        "kube-controller-manager.log")  # fmt: skip
LOGS = ("cluster.log", "node", "node[0-9]*", "cns-kube-*", "kube-scheduler.log",
        "kube-controller-manager.log")  # fmt: skip


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


def serve_nodes(
    workdir: Path, nodes: int, plugin: str, *, flat_network: bool, dual_stack: bool
) -> int:
    """`serve` for `nodes` nodes (`multinode`)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    for old in workdir.glob("node*"):  # the last run's logs and state
        shutil.rmtree(old, ignore_errors=True)
    began = time.monotonic()
    print("cluster: make image ...", flush=True)
    archive = workdir / "images" / "cns.tar"
    archive.parent.mkdir(parents=True, exist_ok=True)
    tag = build_image(archive)
    image_seconds = time.monotonic() - began
    cluster = MultiNodeCluster.start(
        workdir,
        nodes=nodes,
        image=(tag, archive),
        plugin=plugin,
        flat_network=flat_network,
        dual_stack=dual_stack,
    )
    try:
        shutil.copy(cluster.kubeconfig, workdir / "kubeconfig")
        timings = {"make image": image_seconds, **cluster.timings}
        info = {
            "kubeconfig": str(workdir / "kubeconfig"),
            "kubectl": str(cluster.bin_dir / "kubectl"),
            "nodes": {node.name: {"address": ",".join(node.addresses),
                                  "holderPid": node.host.pid, "logs": str(node.directory)}
                      for node in cluster.nodes},
            "subnet": ",".join(str(subnet) for subnet in cluster.subnets.values()),
            "plugin": plugin,
            "flatNetwork": flat_network,
            "seconds": {name: round(value, 1) for name, value in timings.items()},
            "logs": str(workdir),
        }  # fmt: skip
        (workdir / "env").write_text(shell_env(info))
        (workdir / "ready").write_text(json.dumps(info, indent=2) + "\n")
        print(f"cluster: up in {time.monotonic() - began:.1f} s: {info['seconds']}", flush=True)
        stop.wait()
    finally:
        (workdir / "ready").unlink(missing_ok=True)
        (workdir / "env").unlink(missing_ok=True)
        cluster.stop()
    return 0


def shell_env(info: dict[str, Any]) -> str:
    """DIR/env: what a shell needs for `kubectl` and `cns status` to reach this cluster."""
    kubectl_dir = str(Path(info["kubectl"]).parent)
    debug = info.get("cnsDebug")
    lines = [f"export KUBECONFIG={shlex.quote(info['kubeconfig'])}"]
    lines += [f"export {DEBUG_URL_ENV}={shlex.quote(debug)}"] if debug else []
    lines += [f'export PATH={shlex.quote(kubectl_dir)}:"$PATH"']
    return "".join(f"{line}\n" for line in lines)


def up(workdir: Path, serve_args: list[str], timeout: float) -> int:
    pid_file = workdir / "supervisor.pid"
    if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
        print(f"a cluster is already running from {workdir}: `make cluster-down` first")
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "ready").unlink(missing_ok=True)
    with (workdir / "cluster.log").open("ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.cluster_cli", "serve", "--dir", str(workdir),
             *serve_args],
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
    if "nodes" in info:
        print_nodes(workdir, info)
        return 0
    cns = Path(sys.executable).parent / "cns"
    print(f"cluster up (node {info['node']}, pod subnet {info['subnet']}); in your shell:")
    print(f"  source {workdir / 'env'}   # KUBECONFIG, {DEBUG_URL_ENV}, kubectl on PATH")
    print(f"  kubectl get nodes -o wide; {cns} status")
    print(f"  (or: {cns} status --debug-url {info['cnsDebug']})")
    print(f"  logs: {info['logs']}; stop with `make cluster-down`")
    return 0


def print_nodes(workdir: Path, info: dict[str, Any]) -> None:
    nodes = ", ".join(f"{name} {node['address']}" for name, node in info["nodes"].items())
    print(
        f"cluster up: {nodes} on bridge {LAN}; pod subnet {info['subnet']} ({info['plugin']}"
        f"{', flat network' if info['flatNetwork'] else ''}); seconds: {info['seconds']}"
    )
    print(f"in your shell:\n  source {workdir / 'env'}   # KUBECONFIG, kubectl on PATH")
    print("  kubectl get nodes -o wide; kubectl -n kube-system get pods -o wide")
    print("  kubectl -n kube-system exec ds/cns -- cns status   # (the DaemonSet pod of one node)")
    name, node = next(iter(info["nodes"].items()))
    print(f"  nsenter -t {node['holderPid']} -n -m -- ip addr   # a shell command on {name}")
    print(f"  logs: {info['logs']}/<node>; stop with `make cluster-down`")


def down(workdir: Path, timeout: float, *, keep_logs: bool = False) -> int:
    """Stop the supervisor, then remove what `up` made in `workdir` (the logs too, unless
    `keep_logs`), and `workdir` itself once empty."""
    pid_file = workdir / "supervisor.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists():
            if time.monotonic() > deadline:
                print(f"the supervisor {pid} did not stop in {timeout:g} s; see cluster.log")
                return 1
            time.sleep(0.5)
        print("cluster down")
    else:
        print(f"no cluster running from {workdir}")
    kept = {path for name in LOGS for path in workdir.glob(name)} if keep_logs else set()
    for path in {path for name in MADE for path in workdir.glob(name)} - kept:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if kept:
        print(f"logs kept in {workdir}")
    with contextlib.suppress(OSError):
        workdir.rmdir()  # only if nothing else is there
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.cluster_cli", description=__doc__
    )
    parser.add_argument("command", choices=("up", "down", "serve"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state and logs")
    parser.add_argument("--subnet", default="10.250.0.0/24", help="the pod subnet")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (more than 1: multinode)")
    parser.add_argument("--plugin", choices=PLUGIN_SETUPS, default="cns-cni",
                        help="the nodes' CNI set-up (with --nodes N)")  # fmt: skip
    parser.add_argument("--flat-network", action=argparse.BooleanOptionalAction, default=True,
                        help="flat-network mode (with --nodes N; default on)")  # fmt: skip
    parser.add_argument("--dual-stack", action="store_true",
                        help="IPv4 and IPv6 (with --nodes N and cns-cni)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None, help="for `up`: seconds")
    parser.add_argument("--keep-logs", action="store_true",
                        help="for `down`: keep DIR's logs (the image and state go)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes: at least 1")
    if args.command == "serve":
        if args.nodes > 1:
            return serve_nodes(
                args.dir,
                args.nodes,
                args.plugin,
                flat_network=args.flat_network,
                dual_stack=args.dual_stack,
            )
        return serve(args.dir, args.subnet)
    if args.command == "up":
        serve_args = ["--subnet", args.subnet]
        if args.nodes > 1:
            serve_args = ["--nodes", str(args.nodes), "--plugin", args.plugin]
            serve_args += ["--flat-network" if args.flat_network else "--no-flat-network"]
            serve_args += ["--dual-stack"] if args.dual_stack else []
        timeout = args.timeout or (300 if args.nodes == 1 else 900)
        return up(args.dir, serve_args, timeout)
    return down(args.dir, args.timeout or 300, keep_logs=args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
