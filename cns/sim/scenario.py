"""Scenario files: YAML, strictly validated, every error naming its field.

The same conventions as `cns.yaml` (camelCase keys, unknown keys are errors, `scaler` is the same
section), read with the same reader (cns/config/yamlreader.py), so
`deployments[2].pod.cpu: ...` tells the author exactly what to fix. Quantities are
Kubernetes-style: CPU `250m` or `2`, memory `512Mi` or `16Gi`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cns.config.yamlreader import (
    IP_COOLDOWN_SECONDS,
    Reader,
    read_exhaustion,
    read_ip_cooldown,
    read_reserved_ips,
    read_scaler,
    read_yaml,
)
from cns.core.overflow import MAX_OVERFLOW_SUBNETS
from cns.core.types import Scaler
from cns.sim.escalator import NodeGroupOptions, Resources
from cns.sim.strategies import STRATEGIES

# Every usable address of a subnet is listed once per run; beyond this the list is the problem.
MAX_SIMULATED_ADDRESSES = 1 << 20
_MEMORY_UNITS = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class SubnetSpec:
    name: str
    cidr: str
    upper_percent: int = 90
    lower_percent: int = 50
    node_safety_factor: int = 2
    max_batch: int = 16
    reserved_ips: tuple[str, ...] = ()  # `reservedIPs`, as a ClusterSubnet's
    # A ClusterSubnet's `spec.overflow`: where its nodes' pods take addresses once it is
    # exhausted or draining (cns/core/overflow.py), in order; other subnets of the scenario.
    overflow: tuple[str, ...] = ()
    # When the subnet starts draining (`spec.draining` set); None: never.
    drain_at_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class NodeShape:
    """A node's allocatable resources and pod limit (all nodes of a pool are alike)."""

    allocatable: Resources
    max_pods: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscalerSpec:
    """Escalator's options for one node pool, plus its timers."""

    options: NodeGroupOptions
    scale_up_cool_down_seconds: float = 120.0
    soft_delete_grace_seconds: float = 60.0
    hard_delete_grace_seconds: float = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePoolSpec:
    name: str
    subnet: str
    node: NodeShape
    initial_nodes: int
    autoscaler: AutoscalerSpec | None  # None: a fixed pool of `initial_nodes`


@dataclass(frozen=True, slots=True)
class DeploymentChange:
    """From `at_seconds` on, the deployment has these replicas and/or weights."""

    at_seconds: float
    replicas: int | None = None
    weights: dict[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploymentSpec:
    name: str
    pod: Resources
    replicas: int
    weights: dict[str, int]
    start_seconds: float = 0.0
    max_surge_percent: int = 25
    crash_loops_per_minute: float = 0.0
    rollouts_at_seconds: tuple[float, ...] = ()
    changes: tuple[DeploymentChange, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Latencies and periods of the simulated cluster, in seconds."""

    allocation_latency_seconds: float = 2.0
    controller_round_seconds: float = 1.0
    add_timeout_seconds: float = 10.0
    add_retry_seconds: float = 5.0
    pod_start_seconds: float = 5.0
    node_start_seconds: float = 90.0
    escalator_scan_seconds: float = 60.0
    # The daemon's `ipCooldownSeconds`: a released IP is not handed to another pod for this long.
    ip_cooldown_seconds: float = IP_COOLDOWN_SECONDS


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    duration_seconds: float
    subnets: tuple[SubnetSpec, ...]
    node_pools: tuple[NodePoolSpec, ...]
    deployments: tuple[DeploymentSpec, ...]
    description: str = ""
    seed: int = 1
    sample_seconds: float = 10.0
    scaler: Scaler = field(default_factory=Scaler)
    timing: Timing = field(default_factory=Timing)
    strategies: tuple[str, ...] = ()


def _items(reader: Reader, key: str, required: bool = True) -> list[Reader]:
    value = reader.data.pop(key, None)
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise reader.fail(key, why=f"must be a non-empty list, got {value!r}")
    return [
        Reader(item, prefix=f"{reader.name(key)}[{i}]", source=reader.source)
        for i, item in enumerate(value)
    ]


def _numbers(reader: Reader, key: str, high: float) -> tuple[float, ...]:
    value = reader.data.pop(key, [])
    if not isinstance(value, list):
        raise reader.fail(key, why=f"must be a list of numbers, got {value!r}")
    numbers = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int | float) or not 0 <= item <= high:
            raise reader.fail(f"{key}[{i}]", why=f"must be a number in 0..{high:g}, got {item!r}")
        numbers.append(float(item))
    return tuple(sorted(numbers))


def _boolean(reader: Reader, key: str, default: bool) -> bool:
    value = reader.data.pop(key, default)
    if not isinstance(value, bool):
        raise reader.fail(key, why=f"must be true or false, got {value!r}")
    return value


def _strings(reader: Reader, key: str) -> tuple[str, ...]:
    value = reader.data.pop(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise reader.fail(key, why=f"must be a list of names, got {value!r}")
    return tuple(value)


def _quantity(reader: Reader, key: str) -> tuple[float, str]:
    value = reader.data.pop(key, None)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value), ""
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None:
        raise reader.fail(key, why=f"must be a quantity like 500m, 2, 512Mi or 16Gi, got {value!r}")
    return float(match.group(1)), match.group(2)


def _cpu(reader: Reader, key: str) -> int:
    """Millicores from `250m`, `2` or `0.5`."""
    number, unit = _quantity(reader, key)
    if unit not in ("", "m"):
        raise reader.fail(key, why=f"CPU must be in cores or millicores (250m), got unit {unit!r}")
    milli = round(number if unit == "m" else number * 1000)
    if milli <= 0:
        raise reader.fail(key, why="must be more than 0 (every pod and node needs a CPU figure)")
    return milli


def _memory(reader: Reader, key: str) -> int:
    """Bytes from `512Mi`, `16Gi`, `1G` or a plain number of bytes."""
    number, unit = _quantity(reader, key)
    if unit not in _MEMORY_UNITS:
        units = ", ".join(u for u in _MEMORY_UNITS if u)
        raise reader.fail(key, why=f"memory unit must be one of {units}, got {unit!r}")
    size = round(number * _MEMORY_UNITS[unit])
    if size <= 0:
        raise reader.fail(key, why="must be more than 0 (every pod and node needs a memory figure)")
    return size


def _resources(reader: Reader) -> Resources:
    return Resources(cpu_milli=_cpu(reader, "cpu"), memory_bytes=_memory(reader, "memory"))


def _weights(reader: Reader, key: str, pools: dict[str, NodePoolSpec]) -> dict[str, int]:
    child = reader.child(key)
    weights = {}
    for name in list(child.data):
        if str(name) not in pools:
            known = ", ".join(pools)
            raise child.fail(str(name), why=f"no node pool of that name (pools: {known})")
        weights[str(name)] = child.integer(name, default=0, low=0, high=1_000_000)
    if not any(weights.values()):
        raise reader.fail(key, why="must give at least one node pool a weight above 0")
    return weights


def _subnet(reader: Reader, scaler: Scaler, end: float) -> SubnetSpec:
    name = reader.string("name", default="")
    cidr = reader.string("cidr", default="")
    try:
        network = ipaddress.ip_network(cidr)
    except ValueError as exc:
        raise reader.fail("cidr", why=f"not a network in CIDR form: {exc}") from exc
    if not 4 <= network.num_addresses <= MAX_SIMULATED_ADDRESSES:
        raise reader.fail(
            "cidr",
            why=f"must have 4..{MAX_SIMULATED_ADDRESSES} addresses, got {network.num_addresses}",
        )
    exhaustion = read_exhaustion(reader.child("exhaustion"))
    spec = SubnetSpec(
        name=name,
        cidr=str(network),
        upper_percent=exhaustion.upper_percent,
        lower_percent=exhaustion.lower_percent,
        node_safety_factor=reader.integer("nodeSafetyFactor", default=2, low=1, high=64),
        max_batch=reader.integer("maxBatchSize", default=scaler.batch_size, low=1, high=4096),
        reserved_ips=read_reserved_ips(reader, network),
        overflow=_strings(reader, "overflow"),
        drain_at_seconds=reader.number("drainAtSeconds", default=0, low=0, high=end)
        if "drainAtSeconds" in reader.data
        else None,
    )
    reader.done()
    return spec


def _check_overflow(readers: list[Reader], subnets: dict[str, SubnetSpec]) -> None:
    """Each subnet's overflow list names other subnets of the scenario, each once, of its own
    IP family (a pod's address must be of the family it asked for), at most
    MAX_OVERFLOW_SUBNETS of them, as the ClusterSubnet CRD allows."""
    for reader, spec in zip(readers, subnets.values(), strict=True):
        if len(spec.overflow) > MAX_OVERFLOW_SUBNETS:
            raise reader.fail(
                "overflow",
                why=f"at most {MAX_OVERFLOW_SUBNETS} subnets, got {len(spec.overflow)}",
            )
        family = ipaddress.ip_network(spec.cidr).version
        for i, name in enumerate(spec.overflow):
            key = f"overflow[{i}]"
            other = subnets.get(name)
            if name == spec.name:
                raise reader.fail(key, why="a subnet cannot overflow into itself")
            if other is None:
                raise reader.fail(
                    key, why=f"no subnet named {name!r} (subnets: {', '.join(subnets)})"
                )
            if name in spec.overflow[:i]:
                raise reader.fail(key, why=f"{name!r} is listed twice")
            if ipaddress.ip_network(other.cidr).version != family:
                raise reader.fail(
                    key, why=f"{name!r} is not IPv{family}, as this subnet is ({other.cidr})"
                )


# Escalator's options: NodeGroupOptions' field, key, lowest and highest value, in the order read.
_AUTOSCALER_KEYS: tuple[tuple[str, str, int, int], ...] = (
    ("min_nodes", "minNodes", 0, 100_000),
    ("max_nodes", "maxNodes", 1, 100_000),
    ("scale_up_threshold_percent", "scaleUpThresholdPercent", 1, 1000),
    ("taint_upper_capacity_threshold_percent", "taintUpperCapacityThresholdPercent", 0, 1000),
    ("taint_lower_capacity_threshold_percent", "taintLowerCapacityThresholdPercent", 0, 1000),
    ("slow_node_removal_rate", "slowNodeRemovalRate", 0, 100_000),
    ("fast_node_removal_rate", "fastNodeRemovalRate", 0, 100_000),
)


def _autoscaler(reader: Reader) -> AutoscalerSpec:
    default = NodeGroupOptions()
    options = NodeGroupOptions(
        **reader.integer_fields(_AUTOSCALER_KEYS, default),
        scale_on_starve=_boolean(reader, "scaleOnStarve", default.scale_on_starve),
    )
    reader.check(options.problems())
    spec = AutoscalerSpec(
        options=options,
        scale_up_cool_down_seconds=reader.number(
            "scaleUpCoolDownSeconds", default=120, low=0, high=86400
        ),
        soft_delete_grace_seconds=reader.number(
            "softDeleteGracePeriodSeconds", default=60, low=0, high=86400
        ),
        hard_delete_grace_seconds=reader.number(
            "hardDeleteGracePeriodSeconds", default=600, low=0, high=86400
        ),
    )
    reader.done()
    return spec


def _node_pool(reader: Reader, subnets: dict[str, SubnetSpec], scaler: Scaler) -> NodePoolSpec:
    name = reader.string("name", default="")
    subnet = reader.string("subnet", default="")
    if subnet not in subnets:
        raise reader.fail(
            "subnet", why=f"no subnet named {subnet!r} (subnets: {', '.join(subnets)})"
        )
    node_reader = reader.child("node")
    node = NodeShape(
        _resources(node_reader),
        # every pod needs a secondary IP, and the node's primary counts against maxIPCount
        node_reader.integer("maxPods", default=110, low=1, high=max(1, scaler.max_ip_count - 1)),
    )
    node_reader.done()
    autoscaler = None
    if "escalator" in reader.data:
        autoscaler = _autoscaler(reader.child("escalator"))
    if autoscaler is None:
        if "initialNodes" not in reader.data:
            raise reader.fail(
                "initialNodes", why="required: without escalator it is the pool's size"
            )
        initial = reader.integer("initialNodes", default=1, low=1, high=100_000)
    else:
        low, high = autoscaler.options.min_nodes, autoscaler.options.max_nodes
        initial = reader.integer("initialNodes", default=low, low=low, high=high)
    reader.done()
    return NodePoolSpec(
        name=name, subnet=subnet, node=node, initial_nodes=initial, autoscaler=autoscaler
    )


def _deployment(reader: Reader, pools: dict[str, NodePoolSpec], end: float) -> DeploymentSpec:
    name = reader.string("name", default="")
    pod_reader = reader.child("pod")
    pod = _resources(pod_reader)
    pod_reader.done()
    weights = _weights(reader, "weights", pools)
    for pool_name, weight in weights.items():
        if weight and not pod.fits_in(pools[pool_name].node.allocatable):
            raise reader.fail("pod", why=f"does not fit on an empty node of pool {pool_name!r}")
    replicas = reader.integer("replicas", default=0, low=0, high=10_000_000)
    changes = []
    for change in _items(reader, "changes", required=False):
        at = change.number("atSeconds", default=-1, low=0, high=end)
        new_replicas = None
        if "replicas" in change.data:
            new_replicas = change.integer("replicas", default=0, low=0, high=10_000_000)
        new_weights = _weights(change, "weights", pools) if "weights" in change.data else None
        if new_replicas is None and new_weights is None:
            raise change.fail("replicas", why="a change needs replicas, weights or both")
        change.done()
        changes.append(DeploymentChange(at, new_replicas, new_weights))
    spec = DeploymentSpec(
        name=name,
        pod=pod,
        replicas=replicas,
        weights=weights,
        start_seconds=reader.number("startSeconds", default=0, low=0, high=end),
        max_surge_percent=reader.integer("maxSurgePercent", default=25, low=1, high=100),
        crash_loops_per_minute=reader.number(
            "crashLoopsPerMinute", default=0, low=0, high=1_000_000
        ),
        rollouts_at_seconds=_numbers(reader, "rolloutsAtSeconds", end),
        changes=tuple(sorted(changes, key=lambda c: c.at_seconds)),
    )
    reader.done()
    return spec


# Timing's fields (seconds) but the cooldown: field, key, lowest, highest, in the order read.
_TIMING_KEYS: tuple[tuple[str, str, float, float], ...] = (
    ("allocation_latency_seconds", "allocationLatencySeconds", 0, 3600),
    ("controller_round_seconds", "controllerRoundSeconds", 0.01, 3600),
    ("add_timeout_seconds", "addTimeoutSeconds", 0.1, 3600),
    ("add_retry_seconds", "addRetrySeconds", 0, 3600),
    ("pod_start_seconds", "podStartSeconds", 0, 3600),
    ("node_start_seconds", "nodeStartSeconds", 0, 86400),
    ("escalator_scan_seconds", "escalatorScanSeconds", 1, 3600),
)


def _timing(reader: Reader) -> Timing:
    seconds = reader.number_fields(_TIMING_KEYS, Timing())
    timing = Timing(**seconds, ip_cooldown_seconds=read_ip_cooldown(reader))
    reader.done()
    return timing


def _unique(readers: list[Reader], what: str) -> None:
    seen: set[str] = set()
    for reader in readers:
        name = reader.data.get("name")
        if not isinstance(name, str) or not name:
            raise reader.fail("name", why=f"must be a non-empty string, got {name!r}")
        if name in seen:
            raise reader.fail("name", why=f"another {what} is already named {name!r}")
        seen.add(name)


def parse(data: Any, source: str) -> Scenario:
    """Build a Scenario from parsed YAML; raise ConfigError naming the offending field."""
    root = Reader(data, prefix="", source=source)
    name = root.string("name", default="scenario")
    description = root.string("description", default="") if "description" in root.data else ""
    if "durationSeconds" not in root.data:
        raise root.fail("durationSeconds", why="required: how long to simulate, in seconds")
    duration = root.number("durationSeconds", default=0, low=1, high=7 * 86400)
    seed = root.integer("seed", default=1, low=0, high=2**63)
    sample = root.number("sampleSeconds", default=10, low=0.1, high=duration)
    scaler = read_scaler(root.child("scaler"))
    timing = _timing(root.child("timing"))
    strategies = _strategies(root)

    subnet_readers = _items(root, "subnets")
    _unique(subnet_readers, "subnet")
    subnets = {s.name: s for s in (_subnet(r, scaler, duration) for r in subnet_readers)}
    _check_overflow(subnet_readers, subnets)
    pool_readers = _items(root, "nodePools")
    _unique(pool_readers, "node pool")
    pools = {p.name: p for p in (_node_pool(r, subnets, scaler) for r in pool_readers)}
    deployment_readers = _items(root, "deployments")
    _unique(deployment_readers, "deployment")
    deployments = tuple(_deployment(r, pools, duration) for r in deployment_readers)
    root.done()
    return Scenario(
        name=name,
        description=description,
        duration_seconds=duration,
        seed=seed,
        sample_seconds=sample,
        scaler=scaler,
        timing=timing,
        strategies=strategies,
        subnets=tuple(subnets.values()),
        node_pools=tuple(pools.values()),
        deployments=deployments,
    )


def _strategies(root: Reader) -> tuple[str, ...]:
    names = _strings(root, "strategies")
    for i, name in enumerate(names):
        if name not in STRATEGIES:
            raise root.fail(f"strategies[{i}]", why=f"must be one of {', '.join(STRATEGIES)}")
    return names


def load(path: Path) -> Scenario:
    """Read and validate a scenario file."""
    return parse(read_yaml(path, "scenario"), str(path))
