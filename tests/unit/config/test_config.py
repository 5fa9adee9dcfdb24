"""Configuration validation: the shipped file, defaults, every bad key named, flags over the file,
and a bad gateway stopping `cns run`."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from cns.config.daemon_config import (
    ConfigError,
    FlatNetwork,
    StandaloneSubnet,
    load,
    parse,
    with_overrides,
)
from cns.core.pressure import PressureSettings
from cns.core.subnet import Subnet
from cns.core.types import Scaler
from tests.harness import REPO
from tests.harness.kube_api import load_manifests


def test_shipped_config_is_valid() -> None:
    config = load(REPO / "config" / "cns.yaml")
    # `cns install --systemd` writes it on every node: each must keep its own name.
    assert config.node_name == socket.gethostname()
    assert config.scaler == Scaler(16, 50, 150, 250)
    assert config.standalone.subnet == "10.240.0.0/22"
    assert config.debug_host_port == ("127.0.0.1", 10090)


def test_defaults_when_empty() -> None:
    config = parse({}, "x.yaml")
    assert config.socket_path == Path("/run/cns/cns.sock")
    standalone = config.standalone
    assert Subnet("s", standalone.subnet, standalone.gateway).gateway_address == "10.240.0.1"
    assert (config.coalescing.quiet_seconds, config.coalescing.max_delay_seconds) == (0.1, 1.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"bogus": 1}, "unknown key.*bogus"),
        ({"scaler": {"batchSize": 0}}, "scaler.batchSize"),
        ({"scaler": {"batchSize": "16"}}, "scaler.batchSize: must be an integer"),
        ({"scaler": {"releaseThresholdPercnt": 150}}, "scaler.releaseThresholdPercnt"),
        ({"scaler": {"requestThresholdPercent": 80}}, "releaseThresholdPercent must be >="),
        ({"standalone": {"subnet": "10.0.0.0/33"}}, "standalone.subnet"),
        ({"standalone": {"gateway": "192.168.1.1"}}, "standalone.gateway: .* not in subnet"),
        (
            {"standalone": {"gateway": "10.240.0.0"}},
            "standalone.gateway: 10.240.0.0 is the network address of 10.240.0.0/22, not a host",
        ),
        (
            {"standalone": {"gateway": "10.240.3.255"}},
            "standalone.gateway: 10.240.3.255 is the broadcast address of 10.240.0.0/22",
        ),
        (
            {
                "standalone": {
                    "subnets": [{"name": "v6", "subnet": "fd00::/64", "gateway": "fd00::"}]
                }
            },
            r"subnets\[0\].gateway: fd00:: is the network address of fd00::/64",
        ),
        ({"standalone": {"exhaustion": {"lowerPercent": 95}}}, "exhaustion.lowerPercent"),
        ({"standalone": {"subnets": {"name": "v6"}}}, "standalone.subnets: must be a list"),
        ({"standalone": {"subnets": [{"subnet": "fd00::/64"}]}}, r"standalone.subnets\[0\].name"),
        (
            {"standalone": {"subnets": [{"name": "a b", "subnet": "fd00::/64"}]}},
            r"standalone.subnets\[0\].name: 'a b' must start",
        ),
        (
            {"standalone": {"subnets": [{"name": "standalone", "subnet": "fd00::/64"}]}},
            r"subnets\[0\].name: 'standalone' is the name of another subnet",
        ),
        (
            {"standalone": {"subnets": [{"name": "v6", "subnet": "10.240.1.0/24"}]}},
            r"subnets\[0\].subnet: 10.240.1.0/24 overlaps 10.240.0.0/22",
        ),
        (
            {"standalone": {"subnets": [{"name": "v6", "subnet": "fd00::/64", "gw": "x"}]}},
            r"unknown key\(s\): standalone.subnets\[0\].gw",
        ),
        (
            {
                "standalone": {
                    "subnets": [{"name": "v6", "subnet": "fd00::/64", "gateway": "fd01::1"}]
                }
            },
            r"subnets\[0\].gateway: fd01::1 is not in subnet",
        ),
        ({"mode": "magic"}, "mode: must be one of"),
        ({"kubernetes": {"watchTimeoutSeconds": 1}}, "kubernetes.watchTimeoutSeconds"),
        ({"kubernetes": {"subnet": "x"}}, "kubernetes.subnet"),
        ({"debugListen": "nowhere"}, "debugListen"),
        ({"addTimeoutSeconds": -1}, "addTimeoutSeconds"),
        ({"requestCoalescing": {"quietSeconds": -1}}, "requestCoalescing.quietSeconds"),
        (
            {"requestCoalescing": {"quietSeconds": 2, "maxDelaySeconds": 1}},
            "requestCoalescing.maxDelaySeconds: 1 is shorter than quietSeconds",
        ),
        ({"requestCoalescing": {"quietSecs": 1}}, "requestCoalescing.quietSecs"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_config_names_the_key(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(data, "cns.yaml")


def test_standalone_further_subnets_are_read_ipv4_and_ipv6() -> None:
    standalone = parse(
        {
            "standalone": {
                "name": "v4pods",
                "subnets": [
                    {"name": "v6pods", "subnet": "fd00:10:240::/64", "primaryIPCount": 0},
                    {"name": "more", "subnet": "10.241.0.0/24", "gateway": "10.241.0.254"},
                ],
            }
        },
        "t",
    ).standalone
    assert standalone.primary == StandaloneSubnet(
        name="v4pods", subnet="10.240.0.0/22", gateway="", primary_ip_count=1
    )
    assert standalone.subnets == (
        StandaloneSubnet(name="v6pods", subnet="fd00:10:240::/64", primary_ip_count=0),
        StandaloneSubnet(name="more", subnet="10.241.0.0/24", gateway="10.241.0.254"),
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("mode: standalone\nmode: kubernetes\n", "mode"),
        ("flatNetwork:\n  enabled: false\n  enabled: true\n", "enabled"),
    ],
)
def test_a_key_given_twice_is_an_error_naming_it(tmp_path: Path, text: str, key: str) -> None:
    """YAML lets the last of two equal keys win silently: a setting written twice (a paste,
    a merge) would leave the operator reading the one that does not count."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{path}: .*{key!s}.* twice"):
        load(path)


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scaler: [unclosed")
    with pytest.raises(ConfigError, match=str(path)):
        load(path)


def test_flags_override_the_file() -> None:
    config = with_overrides(
        parse({}, "x"), socket_path="/tmp/s.sock", state_dir="/tmp/st", debug_listen="127.0.0.1:1"
    )
    assert str(config.socket_path) == "/tmp/s.sock"
    assert str(config.state_dir) == "/tmp/st"
    assert config.debug_listen == "127.0.0.1:1"
    with pytest.raises(ConfigError, match="--debug-listen"):
        with_overrides(config, debug_listen="bad")


def test_leak_reclaim_asks_containerd_in_kubernetes_mode_and_nothing_standalone() -> None:
    assert parse({}, "t").leak_reclaim.cri_socket == ""
    kube = parse({"mode": "kubernetes"}, "t").leak_reclaim
    assert (kube.cri_socket, kube.check_seconds, kube.grace_seconds) == (
        "/run/containerd/containerd.sock",
        60.0,
        300.0,
    )
    off = parse({"mode": "kubernetes", "leakReclaim": {"criSocket": ""}}, "t")
    assert off.leak_reclaim.cri_socket == ""
    crio = parse({"leakReclaim": {"criSocket": "unix:///var/run/crio/crio.sock"}}, "t")
    assert crio.leak_reclaim.cri_socket == "/var/run/crio/crio.sock"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"criSocket": "run/containerd.sock"}, "leakReclaim.criSocket: must be an absolute path"),
        ({"graceSeconds": 0}, "leakReclaim.graceSeconds"),
        ({"checkSeconds": "often"}, "leakReclaim.checkSeconds"),
        ({"gracePeriod": 5}, "leakReclaim.gracePeriod"),
    ],
)
def test_leak_reclaim_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"leakReclaim": section}, "t")


def test_a_gateway_that_is_the_network_address_stops_cns_run_naming_the_field(
    make_daemon: Any,
) -> None:
    """Pods would be told to route through the subnet's network address, which no host owns."""
    gateway = {"standalone": {"subnet": "10.240.8.0/24", "gateway": "10.240.8.0"}}
    daemon = make_daemon(gateway, start=False)
    daemon.start(wait=False)
    assert daemon.proc.wait(timeout=30) == 2
    assert (
        "standalone.gateway: 10.240.8.0 is the network address of 10.240.8.0/24, not a host "
        "address" in daemon.log()
    )
    assert not (daemon.state_dir / "state.db").exists()


def test_flat_network_is_off_by_default_and_read_strictly() -> None:
    assert parse({}, "x.yaml").flat_network == FlatNetwork(enabled=False, uplink="")
    assert load(REPO / "config" / "cns.yaml").flat_network.enabled is False
    on = parse({"flatNetwork": {"enabled": True, "uplink": "eth0"}}, "x.yaml")
    assert on.flat_network == FlatNetwork(enabled=True, uplink="eth0")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": "yes"}, "flatNetwork.enabled: must be true or false, got 'yes'"),
        ({"uplink": "a-name-far-too-long"}, "flatNetwork.uplink: .* is not an interface name"),
        ({"uplink": "../etc"}, "flatNetwork.uplink: .* is not an interface name"),
        ({"uplink": 3}, "flatNetwork.uplink: must be a non-empty string"),
        ({"uplinks": "eth0"}, "unknown key.*flatNetwork.uplinks"),
    ],
)
def test_flat_network_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"flatNetwork": section}, "cns.yaml")


def test_the_metrics_listener_is_off_by_default_and_read_strictly() -> None:
    assert parse({}, "x.yaml").metrics.host_port is None
    assert load(REPO / "config" / "cns.yaml").metrics.host_port is None
    on = parse({"metrics": {"address": "10.0.0.5", "port": 9000}}, "x.yaml").metrics
    assert on.host_port == ("10.0.0.5", 9000)
    assert parse({"metrics": {"address": "fd00::5"}}, "x.yaml").metrics.url == "[fd00::5]:10092"
    flagged = with_overrides(parse({}, "x.yaml"), metrics_address="0.0.0.0")
    assert flagged.metrics.host_port == ("0.0.0.0", 10092)
    with pytest.raises(ConfigError, match="--metrics-address: 'node-1' is not an IP address"):
        with_overrides(flagged, metrics_address="node-1")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"address": "localhost"}, "metrics.address: 'localhost' is not an IP address"),
        ({"address": 5}, "metrics.address: must be a non-empty string"),
        ({"port": 0}, r"metrics.port: must be in 1..65535, got 0"),
        ({"port": "9000"}, "metrics.port: must be an integer"),
        ({"path": "/m"}, "unknown key.*metrics.path"),
    ],
)
def test_metrics_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"metrics": section}, "cns.yaml")


def test_ip_pressure_is_off_by_default_and_read_strictly() -> None:
    assert parse({}, "x.yaml").ip_pressure == PressureSettings()
    assert PressureSettings().enabled is False
    shipped = load_manifests(REPO / "config" / "daemonset.yaml")
    (config_map,) = [d for d in shipped if d["kind"] == "ConfigMap"]
    in_cluster = parse(yaml.safe_load(config_map["data"]["cns.yaml"]), "cns-config")
    assert in_cluster.ip_pressure == PressureSettings()  # the ConfigMap spells out the defaults
    section = {"enabled": True, "enterAfterSeconds": 0, "leaveFreeIPs": 4, "leaveAfterSeconds": 5}
    on = parse({"mode": "kubernetes", "ipPressure": section}, "x.yaml")
    assert on.ip_pressure == PressureSettings(
        enabled=True, enter_after_seconds=0, leave_free=4, leave_after_seconds=5
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"ipPressure": {"enabled": True}}, "ipPressure.enabled: .*need mode: kubernetes"),
        ({"mode": "kubernetes", "ipPressure": {"leaveFreeIPs": 0}}, "ipPressure.leaveFreeIPs"),
        ({"mode": "kubernetes", "ipPressure": {"enterAfterSeconds": -1}}, "enterAfterSeconds"),
        ({"mode": "kubernetes", "ipPressure": {"enable": True}}, "unknown key.*ipPressure.enable"),
    ],
)
def test_ip_pressure_settings_are_checked(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(data, "cns.yaml")


def test_standalone_reserved_ips_take_addresses_cidrs_and_ranges_per_subnet() -> None:
    standalone = parse(
        {
            "standalone": {
                "reservedIPs": ["10.240.0.5", "10.240.1.0/28", "10.240.2.10-10.240.2.20"],
                "subnets": [{"name": "v6", "subnet": "fd00::/64", "reservedIPs": ["fd00::/120"]}],
            }
        },
        "t",
    ).standalone
    assert standalone.primary.reserved_ips == (
        "10.240.0.5",
        "10.240.1.0/28",
        "10.240.2.10-10.240.2.20",
    )
    assert standalone.subnets[0].reserved_ips == ("fd00::/120",)


@pytest.mark.parametrize(
    ("reserved", "says"),
    [
        (["10.241.0.0/24"], "no address of the subnet 10.240.0.0/22"),
        (["10.240.0.9-10.240.0.1"], "above its last"),
        (["fd00::1"], "IPv6 entry in the IPv4 subnet"),
        ("10.240.0.5", "must be a list of strings"),
        ([5], "must be a list of strings"),
    ],
)
def test_a_bad_standalone_reservation_is_an_error_naming_the_field(
    reserved: object, says: str
) -> None:
    with pytest.raises(ConfigError, match=rf"t: standalone\.reservedIPs: .*{says}"):
        parse({"standalone": {"reservedIPs": reserved}}, "t")
