"""The test harness: real processes, runtimes and clusters for the tests and the benchmarks.

One module per job, each usable on its own (the bench scripts import them too):

- `ports`: free loopback ports.
- `process`: child processes that die with the test, their logs, their private temp dir.
- `daemon`: a `cns run` daemon in a subprocess, and requests over its unix socket.
- `requirements`: what a test needs from the machine (fail under CI, skip elsewhere).
- `host`: host inspection and clean-up (mounts, processes, netns, cgroups, links, ping).
- `podman`, `containerd`, `cri`: real container runtimes and a CRI client.
- `bridge`: the reference `bridge` plugin with `cns-ipam`, a network namespace per pod.
- `kube_api`: a REST client of the Kubernetes API (requests, watches, discovery, apply);
  `async_kube`: an asyncio one, for load generators.
- `kube_cluster`: etcd + kube-apiserver on loopback; `kube_node`: a whole node next to it;
  `kube_scenario`: a ClusterSubnet with nodes, `cns controller` and daemons.
- `controller`: the `cns controller` command line.
- `fleet`: simulated daemons and controller chaos; `scale_fleet`: thousands of simulated
  daemons in one asyncio process, timed on one NNC watch; `ledger`: what clients of a killed
  daemon were told.
- `audit`: an apiserver writing an audit log, requests per user counted from it; `proc_stats`:
  a process's CPU and memory from /proc.
- `nspawn`: a booted systemd container; `systemd_node`: cns installed on it, its pods;
  `cluster_cli`: `make cluster-up`/`cluster-down`.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


class HarnessError(Exception):
    """A run cannot go on: a process did not start, answer or stop, or its results are invalid.

    A test fails with it; the bench scripts know it as `benchlib.BenchError`, print it and exit
    non-zero.
    """
