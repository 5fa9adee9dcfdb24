"""Strict YAML documents: typed values popped out of mappings, every error naming its key.

Both files a person writes for cns are read this way: the daemon's `cns.yaml`
(cns/config/daemon_config.py) and `cns simulate`'s scenarios (cns/sim/scenario.py). Keys are
camelCase, and unknown keys are errors, not warnings: a misspelt `releaseThresholdPercnt` silently
ignored is an outage waiting to happen. Every error names the file and the full key
(`deployments[2].pod.cpu: ...`), so the author knows
exactly what to fix. The `scaler` and `exhaustion` sections are the same in both, so they are
read here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cns.core.reservations import Network, ReservationError
from cns.core.subnet import Subnet
from cns.core.types import Scaler


class ConfigError(Exception):
    """A problem in a file a person wrote; the message names the file and the key."""


class Reader:
    """Pops typed values out of one mapping, naming `prefix.key` in every error.

    What is left when `done()` is called is unknown keys, which are errors.
    """

    def __init__(self, data: Any, *, prefix: str, source: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {prefix or 'the document'} must be a mapping")
        self.data = dict(data)
        self.prefix = prefix
        self.source = source

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, *, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.name(key)}: {why}")

    def string(self, key: str, *, default: str, choices: tuple[str, ...] = ()) -> str:
        value = self.data.pop(key, default)
        if not isinstance(value, str) or (not value and default):
            raise self.fail(key, why=f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, why=f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self.data.pop(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, why=f"must be true or false, got {value!r}")
        return value

    def integer(self, key: str, *, default: int, low: int, high: int) -> int:
        value = self.data.pop(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, why=f"must be an integer, got {value!r}")
        if not low <= value <= high:
            raise self.fail(key, why=f"must be in {low}..{high}, got {value}")
        return value

    def number(self, key: str, *, default: float, low: float, high: float) -> float:
        value = self.data.pop(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, why=f"must be a number, got {value!r}")
        if not low <= value <= high:
            raise self.fail(key, why=f"must be in {low}..{high}, got {value}")
        return float(value)

    def integer_fields(
        self, fields: Sequence[tuple[str, str, int, int]], default: object
    ) -> dict[str, int]:
        """A record's integer fields, read in the table's order: (field, key, lowest, highest),
        each defaulting to `default`'s value; for `Record(**reader.integer_fields(...))`."""
        return {
            name: self.integer(key, default=getattr(default, name), low=low, high=high)
            for name, key, low, high in fields
        }

    def number_fields(
        self, fields: Sequence[tuple[str, str, float, float]], default: object
    ) -> dict[str, float]:
        """`integer_fields` for numbers."""
        return {
            name: self.number(key, default=getattr(default, name), low=low, high=high)
            for name, key, low, high in fields
        }

    def check(self, problems: Sequence[str]) -> None:
        """The section, read whole, cannot be used: every reason in one error."""
        if problems:
            raise ConfigError(f"{self.source}: {self.prefix}: {'; '.join(problems)}")

    def child(self, key: str) -> Reader:
        return Reader(self.data.pop(key, None), prefix=self.name(key), source=self.source)

    def done(self) -> None:
        if self.data:
            unknown = ", ".join(self.name(str(k)) for k in sorted(self.data, key=str))
            raise ConfigError(f"{self.source}: unknown key(s): {unknown}")


# The `scaler` section: Scaler's field, key, lowest and highest value, in the order read.
_SCALER_KEYS: tuple[tuple[str, str, int, int], ...] = (
    ("batch_size", "batchSize", 1, 4096),
    ("request_threshold_percent", "requestThresholdPercent", 0, 100),
    ("release_threshold_percent", "releaseThresholdPercent", 100, 10000),
    ("max_ip_count", "maxIPCount", 1, 65536),
    ("min_ip_count", "minIPCount", 0, 65535),
)


def read_scaler(reader: Reader) -> Scaler:
    """The `scaler` section (NodeNetworkConfig's scaler, camelCase), checked as a whole."""
    scaler = Scaler(**reader.integer_fields(_SCALER_KEYS, Scaler()))
    reader.done()
    reader.check(scaler.problems())
    return scaler


@dataclass(frozen=True, slots=True, kw_only=True)
class ExhaustionThresholds:
    upper_percent: int = 90
    lower_percent: int = 50


def read_exhaustion(reader: Reader) -> ExhaustionThresholds:
    """The `exhaustion` section: the subnet's utilization thresholds, the lower below the upper
    (the hysteresis between them keeps the exhausted state from flipping)."""
    thresholds = ExhaustionThresholds(
        upper_percent=reader.integer("upperPercent", default=90, low=1, high=100),
        lower_percent=reader.integer("lowerPercent", default=50, low=0, high=100),
    )
    reader.done()
    if thresholds.lower_percent >= thresholds.upper_percent:
        raise reader.fail("lowerPercent", why="must be below upperPercent (hysteresis)")
    return thresholds


def read_reserved_ips(reader: Reader, network: Network) -> tuple[str, ...]:
    """`reservedIPs`: addresses, CIDRs and first-last ranges of `network` (the daemon's
    standalone subnets and a scenario's), checked as a ClusterSubnet's are (`Subnet`)."""
    entries = reader.data.pop("reservedIPs", [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise reader.fail("reservedIPs", why=f"must be a list of strings, got {entries!r}")
    try:
        Subnet("", str(network), reserved_ips=frozenset(entries))
    except ReservationError as exc:
        raise reader.fail("reservedIPs", why=str(exc)) from exc
    return tuple(entries)


# `ipCooldownSeconds`: the daemon's (cns.yaml) and the simulator's (a scenario's `timing`).
IP_COOLDOWN_SECONDS = 30.0


def read_ip_cooldown(reader: Reader) -> float:
    """`ipCooldownSeconds`, with one default and range for the daemon and the simulator, so that
    a scenario models the daemon an operator runs (0: a released IP is handed out at once)."""
    return reader.number("ipCooldownSeconds", default=IP_COOLDOWN_SECONDS, low=0, high=3600)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader refusing a mapping that gives one key twice: YAML's rule, which PyYAML does
    not enforce (the last silently wins, and a person reads the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, what: str) -> Any:
    """The parsed YAML of `path`; a ConfigError naming the file if it cannot be read or parsed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc}") from exc
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
