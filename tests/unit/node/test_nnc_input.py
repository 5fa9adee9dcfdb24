"""The control plane's data is input (issue 25, cases 1 to 3), without an API server: the one
parser of an NNC's network containers (`read_containers`), and a real NodeIPAM (pool, SQLite
store) told what a NodeNetworkConfig says as a container leaves it, comes back under another
id, or the whole NNC goes and comes back. The same cases on a real kube-apiserver with a
standalone daemon are in tests/integration/test_nnc_input_apiserver.py."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from cns.core.pool import Pool
from cns.core.types import (
    IgnoredContainer,
    IPConfig,
    IPState,
    NetworkContainer,
    Owner,
    OwnerKey,
    Scaler,
)
from cns.kube.nnc_containers import ignored_containers, network_containers, read_containers
from cns.node.control_plane import FurtherSubnetState, MemorySource, SourceState
from cns.node.errors import IPAMError
from cns.node.service import NodeIPAM
from cns.state.store import Store
from tests.unit.node.test_lanes import make

# --------------------------------------------------------------------------- the parser


def wire_nc(**fields: Any) -> dict[str, Any]:
    """A valid container of 10.70.0.0/24 as the controller writes it, `fields` changed."""
    nc = {
        "id": "nc-a",
        "primaryIP": "10.70.0.4",
        "subnetName": "pods",
        "subnetAddressSpace": "10.70.0.0/24",
        "defaultGateway": "10.70.0.1",
        "version": 1,
        "ipAssignments": [{"name": "ip-5", "ip": "10.70.0.5"}, {"name": "ip-6", "ip": "10.70.0.6"}],
    }
    nc.update(fields)
    return nc


def nnc(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "n1"}, "status": {"networkContainers": list(containers)}}


def test_a_valid_container_is_read_as_it_is() -> None:
    (nc,) = network_containers(nnc(wire_nc(primaryIP="10.70.0.4/32")))
    assert (nc.id, nc.subnet, nc.primary_ips, nc.gateway) == (
        "nc-a",
        "10.70.0.0/24",
        ("10.70.0.4",),  # a prefix form is read as its address
        "10.70.0.1",
    )
    assert [(c.id, c.address) for c in nc.ip_configs] == [
        ("ip-5", "10.70.0.5"),
        ("ip-6", "10.70.0.6"),
    ]
    assert ignored_containers(nnc(wire_nc())) == ()


BAD_CONTAINERS = [
    # field, value, reason: each leaves the whole container out
    ("subnetAddressSpace", "10.70.0.5/24", "has host bits set (not the subnet's own address)"),
    ("subnetAddressSpace", "10.70.0.0", "not a prefix (address/length)"),
    ("subnetAddressSpace", "garbage/24", "not a prefix (address/length)"),
    ("subnetAddressSpace", 7, "not a prefix (address/length)"),
    ("id", "", "not a non-empty string"),
    ("id", 42, "not a non-empty string"),
    ("primaryIP", "10.71.0.4", "outside the subnet"),
    ("primaryIP", "fd00::4", "outside the subnet"),
    ("primaryIP", "garbage", "not an address"),
    ("defaultGateway", "10.70.0.0", "the subnet's network address"),
    ("defaultGateway", "10.70.0.255", "the subnet's broadcast address"),
    ("defaultGateway", "10.71.0.1", "outside the subnet"),
    ("defaultGateway", "10.70.0.1/24", "not an address"),
    ("version", "x", "not a whole number of at least 0"),
]


@pytest.mark.parametrize(("field", "value", "reason"), BAD_CONTAINERS)
def test_an_invalid_container_is_left_out_whole_with_its_reason(
    field: str, value: Any, reason: str
) -> None:
    bad = wire_nc(**{field: value})
    containers, ignored = read_containers(nnc(bad, wire_nc(id="nc-b", subnetName="other")))
    assert [nc.id for nc in containers] == ["nc-b"]  # the other container is used
    shown = bad["id"] if isinstance(bad["id"], str) else str(bad["id"])
    assert ignored == (IgnoredContainer(shown, field, str(value), reason),)
    assert ignored[0].whole_container


BAD_ASSIGNMENTS = [
    # ip, reason: each leaves that one assignment out
    ("garbage", "not an address"),
    ("10.70.0.999", "not an address"),
    ("10.70.0.30/32", "not an address"),
    ("", "not an address"),
    ("10.71.0.9", "outside the subnet"),
    ("fd00::9", "outside the subnet"),
    ("10.70.0.0", "the subnet's network address"),
    ("10.70.0.255", "the subnet's broadcast address"),
    ("10.70.0.4", "the container's primary IP"),
    ("10.70.0.1", "the container's gateway"),
    ("10.70.0.5", "listed twice"),
]


@pytest.mark.parametrize(("ip", "reason"), BAD_ASSIGNMENTS)
def test_an_invalid_assignment_is_left_out_with_its_reason(ip: str, reason: str) -> None:
    wire = wire_nc()
    wire["ipAssignments"].append({"name": "bad", "ip": ip})
    containers, ignored = read_containers(nnc(wire))
    (nc,) = containers  # the rest of the container is used
    assert [c.address for c in nc.ip_configs] == ["10.70.0.5", "10.70.0.6"]
    assert ignored == (IgnoredContainer("nc-a", "ipAssignments.ip", ip, reason, "bad"),)
    assert not ignored[0].whole_container


@pytest.mark.parametrize(
    ("entry", "field", "reason"),
    [
        ({"name": "", "ip": "10.70.0.9"}, "ipAssignments.name", "not a non-empty string"),
        ({"ip": "10.70.0.9"}, "ipAssignments.name", "not a non-empty string"),
        ({"name": "ip-5", "ip": "10.70.0.9"}, "ipAssignments.name", "listed twice"),
        ("10.70.0.9", "ipAssignments", "not an object"),
    ],
)
def test_an_assignment_without_a_usable_name_is_left_out(
    entry: Any, field: str, reason: str
) -> None:
    wire = wire_nc()
    wire["ipAssignments"].append(entry)
    containers, ignored = read_containers(nnc(wire))
    assert [c.address for c in containers[0].ip_configs] == ["10.70.0.5", "10.70.0.6"]
    assert [(i.field, i.reason) for i in ignored] == [(field, reason)]


def test_ipv6_addresses_are_read_canonical_and_small_subnets_keep_every_address() -> None:
    six = wire_nc(
        subnetAddressSpace="fd00::/64",
        primaryIP="fd00::4",
        defaultGateway="fd00::1",
        ipAssignments=[
            {"name": "a", "ip": "FD00::0005"},
            {"name": "b", "ip": "fd00::5"},
            {"name": "c", "ip": "fd00::"},
        ],
    )
    (nc,), ignored = read_containers(nnc(six))
    assert [c.address for c in nc.ip_configs] == ["fd00::5"]
    assert [(i.value, i.reason) for i in ignored] == [
        ("fd00::5", "listed twice"),
        ("fd00::", "the subnet's network address"),
    ]
    # A /31 has no network or broadcast address to keep out (RFC 3021).
    pair = wire_nc(
        subnetAddressSpace="10.70.0.0/31",
        primaryIP="10.70.0.0",
        defaultGateway="",
        ipAssignments=[{"name": "a", "ip": "10.70.0.1"}],
    )
    assert [c.address for c in network_containers(nnc(pair))[0].ip_configs] == ["10.70.0.1"]


def test_a_parsed_listing_is_checked_too_and_kept_when_valid() -> None:
    """The controller's cache holds IP configs already parsed (`slim_nnc`): the same checks,
    and the very tuple back when nothing is left out (the planning state shares it)."""
    good = (IPConfig("ip-5", "10.70.0.5"), IPConfig("ip-6", "10.70.0.6"))
    (nc,) = network_containers(nnc(wire_nc(ipAssignments=good)))
    assert nc.ip_configs is good
    for extra in ("garbage", "10.70.0.5", "10.70.0.4", "10.70.0.1", "10.70.0.255", "10.71.0.1"):
        bad = (*good, IPConfig("ip-7", extra))
        (nc,), ignored = read_containers(nnc(wire_nc(ipAssignments=bad)))
        assert nc.ip_configs == good and [i.value for i in ignored] == [extra]
    (nc,), ignored = read_containers(
        nnc(wire_nc(ipAssignments=(*good, IPConfig("ip-5", "10.70.0.7"))))
    )
    assert nc.ip_configs == good and [i.reason for i in ignored] == ["listed twice"]


def test_a_huge_rejected_value_is_shown_cut_short() -> None:
    wire = wire_nc()
    wire["ipAssignments"].append({"name": "bad", "ip": "x" * 100_000})
    (ignored,) = ignored_containers(nnc(wire))
    assert len(ignored.value) < 300 and ignored.value.endswith("...")


def test_nothing_in_a_hostile_status_raises() -> None:
    for junk in (None, 5, "x", [], {}, [None], [{"id": None}], [{"ipAssignments": 5}]):
        status = {"networkContainers": junk} if junk is not None else None
        read_containers({"status": status})
    read_containers(nnc(wire_nc(ipAssignments=[{"name": "n", "ip": ["10.70.0.5"]}])))


# --------------------------------------------------------------------------- the node

HOUR = 3600.0


def listing(nc_id: str, numbers: Iterable[int], *, ids: str = "ip") -> NetworkContainer:
    """Container `nc_id` of 10.1.0.0/24 listing 10.1.0.<n>, named <ids>-<n>."""
    configs = tuple(IPConfig(f"{ids}-{n}", f"10.1.0.{n}", 1) for n in numbers)
    return NetworkContainer(nc_id, ("10.1.0.2",), "10.1.0.0/24", "10.1.0.1", configs, 1, 1, "pods")


def six(nc_id: str, numbers: Iterable[int], *, ids: str = "ip6") -> NetworkContainer:
    configs = tuple(IPConfig(f"{ids}-{n}", f"fd00::{n:x}", 1) for n in numbers)
    return NetworkContainer(nc_id, ("fd00::2",), "fd00::/64", "fd00::1", configs, 1, 1, "v6pods")


def rows(path: Path) -> dict[str, tuple[str, str, str]]:
    """The state file's assignments, read from disk by a store of its own."""
    store = Store(path)
    try:
        store.open()
        return {i: (a.address, a.nc_id, a.owner.container_id) for i, a in store.assignments.items()}
    finally:
        store.close()


def free(ipam: NodeIPAM) -> dict[str, str]:
    """Address -> NC id of every IP an ADD could get now."""
    return {
        r.address: r.nc_id
        for lane in ipam.lanes.values()
        for r in lane.pool.records.values()
        if r.state is IPState.AVAILABLE
    }


@pytest.mark.parametrize("renamed", [False, True], ids=["same-ip-ids", "new-ip-ids"])
async def test_a_container_whose_id_changes_is_withdrawn_and_its_held_ips_rehomed(
    tmp_path: Path, renamed: bool
) -> None:
    """Case 2: the same addresses under a new container id (and new IP ids, or the same). On
    the old code the old container's free IPs stayed Available beside the new container's
    (the same addresses twice, or under the old id), and the held ones were `skipped`."""
    path = tmp_path / "state.db"
    ipam = make(path, SourceState((listing("nc-old", range(10, 14)),)))
    a = await ipam.add(Owner("c1", "eth0", "a", "shop"))
    b = await ipam.add(Owner("c2", "eth0", "b", "shop"))
    held = {a.record.address, b.record.address}
    ipam.on_state(SourceState((listing("nc-new", range(10, 14), ids="new" if renamed else "ip"),)))
    assert free(ipam) == {"10.1.0.12": "nc-new", "10.1.0.13": "nc-new"}
    assert ipam.pool.network_container("nc-old") is None  # nothing of it is left
    await ipam.store.flush()
    prefix = "new" if renamed else "ip"
    assert rows(path) == {
        f"{prefix}-10": ("10.1.0.10", "nc-new", "c1"),
        f"{prefix}-11": ("10.1.0.11", "nc-new", "c2"),
    }
    again = await ipam.add(Owner("c1", "eth0", "a", "shop"))  # the same answer, the new NC
    assert (again.record.address, again.network.id) == (a.record.address, "nc-new")
    others = [await ipam.add(Owner(f"c{i}", "eth0")) for i in (3, 4)]
    assert {r.record.address for r in others} == {"10.1.0.12", "10.1.0.13"}
    assert held.isdisjoint(r.record.address for r in others)
    assert ipam.inconsistencies_total == 0
    ipam.store.close()


async def test_a_container_that_leaves_the_list_hands_out_nothing_more(tmp_path: Path) -> None:
    """Case 2: the container is removed from the NNC. Its free IPs leave at once, a held one
    stays with its pod until DEL and is then dropped, not handed out again. On the old code
    both free IPs stayed Available, and the DEL made the held one Available too."""
    path = tmp_path / "state.db"
    ipam = make(path, SourceState((listing("nc-a", range(10, 13)),)), timeout=0.0)
    a = await ipam.add(Owner("c1", "eth0", "a", "shop"))
    ipam.on_state(SourceState(()))
    assert free(ipam) == {}
    with pytest.raises(IPAMError) as refused:
        await ipam.add(Owner("c2", "eth0"))
    assert refused.value.code == 11
    assert ipam.pool.lookup(OwnerKey("c1", "eth0")) is a.record  # the pod keeps its address
    assert (await ipam.add(Owner("c1", "eth0", "a", "shop"))).network.id == "nc-a"
    ipam.release(OwnerKey("c1", "eth0"), reason="cni-del")
    assert free(ipam) == {} and not ipam.pool.records and not ipam.pool.withdrawn
    await ipam.store.flush()
    assert rows(path) == {}
    ipam.on_state(SourceState((listing("nc-a", range(10, 13)),)))  # listed again: usable
    assert set(free(ipam)) == {"10.1.0.10", "10.1.0.11", "10.1.0.12"}
    ipam.store.close()


async def test_an_assigned_ip_left_out_of_its_container_is_dropped_at_its_del(
    tmp_path: Path,
) -> None:
    """The container stays but no longer lists a held IP: kept until DEL, then dropped (the
    old code made it Available at the DEL, until the next update dropped it)."""
    ipam = make(tmp_path / "state.db", SourceState((listing("nc-a", range(10, 12)),)))
    a = await ipam.add(Owner("c1", "eth0"))
    rest = sorted({"10.1.0.10", "10.1.0.11"} - {a.record.address})
    ipam.on_state(SourceState((listing("nc-a", [int(r.split(".")[-1]) for r in rest]),)))
    ipam.release(OwnerKey("c1", "eth0"), reason="cni-del")
    assert set(free(ipam)) == set(rest)
    ipam.store.close()


async def test_a_gone_nnc_withdraws_everything_and_asks_for_what_the_pods_hold(
    tmp_path: Path,
) -> None:
    """Case 1, the node: the NNC is deleted (`gone`). Nothing is handed out, each lane asks
    for the addresses its pods hold (the primary's `requestedIPs`, the further subnet's own
    entry), and when the re-created NNC lists them again, under other ids and containers,
    the pods keep them and the state file follows."""
    path = tmp_path / "state.db"
    first = SourceState(
        (listing("nc4", range(10, 14)),),
        subnets={"v6pods": FurtherSubnetState((six("nc6", range(16, 19)),))},
    )
    ipam = make(path, first, timeout=0.0)
    both = ("pods", "v6pods")
    a = await ipam.add(Owner("c1", "eth0", "a", "shop"), subnets=both)
    b = await ipam.add(Owner("c2", "eth0", "b", "shop"))
    held4 = {a.ips[0][0].address, b.record.address}
    held6 = {a.ips[1][0].address}

    ipam.on_state(SourceState((), gone=True))
    assert free(ipam) == {}
    assert not ipam.lanes["v6pods"].removed  # asked for still, not drained
    for subnets in ((), both, ("v6pods",)):
        with pytest.raises(IPAMError):
            await ipam.add(Owner("c9", "eth0"), subnets=subnets)
    assert await ipam.reconcile_once() is not None
    source = ipam.source
    assert isinstance(source, MemorySource)
    assert set(source.published[-1].requested_ips) == held4
    assert set(source.published_subnets[-1]["v6pods"].requested_ips) == held6

    # Re-created and granted: the held addresses under new ids and containers.
    granted = SourceState(
        (listing("nc4-new", [int(x.split(".")[-1]) for x in held4], ids="g"),),
        subnets={
            "v6pods": FurtherSubnetState(
                (six("nc6-new", [int(x.split(":")[-1], 16) for x in held6], ids="g6"),)
            )
        },
    )
    ipam.on_state(granted)
    assert free(ipam) == {}
    again = await ipam.add(Owner("c1", "eth0", "a", "shop"), subnets=both)
    assert [(r.address, nc.id) for r, nc in again.ips] == [
        (a.ips[0][0].address, "nc4-new"),
        (a.ips[1][0].address, "nc6-new"),
    ]
    await ipam.store.flush()
    assert {v[1] for v in rows(path).values()} == {"nc4-new", "nc6-new"}
    assert {v[0] for v in rows(path).values()} == held4 | held6
    await ipam.reconcile_once()
    assert source.published[-1].requested_ips == ()  # listed again: nothing more to ask
    ipam.store.close()


async def test_a_restart_after_the_nnc_went_drops_a_released_address(tmp_path: Path) -> None:
    """An assignment restored from the state file whose container is never listed again is
    dropped at its DEL, never made Available."""
    path = tmp_path / "state.db"
    ipam = make(path, SourceState((listing("nc-a", range(10, 12)),)))
    await ipam.add(Owner("c1", "eth0"))
    await ipam.store.flush()
    ipam.store.close()
    store = Store(path)
    pool = Pool()
    for assignment in store.open():
        pool.restore(assignment)
    restarted = NodeIPAM(pool, store, MemorySource(SourceState(())), Scaler(), HOUR)
    restarted.on_state(SourceState((listing("nc-b", range(20, 22)),)))
    restarted.release(OwnerKey("c1", "eth0"), reason="cni-del")
    assert set(free(restarted)) == {"10.1.0.20", "10.1.0.21"}
    store.close()


def test_the_checked_form_is_what_the_controller_reads() -> None:
    """The controller's NodeView of an NNC with a rejected entry: the rest, as the node."""
    from cns.controller.state import node_view
    from cns.core.subnet import Subnet

    wire = wire_nc()
    wire["ipAssignments"].append({"name": "bad", "ip": "garbage"})
    view = node_view(Subnet("pods", "10.70.0.0/24"), copy.deepcopy(nnc(wire)))
    assert view.nc is not None
    assert [c.address for c in view.nc.ip_configs] == ["10.70.0.5", "10.70.0.6"]


async def test_a_gone_nnc_is_asked_for_again_even_with_no_pod_holding_an_address(
    tmp_path: Path,
) -> None:
    """The plan would equal what the node sent last, but the control plane heard nothing of
    the node once its NNC is gone: the node publishes (its source re-creates the NNC)."""
    ipam = make(tmp_path / "state.db", SourceState((listing("nc-a", range(10, 12)),)))
    await ipam.reconcile_once()
    assert await ipam.reconcile_once() is None  # nothing new to say
    ipam.on_state(SourceState((), gone=True))
    published = await ipam.reconcile_once()
    assert published is not None and published.requested_ips == ()
    ipam.store.close()
