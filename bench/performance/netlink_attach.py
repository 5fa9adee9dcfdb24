"""The daemon's share of a `cns-cni` ADD/DEL: `cns.host.datapath.attach`/`detach` in-process (root).

Each round makes a scratch namespace, attaches a pod interface into it, detaches it and removes
the namespace; only the attach and the detach are timed, and the attach's rtnetlink requests
counted.

    .venv/bin/python -m bench.performance.netlink_attach --rounds 30
    .venv/bin/python -m bench.performance.netlink_attach --rounds 200 --pair  # IPv4 vs dual-stack

`--pair` runs an IPv4-only, a dual-stack and an IPv6-only attach in every round, each first in
turn, and prints the ratio to the round's IPv4 attach (the machine's drift cancels out). The
host side of the attach happens in this process's namespace: run it under `ip netns exec` in a
scratch namespace to leave the machine's routing table alone (docs/benchmarks.md, "Pod interface
attach, per address family").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from cns.host import datapath, rtnl

IPV4 = ["10.255.0.2"]
DUAL = ["10.255.0.2", "fd00:255::2"]
IPV6 = ["fd00:255::2"]


class Counted(rtnl.Rtnl):
    """An Rtnl that counts its requests (the class attribute is shared by every socket)."""

    requests = 0

    def request(self, kind: int, body: bytes, flags: int = 0) -> bytes:
        Counted.requests += 1
        return super().request(kind, body, flags)


def attach_once(i: int, addresses: list[str]) -> tuple[float, float, int]:
    """One namespace, one attach and one detach: their milliseconds and the attach's requests."""
    netns = f"cns-bench-attach-{i}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        Counted.requests = 0
        started = time.perf_counter()
        datapath.attach(f"/var/run/netns/{netns}", "eth0", f"bench{i}", addresses, 1500)
        attach_ms = (time.perf_counter() - started) * 1000
        requests = Counted.requests
        started = time.perf_counter()
        datapath.detach(f"bench{i}", "eth0")
        return attach_ms, (time.perf_counter() - started) * 1000, requests
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=True)


def summary(name: str, values: list[float], unit: str = " ms") -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{name}: median {median:.2f}{unit}, min {low:.2f}{unit}, max {high:.2f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--pair", action="store_true", help="IPv4-only vs dual-stack, paired")
    args = parser.parse_args()
    rtnl.Rtnl = Counted  # type: ignore[misc]  # the class netlink builds its sockets from
    variants = {"ipv4": IPV4, "dual": DUAL, "ipv6": IPV6} if args.pair else {"ipv4": IPV4}
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    for i in range(args.rounds):
        names = list(variants)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each first in turn
            runs[name].append(attach_once(i, variants[name]))
    for name, results in runs.items():
        attach_ms, detach_ms, requests = (list(column) for column in zip(*results, strict=True))
        print(f"{name} ({len(results)} rounds, {requests[0]} requests per attach)")
        print("  " + summary("attach", attach_ms))
        print("  " + summary("detach", detach_ms))
    if args.pair:
        for other in ("dual", "ipv6"):
            pairs = zip(runs["ipv4"], runs[other], strict=True)
            ratios = [b[0] / a[0] for a, b in pairs]
            print(summary(f"{other}/ipv4 attach ratio per round", ratios, unit=""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
