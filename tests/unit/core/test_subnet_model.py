"""The incremental round (`plan_round` over a `SubnetModel`) against the whole-subnet round.

Random histories of requests, releases, deleted and re-created NodeNetworkConfigs (the node
living on, or gone), container and record writes that do or do not land, and containers listing
addresses they should not: after every step the incremental round must decide exactly what the
whole-subnet round decides from the same state, and the model kept up to date change by change
must equal one built from scratch.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from cns.core.allocation import Entry, apply_changes
from cns.core.subnet import Subnet
from cns.core.subnet_model import Listing, NodeView, SubnetModel
from cns.core.subnet_plan import Plan, plan_round, plan_subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, SubnetStatus

SUBNETS = [
    Subnet("v4", "10.0.0.0/23", reserved_ips=frozenset({"10.0.0.40"}), max_batch=8),
    Subnet("v6", "fd00::/119", max_batch=8),
    # A floor that, with a few nodes, exhausts it: the clearing rule comes into play.
    Subnet("floor", "10.1.0.0/25", max_batch=8, min_ip_count=30, upper_percent=80),
]
NAMES = [f"n{i}" for i in range(6)]


def outcome(plan: Plan) -> dict[str, object]:
    return {
        "record": plan.record,
        "changes": plan.node_changes,
        "additions": plan.additions,
        "release_requests": plan.release_requests,
        "duplicates": plan.duplicates,
        "conflicts": plan.conflicts,
        "released": plan.released,
        "granted": plan.granted,
        "status": plan.status,
        "short_of": plan.short_of,
        "owners": (plan.moved, plan.kept, plan.left),
    }


@settings(max_examples=40, deadline=None)
@given(data=st.data(), subnet=st.sampled_from(SUBNETS), seed=st.integers(0, 2**16))
def test_incremental_rounds_decide_what_whole_subnet_rounds_decide(
    data: st.DataObject, subnet: Subnet, seed: int
) -> None:
    model = SubnetModel(subnet)
    record: dict[str, Entry] = {}  # what the API server holds
    views: dict[str, NodeView] = {}
    uids = itertools.count()
    ids = itertools.count()
    status = SubnetStatus()
    gone: set[str] = set()
    for name in NAMES[:4]:
        views[name] = NodeView(name, None, PoolRequest(0), uid=f"u{next(uids)}")
        model.set_node(views[name])
    for step in range(data.draw(st.integers(3, 30))):
        for _ in range(data.draw(st.integers(0, 3))):
            act(data, model, views, gone, step, uids)
        changed = model.take_changed()
        stale = model.stale_owners()
        current = {node: views[node].uid if node in views else None for node in stale}
        current.update(dict.fromkeys(gone))
        first_id = next(ids) * 1000
        whole = plan_subnet(
            subnet,
            sorted(views.values(), key=lambda v: v.name),
            dict(record),
            status,
            random.Random(seed + step),
            map(str, itertools.count(first_id)).__next__,
            current,
            gone,
        )
        incremental = plan_round(
            model,
            changed=changed,
            previous=status,
            rng=random.Random(seed + step),
            new_id=map(str, itertools.count(first_id)).__next__,
            current_uids=current,
            nodes_gone=gone,
        )
        assert outcome(incremental) == outcome(whole)
        if whole.conflicts or whole.duplicates:
            event("audit found something")
        if whole.granted:
            event("granted")
        if whole.short_of:
            event("short")
        if whole.released:
            event("released")

        # The writes: each record change and each container write lands or not.
        landed = {
            address: entry
            for address, entry in incremental.record.items()
            if data.draw(st.booleans(), label=f"record write of {address} lands")
        }
        apply_changes(record, landed)
        model.apply(landed)
        for node, change in sorted(incremental.node_changes.items()):
            nc = change.container(lambda address, landed=landed: address in landed)  # type: ignore[misc]
            if nc is not None and data.draw(st.booleans(), label=f"{node} write lands"):
                views[node] = replace(views[node], nc=nc)
                model.set_node(views[node])
        if landed == incremental.record:
            gone.clear()
        status = incremental.status
        model.settle(changed)
        fresh = SubnetModel.build(subnet, views.values(), record)
        assert model.differences(fresh) == []
        assert model.inconsistencies() == []  # what the nodes take back included
        assert_listings_compact(model)
        assert_listings_compact(fresh)


def assert_listings_compact(model: SubnetModel) -> None:
    """An address listed once, as its entry says, is listed by the entry object itself: no
    `Listing` or tuple of its own (the memory it saves at 5,000 nodes, docs/benchmarks.md)."""
    for address, held in model.listed.items():
        entry = model.entries.get(address)
        if isinstance(held, tuple):
            assert len(held) > 1
        elif entry is not None and (entry.node, entry.id, entry.primary) == (
            held.node,
            held.id,
            held.primary,
        ):
            assert held is entry, address


def act(
    data: st.DataObject,
    model: SubnetModel,
    views: dict[str, NodeView],
    gone: set[str],
    step: int,
    uids: itertools.count[int],
) -> None:
    """One change a node (or an unlucky operator) makes between two rounds."""
    action = data.draw(
        st.sampled_from(["request", "release", "delete", "create", "steal", "give_back"])
    )
    name = data.draw(st.sampled_from(NAMES))
    view = views.get(name)
    if action == "create" and view is None:
        views[name] = NodeView(name, None, PoolRequest(0), uid=f"u{next(uids)}")
        gone.discard(name)
    elif action == "delete" and view is not None:
        # `kubectl delete nnc` (the node lives on: its addresses stay its own), or the node
        # leaves (its Node object is gone: its addresses are freed).
        del views[name]
        model.remove_node(name)
        if data.draw(st.booleans(), label=f"{name}'s Node is gone too"):
            gone.add(name)
        return
    elif action == "request" and view is not None:
        count = data.draw(st.integers(0, 400))
        # Some addresses asked for by name (a pod's annotation): free ones, ones another node
        # holds, ones outside the subnet.
        recorded = sorted(model.entries)
        named = data.draw(
            st.lists(st.sampled_from([*recorded, "10.0.0.9", "10.0.1.7", "192.0.2.1"]), max_size=2)
        )
        views[name] = replace(view, request=PoolRequest(count, (), tuple(sorted(set(named)))))
    elif action == "release" and view is not None and view.nc is not None:
        configs = view.nc.ip_configs
        chosen = data.draw(st.lists(st.sampled_from(configs), unique=True)) if configs else []
        leaving = tuple(c.id for c in chosen)
        count = max(0, view.request.requested_ip_count - len(leaving))
        views[name] = replace(view, request=PoolRequest(count, leaving))
    elif action == "steal" and view is not None and view.nc is not None:
        # A container lists an address it was never granted: a duplicate, a conflict, or one
        # the record does not have (adopted).
        recorded = sorted(model.entries)
        address = data.draw(st.sampled_from([*recorded, "10.0.1.200", "fd00::1c8"]))
        stolen = IPConfig(f"stolen{step}", address)
        nc = replace(view.nc, ip_configs=(*view.nc.ip_configs, stolen))
        views[name] = replace(view, nc=nc)
    elif action == "give_back" and view is not None and view.nc is not None:
        kept = tuple(c for c in view.nc.ip_configs if not c.id.startswith("stolen"))
        views[name] = replace(view, nc=replace(view.nc, ip_configs=kept))
    if name in views:
        model.set_node(views[name])


def test_a_node_whose_entries_move_is_planned_until_the_move_lands() -> None:
    """A's NNC was replaced (uid u1 -> u2): its entries move to the new object. The primary's
    move lands and A gets its container back; X's move does not land. Each later round moves X
    again although nothing of A changes, and must then also complete X into A's container, as
    a whole-subnet round does (found by the property above: incremental rounds left A out)."""
    subnet = SUBNETS[0]
    primary, x = "10.0.0.2", "10.0.0.7"
    record = {primary: Entry("a", "a-nc", primary=True, uid="u1"), x: Entry("a", "a-x", uid="u1")}
    model = SubnetModel.build(subnet, [NodeView("a", None, PoolRequest(0), uid="u1")], record)
    model.take_changed()
    view = NodeView("a", None, PoolRequest(0), uid="u2")
    model.set_node(view)
    for round_ in range(3):
        changed = model.take_changed()
        current = dict.fromkeys(model.stale_owners(), "u2")
        whole = plan_subnet(
            subnet, [view], dict(record), SubnetStatus(), random.Random(0), lambda: "new", current
        )
        incremental = plan_round(
            model, changed=changed, previous=SubnetStatus(), rng=random.Random(0),
            new_id=lambda: "new", current_uids=current,
        )  # fmt: skip
        assert outcome(incremental) == outcome(whole), round_
        change = incremental.node_changes["a"]
        if round_ == 0:  # only the primary's move lands, and the container it makes
            landed = {primary: incremental.record[primary]}
            apply_changes(record, landed)
            model.apply(landed)
            view = replace(view, nc=change.container(lambda address: address == primary))
            model.set_node(view)
        else:
            assert incremental.moved == {"a": 1}
            assert change.additions == (IPConfig("a-x", x),)
        model.settle(changed)


def test_a_listing_as_recorded_is_the_entry_whichever_comes_first() -> None:
    """The standby's sync tells the model a container's new listing before the block's new
    entry: the entry then takes the listing's place, and so does the entry that marks it
    releasing, which lets the old one go."""
    subnet = SUBNETS[0]
    nc = NetworkContainer("a-nc", ("10.0.0.2",), subnet.cidr, "10.0.0.1", (), 1, 1)
    x = "10.0.0.7"
    model = SubnetModel(subnet)
    model.set_node(NodeView("a", replace(nc, ip_configs=(IPConfig("a-x", x),)), PoolRequest(1)))
    assert model.listed[x] == Listing("a", "a-x", False) and x in model.unclean
    granted = Entry("a", "a-x")
    model.set_entry(x, granted)
    assert model.listed[x] is granted and x not in model.unclean
    releasing = replace(granted, releasing=True)
    model.set_entry(x, releasing)
    assert model.listed[x] is releasing
    model.set_entry(x, None)  # the listing stays, as the entry said it
    assert model.holders(x) == (releasing,) and x in model.unclean
    assert model.inconsistencies() == []
    assert_listings_compact(model)


def test_a_grant_another_container_stops_listing_is_completed_at_once() -> None:
    """A's grant X never reached A's container, and B lists X (a conflict): A can get X only
    once B lets it go. B letting go changes only B's container, yet A must be planned."""
    subnet = SUBNETS[0]
    x = "10.0.0.7"
    nc_a = NetworkContainer("a-nc", ("10.0.0.2",), subnet.cidr, "10.0.0.1", (), 1, 1)
    nc_b = NetworkContainer("b-nc", ("10.0.0.3",), subnet.cidr, "10.0.0.1", (), 1, 1)
    record = {
        "10.0.0.2": Entry("a", "a-nc", primary=True),
        "10.0.0.3": Entry("b", "b-nc", primary=True),
        x: Entry("a", "a-x"),
    }
    a = NodeView("a", nc_a, PoolRequest(1))
    b_listing = NodeView("b", replace(nc_b, ip_configs=(IPConfig("b-x", x),)), PoolRequest(0))
    model = SubnetModel.build(subnet, [a, b_listing], record)

    def both(views: list[NodeView]) -> tuple[dict[str, object], dict[str, object]]:
        changed = model.take_changed()
        status = SubnetStatus()
        whole = plan_subnet(subnet, views, record, status, random.Random(0), lambda: "new")
        incremental = plan_round(model, changed=changed, previous=status,
                                 rng=random.Random(0), new_id=lambda: "new")  # fmt: skip
        model.settle(changed)
        return outcome(incremental), outcome(whole)

    incremental, whole = both([a, b_listing])
    assert incremental == whole and whole["conflicts"] == {x: ("b", "a")}
    b = NodeView("b", nc_b, PoolRequest(0))
    model.set_node(b)
    incremental, whole = both([a, b])
    assert incremental == whole
    assert whole["changes"]["a"].additions == (IPConfig("a-x", x),)  # type: ignore[index]


def test_an_address_asked_for_by_name_is_granted_in_the_round_that_frees_it() -> None:
    """B asks for X by name while A holds it: B stays in the rounds (nothing about B changes
    when A lets X go), so B gets X in the round that frees it, as a whole-subnet round would
    decide."""
    subnet = SUBNETS[0]
    x = "10.0.0.7"
    nc_a = NetworkContainer("a-nc", ("10.0.0.2",), subnet.cidr, "10.0.0.1",
                            (IPConfig("a-x", x),), 1, 1)  # fmt: skip
    nc_b = NetworkContainer("b-nc", ("10.0.0.3",), subnet.cidr, "10.0.0.1", (), 1, 1)
    record = {
        "10.0.0.2": Entry("a", "a-nc", primary=True),
        "10.0.0.3": Entry("b", "b-nc", primary=True),
        x: Entry("a", "a-x"),
    }
    a = NodeView("a", nc_a, PoolRequest(1))
    b = NodeView("b", nc_b, PoolRequest(0, (), (x,)))
    model = SubnetModel.build(subnet, [a, b], record)

    def both(views: list[NodeView]) -> dict[str, object]:
        changed = model.take_changed()
        status = SubnetStatus()
        whole = plan_subnet(subnet, views, record, status, random.Random(0), lambda: "new")
        incremental = plan_round(model, changed=changed, previous=status,
                                 rng=random.Random(0), new_id=lambda: "new")  # fmt: skip
        assert outcome(incremental) == outcome(whole)
        apply_changes(record, incremental.record)
        model.apply(incremental.record)
        model.settle(changed)
        return outcome(whole)

    assert both([a, b])["release_requests"] == {"a": ("a-x",)}
    a = NodeView("a", nc_a, PoolRequest(0, ("a-x",)))  # A gives it up: marked releasing
    model.set_node(a)
    both([a, b])
    a = NodeView("a", replace(nc_a, ip_configs=(), version=2), PoolRequest(0))  # dropped
    model.set_node(a)
    granted = both([a, b])["changes"]["b"].additions  # type: ignore[index]
    assert x in [c.address for c in granted]


def test_another_spelling_of_a_held_ipv6_address_never_frees_it() -> None:
    """A container listing `FD00::3` (or `fd00:0::3`) while the record holds `fd00::3` for
    another node: when it stops listing it, `fd00::3` must stay taken, and the odd spelling is
    asked back as a conflict rather than recorded."""
    subnet = Subnet("v6", "fd00::/120", max_batch=8)
    holder = NodeView("a", None, PoolRequest(0), uid="ua")
    record = {"fd00::3": Entry("a", "a-3", uid="ua")}
    for odd in ("FD00::3", "fd00:0::3", "fd00::0003"):
        listing = NetworkContainer(
            id="nc-b", primary_ips=(), subnet=str(subnet.network), gateway="fd00::1",
            ip_configs=(IPConfig("b-odd", odd),), version=1, programmed_version=1,
        )  # fmt: skip
        other = NodeView("b", listing, PoolRequest(1), uid="ub")
        model = SubnetModel.build(subnet, [holder, other], record)
        plan = plan_round(
            model, changed=model.take_changed(), previous=SubnetStatus(),
            rng=random.Random(1), new_id=lambda: "new",
        )  # fmt: skip
        assert odd not in plan.record and plan.conflicts[odd] == ("b", ""), odd
        assert plan.release_requests == {"b": ("b-odd",)}
        empty = replace(listing, ip_configs=())
        model.set_node(replace(other, nc=empty))  # b stops listing the odd spelling
        plan = plan_round(
            model, changed=model.take_changed(), previous=SubnetStatus(),
            rng=random.Random(1), new_id=lambda: "new",
        )  # fmt: skip
        assert plan.record.get("fd00::3", record["fd00::3"]) == record["fd00::3"], odd
        assert (
            model.differences(SubnetModel.build(subnet, list(model.nodes.values()), record)) == []
        )


def test_a_listing_whose_id_the_record_cannot_hold_is_asked_back_not_adopted() -> None:
    """An address a container lists but the record lacks is adopted under the container's IP
    config name; a name with a blank (or none) cannot be written into the record, so it is a
    conflict the node is asked to release, and the round goes on for everyone else."""
    subnet = Subnet("v4", "10.0.0.0/24")
    odd = NetworkContainer(
        id="nc-a", primary_ips=(), subnet=str(subnet.network), gateway="10.0.0.1",
        ip_configs=(IPConfig("pod ip 1", "10.0.0.7"), IPConfig("a-8", "10.0.0.8")),
        version=1, programmed_version=1,
    )  # fmt: skip
    model = SubnetModel.build(subnet, [NodeView("a", odd, PoolRequest(2), uid="ua")], {})
    plan = plan_round(
        model, changed=model.take_changed(), previous=SubnetStatus(),
        rng=random.Random(1), new_id=lambda: "new",
    )  # fmt: skip
    assert "10.0.0.7" not in plan.record and plan.conflicts["10.0.0.7"] == ("a", "")
    assert plan.record["10.0.0.8"] == Entry("a", "a-8", uid="ua")  # adopted
    assert plan.release_requests == {"a": ("pod ip 1",)}


def run_rounds(
    model: SubnetModel, views: dict[str, NodeView], record: dict[str, Entry], limit: int
) -> list[tuple[set[str], set[str], int]]:
    """Rounds until nothing is left to do, every write landing; each round's nodes, the
    nodes that had changed, and what the round's nodes could together be granted (`demand`)."""
    rounds = []
    ids = itertools.count()
    for _ in range(100):
        changed = model.take_changed()
        if not changed:
            break
        planned = model.take_slice(changed, limit)
        rounds.append((planned, changed, sum(model.demand(name) for name in planned)))
        plan = plan_round(
            model, changed=planned, previous=SubnetStatus(), rng=random.Random(0),
            new_id=lambda: f"id{next(ids)}",
        )  # fmt: skip
        apply_changes(record, plan.record)
        model.apply(plan.record)
        for name, nc in plan.changed.items():
            views[name] = replace(views[name], nc=nc)
            model.set_node(views[name])
        model.settle(planned)
    return rounds


def held_counts(record: dict[str, Entry]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for entry in record.values():
        counts[entry.node] = counts.get(entry.node, 0) + 1
    return counts


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.integers(0, 40), min_size=3, max_size=20),
    containers=st.lists(st.booleans(), min_size=20, max_size=20),
    limit=st.integers(1, 300),
    prefix=st.sampled_from([22, 23, 24, 25, 26]),
)
def test_slicing_a_round_changes_when_a_node_is_granted_never_what(
    requests: list[int], containers: list[bool], limit: int, prefix: int
) -> None:
    """Nodes ask for addresses, some with no container yet; rounds in slices of at most `limit`
    addresses (`take_slice`) end where rounds of every node end: with room for all, each node
    gets its whole shortfall whichever slice plans it; short, the round is one, divided among
    all the nodes as before."""
    subnet = Subnet("v4", f"10.0.0.0/{prefix}")
    ends = []
    for sliced in (False, True):
        model = SubnetModel(subnet)
        views: dict[str, NodeView] = {}
        record: dict[str, Entry] = {}
        for i, count in enumerate(requests):
            name = f"n{i:02d}"
            nc = None
            if containers[i]:
                primary = f"10.0.0.{i + 2}"
                nc = NetworkContainer(f"{name}-nc", (primary,), subnet.cidr, "10.0.0.1", (), 1, 1)
                record[primary] = Entry(name, nc.id, primary=True, uid=name)
                model.set_entry(primary, record[primary])
            views[name] = NodeView(name, nc, PoolRequest(count), uid=name)
            model.set_node(views[name])
        free = subnet.capacity - model.free.taken
        short = sum(model.demand(name) for name in views) > free
        rounds = run_rounds(model, views, record, limit if sliced else 2**31)
        if sliced:
            if short:
                event("short: one round")
                assert rounds[0][0] == set(views)
            for planned, changed, demand in rounds:
                assert planned == changed or demand <= limit or len(planned) == 1
            if len(rounds[0][0]) < len(views):
                event("sliced")
        assert model.waiting == set()
        assert model.differences(SubnetModel.build(subnet, views.values(), record)) == []
        ends.append(held_counts(record))
    assert ends[0] == ends[1]


def test_nodes_left_out_of_a_slice_go_first_in_the_next_round() -> None:
    """A node changing again and again, first by name, cannot keep the others out of rounds."""
    subnet = Subnet("v4", "10.0.0.0/22")
    model = SubnetModel(subnet)
    for name in ("a", "b", "c"):
        model.set_node(NodeView(name, None, PoolRequest(9), uid=name))
    assert model.take_slice(model.take_changed(), 15) == {"a"}
    model.settle({"a"})
    model.set_node(NodeView("a", None, PoolRequest(10), uid="a"))
    assert model.take_slice(model.take_changed(), 15) == {"b"}
    model.settle({"b"})
    # b still needs its round (nothing was planned for it here), and now waits behind c and a.
    assert model.take_slice(model.take_changed(), 25) == {"c", "a"}
    assert model.waiting == {"b"}
