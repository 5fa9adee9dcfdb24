"""Tests of the ``cns-ipam`` CNI plugin (``cni_plugin``).

The plugin runs as a real ``python3 -I -S`` subprocess, as the container runtime starts it, against
a fake daemon: a stdlib HTTP server on a unix socket that records requests and sends canned replies.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cni_plugin import client, release_queue, skel, tinyjson
from cni_plugin.skel import CniError
from tests.harness import REPO as REPO_PATH

REPO = str(REPO_PATH)
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
LAUNCH = (
    f"import sys; sys.path.insert(0, {REPO!r}); from cni_plugin.ipam import main; sys.exit(main())"
)
VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]

ADD_REPLY = {
    "ips": [{"address": "10.240.0.5/22", "gateway": "10.240.0.1"}],
    "routes": [{"dst": "0.0.0.0/0", "gw": "10.240.0.1"}],
    "ipConfigID": "6c1f00",
    "waitedSeconds": 0.0,
}


# --- the fake daemon ---------------------------------------------------------------------------


class Recorded:
    def __init__(self, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body


class HoldOpen:
    """A raw reply after which the fake daemon keeps the connection open (ignores "close")."""

    def __init__(self, data: bytes) -> None:
        self.data = data


# A reply: (status, JSON object), raw bytes written as the whole response, HoldOpen or HANG.
Reply = tuple[int, Any] | bytes | str | HoldOpen
HANG = "hang"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        daemon = self.server.fake
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        body = json.loads(raw) if raw else None
        daemon.requests.append(Recorded(self.command, self.path, dict(self.headers), body))
        reply = daemon.replies.get(self.path, (404, {"code": 999, "msg": "no such path"}))
        self.close_connection = True
        if reply == HANG:
            daemon.release.wait(10)
            return
        if isinstance(reply, bytes):
            self.wfile.write(reply)
            return
        if isinstance(reply, HoldOpen):
            self.wfile.write(reply.data)
            self.wfile.flush()
            daemon.release.wait(10)
            return
        assert isinstance(reply, tuple)
        status, obj = reply
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    do_GET = _handle
    do_POST = _handle


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    fake: FakeDaemon


class FakeDaemon:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.requests: list[Recorded] = []
        self.release = threading.Event()
        self.replies: dict[str, Reply] = {
            "/v1/cni/add": (200, ADD_REPLY),
            "/v1/cni/del": (200, {"released": "10.240.0.5"}),
            "/v1/cni/check": (200, {}),
            "/v1/cni/gc": (200, {"released": []}),
            "/v1/cni/status": (200, {"ready": True}),
        }
        self._server = _Server(socket_path, _Handler)
        self._server.fake = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def sockdir(tmp_path: Path) -> Iterator[Path]:
    """A directory for sockets; tmp_path unless that would exceed the 108-byte AF_UNIX limit."""
    if len(str(tmp_path)) < 80:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="cns-", dir="/tmp"))
    yield short
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def daemon(sockdir: Path) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(str(sockdir / "cns.sock"))
    yield fake
    fake.stop()


# --- running the plugin ------------------------------------------------------------------------


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[bytes]) -> None:
        self.rc = proc.returncode
        self.stdout = proc.stdout.decode()
        self.stderr = proc.stderr.decode()
        # Never a traceback: nothing on stderr, stdout empty or exactly one JSON document.
        assert self.stderr == "", self.stderr
        assert "Traceback" not in self.stdout
        self.out: Any = json.loads(self.stdout) if self.stdout.strip() else None
        if self.rc != 0:
            assert self.rc == 1
            assert isinstance(self.out, dict)
            assert set(self.out) == {"cniVersion", "code", "msg", "details"}, self.out

    @property
    def code(self) -> int:
        assert self.rc == 1, self.stdout
        code = self.out["code"]
        assert isinstance(code, int)
        return code


def netconf(
    socket_path: str = "/nonexistent/cns.sock",
    version: str = "1.1.0",
    *,
    queue_dir: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    ipam: dict[str, Any] = {"type": "cns-ipam", "socket": socket_path, "timeoutSeconds": 5}
    if queue_dir is not None:
        ipam["releaseQueueDir"] = queue_dir
    conf: dict[str, Any] = {"cniVersion": version, "name": "cns", "type": "cns-cni", "ipam": ipam}
    conf.update(extra)
    return conf


def run_plugin(
    command: str | None, config: dict[str, Any] | bytes | None, **env_overrides: str | None
) -> Run:
    env: dict[str, str | None] = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "ctr1",
        "CNI_NETNS": "/var/run/netns/p1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
    }
    env.update(env_overrides)
    if config is None:
        stdin = b""
    elif isinstance(config, bytes):
        stdin = config
    else:
        stdin = json.dumps(config).encode()
    proc = subprocess.run(
        [PYTHON, "-I", "-S", "-c", LAUNCH],
        input=stdin,
        capture_output=True,
        env={k: v for k, v in env.items() if v is not None},
        timeout=60,
    )
    return Run(proc)


# --- VERSION and input validation --------------------------------------------------------------


def test_version_with_empty_stdin() -> None:
    r = run_plugin("VERSION", None)
    assert r.rc == 0
    assert r.out == {"cniVersion": "1.1.0", "supportedVersions": VERSIONS}


def test_version_echoes_requested_version() -> None:
    r = run_plugin("VERSION", {"cniVersion": "0.4.0"})
    assert r.out == {"cniVersion": "0.4.0", "supportedVersions": VERSIONS}
    assert run_plugin("VERSION", {"cniVersion": "9.9.9"}).out["cniVersion"] == "1.1.0"
    assert run_plugin("VERSION", b"not json").rc == 0


def test_version_needs_no_container_env() -> None:
    r = run_plugin("VERSION", None, CNI_CONTAINERID=None, CNI_IFNAME=None, CNI_NETNS=None)
    assert r.rc == 0


@pytest.mark.parametrize(
    "stdin",
    [b"", b"{", b"[1, 2]", b'"x"', b"\xff\xfe", b"{} x", b'{"a": ' + b"[" * 100_000 + b"]}"],
)
def test_bad_stdin_is_code_6(stdin: bytes) -> None:
    r = run_plugin("ADD", stdin)
    assert r.code == 6
    assert r.out["cniVersion"] == "1.1.0"


def test_bad_json_details_carry_position() -> None:
    r = run_plugin("ADD", b'{"cniVersion": "1.0.0", "name" 1}')
    assert r.code == 6
    assert "(char 31)" in r.out["details"]


def test_unsupported_version_is_code_1() -> None:
    r = run_plugin("ADD", netconf(version="0.2.0"))
    assert r.code == 1
    assert "0.2.0" in r.out["msg"]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c.pop("cniVersion"), "cniVersion"),
        (lambda c: c.update(cniVersion=1), "cniVersion"),
        (lambda c: c.pop("name"), "name"),
        (lambda c: c.pop("ipam"), "ipam"),
        (lambda c: c.update(ipam="x"), "ipam"),
        (lambda c: c["ipam"].update(socket=3), "ipam.socket"),
        (lambda c: c["ipam"].update(releaseQueueDir=""), "ipam.releaseQueueDir"),
        (lambda c: c["ipam"].update(timeoutSeconds="15"), "ipam.timeoutSeconds"),
        (lambda c: c["ipam"].update(timeoutSeconds=True), "ipam.timeoutSeconds"),
        (lambda c: c["ipam"].update(timeoutSeconds=0), "ipam.timeoutSeconds"),
        # Beyond what a socket timeout can hold: was an OverflowError, i.e. code 102.
        (lambda c: c["ipam"].update(timeoutSeconds=1e308), "ipam.timeoutSeconds"),
        (lambda c: c["ipam"].update(timeoutSeconds=3600.5), "ipam.timeoutSeconds"),
        (lambda c: c["ipam"].update(subnets="v4pods"), "ipam.subnets"),
        (lambda c: c["ipam"].update(subnets=["v4pods", "v4pods"]), "ipam.subnets"),
        (lambda c: c["ipam"].update(subnets=["a", "b", "c", "d", "e"]), "ipam.subnets"),
        (lambda c: c["ipam"].update(subnets=["bad name"]), "ipam.subnets"),
    ],
)
def test_bad_config_is_code_7(mutate: Callable[[dict[str, Any]], object], field: str) -> None:
    conf = netconf()
    mutate(conf)
    r = run_plugin("ADD", conf)
    assert r.code == 7
    assert r.out["msg"].startswith(field + ":")


def test_missing_container_id_is_code_4() -> None:
    r = run_plugin("ADD", netconf(version="1.0.0"), CNI_CONTAINERID=None)
    assert r.code == 4
    assert "CNI_CONTAINERID" in r.out["msg"]
    assert r.out["cniVersion"] == "1.0.0"  # reported in the requested version


@pytest.mark.parametrize("cid", ["", "-abc", "a/b", "a b", "ab:c", "é", "a" * 1025])
def test_bad_container_id_is_code_4(cid: str) -> None:
    assert run_plugin("ADD", netconf(), CNI_CONTAINERID=cid).code == 4


@pytest.mark.parametrize(
    "ifname", ["", "a" * 16, "eth/0", "eth:0", "eth 0", "eth\t0", ".", "..", "eth\x01", "eth\u2028"]
)
def test_bad_ifname_is_code_4(ifname: str) -> None:
    r = run_plugin("ADD", netconf(), CNI_IFNAME=ifname)
    assert r.code == 4
    assert "CNI_IFNAME" in r.out["msg"]


def test_missing_netns_on_add_is_code_4() -> None:
    r = run_plugin("ADD", netconf(), CNI_NETNS=None)
    assert r.code == 4
    assert "CNI_NETNS" in r.out["msg"]


@pytest.mark.parametrize("command", [None, "", "FROB", "add"])
def test_unknown_or_missing_command_is_code_4(command: str | None) -> None:
    r = run_plugin(command, netconf())
    assert r.code == 4
    assert "CNI_COMMAND" in r.out["msg"]


def test_bad_cni_args_is_code_4() -> None:
    assert run_plugin("ADD", netconf(), CNI_ARGS="K8S_POD_NAME").code == 4


# --- ADD ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_add_result_shape_per_version(daemon: FakeDaemon, version: str) -> None:
    r = run_plugin("ADD", netconf(daemon.socket_path, version))
    assert r.rc == 0, r.stdout
    ip: dict[str, Any] = {"address": "10.240.0.5/22", "gateway": "10.240.0.1"}
    if version.startswith("0."):
        ip = {"version": "4", **ip}
    assert r.out == {
        "cniVersion": version,
        "ips": [ip],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.240.0.1"}],
        "dns": {},
    }
    assert "interfaces" not in r.out


@pytest.mark.parametrize("version", VERSIONS)
def test_add_ipv6_result(daemon: FakeDaemon, version: str) -> None:
    daemon.replies["/v1/cni/add"] = (
        200,
        {
            "ips": [{"address": "fd00::5/64", "gateway": "fd00::1"}],
            "routes": [{"dst": "::/0", "gw": "fd00::1"}],
        },
    )
    r = run_plugin("ADD", netconf(daemon.socket_path, version))
    (ip,) = r.out["ips"]
    assert ("version" in ip) == version.startswith("0.")
    if "version" in ip:
        assert ip["version"] == "6"
    assert r.out["routes"] == [{"dst": "::/0", "gw": "fd00::1"}]


def test_add_request(daemon: FakeDaemon) -> None:
    r = run_plugin(
        "ADD",
        netconf(daemon.socket_path),
        CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1;"
        "K8S_POD_INFRA_CONTAINER_ID=ctr1;K8S_POD_UID=u-1",
    )
    assert r.rc == 0
    (req,) = daemon.requests
    assert (req.method, req.path) == ("POST", "/v1/cni/add")
    assert req.body == {
        "containerID": "ctr1",
        "ifName": "eth0",
        "netns": "/var/run/netns/p1",
        "podName": "web-1",
        "podNamespace": "default",
    }
    assert req.headers["Host"] == "cns"
    assert req.headers["Content-Type"] == "application/json"
    assert req.headers["Connection"] == "close"
    assert int(req.headers["Content-Length"]) == len(json.dumps(req.body, separators=(",", ":")))


@pytest.mark.parametrize("version", VERSIONS)
def test_a_dual_stack_add_asks_for_both_subnets_and_returns_both_addresses(
    daemon: FakeDaemon, version: str
) -> None:
    daemon.replies["/v1/cni/add"] = (
        200,
        {
            "ips": [
                {"address": "10.240.0.5/22", "gateway": "10.240.0.1"},
                {"address": "fd00::5/64", "gateway": "fd00::1"},
            ],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.240.0.1"}, {"dst": "::/0", "gw": "fd00::1"}],
        },
    )
    conf = netconf(daemon.socket_path, version)
    conf["ipam"]["subnets"] = ["v4pods", "v6pods"]
    r = run_plugin("ADD", conf)
    assert r.rc == 0, r.stdout
    (req,) = daemon.requests
    assert req.body["subnets"] == ["v4pods", "v6pods"]
    assert [ip["address"] for ip in r.out["ips"]] == ["10.240.0.5/22", "fd00::5/64"]
    if version.startswith("0."):
        assert [ip["version"] for ip in r.out["ips"]] == ["4", "6"]
    assert [route["dst"] for route in r.out["routes"]] == ["0.0.0.0/0", "::/0"]


def test_add_without_cni_args_sends_no_pod(daemon: FakeDaemon) -> None:
    run_plugin("ADD", netconf(daemon.socket_path))
    (req,) = daemon.requests
    assert "podName" not in req.body
    assert "podNamespace" not in req.body


def test_add_daemon_down_is_code_100(sockdir: Path) -> None:
    path = str(sockdir / "absent.sock")
    r = run_plugin("ADD", netconf(path))
    assert r.code == 100
    assert r.out["msg"].startswith(f"cns daemon unreachable at {path}: ")


def test_add_connection_refused_is_code_100(sockdir: Path) -> None:
    path = str(sockdir / "dead.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound but not listening: ECONNREFUSED
        r = run_plugin("ADD", netconf(path))
    assert r.code == 100
    assert "refused" in r.out["msg"].lower()


def test_add_timeout_is_code_100(daemon: FakeDaemon) -> None:
    daemon.replies["/v1/cni/add"] = HANG
    conf = netconf(daemon.socket_path)
    conf["ipam"]["timeoutSeconds"] = 0.3
    t0 = time.monotonic()
    r = run_plugin("ADD", conf)
    assert r.code == 100
    assert "no reply within 0.3 s" in r.out["msg"]
    assert time.monotonic() - t0 < 5


def test_daemon_error_body_passed_through(daemon: FakeDaemon) -> None:
    err = {
        "code": 11,
        "msg": "no free IP within 10.0 s: subnet exhausted",
        "details": "requested=17 assigned=16 waiting=1",
    }
    daemon.replies["/v1/cni/add"] = (503, err)
    r = run_plugin("ADD", netconf(daemon.socket_path, "0.4.0"))
    assert r.out == {"cniVersion": "0.4.0", **err}


def test_daemon_error_without_details(daemon: FakeDaemon) -> None:
    daemon.replies["/v1/cni/add"] = (500, {"code": 102, "msg": "commit failed"})
    r = run_plugin("ADD", netconf(daemon.socket_path))
    assert (r.code, r.out["msg"], r.out["details"]) == (102, "commit failed", "")


@pytest.mark.parametrize(
    "reply",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n",
        b"SSH-2.0-OpenSSH_9.2\r\n",
    ],
)
def test_garbage_reply_is_code_101(daemon: FakeDaemon, reply: bytes) -> None:
    daemon.replies["/v1/cni/add"] = reply
    assert run_plugin("ADD", netconf(daemon.socket_path)).code == 101


@pytest.mark.parametrize(
    "reply",
    [
        (500, ["not", "an", "error"]),
        (500, {"code": "11", "msg": "x"}),
        (200, {"ips": "10.0.0.1/24"}),
        (200, {"ips": [{"address": "10.0.0.1"}]}),
        (200, [1]),
    ],
)
def test_off_protocol_json_is_code_101(daemon: FakeDaemon, reply: tuple[int, Any]) -> None:
    daemon.replies["/v1/cni/add"] = reply
    assert run_plugin("ADD", netconf(daemon.socket_path)).code == 101


def test_empty_reply_counts_as_unreachable(daemon: FakeDaemon) -> None:
    daemon.replies["/v1/cni/add"] = b""
    assert run_plugin("ADD", netconf(daemon.socket_path)).code == 100


def test_chunked_and_eof_delimited_replies(daemon: FakeDaemon) -> None:
    """The daemon never sends a chunked reply (test_real_daemon_replies_carry_content_length), so
    the plugin does not decode one: it is off-protocol, code 101, never a wrong result."""
    body = json.dumps(ADD_REPLY).encode()
    half = len(body) // 2
    daemon.replies["/v1/cni/add"] = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{half:x}\r\n".encode()
        + body[:half]
        + f"\r\n{len(body) - half:X};ext=1\r\n".encode()
        + body[half:]
        + b"\r\n0\r\n\r\n"
    )
    r = run_plugin("ADD", netconf(daemon.socket_path))
    assert r.code == 101
    assert "Transfer-Encoding" in r.out["details"]
    daemon.replies["/v1/cni/add"] = (
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body
    )
    assert run_plugin("ADD", netconf(daemon.socket_path)).rc == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_reply_on_open_connection_is_not_waited_for(daemon: FakeDaemon, chunked: bool) -> None:
    body = json.dumps(ADD_REPLY).encode()
    if chunked:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    else:
        data = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    daemon.replies["/v1/cni/add"] = HoldOpen(data)
    conf = netconf(daemon.socket_path)
    conf["ipam"]["timeoutSeconds"] = 3
    t0 = time.monotonic()
    r = run_plugin("ADD", conf)
    if chunked:
        assert r.code == 101  # off-protocol (never sent by the daemon), and not waited for either
    else:
        assert r.rc == 0
    assert time.monotonic() - t0 < 2


def _raw_exchange(socket_path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(socket_path))
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_real_daemon_replies_carry_content_length(make_daemon: Any) -> None:
    """What lets the plugin drop chunked decoding: every reply of the real daemon's socket, on
    every route the plugins use and on its error paths, is delimited by Content-Length."""
    daemon = make_daemon()
    add = {"containerID": "c1", "ifName": "eth0", "netns": "/var/run/netns/p1"}
    requests: list[tuple[str, str, bytes]] = [
        ("POST", "/v1/cni/add", json.dumps(add).encode()),
        ("POST", "/v1/cni/check", json.dumps({"containerID": "c1", "ifName": "eth0"}).encode()),
        ("POST", "/v1/cni/check", json.dumps({"containerID": "c9", "ifName": "eth0"}).encode()),
        ("POST", "/v1/cni/del", json.dumps({"containerID": "c1", "ifName": "eth0"}).encode()),
        ("POST", "/v1/cni/gc", json.dumps({"validAttachments": []}).encode()),
        ("GET", "/v1/cni/status", b""),
        ("POST", "/v1/cni/attach", b"{}"),
        ("POST", "/v1/cni/detach", b"{}"),
        ("POST", "/v1/cni/verify", b"{}"),
        ("POST", "/v1/cni/add", b"{not json"),
        ("POST", "/v1/cni/add", b" " * ((1 << 20) + 16)),  # over the 1 MiB body limit: 413
        ("GET", "/v1/cni/add", b""),  # 405
        ("POST", "/v1/nope", b"{}"),  # 404
    ]
    statuses = set()
    for method, path, body in requests:
        reply = _raw_exchange(
            daemon.socket,
            f"{method} {path} HTTP/1.1\r\nHost: cns\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body,
        )
        head, _, rest = reply.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        where = f"{method} {path}: {lines[0]}"
        assert "transfer-encoding" not in headers, where
        assert int(headers["content-length"]) == len(rest), where
        statuses.add(int(lines[0].split(" ")[1]))
    assert {200, 400, 404, 405, 413} <= statuses


def test_unexpected_exception_is_a_cni_error(capsys: pytest.CaptureFixture[str]) -> None:
    def boom(inv: skel.Invocation) -> None:
        inv.cni_version = "0.4.0"
        raise KeyError("surprise")

    assert skel.run_plugin(boom, "cns-test") == 1
    out = json.loads(capsys.readouterr().out)
    assert out["cniVersion"] == "0.4.0"
    assert out["code"] == 102
    assert out["msg"] == "cns-test: internal error"
    assert out["details"].startswith("KeyError: 'surprise' (at ")


# --- DEL ---------------------------------------------------------------------------------------


def test_del(daemon: FakeDaemon, tmp_path: Path) -> None:
    queue = tmp_path / "queue"
    r = run_plugin("DEL", netconf(daemon.socket_path, queue_dir=str(queue)), CNI_NETNS="")
    assert (r.rc, r.stdout) == (0, "")
    (req,) = daemon.requests
    assert (req.method, req.path, req.body) == (
        "POST",
        "/v1/cni/del",
        {"containerID": "ctr1", "ifName": "eth0"},
    )
    assert not queue.exists()


def test_del_daemon_error_fails(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.replies["/v1/cni/del"] = (500, {"code": 102, "msg": "commit failed"})
    queue = tmp_path / "queue"
    r = run_plugin("DEL", netconf(daemon.socket_path, queue_dir=str(queue)))
    assert r.code == 102
    assert not queue.exists()


def _check_queue(queue: Path, before: float) -> None:
    assert stat.S_IMODE(queue.stat().st_mode) == 0o700
    files = list(queue.iterdir())
    assert [f.name for f in files] == ["ctr-1.a_eth0.json"]
    content = json.loads(files[0].read_text())
    assert set(content) == {"containerID", "ifName", "queuedAt"}
    assert (content["containerID"], content["ifName"]) == ("ctr-1.a", "eth0")
    assert before - 1 <= content["queuedAt"] <= time.time() + 1


def test_del_daemon_down_writes_release_queue(sockdir: Path, tmp_path: Path) -> None:
    queue = tmp_path / "state" / "release-queue"
    before = time.time()
    conf = netconf(str(sockdir / "absent.sock"), "0.3.1", queue_dir=str(queue))
    r = run_plugin("DEL", conf, CNI_CONTAINERID="ctr-1.a", CNI_NETNS=None)
    assert (r.rc, r.stdout) == (0, "")
    _check_queue(queue, before)
    # A second DEL for the same attachment replaces the file: still exactly one.
    assert run_plugin("DEL", conf, CNI_CONTAINERID="ctr-1.a").rc == 0
    _check_queue(queue, before)


def test_del_daemon_hanging_writes_release_queue(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.replies["/v1/cni/del"] = HANG
    queue = tmp_path / "q"
    conf = netconf(daemon.socket_path, queue_dir=str(queue))
    conf["ipam"]["timeoutSeconds"] = 0.3
    before = time.time()
    assert run_plugin("DEL", conf, CNI_CONTAINERID="ctr-1.a").rc == 0
    _check_queue(queue, before)


def test_del_queue_unwritable_is_code_5(sockdir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    conf = netconf(str(sockdir / "absent.sock"), queue_dir=str(blocker / "queue"))
    assert run_plugin("DEL", conf).code == 5


# --- CHECK, GC, STATUS -------------------------------------------------------------------------


def test_check_without_prev_result_is_code_7(daemon: FakeDaemon) -> None:
    r = run_plugin("CHECK", netconf(daemon.socket_path))
    assert r.code == 7
    assert r.out["msg"].startswith("prevResult")
    assert daemon.requests == []


def test_check_sends_prev_result_addresses(daemon: FakeDaemon) -> None:
    prev = {
        "cniVersion": "0.4.0",
        "ips": [
            {"version": "4", "address": "10.240.0.5/22", "gateway": "10.240.0.1"},
            {"version": "6", "address": "fd00::5/64"},
        ],
    }
    r = run_plugin("CHECK", netconf(daemon.socket_path, "0.4.0", prevResult=prev))
    assert (r.rc, r.stdout) == (0, "")
    (req,) = daemon.requests
    assert (req.path, req.body) == (
        "/v1/cni/check",
        {"containerID": "ctr1", "ifName": "eth0", "ips": ["10.240.0.5/22", "fd00::5/64"]},
    )


def test_check_mismatch_passed_through(daemon: FakeDaemon) -> None:
    daemon.replies["/v1/cni/check"] = (409, {"code": 104, "msg": "allocation differs"})
    prev = {"ips": [{"address": "10.240.0.9/22"}]}
    assert run_plugin("CHECK", netconf(daemon.socket_path, prevResult=prev)).code == 104


def test_check_needs_cni_0_4(daemon: FakeDaemon) -> None:
    prev: dict[str, Any] = {"ips": []}
    assert run_plugin("CHECK", netconf(daemon.socket_path, "0.3.1", prevResult=prev)).code == 1


def test_gc_forwards_valid_attachments(daemon: FakeDaemon) -> None:
    valid = [{"containerID": "a1", "ifname": "eth0"}, {"containerID": "b2", "ifname": "net1"}]
    conf = netconf(daemon.socket_path)
    conf["cni.dev/valid-attachments"] = valid
    r = run_plugin("GC", conf, CNI_CONTAINERID=None, CNI_IFNAME=None, CNI_NETNS=None)
    assert (r.rc, r.stdout) == (0, "")
    (req,) = daemon.requests
    assert (req.path, req.body) == ("/v1/cni/gc", {"validAttachments": valid})


def test_gc_empty_list_is_forwarded(daemon: FakeDaemon) -> None:
    conf = netconf(daemon.socket_path)
    conf["cni.dev/valid-attachments"] = []
    assert run_plugin("GC", conf).rc == 0
    assert daemon.requests[0].body == {"validAttachments": []}


@pytest.mark.parametrize(
    "valid", [None, "x", [{"containerID": "a"}], [{"containerID": 1, "ifname": "e"}]]
)
def test_gc_bad_or_missing_attachments_is_code_7(daemon: FakeDaemon, valid: Any) -> None:
    conf = netconf(daemon.socket_path)
    if valid is not None:
        conf["cni.dev/valid-attachments"] = valid
    r = run_plugin("GC", conf)
    assert r.code == 7
    assert "cni.dev/valid-attachments" in r.out["msg"]
    assert daemon.requests == []


def test_status_ok(daemon: FakeDaemon) -> None:
    r = run_plugin("STATUS", netconf(daemon.socket_path), CNI_CONTAINERID=None, CNI_IFNAME=None)
    assert (r.rc, r.stdout) == (0, "")
    (req,) = daemon.requests
    assert (req.method, req.path, req.body) == ("GET", "/v1/cni/status", None)
    assert req.headers["Content-Length"] == "0"


def test_status_not_ready_passed_through(daemon: FakeDaemon) -> None:
    daemon.replies["/v1/cni/status"] = (503, {"code": 50, "msg": "no network container yet"})
    r = run_plugin("STATUS", netconf(daemon.socket_path))
    assert (r.code, r.out["msg"]) == (50, "no network container yet")


def test_status_daemon_down_is_code_50(sockdir: Path) -> None:
    path = str(sockdir / "absent.sock")
    r = run_plugin("STATUS", netconf(path))
    assert r.code == 50
    assert path in r.out["msg"]


# --- start-up cost -----------------------------------------------------------------------------


def test_import_loads_no_heavy_modules() -> None:
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); import cni_plugin.ipam; "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run([PYTHON, "-I", "-S", "-c", code], capture_output=True, check=True)
    loaded = set(out.stdout.decode().split())
    assert "cni_plugin.ipam" in loaded
    # os is ~1 ms of a ~2 ms budget; the plugin uses posix (already loaded) instead.
    heavy = {"json", "re", "socket", "typing", "enum", "os", "dataclasses", "ipaddress", "logging"}
    assert loaded & heavy == set()


def test_tinyjson_error_position_without_json_loaded() -> None:
    """On 3.11 the C scanner cannot raise its own error unless json.decoder is loaded."""
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); from cni_plugin import tinyjson\n"
        "try:\n    tinyjson.loads('[1, 2 3]')\n"
        "except ValueError as e:\n    print(e)"
    )
    out = subprocess.run([PYTHON, "-I", "-S", "-c", code], capture_output=True, check=True)
    assert "char 6" in out.stdout.decode()


# --- skel, client and release_queue units ------------------------------------------------------


def test_parse_cni_args() -> None:
    args = skel.parse_cni_args("IgnoreUnknown=1;K8S_POD_NAME=web-1;;K8S_POD_UID=a=b")
    assert args == {"IgnoreUnknown": "1", "K8S_POD_NAME": "web-1", "K8S_POD_UID": "a=b"}
    env = skel.read_env(
        "DEL", {"CNI_CONTAINERID": "c", "CNI_IFNAME": "eth0", "CNI_ARGS": "IgnoreUnknown=true"}
    )
    assert env.pod_name is None
    assert env.netns == ""
    with pytest.raises(CniError) as exc:
        skel.read_env("ADD", {"CNI_CONTAINERID": "c", "CNI_IFNAME": "eth0"})
    assert exc.value.code == 4


def test_convert_result_keeps_interfaces_and_index() -> None:
    result = {
        "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/p1"}],
        "ips": [{"address": "10.0.0.2/24", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "mtu": 1400}],
        "dns": {"nameservers": ["10.0.0.10"]},
    }
    old = client.convert_result(result, "0.4.0")
    assert old == {
        "cniVersion": "0.4.0",
        "interfaces": result["interfaces"],
        "ips": [{"version": "4", "address": "10.0.0.2/24", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}],
        "dns": {"nameservers": ["10.0.0.10"]},
    }
    new = client.convert_result(result, "1.1.0")
    assert new["ips"] == [{"address": "10.0.0.2/24", "interface": 0}]
    assert new["routes"] == result["routes"]


def test_queue_release_in_process(tmp_path: Path) -> None:
    path = release_queue.queue_release(
        str(tmp_path / "a" / "b"), container_id="c1", ifname="eth0", now=12.5
    )
    assert path == str(tmp_path / "a" / "b" / "c1_eth0.json")
    assert json.loads(Path(path).read_text()) == {
        "containerID": "c1",
        "ifName": "eth0",
        "queuedAt": 12.5,
    }
    assert os.listdir(tmp_path / "a" / "b") == ["c1_eth0.json"]


# --- tinyjson ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -17,
        10**30,
        1.5,
        -0.0,
        1e-300,
        1.7976931348623157e308,
        "",
        "plain",
        'ünïcødé ☃ 𝄞 \u0000 \n " \\ \u2028',
        [],
        {},
        {"a": [1, {"b": [None, True, "x"]}], "c": {"d": {}}},
    ],
)
def test_tinyjson_roundtrip(value: Any) -> None:
    text = tinyjson.dumps(value)
    assert text.isascii()
    assert text == json.dumps(value, separators=(",", ":"))
    assert tinyjson.loads(text) == value
    assert tinyjson.loads(json.dumps(value, indent=2, ensure_ascii=False)) == value


def test_tinyjson_parses_like_json() -> None:
    assert tinyjson.loads(' \n{"a" : [ 1 , 2.5e3 , "\\u00e9\\ud834\\udd1e" ] }\t') == {
        "a": [1, 2500.0, "é𝄞"]
    }
    assert isinstance(tinyjson.loads("1"), int)
    assert isinstance(tinyjson.loads("1.0"), float)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "{",
        "[1,]",
        "{'a': 1}",
        "tru",
        "NaN",
        "Infinity",
        "-Infinity",
        "[1] [2]",
        "1 x",
        '"a\nb"',
        "01",
        "{1: 2}",
        '"\\x"',
        "\ufeff{}",
        "[" * 100000,
    ],
)
def test_tinyjson_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        tinyjson.loads(text)


def test_tinyjson_error_messages_have_position() -> None:
    with pytest.raises(ValueError, match="char 4"):
        tinyjson.loads("[1] x")
    with pytest.raises(ValueError, match="char 0"):
        tinyjson.loads("")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {1j: 1}, object(), {"a": {1, 2}}])
def test_tinyjson_dumps_rejects(value: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        tinyjson.dumps(value)


def test_tinyjson_dumps_rejects_cycles() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError):
        tinyjson.dumps(cyclic)


@pytest.mark.parametrize(
    "replacement",
    [
        # A new parameter: the call with today's nine arguments fails.
        "lambda *args: original(*args[:-1])",
        # The same arity, another meaning: the two separators swapped.
        "lambda m, d, e, i, ks, its, *flags: original(m, d, e, i, its, ks, *flags)",
    ],
)
def test_tinyjson_falls_back_to_json_if_the_c_encoder_changes(replacement: str) -> None:
    """`_json.make_encoder` is private; should a Python release change it, dumps() must still
    give the same text and errors (through `json`, which CPython keeps in step with it)."""
    code = (
        f"import sys, json, _json; sys.path.insert(0, {REPO!r})\n"
        "original = _json.make_encoder\n"
        f"_json.make_encoder = {replacement}\n"
        "from cni_plugin import tinyjson\n"
        "print(tinyjson._encode.__name__)\n"
        "print(tinyjson.dumps({'k': [1, 2.5, 'é', None], 'a': {}}))\n"
        "for bad in (float('nan'), {1j: 1}, object()):\n"
        "    try:\n        tinyjson.dumps(bad)\n"
        "    except (TypeError, ValueError) as exc:\n        print(type(exc).__name__)\n"
    )
    out = subprocess.run([PYTHON, "-I", "-S", "-c", code], capture_output=True, check=True)
    assert out.stdout.decode().split("\n") == [
        "_stdlib_encode",
        '{"k":[1,2.5,"\\u00e9",null],"a":{}}',
        "ValueError",
        "TypeError",
        "TypeError",
        "",
    ]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_tinyjson_matches_stdlib(value: Any) -> None:
    text = tinyjson.dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))
    assert tinyjson.loads(text) == value
    assert tinyjson.loads(json.dumps(value, indent=1)) == value


def _reject(name: str) -> Any:
    raise ValueError(name)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('{}[],:"\\ \n0123456789.eE+-truefalsnNI\u00e9x'))))
def test_tinyjson_accepts_exactly_what_stdlib_accepts(text: str) -> None:
    try:
        expected: Any = json.loads(text, parse_constant=_reject)
    except (ValueError, RecursionError):
        with pytest.raises(ValueError):
            tinyjson.loads(text)
    else:
        assert tinyjson.loads(text) == expected


def test_a_pod_gets_the_address_it_asks_for_or_a_clear_error(make_daemon: Any) -> None:
    """The CNI `ips` capability (runtimeConfig.ips) and `IP=` in CNI_ARGS, as host-local
    honours them, against the real daemon: the address if it is Available in the node's pool,
    else code 11 naming the address and why; and the same pod may take back its own address
    while it cools down, another pod may not."""
    daemon = make_daemon()
    daemon.wait_pool(lambda p: p["ips"]["Available"] >= 4)
    free = [ip["address"] for ip in daemon.ips() if ip["state"] == "Available"]
    conf = netconf(str(daemon.socket))

    def add(container: str, *, ips: list[str] | None = None, **env: str) -> Run:
        config = {**conf, "runtimeConfig": {"ips": ips}} if ips is not None else conf
        return run_plugin("ADD", config, CNI_CONTAINERID=container, **env)

    def address(run: Run) -> str:
        assert run.rc == 0, run.out
        return str(run.out["ips"][0]["address"]).split("/")[0]

    assert address(add("r1", ips=[f"{free[3]}/22"])) == free[3]
    assert address(add("r2", CNI_ARGS=f"IP={free[2]}")) == free[2]
    assert address(add("r2", CNI_ARGS=f"IP={free[2]}")) == free[2]  # idempotent
    taken = add("r3", ips=[free[3]])
    assert (taken.code, free[3]) == (11, free[3]) and "assigned to container r1" in taken.out["msg"]
    outside = add("r3", CNI_ARGS="IP=192.0.2.1")
    assert outside.code == 11 and "192.0.2.1 is not in this node's pool" in outside.out["msg"]
    bad = add("r3", ips=["banana"])
    assert bad.code == 7 and "requestedIP: 'banana' is not an IP address" in bad.out["msg"]
    two = add("r3", ips=[free[0], free[1]])
    assert two.code == 7 and "are both IPv4: at most one address per family" in two.out["msg"]
    pair = add("r3", CNI_ARGS=f"IP={free[0]},fd00::5")  # one of each family, one subnet
    assert pair.code == 7 and "requestedIP: 2 addresses" in pair.out["msg"]
    assert "at most one address per subnet the ADD names" in pair.out["msg"]
    # Both sources, the same pair in another order: passed on (the daemon refuses it here).
    both = add("r3", ips=["fd00::5/64", f"{free[0]}/22"], CNI_ARGS=f"IP={free[0]},fd00::5")
    assert both.code == 7 and f"2 addresses (fd00::5, {free[0]})" in both.out["msg"]
    differ = add("r3", ips=[free[0]], CNI_ARGS=f"IP={free[1]}")
    assert differ.code == 7 and "different addresses" in differ.out["msg"]
    assert daemon.pool()["ips"]["Assigned"] == 2  # nothing was taken by the refusals

    # A StatefulSet pod re-created under its name takes its address back at once; another
    # pod asking for it during the cooldown is told so.
    pod = "K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0"
    assert address(add("s1", CNI_ARGS=f"{pod};IP={free[0]}")) == free[0]
    assert run_plugin("DEL", conf, CNI_CONTAINERID="s1").rc == 0
    other = add("s2", CNI_ARGS=f"K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-1;IP={free[0]}")
    assert other.code == 11 and "in cooldown" in other.out["msg"]
    assert address(add("s3", CNI_ARGS=f"{pod};IP={free[0]}")) == free[0]
