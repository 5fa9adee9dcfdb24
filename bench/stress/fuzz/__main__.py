#!/usr/bin/env python3
"""Fuzzing `cns-ipam`, `cns-cni` and the socket API with hypothesis, against a real daemon.

Run (as root: `cns-cni` ADDs create veth pairs, in scratch network namespaces of this script):

    .venv/bin/python -m bench.stress.fuzz --cases 10000 > fuzz.json
    .venv/bin/python -m bench.stress.fuzz --targets api --cases 300     # one target, a quick look

Targets, each with its own fresh `cns run` daemon (standalone, state on disk):
- `ipam`: the installed `cns-ipam` executable (`cns install-cni`, the `python3 -IS` launcher), run
  with a generated network config on stdin (valid, mutated, random bytes, deep nesting, huge
  strings, wrong types, unknown cniVersions) and generated `CNI_*` variables (commands including
  garbage; container IDs, interface names, netns, CNI_ARGS and CNI_PATH with control characters,
  invalid UTF-8, over-long values, `../`; extra unknown CNI_ variables).
- `cni`: the installed `cns-cni` the same way; its CNI_NETNS is one of this script's scratch
  network namespaces (as is, or spelt with `..`, `//`, through a symlink) or something that is not
  a namespace (a FIFO, a regular file, a directory, /dev/null, a missing path, hostile strings),
  never a namespace of the host or of anybody else. Every successful ADD is undone with DEL.
- `api`: raw HTTP requests on the daemon's unix socket: methods, paths, HTTP versions, headers
  (Content-Length missing, wrong, duplicated; chunked bodies, good and broken; huge and non-ASCII
  headers), bodies (JSON objects around the documented fields with hostile values, random bytes,
  deep nesting, truncated JSON, bodies over the 1 MiB limit).

The daemon holds a few resident pods the whole time (two plain ADDs, two cns-cni attachments with
real veths), so that requests naming them (conflicts, CHECK/verify, DEL, GC) have something to
hit. Checked for every case:
- the answer is a CNI success or a CNI error object: for the plugins JSON on stdout with `code`
  (int) and `msg` (str), exit status 0 for success and 1 for an error, and nothing on stderr;
  code 102 (the plugin's catch-all for an unexpected exception) counts as a finding. For the API,
  a 2xx JSON object or a non-2xx JSON error with `code` and `msg`; aiohttp's plain-text 400 for
  malformed HTTP is the documented exception (docs/api.md), and a connection closed without a
  reply is accepted only when the request never completed (no end of head, or a body cut short);
- the daemon's log gains no traceback, no `api_internal_error`, nothing at error level, and no
  line longer than 4 KiB (a client's input copied into the log unbounded);
- the daemon is alive and its debug endpoint answers;
- on every answer that is not a success of a state-changing verb (so on every error, and on
  successful CHECK, STATUS, VERSION), `/debug/ips` is the same before and after: no IP changed
  owner or state. After a successful state change the script undoes it (DEL/detach of every
  non-resident owner, residents re-added) and takes a new baseline.

Some values are kept out on purpose, because the answer would depend on the client, not the
daemon: a client timeout below 5 s (the daemon may finish an ADD its client gave up on; a
runtime then DELs it), and a `releaseQueueDir` outside this script's directory (a DEL that cannot
reach the daemon writes there as root). The plugins always get an explicit `socket`: the default
`/run/cns/cns.sock` could be somebody else's daemon.

hypothesis runs with `derandomize=True` (the same cases on every run for the same hypothesis
version and --cases) and no example database; failures are recorded, not raised, so one finding
does not stop the run (and cases are not shrunk). Prints progress on stderr and one JSON report on
stdout; exits 1 if anything was found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.benchlib import (
    BenchError,
    exit_cleanly_on_sigterm,
    install_cni,
    log,
    machine_facts,
    temp_work_dir,
)
from bench.stress.fuzz.api import run_api_target
from bench.stress.fuzz.common import ATTACHED_RESIDENTS, PLAIN_RESIDENTS, Harness, Target, World
from bench.stress.fuzz.plugins import Strategies, run_plugin_target


def host_leftovers(names: set[str]) -> list[str]:
    """Host veths of this run's attachments that still exist."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    present = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return sorted(names & present)


def run_target(
    name: str, workdir: Path, bin_dir: Path, tag: str, cases: int
) -> tuple[Target, list[str]]:
    target = Target(name)
    world = World(
        workdir / name, f"{tag}{name[0]}", queue_dir=str(workdir / name / "queue"),
        plugin_cwd=str(workdir / name / "cwd"),
    )  # fmt: skip
    (workdir / name).mkdir()
    world.create()
    (workdir / name / "daemon").mkdir()
    harness = Harness(workdir / name / "daemon", world, target)
    leftovers: list[str] = []
    began = time.monotonic()
    try:
        harness.start()
        strategies = Strategies(world)
        if name == "api":
            run_api_target(harness, strategies, cases)
        else:
            run_plugin_target(harness, bin_dir / f"cns-{name}", strategies, cases)
        # Undo the residents too: every attachment of this run must be gone afterwards.
        for container, ifname, *_ in ATTACHED_RESIDENTS + PLAIN_RESIDENTS:
            harness.call("/v1/cni/detach", {"containerID": container, "ifName": ifname})
        assigned = [ip for ip in harness.daemon.ips() if ip["owner"]]
        if assigned:
            leftovers.append(f"still assigned after the undo: {assigned[:5]}")
    finally:
        target.seconds = time.monotonic() - began
        if harness.daemon.proc is not None:
            harness.daemon.stop()
        leftovers += world.destroy()
        leftovers += [f"host veth {v}" for v in host_leftovers(target.attachments_made)]
        queued = [
            *Path(world.queue_dir).glob("**/*.json"),
            *Path(world.plugin_cwd).glob("**/*.json"),
        ]
        target.inputs["DELs queued by a plugin (daemon unreachable)"] = len(queued)
    return target, leftovers


def report_of(target: Target, leftovers: list[str]) -> dict[str, Any]:
    return {
        "cases": target.cases,
        "seconds": round(target.seconds, 1),
        "answers": dict(target.answers.most_common()),
        "inputs": dict(target.inputs.most_common()),
        "stateChecks": target.state_checks,
        "successesUndone": target.undone,
        "daemonRestarts": target.restarts,
        "findings": dict(target.finding_kinds),
        "findingExamples": target.findings,
        "leftovers": leftovers,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.stress.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="hypothesis examples per target")
    parser.add_argument("--targets", default="ipam,cni,api")
    parser.add_argument("--tmp-dir", help="parent of the temp dirs (default /var/tmp)")
    args = parser.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    if not set(args.targets) <= {"ipam", "cni", "api"}:
        parser.error("--targets: ipam, cni and/or api")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("fuzz: needs root (network namespaces for cns-cni)", file=sys.stderr)
        return 2
    exit_cleanly_on_sigterm()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    import hypothesis

    workdir = temp_work_dir("cns-fuzz-", args.tmp_dir)
    tag = f"cnsfz{os.getpid() % 10000}"
    load_before = os.getloadavg()
    began = time.monotonic()
    results: dict[str, Any] = {}
    failed = False
    try:
        bin_dir = install_cni(workdir / "plugins" / "bin")
        facts = machine_facts(workdir)
        for name in args.targets:
            log(f"{name}: {args.cases} cases")
            target, leftovers = run_target(name, workdir, bin_dir, tag, args.cases)
            results[name] = report_of(target, leftovers)
            failed = failed or bool(target.finding_kinds) or bool(leftovers)
            log(f"{name}: done, {target.cases} cases, findings {dict(target.finding_kinds)}")
        report = {
            "benchmark": "fuzz",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": facts,
            "hypothesis": f"{hypothesis.__version__}, derandomize=True, database=None, "
            "phases=[generate]",
            "loadAverageBefore": [round(x, 2) for x in load_before],
            "loadAverageAfter": [round(x, 2) for x in os.getloadavg()],
            "minutes": round((time.monotonic() - began) / 60, 1),
            "targets": results,
        }
        print(json.dumps(report, indent=2))
        return 1 if failed else 0
    except BenchError as exc:
        print(f"fuzz: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
