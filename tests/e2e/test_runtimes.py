"""Real container runtimes drive the CNI network: podman 4.3 (CNI backend) and containerd 1.6 (CRI).

The network is a fixture parameter (`cni_network`): the reference `ptp + host-local`, which
builds the same topology as cns-cni (a veth per pod, a /32 host route, default route via the
host), and `ptp + cns-ipam` in front of a `make_daemon` daemon. `cns-cni` (with its own daemon)
is a third branch of the same fixture: add "cns-cni" to its params.

`TestDualStack` overrides `cni_network`: a daemon with an IPv4 and an IPv6 subnet, asked for one
address of each, and the runtime and daemon running in a scratch network namespace that plays
the node, so nothing the plugins set (IPv6 forwarding first) touches the machine.
`TestLanes` does the same with a tiny subnet filled up beside a roomy one.

Needs root, podman, runc, containerd, busybox-static, containernetworking-plugins, grpcio and
grpcio-tools: under CI a missing one fails these tests instead of skipping them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.containerd import Containerd
from tests.harness.cri import CriClient
from tests.harness.daemon import parse_metrics
from tests.harness.host import MACHINE_SYSCTLS, host_routes, host_test_address, ping
from tests.harness.podman import Podman, build_pause_archive, busybox_rootfs
from tests.harness.requirements import require_runtime_root

# Pods ping "the host" at a /32 on a link of its own (RFC 2544 benchmarking range: never routed).
HOST_ADDRESS = "198.18.0.1"
CONCURRENT_SANDBOXES = 50


@dataclass
class CniNetwork:
    """A conflist as a runtime gets it, and how to tell that an IP went back to the IPAM."""

    conflist: dict[str, Any]
    subnet: ipaddress.IPv4Network | ipaddress.IPv6Network
    is_released: Callable[[str], bool]
    owner_of: Callable[[str], dict[str, Any] | None]
    plugin_dirs: list[Path] = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)  # the runtime's command runs under it

    @property
    def name(self) -> str:
        name: str = self.conflist["name"]
        return name

    def wait_released(self, address: str, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_released(address):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def cns_cni(daemon: Any, plugin_dir: Path) -> CniNetwork:
    """cns-cni (installed by `cns install-cni`) in front of a `make_daemon` daemon."""
    conflist = {
        "cniVersion": "1.0.0",
        "name": "cns",
        "plugins": [
            {
                "type": "cns-cni",
                "socket": str(daemon.socket),
                "releaseQueueDir": str(daemon.state_dir / "release-queue"),
                "mtu": 1500,
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }

    def owner_of(address: str) -> dict[str, Any] | None:
        owners = [ip["owner"] for ip in daemon.ips() if ip["address"] == address]
        return owners[0] if owners else None

    def released(address: str) -> bool:
        return owner_of(address) is None

    subnet = ipaddress.ip_network("10.240.0.0/22")
    return CniNetwork(conflist, subnet, released, owner_of, [plugin_dir])


def ptp_cns_ipam(daemon: Any, plugin_dir: Path) -> CniNetwork:
    """The reference `ptp` with `cns-ipam` (installed by `cns install-cni`) as its IPAM."""
    network = cns_cni(daemon, plugin_dir)
    network.conflist["plugins"][0] = {
        "type": "ptp",
        "ipMasq": False,
        "mtu": 1500,
        "ipam": {
            "type": "cns-ipam",
            "socket": str(daemon.socket),
            "releaseQueueDir": str(daemon.state_dir / "release-queue"),
        },
    }
    return network


# cns-cni, our main plugin; and the reference ptp with cns-ipam for its IPs.
@pytest.fixture(params=["cns-cni", "ptp-cns-ipam"])
def cni_network(request: pytest.FixtureRequest, tmp_path: Path) -> CniNetwork:
    require_runtime_root()
    daemon = request.getfixturevalue("make_daemon")()
    plugin_dir: Path = request.getfixturevalue("plugin_dir")
    if request.param == "ptp-cns-ipam":
        return ptp_cns_ipam(daemon, plugin_dir)
    return cns_cni(daemon, plugin_dir)


@pytest.fixture(autouse=True)
def machine_as_found() -> Iterator[None]:
    """The single-family tests run their plugins (and the cns-cni daemon) in the machine's own
    namespace, where they turn IPv4 forwarding on: put back what they changed."""
    found = {path: path.read_text() for path in MACHINE_SYSCTLS}
    yield
    for path, value in found.items():
        if path.read_text() != value:
            path.write_text(value)


@pytest.fixture(scope="session")
def runtime_images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(busybox rootfs, pause image archive), built once per session without a registry."""
    require_runtime_root()
    root = tmp_path_factory.mktemp("runtime-images")
    return busybox_rootfs(root / "rootfs"), build_pause_archive(root / "pause")


@pytest.fixture
def host_address() -> Iterator[str]:
    with host_test_address(HOST_ADDRESS, f"cnsh{os.getpid() % 100000}") as address:
        yield address


@pytest.fixture
def podman(
    tmp_path: Path, cni_network: CniNetwork, runtime_images: tuple[Path, Path]
) -> Iterator[Podman]:
    runtime = Podman(
        tmp_path / "podman",
        plugin_dirs=cni_network.plugin_dirs,
        rootfs=runtime_images[0],
        prefix=cni_network.prefix,
    )
    try:
        runtime.add_network(cni_network.conflist)
        yield runtime
    finally:
        runtime.close()
    assert runtime.leftovers() == []


@pytest.fixture
def containerd(
    tmp_path: Path, cni_network: CniNetwork, runtime_images: tuple[Path, Path]
) -> Iterator[Containerd]:
    runtime = Containerd(
        tmp_path / "containerd",
        conflist=cni_network.conflist,
        plugin_dirs=cni_network.plugin_dirs,
        pause_archive=runtime_images[1],
        prefix=cni_network.prefix,
    )
    try:
        runtime.start()
        yield runtime
    finally:
        runtime.stop()
    assert runtime.leftovers() == []


@pytest.fixture
def cri(containerd: Containerd) -> Iterator[CriClient]:
    with containerd.client() as client:
        yield client


def in_subnet(network: CniNetwork | str, address: str) -> bool:
    subnet = ipaddress.ip_network(network) if isinstance(network, str) else network.subnet
    return ipaddress.ip_address(address) in subnet


# --- podman ----------------------------------------------------------------------------------


@pytest.mark.root
def test_podman_run_gets_an_ip_and_rm_releases_it(podman: Podman, cni_network: CniNetwork) -> None:
    result = podman.run(cni_network.name, ["/bin/ip", "-4", "-o", "addr", "show", "eth0"])
    assert result.returncode == 0, result.stdout + result.stderr
    address = result.stdout.split(" inet ")[1].split("/")[0]
    assert in_subnet(cni_network, address), result.stdout
    assert cni_network.wait_released(address), f"--rm did not release {address}"

    podman.run_detached(cni_network.name, "solo")
    address = podman.ip("solo")
    assert in_subnet(cni_network, address) and not cni_network.is_released(address)
    netns = podman.netns("solo")
    assert Path(netns).exists()
    assert host_routes(address), f"no host route to {address}"

    removed = podman.rm("solo")
    assert removed.returncode == 0, removed.stderr
    assert cni_network.wait_released(address), f"podman rm did not release {address}"
    assert podman.containers() == []
    assert not Path(netns).exists()
    assert host_routes(address) == ""


@pytest.mark.root
def test_podman_containers_ping_each_other_and_the_host(
    podman: Podman, cni_network: CniNetwork, host_address: str
) -> None:
    podman.run_detached(cni_network.name, "a")
    podman.run_detached(cni_network.name, "b")
    ip_a, ip_b = podman.ip("a"), podman.ip("b")
    assert ip_a != ip_b and in_subnet(cni_network, ip_a) and in_subnet(cni_network, ip_b)

    for name, target in (("a", ip_b), ("b", ip_a), ("a", host_address), ("b", host_address)):
        result = podman.exec(name, ["ping", "-c1", "-W2", target])
        if result.returncode != 0:  # the first packet after the veth came up, see ping()
            result = podman.exec(name, ["ping", "-c1", "-W2", target])
        assert result.returncode == 0, f"{name} -> {target}: {result.stdout}{result.stderr}"
    for target in (ip_a, ip_b):
        result = ping(target)
        assert result.returncode == 0, f"host -> {target}: {result.stdout}{result.stderr}"

    assert podman.rm("a", "b").returncode == 0
    assert cni_network.wait_released(ip_a) and cni_network.wait_released(ip_b)
    assert podman.containers() == []


# --- containerd through CRI ------------------------------------------------------------------


@pytest.mark.root
def test_cri_sandbox_lifecycle(cri: CriClient, cni_network: CniNetwork) -> None:
    version = cri.version()
    assert version.runtime_name == "containerd" and version.runtime_api_version == "v1"

    sandbox = cri.run_pod_sandbox("web", "default", str(uuid.uuid4()))
    status = cri.status(sandbox).status
    assert status.state == cri.pb.SANDBOX_READY
    assert status.metadata.name == "web" and status.metadata.namespace == "default"
    address = status.network.ip
    assert in_subnet(cni_network, address), status
    owner = cni_network.owner_of(address)  # CRI's K8S_POD_* CNI_ARGS name the pod in /debug/ips
    assert owner is not None and (owner["podName"], owner["podNamespace"]) == ("web", "default")
    netns = cri.netns(sandbox)
    assert netns and Path(netns).exists()
    result = ping(address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [s.id for s in cri.list_pod_sandboxes()] == [sandbox]

    cri.stop(sandbox)  # CNI DEL with the netns
    assert not cri.ready(sandbox)
    assert cni_network.wait_released(address), f"StopPodSandbox did not release {address}"
    assert not Path(netns).exists()
    assert host_routes(address) == ""
    cri.stop(sandbox)  # idempotent, as kubelet expects

    cri.remove(sandbox)  # CNI DEL again, with an empty CNI_NETNS
    assert cri.list_pod_sandboxes() == []
    cri.remove(sandbox)  # idempotent


@pytest.mark.root
@pytest.mark.slow
def test_cri_50_sandboxes_concurrently(cri: CriClient, cni_network: CniNetwork) -> None:
    names = [f"pod-{n}" for n in range(CONCURRENT_SANDBOXES)]
    with ThreadPoolExecutor(max_workers=CONCURRENT_SANDBOXES) as pool:
        sandboxes = list(
            pool.map(lambda name: cri.run_pod_sandbox(name, "load", str(uuid.uuid4())), names)
        )
        addresses = list(pool.map(cri.pod_ip, sandboxes))
        netns = list(pool.map(cri.netns, sandboxes))

    assert len(set(sandboxes)) == CONCURRENT_SANDBOXES
    assert len(set(addresses)) == CONCURRENT_SANDBOXES, sorted(addresses)
    assert all(in_subnet(cni_network, address) for address in addresses), addresses
    assert not any(cni_network.is_released(address) for address in addresses)
    for address in addresses:
        result = ping(address)
        assert result.returncode == 0, f"host -> {address}: {result.stdout}{result.stderr}"
    # pod to pod, from inside a sandbox's network namespace
    assert netns[0] is not None
    result = ping(addresses[-1], netns=netns[0])
    assert result.returncode == 0, result.stdout + result.stderr

    def stop_and_remove(sandbox: str) -> None:
        cri.stop(sandbox)
        cri.remove(sandbox)

    with ThreadPoolExecutor(max_workers=CONCURRENT_SANDBOXES) as pool:
        list(pool.map(stop_and_remove, sandboxes))

    assert cri.list_pod_sandboxes() == []
    leaked = [a for a in addresses if not cni_network.wait_released(a, timeout=5)]
    assert leaked == [], f"still allocated after RemovePodSandbox: {leaked}"
    assert [a for a in addresses if host_routes(a)] == []
    assert [path for path in netns if path and Path(path).exists()] == []


# --- leak reclamation against containerd's own list of sandboxes --------------------------------


def containerd_with_its_daemon(
    tmp_path: Path,
    make_daemon: Callable[..., Any],
    plugin_dir: Path,
    runtime_images: Any,
    leak_reclaim: dict[str, Any],
) -> tuple[Containerd, Any, CniNetwork]:
    """A containerd (not started) whose sandboxes get their IPs from a `make_daemon` daemon
    (ptp + cns-ipam) that asks it for its sandboxes (`leakReclaim.criSocket`, with
    `leak_reclaim` laid over it)."""
    runtime = Containerd(
        tmp_path / "containerd",
        conflist={"cniVersion": "1.0.0", "name": "placeholder", "plugins": []},
        plugin_dirs=[plugin_dir],
        pause_archive=runtime_images[1],
    )
    daemon = make_daemon({"leakReclaim": {"criSocket": str(runtime.socket), **leak_reclaim}})
    network = ptp_cns_ipam(daemon, plugin_dir)
    runtime.set_conflist(network.conflist)
    return runtime, daemon, network


def run_sandboxes(
    cri: CriClient, namespace: str, names: tuple[str, ...]
) -> tuple[dict[str, str], dict[str, str]]:
    """One sandbox per name, one after the other: (name -> sandbox id, name -> its IP)."""
    sandboxes = {name: cri.run_pod_sandbox(name, namespace, str(uuid.uuid4())) for name in names}
    return sandboxes, {name: cri.pod_ip(sandbox) for name, sandbox in sandboxes.items()}


def leak_fields(daemon: Any, address: str) -> dict[str, Any]:
    (row,) = [ip for ip in daemon.ips() if ip["address"] == address]
    return dict(row)


@pytest.mark.root
@pytest.mark.slow
def test_leaked_ips_come_back_only_once_containerd_no_longer_has_their_sandbox(
    tmp_path: Path, make_daemon: Callable[..., Any], plugin_dir: Path, runtime_images: Any
) -> None:
    """DELs lost while the daemon was down (its queue entries gone): the IP of a removed sandbox
    comes back (reason sandbox-gone), the IP of a stopped one that containerd still lists does
    not, and no live sandbox's IP is touched."""
    runtime, daemon, network = containerd_with_its_daemon(
        tmp_path, make_daemon, plugin_dir, runtime_images, {"checkSeconds": 1, "graceSeconds": 2}
    )
    try:
        runtime.start()
        with runtime.client() as cri:
            sandboxes, address = run_sandboxes(cri, "leaks", ("keep", "lost", "stopped"))

            assert daemon.stop() == 0
            cri.stop(sandboxes["lost"])
            cri.remove(sandboxes["lost"])
            cri.stop(sandboxes["stopped"])  # stays listed, NOTREADY
            queue = daemon.state_dir / "release-queue"
            queued = sorted(queue.iterdir())
            assert len(queued) >= 2, queued  # the DELs came while the daemon was down ...
            for entry in queued:  # ... and are lost
                entry.unlink()
            daemon.start()

            deadline = time.monotonic() + 60
            while "reclaimed" not in leak_fields(daemon, address["lost"]):
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.2)
            lost = leak_fields(daemon, address["lost"])
            assert lost["owner"] is None and lost["reclaimed"]["reason"] == "sandbox-gone"
            assert lost["reclaimed"]["containerID"] == sandboxes["lost"]
            assert lost["reclaimed"]["suspectedSeconds"] >= 2

            checks = daemon.pool()["leakCheck"]["checks"]
            while daemon.pool()["leakCheck"]["checks"] < checks + 4:  # > the grace, once more
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.2)
            for name in ("keep", "stopped"):  # still listed by containerd: never taken
                row = leak_fields(daemon, address[name])
                assert row["owner"]["containerID"] == sandboxes[name], row
                assert "leakSuspect" not in row and "reclaimed" not in row
            for sandbox in cri.list_pod_sandboxes():  # every live sandbox's IP is its own in cns
                if sandbox.state == cri.pb.SANDBOX_READY:
                    owner = network.owner_of(cri.pod_ip(sandbox.id))
                    assert owner is not None and owner["containerID"] == sandbox.id
            result = ping(address["keep"])
            assert result.returncode == 0, result.stdout + result.stderr
            metrics = daemon.metrics()
            assert metrics['cns_ip_leaks_reclaimed_total{reason="sandbox-gone"}'] == 1
            assert metrics["cns_leak_check_runtime_ok"] == 1
            assert '"event": "ip_leak_reclaimed"' in daemon.log()

            for name in ("stopped", "keep"):
                cri.stop(sandboxes[name])
                cri.remove(sandboxes[name])
                assert network.wait_released(address[name])
    finally:
        runtime.stop()
    assert runtime.leftovers() == []


# --- the world checks the state file: containerd's sandboxes after a lost row -----------------


def lose_row(state_file: Path, address: str) -> None:
    """Delete the assignment of `address` from a stopped daemon's state file, with sqlite3."""
    subprocess.run(
        ["sqlite3", str(state_file), f"DELETE FROM assignments WHERE address='{address}'"],
        check=True,
        capture_output=True,
    )
    rows = subprocess.run(
        ["sqlite3", str(state_file), f"SELECT count(*) FROM assignments WHERE address='{address}'"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert rows.stdout.strip() == "0"


@pytest.mark.root
@pytest.mark.slow
def test_an_address_the_state_file_lost_is_adopted_by_its_live_sandbox_and_never_reissued(
    tmp_path: Path, make_daemon: Callable[..., Any], plugin_dir: Path, runtime_images: Any
) -> None:
    """A row lost from state.db while the daemon was down (deleted with sqlite3): at the next
    start containerd's ready sandbox still has the address, so the daemon adopts it for that
    sandbox (durably) before any ADD gets an IP; new ADDs and a new sandbox get other addresses,
    and the sandbox's own DEL frees it."""
    runtime, daemon, network = containerd_with_its_daemon(
        tmp_path, make_daemon, plugin_dir, runtime_images, {"graceSeconds": 3600}
    )
    state_file = daemon.state_dir / "state.db"
    try:
        runtime.start()
        with runtime.client() as cri:
            sandboxes, address = run_sandboxes(cri, "world", ("a", "b", "c"))
            lost = address["a"]  # the first handed out: the first free one after the loss

            assert daemon.stop() == 0
            lose_row(state_file, lost)
            daemon.start()

            added = [
                daemon.call("POST", "/v1/cni/add", {"containerID": f"new-{i}", "ifName": "eth0"})
                for i in range(4)
            ]
            assert all(status == 200 for status, _ in added), added
            fresh = {body["ips"][0]["address"].split("/")[0] for _, body in added}
            assert lost not in fresh and not fresh & set(address.values()), (lost, fresh)
            owner = network.owner_of(lost)
            assert owner is not None and owner["containerID"] == sandboxes["a"], owner
            assert (owner["ifName"], owner["podNamespace"], owner["podName"]) == (
                "eth0",
                "world",
                "a",
            )
            rows = subprocess.run(
                ["sqlite3", str(state_file),
                 f"SELECT container_id FROM assignments WHERE address='{lost}'"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            assert rows.stdout.strip() == sandboxes["a"]  # durable
            world = daemon.pool()["worldCheck"]
            assert world["state"] == "done" and world["sources"] == {"cri": "checked"}, world
            assert world["outcomes"] == {"adopted": 1, "fine": 2}, world
            (finding,) = world["findings"]
            assert finding["address"] == lost and finding["sources"] == ["cri"], finding
            metrics = daemon.metrics()
            assert metrics['cns_state_world_check_addresses_total{outcome="adopted"}'] == 1
            assert metrics['cns_state_world_check_addresses_total{outcome="conflict"}'] == 0
            assert metrics["cns_state_world_check_pending"] == 0
            adopted = [json.loads(line) for line in daemon.log().splitlines()
                       if '"event": "state_adopted"' in line]  # fmt: skip
            assert [(e["address"], e["source"], e["pod"]) for e in adopted] == [
                (lost, "cri", "world/a")
            ]

            extra = cri.run_pod_sandbox("d", "world", str(uuid.uuid4()))
            assert cri.pod_ip(extra) not in {lost, *address.values(), *fresh}
            for i in range(4):
                status, _ = daemon.call("POST", "/v1/cni/del", {"containerID": f"new-{i}",
                                                                "ifName": "eth0"})  # fmt: skip
                assert status == 200
            for sandbox in (*sandboxes.values(), extra):
                cri.stop(sandbox)
                cri.remove(sandbox)
            assert network.wait_released(lost)  # the sandbox's own DEL frees the adopted one
    finally:
        runtime.stop()
    assert runtime.leftovers() == []


# --- dual-stack: an IPv4 and an IPv6 subnet (two lanes) of one standalone daemon ---------------

LANES = {"v4pods": "10.254.20.0/24", "v6pods": "fd00:c5:20::/120"}
# What the runtime hands each plugin of the chain, recorded by `record-cni` (the last plugin):
# every capability a runtime may fill, so runtimeConfig shows all it gives.
CAPABILITIES = ["portMappings", "bandwidth", "ipRanges", "ips", "mac", "dns", "aliases",
                "cgroupPath", "io.kubernetes.cri.pod-annotations", "infinibandGUID",
                "deviceID"]  # fmt: skip
RECORDER = """#!{python}
import json, os, sys
env = {{k: v for k, v in os.environ.items() if k.startswith("CNI_")}}
if env["CNI_COMMAND"] == "VERSION":
    print(json.dumps({{"cniVersion": "1.0.0", "supportedVersions": ["0.4.0", "1.0.0"]}}))
    sys.exit(0)
conf = json.load(sys.stdin)
with open(conf["record"], "a") as out:
    print(json.dumps({{"env": env, "runtimeConfig": conf.get("runtimeConfig")}}), file=out)
if env["CNI_COMMAND"] == "ADD":
    print(json.dumps(conf["prevResult"]))
"""


@dataclass
class ScratchHost:
    """A network namespace playing the node: the daemon and the runtime run in it (`nsenter
    --net`, their mount namespace stays the machine's, so the runtime's pod namespaces under
    /run/netns are seen by all), and with them every veth, route and sysctl the plugins make, the
    IPv6 forwarding first (see tests/integration/test_dual_stack.py). Deleting it removes them
    all."""

    name: str

    @property
    def enter(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.name}"]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.enter, *args], capture_output=True, text=True, cwd=REPO)


@pytest.fixture
def scratch_host() -> Iterator[ScratchHost]:
    made = ScratchHost(f"cnsrt-{uuid.uuid4().hex[:6]}")
    machine = {path: path.read_text() for path in MACHINE_SYSCTLS}
    try:
        subprocess.run(["ip", "netns", "add", made.name], check=True, capture_output=True)
        subprocess.run(["ip", "-n", made.name, "link", "set", "lo", "up"], check=True)
        yield made
    finally:
        subprocess.run(["ip", "netns", "del", made.name], capture_output=True)
    assert {path: path.read_text() for path in MACHINE_SYSCTLS} == machine


def start_in(
    host: ScratchHost, make_daemon: Callable[..., Any], standalone: Any, **config: Any
) -> Any:
    """A `make_daemon` daemon running in `host`."""
    daemon = make_daemon({"standalone": standalone, **config}, start=False)
    daemon.start(prefix=host.enter, wait=False)
    daemon.wait_socket()
    return daemon


def status(host: ScratchHost, daemon: Any) -> dict[str, Any]:
    """`cns status --json --ips` run beside the daemon (its debug port is on `host`'s loopback):
    {"pool": ..., "ips": [...]}, every lane's IPs with their owners."""
    done = host.run(sys.executable, "-m", "cns.commands.cli", "status", "--json", "--ips",
                    "--debug-url", daemon.debug_url)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def debug_get(host: ScratchHost, daemon: Any, path: str) -> str:
    """A debug endpoint of a daemon in `host`, as text."""
    url = f"{daemon.debug_url}{path}"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    done = host.run(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    return done.stdout


def held(host: ScratchHost, daemon: Any) -> dict[str, dict[str, Any]]:
    """address -> its /debug/ips row, for every address that has an owner."""
    return {ip["address"]: ip for ip in status(host, daemon)["ips"] if ip["owner"]}


def assigned_per_lane(state: dict[str, Any]) -> dict[str, int]:
    pool = state["pool"]
    lanes = {pool["subnet"]: pool, **pool["subnets"]}
    return {name: lane["ips"]["Assigned"] for name, lane in lanes.items()}


def recorded(path: Path, command: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    return [call for call in calls if call["env"]["CNI_COMMAND"] == command]


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    """The directory of `record-cni` (see RECORDER)."""
    bin_dir = tmp_path / "recorder-bin"
    bin_dir.mkdir()
    plugin = bin_dir / "record-cni"
    plugin.write_text(RECORDER.format(python=sys.executable))
    plugin.chmod(0o755)
    return bin_dir


def dual_stack_network(
    kind: str, daemon: Any, host: ScratchHost, plugin_dir: Path, recorder: Path
) -> CniNetwork:
    """cns-cni, or the reference ptp with cns-ipam, asking for one address of each lane."""
    network = cns_cni(daemon, plugin_dir) if kind == "cns-cni" else ptp_cns_ipam(daemon, plugin_dir)
    first = network.conflist["plugins"][0]
    (first if kind == "cns-cni" else first["ipam"])["subnets"] = list(LANES)
    network.conflist["name"] = f"dual-{kind}"
    network.conflist["plugins"][1] = {
        "type": "record-cni",
        "record": str(daemon.workdir / "calls.jsonl"),
        "capabilities": dict.fromkeys(CAPABILITIES, True),
    }

    def owner_of(address: str) -> dict[str, Any] | None:
        row = held(host, daemon).get(address)
        return row["owner"] if row else None

    network.owner_of = owner_of
    network.is_released = lambda address: owner_of(address) is None
    network.subnet = ipaddress.ip_network(LANES["v4pods"])
    network.plugin_dirs.append(recorder)
    network.prefix = host.enter
    return network


def in_lanes(addresses: dict[str, str]) -> bool:
    return all(ipaddress.ip_address(addresses[lane]) in ipaddress.ip_network(subnet)
               for lane, subnet in LANES.items())  # fmt: skip


class TestDualStack:
    """A pair of podman containers and a pair of CRI sandboxes, each with an IPv4 and an IPv6
    address (one per lane) through `cns-cni` and through the reference `ptp` with `cns-ipam`,
    pinging each other over both families; removal gives both lanes their addresses back.

    The daemon and the runtime run in a scratch namespace playing the node (`ScratchHost`):
    the IPv6 forwarding and everything else the plugins set there goes with it."""

    @pytest.fixture
    def daemon(self, scratch_host: ScratchHost, make_daemon: Callable[..., Any]) -> Any:
        require_runtime_root()
        standalone = {
            "name": "v4pods",
            "subnet": LANES["v4pods"],
            "subnets": [{"name": "v6pods", "subnet": LANES["v6pods"]}],
        }
        return start_in(scratch_host, make_daemon, standalone)

    @pytest.fixture(params=["cns-cni", "ptp-cns-ipam"])
    def cni_network(
        self,
        request: pytest.FixtureRequest,
        scratch_host: ScratchHost,
        daemon: Any,
        plugin_dir: Path,
        recorder: Path,
    ) -> CniNetwork:
        return dual_stack_network(request.param, daemon, scratch_host, plugin_dir, recorder)

    @pytest.mark.root
    def test_podman_pair_pings_over_both_families_and_rm_frees_both_lanes(
        self, podman: Podman, cni_network: CniNetwork, scratch_host: ScratchHost, daemon: Any
    ) -> None:
        """podman 4.3 (CNI backend) shows both addresses in `podman inspect`: `IPAddress` and
        `GlobalIPv6Address` of the network. It passes CNI_ARGS `IgnoreUnknown=1;K8S_POD_NAME=
        <container name>` (no namespace) and, of all the capabilities, only `aliases` (these
        containers publish no ports)."""
        ids = {name: podman.run_detached(cni_network.name, name) for name in ("a", "b")}
        addresses = {}
        for name in ids:
            shown = podman.inspect(name)["NetworkSettings"]["Networks"][cni_network.name]
            addresses[name] = {"v4pods": shown["IPAddress"], "v6pods": shown["GlobalIPv6Address"]}
            assert in_lanes(addresses[name]), shown
        assert addresses["a"] != addresses["b"]
        assert_held_per_lane(held(scratch_host, daemon), ids, addresses)
        (add_a, add_b) = recorded(daemon.workdir / "calls.jsonl", "ADD")
        for call, name in ((add_a, "a"), (add_b, "b")):
            assert call["env"]["CNI_ARGS"] == f"IgnoreUnknown=1;K8S_POD_NAME={name}"
            assert call["env"]["CNI_CONTAINERID"] == ids[name]
            assert call["runtimeConfig"] == {"aliases": {cni_network.name: [ids[name][:12]]}}

        for source, target in (("a", "b"), ("b", "a")):
            for address in addresses[target].values():
                result = podman.exec(source, ["ping", "-c1", "-W2", address])
                if result.returncode != 0:  # the first packet after the veth came up, see ping()
                    result = podman.exec(source, ["ping", "-c1", "-W2", address])
                assert result.returncode == 0, (
                    f"{source} -> {address}: {result.stdout}{result.stderr}"
                )

        assert podman.rm("a", "b").returncode == 0
        state = status(scratch_host, daemon)
        assert [ip for ip in state["ips"] if ip["owner"]] == []
        assert assigned_per_lane(state) == {"v4pods": 0, "v6pods": 0}
        assert len(recorded(daemon.workdir / "calls.jsonl", "DEL")) == 2

    @pytest.mark.root
    def test_cri_pair_pings_over_both_families_and_removal_frees_both_lanes(
        self, cri: CriClient, cni_network: CniNetwork, scratch_host: ScratchHost, daemon: Any
    ) -> None:
        """containerd 1.6 (CRI) shows both addresses in PodSandboxStatus: `network.ip` the IPv4
        one (the first of the CNI result), `network.additional_ips` the IPv6 one. It passes
        CNI_ARGS with the pod's namespace, name, infra container id and uid, and, of all the
        capabilities, `io.kubernetes.cri.pod-annotations` (these sandboxes have no ports)."""
        names = ("a", "b")
        ids = {name: cri.run_pod_sandbox(name, "dual", str(uuid.uuid4())) for name in names}
        addresses, netns = {}, {}
        for name, sandbox in ids.items():
            network = cri.status(sandbox).status.network
            assert len(network.additional_ips) == 1, network
            addresses[name] = {"v4pods": network.ip, "v6pods": network.additional_ips[0].ip}
            assert in_lanes(addresses[name]), network
            netns[name] = cri.netns(sandbox)
        assert addresses["a"] != addresses["b"]
        assert_held_per_lane(held(scratch_host, daemon), ids, addresses, namespace="dual")
        (add_a, add_b) = recorded(daemon.workdir / "calls.jsonl", "ADD")
        for call, name in ((add_a, "a"), (add_b, "b")):
            args = dict(pair.split("=", 1) for pair in call["env"]["CNI_ARGS"].split(";"))
            assert args.pop("K8S_POD_UID")
            assert args == {"IgnoreUnknown": "1", "K8S_POD_NAMESPACE": "dual",
                            "K8S_POD_NAME": name,
                            "K8S_POD_INFRA_CONTAINER_ID": ids[name]}  # fmt: skip
            assert set(call["runtimeConfig"]) == {"io.kubernetes.cri.pod-annotations"}, call

        for source, target in (("a", "b"), ("b", "a")):
            for address in addresses[target].values():
                result = ping(address, netns=netns[source])
                assert result.returncode == 0, (
                    f"{source} -> {address}: {result.stdout}{result.stderr}"
                )

        for sandbox in ids.values():
            cri.stop(sandbox)
            cri.remove(sandbox)
        state = status(scratch_host, daemon)
        assert [ip for ip in state["ips"] if ip["owner"]] == []
        assert assigned_per_lane(state) == {"v4pods": 0, "v6pods": 0}


def assert_held_per_lane(
    rows: dict[str, dict[str, Any]],
    ids: dict[str, str],
    addresses: dict[str, dict[str, str]],
    namespace: str = "",
) -> None:
    """Each container holds exactly its two addresses, one in each lane, under its pod name."""
    assert sorted(rows) == sorted(a for pair in addresses.values() for a in pair.values())
    for name, pair in addresses.items():
        for lane, address in pair.items():
            row = rows[address]
            assert row.get("subnet", "v4pods") == lane, row  # the primary lane's rows name none
            owner = row["owner"]
            assert (owner["containerID"], owner["podName"]) == (ids[name], name), row
            assert owner["podNamespace"] == namespace, row


# --- one lane exhausted, the other untouched ----------------------------------------------------

SMALL, ROOMY = ("v6small", "fd00:c5:21::/125"), ("v4pods", "10.254.21.0/24")
LANE_TIMEOUT = 2  # addTimeoutSeconds: how long an ADD waits for an address of a full lane


class TestLanes:
    """A tiny IPv6 subnet (a few addresses) filled up beside a roomy IPv4 one, on podman 4.3
    with `cns-cni`: three networks name the small subnet, the roomy one, and both."""

    @pytest.fixture
    def daemon(self, scratch_host: ScratchHost, make_daemon: Callable[..., Any]) -> Any:
        require_runtime_root()
        standalone = {
            "name": ROOMY[0],
            "subnet": ROOMY[1],
            "subnets": [{"name": SMALL[0], "subnet": SMALL[1]}],
        }
        return start_in(
            scratch_host,
            make_daemon,
            standalone,
            addTimeoutSeconds=LANE_TIMEOUT,
            ipCooldownSeconds=0,  # a freed address is the next ADD's at once
        )

    @pytest.fixture
    def cni_network(
        self, scratch_host: ScratchHost, daemon: Any, plugin_dir: Path, recorder: Path
    ) -> CniNetwork:
        network = dual_stack_network("cns-cni", daemon, scratch_host, plugin_dir, recorder)
        network.conflist["name"] = "roomy"
        network.conflist["plugins"][0]["subnets"] = [ROOMY[0]]
        return network

    @pytest.mark.root
    def test_a_full_subnet_fails_its_adds_and_never_the_other_subnets_pods(
        self, podman: Podman, cni_network: CniNetwork, scratch_host: ScratchHost, daemon: Any
    ) -> None:
        """Filled, the small subnet fails its ADDs after `addTimeoutSeconds` with code 11
        naming it (podman shows the message, not the code: the daemon's metrics have it), while
        containers of the roomy one come and go; an ADD of both fails holding no address of
        either. One small address freed, the next container of it gets that address."""
        for name, subnets in (("small", [SMALL[0]]), ("both", [ROOMY[0], SMALL[0]])):
            conflist = json.loads(json.dumps(cni_network.conflist))
            conflist["name"], conflist["plugins"][0]["subnets"] = name, subnets
            podman.add_network(conflist)

        def address(name: str, network: str) -> str:
            shown = podman.inspect(name)["NetworkSettings"]["Networks"][network]
            return str(shown["GlobalIPv6Address" if network == "small" else "IPAddress"])

        small: dict[str, str] = {}  # container -> its address of the small subnet
        while (last := podman.start("small", f"small-{len(small)}")).returncode == 0:
            small[f"small-{len(small)}"] = address(f"small-{len(small)}", "small")
            assert len(small) < 8, f"{SMALL[1]} never filled up: {small}"
        assert len(small) >= 2 and all(in_subnet(SMALL[1], a) for a in small.values()), small
        assert_no_free_ip_of_small(last.stderr)

        def waiting_for_small(started: Future[subprocess.CompletedProcess[str]]) -> dict[str, Any]:
            """The daemon's state once the ADD `started` waits for an address of the small
            subnet."""
            deadline = time.monotonic() + 30
            state = status(scratch_host, daemon)
            while state["pool"]["subnets"][SMALL[0]]["waitingAdds"] != 1:
                assert time.monotonic() < deadline and not started.done(), started
                state = status(scratch_host, daemon)
            return state

        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(podman.start, "small", "small-waits")
            waiting_for_small(waiting)
            for n in range(2):  # the roomy subnet meanwhile: containers come and go
                podman.run_detached("roomy", f"roomy-{n}")
                roomy = address(f"roomy-{n}", "roomy")
                assert in_subnet(ROOMY[1], roomy)
                assert held(scratch_host, daemon)[roomy]["owner"]["podName"] == f"roomy-{n}"
                assert podman.rm(f"roomy-{n}").returncode == 0
            assert_no_free_ip_of_small(waiting.result().stderr)

        with ThreadPoolExecutor(max_workers=1) as pool:
            started = pool.submit(podman.start, "both", "both-0")
            state = waiting_for_small(started)  # it counts in both lanes, holding neither
            assert state["pool"]["waitingAdds"] == 1
            assert [ip for ip in state["ips"] if ip["owner"]] == [
                ip for ip in state["ips"] if ip["address"] in small.values()
            ]
            both = started.result()
        assert both.returncode != 0
        assert_no_free_ip_of_small(both.stderr, both=True)
        rows = held(scratch_host, daemon)
        assert sorted(rows) == sorted(small.values()), rows  # nothing of the roomy subnet
        assert assigned_per_lane(status(scratch_host, daemon)) == {
            ROOMY[0]: 0,
            SMALL[0]: len(small),
        }
        metrics = parse_metrics(debug_get(scratch_host, daemon, "/metrics"))
        failed = 'cns_cni_request_duration_seconds_count{result="error11",verb="attach"}'
        assert metrics[failed] == 3

        assert podman.rm("small-0", "small-waits", "both-0").returncode == 0
        assert podman.start("small", "small-again").returncode == 0
        assert address("small-again", "small") == small["small-0"]


def assert_no_free_ip_of_small(stderr: str, both: bool = False) -> None:
    """podman's error is the plugin's message (and details), as the daemon wrote it."""
    asks = f"{ROOMY[0]}, {SMALL[0]}" if both else SMALL[0]
    assert 'plugin type="cns-cni" failed (add)' in stderr, stderr
    assert (
        f"no free IP of subnet {SMALL[0]} within {LANE_TIMEOUT} s (the ADD asks for one of each "
        f"of {asks}, all or none): subnet exhausted"
    ) in stderr, stderr
