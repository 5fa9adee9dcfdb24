"""The pool as the debug endpoint, the metrics and the summary line show it (cns/web/views.py): one
reading, the same figures in every view, in the shapes README "Observing it" documents."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cns.commands.status import ignored_text
from cns.core.pool import Pool
from cns.core.types import IgnoredContainer, IPConfig, NetworkContainer, Owner, PoolRequest, Scaler
from cns.node.control_plane import MemorySource, SourceState
from cns.node.service import NodeIPAM
from cns.state.store import Store
from cns.web import views
from cns.web.node_metrics import Metrics


def gauges(metrics: Metrics) -> dict[str, float]:
    """Every unlabelled sample, and cns_pool_ips by state as cns_pool_ips:<state>."""
    text = generate_latest(metrics.registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            state = sample.labels.get("state")
            found[sample.name + (f":{state}" if state else "")] = sample.value
    return found


async def test_debug_pool_metrics_and_summary_show_the_same_figures(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.open()
    in_text_order = sorted(range(8, 28), key=str)  # 10.1.0.10 ... 10.1.0.27, 10.1.0.8, 10.1.0.9
    configs = tuple(IPConfig(f"ip-{n}", f"10.1.0.{n}", 1) for n in in_text_order)
    nc = NetworkContainer("nc1", ("10.1.0.2",), "10.1.0.0/24", "10.1.0.1", configs, 1, 1)
    scaler = Scaler(batch_size=8, max_ip_count=64)
    ignored = (
        IgnoredContainer("nc2", "type", "overlay"),
        IgnoredContainer("nc3", "type", "overlay"),
    )
    source = MemorySource(
        SourceState((nc,), scaler=scaler, request=PoolRequest(20), pod_demand=3, ignored=ignored)
    )
    node = NodeIPAM(Pool(), store, source, Scaler(), 3600.0)
    running = asyncio.create_task(source.run(node.on_state))
    await node.has_network.wait()
    for n in range(5):
        await node.add(Owner(f"web-{n}", "eth0", f"web-{n}", "shop"))
    node.pool.mark_pending_release(2)
    metrics = Metrics()
    metrics.watch(node)

    pool, summary, measured = views.pool_view(node), views.summary(node), gauges(metrics)
    running.cancel()
    store.close()

    assert list(pool) == [
        "batchSize",
        "scalerBatchSize",
        "requestThresholdPercent",
        "releaseThresholdPercent",
        "maxIPCount",
        "minIPCount",
        "ipCooldownSeconds",
        "requestedIPCount",
        "targetIPCount",
        "ipsNotInUse",
        "primaryIPCount",
        "demand",
        "waitingAdds",
        "podDemand",
        "subnetExhausted",
        "subnetDraining",
        "ips",
        "leakCheck",
        "worldCheck",
        "networkContainers",
        "ignoredNetworkContainers",
    ]
    assert pool["ignoredNetworkContainers"] == [
        {"id": "nc2", "field": "type", "value": "overlay"},
        {"id": "nc3", "field": "type", "value": "overlay"},
    ]
    assert ignored_text(pool["ignoredNetworkContainers"]) == "nc2 type=overlay, nc3 type=overlay"
    assert ignored_text([]) == ignored_text(None) == "none"  # None: an older daemon
    labelled = [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for sample in family.samples
        if sample.name == "cns_network_containers_ignored"
    ]
    assert labelled == [({"field": "type", "value": "overlay"}, 2)]
    assert pool["leakCheck"] == {
        "enabled": False,
        "checks": 0,
        "runtimeError": None,
        "suspects": 0,
        "reclaimed": {},
    }
    counts = {
        "Available": 13,
        "Assigned": 5,
        "PendingRelease": 2,
        "PendingProgramming": 0,
        "Cooldown": 0,
    }
    assert pool["ips"] == counts
    assert summary == {
        **counts,
        "requestedIPCount": 20,
        "targetIPCount": pool["targetIPCount"],
        "demand": 5,
        "waitingAdds": 0,
        "subnetExhausted": False,
    }
    assert pool["targetIPCount"] == 8 * 2 - 1  # 8 * ceil(0.5 + 5 / 8) - 1 primary
    assert (pool["batchSize"], pool["maxIPCount"], pool["podDemand"]) == (8, 64, 3)
    assert pool["ipsNotInUse"] == ["ip-26", "ip-27"]
    for state, count in counts.items():
        assert measured[f"cns_pool_ips:{state}"] == count
    assert {
        "cns_requested_ip_count": measured["cns_requested_ip_count"],
        "cns_target_ip_count": measured["cns_target_ip_count"],
        "cns_primary_ip_count": measured["cns_primary_ip_count"],
        "cns_demand": measured["cns_demand"],
        "cns_waiting_adds": measured["cns_waiting_adds"],
        "cns_batch_size": measured["cns_batch_size"],
        "cns_max_ip_count": measured["cns_max_ip_count"],
        "cns_subnet_exhausted": measured["cns_subnet_exhausted"],
        "cns_subnet_draining": measured["cns_subnet_draining"],
    } == {
        "cns_requested_ip_count": pool["requestedIPCount"],
        "cns_target_ip_count": pool["targetIPCount"],
        "cns_primary_ip_count": pool["primaryIPCount"],
        "cns_demand": pool["demand"],
        "cns_waiting_adds": pool["waitingAdds"],
        "cns_batch_size": pool["batchSize"],
        "cns_max_ip_count": pool["maxIPCount"],
        "cns_subnet_exhausted": int(pool["subnetExhausted"]),
        "cns_subnet_draining": int(pool["subnetDraining"]),
    }
    addresses = [row["address"] for row in views.ips_view(node.pool)]
    assert addresses == [f"10.1.0.{n}" for n in range(8, 28)]  # in address order
