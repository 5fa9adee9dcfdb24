"""Machine instructions the daemon executes per durable ADD+DEL pair, counted by valgrind.

Wall-clock pairs/s on a shared 2-core VM move by 10-20 % between runs; instructions do not (two
runs of one tree agree within 0.1 %), so this is how two trees' request paths are compared when
the machine is not quiet. The daemon (`cns run`, the throughput bench's configuration: standalone,
pool pre-warmed, cooldown 0) runs under `valgrind --tool=callgrind`; clients make durable ADD+DEL
pairs through the unix socket, one connection per request as the plugin does; callgrind's totals
(every thread: interpreter, aiohttp, SQLite) are read after SIGTERM. Each tree runs twice, with
`--pairs` and with ten times as many: the difference divided by the extra pairs cancels start-up
and shutdown.

    python -m bench.performance.instructions_per_pair --code /tmp/base --code . [--clients 1]

`--code` is a source tree (e.g. `git archive REV | tar -x -C /tmp/base`): its daemon runs from it
through the `cns` entry point its pyproject.toml names. With many clients, how many requests
share a commit depends on timing under valgrind, so that figure is less exact. Needs valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from bench.benchlib import Daemon, durable_temp_parent, log
from bench.performance.daemon_throughput import CloseTransport

# Runs the tree's `cns` entry point as `cns run ...`: the harness starts the daemon as
# `python <wrap> -m cns.commands.cli run ...`, and `-c` turns the rest into sys.argv[1:].
LAUNCHER = """
import importlib, sys
sys.path.insert(0, {tree!r})
module, _, function = {entry!r}.partition(":")
sys.argv = ["cns", *sys.argv[3:]]
sys.exit(getattr(importlib.import_module(module), function)())
"""


def entry_point(tree: Path) -> str:
    scripts = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]
    entry: str = scripts["cns"]
    return entry


def _knows_key(tree: Path, key: str) -> bool:
    return any(key in path.read_text() for path in (tree / "cns").rglob("*.py"))


async def _pairs(socket: str, clients: int, count: int, tag: str) -> None:
    async def client(index: int) -> None:
        transport = CloseTransport(socket)
        for number in range(count):
            container = f"{tag}-{index}-{number}"
            status, body = await transport.call(
                "/v1/cni/add",
                {
                    "containerID": container,
                    "ifName": "eth0",
                    "netns": f"/var/run/netns/{container}",
                    "podName": container,
                    "podNamespace": "bench",
                },
            )
            assert status == 200, body
            status, body = await transport.call(
                "/v1/cni/del", {"containerID": container, "ifName": "eth0"}
            )
            assert status == 200, body

    await asyncio.gather(*(client(index) for index in range(clients)))


def instructions(tree: Path, *, clients: int, pairs_per_client: int) -> int:
    """Callgrind's instruction total of one daemon run that served `clients * pairs_per_client`
    pairs after three warm-up pairs per client."""
    workdir = Path(tempfile.mkdtemp(prefix="cns-instructions-", dir=durable_temp_parent(None)))
    out = workdir / "callgrind.out"
    batch = max(64, 4 * clients)
    config: dict[str, Any] = {
        "logLevel": "warning",
        "scaler": {"batchSize": batch, "maxIPCount": max(1000, 4 * batch)},
        "standalone": {"subnet": "10.242.0.0/16", "allocationLatencyMs": 0},
    }
    if _knows_key(tree, "ipCooldownSeconds"):  # trees before the reuse cooldown reject the key
        config["ipCooldownSeconds"] = 0
    daemon = Daemon(
        workdir,
        config,
        wrap=["-c", LAUNCHER.format(tree=str(tree.resolve()), entry=entry_point(tree))],
    )
    try:
        daemon.start(
            timeout=600,
            prefix=[
                "valgrind",
                "--tool=callgrind",
                "--vgdb=no",
                f"--callgrind-out-file={out}.%p",
                "--dump-line=no",
            ],
        )
        daemon.wait_pool(
            lambda pool: pool["ips"]["Available"] >= clients and pool["waitingAdds"] == 0,
            "a warm pool",
            timeout=300,
        )
        asyncio.run(_pairs(str(daemon.socket), clients, 3, "warm"))
        asyncio.run(_pairs(str(daemon.socket), clients, pairs_per_client, "pair"))
        assert daemon.stop() == 0, "the daemon did not stop cleanly"
        total = 0
        for dump in workdir.glob("callgrind.out.*"):
            for line in dump.read_text().splitlines():
                if line.startswith("summary:"):
                    total += int(line.split()[1])
        return total
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, action="append", required=True, help="source tree")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=20, help="pairs of the short run")
    args = parser.parse_args()
    results = {}
    short = max(1, args.pairs // args.clients)
    for tree in args.code:
        log(f"{tree}: {short * args.clients} and {10 * short * args.clients} pairs under callgrind")
        low = instructions(tree, clients=args.clients, pairs_per_client=short)
        high = instructions(tree, clients=args.clients, pairs_per_client=10 * short)
        results[str(tree)] = round((high - low) / (9 * short * args.clients))
    first = results[str(args.code[0])]
    print(json.dumps({"clients": args.clients, "instructionsPerPair": results}, indent=2))
    for tree, value in results.items():
        print(f"{tree}: {value:,} instructions per pair, {value / first:.3f}x of the first tree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
