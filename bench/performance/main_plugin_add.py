"""One pod ADD with the main plugin: `cns-cni` versus the reference `ptp + host-local`.

Both build the same topology (a veth pair, the pod IP, routes), so this is the per-pod network
set-up cost a runtime sees. Both are measured in ONE hyperfine invocation; every timed run is an
ADD in a fresh state (a DEL through the same plugin is hyperfine's `--prepare`).

    .venv/bin/python -m bench.performance.main_plugin_add --json /tmp/cns-bench/main_plugin_add.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.benchlib import (
    BenchError,
    Daemon,
    add_output_arguments,
    exit_cleanly_on_sigterm,
    install_cni,
    log,
    machine_facts,
    plugin_daemon,
    print_facts,
    temp_work_dir,
)
from bench.performance.plugin_add import REFERENCE_PLUGINS, hyperfine, print_stats

ENV_KEYS = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH", "CNI_ARGS")


def cni_env(command: str, netns: str, container: str, cni_path: str) -> dict[str, str]:
    return dict(
        zip(
            ENV_KEYS,
            (command, container, f"/var/run/netns/{netns}", "eth0", cni_path,
             "IgnoreUnknown=1;K8S_POD_NAME=bench;K8S_POD_NAMESPACE=bench"),
            strict=True,
        )
    )  # fmt: skip


def shell(binary: Path, env: dict[str, str], config: Path) -> str:
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"{assignments} {shlex.quote(str(binary))} < {shlex.quote(str(config))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir = temp_work_dir("cns-main-add-", args.tmp_dir)
    daemon: Daemon | None = None
    namespaces: list[str] = []
    try:
        bin_dir = install_cni(workdir / "cni" / "bin")
        daemon = plugin_daemon(workdir, "10.243.0.0/16")
        facts = machine_facts(workdir)
        daemon.start()
        daemon.wait_pool(lambda p: p["ips"]["Available"] > 0, "an Available IP")
        tag = os.getpid() % 100000
        sides: list[tuple[str, Path, dict[str, Any], str]] = [
            (
                "ptp + host-local",
                REFERENCE_PLUGINS / "ptp",
                {"type": "ptp", "ipMasq": False, "mtu": 1500, "ipam": {
                    "type": "host-local", "subnet": "10.252.0.0/16",
                    "dataDir": str(workdir / "host-local")}},
                str(REFERENCE_PLUGINS),
            ),
            (
                "cns-cni",
                bin_dir / "cns-cni",
                {"type": "cns-cni", "socket": str(daemon.socket), "mtu": 1500,
                 "releaseQueueDir": str(daemon.state_dir / "release-queue")},
                f"{bin_dir}:{REFERENCE_PLUGINS}",
            ),
        ]  # fmt: skip
        commands, prepares = [], []
        for index, (label, binary, plugin, cni_path) in enumerate(sides):
            netns = f"cnsbm{index}-{tag}"
            subprocess.run(["ip", "netns", "add", netns], check=True)
            namespaces.append(netns)
            config = workdir / f"side{index}.json"
            config.write_text(json.dumps({"cniVersion": "1.0.0", "name": "bench", **plugin}))
            container = f"bench{index}-{tag}"
            for command in ("ADD", "DEL"):
                check = subprocess.run(
                    [str(binary)],
                    input=config.read_text(),
                    env={
                        "PATH": os.environ["PATH"],
                        **cni_env(command, netns, container, cni_path),
                    },
                    capture_output=True,
                    text=True,
                )
                if check.returncode != 0:
                    raise BenchError(f"{label} {command} failed: {check.stdout}{check.stderr}")
            log(f"{label}: ADD and DEL work")
            commands.append(
                (label, shell(binary, cni_env("ADD", netns, container, cni_path), config))
            )
            prepares += [
                "--prepare",
                shell(binary, cni_env("DEL", netns, container, cni_path), config),
            ]
        out = workdir / "results"
        out.mkdir()
        results = hyperfine(commands, out, "main_plugin_add", args.runs, args.warmup, prepares)
        print_facts(facts)
        print_stats("pod ADD with a main plugin: ptp + host-local vs cns-cni", results)
        ours, reference = results["cns-cni"], results["ptp + host-local"]
        verdict = "MET" if ours["median"] <= reference["median"] else "NOT MET"
        print(
            f"\ntarget: cns-cni no slower than ptp + host-local at the median: "
            f"{ours['median']:.2f} ms vs {reference['median']:.2f} ms -> {verdict}"
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"machine": facts, "add": results}, indent=1))
        return 0
    finally:
        for netns in namespaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        if daemon is not None:
            daemon.stop()
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


if __name__ == "__main__":
    sys.exit(main())
