"""The daemon's share of a `cns-cni` ADD/DEL: `cns.netlink.attach`/`detach` in-process (root).

Each round makes a scratch namespace, attaches a pod interface into it, detaches it and removes
the namespace; only the attach and the detach are timed.

    .venv/bin/python bench/netlink_attach.py --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cns import netlink


def measure(rounds: int) -> tuple[list[float], list[float]]:
    attach_ms: list[float] = []
    detach_ms: list[float] = []
    for i in range(rounds):
        netns = f"cns-bench-attach-{i}"
        subprocess.run(["ip", "netns", "add", netns], check=True)
        try:
            started = time.perf_counter()
            netlink.attach(f"/var/run/netns/{netns}", "eth0", f"bench{i}", "10.255.0.2", 1500)
            attach_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            netlink.detach(f"bench{i}", "eth0")
            detach_ms.append((time.perf_counter() - started) * 1000)
        finally:
            subprocess.run(["ip", "netns", "del", netns], check=True)
    return attach_ms, detach_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    attach_ms, detach_ms = measure(args.rounds)
    for name, values in (("attach", attach_ms), ("detach", detach_ms)):
        median, low, high = statistics.median(values), min(values), max(values)
        print(f"{name}: median {median:.2f} ms, min {low:.2f} ms, max {high:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
