"""A whole Kubernetes node on loopback: kube-scheduler, kube-controller-manager, containerd and a
kubelet next to a `KubeCluster` (etcd + kube-apiserver), with `cns controller` and the `cns`
daemon in Kubernetes mode and `cns-cni` (installed by `cns install-cni`) as the node's CNI.

    with KubeNode.start(kube, workdir, subnet_cidr="10.250.0.0/24") as node:
        node.kubectl("apply", "-f", "deployment.yaml")
        node.wait_pods_running("app=web", 30)

The binaries are those of `scripts/build-kubernetes.sh` with the extra targets
(`cmd/kubelet cmd/kube-scheduler cmd/kube-controller-manager cmd/kubectl`). Everything binds to
127.0.0.1 on free ports. `stop()` puts the host back as it was: the kubelet's sysctls, its bind
mount and `/var/log/pods`, `/var/log/containers` (when it created them), and every link, network
namespace, mount, process and cgroup of the node; `host_state()` is what a test compares before
and after. `make cluster-up`/`cluster-down` (`cluster_cli`) runs the same node for a person.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import yaml

from tests.harness import REPO
from tests.harness.containerd import Containerd
from tests.harness.controller import controller_command
from tests.harness.daemon import Daemon
from tests.harness.host import (
    cgroup_dirs,
    mounts_under,
    named_netns,
    remove_cgroup,
    run,
    unmount_under,
)
from tests.harness.kube_api import CS_API, DAEMON_USER, KUBE_SYSTEM, MERGE_PATCH, NNC_API
from tests.harness.kube_cluster import KubeCluster
from tests.harness.podman import PAUSE_IMAGE, build_pause_archive
from tests.harness.ports import free_port
from tests.harness.process import ManagedProcess, private_tmp

NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-controller-manager", "kubectl")
NODE_NAME = "node1"
WORKLOAD_IMAGE = "localhost/cns-test/busybox:1"
LEAK_GRACE_SECONDS = 5
# What the 1.20 kubelet changes at start with protectKernelDefaults: false.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
# What a node's operator sets for its IPv6 pods (docs/networking.md): each multi-node node sets
# them in its own network namespace, so the host's never change (compared, never restored).
# (Not net.ipv4.ip_forward: the one-node cluster's daemon runs in the host's namespace and sets
# it there when it is 0, as config/daemonset.yaml says.)
FORWARDING_SYSCTLS = (
    "net/ipv6/conf/all/forwarding",
    "net/ipv6/conf/default/forwarding",
    "net/ipv6/conf/all/proxy_ndp",
    "net/ipv6/conf/default/proxy_ndp",
)
KUBELET_LOG_DIRS = (Path("/var/log/pods"), Path("/var/log/containers"))
# With cgroupsPerQOS: false the kubelet names no cgroup parent: containerd uses its own default.
POD_CGROUP_PARENT = "/k8s.io"
# The kubelet's API rate limit (kubeAPIQPS, kubeAPIBurst): upstream's defaults since 1.27. Under
# 1.20's 5 and 10 its status manager, one request after the other, removed the 30 pods of a
# scaled-down Deployment from the API at 1.7 a second (16 s); at 50 and 100, 22 of them in the
# same second. `bench/performance/pod_startup.py` keeps 1.20's, as its published figures had them.
KUBELET_API_QPS = (50, 100)
KUBELET_API_QPS_1_20 = (5, 10)


def missing_node_binaries(bin_dir: Path) -> list[str]:
    return [name for name in NODE_BINARIES if not os.access(bin_dir / name, os.X_OK)]


def control_plane_argv(kube: KubeCluster) -> tuple[list[str], list[str]]:
    """The command lines of kube-scheduler and kube-controller-manager for `kube`."""

    def common() -> list[str]:
        return [
            f"--kubeconfig={kube.kubeconfig}",
            "--leader-elect=false",
            "--port=0",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--authentication-kubeconfig={kube.kubeconfig}",
            f"--authorization-kubeconfig={kube.kubeconfig}",
        ]

    scheduler = [str(kube.bin_dir / "kube-scheduler"), *common()]
    controller_manager = [
        str(kube.bin_dir / "kube-controller-manager"),
        *common(),
        f"--service-account-private-key-file={kube.workdir / 'sa.key'}",
        f"--root-ca-file={kube.ca_file}",
        # Node IPAM is cns's job; no cloud, no service load balancers.
        "--allocate-node-cidrs=false",
        "--controllers=*,-nodeipam,-service,-route,-cloud-node-lifecycle",
    ]
    return scheduler, controller_manager


def kubelet_config(
    *,
    address: str,
    ports: tuple[int, int],
    max_pods: int,
    api_qps: tuple[int, int],
    volume_plugin_dir: Path,
) -> dict[str, Any]:
    """A test node's KubeletConfiguration: serving on `address` at `ports` (API, healthz),
    changing nothing on the host it can leave alone (no QoS cgroups, no iptables chains)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": address,
        "port": ports[0],
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports[1],
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "protectKernelDefaults": False,
        "failSwapOn": False,
        "oomScoreAdj": 0,
        "resolvConf": "/etc/resolv.conf",
        "clusterDNS": [],
        "makeIPTablesUtilChains": False,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": max_pods,
        "kubeAPIQPS": api_qps[0],
        "kubeAPIBurst": api_qps[1],
        "featureGates": {"LocalStorageCapacityIsolation": False},
        "volumePluginDir": str(volume_plugin_dir),
        "serializeImagePulls": False,
    }


def publish_node_address(kube: KubeCluster, node: str) -> None:
    """Give the Node the address its kubelet serves on, 127.0.0.1, as its InternalIP.

    kubelet 1.20 refuses a loopback `--node-ip` ("nodeIP can't be loopback address", in its log
    every status update) and then publishes no address at all: `kubectl get nodes -o wide` shows
    INTERNAL-IP <none> and the API server has nowhere to dial for `kubectl exec` and `logs`. Since
    that refusal happens before it touches the addresses, its status updates leave this one in
    place. InternalIP only: given a Hostname address the API server would dial the node's name,
    which does not resolve.
    """
    address = {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}
    path = f"/api/v1/nodes/{node}/status"
    kube.request("PATCH", path, {"status": address}, MERGE_PATCH).raise_for_status()


@dataclass(frozen=True)
class HostState:
    """What a node could leave behind on the host; equal before start and after stop."""

    sysctls: tuple[tuple[str, str], ...]
    log_dirs: tuple[str, ...]
    links: tuple[str, ...]
    netns: tuple[str, ...]
    iptables_chains: tuple[str, ...]
    ip6tables_chains: tuple[str, ...]
    forwarding: tuple[tuple[str, str], ...]
    cgroups: tuple[str, ...]


def host_state() -> HostState:
    links = run(["ip", "-o", "link", "show"]).stdout.splitlines()
    return HostState(
        sysctls=_sysctls(KUBELET_SYSCTLS),
        log_dirs=tuple(str(path) for path in KUBELET_LOG_DIRS if path.exists()),
        links=tuple(sorted(line.split(":")[1].strip().split("@")[0] for line in links)),
        netns=tuple(sorted(named_netns())),
        iptables_chains=_chains("iptables-save"),
        ip6tables_chains=_chains("ip6tables-save"),
        forwarding=_sysctls(FORWARDING_SYSCTLS),
        cgroups=tuple(
            sorted(str(path) for path in Path("/sys/fs/cgroup/memory").iterdir() if path.is_dir())
        ),
    )


def _sysctls(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple((name, Path(f"/proc/sys/{name}").read_text().strip()) for name in names)


def _chains(save: str) -> tuple[str, ...]:
    """The chains of every table that `save` (iptables-save, ip6tables-save) lists."""
    lines = run([save]).stdout.splitlines()
    return tuple(sorted(line.split()[0] for line in lines if line.startswith(":")))


def cns_conflist(workdir: Path, socket: Path, release_queue: Path) -> tuple[dict[str, Any], Path]:
    """`cns install-cni` into `workdir`: the conflist it writes and its bin dir."""
    bin_dir, conf_dir = workdir / "cns-cni-bin", workdir / "cns-cni-conf"
    subprocess.run(
        [
            sys.executable, "-m", "cns.commands.cli", "install-cni",
            "--bin-dir", str(bin_dir), "--conf-dir", str(conf_dir),
            "--socket", str(socket), "--release-queue-dir", str(release_queue),
        ],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    conflist: dict[str, Any] = json.loads((conf_dir / "10-cns.conflist").read_text())
    return conflist, bin_dir


def ptp_conflist(subnet: str, data_dir: Path, **range_keys: str) -> dict[str, Any]:
    """The reference plugins doing the same job as cns-cni: a veth per pod, /32 host routes,
    then `portmap`, chained after the main plugin as in the conflist `cns install-cni` writes.
    `range_keys`: host-local's `rangeStart`, `rangeEnd`, `gateway` for the subnet."""
    return {
        "cniVersion": "0.4.0",
        "name": "ptp-host-local",
        "plugins": [
            {
                "type": "ptp",
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet, **range_keys}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(data_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
        ],
    }


class NodeError(RuntimeError):
    """The node could not start or stop; the message has the relevant log tails."""


class PodQueries:
    """kubectl and the pods of a cluster, for a test: `kube`, `bin_dir` and `kubeconfig` are
    the cluster's, `log_tail()` what a failure shows."""

    kube: KubeCluster
    bin_dir: Path
    kubeconfig: Path

    def log_tail(self, lines: int = 20) -> str:
        raise NotImplementedError

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise NodeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def pods(self, selector: str = "", namespace: str = "default") -> list[dict[str, Any]]:
        query = f"?labelSelector={selector}" if selector else ""
        body = self.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods{query}").json
        return list(body.get("items") or [])

    def wait_pods(
        self, selector: str, predicate: Callable[[list[dict[str, Any]]], bool], what: str,
        timeout: float = 180, namespace: str = "default",
    ) -> list[dict[str, Any]]:  # fmt: skip
        found: list[dict[str, Any]] = []

        def check() -> bool:
            nonlocal found
            found = self.pods(selector, namespace)
            return predicate(found)

        try:
            self.kube.wait_for(check, timeout=timeout, what=what, interval=0.5)
        except Exception as exc:
            phases = sorted((p["metadata"]["name"], p["status"].get("phase")) for p in found)
            raise NodeError(f"{exc}; pods: {phases}\n{self.log_tail()}") from exc
        return found

    def wait_running(
        self, selector: str, count: int, timeout: float = 180, namespace: str = "default"
    ) -> list[dict[str, Any]]:
        def all_running(pods: list[dict[str, Any]]) -> bool:
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            return len(live) == count and all(
                p["status"].get("phase") == "Running" and p["status"].get("podIP") for p in live
            )

        pods = self.wait_pods(
            selector, all_running, f"{count} pods {selector} Running", timeout, namespace
        )
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def wait_gone(self, selector: str, timeout: float = 180, namespace: str = "default") -> None:
        """Until no pod of `selector` is left. A deleted pod that is done on its node (no
        container running, every sandbox stopped with its network namespace closed, so its
        CNI DEL done: what the tests wait for) is finished off as the kubelet would, its
        sandboxes removed from the runtime (`finish_off`), then its object: kubelet 1.20
        removes the object only once the pod's containers are gone, and when its clean-up at
        the container's death loses a race with its own cache, that waits for its container
        GC, once a minute (seen: 3 of 20 pods removed 67 s after their sandboxes had stopped,
        the others within 10 s)."""

        def gone(pods: list[dict[str, Any]]) -> bool:
            for pod in pods:
                if pod["metadata"].get("deletionTimestamp") and self.finish_off(pod):
                    meta = pod["metadata"]
                    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
                    self.kube.request("DELETE", path, {"gracePeriodSeconds": 0})
            return not pods

        self.wait_pods(selector, gone, f"pods {selector} gone", timeout, namespace)

    def finish_off(self, pod: dict[str, Any]) -> bool:
        """Remove the deleted `pod`'s sandboxes from its node's runtime if it is done there
        (`finish_off_sandboxes`); whether it was (False when the node cannot say)."""
        raise NotImplementedError

    def wait(self, condition: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        return self.kube.wait_for(condition, timeout=timeout, what=what, interval=0.2)


def sandbox_netns(containerd: Containerd, pod: str, locate: Callable[[str], Path] = Path) -> str:
    """The network namespace of `pod`'s ready sandbox in `containerd`, over CRI (`locate`: see
    `CriClient.netns`)."""
    with containerd.client() as cri:
        found = [s for s in cri.list_pod_sandboxes() if s.metadata.name == pod]
        for sandbox in found:
            if sandbox.state == 0:  # SANDBOX_READY
                netns = cri.netns(sandbox.id, locate)
                if netns:
                    return netns
    states = [(s.id[:12], s.state) for s in found]
    raise NodeError(
        f"no ready sandbox with a network namespace for pod {pod} (its sandboxes, state 0 "
        f"ready: {states})\n{containerd.log(20)}"
    )


def finish_off_sandboxes(containerd: Containerd, pod: dict[str, Any]) -> bool:
    """If the deleted `pod` is done on its node, remove its sandboxes from `containerd`, as the
    kubelet's garbage collection would, and say so. Done: the kubelet reports none of its
    containers running, and containerd holds sandboxes of it, all stopped with their network
    namespace closed, which containerd marks only once the CNI DEL succeeded (StopPodSandbox);
    removing such a sandbox calls no plugin. Left to the kubelet after a test (as the API
    object was), their removal would call the CNI DEL again, and fail once cns is uninstalled.
    A pod with no sandbox (none yet, or already removed) is not done: its ADD may be in flight."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses or any("running" in (c.get("state") or {}) for c in statuses):
        return False
    uid = pod["metadata"]["uid"]
    try:
        with containerd.client(timeout=5) as cri:
            sandboxes = [s for s in cri.list_pod_sandboxes() if s.metadata.uid == uid]
            done = bool(sandboxes) and all(
                s.state != 0 and cri.info(s.id).get("netNamespaceClosed") is True  # 0: READY
                for s in sandboxes
            )
            if done:
                for sandbox in sandboxes:
                    cri.remove(sandbox.id)
            return done
    except Exception:  # the node stopped meanwhile: it cannot say
        return False


class KubeNode(PodQueries):
    """One node: control-plane helpers, containerd + kubelet, and cns (controller + daemon)."""

    def __init__(
        self,
        kube: KubeCluster,
        workdir: Path,
        *,
        subnet_cidr: str,
        scaler: dict[str, int] | None = None,
        exhaustion: tuple[int, int] = (90, 50),
        max_pods: int = 110,
        kubelet_api_qps: tuple[int, int] = KUBELET_API_QPS,
    ) -> None:
        self.kube = kube
        self.workdir = workdir
        self.bin_dir = kube.bin_dir
        self.name = NODE_NAME
        self.subnet_name = "pods"
        self.subnet_cidr = subnet_cidr
        self.scaler = scaler
        self.exhaustion = exhaustion
        self.max_pods = max_pods
        self.kubelet_api_qps = kubelet_api_qps
        self.before = host_state()
        self.kubeconfig = kube.kubeconfig
        self.kubelet_root = workdir / "kubelet"
        self._scheduler = ManagedProcess("kube-scheduler", [], workdir / "kube-scheduler.log")
        self._controller_manager = ManagedProcess(
            "kube-controller-manager", [], workdir / "kube-controller-manager.log"
        )
        self._kubelet = ManagedProcess("kubelet", [], workdir / "kubelet.log")
        self._cns_controller = ManagedProcess(
            "cns-controller", [], workdir / "cns-controller.log", env=private_tmp(workdir)
        )
        self.daemon: Daemon | None = None
        self.containerd: Containerd | None = None
        self._created_log_dirs = [path for path in KUBELET_LOG_DIRS if not path.exists()]
        self._created_pod_cgroup = not cgroup_dirs(POD_CGROUP_PARENT)
        self._stopped = False

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def start(cls, kube: KubeCluster, workdir: Path, **options: Any) -> Self:
        missing = missing_node_binaries(kube.bin_dir)
        if missing:
            raise NodeError(
                f"{', '.join(missing)} missing in {kube.bin_dir}: run "
                "`bash scripts/build-kubernetes.sh` with the node targets (scripts/test.sh does)"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        node = cls(kube, workdir, **options)
        try:
            node._start()
        except BaseException:
            node.stop()
            raise
        return node

    def __enter__(self) -> KubeNode:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start(self) -> None:
        self.kube.apply(REPO / "config" / "crd")
        self.kube.apply(REPO / "config" / "rbac.yaml")
        subnet_spec: dict[str, Any] = {
            "subnet": self.subnet_cidr,
            "exhaustion": {"upperPercent": self.exhaustion[0], "lowerPercent": self.exhaustion[1]},
        }
        if self.scaler:
            subnet_spec["scaler"] = self.scaler
        self.kube.apply(
            {
                "apiVersion": CS_API,
                "kind": "ClusterSubnet",
                "metadata": {"name": self.subnet_name},
                "spec": subnet_spec,
            }
        )
        self._start_control_plane()
        self.start_cns_controller()
        (self.workdir / "cns").mkdir(exist_ok=True)
        # The daemon's paths (checked below): its socket, and the queue it drains at start.
        socket, queue = (
            self.workdir / "cns" / "cns.sock",
            self.workdir / "cns" / "state" / "release-queue",
        )
        conflist, plugin_dir = cns_conflist(self.workdir, socket, queue)
        self.containerd = Containerd(
            self.workdir / "containerd",
            conflist=conflist,
            plugin_dirs=[plugin_dir],
            pause_archive=build_pause_archive(self.workdir / "images"),
            log_level="debug",  # its "begin cni setup" / "cni result" lines time each CNI ADD
        )
        self.daemon = Daemon(
            self.workdir / "cns",
            {
                "mode": "kubernetes",
                "nodeName": self.name,
                # The tests check that a burst of pods becomes one request: on a loaded 2-core
                # machine the gaps between bindings outgrow the default 0.1 s quiet time.
                "requestCoalescing": {"quietSeconds": 1, "maxDelaySeconds": 10},
                # Leaks are reclaimed within seconds, so every test on the node also checks
                # that no live pod's IP is ever taken (the default grace is 300 s).
                # The interface reaper would take some of those IPs first (netns and veth
                # gone), by another path: it runs long after the CRI check here.
                "attachmentCheckSeconds": 120,
                "leakReclaim": {
                    "criSocket": str(self.containerd.socket),
                    "checkSeconds": 1,
                    "graceSeconds": LEAK_GRACE_SECONDS,
                },
                "kubernetes": {
                    "kubeconfig": str(self.kube.kubeconfig_for(DAEMON_USER)),
                    "subnetName": self.subnet_name,
                    "watchTimeoutSeconds": 30,
                },
            },
        )
        assert (socket, queue) == (self.daemon.socket, self.daemon.state_dir / "release-queue")
        # Before its Node exists the daemon waits without serving: it is started once the
        # kubelet has registered the node (`start_daemon`), as a DaemonSet pod would be.
        self.start_runtime_and_kubelet()
        self.start_daemon()
        self.wait_node_ready()

    def start_runtime_and_kubelet(self, *image_archives: Path) -> None:
        """containerd (with the workload image and `image_archives` imported), then the kubelet;
        returns once the kubelet has registered the node."""
        assert self.containerd is not None
        self.containerd.start()
        self.containerd.ctr("-n", "k8s.io", "images", "tag", PAUSE_IMAGE, WORKLOAD_IMAGE)
        for archive in image_archives:
            self.containerd.ctr("-n", "k8s.io", "images", "import", archive, check=True)
        self._start_kubelet()
        self.kube.wait_for(
            lambda: self.kube.exists("v1", "Node", self.name),
            timeout=60,
            what=f"node {self.name} registered",
            interval=0.2,
        )

    def _start_control_plane(self) -> None:
        self._scheduler.argv, self._controller_manager.argv = control_plane_argv(self.kube)
        self._scheduler.spawn(self.workdir)
        self._controller_manager.spawn(self.workdir)

    def start_cns_controller(self, subnet: str | None = None) -> None:
        """`cns controller` for the node's subnet, or for `subnet` ("": every ClusterSubnet,
        the further subnets a test adds too); one already running is stopped first."""
        self._cns_controller.stop(5)
        self._cns_controller.argv = controller_command(
            self.kube,
            subnet=self.subnet_name if subnet is None else subnet,
            identity="controller-0",
            lease_seconds=5,
        )
        self._cns_controller.spawn(REPO)

    def start_daemon(self) -> Daemon:
        assert self.daemon is not None
        self.daemon.start(wait=True)
        return self.daemon

    def _start_kubelet(self) -> None:
        assert self.containerd is not None
        self.kubelet_root.mkdir(exist_ok=True)
        config = kubelet_config(
            address="127.0.0.1",
            ports=(free_port(), free_port()),
            max_pods=self.max_pods,
            api_qps=self.kubelet_api_qps,
            volume_plugin_dir=self.workdir / "volume-plugins",
        )
        config_path = self.workdir / "kubelet.yaml"
        config_path.write_text(yaml.safe_dump(config))
        endpoint = f"unix://{self.containerd.socket}"
        self._kubelet.argv = [
            str(self.bin_dir / "kubelet"),
            f"--config={config_path}",
            f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={self.kubelet_root}",
            # A 1.20 kubelet reads Localhost seccomp profiles from /var/lib/kubelet/seccomp
            # whatever its root dir; later ones from <root-dir>/seccomp, as here.
            f"--seccomp-profile-root={self.kubelet_root / 'seccomp'}",
            f"--cert-dir={self.workdir / 'kubelet-certs'}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint={endpoint}",
            f"--image-service-endpoint={endpoint}",
            "--runtime-request-timeout=2m",
            f"--hostname-override={self.name}",
            "--node-ip=127.0.0.1",
            "--v=2",
        ]
        self._kubelet.spawn(self.workdir)

    def wait_node_ready(self, timeout: float = 90) -> None:
        def ready() -> bool:
            node = self.kube.get("v1", "Node", self.name)
            conditions = (node.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        try:
            self.kube.wait_for(ready, timeout=timeout, what=f"node {self.name} Ready", interval=0.5)
        except Exception as exc:
            raise NodeError(f"{exc}\n{self.log_tail()}") from exc

    def stop(self) -> None:
        """Pods first (their CNI DEL through the daemon), then every process; then the host."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self.kube.request("DELETE", "/apis/apps/v1/namespaces/default/deployments", timeout=10)
        self._kubelet.stop(10)
        if self.containerd is not None:
            if self.daemon is not None and self.daemon.proc is None:
                with contextlib.suppress(Exception):
                    self.daemon.start(wait=True)
            self.containerd.stop()  # removes every sandbox: CNI DEL releases the IPs
        if self.daemon is not None and self.daemon.proc is not None:
            with contextlib.suppress(Exception):
                self.daemon.stop()
        for process in (self._cns_controller, self._controller_manager, self._scheduler):
            process.stop(5)
        self._restore_host()

    def _restore_host(self) -> None:
        for name, value in self.before.sysctls:
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/{name}").write_text(value)
        unmount_under(self.workdir)
        for path in self._created_log_dirs:
            shutil.rmtree(path, ignore_errors=True)
        if self._created_pod_cgroup:
            remove_cgroup(POD_CGROUP_PARENT)

    # ------------------------------------------------------------------ helpers

    def log_tail(self, lines: int = 20) -> str:
        parts = []
        for process in (self._kubelet, self._scheduler, self._controller_manager):
            with contextlib.suppress(OSError):
                text = process.log.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {process.name}\n" + "\n".join(text))
        if self.containerd is not None:
            parts.append("--- containerd\n" + self.containerd.log(lines))
        return "\n".join(parts)

    def finish_off(self, pod: dict[str, Any]) -> bool:
        return self.containerd is not None and finish_off_sandboxes(self.containerd, pod)

    def pod_netns(self, pod: str) -> str:
        """The network namespace of `pod`'s ready sandbox, from containerd over CRI.

        (`kubectl exec` cannot be used: with a loopback node IP the node has no address the
        apiserver could dial.)
        """
        assert self.containerd is not None
        return sandbox_netns(self.containerd, pod)

    def nnc(self) -> dict[str, Any]:
        return self.kube.get(NNC_API, "NodeNetworkConfig", self.name, KUBE_SYSTEM)

    def leftovers(self) -> list[str]:
        """Processes, mounts and cgroups of this node still present (empty after `stop`)."""
        found = []
        for process in (self._kubelet, self._scheduler, self._controller_manager):
            if process.running():
                found.append(f"process {process.name}")
        found += [f"mount {point}" for point in mounts_under(self.workdir)]
        if self._created_pod_cgroup:
            found += [f"cgroup {path}" for path in cgroup_dirs(POD_CGROUP_PARENT)]
        if self.containerd is not None:
            found += self.containerd.leftovers()
        return found


def deployment(
    name: str, replicas: int, image: str = WORKLOAD_IMAGE, namespace: str = "default"
) -> dict[str, Any]:
    """A busybox Deployment that never pulls: pods sleep, ping and answer `kubectl exec`."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "50%"}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": image,
                            "imagePullPolicy": "Never",
                            "command": ["/bin/sleep", "3600"],
                        }
                    ],
                },
            },
        },
    }
