#!/usr/bin/env python3
"""`kill -9` of a real `cns run` daemon at random moments of concurrent ADD/DEL streams, round
after round: is an acknowledged assignment ever lost, or an address ever given twice?

Run (as root for nothing; kubernetes mode needs the binaries of scripts/build-kubernetes.sh):

    .venv/bin/python -m bench.stress.crash_rounds --mode standalone --rounds 200 \\
        > crash-standalone.json
    .venv/bin/python -m bench.stress.crash_rounds --mode kubernetes --rounds 200 \\
        > crash-kubernetes.json

Each round: client threads (tests/harness/ledger.py, as in tests/integration/test_crash.py) stream
ADDs and DELs to the daemon's unix socket exactly as the plugins send them; one more client runs the
real installed `cns-ipam` for every request (its DELs are queued on disk while the daemon is down
and must be applied on restart). At a moment drawn uniformly from [0, --max-kill-delay] s after the
daemon became ready, the daemon gets SIGKILL; it is restarted and `/debug/ips` is checked against
the ledger: every acknowledged ADD whose DEL was never attempted holds the address it was given, no
acknowledged DEL is assigned, no address or owner appears twice. Requests in flight at the kill are
looked up (committed or not) and retried as a runtime would; a committed ADD's retry must get the
same address. The clients keep a standing population between --low and --high pods (they delete more
above, add more below), so the pool grows and shrinks all the time; the pool seen last before the
kill says what was going on (starting, growing, shrinking, steady).

Kubernetes mode: a real kube-apiserver + etcd (tests/harness/kube_cluster.py), the real `cns
controller`, and two daemons in `mode: kubernetes` with the RBAC-limited credentials
(tests/harness/kube_scenario.py, as in tests/integration/test_kube_mode.py); both nodes get streams,
the daemon killed alternates, and after every round no address may be in two NodeNetworkConfigs.

Prints progress on stderr and one JSON report on stdout; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.benchlib import (
    BenchError,
    exit_cleanly_on_sigterm,
    install_cni,
    log,
    machine_facts,
    metric_sum,
    parse_metrics,
    percentile,
    temp_work_dir,
)
from tests.harness import REPO
from tests.harness.daemon import Daemon
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_scenario import Scenario
from tests.harness.ledger import ADD, DEL, Ledger, client, resolve_in_flight, violations

KINDS = ("duplicate address", "duplicate owner", "lost", "resurrected")
STANDALONE_SUBNET = "10.78.0.0/20"
KUBE_SUBNET = "10.79.0.0/20"


class PluginCall:
    """A `Call` through the installed `cns-ipam` executable (a runtime's view of the daemon).

    A reply is (200, result) when the plugin exits 0, else (0, the CNI error it printed); code
    100 (daemon unreachable) on an ADD raises ConnectionError like a dead socket does. A DEL
    with the daemon down is queued on disk by the plugin and succeeds: that is an acknowledged DEL
    the restarted daemon must apply.
    """

    def __init__(self, plugin: Path, daemon: Daemon) -> None:
        self.plugin = plugin
        self.acknowledged: Counter[str] = Counter()  # by CNI_COMMAND
        self.config = json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "crash-rounds",
                "type": "cns-ipam",
                "ipam": {
                    "type": "cns-ipam",
                    "socket": str(daemon.socket),
                    "releaseQueueDir": str(daemon.state_dir / "release-queue"),
                },
            }
        )

    def __call__(self, method: str, url: str, body: Any = None) -> tuple[int, Any]:
        command = {ADD: "ADD", DEL: "DEL"}[url]
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": body["containerID"],
            "CNI_IFNAME": body["ifName"],
            "CNI_NETNS": "/var/run/netns/crash-rounds",
            "CNI_PATH": str(self.plugin.parent),
        }
        done = subprocess.run(
            [str(self.plugin)], input=self.config, env=env, capture_output=True, text=True
        )
        if done.returncode == 0:
            self.acknowledged[command] += 1
        if done.returncode == 0 and not done.stdout.strip():
            return 200, {}  # DEL: success prints nothing
        try:
            reply = json.loads(done.stdout)
        except ValueError:
            return 0, {"code": "not JSON", "stdout": done.stdout, "stderr": done.stderr}
        if done.returncode == 0:
            return 200, reply
        if reply.get("code") == 100 and command == "ADD":
            raise ConnectionError(reply.get("msg"))
        return 0, reply


@dataclass
class Node:
    """One daemon under test and what its clients were told."""

    name: str
    daemon: Daemon
    ledger: Ledger = field(default_factory=Ledger)
    plugin: PluginCall | None = None


@dataclass
class Totals:
    """Summed over the rounds."""

    rounds: int = 0
    acknowledged_adds: int = 0
    acknowledged_dels: int = 0
    queued_dels_applied: int = 0
    in_flight: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})
    phases: Counter[str] = field(default_factory=Counter)
    kill_delays: list[float] = field(default_factory=list)
    restart_seconds: list[float] = field(default_factory=list)
    population: list[int] = field(default_factory=list)
    subnet_duplicates: list[str] = field(default_factory=list)
    subnet_checks: int = 0
    load: list[float] = field(default_factory=list)
    slow_debug_reads: int = 0


def delete_share(low: int, high: int) -> Callable[[int], float]:
    """Chance of a DEL given the live population: mostly ADDs below `low`, DELs above `high`."""

    def share(live: int) -> float:
        if live < low:
            return 0.25
        if live > high:
            return 0.75
        return 0.5

    return share


def phase_of(delay: float, pool: dict[str, Any] | None) -> str:
    """What the daemon was doing when it was killed, from the last `/debug/pool` before it."""
    if delay < 0.25 or pool is None:
        return "starting (< 0.25 s after ready)"
    ips = pool["ips"]
    held = ips["Available"] + ips["Assigned"] + ips["PendingProgramming"]
    if pool["waitingAdds"] > 0 or pool["requestedIPCount"] > held:
        return "pool growing"
    if ips["PendingRelease"] > 0:
        return "pool shrinking"
    return "steady"


class PoolWatch:
    """Polls `/debug/pool` every 0.1 s until the daemon dies; keeps the last answer."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.last: dict[str, Any] | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.last = self.daemon.pool()
            except (OSError, urllib.error.URLError, ValueError):
                return
            self.stop.wait(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def read_debug(daemon: Daemon, path: str, totals: Totals, patience: float = 60) -> Any:
    """A read of the debug endpoint that waits out a starved machine: `Daemon.get` gives
    up after 5 s (a Kubernetes-mode run stopped there at load average 14, its daemon ready and
    idle); a daemon that does not answer within `patience` seconds still fails the run."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return daemon.get(path)
        except (TimeoutError, urllib.error.URLError) as exc:
            totals.slow_debug_reads += 1
            if time.monotonic() > deadline:
                raise BenchError(f"{path} unanswered for {patience:g} s: {exc}") from None


def run_round(
    nodes: list[Node], index: int, rng: random.Random, args: argparse.Namespace, totals: Totals
) -> dict[str, Any]:
    """One round: streams, SIGKILL of one daemon, restart, checks; returns the round's record."""
    victim = nodes[index % len(nodes)]
    stop = threading.Event()
    threads: list[threading.Thread] = []
    share = delete_share(args.low, args.high)
    before = {node.name: (len(node.ledger.added), len(node.ledger.deleted)) for node in nodes}
    for node in nodes:
        calls: list[Any] = [node.daemon.call] * args.clients
        if node.plugin is not None:
            calls.append(node.plugin)
        for number, call in enumerate(calls):
            threads.append(
                threading.Thread(
                    target=client,
                    args=(call, f"{node.name}-r{index}-c{number}", node.ledger, stop),
                    kwargs={"seed": rng.randrange(1 << 30), "delete_share": share},
                )
            )
    watch = PoolWatch(victim.daemon)
    delay = rng.uniform(0, args.max_kill_delay)
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, started + delay - time.monotonic()))
    pool = watch.last
    assert victim.daemon.proc is not None
    victim.daemon.proc.send_signal(signal.SIGKILL)
    victim.daemon.proc.wait()
    victim.daemon.proc = None
    stop.set()
    watch.close()
    for thread in threads:
        thread.join(timeout=60)
        if thread.is_alive():
            raise BenchError(f"round {index}: a client is still running 60 s after the kill")
    phase = phase_of(delay, pool)
    restarted = time.monotonic()
    victim.daemon.start(wait=False)
    victim.daemon.wait_ready(timeout=args.ready_timeout)
    restart = time.monotonic() - restarted
    # A fresh process: its counter holds exactly the DELs the plugin queued while it was down.
    queued = metric_sum(
        parse_metrics(read_debug(victim.daemon, "/metrics", totals)),
        "cns_release_queue_applied_total",
    )
    totals.queued_dels_applied += int(queued)
    record: dict[str, Any] = {
        "round": index,
        "victim": victim.name,
        "killDelay": round(delay, 3),
        "phase": phase,
        "restartSeconds": round(restart, 3),
    }
    for node in nodes:
        ips = read_debug(node.daemon, "/debug/ips", totals)["ips"]
        found = violations(ips, node.ledger)
        for kind, items in found.items():
            totals.violations[kind] += [f"round {index} {node.name}: {item}" for item in items]
        in_flight_before = dict(node.ledger.in_flight)
        # An ADD retried at once may meet a pool still waiting for its control plane (503, code
        # 11, after addTimeoutSeconds): a runtime retries, so does this.
        outcome = resolve_in_flight(node.daemon.call, ips, node.ledger, attempts=4)
        totals.in_flight.update(outcome)
        if outcome["add retried to another address"]:
            totals.violations["lost"].append(
                f"round {index} {node.name}: a committed in-flight ADD got another address on "
                f"retry ({in_flight_before})"
            )
        adds, dels = before[node.name]
        retried_adds = outcome["add committed"] + outcome["add not committed"]
        retried_dels = outcome["del applied"] + outcome["del not applied"]
        record[node.name] = {
            # Acknowledged by the streams; the retries of in-flight requests are counted apart.
            "acknowledgedAdds": len(node.ledger.added) - adds - retried_adds,
            "acknowledgedDels": len(node.ledger.deleted) - dels - retried_dels,
            "inFlight": dict(outcome),
            "live": len(node.ledger.live),
            "violations": sum(len(items) for items in found.values()),
        }
        totals.acknowledged_adds += record[node.name]["acknowledgedAdds"]
        totals.acknowledged_dels += record[node.name]["acknowledgedDels"]
        totals.population.append(len(node.ledger.live))
    totals.rounds += 1
    totals.phases[phase] += 1
    totals.kill_delays.append(delay)
    totals.restart_seconds.append(restart)
    totals.load.append(os.getloadavg()[0])
    return record


def merge_refusals(nodes: list[Node], totals: Totals) -> None:
    for node in nodes:
        totals.refused.update(node.ledger.refused)


def final_check(nodes: list[Node]) -> dict[str, Any]:
    """Every live container, ADDed once more, gets the address it was first given."""
    checked = 0
    moved = []
    for node in nodes:
        for container in list(node.ledger.live):
            status, body = node.daemon.call(
                "POST", ADD, {"containerID": container, "ifName": "eth0"}
            )
            checked += 1
            address = body["ips"][0]["address"].split("/")[0] if status == 200 else None
            if address != node.ledger.added[container]:
                moved.append(f"{node.name} {container}: {node.ledger.added[container]} -> {body}")
    return {"reAdded": checked, "changed": moved}


def log_problems(nodes: list[Node]) -> dict[str, int]:
    """Lines of the daemons' logs that must never appear, whatever was killed when."""
    counts: Counter[str] = Counter()
    for node in nodes:
        for line in node.daemon.log().splitlines():
            if "Traceback" in line:
                counts["Traceback"] += 1
            if "api_internal_error" in line:
                counts["api_internal_error"] += 1
            if '"level": "error"' in line or '"level": "critical"' in line:
                counts["error level"] += 1
    return dict(counts)


def summary(totals: Totals) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {
            "p50": round(percentile(values, 50), 3),
            "p90": round(percentile(values, 90), 3),
            "max": round(max(values), 3),
        }

    return {
        "rounds": totals.rounds,
        "acknowledgedAdds": totals.acknowledged_adds,
        "acknowledgedDels": totals.acknowledged_dels,
        "inFlightAtKills": dict(totals.in_flight),
        "queuedDelsAppliedAtRestart": totals.queued_dels_applied,
        "refused": dict(totals.refused),
        "violations": {kind: len(items) for kind, items in totals.violations.items()},
        "violationExamples": {k: v[:10] for k, v in totals.violations.items() if v},
        "killPhases": dict(totals.phases),
        "killDelaySeconds": spread(totals.kill_delays),
        "restartSeconds": spread(totals.restart_seconds),
        "livePopulation": {"min": min(totals.population), "max": max(totals.population)},
        "subnetChecks": totals.subnet_checks,
        "slowDebugReads": totals.slow_debug_reads,
        "subnetDuplicates": totals.subnet_duplicates[:10],
        "loadAverage1m": {
            "mean": round(sum(totals.load) / len(totals.load), 2),
            "max": round(max(totals.load), 2),
        },
    }


def keep_logs(workdir: Path) -> Path:
    """Copy every log under `workdir` (daemons, controller, apiserver, etcd) to a kept directory."""
    kept = Path(tempfile.mkdtemp(prefix="cns-crash-logs-", dir=workdir.parent))
    for path in workdir.rglob("*.log"):
        target = kept / path.relative_to(workdir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return kept


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("standalone", "kubernetes"), default="standalone")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8, help="socket clients per daemon")
    parser.add_argument("--no-plugin", action="store_true", help="no cns-ipam client")
    parser.add_argument("--max-kill-delay", type=float, default=3.0, help="seconds after ready")
    parser.add_argument("--low", type=int, default=100, help="standing population per node, min")
    parser.add_argument("--high", type=int, default=300, help="standing population per node, max")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        help="seconds a restarted daemon may take to answer /readyz (the interpreter alone took "
        "10 s to import cns on a 2-core machine at load average 17)",
    )
    parser.add_argument("--tmp-dir", help="parent of the temp state dirs (default /var/tmp)")
    parser.add_argument("--rounds-out", help="write every round's record (JSON lines) here")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 10000 or not 1 <= args.clients <= 64:
        parser.error("--rounds in 1..10000, --clients in 1..64")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    rng = random.Random(args.seed)
    workdir: Path | None = None
    cluster: KubeCluster | None = None
    scenario: Scenario | None = None
    nodes: list[Node] = []
    totals = Totals()
    succeeded = False
    began = time.monotonic()
    load_before = os.getloadavg()
    try:
        workdir = temp_work_dir("cns-crash-", args.tmp_dir)
        facts = machine_facts(workdir)
        plugin = None if args.no_plugin else install_cni(workdir / "cni" / "bin") / "cns-ipam"
        if args.mode == "standalone":
            daemon = Daemon(
                workdir,
                {
                    "nodeName": "crash-node",
                    "scaler": {"maxIPCount": 2000},
                    "standalone": {"subnet": STANDALONE_SUBNET, "allocationLatencyMs": 200},
                },
            )
            daemon.start(wait=False)
            daemon.wait_ready(timeout=args.ready_timeout)
            nodes.append(Node("standalone", daemon))
        else:
            log("starting kube-apiserver and etcd")
            cluster = KubeCluster.start(workdir_parent=str(workdir))
            cluster.apply(REPO / "config" / "crd")
            cluster.apply(REPO / "config" / "rbac.yaml")
            scenario = Scenario(cluster, workdir, "crash-subnet", KUBE_SUBNET, {"maxIPCount": 1000})
            for name in ("crash-n1", "crash-n2"):
                scenario.add_node(name)
            scenario.start_controller()
            for name in scenario.nodes:
                daemon = scenario.start_daemon(name, wait=False)
                daemon.wait_ready(timeout=args.ready_timeout)
                nodes.append(Node(name, daemon))
        for node in nodes:
            if plugin is not None:
                node.plugin = PluginCall(plugin, node.daemon)
        log(f"{args.mode}: {len(nodes)} daemon(s), state under {workdir} ({facts['stateDirFs']})")
        rounds_out = open(args.rounds_out, "w") if args.rounds_out else None  # noqa: SIM115
        try:
            for index in range(args.rounds):
                record = run_round(nodes, index, rng, args, totals)
                if scenario is not None:
                    addresses = scenario.all_nc_addresses()
                    totals.subnet_checks += 1
                    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
                    totals.subnet_duplicates += [f"round {index}: {a}" for a in duplicates]
                    record["subnetDuplicates"] = len(duplicates)
                if rounds_out is not None:
                    rounds_out.write(json.dumps(record) + "\n")
                    rounds_out.flush()
                bad = sum(len(v) for v in totals.violations.values()) + len(
                    totals.subnet_duplicates
                )
                log(
                    f"round {index + 1}/{args.rounds}: killed {record['victim']} at "
                    f"{record['killDelay']:.2f} s ({record['phase']}), restart "
                    f"{record['restartSeconds']:.2f} s, live "
                    f"{[len(n.ledger.live) for n in nodes]}, problems so far {bad}"
                )
        finally:
            if rounds_out is not None:
                rounds_out.close()
        final = final_check(nodes)
        merge_refusals(nodes, totals)
        report = {
            "benchmark": "crash_rounds",
            "mode": args.mode,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": facts,
            "loadAverageBefore": [round(x, 2) for x in load_before],
            "loadAverageAfter": [round(x, 2) for x in os.getloadavg()],
            "minutes": round((time.monotonic() - began) / 60, 1),
            "settings": {
                "clientsPerDaemon": args.clients,
                "pluginClient": plugin is not None,
                "maxKillDelay": args.max_kill_delay,
                "population": [args.low, args.high],
                "seed": args.seed,
                "readyTimeout": args.ready_timeout,
                "subnet": STANDALONE_SUBNET if args.mode == "standalone" else KUBE_SUBNET,
            },
            **summary(totals),
            "pluginAcknowledged": {
                node.name: dict(node.plugin.acknowledged) for node in nodes if node.plugin
            },
            "finalReAdd": final,
            "daemonLogProblems": log_problems(nodes),
        }
        print(json.dumps(report, indent=2))
        succeeded = not (
            any(totals.violations.values()) or totals.subnet_duplicates or final["changed"]
        )
        return 0 if succeeded else 1
    except BenchError as exc:
        print(f"crash_rounds: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for node in nodes:
            if node.daemon.proc is not None:
                node.daemon.proc.kill()
                node.daemon.proc.wait()
        if workdir is not None and not succeeded:
            log(f"logs kept in {keep_logs(workdir)}")
        if scenario is not None:
            scenario.cleanup()
        if cluster is not None:
            cluster.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
