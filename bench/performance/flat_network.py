"""The flat-network mode's costs (root): what it adds to an ADD, and how soon a pod address that
moved to another node answers there, with and without the announcement.

    .venv/bin/python -m bench.performance.flat_network --rounds 100

Three node namespaces on one bridge (tests/harness/flat_lan.py): node 1 runs cns with the mode
on, node 2 with it off, node 3 only watches. Each round ADDs and DELs one dual-stack pod on each of
nodes 1 and 2 through the daemon's API (`POST /v1/cni/attach`, as `cns-cni` sends it), in turn
first; the ADD's latency is compared round by round (the machine's drift cancels out).

Then the move: node 3 pings a pod's IPv4 address on node A (its neighbour cache holds A's MAC),
the pod is DELeted on A and ADDed with the same address on node B, and A's uplink goes down (a
node that left); node 3 pings every 10 ms and the time to the first reply is reported. Once with
B announcing (its daemon holds CAP_NET_RAW), once without (B's daemon started without it): node
3 then finds B only once its stale entry for A fails (reachable time, 5 s delay, 3 probes).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tests.harness.daemon import Daemon
from tests.harness.flat_lan import FlatLan, LanNode, wait_served

SUBNETS = ("10.123.0.64/26", "fd00:123::40/122")
PING_INTERVAL = 0.01


def config(*, enabled: bool) -> dict[str, Any]:
    return {
        "flatNetwork": {"enabled": enabled},
        "ipCooldownSeconds": 0,
        "standalone": {
            "subnet": SUBNETS[0],
            "allocationLatencyMs": 0,
            "subnets": [{"name": "v6", "subnet": SUBNETS[1]}],
        },
    }


def add(daemon: Daemon, netns: str, container: str, requested: str = "") -> tuple[float, str]:
    """One ADD through the API; its milliseconds and the pod's IPv4 address."""
    body = {"containerID": container, "ifName": "eth0", "netns": netns,
            "subnets": ["standalone", "v6"], "requestedIP": requested}  # fmt: skip
    started = time.perf_counter()
    status, reply = daemon.call("POST", "/v1/cni/attach", body)
    elapsed = (time.perf_counter() - started) * 1000
    assert status == 200, reply
    return elapsed, reply["ips"][0]["address"].split("/")[0]


def delete(daemon: Daemon, container: str) -> None:
    status, reply = daemon.call(
        "POST", "/v1/cni/detach", {"containerID": container, "ifName": "eth0"}
    )
    assert status == 200, reply


def add_cost(
    lan: FlatLan, on: LanNode, off: LanNode, rounds: int
) -> tuple[list[float], list[float]]:
    """Per round, the mode-on and the mode-off ADD's milliseconds."""
    assert on.daemon is not None and off.daemon is not None
    netns = {node.netns: lan.pod(node, "p") for node in (on, off)}
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(rounds):
        took = {}
        for node in (on, off) if i % 2 else (off, on):
            assert node.daemon is not None
            took[node.netns] = add(node.daemon, netns[node.netns], f"r{i}")[0]
            delete(node.daemon, f"r{i}")
        times[0].append(took[on.netns])
        times[1].append(took[off.netns])
    return times


def first_reply_seconds(watcher: LanNode, address: str) -> float:
    """Ping `address` every 10 ms for up to 90 s; seconds to the first reply."""
    done = watcher.run("ping", "-n", "-i", str(PING_INTERVAL), "-c", "9000", "-w", "90", "-W", "1",
                       address)  # fmt: skip
    sequences = [int(s) for s in re.findall(r"icmp_seq=(\d+) ttl", done.stdout)]
    return (min(sequences) - 1) * PING_INTERVAL if sequences else float("inf")


def move(lan: FlatLan, a: LanNode, b: LanNode, watcher: LanNode, tag: str) -> float:
    assert a.daemon is not None and b.daemon is not None
    pod_a, pod_b = lan.pod(a, f"m{tag}"), lan.pod(b, f"n{tag}")
    _, address = add(a.daemon, pod_a, f"m{tag}")
    assert watcher.run("ping", "-c1", "-W3", address).returncode == 0
    assert watcher.neighbour_mac(address) == a.mac
    delete(a.daemon, f"m{tag}")
    add(b.daemon, pod_b, f"n{tag}", requested=address)
    a.run("ip", "link", "set", "dev", "lan0", "down")  # node A has left the LAN
    try:
        return first_reply_seconds(watcher, address)
    finally:
        a.run("ip", "link", "set", "dev", "lan0", "up")
        delete(b.daemon, f"n{tag}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cns-bench-flat-"))
    lan = FlatLan(f"fb{uuid.uuid4().hex[:6]}")
    try:
        n1 = lan.node("n1", "10.123.0.11", "fd00:123::11")
        n2 = lan.node("n2", "10.123.0.12", "fd00:123::12")
        n3 = lan.node("n3", "10.123.0.13", "fd00:123::13")
        lan.daemon(n1, workdir / "n1", config(enabled=True))
        lan.daemon(n2, workdir / "n2", config(enabled=False))
        on, off = add_cost(lan, n1, n2, args.rounds)
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        print(
            f"ADD through the API, median {statistics.median(on):.2f} ms with the mode on, "
            f"{statistics.median(off):.2f} ms off; on / off per round, {args.rounds} rounds: "
            "median "
            f"{statistics.median(ratios):.2f}x (p10 {sorted(ratios)[len(ratios) // 10]:.2f}x, "
            f"p90 {sorted(ratios)[len(ratios) * 9 // 10]:.2f}x)"
        )
        assert n2.daemon is not None
        n2.daemon.stop()  # node 2 now in the mode too, first announcing, then without CAP_NET_RAW
        shutil.rmtree(workdir / "n2")
        lan.daemon(n2, workdir / "n2", config(enabled=True))
        announced = move(lan, n1, n2, n3, "a")
        print(f"address moved, announced: first reply after {announced:.2f} s")
        n2.daemon.stop()
        n2.daemon.start(wait=False, prefix=["setpriv", "--bounding-set=-net_raw", "ip", "netns",
                                            "exec", n2.netns])  # fmt: skip
        wait_served(n2.daemon)
        silent = move(lan, n1, n2, n3, "b")
        print(f"address moved, not announced (no CAP_NET_RAW): first reply after {silent:.2f} s")
    finally:
        lan.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
