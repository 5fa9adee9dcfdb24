"""The scale harness (bench/performance/controller_scale.py) run small, and the parts of it that can
fail.

The whole harness runs against a real etcd, kube-apiserver and two `cns controller` replicas: 30
nodes on a /20, every phase short; every node is fulfilled, no address is seen twice, the
fail-over is measured, the audit log is counted, and the host is left clean. Its duplicate check
is shown to catch a duplicate on a real watch, and its pure parts (fulfilment, releases, CPU and
audit parsing) are checked alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.performance import controller_scale
from tests.harness import REPO
from tests.harness.async_kube import AsyncKube
from tests.harness.audit import Window, count_requests
from tests.harness.kube_api import DAEMON_USER, KUBE_SYSTEM, MERGE_PATCH
from tests.harness.kube_cluster import KubeCluster, binaries, kube_cluster_fixture
from tests.harness.proc_stats import CLOCK_TICKS, cpu_seconds_from_stat, memory_kib_from_status
from tests.harness.requirements import unavailable
from tests.harness.scale_fleet import (
    NNC_PATH,
    OwnershipCheck,
    ScaleFleet,
    fulfilled,
    percentile,
    releases_for,
    request_choices,
)

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


def nnc_with(
    held: list[str], *, request: int = 0, ips_to_release: list[str] | None = None
) -> dict[str, Any]:
    assignments = [{"name": name, "ip": f"10.0.1.{i}"} for i, name in enumerate(held)]
    status: dict[str, Any] = {
        "networkContainers": [{"id": "nc", "primaryIP": "10.0.0.1", "ipAssignments": assignments}]
    }
    if ips_to_release:
        status["ipsToRelease"] = ips_to_release
    return {
        "metadata": {"name": "n1", "resourceVersion": "7"},
        "spec": {"requestedIPCount": request},
        "status": status,
    }


# ---------------------------------------------------------------------- pure parts


def test_ownership_check_counts_every_event_and_finds_an_address_in_two_nncs() -> None:
    check = OwnershipCheck()
    check.update("a", ["10.0.0.1", "10.0.0.2"])
    check.update("b", ["10.0.0.3"])
    assert (check.events, check.events_with_duplicate, check.duplicated) == (2, 0, set())
    check.update("b", ["10.0.0.3", "10.0.0.2"])  # b now lists a's address
    assert check.shared == {"10.0.0.2"} and check.events_with_duplicate == 1
    check.update("a", ["10.0.0.1"])  # a gave it up: resolved, but remembered
    assert check.shared == set() and check.duplicated == {"10.0.0.2"}
    check.update("c", ["10.0.0.9", "10.0.0.9"])  # listed twice by one node
    assert check.shared == {"10.0.0.9"}
    check.remove("c")
    assert check.shared == set() and check.events == 6 and check.events_with_duplicate == 2
    assert "10.0.0.2 listed by ['a', 'b']" in check.examples


def test_fulfilled_needs_the_count_no_address_given_back_and_no_release_asked() -> None:
    assert fulfilled(nnc_with(["x", "y"]), request=2, releasing=[])
    assert not fulfilled(nnc_with(["x", "y"]), request=3, releasing=[])
    assert not fulfilled(nnc_with(["x", "y"]), request=2, releasing=["y"])
    assert not fulfilled(nnc_with(["x", "y"], ips_to_release=["x"]), request=2, releasing=[])
    assert not fulfilled({"metadata": {}, "status": {}}, request=0, releasing=[])


def test_releases_are_what_the_controller_asks_for_plus_the_surplus() -> None:
    rng = random.Random(3)
    held = [f"ip{i}" for i in range(48)]
    released = releases_for(nnc_with(held, request=48, ips_to_release=["ip5"]), request=32, rng=rng)
    assert "ip5" in released and len(set(released)) == 16  # ip5 and 15 of the other 47: 32 kept
    assert releases_for(nnc_with(held), request=64, rng=rng) == []
    assert request_choices(batch=16, low=32, high=64) == [32, 48, 64]
    assert request_choices(batch=8, low=30, high=40) == [32, 40]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99)) == (50.0, 99.0)
    assert percentile([], 0.5) is None


def test_proc_parsing_survives_a_command_name_with_spaces_and_parentheses() -> None:
    fields = ["S"] + ["0"] * 10 + [str(3 * CLOCK_TICKS), str(CLOCK_TICKS)] + ["0"] * 30
    assert cpu_seconds_from_stat("42 (cns (x) y) " + " ".join(fields)) == 4.0
    status = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n"
    assert memory_kib_from_status(status) == {"VmHWM": 2048, "VmRSS": 1024}


def test_audit_counts_by_user_and_window_once_per_request() -> None:
    def event(user: str, at: str, stage: str = "ResponseComplete", code: int = 200) -> str:
        return json.dumps(
            {
                "stage": stage,
                "user": {"username": user},
                "verb": "patch",
                "objectRef": {"resource": "nodenetworkconfigs", "subresource": "status"},
                "responseStatus": {"code": code},
                "requestReceivedTimestamp": at,
            }
        )

    lines = [
        event("c0", "1970-01-01T00:00:01.500000Z"),
        event("c0", "1970-01-01T00:00:01.600000Z", stage="ResponseStarted"),
        event("c1", "1970-01-01T00:00:02.000000Z", code=409),
        event("someone", "1970-01-01T00:00:02.000000Z"),
        event("c1", "1970-01-01T00:00:09.000000Z"),
    ]
    roles = {"c0": ("replica-0", "controller"), "c1": ("replica-1", "controller")}
    counted = count_requests(lines, roles=roles, windows=[Window("w", 1.0, 3.0)])["w"]
    assert counted["controller"]["requests"] == 2 and counted["controller"]["conflicts"] == 1
    assert counted["controller"]["perSecond"] == 1.0
    assert counted["replica-0"]["byVerb"] == {"patch nodenetworkconfigs/status": 1}


# ---------------------------------------------------------------------- on a real apiserver


def test_the_fleet_watch_catches_an_address_granted_to_two_nodes(kube: KubeCluster) -> None:
    """What the harness relies on to fail a run: an address in two NNCs seen on the watch."""
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    names = ["dup-a", "dup-b"]
    for name in names:
        kube.create(
            {
                "apiVersion": "acn.azure.com/v1alpha",
                "kind": "NodeNetworkConfig",
                "metadata": {"name": name, "namespace": KUBE_SYSTEM},
                "spec": {"requestedIPCount": 0},
            }
        )

    def grant(name: str, address: str) -> None:
        nc = {
            "id": f"nc-{name}",
            "primaryIP": f"10.9.0.{names.index(name) + 1}",
            "subnetAddressSpace": "10.9.0.0/24",
            "ipAssignments": [{"name": name, "ip": address}],
        }
        path = f"{NNC_PATH}/{name}/status"
        kube.request("PATCH", path, {"status": {"networkContainers": [nc]}}, MERGE_PATCH)
        kube.request("GET", path).raise_for_status()

    async def watch_while_granting() -> OwnershipCheck:
        async with AsyncKube(
            port=kube.port, ca_file=kube.ca_file, token=kube.tokens[DAEMON_USER]
        ) as daemons:
            fleet = ScaleFleet(daemons, names, seed=1, timeout=10)
            watching = asyncio.create_task(fleet.run_watch())
            await asyncio.wait_for(fleet.appeared.wait(), 30)
            await asyncio.to_thread(grant, "dup-a", "10.9.0.50")
            await asyncio.to_thread(grant, "dup-b", "10.9.0.50")
            for _ in range(100):
                if fleet.check.duplicated:
                    break
                await asyncio.sleep(0.1)
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            return fleet.check

    try:
        check = asyncio.run(watch_while_granting())
    finally:
        for name in names:
            kube.request("DELETE", f"{NNC_PATH}/{name}")
    assert check.duplicated == {"10.9.0.50"}, check.examples
    assert check.events >= 4 and check.events_with_duplicate >= 1


def leftover_processes(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and marker in (proc / "cmdline").read_text():
                found.append(proc.name)
    return found


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Where a harness run keeps everything (clusters, logs); it must be empty afterwards."""
    if binaries() is None:
        unavailable("kube-apiserver/etcd missing: run scripts/build-kubernetes.sh")
    path = tmp_path / "run"
    path.mkdir()
    return path


def harness(run_dir: Path, *options: str) -> list[str]:
    module = "bench.performance.controller_scale"  # run from REPO, as docs/benchmarks.md runs it
    return [sys.executable, "-m", module, "--lease", "3", "--tmp", str(run_dir), *options]


@pytest.mark.slow
def test_the_scale_harness_runs_small_and_leaves_the_host_clean(run_dir: Path) -> None:
    command = harness(
        run_dir,
        "--nodes", "30", "--cidr", "10.0.0.0/20", "--idle-seconds", "3", "--single-changes", "10",
        "--churn-rate", "5", "--churn-seconds", "5", "--failover-seconds", "15",
        "--timeout", "120", "--label", "ci",
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-5000:]
    run = json.loads(done.stdout)["runs"][0]
    assert run["failures"] == [], run["failures"]
    assert run["duplicateAddresses"] == 0 and run["eventsShowingADuplicate"] == 0
    assert run["nncEventsChecked"] > 100  # every node's creation, grants, releases, clears
    phases = run["phases"]
    assert set(phases) == {"initial", "idle", "single", "burst", "churn", "failover"}
    assert phases["initial"]["fulfilled"] == 30 and phases["initial"]["allFulfilledSeconds"]
    for name in ("single", "burst", "churn", "failover"):
        assert phases[name]["changes"] > 0 and phases[name]["notFulfilled"] == 0, phases[name]
    failover = phases["failover"]
    assert failover["newLeader"] not in (None, failover["killed"])
    assert failover["recoverySeconds"] is not None and failover["leaseSeconds"] == 3
    # The standby kept its caches warm: its new term listed nothing.
    taking_over = failover["apiRequests"]["standby"]["byVerb"]
    assert taking_over.get("patch nodenetworkconfigs/status"), taking_over
    assert not [verb for verb in taking_over if verb.startswith("list ")], taking_over
    for name, phase in phases.items():
        assert phase["apiRequests"]["controller"]["requests"] > 0, name
        if name in ("idle", "churn"):  # phases of a fixed length, a lease or longer: renewals
            assert phase["apiRequests"]["leader"]["byVerb"].get("update leases"), name
        survivor = "standby" if name == "failover" else "leader"  # the leader was killed
        assert phase["controller"][survivor]["hwmMiB"], name
    assert phases["churn"]["apiRequests"]["fleet"]["requests"] >= phases["churn"]["changes"]
    assert phases["churn"]["controller"]["leader"]["cores"] > 0
    assert "initial: all fulfilled (s)" in done.stderr  # the table
    assert list(run_dir.iterdir()) == []
    assert leftover_processes(str(run_dir)) == []


@pytest.mark.slow
def test_the_scale_harness_stopped_with_sigterm_leaves_the_host_clean(run_dir: Path) -> None:
    command = harness(run_dir, "--nodes", "10", "--cidr", "10.0.0.0/22", "--idle-seconds", "600")
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # stopped in the middle of a phase, controllers running
            if "phase idle: start" in line:
                break
        assert leftover_processes(str(run_dir))  # the cluster and controllers are running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(run_dir.iterdir()) == []
    assert leftover_processes(str(run_dir)) == []


def test_runs_are_compared_with_the_first_in_the_json_and_the_table() -> None:
    base = {"single: p50 (s)": 2.0, "churn: p50 (s)": None, "single: p99 (s)": 0.0}
    new = {"single: p50 (s)": 1.0, "churn: p50 (s)": 3.0, "single: p99 (s)": 1.0}
    assert controller_scale.ratios(base, new) == {"single: p50 (s)": 0.5}
    runs = [
        {"label": label, "headlines": {**dict.fromkeys(controller_scale.HEADLINES), **figures}}
        for label, figures in (("base", base), ("new", new))
    ]
    runs[0]["ratios"], runs[1]["ratios"] = {}, controller_scale.ratios(base, new)
    rows = {line.split("  ")[0]: line.split() for line in controller_scale.table(runs).splitlines()}
    assert rows["single: p50 (s)"][-3:] == ["2", "1", "0.50"]
    assert rows["churn: p50 (s)"][-3:] == ["-", "3", "nan"]
