"""How long a Deployment's pods wait when the node the scheduler prefers is full, with the IP
pressure taint (config `ipPressure`) and without, on the same scenario of a real three-node
cluster (tests/harness/pressure_scenario.py): node A's pool at maxIPCount with 3 pods, a
Deployment of 2 pods preferring A (allowed on A or B), A's pods deleted HOLD s after the apply.
Without the taint the scheduler puts both on A, where they wait for A's addresses; with it they
run on B. One run of each, off first.

    .venv/bin/python -m bench.performance.ip_pressure --hold 45
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bench.benchlib import exit_cleanly_on_sigterm, log, machine_facts, print_facts
from tests.harness.install_node import build_image
from tests.harness.multinode import MultiNodeCluster
from tests.harness.pressure_scenario import configured, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=float, default=45.0, help="seconds A stays full")
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="cns-bp-", dir="/tmp"))
    print_facts(machine_facts(workdir))
    try:
        archive = workdir / "cns.tar"
        image = (build_image(archive), archive)
        with MultiNodeCluster.start(
            workdir / "c", nodes=3, image=image, flat_network=True
        ) as cluster:
            first, second = cluster.nodes[0], cluster.nodes[1]
            waited: dict[bool, float] = {}
            for tainted in (False, True):
                with configured(cluster, enabled=tainted):
                    outcome = run(cluster, first, second, tainted=tainted, hold_seconds=args.hold)
                waited[tainted] = outcome.waited_seconds
                log(f"taint {'on' if tainted else 'off'}: 2 pods Running after "
                    f"{outcome.waited_seconds:.2f} s on {outcome.first_nodes}; "
                    f"after A was freed: {outcome.later_nodes}")  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    on, off = waited[True], waited[False]
    print(f"pods' wait, with the taint / without: {on / off:.3f}x "
          f"({on:.2f} s / {off:.2f} s; A full for {args.hold:g} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
