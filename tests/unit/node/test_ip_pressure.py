"""What IP pressure reads of the lanes (cns/node/ip_pressure.py): free addresses (available or
cooling down), the subnet exhausted, the node at maxIPCount; lanes that hand out nothing are not
read. The Node side runs on a real API server: tests/integration/test_ip_pressure.py."""

from __future__ import annotations

import time

from cns.core.pool import Pool
from cns.core.pressure import Cause, LaneReading, Pressure, PressureSettings
from cns.core.types import IPConfig, NetworkContainer, Owner, Scaler
from cns.node.ip_pressure import mark_of, readings
from cns.node.lanes import Lanes

SETTINGS = PressureSettings(enabled=True)


def nc(count: int) -> NetworkContainer:
    configs = tuple(IPConfig(f"ip-{i}", f"10.0.0.{i}", 1) for i in range(10, 10 + count))
    return NetworkContainer("nc1", ("10.0.0.2",), "10.0.0.0/24", "10.0.0.1", configs, 1, 1, "pods")


def test_the_lanes_read_as_free_exhausted_and_at_max_ip_count() -> None:
    lanes = Lanes(Pool(), config_scaler=Scaler(16, 50, 150, 4), cooldowns={}, cooldown_seconds=60)
    assert readings(lanes) == []  # no network yet: nothing to say
    lanes.primary.pool.apply_nc(nc(3))  # a primary address and 3 = maxIPCount 4
    lanes.primary.name = "pods"
    lanes.has_network.set()
    lanes.lane("other")  # a further lane with no network container: not read
    assert readings(lanes) == [
        LaneReading(subnet="pods", free=3, exhausted=False, at_max_ip_count=True)
    ]
    pool = lanes.primary.pool
    owners = [Owner(f"c{i}", "eth0", "", "") for i in range(3)]
    for owner in owners:
        pool.assign(owner)
    (full,) = readings(lanes)
    assert full.free == 0 and full.starving and full.cause is Cause.MAX_IP_COUNT
    pool.release(owners[0].key, cool_until=time.time() + 60)  # cooling down: free soon
    assert readings(lanes)[0].free == 1
    lanes.primary.exhausted = True
    assert readings(lanes)[0].exhausted


def test_the_condition_names_the_cause_in_the_kubelets_style() -> None:
    full = mark_of(Pressure(pressed=True, lanes=("pods",), cause=Cause.MAX_IP_COUNT), SETTINGS)
    assert (full.status, full.reason, full.tainted) == ("True", "MaxIPCountReached", True)
    assert "subnet pods" in full.message
    exhausted = mark_of(Pressure(pressed=True, lanes=("a",), cause=Cause.EXHAUSTED), SETTINGS)
    assert exhausted.reason == "SubnetExhausted"
    assert mark_of(Pressure(pressed=True), SETTINGS).reason == "SetBeforeRestart"
    fine = mark_of(Pressure(), SETTINGS)
    assert (fine.status, fine.reason, fine.tainted) == ("False", "PodIPsAvailable", False)
