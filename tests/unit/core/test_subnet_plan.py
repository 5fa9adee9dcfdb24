"""The reference control plane's pure planner: fulfilment, releases, scarcity, safety."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core import subnet_plan as plan_module
from cns.core.allocation import Entry, apply_changes, block_index
from cns.core.scaling import next_request, reserved_once_cleared
from cns.core.subnet import Subnet
from cns.core.subnet_model import SubnetModel
from cns.core.subnet_plan import NodeView, Plan, plan_round, plan_subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, Scaler, SubnetStatus
from cns.kube.cluster_subnet import cluster_subnet, cluster_subnet_status
from cns.kube.scalers import merge_scalers, scaler_to_wire

SUBNET = Subnet("pods", "10.10.0.0/24", reserved_ips=frozenset({"10.10.0.250"}))


IDS = itertools.count()  # unique across rounds, as the controller's uuids are


def run(
    subnet: Subnet,
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]],
    previous: SubnetStatus | None = None,
    seed: int = 0,
    record: dict[str, Entry] | None = None,
) -> Plan:
    """One round as a single writer runs it: every record write lands, and `record` (when
    given) is brought up to date with the round's changes."""
    views = [NodeView(name, nc, request) for name, (nc, request) in sorted(nodes.items())]
    plan = plan_subnet(
        subnet,
        views,
        {} if record is None else record,
        previous or SubnetStatus(),
        random.Random(seed),
        lambda: f"id{next(IDS)}",
    )
    if record is not None:
        apply_changes(record, plan.record)
    return plan


def addresses(nc: NetworkContainer) -> set[str]:
    return {*nc.primary_ips, *(c.address for c in nc.ip_configs)}


def test_new_node_gets_an_empty_network_container_first() -> None:
    plan = run(SUBNET, {"n1": (None, PoolRequest(0))})
    nc = plan.changed["n1"]
    assert nc.primary_ips == ("10.10.0.2",) and nc.ip_configs == () and nc.version == 1
    assert nc.gateway == "10.10.0.1" and nc.subnet == "10.10.0.0/24"


def test_request_is_granted_in_one_round_and_version_bumps_once() -> None:
    first = run(SUBNET, {"n1": (None, PoolRequest(15))}).changed["n1"]
    assert len(first.ip_configs) == 15 and first.version == 1
    second = run(SUBNET, {"n1": (first, PoolRequest(31))}).changed["n1"]
    assert len(second.ip_configs) == 31 and second.version == 2
    assert second.ip_configs[:15] == first.ip_configs  # existing IPs untouched
    assert run(SUBNET, {"n1": (second, PoolRequest(31))}).changed == {}  # fixed point


def test_released_ips_leave_and_are_not_reused_in_the_same_round() -> None:
    nc = run(SUBNET, {"a": (None, PoolRequest(4))}).changed["a"]
    released = tuple(c.id for c in nc.ip_configs[:2])
    gone = {c.address for c in nc.ip_configs[:2]}
    plan = run(SUBNET, {"a": (nc, PoolRequest(2, released)), "b": (None, PoolRequest(250))})
    assert {c.id for c in plan.changed["a"].ip_configs}.isdisjoint(released)
    assert plan.changed["a"].version == nc.version + 1
    assert gone.isdisjoint(addresses(plan.changed["b"]))


def test_scarce_ips_are_divided_by_shortfall_and_never_over_granted() -> None:
    tiny = Subnet("tiny", "10.20.0.0/28")  # 14 hosts, gateway -> 13 usable
    plan = run(tiny, {n: (None, PoolRequest(r)) for n, r in (("a", 20), ("b", 10), ("c", 0))})
    primaries = 3
    granted = plan.granted
    assert sum(granted.values()) == 13 - primaries
    assert granted["a"] > granted["b"] > 0 and "c" not in granted
    assert plan.short_of == 30 - sum(granted.values())
    every = [addr for nc in plan.changed.values() for addr in addresses(nc)]
    assert len(every) == len(set(every)) == 13


def test_exhaustion_and_batch_follow_utilization_with_hysteresis() -> None:
    subnet = Subnet("s", "10.30.0.0/24", upper_percent=80, lower_percent=40)
    plan = run(subnet, {"a": (None, PoolRequest(230))})
    assert plan.status.exhausted and plan.status.reserved == 231
    nc = plan.changed["a"]
    keep = PoolRequest(150, tuple(c.id for c in nc.ip_configs[150:]))
    still = run(subnet, {"a": (nc, keep)}, plan.status)
    assert still.status.exhausted  # 151 of 253 is under 80 % but above 40 %
    nc = still.changed["a"]
    low = PoolRequest(50, tuple(c.id for c in nc.ip_configs[50:]))
    assert not run(subnet, {"a": (nc, low)}, still.status).status.exhausted
    assert 1 <= plan.status.batch <= subnet.max_batch


# One block, and four blocks (the grants' choice of blocks, and scarce with 5 nodes at 300).
BOOKING = [
    Subnet("s", "10.40.0.0/25", reserved_ips=frozenset({"10.40.0.100"})),
    Subnet("s", "10.40.0.0/22", reserved_ips=frozenset({"10.40.1.0", "10.40.2.77"})),
]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(BOOKING),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 300), st.booleans()), max_size=40),
)
def test_no_address_is_ever_in_two_containers(
    subnet: Subnet, steps: list[tuple[int, int, bool]]
) -> None:
    """Nodes change requests and release IPs in any order; the planner never double-books,
    whichever blocks it grants from and whenever it frees what was released."""
    rng = random.Random(1)
    state: dict[str, tuple[NetworkContainer | None, PoolRequest]] = {
        f"n{i}": (None, PoolRequest(0)) for i in range(5)
    }
    status = SubnetStatus()
    record: dict[str, Entry] = {}
    for node_index, asked, release in steps:
        request = asked * subnet.capacity // 500  # up to 0.6 of the subnet a node
        name = f"n{node_index}"
        nc, _ = state[name]
        held = nc.ip_configs if nc else ()
        releasing = tuple(c.id for c in held[request:]) if release else ()
        state[name] = (nc, PoolRequest(request, releasing))
        plan = run(subnet, state, status, seed=rng.randrange(1000), record=record)
        status = plan.status
        assert not plan.duplicates and not plan.conflicts and not plan.release_requests
        for changed, new_nc in plan.changed.items():
            state[changed] = (new_nc, PoolRequest(state[changed][1].requested_ip_count))
        every = [addr for nc, _ in state.values() if nc for addr in addresses(nc)]
        assert len(every) == len(set(every))
        usable = set(subnet.usable())
        assert set(every) <= usable
        assert status.reserved == len(every) <= subnet.capacity
        # With one writer the record and the containers agree, entry for entry.
        live = {a: e.node for a, e in record.items() if not e.releasing}
        assert live == {a: n for n, (nc, _) in state.items() if nc for a in addresses(nc)}


# --------------------------------------------------------------------- the allocation record

SMALL = Subnet("small", "10.50.0.0/28")  # 10.50.0.1 gateway, .2-.14 usable


def nc(name: str, primary: str, *configs: tuple[str, str], version: int = 1) -> NetworkContainer:
    return NetworkContainer(
        id=f"nc-{name}",
        primary_ips=(primary,),
        subnet=str(SMALL.network),
        gateway=SMALL.gateway_address,
        ip_configs=tuple(IPConfig(i, a) for i, a in configs),
        version=version,
        programmed_version=version,
    )


def plan_with(
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]],
    record: dict[str, Entry],
    current_uids: dict[str, str | None] | None = None,
    uids: dict[str, str] | None = None,
    nodes_gone: frozenset[str] | set[str] = frozenset(),
) -> Plan:
    views = [
        NodeView(name, c, request, (uids or {}).get(name, ""))
        for name, (c, request) in sorted(nodes.items())
    ]
    return plan_subnet(
        SMALL,
        views,
        record,
        SubnetStatus(),
        random.Random(0),
        lambda: f"id{next(IDS)}",
        current_uids,
        nodes_gone,
    )


def test_containers_from_before_the_record_are_adopted() -> None:
    plan = plan_with({"a": (nc("a", "10.50.0.2", ("x", "10.50.0.3")), PoolRequest(1))}, {})
    assert plan.record == {
        "10.50.0.2": Entry("a", "nc-a", primary=True),
        "10.50.0.3": Entry("a", "x"),
    }
    assert not plan.duplicates and not plan.conflicts and not plan.node_changes


def test_an_address_in_two_containers_is_reported_and_both_nodes_are_asked() -> None:
    nodes = {
        "a": (nc("a", "10.50.0.2", ("x", "10.50.0.4")), PoolRequest(1)),
        "b": (nc("b", "10.50.0.3", ("y", "10.50.0.4")), PoolRequest(1)),
        "c": (nc("c", "10.50.0.5"), PoolRequest(12)),
    }
    plan = plan_with(nodes, {})
    assert plan.duplicates == {"10.50.0.4": ("a", "b")}
    assert plan.release_requests == {"a": ("x",), "b": ("y",)}
    assert "10.50.0.4" not in plan.record  # nobody's until one of them gives it up
    granted = [c.address for change in plan.node_changes.values() for c in change.additions]
    assert "10.50.0.4" not in granted
    assert len(granted) == len(set(granted)) == 9  # 13 usable - 3 primaries - the duplicate


def test_an_address_listed_against_the_record_is_a_conflict_and_not_completed() -> None:
    record = {
        "10.50.0.2": Entry("a", "nc-a", primary=True),
        "10.50.0.3": Entry("b", "nc-b", primary=True),
        "10.50.0.4": Entry("b", "q"),  # granted to b, b's write did not land yet
    }
    nodes = {
        "a": (nc("a", "10.50.0.2", ("x", "10.50.0.4")), PoolRequest(1)),
        "b": (nc("b", "10.50.0.3"), PoolRequest(1)),
    }
    plan = plan_with(nodes, record)
    assert plan.conflicts == {"10.50.0.4": ("a", "b")}
    assert plan.release_requests == {"a": ("x",)}
    assert "b" not in plan.changed  # completing it would put 10.50.0.4 on two nodes
    # Once a has given it up, b's grant is completed.
    nodes["a"] = (nc("a", "10.50.0.2", version=2), PoolRequest(0))
    plan = plan_with(nodes, record)
    assert [c.address for c in plan.changed["b"].ip_configs] == ["10.50.0.4"]
    assert plan.additions == {"10.50.0.4"}


def test_a_release_is_marked_first_and_freed_once_the_container_no_longer_lists_it() -> None:
    record = {"10.50.0.2": Entry("a", "nc-a", primary=True), "10.50.0.3": Entry("a", "x")}
    listed = nc("a", "10.50.0.2", ("x", "10.50.0.3"))
    plan = plan_with({"a": (listed, PoolRequest(0, ("x",)))}, record)
    assert plan.record == {"10.50.0.3": Entry("a", "x", releasing=True)}
    change = plan.node_changes["a"]
    assert change.removals == ((IPConfig("x", "10.50.0.3"), True),)
    # The record write refused: the address stays in the container.
    assert change.container(lambda address: address != "10.50.0.3") is None
    assert change.container().ip_configs == ()  # type: ignore[union-attr]
    apply_changes(record, plan.record)
    after = plan_with({"a": (nc("a", "10.50.0.2", version=2), PoolRequest(0))}, record)
    assert after.record == {"10.50.0.3": None}


def test_a_release_of_an_earlier_grant_of_the_same_address_marks_nothing() -> None:
    """ipsNotInUse names the grant by id: an id the record does not hold for that address (an
    earlier grant of it) must not release the current one."""
    record = {"10.50.0.2": Entry("a", "nc-a", primary=True), "10.50.0.3": Entry("a", "new")}
    listed = nc("a", "10.50.0.2", ("old", "10.50.0.3"))
    plan = plan_with({"a": (listed, PoolRequest(0, ("old",)))}, record)
    assert "10.50.0.3" not in plan.record  # not marked releasing
    assert plan.node_changes["a"].removals == ((IPConfig("old", "10.50.0.3"), False),)


def test_a_deleted_nncs_addresses_stay_with_its_live_node_and_are_freed_once_the_node_is_gone() -> (
    None
):
    """Addresses belong to the node, not to one NNC object: its pods may still use them after
    `kubectl delete nnc`. So they are kept while the Node object exists, also when another node
    is short of exactly those addresses, and freed only once a direct read finds the Node gone."""
    configs = [(f"b{i}", f"10.50.0.{i}") for i in range(5, 15)]
    b = nc("b", "10.50.0.4", *configs)
    record = {
        "10.50.0.2": Entry("a", "nc-a", primary=True, uid="u1"),
        "10.50.0.3": Entry("a", "x", uid="u1"),
        "10.50.0.4": Entry("b", "nc-b", primary=True, uid="ub"),
        **{address: Entry("b", name, uid="ub") for name, address in configs},
    }
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]] = {"b": (b, PoolRequest(12))}
    unconfirmed = plan_with(nodes, record, uids={"b": "ub"})
    kept = plan_with(nodes, record, current_uids={"a": None}, uids={"b": "ub"})
    for plan in (unconfirmed, kept):
        assert plan.record == {} and plan.node_changes == {}
    assert kept.kept == {"a": 2} and kept.short_of == 2
    left = plan_with(nodes, record, current_uids={"a": None}, uids={"b": "ub"}, nodes_gone={"a"})
    assert left.left == {"a": 2}
    granted = {c.address for c in left.changed["b"].ip_configs[10:]}
    assert granted == {"10.50.0.2", "10.50.0.3"}  # free again, and granted
    assert {left.record[a].node for a in granted} == {"b"}  # type: ignore[union-attr]


def test_a_replaced_nncs_addresses_move_to_the_new_object_under_the_same_ids() -> None:
    """An NNC deleted and created again under its name is a new object (a new uid). Once a
    direct read confirms it, the old object's entries move to the new one (the record write
    first, under the same ids) and are completed into it: the container comes back with the
    same id and primary IP, its IP configs with the same names. Until then the node gets
    nothing new: no second container, no grants."""
    record = {
        "10.50.0.2": Entry("a", "nc-old", primary=True, uid="old"),
        "10.50.0.3": Entry("a", "x", uid="old"),
    }
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]] = {"a": (None, PoolRequest(1))}
    waiting = plan_with(nodes, record, uids={"a": "new"})
    assert waiting.record == {} and waiting.node_changes == {}
    moved = plan_with(nodes, record, current_uids={"a": "new"}, uids={"a": "new"})
    assert moved.record == {a: replace(e, uid="new") for a, e in record.items()}
    assert moved.moved == {"a": 2} and moved.granted == {}
    assert moved.additions == {"10.50.0.2", "10.50.0.3"}  # their block writes come first
    change = moved.node_changes["a"]
    assert change.container(lambda address: False) is None
    back = change.container()
    assert back is not None and (back.id, back.primary_ips) == ("nc-old", ("10.50.0.2",))
    assert back.ip_configs == (IPConfig("x", "10.50.0.3"),)


def test_a_grant_is_never_completed_into_an_object_whose_uid_it_does_not_carry() -> None:
    """A writer whose cache still shows an NNC object that is gone (uid "new") while a direct
    read finds a newer one ("newer"): the entries move to the object that exists now, and
    nothing is written into the one the cache shows (that write could only be refused, and the
    stale writer's plan must not depend on it)."""
    record = {
        "10.50.0.2": Entry("a", "nc-old", primary=True, uid="old"),
        "10.50.0.3": Entry("a", "x", uid="old"),
    }
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]] = {"a": (None, PoolRequest(3))}
    plan = plan_with(nodes, record, current_uids={"a": "newer"}, uids={"a": "new"})
    assert {e.uid for e in plan.record.values() if e is not None} == {"newer"}
    assert plan.node_changes == {} and plan.granted == {}


def test_addresses_a_new_nnc_asks_for_that_the_record_holds_for_its_node_are_its_own() -> None:
    """The daemon re-creates its deleted NNC asking by name (`requestedIPs`) for the addresses
    its pods hold: the record still holds them for the node under the old object's uid. They
    are the node's own: moved and completed under their ids, never asked back or reported."""
    record = {
        "10.50.0.2": Entry("a", "nc-a", primary=True, uid="old"),
        "10.50.0.3": Entry("a", "x", uid="old"),
        "10.50.0.4": Entry("a", "y", uid="old"),
    }
    request = PoolRequest(2, (), ("10.50.0.3", "10.50.0.4"))
    nodes: dict[str, tuple[NetworkContainer | None, PoolRequest]] = {"a": (None, request)}
    plan = plan_with(nodes, record, current_uids={"a": "new"}, uids={"a": "new"})
    assert not plan.release_requests and not plan.conflicts and not plan.duplicates
    assert plan.granted == {}
    back = plan.changed["a"]
    assert back.ip_configs == (IPConfig("x", "10.50.0.3"), IPConfig("y", "10.50.0.4"))


def test_unconfirmed_grants_are_left_out_of_the_container() -> None:
    plan = plan_with({"a": (nc("a", "10.50.0.2"), PoolRequest(3))}, {})
    change = plan.node_changes["a"]
    granted = [c.address for c in change.additions]
    assert granted == ["10.50.0.3", "10.50.0.4", "10.50.0.5"]
    partial = change.container(lambda address: address != "10.50.0.4")
    assert partial is not None and [c.address for c in partial.ip_configs] == [
        "10.50.0.3",
        "10.50.0.5",
    ]
    assert change.container(lambda address: False) is None
    # A new container waits for its primary IP's record write.
    fresh = plan_with({"b": (None, PoolRequest(0))}, {}).node_changes["b"]
    assert fresh.container(lambda address: False) is None
    assert fresh.container() is not None


@pytest.mark.parametrize(
    ("overrides", "thresholds"),
    [
        (None, (50, 150)),
        ({"requestThresholdPercent": 25, "releaseThresholdPercent": 200}, (25, 200)),
        ({"batchSize": 4, "releaseThresholdPercent": 300}, (50, 300)),
        # 0 is ignored and 100 is then below mf + 100: the scaler is refused and the nodes use
        # the default. Read raw, the controller took mf = 0, Mf = 100 and sized its grow bound
        # for b + 1 free IPs a node where the nodes keep up to 1.5 b.
        ({"requestThresholdPercent": 0, "releaseThresholdPercent": 100}, (50, 150)),
    ],
)
def test_the_controller_assumes_the_thresholds_the_nodes_use(
    overrides: dict[str, int] | None, thresholds: tuple[int, int]
) -> None:
    """The phase-4 batch grows only as far as the nodes' request and release thresholds allow,
    so the controller must take them from the same merge as the nodes: `spec.scaler` over the
    default, then the `status.scaler` it publishes."""
    cs = {
        "metadata": {"name": "pods"},
        "spec": {"subnet": "10.10.0.0/24", **({"scaler": overrides} if overrides else {})},
    }
    default = Scaler()
    subnet = cluster_subnet(cs, default)
    assert (subnet.request_threshold_percent, subnet.release_threshold_percent) == thresholds
    published = scaler_to_wire(merge_scalers(default, overrides, {"batchSize": 8}))
    on_a_node = merge_scalers(default, overrides, published, published)
    assert thresholds == (on_a_node.request_threshold_percent, on_a_node.release_threshold_percent)


def test_a_warm_floor_set_on_the_subnet_reaches_the_nodes_and_the_batch_rule() -> None:
    """`spec.scaler.minIPCount` is part of what the controller publishes and the nodes merge,
    and the controller's batch rule counts it among the free IPs a node may hold."""
    cs = {"metadata": {"name": "pods"},
          "spec": {"subnet": "10.10.0.0/24", "scaler": {"minIPCount": 20}}}  # fmt: skip
    default = Scaler()
    assert cluster_subnet(cs, default).min_ip_count == 20
    published = scaler_to_wire(merge_scalers(default, cs["spec"]["scaler"], {"batchSize": 8}))
    assert published["minIPCount"] == 20
    assert merge_scalers(default, None, published).min_ip_count == 20
    # A floor the scaler cannot keep (not below maxIPCount) is refused as a whole, as on nodes.
    assert merge_scalers(default, {"minIPCount": 300}) == default


def test_an_address_asked_for_by_name_is_granted_when_free_and_asked_back_when_held() -> None:
    """`spec.requestedIPs` (a pod's annotation, via its node): a free address goes to the node
    asking, before anything is granted lowest first, and counts toward its request; one another
    node holds is asked back from that node (`ipsToRelease`), then granted once freed."""
    record: dict[str, Entry] = {}
    a = run(SUBNET, {"a": (None, PoolRequest(2)), "b": (None, PoolRequest(0))}, record=record)
    nc_a, nc_b = a.changed["a"], a.changed["b"]
    assert [c.address for c in nc_a.ip_configs] == ["10.10.0.4", "10.10.0.5"]
    # b asks for 10.10.0.9 (free) and 10.10.0.5 (held by a): the first at once, lowest-first
    # grants go around it; a is asked to give the second back.
    asked = PoolRequest(3, requested_ips=("10.10.0.5", "10.10.0.9"))
    plan = run(SUBNET, {"a": (nc_a, PoolRequest(2)), "b": (nc_b, asked)}, record=record)
    nc_b = plan.changed["b"]
    assert {c.address for c in nc_b.ip_configs} == {"10.10.0.6", "10.10.0.7", "10.10.0.9"}
    held = next(c for c in nc_a.ip_configs if c.address == "10.10.0.5")
    assert plan.release_requests == {"a": (held.id,)}
    # a gives it up through the handshake; b gets it in the round that frees it.
    plan = run(SUBNET, {"a": (nc_a, PoolRequest(1, (held.id,))), "b": (nc_b, asked)},
               record=record)  # fmt: skip
    nc_a = plan.changed["a"]
    plan = run(SUBNET, {"a": (nc_a, PoolRequest(1)), "b": (nc_b, asked)}, record=record)
    assert "10.10.0.5" in {c.address for c in plan.changed["b"].ip_configs}
    # Not in the subnet, the gateway, a reserved one: nothing happens for those.
    odd = PoolRequest(0, requested_ips=("192.0.2.1", "10.10.0.1", "10.10.0.250"))
    assert run(SUBNET, {"c": (None, odd)}).changed["c"].ip_configs == ()


class Nodes:
    """Nodes of a given demand (none: idle), each sending the request its scaler gives for the
    state it was told (the controller's batch, batch 1 while exhausted) and giving back what is
    above it, under the incremental controller (`plan_round` over a `SubnetModel`), one round
    trip a round."""

    def __init__(self, subnet: Subnet, names: list[str]) -> None:
        self.subnet = subnet
        self.model = SubnetModel(subnet)
        self.status = SubnetStatus()
        self.ncs: dict[str, NetworkContainer] = {}
        self.sent = dict.fromkeys(names, 0)
        self.demand = dict.fromkeys(names, 0)
        self.rng = random.Random(0)

    def round(self) -> Plan:
        batch = self.subnet.pinned_batch or self.status.batch or self.subnet.max_batch
        for name in sorted(self.sent):
            nc = self.ncs.get(name)
            leaving: tuple[str, ...] = ()
            if nc is not None:
                self.sent[name] = next_request(
                    Scaler(batch, min_ip_count=self.subnet.min_ip_count),
                    current=self.sent[name],
                    demand=self.demand[name],
                    primary_ip_count=len(nc.primary_ips),
                    exhausted=self.status.exhausted,
                )
                leaving = tuple(c.id for c in nc.ip_configs[self.sent[name] :])
            self.model.set_node(NodeView(name, nc, PoolRequest(self.sent[name], leaving)))
        changed = self.model.take_changed()
        plan = plan_round(
            self.model,
            changed=changed,
            previous=self.status,
            rng=self.rng,
            new_id=lambda: f"id{next(IDS)}",
        )
        self.model.apply(plan.record)
        self.ncs.update(plan.changed)
        self.model.settle(changed)
        self.status = plan.status
        return plan


def test_a_warm_floor_alone_does_not_make_exhaustion_flap() -> None:
    """docs/simulate.md, churn-24 with minIPCount 40: the floor of 8 idle nodes (47 secondary
    IPs each, 384 addresses) is over 90 % of a /24. Exhausted, they drop it and ask for one IP
    each (16 reserved, under 50 %). The exhaustion used to clear then, the floors came back and
    set it again, every round trip for as long as the nodes stayed idle; now it stays set, since
    clearing it would give them back 384 addresses."""
    nodes = Nodes(Subnet("pods", "10.10.0.0/24", min_ip_count=40), [f"n{i}" for i in range(8)])
    states = [nodes.round().status.exhausted for _ in range(12)]
    assert states.count(False) <= 2 and states[-1], states  # set once, by the floors
    assert sum(a != b for a, b in itertools.pairwise(states)) == 1, states
    assert nodes.status.reserved == 16  # batch 1: a primary and one free IP a node
    assert nodes.model.inconsistencies() == []


def test_exhaustion_clears_once_the_floors_fit_under_the_upper_threshold() -> None:
    """The same nodes, exhausted, on a subnet where their floors fit: it clears, and stays so."""
    nodes = Nodes(Subnet("pods", "10.10.0.0/22", min_ip_count=40), [f"n{i}" for i in range(8)])
    nodes.status = SubnetStatus(exhausted=True)
    states = [nodes.round().status.exhausted for _ in range(8)]
    assert not any(states[2:]), states
    assert nodes.status.reserved == 8 * 48


def test_a_batch_pinned_by_the_operator_is_counted_and_the_toggle_does_not_flap() -> None:
    """40 nodes with 9 pods each on a /22 scale at 16, as `spec.scaler.batchSize` says: 32
    addresses a node, 1,280 in all, over 90 %. Exhausted, 10 a node, under 50 %. Counted at the
    controller's own batch (8, with 40 nodes on a /22: 16 a node, 640), the exhaustion would
    clear and be set again every other round (the toggle's critical node count); counted at the
    operator's, it stays set."""
    cs = {"metadata": {"name": "pods"},
          "spec": {"subnet": "10.10.0.0/22", "scaler": {"batchSize": 16}}}  # fmt: skip
    subnet = cluster_subnet(cs, Scaler(batch_size=8))
    assert subnet.pinned_batch == 16
    nodes = Nodes(subnet, [f"n{i:02}" for i in range(40)])
    nodes.demand = dict.fromkeys(nodes.demand, 9)
    states = [nodes.round().status.exhausted for _ in range(12)]
    assert sum(a != b for a, b in itertools.pairwise(states)) == 1, states
    assert nodes.status.batch < 16 and nodes.status.reserved == 40 * 11


@pytest.mark.parametrize(
    ("scaler", "pinned"),
    [
        (None, 0),  # the phase-4 batch reaches the nodes
        ({"batchSize": 16}, 16),
        ({"batchSize": 0, "minIPCount": 10}, 0),  # 0 sets nothing, as on the nodes
        # A scaler the merge refuses is replaced by the default, batch included: the controller
        # publishes the default's batch, not its own, as it does for the thresholds.
        ({"batchSize": 4, "minIPCount": 300}, 16),
    ],
)
def test_the_controller_knows_when_the_operator_pins_the_batch(
    scaler: dict[str, int] | None, pinned: int
) -> None:
    cs = {"metadata": {"name": "pods"},
          "spec": {"subnet": "10.10.0.0/22", **({"scaler": scaler} if scaler else {})}}  # fmt: skip
    assert cluster_subnet(cs, Scaler()).pinned_batch == pinned


def test_what_the_nodes_take_back_is_counted_for_the_changed_nodes_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 14: a round costs what changed. The sum of what the nodes take back once the
    exhaustion clears is kept up to date node by node; it is counted over every node only when
    the batch changes."""
    names = [f"n{i}" for i in range(40)]
    nodes = Nodes(Subnet("pods", "10.10.0.0/22"), names)
    for _ in range(3):
        nodes.round()
    counted: list[int] = []

    def counting(scaler: Scaler, requested: int, primary_ip_count: int) -> int:
        counted.append(requested)
        return reserved_once_cleared(scaler, requested, primary_ip_count)

    monkeypatch.setattr("cns.core.subnet_model.reserved_once_cleared", counting)
    nodes.demand["n7"] = 40  # one node's demand grows: it sends a new request
    batch = nodes.status.batch
    nodes.round()
    assert nodes.status.batch == batch
    assert len(counted) <= 2  # its view before and after
    assert nodes.model.inconsistencies() == []
    fresh = SubnetModel.build(nodes.subnet, nodes.model.nodes.values(), nodes.model.entries)
    assert fresh.reserved_once_cleared(batch) == nodes.model.reserved_once_cleared(batch)


# --------------------------------------------------------------------- IPBlock writes a round

WIDE = Subnet("wide", "10.60.0.0/20")  # 16 blocks of 256; 10.60.0.1 the gateway


def _blocks(addresses: Iterable[str]) -> set[int]:
    return {block_index(WIDE.network, address) for address in addresses}


def _wide_nc(name: str, primary: str, addresses: Iterable[str]) -> NetworkContainer:
    return NetworkContainer(
        id=f"nc-{name}",
        primary_ips=(primary,),
        subnet=str(WIDE.network),
        gateway=WIDE.gateway_address,
        ip_configs=tuple(IPConfig(f"{name}-{a}", a) for a in addresses),
    )


def _wide_plan(
    nodes: dict[str, tuple[NetworkContainer, PoolRequest]], record: dict[str, Entry]
) -> Plan:
    views = [NodeView(name, c, request) for name, (c, request) in sorted(nodes.items())]
    return plan_subnet(
        WIDE, views, record, SubnetStatus(), random.Random(0), lambda: f"id{next(IDS)}"
    )


def _holed() -> tuple[dict[str, tuple[NetworkContainer, PoolRequest]], dict[str, Entry]]:
    """Blocks 0-11 in use but for 4 addresses each (what releases leave behind), 12-15 unused;
    node "a" holds one primary IP and asks for 300 addresses."""
    taken = [
        str(WIDE.network[block * 256 + offset])
        for block in range(12)
        for offset in range(2, 252)
        if (block, offset) != (0, 2)
    ]
    record = {a: Entry("filler", f"filler-{a}") for a in taken}
    record["10.60.0.2"] = Entry("a", "nc-a", primary=True)
    record["10.60.0.254"] = Entry("filler", "nc-filler", primary=True)
    nodes = {
        "filler": (_wide_nc("filler", "10.60.0.254", taken), PoolRequest(len(taken))),
        "a": (_wide_nc("a", "10.60.0.2", ()), PoolRequest(300)),
    }
    return nodes, record


def _released(
    nodes: dict[str, tuple[NetworkContainer, PoolRequest]],
    record: dict[str, Entry],
    addresses: Iterable[str],
) -> None:
    """The filler node's `addresses` released: marked in the record, gone from its container."""
    gone = set(addresses)
    for address in gone:
        record[address] = replace(record[address], releasing=True)
    filler_nc, _ = nodes["filler"]
    kept = tuple(c for c in filler_nc.ip_configs if c.address not in gone)
    nodes["filler"] = (replace(filler_nc, ip_configs=kept), PoolRequest(len(kept)))


def test_a_rounds_grants_touch_the_fewest_blocks_that_hold_them() -> None:
    """Every block written costs the API server a whole IPBlock object: 300 grants on a subnet
    with a few free addresses in each of 12 blocks go to 2 blocks (ceil(300 / 256) + at most
    one), not to the holes of 12 blocks and 2 more, as lowest first did."""
    nodes, record = _holed()
    plan = _wide_plan(nodes, record)
    assert plan.granted == {"a": 300}
    granted = [c.address for c in plan.changed["a"].ip_configs]
    assert len(set(granted)) == 300 and not set(granted) & record.keys()
    assert len(_blocks(plan.touched)) <= math.ceil(300 / 256) + 1


def test_grants_fill_the_blocks_the_round_writes_anyway_first() -> None:
    """A release marks an entry in block 3: the same round's grant comes from block 3's free
    addresses, so the round writes that one block."""
    nodes, record = _holed()
    filler_nc, _ = nodes["filler"]
    leaving = next(c for c in filler_nc.ip_configs if block_index(WIDE.network, c.address) == 3)
    nodes["filler"] = (filler_nc, PoolRequest(len(filler_nc.ip_configs) - 1, (leaving.id,)))
    nodes["a"] = (nodes["a"][0], PoolRequest(3))
    plan = _wide_plan(nodes, record)
    assert plan.granted == {"a": 3}
    assert _blocks(plan.touched) == {3}


def test_a_free_waits_for_a_write_of_its_block_or_a_round_that_writes_no_block() -> None:
    """A released entry that no container lists any more is freed with another change to its
    block; in a round whose writes are elsewhere it waits (a block write of its own costs the
    API server a whole object), and a round that writes nothing else frees it."""
    nodes, record = _holed()
    released = "10.60.5.100"
    _released(nodes, record, [released])
    plan = _wide_plan(nodes, record)  # "a" gets 300 elsewhere
    assert released not in plan.record and plan.deferred == 1
    assert 5 not in _blocks(plan.touched)
    apply_changes(record, plan.record)
    nodes["a"] = (plan.changed["a"], PoolRequest(300))
    quiet = _wide_plan(nodes, record)
    assert quiet.record == {released: None} and quiet.deferred == 0


def test_a_free_is_made_at_once_when_the_round_needs_the_room() -> None:
    nodes, record = _holed()
    released = "10.60.5.100"
    _released(nodes, record, [released])
    free = WIDE.capacity - len(record)
    nodes["a"] = (nodes["a"][0], PoolRequest(free + 1))  # one more than is free without it
    plan = _wide_plan(nodes, record)
    assert plan.record[released] is not None and plan.record[released].node == "a"  # type: ignore[union-attr]
    assert plan.granted == {"a": free + 1} and plan.short_of == 0 and plan.deferred == 0


def test_a_round_that_writes_nothing_else_frees_a_few_blocks_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frees waiting in 3 blocks, 2 blocks' worth a quiet round: changes that arrive meanwhile
    wait for one wave of writes, not for every free left behind by a burst."""
    monkeypatch.setattr(plan_module, "QUIET_FREE_BLOCKS", 2)
    nodes, record = _holed()
    released = ["10.60.7.100", "10.60.5.100", "10.60.5.101", "10.60.9.3"]
    _released(nodes, record, released)
    nodes["a"] = (nodes["a"][0], PoolRequest(0))
    first = _wide_plan(nodes, record)
    assert first.record == dict.fromkeys(released[:3]) and first.deferred == 1
    apply_changes(record, first.record)
    second = _wide_plan(nodes, record)
    assert second.record == {"10.60.9.3": None} and second.deferred == 0


def test_a_draining_subnet_grants_nothing_and_frees_what_the_nodes_give_back() -> None:
    """`spec.draining`: no new container, no address by count or by name; releases go on, and
    `drain_left` counts what each node still holds for its pods (its primary IP aside)."""
    record: dict[str, Entry] = {}
    first = run(SUBNET, {"a": (None, PoolRequest(4))}, record=record)
    nc_a = first.changed["a"]
    draining = replace(SUBNET, draining=True)
    asked = PoolRequest(8, requested_ips=("10.10.0.9",))
    plan = run(draining, {"a": (nc_a, asked), "b": (None, PoolRequest(4))}, record=record)
    assert plan.changed == {} and plan.granted == {}
    assert plan.short_of == 4 and plan.drain_left == {"a": 4}
    released = tuple(c.id for c in nc_a.ip_configs[2:])
    plan = run(draining, {"a": (nc_a, PoolRequest(2, released))}, record=record)
    assert plan.drain_left == {"a": 2}  # the released ones no longer count
    nc_a = plan.changed["a"]
    plan = run(draining, {"a": (nc_a, PoolRequest(2))}, record=record)
    assert set(plan.record.values()) == {None} and len(plan.record) == 2  # freed
    assert run(SUBNET, {"a": (nc_a, PoolRequest(2))}).drain_left is None  # not draining
    # Its status says so: draining, and the addresses held by node.
    status = cluster_subnet_status(
        plan.status, scaler=Scaler(), capacity=plan.capacity, node_count=1, duplicates=0,
        conflicts=0, drain_left=plan.drain_left,
    )  # fmt: skip
    assert status["draining"] is True
    assert status["drain"] == {"addressesHeld": 2, "nodes": [{"name": "a", "addressesHeld": 2}]}


@pytest.mark.parametrize(
    ("value", "draining"), [(None, False), (False, False), (True, True), ("false", None), (1, None)]
)
def test_spec_draining_is_a_boolean_or_the_subnet_is_refused(
    value: object, draining: bool | None
) -> None:
    spec: dict[str, object] = {"subnet": "10.10.0.0/24"}
    if value is not None:
        spec["draining"] = value
    cs: dict[str, object] = {"metadata": {"name": "pods"}, "spec": spec}
    if draining is None:
        with pytest.raises(ValueError, match=r"spec\.draining"):
            cluster_subnet(cs, Scaler())  # type: ignore[arg-type]
    else:
        assert cluster_subnet(cs, Scaler()).draining is draining  # type: ignore[arg-type]
