"""A Kubernetes cluster of several nodes on one machine: `make cluster-up NODES=3` and the
multi-node tests (tests/e2e/test_multinode.py) run this same harness.

    with MultiNodeCluster.start(workdir, nodes=3, image=(tag, archive)) as cluster:
        cluster.kube.apply(deployment("web", 9))
        cluster.wait_running("app=web", 9)

The control plane runs on the host: etcd on loopback; kube-apiserver on the address of the
cluster's own bridge (`LAN`: 10.123.0.1, a test-only range), so that its certificate names that
address and the Service `kubernetes` points there; kube-scheduler and kube-controller-manager.

Each node (`ClusterNode`) is a network namespace and a mount namespace of its own, held by one
`sleep` process (`NodeHost`): its uplink `eth0` is a veth onto the bridge with the node's address
(10.123.0.11, .12, ...), its /sys is that namespace's sysfs, and its own directories are mounted
over the paths every kubelet, containerd and libcni use whatever their configuration (/run, with
/run/containerd and /run/netns; /var/log/pods, /var/log/containers, /var/lib/cni), so two nodes
never share state. In it run the node's containerd, kubelet (`--node-ip`) and kube-proxy
(iptables mode: its rules are the node's netns's). The kubelets manage no cgroups
(`cgroupsPerQOS: false`): each pod's cgroup is one of containerd's, named by its sandbox, under
POD_CGROUP_PARENT. Nothing of a node is visible on the host but its processes, the host end of
its veth and its directory.

cns arrives as an operator installs it: the image imported into every node's containerd and
`kubectl apply -k` of one overlay of config/ for every node. The overlay moves the DaemonSet's
host paths that a node's mount namespace does not already hold (/opt/cni, /etc/cni/net.d,
/var/lib/cns, the kubelet's seccomp dir) below `this_node` (WORKDIR/this-node), the directory over
which each node mounts its own; the in-cluster API address is the Service `kubernetes`, through
kube-proxy.

The pod subnet is the LAN's own (the flat network of docs/networking.md): the ClusterSubnet is
10.123.0.0/24 with the bridge as gateway (`PTP_GATEWAY` with ptp); the controller excludes the
nodes' addresses. Pods of one node reach each other and their node; across nodes they need the
daemon's flat-network mode (`flat_network`), which answers ARP for a node's pods on its uplink.

`dual_stack` (with `cns-cni`) adds IPv6 to all of it: fd00:123::1/64 on the bridge, fd00:123::1<N>
on each node (IPv6 forwarding and proxy NDP in its own netns), Services of both families, and a
second ClusterSubnet (fd00:123::/112) that the namespace `default` names beside the first, so
that every pod there gets an address of each (docs/cluster.md, "Dual-stack").

`stop()` puts the host back as it was: links, processes, mounts (they die with the namespaces),
cgroups, the kubelets' global sysctls; `host_state()` is what a test compares.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import yaml

from tests.harness import REPO
from tests.harness.containerd import Containerd
from tests.harness.host import cgroup_dirs, remove_cgroup, run, system_env
from tests.harness.install_node import rewrite_paths, write_overlay
from tests.harness.kube_api import CS_API
from tests.harness.kube_cluster import KubeCluster
from tests.harness.kube_node import (
    KUBELET_API_QPS,
    KUBELET_LOG_DIRS,
    POD_CGROUP_PARENT,
    WORKLOAD_IMAGE,
    NodeError,
    PodQueries,
    control_plane_argv,
    deployment,
    finish_off_sandboxes,
    host_state,
    kubelet_config,
    sandbox_netns,
)
from tests.harness.podman import PAUSE_IMAGE, build_pause_archive
from tests.harness.process import ManagedProcess, die_with_parent, tail

LAN = ipaddress.ip_interface("10.123.0.1/24")
# The dual-stack LAN's IPv6 side: the bridge's address, and the pods' IPv6 subnet, a range of the
# LAN's /64 that holds the nodes' addresses (fd00:123::1<N>) as the IPv4 one does.
LAN6 = ipaddress.ip_interface("fd00:123::1/64")
POD_SUBNET6 = ipaddress.ip_network("fd00:123::/112")
# The pods' gateway with `ptp`, which puts it on the node end of every pod's veth: an address of
# the LAN that no host holds (the bridge's, the API server's, would become local to every node).
PTP_GATEWAY = LAN.network[-2]
BRIDGE = "cnsmn0"
UPLINK = "eth0"
PLUGIN_SETUPS = ("cns-cni", "ptp-cns-ipam")
DUAL_STACK = "dual-stack"
# The clusters the tests share (tests/e2e/conftest.py): `ptp` + `cns-ipam` on an IPv4 LAN, and
# `cns-cni` on a dual-stack one (every pod IPv4 and IPv6), which checks every IPv4 property an
# IPv4 one would: one cluster start fewer in the suite's time.
KINDS = ("ptp-cns-ipam", DUAL_STACK)
# The kind of cluster a test asking for a plugin set-up runs on (one not named: its own name).
KIND_OF_SETUP = {"cns-cni": DUAL_STACK}
SUBNET_NAME = "pod-subnet"
SUBNET6_NAME = "pod-subnet-v6"  # after SUBNET_NAME by name: the nodes' primary stays the IPv4 one
# The namespace annotation that gives a pod one address of each subnet (docs/kubernetes.md).
SUBNETS_ANNOTATION = "acn.azure.com/subnets"
DUAL_STACK_GATE = "IPv6DualStack"
CNS = "app.kubernetes.io/name=cns"
# Fixed paths of the kubelet, containerd (its shims' sockets, the pods' netns) and libcni (its
# result cache): each node's own directory (the value) is mounted over them.
NODE_FIXED_PATHS = {
    Path("/run"): "run",
    **{path: f"log-{path.name}" for path in KUBELET_LOG_DIRS},
    Path("/var/lib/cni"): "var-lib-cni",
}
# config/daemonset.yaml's host paths -> below the cluster's `this_node`.
DAEMONSET_PATHS = {
    "/opt/cni": "opt-cni",
    "/etc/cni/net.d": "net.d",
    "/var/lib/cns": "var-lib-cns",
    "/var/lib/kubelet/seccomp": "kubelet/seccomp",
}
# The node's mount namespace: its /sys for its network namespace (keeping the host's cgroup
# hierarchies), its directory over the cluster's this-node, its own ones over the fixed paths;
# then it waits.
HOLDER_SCRIPT = r"""
set -eu
node=$1 this=$2
shift 2
mkdir -p "$node/.cgroup"
mount --rbind /sys/fs/cgroup "$node/.cgroup"
umount -l /sys
mount -t sysfs sysfs /sys
mount --move "$node/.cgroup" /sys/fs/cgroup
mount --bind "$node" "$this"
while [ $# -gt 0 ]; do mount --bind "$node/$1" "$2"; shift 2; done
# As on a booted node: every mount shared (new peer groups: nothing reaches the host's), and
# /run/netns a mount of its own, which pods mount with HostToContainer propagation.
mkdir -p /run/netns
mount --bind /run/netns /run/netns
mount --make-rshared /
ip link set lo up
echo ready
exec sleep 2147483647
"""


def node_address(index: int) -> ipaddress.IPv4Interface:
    """Node `index` (1, 2, ...) has 10.123.0.1<index> on its uplink."""
    return ipaddress.IPv4Interface(f"{LAN.network[10 + index]}/{LAN.network.prefixlen}")


def node_address6(index: int) -> ipaddress.IPv6Interface:
    """On a dual-stack LAN node `index` has fd00:123::1<index> too."""
    return ipaddress.IPv6Interface(
        f"{LAN6.network.network_address}1{index}/{LAN6.network.prefixlen}"
    )


def lan_mac(host: int) -> str:
    """A fixed, locally administered MAC for host number `host` of the LAN (the bridge is 1)."""
    return f"02:00:0a:7b:00:{host:02x}"


class Lan:
    """The cluster's L2 segment: a bridge on the host holding the LAN's gateway address (and
    the IPv6 one on a dual-stack LAN: an address of a link the harness made, gone with it)."""

    def __init__(self, *, dual_stack: bool) -> None:
        self.dual_stack = dual_stack

    def up(self) -> None:
        # A MAC of its own: a bridge otherwise takes its lowest port's, and changes it when a
        # node's veth comes and goes, leaving every node's neighbour entry for the gateway stale.
        run(["ip", "link", "add", BRIDGE, "address", lan_mac(1), "type", "bridge"], check=True)
        run(["ip", "addr", "add", str(LAN), "dev", BRIDGE], check=True)
        if self.dual_stack:
            run(["ip", "addr", "add", str(LAN6), "dev", BRIDGE, "nodad"], check=True)
        run(["ip", "link", "set", BRIDGE, "up"], check=True)

    def down(self) -> None:
        run(["ip", "link", "del", BRIDGE])


class NodeHost:
    """A node's network and mount namespaces, held by one process; `prefix` runs a command in
    them. Its uplink is a veth onto the LAN's bridge (host end `cnsmn<index>`); `dual_stack`:
    with an IPv6 address and default route too."""

    def __init__(self, index: int, directory: Path, this_node: Path, *, dual_stack: bool) -> None:
        self.index = index
        self.directory = directory
        self.this_node = this_node
        self.address = node_address(index)
        self.address6 = node_address6(index) if dual_stack else None
        self.host_link = f"cnsmn{index}"
        self.holder: subprocess.Popen[str] | None = None
        self.created_paths: list[Path] = []

    @property
    def pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    @property
    def prefix(self) -> list[str]:
        return ["nsenter", f"--target={self.pid}", "--net", "--mount", "--"]

    def run(self, *argv: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([*self.prefix, *argv], check=check, timeout=60)

    def path(self, inside: str | Path) -> Path:
        """A path of the node's mount namespace, as the host reaches it (through the holder's
        root, where an absolute symlink such as /var/run -> /run would lead back to the host's:
        /var/run is spelled /run)."""
        relative = str(inside).lstrip("/")
        if relative == "var/run" or relative.startswith("var/run/"):
            relative = relative[len("var/") :]
        return Path(f"/proc/{self.pid}/root") / relative

    def start(self) -> None:
        binds: list[str] = []
        for fixed, name in NODE_FIXED_PATHS.items():
            (self.directory / name).mkdir(parents=True, exist_ok=True)
            if not fixed.exists():  # a mount point is needed: removed again by `stop`
                fixed.mkdir(parents=True)
                self.created_paths.append(fixed)
            binds += [name, str(fixed)]
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "--",
             "sh", "-c", HOLDER_SCRIPT, "holder", str(self.directory), str(self.this_node),
             *binds],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        assert self.holder.stdout is not None
        said = self.holder.stdout.readline()
        if said.strip() != "ready":
            raise NodeError(f"node {self.index}: its namespaces: {said}{self.holder.stdout.read()}")
        uplink = f"{self.host_link}u"
        run(["ip", "link", "add", self.host_link, "type", "veth", "peer", "name", uplink,
             "netns", str(self.pid)], check=True)  # fmt: skip
        run(["ip", "link", "set", self.host_link, "master", BRIDGE, "up"], check=True)
        # The same MAC at every start, as a NIC keeps it across a reboot: a new one would leave
        # the other nodes' neighbour entries for this node stale (unanswered until re-probed).
        self.run("ip", "link", "set", uplink, "name", UPLINK, "address", lan_mac(10 + self.index))
        self.run("ip", "addr", "add", str(self.address), "dev", UPLINK)
        if self.address6 is not None:
            self.run("ip", "addr", "add", str(self.address6), "dev", UPLINK, "nodad")
        self.run("ip", "link", "set", UPLINK, "up")
        self.run("ip", "route", "add", "default", "via", str(LAN.ip))
        # What config/daemonset.yaml asks of a node's operator, in the node's own netns (its
        # sysctls are that namespace's: the host's stay as they are).
        self.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        if self.address6 is not None:
            # The IPv6 default route (the Services' IPv6 range is routed through it, as the
            # IPv4 one) and what the flat-network mode asks for IPv6 pods (docs/networking.md).
            self.run("ip", "-6", "route", "add", "default", "via", str(LAN6.ip))
            self.run("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1",
                     f"net.ipv6.conf.{UPLINK}.proxy_ndp=1")  # fmt: skip

    def uplink_mac(self) -> str:
        return self.run("cat", f"/sys/class/net/{UPLINK}/address").stdout.strip()

    def stop(self) -> None:
        """The holder goes, and with it the namespaces (once the node's processes are gone)."""
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()
            self.holder = None
        run(["ip", "link", "del", self.host_link])
        for path in reversed(self.created_paths):
            with contextlib.suppress(OSError):
                path.rmdir()


class ClusterNode:
    """One node: its `NodeHost`, containerd (the images imported), kubelet and kube-proxy."""

    def __init__(
        self, cluster: MultiNodeCluster, index: int, *, conflist: dict[str, Any] | None
    ) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"node{index}"
        self.directory = cluster.workdir / self.name
        self.host = NodeHost(
            index, self.directory, cluster.this_node, dual_stack=cluster.dual_stack
        )
        self.address = str(self.host.address.ip)
        # Its InternalIPs, IPv4 first.
        self.addresses = [self.address]
        if self.host.address6 is not None:
            self.addresses.append(str(self.host.address6.ip))
        # The cgroup parent of the sandboxes a test makes through CRI; the kubelet's pods go
        # under containerd's default (POD_CGROUP_PARENT), one cgroup each.
        self.cgroup_parent = f"/cns-cluster-{self.name}"
        self.conflist = conflist
        self.containerd: Containerd | None = None
        self.kubelet = ManagedProcess("kubelet", [], self.directory / "kubelet.log")
        self.kube_proxy = ManagedProcess("kube-proxy", [], self.directory / "kube-proxy.log")

    @property
    def up(self) -> bool:
        """Whether its namespaces are held (started, not stopped, the holder alive)."""
        return self.host.holder is not None and self.host.holder.poll() is None

    def start_namespaces(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.host.start()

    def forget_run_state(self) -> None:
        """What a reboot empties (a stopped node only): its /run, a tmpfs on a real node (the
        runtime's sockets, the pods' netns files, cns's socket), and containerd's state, which is
        /run/containerd there. /var/lib stays: the cns state, the images, libcni's cache."""
        assert not self.up, f"{self.name} is running"
        for volatile in (self.directory / "run", self.directory / "containerd" / "state"):
            shutil.rmtree(volatile, ignore_errors=True)
            volatile.mkdir(parents=True)

    def start_runtime(self, archives: list[Path]) -> None:
        """containerd with the pause, workload and `archives` images (slow: any thread)."""
        self.containerd = Containerd(
            self.directory / "containerd",
            conflist=self.conflist,
            cni_dirs=(self.directory / "opt-cni" / "bin", self.directory / "net.d"),
            pause_archive=archives[0],
            cgroup_parent=self.cgroup_parent,
            prefix=self.host.prefix,
            socket=self.directory / "run" / "containerd" / "containerd.sock",
        )
        self.containerd.start()
        self.containerd.ctr("-n", "k8s.io", "images", "tag", PAUSE_IMAGE, WORKLOAD_IMAGE)
        for archive in archives[1:]:
            self.containerd.ctr("-n", "k8s.io", "images", "import", archive, check=True)

    def start_agents(self) -> None:
        """The kubelet and kube-proxy (from the main thread: they die with the harness)."""
        assert self.containerd is not None
        kube = self.cluster.kube
        kubelet_root = self.directory / "kubelet"
        kubelet_root.mkdir(exist_ok=True)
        config = kubelet_config(
            address=self.address,
            ports=(10250, 10248),
            max_pods=110,
            api_qps=KUBELET_API_QPS,
            volume_plugin_dir=self.directory / "volume-plugins",
        )
        gates = self.cluster.feature_gates
        if gates:
            config["featureGates"] = gates
        (self.directory / "kubelet.yaml").write_text(yaml.safe_dump(config))
        endpoint = f"unix://{self.containerd.socket}"
        self.kubelet.argv = [
            *self.host.prefix,
            str(kube.bin_dir / "kubelet"),
            f"--config={self.directory / 'kubelet.yaml'}",
            f"--kubeconfig={kube.kubeconfig}",
            f"--root-dir={kubelet_root}",
            f"--seccomp-profile-root={kubelet_root / 'seccomp'}",
            f"--cert-dir={self.directory / 'kubelet-certs'}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint={endpoint}",
            f"--image-service-endpoint={endpoint}",
            "--runtime-request-timeout=2m",
            f"--hostname-override={self.name}",
            f"--node-ip={','.join(self.addresses)}",
            "--v=2",
        ]
        self.kubelet.env = system_env()
        self.kubelet.spawn(self.directory)
        proxy_config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "mode": "iptables",
            "clientConnection": {"kubeconfig": str(kube.kubeconfig)},
            "hostnameOverride": self.name,
            "bindAddress": self.address,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "oomScoreAdj": 0,
            # 0: leave the conntrack table's size (a host-wide setting) and timeouts as they are.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }
        if gates:  # both families' rules (iptables and ip6tables, the node's own tables)
            proxy_config["featureGates"] = gates
        (self.directory / "kube-proxy.yaml").write_text(yaml.safe_dump(proxy_config))
        self.kube_proxy.argv = [
            *self.host.prefix,
            str(kube.bin_dir / "kube-proxy"),
            f"--config={self.directory / 'kube-proxy.yaml'}",
            "--v=2",
        ]
        self.kube_proxy.env = system_env()
        self.kube_proxy.spawn(self.directory)

    def stop(self) -> None:
        self.kubelet.stop(10)
        if self.containerd is not None:
            self.containerd.stop()  # removes every sandbox (their CNI DEL), kills the shims
        self.kube_proxy.stop(5)
        self.host.stop()
        remove_cgroup(self.cgroup_parent)

    def pod_netns(self, pod: str) -> str:
        """The path of `pod`'s network namespace as the host reaches it."""
        assert self.containerd is not None
        return sandbox_netns(self.containerd, pod, self.host.path)

    def in_pod(
        self, pod: str, *argv: str, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """`argv` in `pod`'s network namespace (host tools: ping, ...)."""
        return run(["nsenter", f"--net={self.pod_netns(pod)}", "--", *argv], timeout=timeout)

    def log_tail(self, lines: int = 20) -> str:
        parts = [
            f"--- {self.name} {process.name}\n{tail(process.log, lines)}"
            for process in (self.kubelet, self.kube_proxy)
        ]
        if self.containerd is not None:
            parts.append(f"--- {self.name} containerd\n{self.containerd.log(lines)}")
        return "\n".join(parts)


def ptp_conflist(this_node: Path) -> dict[str, Any]:
    """The reference `ptp` with `cns-ipam` (installed by the DaemonSet) as its IPAM."""
    return {
        "cniVersion": "0.4.0",
        "name": "ptp-cns-ipam",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": False,
                "mtu": 1500,
                "ipam": {
                    "type": "cns-ipam",
                    "socket": "/run/cns/cns.sock",
                    "releaseQueueDir": str(this_node / "var-lib-cns" / "release-queue"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
        ],
    }


class MultiNodeCluster(PodQueries):
    """The control plane and `nodes` nodes on one bridge, cns installed (see the module).

    `image`: (tag, archive) of `make image`. `plugin`: one of PLUGIN_SETUPS: `cns-cni` (the
    conflist the DaemonSet's install-cni writes) or `ptp-cns-ipam` (the reference ptp with
    cns-ipam, a conflist of the node's operator; install-cni then writes none). `flat_network`:
    the daemon's flat-network mode (`flatNetwork` in its config file) on. `dual_stack` (with
    `cns-cni`): the LAN, the nodes and the Services IPv4 and IPv6 (`IPv6DualStack` on every
    component), a second ClusterSubnet of the LAN's IPv6 range, and the namespace `default`
    annotated to give each pod one address of each subnet. `daemon_settings`: top-level keys of
    the daemons' config file (the ConfigMap) set from the start, e.g. `ipPressure`.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        nodes: int,
        image: tuple[str, Path],
        plugin: str = "cns-cni",
        flat_network: bool = False,
        dual_stack: bool = False,
        daemon_settings: Mapping[str, Any] | None = None,
    ) -> None:
        if plugin not in PLUGIN_SETUPS:
            raise ValueError(f"plugin {plugin!r}: one of {', '.join(PLUGIN_SETUPS)}")
        if dual_stack and plugin != "cns-cni":
            raise ValueError(f"dual_stack: with the plugin cns-cni only, not {plugin!r}")
        self.workdir = workdir
        self.this_node = workdir / "this-node"
        self.image = image
        self.plugin = plugin
        self.flat_network = flat_network
        self.dual_stack = dual_stack
        self.daemon_settings = dict(daemon_settings or {})
        self.subnet = str(LAN.network)
        # ClusterSubnet name -> range, the primary first.
        self.subnets = {SUBNET_NAME: LAN.network}
        if dual_stack:
            self.subnets[SUBNET6_NAME] = POD_SUBNET6
        self.before = host_state()
        self.lan = Lan(dual_stack=dual_stack)
        self._kube: KubeCluster | None = None
        conflist = ptp_conflist(self.this_node) if plugin == "ptp-cns-ipam" else None
        self.nodes = [ClusterNode(self, i, conflist=conflist) for i in range(1, nodes + 1)]
        self._scheduler = ManagedProcess("kube-scheduler", [], workdir / "kube-scheduler.log")
        self._controller_manager = ManagedProcess(
            "kube-controller-manager", [], workdir / "kube-controller-manager.log"
        )
        self.timings: dict[str, float] = {}
        self._created_pod_cgroup = not cgroup_dirs(POD_CGROUP_PARENT)
        self._stopped = False

    @property  # type: ignore[override]
    def kube(self) -> KubeCluster:
        assert self._kube is not None, "the control plane has not started"
        return self._kube

    @property
    def feature_gates(self) -> dict[str, bool]:
        """Of every Kubernetes component (the KubeletConfiguration's and kube-proxy's form)."""
        return {DUAL_STACK_GATE: True} if self.dual_stack else {}

    @property
    def gateways(self) -> list[str]:
        """The LAN's gateway addresses (the bridge's), which no pod is granted."""
        return [str(LAN.ip), *([str(LAN6.ip)] if self.dual_stack else [])]

    @property  # type: ignore[override]
    def bin_dir(self) -> Path:
        return self.kube.bin_dir

    @property  # type: ignore[override]
    def kubeconfig(self) -> Path:
        return self.kube.kubeconfig

    @classmethod
    def start(cls, workdir: Path, **options: Any) -> Self:
        workdir.mkdir(parents=True, exist_ok=True)
        cluster = cls(workdir, **options)
        try:
            cluster._start()
        except BaseException:
            # What each part said, before `stop` removes the directory that holds their logs.
            print(f"cluster start failed:\n{cluster.log_tail(40)}", flush=True)
            cluster.stop()
            raise
        return cluster

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def _step(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        print(f"cluster: {name} ...", flush=True)
        yield
        self.timings[name] = time.monotonic() - began

    def _start(self) -> None:
        self.this_node.mkdir(exist_ok=True)
        with self._step("bridge and control plane"):
            self.lan.up()
            self._kube = KubeCluster.start(
                address=str(LAN.ip),
                service_account_tokens=True,
                workdir_parent=str(self.workdir),
                dual_stack=self.dual_stack,
            )
            self._scheduler.argv, self._controller_manager.argv = control_plane_argv(self.kube)
            if self.dual_stack:  # its EndpointSlices of both families
                self._controller_manager.argv.append(f"--feature-gates={DUAL_STACK_GATE}=true")
            self._scheduler.spawn(self.workdir)
            self._controller_manager.spawn(self.workdir)
        with self._step("node namespaces"):
            for node in self.nodes:
                node.start_namespaces()
        with self._step("containerd and images on every node"):
            archives = [build_pause_archive(self.workdir / "images"), self.image[1]]
            with ThreadPoolExecutor(len(self.nodes)) as pool:
                for started in [pool.submit(n.start_runtime, archives) for n in self.nodes]:
                    started.result()
        with self._step("kubelets and kube-proxies registered"):
            for node in self.nodes:
                node.start_agents()
            for node in self.nodes:
                self.wait(lambda n=node: self.kube.exists("v1", "Node", n.name),
                          f"node {node.name} registered", timeout=90)  # fmt: skip
        with self._step("kubectl apply -k of cns, the pod subnet"):
            overlay = self.install_overlay(self.workdir / "overlay")
            self.kubectl("apply", "-k", str(overlay))
            self.wait(self._apply_subnet, "the pod subnet applied", timeout=60)
        with self._step("the cns DaemonSet Ready on every node, every node Ready"):
            self.wait(lambda: self.ready_daemon_pods() == len(self.nodes),
                      "a Ready cns pod on every node", timeout=300)  # fmt: skip
            self.wait(lambda: self.ready_nodes() == len(self.nodes), "every node Ready", 120)

    def install_overlay(self, directory: Path) -> Path:
        """One kustomization over config/ for every node (see the module)."""
        base = yaml.safe_load_all(self.kubectl("kustomize", str(REPO / "config")))
        docs = {(d["kind"], d["metadata"]["name"]): d for d in base if d}
        paths = {old: str(self.this_node / new) for old, new in DAEMONSET_PATHS.items()}
        config_map = docs["ConfigMap", "cns-config"]
        config = yaml.safe_load(config_map["data"]["cns.yaml"])
        (op,) = rewrite_paths(config["stateDir"], "", paths)
        config["stateDir"] = op["value"]
        config.update(self.daemon_settings)
        if self.flat_network:
            config["flatNetwork"] = {"enabled": True}
            if self.plugin == "ptp-cns-ipam":
                # ptp's gateway on every pod's veth is an address of the pod subnet too: the
                # uplink cannot be found as the one link holding one, it is named.
                config["flatNetwork"]["uplink"] = UPLINK
        daemonset = docs["DaemonSet", "cns"]
        pod_spec = daemonset["spec"]["template"]["spec"]
        ops = list(rewrite_paths(pod_spec, "/spec/template/spec", paths))
        if self.plugin == "ptp-cns-ipam":
            ops += self._without_conflist(pod_spec)
        patches: Mapping[tuple[str, str], list[dict[str, Any]]] = {
            ("ConfigMap", "cns-config"): [
                {"op": "replace", "path": "/data/cns.yaml", "value": yaml.safe_dump(config)}
            ],
            ("DaemonSet", "cns"): ops,
        }
        return write_overlay(directory, docs, patches, self.image[0])

    @staticmethod
    def _without_conflist(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
        """JSON patches dropping `--conf-dir DIR` from every install-cni command line: the
        plugins only, the node's operator writes the network's conflist. (After the paths'
        patches: they name the arguments by index.)"""
        ops = []
        commands = [
            (f"/spec/template/spec/initContainers/{i}/command", c["command"])
            for i, c in enumerate(pod_spec.get("initContainers") or [])
        ]
        for i, container in enumerate(pod_spec["containers"]):
            hook = ((container.get("lifecycle") or {}).get("postStart") or {}).get("exec")
            if hook:
                path = f"/spec/template/spec/containers/{i}/lifecycle/postStart/exec/command"
                commands.append((path, hook["command"]))
        for path, command in commands:
            if "install-cni" in command and "--conf-dir" in command:
                at = command.index("--conf-dir")  # the flag, then its value in its place
                ops += [{"op": "remove", "path": f"{path}/{at}"}] * 2
        return ops

    def _apply_subnet(self) -> bool:
        """The LAN as the ClusterSubnet (and its IPv6 range as a second one, chosen for every
        pod of the namespace `default`), once its CRD serves (an apply right after can 404)."""
        gateways = [PTP_GATEWAY if self.plugin == "ptp-cns-ipam" else LAN.ip, LAN6.ip]
        try:
            for (name, subnet), gateway in zip(self.subnets.items(), gateways, strict=False):
                self.kube.apply(
                    {"apiVersion": CS_API, "kind": "ClusterSubnet", "metadata": {"name": name},
                     "spec": {"subnet": str(subnet), "gateway": str(gateway)}}
                )  # fmt: skip
        except Exception:
            return False
        if self.dual_stack:
            annotation = {SUBNETS_ANNOTATION: ",".join(self.subnets)}
            self.kube.apply(
                {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": "default", "annotations": annotation}}
            )  # fmt: skip
        return True

    def ready_daemon_pods(self) -> int:
        return sum(1 for pod in self.pods(CNS, "kube-system") if is_ready(pod))

    def ready_nodes(self) -> int:
        items = self.kube.request("GET", "/api/v1/nodes").json.get("items") or []
        return sum(1 for node in items if is_ready(node))

    def node(self, name: str) -> ClusterNode:
        (found,) = [node for node in self.nodes if node.name == name]
        return found

    def finish_off(self, pod: dict[str, Any]) -> bool:
        name = pod["spec"].get("nodeName")
        node = next((node for node in self.nodes if node.name == name), None)
        if node is None or node.containerd is None:
            return False
        return finish_off_sandboxes(node.containerd, pod)

    def log_tail(self, lines: int = 20) -> str:
        parts = [node.log_tail(lines) for node in self.nodes]
        for process in (self._scheduler, self._controller_manager):
            parts.append(f"--- {process.name}\n{tail(process.log, lines)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Workloads first (their CNI DEL through each node's daemon), then every node, the
        control plane and the bridge; then the host's sysctls as they were."""
        if self._stopped:
            return
        self._stopped = True
        if self._kube is not None:
            with contextlib.suppress(Exception):
                self._kube.request("DELETE", "/apis/apps/v1/namespaces/default/deployments")
        stops = [threading.Thread(target=node.stop) for node in self.nodes]
        for thread in stops:
            thread.start()
        for thread in stops:
            thread.join()
        for process in (self._controller_manager, self._scheduler):
            process.stop(5)
        if self._kube is not None:
            self._kube.stop()
        self.lan.down()
        if self._created_pod_cgroup:
            remove_cgroup(POD_CGROUP_PARENT)
        for name, value in self.before.sysctls:
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/{name}").write_text(value)
        for node in self.nodes:
            shutil.rmtree(node.directory, ignore_errors=True)


def is_ready(item: dict[str, Any]) -> bool:
    """A Node's or Pod's `Ready` condition is True."""
    conditions = (item.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def spread(name: str, replicas: int) -> dict[str, Any]:
    """`deployment` with its pods spread evenly over the nodes."""
    body = deployment(name, replicas)
    body["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": name}},
        }
    ]
    return body


def pod_ips(pod: dict[str, Any]) -> list[str]:
    """Every address of `pod` (`status.podIPs`: one of each family on a dual-stack cluster)."""
    return [entry["ip"] for entry in pod["status"].get("podIPs") or []]


def pods_by_node(pods: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """node -> pod name -> pod IP."""
    found: dict[str, dict[str, str]] = {}
    for pod in pods:
        found.setdefault(pod["spec"]["nodeName"], {})[pod["metadata"]["name"]] = pod["status"][
            "podIP"
        ]
    return found


# Pings per target before it counts as unreachable, 2 s each: a first ping may wait up to
# `proxy_delay` for a proxy answer, and a neighbour entry left stale by a node's restart or an
# address's move is probed for up to 8 s (5 s DELAY, three 1 s probes) before it is resolved anew.
PING_TRIES = 6


def unreachable(
    node: ClusterNode, pod: str | None, targets: list[str], *, tries: int = PING_TRIES
) -> list[str]:
    """The `targets` that `pod` on `node` (None: the node itself) cannot ping within `tries`
    tries, all targets at once; a target that answers stops at once. Two tries (4 s) is "at
    once": less than a stale neighbour entry takes to be resolved anew."""
    script = (
        f"for ip in {' '.join(targets)}; do (n=0; until ping -c1 -W2 $ip >/dev/null; do "
        f"n=$((n+1)); if [ $n -ge {tries} ]; then echo $ip; break; fi; done) & done; "
        "wait; echo done"
    )
    if pod is None:
        said = node.host.run("sh", "-c", script).stdout.split()
    else:
        said = node.in_pod(pod, "sh", "-c", script).stdout.split()
    assert said and said[-1] == "done", said
    return said[:-1]


def neighbour_report(cluster: MultiNodeCluster, addresses: list[str]) -> str:
    """What each node's uplink knows of `addresses` (its MAC, the neighbour and proxy entries,
    the route it takes): why a ping across nodes went unanswered."""
    parts = []
    for node in cluster.nodes:
        if not node.up:
            parts.append(f"--- {node.name}: down")
            continue
        lines = [node.host.run("ip", "-br", "link", "show", UPLINK, check=False).stdout.strip()]
        for address in addresses:
            asked = (["ip", "neigh", "show", address], ["ip", "neigh", "show", "proxy", address],
                     ["ip", "route", "get", address])  # fmt: skip
            for argv in asked:
                said = node.host.run(*argv, check=False)
                lines.append(f"{' '.join(argv)}: {(said.stdout + said.stderr).strip()}")
        parts.append(f"--- {node.name}\n" + "\n".join(lines))
    return "\n".join(parts)
