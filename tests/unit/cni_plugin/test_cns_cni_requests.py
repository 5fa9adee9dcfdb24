"""`cns-cni`'s own request handling, as a real `python3 -IS` process against a fake daemon.

The network effects are tested for real in tests/integration/test_cns_cni_netns.py; this checks
what the plugin sends and prints: its endpoints, the MTU, the result per cniVersion, and its errors.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.cni_plugin.test_cns_ipam import PYTHON, REPO, VERSIONS, FakeDaemon, Run

LAUNCH = (
    f"import sys; sys.path.insert(0, {REPO!r}); from cni_plugin.cni import main; sys.exit(main())"
)
ATTACH_REPLY = {
    "interfaces": [
        {"name": "cnsabc", "mac": "aa:bb:cc:dd:ee:01", "mtu": 1400},
        {"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "mtu": 1400, "sandbox": "/var/run/netns/p1"},
    ],
    "ips": [{"address": "10.240.0.9/32", "gateway": "169.254.1.1", "interface": 1}],
    "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}],
}


def conf(socket: str, version: str = "1.1.0", **extra: Any) -> dict[str, Any]:
    return {"cniVersion": version, "name": "cns", "type": "cns-cni", "socket": socket,
            "timeoutSeconds": 5, **extra}  # fmt: skip


def run(command: str, config: dict[str, Any], **env: str) -> Run:
    environ = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "ctr1",
        "CNI_NETNS": "/var/run/netns/p1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=shop",
        **env,
    }
    proc = subprocess.run(
        [PYTHON, "-I", "-S", "-c", LAUNCH],
        input=json.dumps(config).encode(),
        capture_output=True,
        env=environ,
        timeout=60,
    )
    return Run(proc)


@pytest.fixture
def fake(tmp_path: Path) -> Any:
    daemon = FakeDaemon(str(Path("/tmp") / f"cns-cni-{tmp_path.name[-12:]}.sock"))
    daemon.replies["/v1/cni/attach"] = (200, ATTACH_REPLY)
    daemon.replies["/v1/cni/detach"] = (200, {"released": "10.240.0.9"})
    daemon.replies["/v1/cni/verify"] = (200, {})
    yield daemon
    daemon.stop()
    Path(daemon.socket_path).unlink(missing_ok=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_add_sends_attach_and_prints_a_full_result(fake: Any, version: str) -> None:
    result = run("ADD", conf(fake.socket_path, version, mtu=1400))
    assert result.rc == 0, result.stdout
    sent = fake.requests[-1]
    assert sent.path == "/v1/cni/attach"
    assert sent.body == {"containerID": "ctr1", "ifName": "eth0", "netns": "/var/run/netns/p1",
                         "mtu": 1400, "podName": "web", "podNamespace": "shop"}  # fmt: skip
    out = result.out
    assert out["cniVersion"] == version
    assert [i["mac"] for i in out["interfaces"]] == ["aa:bb:cc:dd:ee:01", "aa:bb:cc:dd:ee:02"]
    assert out["ips"][0]["interface"] == 1
    assert ("version" in out["ips"][0]) == version.startswith("0.")


def test_add_without_netns_is_code_4(fake: Any) -> None:
    assert run("ADD", conf(fake.socket_path), CNI_NETNS="").code == 4
    assert fake.requests == []


@pytest.mark.parametrize("mtu", [0, 100, 70000, "1500", True])
def test_bad_mtu_is_code_7(fake: Any, mtu: Any) -> None:
    result = run("ADD", conf(fake.socket_path, mtu=mtu))
    assert result.code == 7 and "mtu" in result.out["msg"]


def test_del_and_check_use_the_main_plugin_endpoints(fake: Any) -> None:
    assert run("DEL", conf(fake.socket_path), CNI_NETNS="").rc == 0
    assert fake.requests[-1].path == "/v1/cni/detach"
    prev = conf(fake.socket_path, prevResult=ATTACH_REPLY)
    assert run("CHECK", prev).rc == 0
    assert fake.requests[-1].path == "/v1/cni/verify"
    assert fake.requests[-1].body["ips"] == ["10.240.0.9/32"]
    assert fake.requests[-1].body["netns"] == "/var/run/netns/p1"


def test_check_failure_is_passed_through(fake: Any) -> None:
    fake.replies["/v1/cni/verify"] = (409, {"code": 106, "msg": "host veth cnsabc is missing"})
    result = run("CHECK", conf(fake.socket_path, prevResult=ATTACH_REPLY))
    assert result.code == 106 and "cnsabc" in result.out["msg"]


def test_del_with_the_daemon_down_is_queued(tmp_path: Path) -> None:
    queue = tmp_path / "queue"
    result = run("DEL", conf(str(tmp_path / "none.sock"), releaseQueueDir=str(queue)))
    assert result.rc == 0
    assert [p.name for p in queue.iterdir()] == ["ctr1_eth0.json"]
