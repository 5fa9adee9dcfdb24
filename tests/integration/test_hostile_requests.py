"""One request can never hurt another: hostile and broken input against a real daemon.

Every bad request gets a CNI error naming what is wrong, changes nothing, and leaves the daemon
serving everybody else; nothing is logged as an internal error or with a multi-line traceback.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

GOOD = {"containerID": "c1", "ifName": "eth0", "netns": "/run/netns/p1"}


def raw_exchange(
    address: str | tuple[str, int], data: bytes, close_after_send: bool = False
) -> bytes:
    """Send `data` as is on a fresh connection and read until EOF."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(address)
        sock.sendall(data)
        if close_after_send:
            return b""
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: cns\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def error_of(reply: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def samples(daemon: Any, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    families = {f.name: f for f in text_string_to_metric_families(daemon.get("/metrics"))}
    return {
        tuple(sorted(s.labels.items())): s.value
        for s in families[name].samples
        if s.name == f"{name}_count" or s.name == name
    }


def log_events(daemon: Any) -> list[dict[str, Any]]:
    """Every log line, parsed: each must be one JSON object (one event per line)."""
    return [json.loads(line) for line in daemon.log().splitlines() if line.strip()]


BAD_IDENTIFIERS = [
    ("/v1/cni/add", {**GOOD, "containerID": "../../etc/x"}, "containerID"),
    ("/v1/cni/add", {**GOOD, "containerID": "a\x00b"}, "containerID"),
    ("/v1/cni/add", {**GOOD, "containerID": "c" * 1025}, "containerID: longer than 1024"),
    ("/v1/cni/add", {**GOOD, "ifName": "eth0/../x"}, "ifName"),
    ("/v1/cni/add", {**GOOD, "ifName": "e" * 16}, "ifName: longer than 15"),
    ("/v1/cni/add", {**GOOD, "ifName": ".."}, "ifName"),
    ("/v1/cni/add", {**GOOD, "ifName": "eth\x000"}, "ifName"),
    ("/v1/cni/add", {**GOOD, "podName": "p" * 1_000_000}, "podName: longer than 253 characters"),
    ("/v1/cni/add", {**GOOD, "podName": "web\ud800"}, "podName"),
    ("/v1/cni/add", {**GOOD, "podName": "web\nx"}, "podName"),
    ("/v1/cni/add", {**GOOD, "podNamespace": "n" * 64}, "podNamespace: longer than 63"),
    ("/v1/cni/add", {**GOOD, "podNamespace": "a/b"}, "podNamespace"),
    ("/v1/cni/add", {**GOOD, "netns": "/run/netns/\x00"}, "netns"),
    ("/v1/cni/add", {**GOOD, "netns": "/" + "n" * 5000}, "netns: longer than 4095 bytes"),
    ("/v1/cni/del", {"containerID": "\ud800", "ifName": "eth0"}, "containerID"),
    ("/v1/cni/check", {"containerID": "c1", "ifName": "a:b"}, "ifName"),
    ("/v1/cni/attach", {**GOOD, "podName": "\ud800"}, "podName"),
    ("/v1/cni/detach", {"containerID": "-x", "ifName": "eth0"}, "containerID"),
    ("/v1/cni/verify", {**GOOD, "netns": "\x01"}, "netns"),
    (
        "/v1/cni/gc",
        {"validAttachments": [{"containerID": "ok", "ifname": "eth0"},
                              {"containerID": "ok", "ifname": "e/0"}]},
        "validAttachments[1].ifname",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "named"), BAD_IDENTIFIERS)
def test_identifiers_are_validated_naming_the_field(
    make_daemon: Any, path: str, body: dict[str, Any], named: str
) -> None:
    daemon = make_daemon()
    status, err = daemon.call("POST", path, body)
    assert (status, err["code"]) == (400, 4), err
    assert err["msg"].startswith(named), err
    assert daemon.pool()["ips"]["Assigned"] == 0
    assert daemon.get("/healthz") == {"ok": True}
    failed = [e for e in log_events(daemon) if e["event"] == "cni_request_failed"]
    assert [(e["verb"], e["code"]) for e in failed] == [(path.rsplit("/", 1)[1], 4)], failed
    assert failed[0]["msg"].startswith(named) and len(failed[0]["msg"]) <= 512, failed


@pytest.mark.parametrize(
    ("subnets", "problem"),
    [
        ("v6pods", "must be a list of subnet names"),
        (["v6pods", "v6pods"], "names a subnet twice"),
        (["a", "b", "c", "d", "e"], "names 5 subnets, at most 4"),
        (["ok", "x/y"], "[1] must start with a letter or digit"),
    ],
)
def test_the_subnets_of_an_add_are_validated_naming_the_field(
    make_daemon: Any, subnets: object, problem: str
) -> None:
    daemon = make_daemon()
    status, err = daemon.call("POST", "/v1/cni/add", {**GOOD, "subnets": subnets})
    assert (status, err["code"]) == (400, 7), err
    assert err["msg"].startswith("subnets: ") and problem in err["msg"], err
    assert daemon.pool()["ips"]["Assigned"] == 0


DUAL = {
    "standalone": {
        "name": "v4pods",
        "subnet": "10.242.0.0/24",
        "subnets": [{"name": "v6pods", "subnet": "fd00:242::/64"}],
    }
}
BOTH = ["v4pods", "v6pods"]


def test_requested_addresses_that_do_not_fit_are_refused_naming_the_field(
    make_daemon: Any,
) -> None:
    """`requestedIP` with an address of each family, against a dual-stack daemon: every
    request that cannot be right is 400, code 7, naming the field and what is wrong, and takes
    nothing; the good pair then gets exactly those addresses."""
    daemon = make_daemon(DUAL)
    daemon.wait_pool(
        lambda p: p["ips"]["Available"] >= 4 and p["subnets"]["v6pods"]["ips"]["Available"] >= 4
    )
    cases: list[tuple[object, list[str], str]] = [
        (["10.242.0.9"], BOTH, "requestedIP must be a string"),
        ("10.242.0.9,10.242.0.10", BOTH, "10.242.0.9 and 10.242.0.10 are both IPv4"),
        ("10.242.0.9,fd00:242::9,fd00:242::a", BOTH, "more than two addresses"),
        ("10.242.0.9;fd00:242::9", BOTH, "'10.242.0.9;fd00:242::9' is not an IP address"),
        ("\ud800,fd00:242::9", BOTH, "'\\ud800' is not an IP address"),
        ("10.242.0.9,fd00:242::9", ["v6pods"], "2 addresses (10.242.0.9, fd00:242::9) for 1"),
        ("10.9.9.9,fd00:242::9", BOTH, "10.9.9.9 is in none of the subnets the ADD names"),
        ("10.242.0.9", ["v6pods"], "10.242.0.9 is in subnet v4pods, which the ADD does not "
         "name (it names v6pods)"),
    ]  # fmt: skip
    for requested, subnets, problem in cases:
        body = {**GOOD, "requestedIP": requested, "subnets": subnets}
        status, err = daemon.call("POST", "/v1/cni/add", body)
        assert (status, err["code"]) == (400, 7), err
        assert err["msg"].startswith("requestedIP") and problem in err["msg"], err
    pool = daemon.pool()
    assert pool["ips"]["Assigned"] == pool["subnets"]["v6pods"]["ips"]["Assigned"] == 0
    pair = {**GOOD, "requestedIP": "fd00:242::9,10.242.0.9", "subnets": BOTH}
    status, reply = daemon.call("POST", "/v1/cni/add", pair)
    assert status == 200, reply
    assert [ip["address"] for ip in reply["ips"]] == ["10.242.0.9/24", "fd00:242::9/64"]


def test_a_bad_add_does_not_fail_the_good_adds_sharing_its_commit(make_daemon: Any) -> None:
    """A lone surrogate cannot be encoded for SQLite: accepted, it failed the group commit of
    every ADD beside it, and the daemon stopped. Refused at the door, it touches nothing."""
    daemon = make_daemon({"scaler": {"batchSize": 64}})
    daemon.wait_pool(lambda p: p["ips"]["Available"] >= 40)
    bad = [{**GOOD, "containerID": f"bad{n}", "podName": "\ud800"} for n in range(10)]
    good = [{**GOOD, "containerID": f"good{n}", "podName": f"web-{n}"} for n in range(30)]
    mixed = [body for pair in itertools.zip_longest(good, bad) for body in pair if body]
    with ThreadPoolExecutor(len(mixed)) as pool:
        replies = list(pool.map(lambda b: daemon.call("POST", "/v1/cni/add", b), mixed))
    for body, (status, reply) in zip(mixed, replies, strict=True):
        if body["containerID"].startswith("good"):
            assert status == 200, reply
        else:
            assert (status, reply["code"]) == (400, 4) and reply["msg"].startswith("podName")
    assert daemon.get("/healthz") == {"ok": True}
    assert daemon.stop() == 0
    daemon.start()
    owners = {ip["owner"]["containerID"] for ip in daemon.ips() if ip["owner"]}
    assert owners == {f"good{n}" for n in range(30)}


def test_deeply_nested_json_is_code_6(make_daemon: Any) -> None:
    daemon = make_daemon()
    nested = b'{"containerID": "c1", "ifName": "eth0", "x": ' + b"[" * 100_000 + b"]" * 100_000
    status, err = error_of(raw_exchange(str(daemon.socket), post("/v1/cni/add", nested + b"}")))
    assert (status, err["code"]) == (400, 6) and "nested too deeply" in err["details"]
    status, err = error_of(raw_exchange(str(daemon.socket), post("/v1/cni/add", b"\xff{}")))
    assert (status, err["code"]) == (400, 6)
    counts = samples(daemon, "cns_cni_request_duration_seconds")
    assert counts == {(("result", "error6"), ("verb", "add")): 2}
    assert "api_internal_error" not in daemon.log()


def test_a_client_leaving_mid_body_is_not_an_internal_error(make_daemon: Any) -> None:
    daemon = make_daemon()
    head = post("/v1/cni/add", b"x" * 100)[:-90]  # promises 100 bytes, sends 10
    raw_exchange(str(daemon.socket), head, close_after_send=True)
    deadline = time.monotonic() + 10
    while "api_request_aborted" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    counts = samples(daemon, "cns_cni_request_duration_seconds")
    assert counts == {(("result", "aborted"), ("verb", "add")): 1}
    events = [e["event"] for e in log_events(daemon)]
    assert "api_request_aborted" in events
    assert "api_internal_error" not in events and "http_server_error" not in events
    assert "Traceback" not in daemon.log()
    assert daemon.call("POST", "/v1/cni/add", GOOD)[0] == 200


@pytest.mark.parametrize(
    "garbage",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /debug/pool HTTP/1.1\r\nBad Header\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS client hello
        b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
    ],
)
def test_malformed_http_is_one_log_line(make_daemon: Any, garbage: bytes) -> None:
    daemon = make_daemon()
    for address in (str(daemon.socket), ("127.0.0.1", daemon.port)):
        reply = raw_exchange(address, garbage)
        assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n")[0]
    events = log_events(daemon)  # every line is one JSON event
    bad = [e for e in events if e["event"] == "http_bad_request"]
    assert {e["listener"] for e in bad} == {"socket", "debug"} and len(bad) == 2
    assert all(e["reason"] and "\n" not in e["reason"] for e in bad)
    assert next(e for e in bad if e["listener"] == "debug")["peer"] == "127.0.0.1"
    assert "Traceback" not in daemon.log()


@pytest.mark.parametrize(
    "garbage",
    [
        b"QCIN /" + b"a" * 7000 + b" HTTP/1.1\r\n\r\n",  # aiohttp quotes the request line
        b"GET /healthz HTTP/1.1\r\nHost: cns\r\nConnection: close\r\n\r\n" + b"x" * 60_000,
    ],
)
def test_a_bad_request_cannot_copy_itself_into_the_log(make_daemon: Any, garbage: bytes) -> None:
    """aiohttp's parser errors quote what the client sent, up to a whole read: any local user
    could have the daemon write a 64 KiB log line per connection to the debug port (and a
    client of the socket, 200 KiB). The reason is cut to a bounded length."""
    daemon = make_daemon()
    for address in (str(daemon.socket), ("127.0.0.1", daemon.port)):
        reply = raw_exchange(address, garbage)
        assert b" 400 " in reply.split(b"\r\n")[0]
    lines = [line for line in daemon.log().splitlines() if '"http_bad_request"' in line]
    assert len(lines) == 2
    assert all(len(line) < 1024 for line in lines), [len(line) for line in lines]
    reasons = [json.loads(line)["reason"] for line in lines]
    assert all(r.startswith(("Invalid method", "Data after")) for r in reasons), reasons


def test_add_for_an_attachment_of_another_pod_is_refused(make_daemon: Any) -> None:
    daemon = make_daemon()
    web = {**GOOD, "podName": "web", "podNamespace": "shop"}
    status, reply = daemon.call("POST", "/v1/cni/add", web)
    assert status == 200
    first = reply["ips"]
    status, err = daemon.call("POST", "/v1/cni/add", {**web, "podName": "db"})
    assert (status, err["code"]) == (409, 4)
    assert "shop/web" in err["msg"] and "shop/db" in err["msg"]
    status, err = daemon.call("POST", "/v1/cni/add", {**web, "podNamespace": "other"})
    assert (status, err["code"]) == (409, 4)
    # Without pod names (cns-ipam without K8S_* args), or the same pod again: the same IP.
    assert daemon.call("POST", "/v1/cni/add", GOOD)[1]["ips"] == first
    assert daemon.call("POST", "/v1/cni/add", web)[1]["ips"] == first
    # An owner that had no pod names learns them, as before.
    assert daemon.call("POST", "/v1/cni/add", {**GOOD, "containerID": "c2"})[0] == 200
    named = {**GOOD, "containerID": "c2", "podName": "late", "podNamespace": "shop"}
    assert daemon.call("POST", "/v1/cni/add", named)[0] == 200
    assert daemon.stop() == 0
    daemon.start()
    owners = {ip["owner"]["containerID"]: ip["owner"] for ip in daemon.ips() if ip["owner"]}
    assert owners["c1"]["podName"] == "web" and owners["c2"]["podName"] == "late"
    assert daemon.call("POST", "/v1/cni/add", {**web, "podName": "db"})[0] == 409


def test_a_waiting_add_for_another_pod_is_refused_at_once(make_daemon: Any) -> None:
    """Both ADDs wait for the first batch: the second names another pod and is refused."""
    daemon = make_daemon({"addTimeoutSeconds": 15, "standalone": {"allocationLatencyMs": 1500}})
    web = {**GOOD, "podName": "web", "podNamespace": "shop"}
    first: list[tuple[int, Any]] = []
    waiting = threading.Thread(target=lambda: first.append(daemon.call("POST", "/v1/cni/add", web)))
    waiting.start()
    daemon.wait_pool(lambda p: p["waitingAdds"] == 1)
    status, err = daemon.call("POST", "/v1/cni/add", {**web, "podName": "db"})
    assert (status, err["code"]) == (409, 4)
    assert first == [] and daemon.pool()["waitingAdds"] == 1  # refused while the other waits
    waiting.join(30)
    assert first[0][0] == 200
    (owner,) = [ip["owner"] for ip in daemon.ips() if ip["owner"]]
    assert owner["podName"] == "web"


def test_one_container_cannot_hold_two_pods_on_different_interfaces(make_daemon: Any) -> None:
    """A container ID is one pod: an ADD of it for another pod on a new interface is refused
    like one on the same interface (held, waiting, after a restart); the same pod may have a
    second interface."""
    daemon = make_daemon({"addTimeoutSeconds": 15, "standalone": {"allocationLatencyMs": 1500}})
    web = {**GOOD, "podName": "web", "podNamespace": "shop"}
    db_on_eth1 = {**web, "podName": "db", "ifName": "eth1"}
    first: list[tuple[int, Any]] = []
    waiting = threading.Thread(target=lambda: first.append(daemon.call("POST", "/v1/cni/add", web)))
    waiting.start()
    daemon.wait_pool(lambda p: p["waitingAdds"] == 1)
    status, err = daemon.call("POST", "/v1/cni/add", db_on_eth1)
    assert (status, err["code"]) == (409, 4), err
    assert "shop/web" in err["msg"] and "shop/db" in err["msg"], err
    waiting.join(30)
    assert first[0][0] == 200
    for _ in range(2):  # held, then held after a restart
        status, err = daemon.call("POST", "/v1/cni/add", db_on_eth1)
        assert (status, err["code"]) == (409, 4), err
        assert "shop/web" in err["msg"] and "shop/db" in err["msg"], err
        assert daemon.stop() == 0
        daemon.start()
    assert daemon.call("POST", "/v1/cni/add", {**web, "ifName": "eth1"})[0] == 200
    owners = {(ip["owner"]["ifName"], ip["owner"]["podName"]) for ip in daemon.ips() if ip["owner"]}
    assert owners == {("eth0", "web"), ("eth1", "web")}


def test_unknown_paths_do_not_add_metric_labels(make_daemon: Any) -> None:
    daemon = make_daemon()
    for n in range(20):
        assert daemon.call("POST", f"/v1/cni/nothing{n}", {})[0] == 404
    counts = samples(daemon, "cns_cni_request_duration_seconds")
    assert counts == {(("result", "http404"), ("verb", "other")): 20}
