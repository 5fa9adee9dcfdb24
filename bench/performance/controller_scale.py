"""`cns controller` at scale, in the spirit of kubemark: a real etcd and kube-apiserver, two real
controller replicas with leader election, and thousands of simulated node daemons played by one
asyncio process (tests/harness/scale_fleet.py).

Every change is timed from the acknowledgement of the node's spec patch to the NNC watch event
that shows it fulfilled. Phases (`--phases`, in this order; `initial` always runs):

- initial:  N Node objects appear; each node, once its NNC exists, asks for 32 to 64 addresses;
- idle:     nothing changes for `--idle-seconds` (the controller's CPU at rest);
- single:   one node changes at a time, the rest idle (`--single-changes` of them);
- burst:    10 % of the nodes change at once: time until all are fulfilled;
- churn:    `--churn-rate` changes per second for `--churn-seconds`;
- failover: the same churn; the leader gets SIGKILL; time from the kill to the first change
            acknowledged after it that is fulfilled (the standby takes over once the lease,
            `--lease` seconds, runs out).

Throughout, the watch checks after every event that no address is in two NNCs (any duplicate
is a failure: exit code 1, as is a change not fulfilled within `--timeout`). Per phase it reports
the controllers' CPU (a fraction of one core, from /proc/PID/stat) and memory (VmRSS, VmHWM),
the CPU of etcd and kube-apiserver (they share the machine's cores with everything else), and the
API requests each replica's user made (the apiserver's audit log).

`--code DIR` runs the controllers from another checkout; given several times (with as many
`--label`s), each gets a fresh cluster in turn and the first is the baseline the others are
compared with (ratios in the JSON and the table):

    git worktree add /tmp/cns-base <commit>
    nice -n 10 .venv/bin/python -m bench.performance.controller_scale --nodes 1000 \\
        --code /tmp/cns-base --label base --code . --label new

Prints one JSON object on stdout and a table on stderr; progress on stderr with timestamps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import REPO, HarnessError
from tests.harness.async_kube import AsyncKube
from tests.harness.audit import AuditedCluster, Window, audit_log, count_requests
from tests.harness.controller import controller_command
from tests.harness.kube_api import (
    ADMIN,
    CS_API,
    DAEMON_USER,
    KUBE_SYSTEM,
    ApiError,
)
from tests.harness.kube_cluster import KubeCluster, binaries, missing_binaries_message
from tests.harness.proc_stats import Sample, cores_used, sample
from tests.harness.process import ManagedProcess, private_tmp
from tests.harness.scale_fleet import Change, ScaleFleet, percentile

PHASES = ("initial", "idle", "single", "burst", "churn", "failover")
SUBNET = "scale"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{KUBE_SYSTEM}/leases/cns-controller-{SUBNET}"
PROGRESS_SECONDS = 15.0
# Each replica has its own user (with the roles of config/rbac.yaml), so that the audit log
# tells the leader's requests from the standby's.
REPLICA_USERS = ("cns-scale-replica-0", "cns-scale-replica-1")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- figures


def summary(changes: list[Change]) -> dict[str, Any]:
    """Latencies (seconds, ack to fulfilment) of a phase's changes, and those that failed."""
    seconds = [c.seconds for c in changes if c.seconds is not None]
    failed = [c for c in changes if c.seconds is None]
    return {
        "changes": len(changes),
        "fulfilled": len(seconds),
        "p50Seconds": _round(percentile(seconds, 0.5)),
        "p99Seconds": _round(percentile(seconds, 0.99)),
        "maxSeconds": _round(max(seconds, default=None)),
        "notFulfilled": len(failed),
        "errors": sorted({c.error for c in failed})[:5],
    }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


HEADLINES: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "initial: all fulfilled (s)": lambda p: p["initial"]["allFulfilledSeconds"],
    "initial: p50 / node (s)": lambda p: p["initial"]["p50Seconds"],
    "initial: p99 / node (s)": lambda p: p["initial"]["p99Seconds"],
    "single: p50 (s)": lambda p: p["single"]["p50Seconds"],
    "single: p99 (s)": lambda p: p["single"]["p99Seconds"],
    "burst 10%: all fulfilled (s)": lambda p: p["burst"]["allFulfilledSeconds"],
    "churn: p50 (s)": lambda p: p["churn"]["p50Seconds"],
    "churn: p99 (s)": lambda p: p["churn"]["p99Seconds"],
    "failover: kill to first fulfilled (s)": lambda p: p["failover"]["recoverySeconds"],
    "burst 10%: apiserver CPU (s)": lambda p: p["burst"]["servers"]["apiserver"]["cpuSeconds"],
    "burst 10%: etcd CPU (s)": lambda p: p["burst"]["servers"]["etcd"]["cpuSeconds"],
    "burst 10%: IPBlock writes / change": lambda p: _per_change(p["burst"], "ipblocks"),
    "burst 10%: NNC status writes / change": lambda p: _per_change(
        p["burst"], "nodenetworkconfigs/status"
    ),
    "leader CPU idle (cores)": lambda p: p["idle"]["controller"]["leader"]["cores"],
    "leader CPU churn (cores)": lambda p: p["churn"]["controller"]["leader"]["cores"],
    "standby CPU churn (cores)": lambda p: p["churn"]["controller"]["standby"]["cores"],
    "leader peak RSS (MiB)": lambda p: max(
        phase["controller"]["leader"]["hwmMiB"] or 0 for phase in p.values()
    ),
    "controller req/s idle": lambda p: p["idle"]["apiRequests"]["controller"]["perSecond"],
    "controller req/s single": lambda p: p["single"]["apiRequests"]["controller"]["perSecond"],
    "controller req/s churn": lambda p: p["churn"]["apiRequests"]["controller"]["perSecond"],
    "controller req/s initial": lambda p: p["initial"]["apiRequests"]["controller"]["perSecond"],
}


def _per_change(phase: dict[str, Any], resource: str) -> float:
    """The leader's writes (create, update, patch) of `resource` over the phase, per change."""
    verbs: dict[str, int] = phase["apiRequests"]["leader"]["byVerb"]
    writes = 0
    for key, count in verbs.items():
        verb, _, written = key.partition(" ")
        writes += count if written == resource and verb in ("create", "update", "patch") else 0
    return round(writes / int(phase["changes"]), 3)


def headlines(run: dict[str, Any]) -> dict[str, float | None]:
    """The figures of a run that the table shows and the ratios compare (None: not measured)."""
    found: dict[str, float | None] = {}
    for name, get in HEADLINES.items():
        try:
            found[name] = get(run["phases"])
        except (KeyError, TypeError):
            found[name] = None
    return found


def ratios(base: Mapping[str, float | None], other: Mapping[str, float | None]) -> dict[str, float]:
    return {
        name: round(value / base_value, 3)
        for name, value in other.items()
        if value is not None and (base_value := base.get(name))
    }


def table(runs: list[dict[str, Any]]) -> str:
    labels = [run["label"] for run in runs]
    columns = labels + [f"{label}/{labels[0]}" for label in labels[1:]]
    rows = [["", *columns]]
    for name in HEADLINES:
        values = [run["headlines"][name] for run in runs]
        cells = ["-" if v is None else f"{v:g}" for v in values]
        cells += [f"{run['ratios'].get(name, float('nan')):.2f}" for run in runs[1:]]
        rows.append([name, *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


# ---------------------------------------------------------------------- the processes


class Replicas:
    """The two `cns controller` processes, named replica-0 and replica-1 (their lease identity)."""

    def __init__(self, cluster: KubeCluster, *, code: Path, workdir: Path, lease: int) -> None:
        self.code = code
        self.procs = []
        for index in range(2):
            command = controller_command(
                cluster,
                subnet=SUBNET,
                identity=f"replica-{index}",
                lease_seconds=lease,
                user=REPLICA_USERS[index],
            )
            proc = ManagedProcess(f"controller{index}", command, workdir / f"controller{index}.log")
            proc.env = private_tmp(workdir)
            self.procs.append(proc)

    def start(self, index: int) -> None:
        self.procs[index].spawn(self.code)

    def pid(self, index: int) -> int | None:
        popen = self.procs[index].popen
        return popen.pid if popen is not None and popen.poll() is None else None

    def kill(self, index: int) -> None:
        self.procs[index].stop(timeout=0)  # SIGKILL

    def restore(self) -> None:
        """Start again the replicas that are not running (the killed leader, as a standby)."""
        for index in range(len(self.procs)):
            if self.pid(index) is None:
                self.start(index)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


async def leader(admin: AsyncKube) -> int | None:
    """The index of the replica holding the lease, None if none does."""
    try:
        lease = await admin.request("GET", LEASE_PATH)
    except ApiError as exc:
        if exc.status == 404:  # before the first election
            return None
        raise
    holder = str((lease.get("spec") or {}).get("holderIdentity") or "")
    return int(holder.rsplit("-", 1)[1]) if holder.startswith("replica-") else None


@dataclass
class Meter:
    """Wall-clock windows of the phases, and the processes' CPU and memory over each."""

    replicas: Replicas
    admin: AsyncKube
    servers: Callable[[], dict[str, int | None]]  # etcd and kube-apiserver, by name
    windows: list[Window] = field(default_factory=list)

    async def measure(self, name: str, body: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        roles = await self._roles()
        names = {role: f"replica-{index}" for role, index in roles.items()}
        before = self._samples()
        started_wall, started = time.time(), time.monotonic()
        log(f"phase {name}: start")
        figures = await body
        after = self._samples()
        self.windows.append(Window(name, started_wall, time.time()))
        seconds = time.monotonic() - started
        log(f"phase {name}: done in {seconds:.1f} s")
        controller = {}
        for role, index in roles.items():
            first, last = before.get(f"replica-{index}"), after.get(f"replica-{index}")
            controller[role] = _usage(first, last)
        return {
            "wallSeconds": round(seconds, 2),
            **figures,
            "controller": controller,
            "harness": _usage(before["harness"], after["harness"]),
            "servers": {name: _usage(before.get(name), after.get(name)) for name in self.servers()},
            "roles": names,
        }

    async def _roles(self) -> dict[str, int]:
        index = await leader(self.admin)
        if index is None:
            return {}
        return {"leader": index, "standby": 1 - index}

    def _samples(self) -> dict[str, Sample | None]:
        now = time.monotonic()
        found = {"harness": sample(os.getpid(), now)}
        for index in range(2):
            pid = self.replicas.pid(index)
            found[f"replica-{index}"] = None if pid is None else sample(pid, now)
        for name, pid in self.servers().items():
            found[name] = None if pid is None else sample(pid, now)
        return found


def _usage(before: Sample | None, after: Sample | None) -> dict[str, float | None]:
    """CPU over the phase (if the same process lived through it) and memory at its end."""
    same = before is not None and after is not None and before.pid == after.pid
    return {
        "cores": round(cores_used(before, after), 3) if same and before and after else None,
        "cpuSeconds": round(after.cpu - before.cpu, 2) if same and before and after else None,
        "rssMiB": round(after.rss_kib / 1024, 1) if after else None,
        "hwmMiB": round(after.hwm_kib / 1024, 1) if after else None,
    }


# ---------------------------------------------------------------------- the phases


@dataclass
class Run:
    args: argparse.Namespace
    fleet: ScaleFleet
    admin: AsyncKube
    replicas: Replicas
    names: list[str]
    rng: random.Random

    async def initial(self) -> dict[str, Any]:
        started = time.monotonic()
        appearing = [asyncio.create_task(self.fleet.appear(name)) for name in self.names]

        async def create(name: str) -> None:
            node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
            await self.admin.request("POST", "/api/v1/nodes", node)

        await asyncio.gather(*(create(name) for name in self.names))
        created = time.monotonic() - started
        log(f"{len(self.names)} Node objects created in {created:.1f} s")
        changes = await asyncio.gather(*appearing)
        done = [c.fulfilled_at for c in changes if c.fulfilled_at is not None]
        return {
            **summary(changes),
            "nodesCreatedSeconds": round(created, 2),
            "allFulfilledSeconds": _round(max(done) - started)
            if len(done) == len(changes)
            else None,
        }

    async def idle(self) -> dict[str, Any]:
        await asyncio.sleep(self.args.idle_seconds)
        return {"seconds": self.args.idle_seconds}

    async def single(self) -> dict[str, Any]:
        changes = []
        for _ in range(self.args.single_changes):
            changes.append(await self.fleet.change(self.rng.choice(self.names)))
        return summary(changes)

    async def burst(self) -> dict[str, Any]:
        chosen = self.rng.sample(self.names, max(1, len(self.names) // 10))
        started = time.monotonic()
        changes = await asyncio.gather(*(self.fleet.change(name) for name in chosen))
        done = [c.fulfilled_at for c in changes if c.fulfilled_at is not None]
        every = max(done) - started if len(done) == len(changes) else None
        return {**summary(changes), "allFulfilledSeconds": _round(every)}

    async def _churn(self, seconds: float) -> tuple[list[Change], int]:
        """Start a change on an idle node every 1/rate seconds; wait for all of them."""
        rate = self.args.churn_rate
        tasks: list[asyncio.Task[Change]] = []
        skipped = 0
        started = time.monotonic()
        due = started
        while due < started + seconds:
            idle = self.fleet.idle()
            if idle:
                tasks.append(asyncio.create_task(self.fleet.change(self.rng.choice(idle))))
            else:
                skipped += 1
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        return list(await asyncio.gather(*tasks)), skipped

    async def churn(self) -> dict[str, Any]:
        changes, skipped = await self._churn(self.args.churn_seconds)
        return {
            **summary(changes),
            "ratePerSecond": self.args.churn_rate,
            "seconds": self.args.churn_seconds,
            "skippedNoIdleNode": skipped,
        }

    async def failover(self) -> dict[str, Any]:
        lease = self.args.lease
        churning = asyncio.create_task(self._churn(self.args.failover_seconds))
        await asyncio.sleep(min(5.0, self.args.failover_seconds / 4))
        old = await leader(self.admin)
        if old is None:
            raise HarnessError("no leader to kill")
        killed_at = time.monotonic()
        self.replicas.kill(old)
        log(f"killed the leader replica-{old} (SIGKILL); lease {lease} s")
        new, took_over = None, None
        while new is None or new == old:
            await asyncio.sleep(0.1)
            new = await leader(self.admin)
            if time.monotonic() - killed_at > 10 * lease + 60:
                break
        if new is not None and new != old:
            took_over = time.monotonic() - killed_at
            log(f"replica-{new} leads {took_over:.1f} s after the kill")
        changes, skipped = await churning
        done = [(c.acked_at, c.fulfilled_at) for c in changes if c.fulfilled_at is not None]
        after = [fulfilled for acked, fulfilled in done if acked > killed_at]
        any_after = [fulfilled for _, fulfilled in done if fulfilled > killed_at]
        return {
            **summary(changes),
            "leaseSeconds": lease,
            "killed": f"replica-{old}",
            "newLeader": None if new is None else f"replica-{new}",
            "leaseTakenOverSeconds": _round(took_over),
            "recoverySeconds": _round(min(after) - killed_at) if after else None,
            "firstFulfilmentSeenAfterKillSeconds": _round(min(any_after) - killed_at)
            if any_after
            else None,
            "ratePerSecond": self.args.churn_rate,
            "skippedNoIdleNode": skipped,
        }


async def watched(
    body: Coroutine[Any, Any, dict[str, Any]], watching: asyncio.Task[None]
) -> dict[str, Any]:
    """A phase, stopped with the watch's error if the watch fails first (the changes would
    only wait for their timeout)."""
    phase = asyncio.ensure_future(body)
    await asyncio.wait({phase, watching}, return_when=asyncio.FIRST_COMPLETED)
    if phase.done():
        return phase.result()
    phase.cancel()
    watching.result()
    raise HarnessError("the NNC watch ended")


async def progress(fleet: ScaleFleet) -> None:
    while True:
        await asyncio.sleep(PROGRESS_SECONDS)
        busy = sum(1 for node in fleet.nodes.values() if node.busy)
        seen = sum(1 for node in fleet.nodes.values() if node.nnc is not None)
        log(
            f"  NNCs seen {seen}/{len(fleet.nodes)}, changes in flight {busy}, "
            f"spec writes {fleet.writes}, events checked {fleet.check.events}, "
            f"duplicates {len(fleet.check.duplicated)}"
        )


async def drive(
    args: argparse.Namespace, cluster: KubeCluster, replicas: Replicas
) -> tuple[dict[str, Any], list[Window], ScaleFleet]:
    names = [f"node-{i:05d}" for i in range(args.nodes)]
    port, ca_file = cluster.port, cluster.ca_file
    async with (
        AsyncKube(port=port, ca_file=ca_file, token=cluster.tokens[ADMIN], connections=32) as admin,
        AsyncKube(port=port, ca_file=ca_file, token=cluster.tokens[DAEMON_USER]) as daemons,
    ):
        await admin.request(
            "POST",
            "/apis/acn.azure.com/v1alpha1/clustersubnets",
            {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": SUBNET},
             "spec": {"subnet": args.cidr}},
        )  # fmt: skip
        replicas.start(0)
        replicas.start(1)
        deadline = time.monotonic() + 120
        while await leader(admin) is None:
            if time.monotonic() > deadline:
                raise HarnessError("no controller replica took the lease within 120 s")
            await asyncio.sleep(0.2)
        fleet = ScaleFleet(daemons, names, seed=args.seed, timeout=args.timeout)
        run = Run(args, fleet, admin, replicas, names, random.Random(args.seed))
        meter = Meter(replicas, admin, cluster.server_pids)
        watching = asyncio.create_task(fleet.run_watch())
        background = [watching, asyncio.create_task(progress(fleet))]
        phases: dict[str, Any] = {}
        try:
            for name in PHASES:
                if name in args.phases:
                    body = watched(getattr(run, name)(), watching)
                    phases[name] = await meter.measure(name, body)
                    replicas.restore()  # two replicas again if one was killed
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return phases, meter.windows, fleet


def run_once(args: argparse.Namespace, *, code: Path, label: str, tmp: Path) -> dict[str, Any]:
    bin_dir = binaries()
    if bin_dir is None:
        raise HarnessError(missing_binaries_message())
    workdir = Path(tempfile.mkdtemp(prefix="cns-scale-", dir=tmp))
    log(f"[{label}] starting etcd and kube-apiserver (audit log on), code {code}")
    cluster = AuditedCluster.start(bin_dir, workdir_parent=str(tmp), extra_users=REPLICA_USERS)
    replicas = Replicas(cluster, code=code, workdir=workdir, lease=args.lease)
    try:
        cluster.apply(code / "config" / "crd")  # the schemas that code writes to
        cluster.apply(code / "config" / "rbac.yaml")
        cluster.apply(replica_bindings())
        load = os.getloadavg()
        phases, windows, fleet = asyncio.run(drive(args, cluster, replicas))
        replicas.stop()
        roles: dict[str, tuple[str, ...]] = {DAEMON_USER: ("fleet",)}
        for index, user in enumerate(REPLICA_USERS):
            roles[user] = (f"replica-{index}", "controller")
        with audit_log(cluster).open() as lines:
            requests = count_requests(lines, roles=roles, windows=windows)
        for name, phase in phases.items():
            counted = requests[name]
            phase["apiRequests"] = {
                "controller": counted["controller"],  # both replicas
                **{role: counted[replica] for role, replica in phase["roles"].items()},
                "fleet": counted["fleet"],
            }
        check = fleet.check
        result = {
            "label": label,
            "code": str(code),
            "commit": _commit(code),
            "nodes": args.nodes,
            "cidr": args.cidr,
            "leaseSeconds": args.lease,
            "loadAverageAtStart": [round(x, 2) for x in load],
            "loadAverageAtEnd": [round(x, 2) for x in os.getloadavg()],
            "phases": phases,
            "nncEventsChecked": check.events,
            "eventsShowingADuplicate": check.events_with_duplicate,
            "duplicateAddresses": len(check.duplicated),
            "duplicateExamples": check.examples,
            "specWrites": fleet.writes,
            "watchRestarts": fleet.watch_restarts,
        }
        if args.keep_logs:
            result["logs"] = str(workdir)
        return result
    finally:
        replicas.stop()
        cluster.stop()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


def replica_bindings() -> list[dict[str, Any]]:
    """The roles config/rbac.yaml grants the controller's service account, for REPLICA_USERS."""
    subjects = [
        {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}
        for user in REPLICA_USERS
    ]
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "name": "cns-controller"}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "cns-scale-replicas", "namespace": KUBE_SYSTEM},
            "roleRef": {**role_ref, "kind": "Role"},
            "subjects": subjects,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "cns-scale-replicas"},
            "roleRef": {**role_ref, "kind": "ClusterRole"},
            "subjects": subjects,
        },
    ]


def _commit(code: Path) -> str:
    answer = subprocess.run(
        ["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return answer.stdout.strip()


def failures(run: dict[str, Any]) -> list[str]:
    """What makes the run fail (exit code 1): duplicates, changes never fulfilled, a fail-over
    that was not measured."""
    found = []
    if run["eventsShowingADuplicate"] or run["duplicateAddresses"]:
        found.append(f"{run['duplicateAddresses']} addresses were in two NNCs")
    for name, phase in run["phases"].items():
        if phase.get("notFulfilled"):
            found.append(f"{name}: {phase['notFulfilled']} changes not fulfilled")
    if "failover" in run["phases"] and run["phases"]["failover"]["recoverySeconds"] is None:
        found.append("failover: no change fulfilled after the leader was killed")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cidr", default="10.0.0.0/12")
    parser.add_argument("--lease", type=int, default=15, help="the controllers' lease, seconds")
    parser.add_argument(
        "--code", action="append", type=Path, help="checkout the controllers run from (repeat)"
    )
    parser.add_argument("--label", action="append", help="a name per --code")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated")
    parser.add_argument("--idle-seconds", type=float, default=30)
    parser.add_argument("--single-changes", type=int, default=100)
    parser.add_argument("--churn-rate", type=float, default=10, help="changes per second")
    parser.add_argument("--churn-seconds", type=float, default=60)
    parser.add_argument("--failover-seconds", type=float, default=0, help="0: 3 leases + 20 s")
    parser.add_argument("--timeout", type=float, default=300, help="per change, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    codes = args.code or [REPO]
    labels = args.label or [path.name for path in codes]
    if len(labels) != len(codes):
        parser.error("give one --label per --code")
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    args.phases = {"initial", *args.phases.split(",")}
    args.failover_seconds = args.failover_seconds or 3 * args.lease + 20
    # SIGTERM ends the run as Ctrl-C does: every `finally` stops its processes, removes its files.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    runs = []
    try:
        for code, label in zip(codes, labels, strict=True):
            runs.append(run_once(args, code=code.resolve(), label=label, tmp=args.tmp))
    except HarnessError as exc:
        print(f"controller_scale: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        run["headlines"] = headlines(run)
        run["ratios"] = ratios(runs[0]["headlines"], run["headlines"])
        run["failures"] = failures(run)
    print(json.dumps({"baseline": runs[0]["label"], "runs": runs}, indent=1))
    print(table(runs), file=sys.stderr)
    for run in runs:
        for failure in run["failures"]:
            print(f"FAILED [{run['label']}]: {failure}", file=sys.stderr)
    return 1 if any(run["failures"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
