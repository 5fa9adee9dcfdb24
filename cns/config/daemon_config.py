"""The daemon's configuration file: YAML, strictly validated, every error naming its key.

Keys follow the NodeNetworkConfig scaler conventions (camelCase); the strict reading (unknown keys
are errors, every error names its key) is cns/config/yamlreader.py's, shared with `cns simulate`.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cni_plugin.skel import MAX_SUBNET_NAME_LENGTH, identifier_problem
from cns.config.yamlreader import (
    IP_COOLDOWN_SECONDS,
    ConfigError,
    ExhaustionThresholds,
    Reader,
    read_exhaustion,
    read_ip_cooldown,
    read_reserved_ips,
    read_scaler,
    read_yaml,
)
from cns.core.pressure import PressureSettings
from cns.core.subnet import host_address_problem
from cns.core.types import Scaler
from cns.kube import NAMESPACE

__all__ = ["Config", "ConfigError", "load", "parse", "with_overrides"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StandaloneSubnet:
    """One subnet the embedded allocator hands out: a lane of the node (IPv4 or IPv6)."""

    name: str
    subnet: str
    gateway: str = ""  # "": the subnet's first host address
    primary_ip_count: int = 1
    # `reservedIPs`: addresses, CIDRs and first-last ranges never handed out (`Subnet`).
    reserved_ips: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StandaloneConfig:
    name: str = "standalone"  # the primary subnet's name, by which an ADD's `subnets` names it
    subnet: str = "10.240.0.0/22"
    gateway: str = ""
    primary_ip_count: int = 1
    reserved_ips: tuple[str, ...] = ()
    allocation_latency_ms: int = 200
    exhaustion: ExhaustionThresholds = field(default_factory=ExhaustionThresholds)
    # Further subnets (dual-stack: an IPv6 one), each its own lane and allocator state file.
    subnets: tuple[StandaloneSubnet, ...] = ()

    @property
    def primary(self) -> StandaloneSubnet:
        return StandaloneSubnet(
            name=self.name,
            subnet=self.subnet,
            gateway=self.gateway,
            primary_ip_count=self.primary_ip_count,
            reserved_ips=self.reserved_ips,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    kubeconfig: str = ""  # empty: in-cluster service account
    namespace: str = NAMESPACE
    subnet_name: str = ""  # the subnet to follow until the NNC names one ("": none)
    watch_timeout_seconds: int = 300
    events: bool = True  # Kubernetes Events on pods and the NNC (cns/node/notes.py)


CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
DEBUG_SOCKET_NAME = "debug.sock"


@dataclass(frozen=True, slots=True, kw_only=True)
class LeakReclaim:
    """Taking back IPs whose DEL never came (cns/node/leak_reclaim.py). On with a CRI socket: by
    default containerd's in Kubernetes mode, none in standalone mode (where containers may come
    from a runtime without CRI, whose sandboxes a CRI runtime would not list)."""

    cri_socket: str = ""
    check_seconds: float = 60.0
    grace_seconds: float = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Coalescing:
    """How long the daemon lets a burst of demand changes (pods bound, ADDs) gather into one
    request: until nothing changed for `quiet_seconds`, at most `max_delay_seconds` after the
    first. Longer windows mean fewer NNC updates on a slow API server, later requests."""

    quiet_seconds: float = 0.1
    max_delay_seconds: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatNetwork:
    """The flat-network mode (cns/node/flat_network.py): the node answers ARP and neighbour
    solicitations for its pods' addresses on `uplink` ("": the link holding an address on the
    pod subnet) and announces each new one."""

    enabled: bool = False
    uplink: str = ""


METRICS_PORT = 10092


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsListen:
    """The listener that serves only /metrics, for Prometheus on another host: the node's
    address (the DaemonSet passes `--metrics-address $(HOST_IP)`) and its own port, apart from
    the debug endpoint, which stays on loopback. `address` "": no such listener (/metrics is
    still on the debug endpoint)."""

    address: str = ""
    port: int = METRICS_PORT

    @property
    def host_port(self) -> tuple[str, int] | None:
        return (self.address, self.port) if self.address else None

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    node_name: str = field(default_factory=socket.gethostname)
    mode: str = "standalone"
    socket_path: Path = Path("/run/cns/cns.sock")
    state_dir: Path = Path("/var/lib/cns")
    debug_listen: str = "127.0.0.1:10090"
    # The debug endpoint on a root-only unix socket, which no other user can take; None:
    # debug.sock beside the CNI socket.
    debug_socket: Path | None = None
    log_level: str = "info"
    log_format: str = "auto"
    add_timeout_seconds: float = 10.0
    # An IP a pod gave back is not handed out again for this long (0: at once).
    ip_cooldown_seconds: float = IP_COOLDOWN_SECONDS
    reconcile_interval_seconds: float = 30.0
    attachment_check_seconds: float = 30.0
    coalescing: Coalescing = field(default_factory=Coalescing)
    leak_reclaim: LeakReclaim = field(default_factory=LeakReclaim)
    scaler: Scaler = field(default_factory=Scaler)
    standalone: StandaloneConfig = field(default_factory=StandaloneConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    flat_network: FlatNetwork = field(default_factory=FlatNetwork)
    metrics: MetricsListen = field(default_factory=MetricsListen)
    ip_pressure: PressureSettings = field(default_factory=PressureSettings)

    @property
    def debug_host_port(self) -> tuple[str, int]:
        host, _, port = self.debug_listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def debug_socket_path(self) -> Path:
        return self.debug_socket or self.socket_path.parent / DEBUG_SOCKET_NAME

    @property
    def release_queue_dir(self) -> Path:
        return self.state_dir / "release-queue"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.db"


def _coalescing(reader: Reader) -> Coalescing:
    default = Coalescing()
    quiet = reader.number("quietSeconds", default=default.quiet_seconds, low=0, high=60)
    longest = reader.number("maxDelaySeconds", default=default.max_delay_seconds, low=0, high=60)
    if longest < quiet:
        raise reader.fail("maxDelaySeconds", why=f"{longest:g} is shorter than quietSeconds")
    reader.done()
    return Coalescing(quiet_seconds=quiet, max_delay_seconds=longest)


def _leak_reclaim(reader: Reader, mode: str) -> LeakReclaim:
    default = LeakReclaim()
    if "criSocket" in reader.data:  # "" turns it off
        socket_path = reader.string("criSocket", default="").removeprefix("unix://")
    else:
        socket_path = CONTAINERD_SOCKET if mode == "kubernetes" else ""
    if socket_path and not socket_path.startswith("/"):
        raise reader.fail("criSocket", why=f"must be an absolute path, got {socket_path!r}")
    check = reader.number("checkSeconds", default=default.check_seconds, low=1, high=86400)
    grace = reader.number("graceSeconds", default=default.grace_seconds, low=1, high=86400)
    reader.done()
    return LeakReclaim(cri_socket=socket_path, check_seconds=check, grace_seconds=grace)


def _addressing(reader: Reader, *, name: str, default: str) -> StandaloneSubnet:
    """A subnet's `name` check, `subnet`, `gateway`, `primaryIPCount` and `reservedIPs`, IPv4
    or IPv6."""
    problem = identifier_problem(name, MAX_SUBNET_NAME_LENGTH)
    if problem is not None:
        raise reader.fail("name", why=f"{name!r} {problem}")
    subnet = reader.string("subnet", default=default)
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise reader.fail("subnet", why=f"not a network in CIDR form: {exc}") from exc
    gateway = reader.string("gateway", default="")
    if gateway:
        try:
            gateway_ip = ipaddress.ip_address(gateway)
        except ValueError as exc:
            raise reader.fail("gateway", why=f"not an IP address: {exc}") from exc
        problem = host_address_problem(gateway_ip, network)
        if problem is not None:
            raise reader.fail("gateway", why=problem)
    if network.num_addresses < 4:
        raise reader.fail("subnet", why=f"{subnet} is too small (fewer than 4 addresses)")
    primary = reader.integer("primaryIPCount", default=1, low=0, high=16)
    return StandaloneSubnet(
        name=name, subnet=str(network), gateway=gateway, primary_ip_count=primary,
        reserved_ips=read_reserved_ips(reader, network),
    )  # fmt: skip


def _further_subnets(reader: Reader, primary: StandaloneSubnet) -> tuple[StandaloneSubnet, ...]:
    """`standalone.subnets`: a list of {name, subnet, gateway, primaryIPCount, reservedIPs},
    every name and subnet distinct from the others' and the primary's (no address in two
    lanes)."""
    items = reader.data.pop("subnets", [])
    if not isinstance(items, list):
        raise reader.fail(
            "subnets",
            why="must be a list of {name, subnet, gateway, primaryIPCount, reservedIPs}",
        )
    subnets = [primary]
    for index, item in enumerate(items):
        entry = Reader(item, prefix=reader.name(f"subnets[{index}]"), source=reader.source)
        name = entry.data.pop("name", None)
        if not isinstance(name, str):
            raise entry.fail("name", why=f"must be a non-empty string, got {name!r}")
        subnet = _addressing(entry, name=name, default="")
        entry.done()
        for other in subnets:
            if other.name == name:
                raise entry.fail("name", why=f"{name!r} is the name of another subnet")
            if ipaddress.ip_network(other.subnet).overlaps(ipaddress.ip_network(subnet.subnet)):
                raise entry.fail(
                    "subnet", why=f"{subnet.subnet} overlaps {other.subnet} (subnet {other.name})"
                )
        subnets.append(subnet)
    return tuple(subnets[1:])


def _standalone(reader: Reader) -> StandaloneConfig:
    default = StandaloneConfig()
    name = reader.string("name", default=default.name)
    own = _addressing(reader, name=name, default=default.subnet)
    subnet, gateway, primary = own.subnet, own.gateway, own.primary_ip_count
    further = _further_subnets(reader, own)
    latency = reader.integer(
        "allocationLatencyMs", default=default.allocation_latency_ms, low=0, high=600_000
    )
    thresholds = read_exhaustion(reader.child("exhaustion"))
    reader.done()
    return StandaloneConfig(
        name=name,
        subnet=subnet,
        gateway=gateway,
        primary_ip_count=primary,
        reserved_ips=own.reserved_ips,
        allocation_latency_ms=latency,
        exhaustion=thresholds,
        subnets=further,
    )


IFNAMSIZ = 16  # with the terminating NUL


def _flat_network(reader: Reader) -> FlatNetwork:
    enabled = reader.boolean("enabled", default=False)
    uplink = reader.string("uplink", default="")
    if uplink and (len(uplink) >= IFNAMSIZ or "/" in uplink or uplink in (".", "..")):
        raise reader.fail("uplink", why=f"{uplink!r} is not an interface name")
    reader.done()
    return FlatNetwork(enabled=enabled, uplink=uplink)


def metrics_address_problem(address: str) -> str | None:
    """Why `address` cannot be the metrics listener's ("" turns it off); None when it can."""
    if not address:
        return None
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return f'{address!r} is not an IP address (the node\'s, 0.0.0.0, :: or "" for none)'
    return None


def _metrics(reader: Reader) -> MetricsListen:
    address = reader.string("address", default="")
    problem = metrics_address_problem(address)
    if problem is not None:
        raise reader.fail("address", why=problem)
    port = reader.integer("port", default=METRICS_PORT, low=1, high=65535)
    reader.done()
    return MetricsListen(address=address, port=port)


def _ip_pressure(reader: Reader, mode: str) -> PressureSettings:
    default = PressureSettings()
    enabled = reader.boolean("enabled", default=default.enabled)
    if enabled and mode != "kubernetes":
        raise reader.fail("enabled", why="the node's condition and taint need mode: kubernetes")
    settings = PressureSettings(
        enabled=enabled,
        enter_after_seconds=reader.number(
            "enterAfterSeconds", default=default.enter_after_seconds, low=0, high=3600
        ),
        leave_free=reader.integer("leaveFreeIPs", default=default.leave_free, low=1, high=1024),
        leave_after_seconds=reader.number(
            "leaveAfterSeconds", default=default.leave_after_seconds, low=0, high=3600
        ),
    )
    reader.done()
    return settings


def _kubernetes(reader: Reader) -> KubernetesConfig:
    default = KubernetesConfig()
    config = KubernetesConfig(
        kubeconfig=reader.string("kubeconfig", default=""),
        namespace=reader.string("namespace", default=default.namespace),
        subnet_name=reader.string("subnetName", default=default.subnet_name),
        watch_timeout_seconds=reader.integer(
            "watchTimeoutSeconds", default=default.watch_timeout_seconds, low=5, high=3600
        ),
        events=reader.boolean("events", default=default.events),
    )
    reader.done()
    return config


def parse(data: Any, source: str) -> Config:
    """Build a Config from parsed YAML; raise ConfigError naming the offending key."""
    root = Reader(data, prefix="", source=source)
    default = Config()
    node_name = root.string("nodeName", default=default.node_name)
    mode = root.string("mode", default="standalone", choices=("standalone", "kubernetes"))
    socket_path = Path(root.string("socketPath", default=str(default.socket_path)))
    state_dir = Path(root.string("stateDir", default=str(default.state_dir)))
    debug_listen = root.string("debugListen", default=default.debug_listen)
    debug_socket = root.string("debugSocketPath", default="")
    if debug_socket and not debug_socket.startswith("/"):
        raise root.fail("debugSocketPath", why=f"must be an absolute path, got {debug_socket!r}")
    if debug_socket and Path(debug_socket) == socket_path:
        raise root.fail("debugSocketPath", why="must not be the CNI socket's path (socketPath)")
    log_level = root.string(
        "logLevel", default="info", choices=("debug", "info", "warning", "error")
    )
    log_format = root.string("logFormat", default="auto", choices=("auto", "json", "console"))
    add_timeout = root.number(
        "addTimeoutSeconds", default=default.add_timeout_seconds, low=0.1, high=600
    )
    cooldown = read_ip_cooldown(root)
    interval = root.number(
        "reconcileIntervalSeconds", default=default.reconcile_interval_seconds, low=0.1, high=3600
    )
    attachment_check = root.number(
        "attachmentCheckSeconds", default=default.attachment_check_seconds, low=0.1, high=3600
    )
    coalescing = _coalescing(root.child("requestCoalescing"))
    leak_reclaim = _leak_reclaim(root.child("leakReclaim"), mode)
    scaler = read_scaler(root.child("scaler"))
    standalone = _standalone(root.child("standalone"))
    kubernetes = _kubernetes(root.child("kubernetes"))
    flat_network = _flat_network(root.child("flatNetwork"))
    metrics = _metrics(root.child("metrics"))
    ip_pressure = _ip_pressure(root.child("ipPressure"), mode)
    root.done()
    config = Config(
        node_name=node_name,
        mode=mode,
        socket_path=socket_path,
        state_dir=state_dir,
        debug_listen=debug_listen,
        debug_socket=Path(debug_socket) if debug_socket else None,
        log_level=log_level,
        log_format=log_format,
        add_timeout_seconds=add_timeout,
        ip_cooldown_seconds=cooldown,
        reconcile_interval_seconds=interval,
        attachment_check_seconds=attachment_check,
        coalescing=coalescing,
        leak_reclaim=leak_reclaim,
        scaler=scaler,
        standalone=standalone,
        kubernetes=kubernetes,
        flat_network=flat_network,
        metrics=metrics,
        ip_pressure=ip_pressure,
    )
    check_debug_listen(config.debug_listen, source=source)
    return config


def check_debug_listen(value: str, *, source: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{source}: debugListen: must be HOST:PORT, got {value!r}")


def load(path: Path) -> Config:
    """Read and validate a config file."""
    return parse(read_yaml(path, "config"), str(path))


def with_overrides(
    config: Config,
    *,
    socket_path: str | None = None,
    state_dir: str | None = None,
    debug_listen: str | None = None,
    node_name: str | None = None,
    kubeconfig: str | None = None,
    metrics_address: str | None = None,
) -> Config:
    """Apply command-line flags, which win over the file."""
    if debug_listen is not None:
        check_debug_listen(debug_listen, source="--debug-listen")
    if metrics_address is not None:
        problem = metrics_address_problem(metrics_address)
        if problem is not None:
            raise ConfigError(f"--metrics-address: {problem}")
        config = replace(config, metrics=replace(config.metrics, address=metrics_address))
    if kubeconfig:
        config = replace(config, kubernetes=replace(config.kubernetes, kubeconfig=kubeconfig))
    return replace(
        config,
        node_name=node_name or config.node_name,
        socket_path=Path(socket_path) if socket_path else config.socket_path,
        state_dir=Path(state_dir) if state_dir else config.state_dir,
        debug_listen=debug_listen or config.debug_listen,
    )
