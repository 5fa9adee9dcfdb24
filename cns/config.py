"""The daemon's configuration file: YAML, strictly validated, every error naming its key.

Keys follow the NodeNetworkConfig scaler conventions (camelCase). Unknown keys are errors, not
warnings: a misspelt `releaseThresholdPercnt` silently ignored is an outage waiting to happen.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from cns.core.types import Scaler
from cns.kube import NAMESPACE


class ConfigError(Exception):
    """A configuration problem; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ExhaustionThresholds:
    upper_percent: int = 90
    lower_percent: int = 50


@dataclass(frozen=True, slots=True)
class StandaloneConfig:
    subnet: str = "10.240.0.0/22"
    gateway: str = ""
    primary_ip_count: int = 1
    allocation_latency_ms: int = 200
    exhaustion: ExhaustionThresholds = field(default_factory=ExhaustionThresholds)


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    kubeconfig: str = ""  # empty: in-cluster service account
    namespace: str = NAMESPACE
    subnet_name: str = "pod-subnet"
    watch_timeout_seconds: int = 300


@dataclass(frozen=True, slots=True)
class Config:
    node_name: str = field(default_factory=socket.gethostname)
    mode: str = "standalone"
    socket_path: Path = Path("/run/cns/cns.sock")
    state_dir: Path = Path("/var/lib/cns")
    debug_listen: str = "127.0.0.1:10090"
    log_level: str = "info"
    log_format: str = "auto"
    add_timeout_seconds: float = 10.0
    reconcile_interval_seconds: float = 30.0
    attachment_check_seconds: float = 30.0
    scaler: Scaler = field(default_factory=Scaler)
    standalone: StandaloneConfig = field(default_factory=StandaloneConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    @property
    def debug_host_port(self) -> tuple[str, int]:
        host, _, port = self.debug_listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def release_queue_dir(self) -> Path:
        return self.state_dir / "release-queue"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.db"


class _Reader:
    """Pops typed values out of one mapping, naming `prefix.key` in every error."""

    def __init__(self, data: Any, prefix: str, source: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {prefix or 'the document'} must be a mapping")
        self.data = dict(data)
        self.prefix = prefix
        self.source = source

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.name(key)}: {why}")

    def string(self, key: str, default: str, choices: tuple[str, ...] = ()) -> str:
        value = self.data.pop(key, default)
        if not isinstance(value, str) or (not value and default):
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(self, key: str, default: int, low: int, high: int) -> int:
        value = self.data.pop(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if not low <= value <= high:
            raise self.fail(key, f"must be in {low}..{high}, got {value}")
        return value

    def number(self, key: str, default: float, low: float, high: float) -> float:
        value = self.data.pop(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        if not low <= value <= high:
            raise self.fail(key, f"must be in {low}..{high}, got {value}")
        return float(value)

    def child(self, key: str) -> _Reader:
        return _Reader(self.data.pop(key, None), self.name(key), self.source)

    def done(self) -> None:
        if self.data:
            unknown = ", ".join(self.name(str(k)) for k in sorted(self.data, key=str))
            raise ConfigError(f"{self.source}: unknown key(s): {unknown}")


def _scaler(reader: _Reader) -> Scaler:
    default = Scaler()
    scaler = Scaler(
        batch_size=reader.integer("batchSize", default.batch_size, 1, 4096),
        request_threshold_percent=reader.integer(
            "requestThresholdPercent", default.request_threshold_percent, 0, 100
        ),
        release_threshold_percent=reader.integer(
            "releaseThresholdPercent", default.release_threshold_percent, 100, 10000
        ),
        max_ip_count=reader.integer("maxIPCount", default.max_ip_count, 1, 65536),
    )
    reader.done()
    problems = scaler.problems()
    if problems:
        raise ConfigError(f"{reader.source}: {reader.prefix}: {'; '.join(problems)}")
    return scaler


def _standalone(reader: _Reader) -> StandaloneConfig:
    default = StandaloneConfig()
    subnet = reader.string("subnet", default.subnet)
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise reader.fail("subnet", f"not a network in CIDR form: {exc}") from exc
    gateway = reader.string("gateway", "")
    if gateway:
        try:
            gateway_ip = ipaddress.ip_address(gateway)
        except ValueError as exc:
            raise reader.fail("gateway", f"not an IP address: {exc}") from exc
        if gateway_ip not in network:
            raise reader.fail("gateway", f"{gateway} is not in subnet {subnet}")
    if network.num_addresses < 4:
        raise reader.fail("subnet", f"{subnet} is too small (fewer than 4 addresses)")
    primary = reader.integer("primaryIPCount", default.primary_ip_count, 0, 16)
    latency = reader.integer("allocationLatencyMs", default.allocation_latency_ms, 0, 600_000)
    exhaustion = reader.child("exhaustion")
    thresholds = ExhaustionThresholds(
        upper_percent=exhaustion.integer("upperPercent", 90, 1, 100),
        lower_percent=exhaustion.integer("lowerPercent", 50, 0, 100),
    )
    exhaustion.done()
    if thresholds.lower_percent >= thresholds.upper_percent:
        raise exhaustion.fail("lowerPercent", "must be below upperPercent (hysteresis)")
    reader.done()
    return StandaloneConfig(subnet, gateway, primary, latency, thresholds)


def _kubernetes(reader: _Reader) -> KubernetesConfig:
    default = KubernetesConfig()
    config = KubernetesConfig(
        kubeconfig=reader.string("kubeconfig", ""),
        namespace=reader.string("namespace", default.namespace),
        subnet_name=reader.string("subnetName", default.subnet_name),
        watch_timeout_seconds=reader.integer(
            "watchTimeoutSeconds", default.watch_timeout_seconds, 5, 3600
        ),
    )
    reader.done()
    return config


def parse(data: Any, source: str) -> Config:
    """Build a Config from parsed YAML; raise ConfigError naming the offending key."""
    root = _Reader(data, "", source)
    default = Config()
    node_name = root.string("nodeName", default.node_name)
    mode = root.string("mode", "standalone", ("standalone", "kubernetes"))
    socket_path = Path(root.string("socketPath", str(default.socket_path)))
    state_dir = Path(root.string("stateDir", str(default.state_dir)))
    debug_listen = root.string("debugListen", default.debug_listen)
    log_level = root.string("logLevel", "info", ("debug", "info", "warning", "error"))
    log_format = root.string("logFormat", "auto", ("auto", "json", "console"))
    add_timeout = root.number("addTimeoutSeconds", default.add_timeout_seconds, 0.1, 600)
    interval = root.number(
        "reconcileIntervalSeconds", default.reconcile_interval_seconds, 0.1, 3600
    )
    attachment_check = root.number(
        "attachmentCheckSeconds", default.attachment_check_seconds, 0.1, 3600
    )
    scaler = _scaler(root.child("scaler"))
    standalone = _standalone(root.child("standalone"))
    kubernetes = _kubernetes(root.child("kubernetes"))
    root.done()
    config = Config(
        node_name=node_name,
        mode=mode,
        socket_path=socket_path,
        state_dir=state_dir,
        debug_listen=debug_listen,
        log_level=log_level,
        log_format=log_format,
        add_timeout_seconds=add_timeout,
        reconcile_interval_seconds=interval,
        attachment_check_seconds=attachment_check,
        scaler=scaler,
        standalone=standalone,
        kubernetes=kubernetes,
    )
    check_debug_listen(config.debug_listen, source)
    return config


def check_debug_listen(value: str, source: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{source}: debugListen: must be HOST:PORT, got {value!r}")


def read_yaml(path: Path, what: str) -> Any:
    """The parsed YAML of `path`; a ConfigError naming the file if it cannot be read or parsed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def load(path: Path) -> Config:
    """Read and validate a config file."""
    return parse(read_yaml(path, "config"), str(path))


def with_overrides(
    config: Config,
    socket_path: str | None = None,
    state_dir: str | None = None,
    debug_listen: str | None = None,
    node_name: str | None = None,
    kubeconfig: str | None = None,
) -> Config:
    """Apply command-line flags, which win over the file."""
    if debug_listen is not None:
        check_debug_listen(debug_listen, "--debug-listen")
    if kubeconfig:
        config = replace(config, kubernetes=replace(config.kubernetes, kubeconfig=kubeconfig))
    return replace(
        config,
        node_name=node_name or config.node_name,
        socket_path=Path(socket_path) if socket_path else config.socket_path,
        state_dir=Path(state_dir) if state_dir else config.state_dir,
        debug_listen=debug_listen or config.debug_listen,
    )
