"""The daemon as a process: its socket API, debug endpoint, restarts and failure modes."""

from __future__ import annotations

import json
import math
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO
from tests.harness.daemon import unix_request


def add(daemon: Any, n: int, **extra: Any) -> tuple[int, Any]:
    body = {"containerID": f"c{n}", "ifName": "eth0", "netns": f"/run/netns/p{n}", **extra}
    return daemon.call("POST", "/v1/cni/add", body)


def cns_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )


def formula(demand: int, batch: int = 16, mf: float = 0.5, primary: int = 1) -> int:
    return batch * math.ceil(mf + demand / batch) - primary


def test_add_del_check_gc_status(make_daemon: Any) -> None:
    daemon = make_daemon()
    status, body = add(daemon, 1, podName="web-1", podNamespace="shop")
    assert status == 200, body
    address = body["ips"][0]["address"]
    assert address.startswith("10.240.") and address.endswith("/22")
    assert body["ips"][0]["gateway"] == "10.240.0.1"
    assert body["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.240.0.1"}]
    assert add(daemon, 1)[1]["ips"] == body["ips"]  # idempotent

    owner = next(ip["owner"] for ip in daemon.ips() if ip["owner"])
    assert owner == {
        "containerID": "c1",
        "ifName": "eth0",
        "podName": "web-1",
        "podNamespace": "shop",
    }
    check = {"containerID": "c1", "ifName": "eth0", "ips": [address]}
    assert daemon.call("POST", "/v1/cni/check", check)[0] == 200
    status, err = daemon.call("POST", "/v1/cni/check", {**check, "ips": ["10.9.9.9/22"]})
    assert (status, err["code"]) == (409, 104)
    status, err = daemon.call("POST", "/v1/cni/check", {"containerID": "zz", "ifName": "eth0"})
    assert (status, err["code"]) == (404, 3)

    add(daemon, 2)
    add(daemon, 3)
    gc = {"validAttachments": [{"containerID": "c2", "ifname": "eth0"}]}
    status, body = daemon.call("POST", "/v1/cni/gc", gc)
    assert status == 200 and len(body["released"]) == 2
    assert {ip["owner"]["containerID"] for ip in daemon.ips() if ip["owner"]} == {"c2"}

    status, body = daemon.call("POST", "/v1/cni/del", {"containerID": "c2", "ifName": "eth0"})
    assert status == 200 and body["released"]
    status, body = daemon.call("POST", "/v1/cni/del", {"containerID": "c2", "ifName": "eth0"})
    assert status == 200 and body["released"] is None
    assert daemon.call("GET", "/v1/cni/status") == (200, {"ready": True})
    mode = stat.S_IMODE(daemon.socket.stat().st_mode)
    assert mode == 0o600


def test_bad_requests_get_cni_errors(make_daemon: Any) -> None:
    daemon = make_daemon()
    sock = daemon.socket
    raw = (
        b"POST /v1/cni/add HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Connection: close\r\n\r\n{nope"
    )
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert b" 400 " in reply.split(b"\r\n")[0]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["code"] == 6
    assert daemon.call("POST", "/v1/cni/add", [1])[1]["code"] == 6
    status, err = daemon.call("POST", "/v1/cni/add", {"ifName": "eth0"})
    assert (status, err["code"]) == (400, 4) and "containerID" in err["msg"]
    status, err = daemon.call(
        "POST", "/v1/cni/add", {"containerID": "c", "ifName": "e", "podName": 3}
    )
    assert (status, err["code"]) == (400, 7) and "podName" in err["msg"]
    status, err = daemon.call("POST", "/v1/cni/gc", {"validAttachments": "all"})
    assert (status, err["code"]) == (400, 7)
    status, err = daemon.call("GET", "/v1/nothing")
    assert status == 404 and "code" in err
    assert daemon.pool()["ips"]["Assigned"] == 0  # nothing was half-done


def test_burst_of_adds_grows_the_pool_in_one_step(make_daemon: Any) -> None:
    daemon = make_daemon({"standalone": {"allocationLatencyMs": 300}})
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda n: add(daemon, n), range(40)))
    assert all(status == 200 for status, _ in results), results
    addresses = [body["ips"][0]["address"] for _, body in results]
    assert len(set(addresses)) == 40
    pool_view = daemon.wait_pool(lambda p: p["requestedIPCount"] == formula(40))
    assert pool_view["ips"]["Assigned"] == 40
    assert pool_view["demand"] == 40
    waits = [body["waitedSeconds"] for _, body in results]
    assert max(waits) < 5  # they waited for one allocation round, not one per batch
    metrics = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics"))}
    wait_count = next(
        s.value for s in metrics["cns_add_ip_wait_seconds"].samples if s.name.endswith("_count")
    )
    assert wait_count >= 25  # the ADDs beyond the first 15 free IPs waited
    published = metrics["cns_pool_requests_published"].samples[0].value
    assert published <= 3  # start-up request plus the burst (possibly split in two)
    commits = metrics["cns_state_commits"].samples[0].value
    timed = {s.name: s.value for s in metrics["cns_state_commit_duration_seconds"].samples}
    assert 0 < commits == timed["cns_state_commit_duration_seconds_count"]
    assert timed["cns_state_commit_duration_seconds_sum"] > 0


def test_exhausted_subnet_fails_adds_with_code_11_and_says_why(make_daemon: Any) -> None:
    daemon = make_daemon(
        {
            "addTimeoutSeconds": 0.5,
            # Released IPs cool down before the pool lets them go (docs: cooldown and
            # exhaustion); a short cooldown keeps the recovery below quick.
            "ipCooldownSeconds": 1,
            "standalone": {
                "subnet": "10.9.0.0/27",
                "exhaustion": {"upperPercent": 80, "lowerPercent": 40},
            },
        }
    )
    statuses = [add(daemon, n) for n in range(40)]
    ok = [s for s, _ in statuses if s == 200]
    failed = [b for s, b in statuses if s != 200]
    assert len(ok) == 28  # 32 addresses - network, broadcast, gateway, primary
    assert failed and all(b["code"] == 11 for b in failed)
    assert "subnet exhausted" in failed[-1]["msg"]
    pool = daemon.pool()
    assert pool["subnetExhausted"] is True and pool["batchSize"] == 1
    status, _body = daemon.call("GET", "/v1/cni/status")
    assert status == 200  # exhausted but still able to grow one at a time
    for n in range(28):
        daemon.call("POST", "/v1/cni/del", {"containerID": f"c{n}", "ifName": "eth0"})
    # With everything free the subnet recovers and the pool returns to one batch.
    pool = daemon.wait_pool(lambda p: not p["subnetExhausted"] and p["requestedIPCount"] == 15)
    assert pool["ips"]["Assigned"] == 0


def test_slow_control_plane_reports_allocation_pending(make_daemon: Any) -> None:
    daemon = make_daemon({"addTimeoutSeconds": 0.3, "standalone": {"allocationLatencyMs": 3000}})
    # A fresh node starts from an empty network container; its first batch takes 3 s.
    status, body = add(daemon, 0)
    assert status == 503 and body["code"] == 11
    assert "allocation still pending" in body["msg"]


def test_metrics_are_prometheus_text(make_daemon: Any) -> None:
    daemon = make_daemon()
    add(daemon, 1)
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics"))}
    states = {s.labels["state"]: s.value for s in families["cns_pool_ips"].samples}
    assert states["Assigned"] == 1
    assert set(states) == {"Available", "Assigned", "PendingRelease", "PendingProgramming",
                           "Cooldown"}  # fmt: skip
    assert families["cns_batch_size"].samples[0].value == 16
    assert families["cns_requested_ip_count"].samples[0].value == 15
    assert families["cns_subnet_exhausted"].samples[0].value == 0
    latency = families["cns_cni_request_duration_seconds"]
    assert latency.type == "histogram"
    assert any(s.labels.get("verb") == "add" for s in latency.samples)
    assert daemon.get("/healthz") == {"ok": True}


def test_a_released_ip_cools_down_before_reuse_even_across_a_restart(make_daemon: Any) -> None:
    """An IP a pod gave back is not handed to the next pod before `ipCooldownSeconds`, also
    after a restart: an ADD finding only cooling IPs fails (code 11, saying so) or, when the
    cooldown ends within its timeout, waits for it and gets the IP then."""
    daemon = make_daemon(
        {"ipCooldownSeconds": 8, "addTimeoutSeconds": 3, "scaler": {"maxIPCount": 3}}
    )  # two secondary IPs at most: the pool cannot grow around the cooling one
    first = add(daemon, 0)[1]["ips"][0]["address"].split("/")[0]
    add(daemon, 1)
    assert daemon.call("POST", "/v1/cni/del", {"containerID": "c0", "ifName": "eth0"})[0] == 200

    def row(address: str) -> dict[str, Any]:
        return next(ip for ip in daemon.ips() if ip["address"] == address)

    cooling = row(first)
    assert cooling["state"] == "Cooldown" and cooling["owner"] is None
    assert daemon.stop(signal.SIGTERM) == 0
    daemon.start()
    assert row(first) == cooling  # same end, from the state file

    status, body = add(daemon, 2)
    assert status != 200 and body["code"] == 11, body
    assert "in cooldown" in body["msg"], body
    ends = time.mktime(time.strptime(cooling["cooldownEndsAt"][:19], "%Y-%m-%dT%H:%M:%S"))
    ends -= time.timezone  # the field is UTC
    while ends - time.time() > 2:  # the rest of the cooldown now fits in the ADD's 3 s
        time.sleep(0.2)
    status, body = add(daemon, 2)
    assert status == 200 and body["ips"][0]["address"].split("/")[0] == first, body
    log = daemon.log()
    assert log.rindex('"ip_cooldown_ended"') < log.rindex('"container_id": "c2"')


def test_a_warm_floor_holds_ips_before_the_first_pod(make_daemon: Any) -> None:
    """`scaler.minIPCount`: an empty node already holds the floor (in whole batches, after the
    primary IP), so its first pods never wait for the control plane."""
    daemon = make_daemon({"scaler": {"minIPCount": 20}})
    pool = daemon.wait_pool(lambda p: p["ips"]["Available"] == 31)  # 2 batches of 16 - 1 primary
    assert (pool["requestedIPCount"], pool["minIPCount"], pool["demand"]) == (31, 20, 0)
    replies = [add(daemon, n)[1] for n in range(20)]
    assert all(reply["ips"] for reply in replies)
    served = [json.loads(line) for line in daemon.log().splitlines() if "ip_assigned" in line]
    assert [entry["waited_seconds"] for entry in served] == [0.0] * 20  # none had to wait
    assert daemon.pool()["ips"]["Assigned"] == 20


def test_status_pod_says_what_a_pod_waits_for_and_debug_ips_filters(make_daemon: Any) -> None:
    """`cns status --pod NS/NAME` in one screen: a pod's IP, or what it waits for and the
    figures (here the node at maxIPCount, then an IP in cooldown); /debug/ips filters by
    state, pod and container, and refuses a filter it cannot use, naming it."""
    daemon = make_daemon({"addTimeoutSeconds": 8, "scaler": {"maxIPCount": 3}})
    url = daemon.debug_url

    def pod_add(n: int, name: str) -> tuple[int, Any]:
        return add(daemon, n, podName=name, podNamespace="shop")

    first = pod_add(0, "a")[1]["ips"][0]["address"].split("/")[0]
    pod_add(1, "b")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(pod_add, 2, "c")
        daemon.wait_pool(lambda p: p["waitingAdds"] == 1)
        shown = cns_cli("status", "--debug-url", url, "--pod", "shop/c")
        assert shown.returncode == 0, shown.stderr
        assert "pod shop/c is waiting for an IP" in shown.stdout
        assert (
            "why: node at maxIPCount (3)" in shown.stdout and "ADD for container c2" in shown.stdout
        )
        view = json.loads(cns_cli("status", "--debug-url", url, "--pod", "shop/c", "--json").stdout)
        assert view["reason"]["code"] == "max-ip-count" and view["reason"]["assigned"] == 2

        assert daemon.call("POST", "/v1/cni/del", {"containerID": "c0", "ifName": "eth0"})[0] == 200
        view = daemon.get("/debug/pod?pod=shop/c")
        assert view["state"] == "waiting" and view["reason"]["code"] == "cooldown", view
        assert view["reason"]["nextCooldownEndsAt"]
        assert waiting.result()[0] != 200  # the cooldown (30 s) outlasts the ADD's 8 s

    shown = cns_cli("status", "--debug-url", url, "--pod", "shop/b")
    assert "pod shop/b has its IP" in shown.stdout and "Assigned" in shown.stdout
    assert "has no IP from cns on this node" in cns_cli(
        "status", "--debug-url", url, "--pod", "shop/nobody").stdout  # fmt: skip

    assert [ip["address"] for ip in daemon.get("/debug/ips?state=Cooldown")["ips"]] == [first]
    assert [ip["owner"]["podName"] for ip in daemon.get("/debug/ips?pod=shop/b")["ips"]] == ["b"]
    assert len(daemon.get("/debug/ips?container=c1&state=Assigned")["ips"]) == 1
    for query, field in (("state=Bogus", "state: 'Bogus'"), ("pod=shop", "pod: 'shop'"),
                         ("colour=red", "unknown parameter(s) colour")):  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/debug/ips?{query}", timeout=10)
        body = json.load(refused.value)
        assert refused.value.code == 400 and field in body["error"], (query, body)
    bad = cns_cli("status", "--debug-url", url, "--pod", "no-slash")
    assert bad.returncode == 2 and "NAMESPACE/NAME" in bad.stderr


def test_restart_keeps_owners_and_sigterm_is_clean(make_daemon: Any) -> None:
    daemon = make_daemon()
    before = {n: add(daemon, n)[1]["ips"][0]["address"] for n in range(20)}
    assert daemon.stop(signal.SIGTERM) == 0
    assert not daemon.socket.exists()
    assert '"cns_stopped"' in daemon.log()
    daemon.start()
    after = {n: add(daemon, n)[1]["ips"][0]["address"] for n in range(20)}
    assert before == after
    assert daemon.pool()["ips"]["Assigned"] == 20


def test_corrupt_state_stops_the_daemon_naming_the_file(make_daemon: Any) -> None:
    daemon = make_daemon(start=False)
    daemon.state_dir.mkdir()
    state = daemon.state_dir / "state.db"
    state.write_bytes(b"garbage" * 1000)
    proc = cns_cli("run", "--config", str(daemon.config_path))
    assert proc.returncode == 1
    assert str(state) in proc.stderr and "refusing to start" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert state.read_bytes() == b"garbage" * 1000


def test_bad_config_exits_2_naming_the_key(make_daemon: Any) -> None:
    daemon = make_daemon({"scaler": {"batchSize": -3}}, start=False)
    proc = cns_cli("run", "--config", str(daemon.config_path))
    assert proc.returncode == 2
    assert "scaler.batchSize" in proc.stderr


def test_second_daemon_on_the_same_socket_is_refused(make_daemon: Any) -> None:
    daemon = make_daemon()
    proc = cns_cli(
        "run",
        "--config",
        str(daemon.config_path),
        "--state-dir",
        str(daemon.workdir / "other"),
        "--debug-listen",
        "127.0.0.1:0",
    )
    assert proc.returncode == 1 and "already running" in proc.stderr
    assert daemon.socket.exists()
    assert unix_request(daemon.socket, "GET", "/v1/cni/status")[0] == 200


def test_release_queue_is_applied_at_start(make_daemon: Any) -> None:
    daemon = make_daemon()
    assert add(daemon, 1)[0] == 200
    daemon.stop()
    queue = daemon.state_dir / "release-queue"
    queue.mkdir(exist_ok=True)
    (queue / "c1_eth0.json").write_text(
        json.dumps({"containerID": "c1", "ifName": "eth0", "queuedAt": time.time()})
    )
    (queue / "broken_eth0.json").write_text("{not json")
    daemon.start()
    assert daemon.pool()["ips"]["Assigned"] == 0
    assert not (queue / "c1_eth0.json").exists()
    assert (queue / "quarantine" / "broken_eth0.json").read_text() == "{not json"
    assert "release_queue_entries_invalid" in daemon.log()


def test_cns_status_prints_the_pool_table(make_daemon: Any) -> None:
    daemon = make_daemon()
    add(daemon, 1, podName="web", podNamespace="shop")
    cmd = ["status", "--debug-url", daemon.debug_url]
    table = cns_cli(*cmd, "--ips")
    assert table.returncode == 0, table.stderr
    assert "requestedIPCount         15" in table.stdout
    assert "Assigned            1" in table.stdout
    assert "shop/web" in table.stdout
    assert "leakCheck                off" in table.stdout
    as_json = cns_cli(*cmd, "--json")
    assert json.loads(as_json.stdout)["requestedIPCount"] == 15
    down = cns_cli("status", "--debug-url", "http://127.0.0.1:1")
    assert down.returncode == 1 and "cannot read" in down.stderr


def test_ipv6_subnet(make_daemon: Any) -> None:
    daemon = make_daemon({"standalone": {"subnet": "fd00:10::/120"}})
    status, body = add(daemon, 1)
    assert status == 200, body
    assert body["ips"][0]["address"].startswith("fd00:10::") and body["ips"][0]["address"].endswith(
        "/120"
    )
    assert body["ips"][0]["gateway"] == "fd00:10::1"
    assert body["routes"] == [{"dst": "::/0", "gw": "fd00:10::1"}]


def test_a_subnet_removed_from_the_config_drains_after_a_restart(make_daemon: Any) -> None:
    """`standalone.subnets` loses its IPv6 entry while a pod holds an address of it: the daemon
    starts, says so, keeps the pod's addresses until its DEL, refuses an ADD naming the subnet
    at once (code 11 naming it, not a wait for a container that never comes), and forgets the
    subnet once its last address is freed."""
    six = {"name": "v6pods", "subnet": "fd00:5::/112"}
    daemon = make_daemon({"addTimeoutSeconds": 20, "standalone": {"subnets": [six]}})
    both = ["standalone", "v6pods"]
    status, body = add(daemon, 1, subnets=both)
    assert status == 200 and len(body["ips"]) == 2, body
    held = sorted(ip["address"] for ip in daemon.ips() if ip["owner"])
    assert daemon.stop(signal.SIGTERM) == 0
    config = yaml.safe_load(daemon.config_path.read_text())
    del config["standalone"]["subnets"]
    daemon.config_path.write_text(yaml.safe_dump(config))
    daemon.start()
    assert sorted(ip["address"] for ip in daemon.ips() if ip["owner"]) == held
    assert '"subnet_removed"' in daemon.log()
    lane = daemon.pool()["subnets"]["v6pods"]
    assert lane["removed"] is True and lane["ips"]["Assigned"] == 1
    assert daemon.metrics()['cns_lane_removed{subnet="v6pods"}'] == 1
    started = time.monotonic()
    status, body = add(daemon, 2, subnets=both)
    assert (status, body["code"]) == (503, 11) and "subnet v6pods was removed" in body["msg"]
    assert time.monotonic() - started < 10  # at once, not after addTimeoutSeconds
    assert add(daemon, 3)[0] == 200  # the primary subnet serves as ever
    status, body = daemon.call("POST", "/v1/cni/del", {"containerID": "c1", "ifName": "eth0"})
    assert status == 200 and body["released"], body
    pool = daemon.wait_pool(lambda p: "subnets" not in p, "the removed subnet gone")
    assert pool["ips"]["Assigned"] == 1
    assert '"subnet_drained"' in daemon.log()


@pytest.mark.parametrize("applied_by", ["restart", "SIGHUP"])
def test_reserved_ranges_are_never_assigned_and_one_added_over_held_ips_takes_none_from_a_pod(
    make_daemon: Any, applied_by: str
) -> None:
    """Standalone `reservedIPs` (addresses, CIDRs, ranges): no ADD gets one. A range added over
    IPs the node holds, by a restart or at run time (SIGHUP reads the file's reservations
    again): the pod keeps its address, the free ones are given back and replaced from outside
    the range, and the pod's goes too once it is deleted."""
    subnet = {"subnet": "10.77.0.0/26", "reservedIPs": ["10.77.0.3-10.77.0.9", "10.77.0.10/31"]}
    daemon = make_daemon({"standalone": subnet, "ipCooldownSeconds": 0})
    first = add(daemon, 0)[1]["ips"][0]["address"].split("/")[0]
    assert first == "10.77.0.12"  # .1 the gateway, .2 the primary, .3-.11 reserved
    held = {ip["address"] for ip in daemon.ips()}
    assert not held & {f"10.77.0.{n}" for n in range(3, 12)}, held

    if applied_by == "restart":
        assert daemon.stop(signal.SIGTERM) == 0
    config = yaml.safe_load(daemon.config_path.read_text())
    config["standalone"]["reservedIPs"].append("10.77.0.12-10.77.0.20")
    daemon.config_path.write_text(yaml.safe_dump(config))
    if applied_by == "restart":
        daemon.start()
    else:  # a broken file first: nothing changes, and the daemon says why
        good = daemon.config_path.read_text()
        daemon.config_path.write_text("standalone: [")
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while '"config_reload_failed"' not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert '"config_reload_failed"' in daemon.log()
        assert daemon.proc.poll() is None  # still serving, on the reservations it had
        daemon.config_path.write_text(good)
        daemon.proc.send_signal(signal.SIGHUP)
    reserved = {f"10.77.0.{n}" for n in range(3, 21)}

    def settled(pool: dict[str, Any]) -> bool:
        rows = daemon.ips()
        return pool["ips"]["Available"] > 0 and all(
            row["address"] not in reserved or row["state"] == "Assigned" for row in rows
        )

    daemon.wait_pool(settled)
    (mine,) = [row for row in daemon.ips() if row["state"] == "Assigned"]
    assert (mine["address"], mine["owner"]["containerID"]) == (first, "c0")
    log = daemon.log()
    assert '"reserved_address_held"' in log and first in log
    second = add(daemon, 1)[1]["ips"][0]["address"].split("/")[0]
    assert second not in reserved and second != first

    assert daemon.call("POST", "/v1/cni/del", {"containerID": "c0", "ifName": "eth0"})[0] == 200
    daemon.wait_pool(lambda pool: all(row["address"] != first for row in daemon.ips()))
    third = add(daemon, 2)[1]["ips"][0]["address"].split("/")[0]
    assert third not in reserved
