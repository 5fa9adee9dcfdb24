"""The cluster-wide IPAM check's comparison (`cns.core.ipam_audit`): each kind of problem, the
release's rule, the report's round trip and its hostile forms, and properties over random
clusters: a held or listed address is never called leaked, never released."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cns.core.allocation import Entry
from cns.core.ipam_audit import (
    EXIT_BITS,
    ClusterView,
    Finding,
    Granted,
    NodeConfig,
    PodHolding,
    Problem,
    Recorded,
    ReportInvalid,
    SubnetInfo,
    Unreadable,
    address_ranges,
    check,
    exit_status,
    parse_report,
    release_refusal,
    report,
    utilization,
)

SUBNET = SubnetInfo("pods", "10.9.0.0/24", 253)


def _rec(address: str, node: str, *, id_: str = "", releasing: bool = False) -> Recorded:
    entry = Entry(node, id_ or f"ip-{address}", releasing=releasing, uid=f"uid-{node}")
    return Recorded(address, "pods", "pods-b0", entry)


def _nnc(node: str, *addresses: str) -> NodeConfig:
    granted = tuple(Granted(node, a, f"ip-{a}") for a in addresses)
    return NodeConfig(node, f"uid-{node}", granted, frozenset(addresses), requested=len(addresses))


def _view(
    *,
    record: tuple[Recorded, ...] = (),
    nncs: tuple[NodeConfig, ...] = (),
    pods: tuple[PodHolding, ...] = (),
    nodes: tuple[str, ...] = ("a", "b"),
    unreadable: tuple[Unreadable, ...] = (),
) -> ClusterView:
    return ClusterView(
        subnets=(SUBNET,),
        nodes=frozenset(nodes),
        configs={c.node: c for c in nncs},
        record=record,
        pods=pods,
        unreadable=unreadable,
    )


def _problems(view: ClusterView) -> list[tuple[str, str]]:
    return [(f.problem.value, f.address) for f in check(view)]


def test_a_consistent_cluster_is_clean_and_exits_0() -> None:
    view = _view(
        record=(_rec("10.9.0.2", "a"), _rec("10.9.0.3", "a"), _rec("10.9.0.4", "b")),
        nncs=(_nnc("a", "10.9.0.2", "10.9.0.3"), _nnc("b", "10.9.0.4")),
        pods=(PodHolding("ns/p", "a", "10.9.0.2"),),  # .3 and .4: pool headroom, not leaks
    )
    assert check(view) == []
    assert exit_status(check(view)) == 0


def test_an_address_two_nncs_list_is_a_duplicate() -> None:
    view = _view(
        record=(_rec("10.9.0.2", "a"),), nncs=(_nnc("a", "10.9.0.2"), _nnc("b", "10.9.0.2"))
    )
    (finding,) = check(view)
    assert finding.problem is Problem.DUPLICATE
    assert finding.nodes == ("a", "b")
    assert "granted to nodes a, b" in finding.why
    assert exit_status([finding]) == EXIT_BITS[Problem.DUPLICATE] == 4


def test_an_address_two_live_pods_hold_is_a_duplicate_but_a_finished_pod_is_no_holder() -> None:
    pods = (PodHolding("ns/p", "a", "10.9.0.2"), PodHolding("ns/q", "a", "10.9.0.2"))
    view = _view(record=(_rec("10.9.0.2", "a"),), nncs=(_nnc("a", "10.9.0.2"),), pods=pods)
    assert _problems(view) == [("duplicate", "10.9.0.2")]
    ended = (pods[0], PodHolding("ns/q", "a", "10.9.0.2", live=False))
    assert check(_view(record=view.record, nncs=(_nnc("a", "10.9.0.2"),), pods=ended)) == []


def test_a_pod_on_another_node_than_the_address_is_recorded_for_is_a_duplicate() -> None:
    view = _view(
        record=(_rec("10.9.0.2", "a"),),
        nncs=(_nnc("a", "10.9.0.2"),),
        pods=(PodHolding("ns/p", "b", "10.9.0.2"),),
    )
    (finding,) = check(view)
    assert finding.problem is Problem.DUPLICATE
    assert "held by pod ns/p on node b, but it is node a's" in finding.why


def test_a_recorded_address_no_nnc_lists_and_no_pod_holds_is_leaked() -> None:
    view = _view(record=(_rec("10.9.0.5", "a"),), nncs=(_nnc("a"),))
    (finding,) = check(view)
    assert (finding.problem, finding.address, finding.nodes) == (Problem.LEAKED, "10.9.0.5", ("a",))
    assert finding.record == view.record[0]
    assert exit_status([finding]) == 8


def test_a_releasing_entry_is_a_release_in_flight_not_a_leak() -> None:
    assert check(_view(record=(_rec("10.9.0.5", "a", releasing=True),))) == []


def test_a_pod_address_no_record_holds_is_unrecorded_and_one_outside_every_subnet_is_ignored() -> (
    None
):
    view = _view(
        nncs=(_nnc("a", "10.9.0.7"),),
        pods=(PodHolding("ns/p", "a", "10.9.0.7"), PodHolding("ns/other-cni", "a", "192.168.1.4")),
    )
    (finding,) = check(view)
    assert (finding.problem, finding.address, finding.pods) == (
        Problem.UNRECORDED,
        "10.9.0.7",
        ("ns/p",),
    )
    assert exit_status([finding]) == 16


def test_a_record_for_a_node_that_is_gone_is_stale() -> None:
    view = _view(record=(_rec("10.9.0.9", "gone"),))
    (finding,) = check(view)
    assert (finding.problem, finding.nodes) == (Problem.STALE, ("gone",))
    assert "node gone, which does not exist" in finding.why


def test_an_unreadable_object_is_reported_by_field_and_the_statuses_add_up() -> None:
    broken = Unreadable("NodeNetworkConfig", "a", "spec.requestedIPCount", "'x' is not a count")
    view = _view(record=(_rec("10.9.0.9", "gone"), _rec("10.9.0.5", "a")), unreadable=(broken,))
    findings = check(view)
    assert [f.problem for f in findings] == [Problem.LEAKED, Problem.STALE, Problem.UNREADABLE]
    assert "NodeNetworkConfig a: spec.requestedIPCount: 'x' is not a count" in [
        f.why for f in findings
    ]
    assert exit_status(findings) == 8 + 32 + 64


def _leak_report(view: ClusterView) -> Finding:
    (finding,) = [f for f in check(view) if f.problem is Problem.LEAKED]
    return finding


def test_release_takes_exactly_what_is_still_the_same_leak_after_the_grace() -> None:
    view = _view(record=(_rec("10.9.0.5", "a"),), nncs=(_nnc("a"),))
    leak = _leak_report(view)
    assert release_refusal(leak, view, age_seconds=60, grace_seconds=60) is None
    young = release_refusal(leak, view, age_seconds=5, grace_seconds=60)
    assert young is not None and "less than the grace" in young


@pytest.mark.parametrize(
    ("later", "reason"),
    [
        (_view(record=(_rec("10.9.0.5", "a"),), pods=(PodHolding("ns/late", "a", "10.9.0.5"),)),
         "pod ns/late holds it"),
        (_view(record=(_rec("10.9.0.5", "a"),), nncs=(_nnc("a", "10.9.0.5"),)),
         "the NodeNetworkConfig of node a lists it"),
        (_view(), "no allocation record holds it any more"),
        (_view(record=(_rec("10.9.0.5", "a", id_="other"),)), "its record changed since the check"),
        (_view(record=(_rec("10.9.0.5", "a"),), nodes=("b",)), "node a no longer exists"),
    ],
)  # fmt: skip
def test_release_refuses_an_address_that_changed_since_the_check(
    later: ClusterView, reason: str
) -> None:
    leak = _leak_report(_view(record=(_rec("10.9.0.5", "a"),)))
    refusal = release_refusal(leak, later, age_seconds=100, grace_seconds=0)
    assert refusal is not None and reason in refusal


def test_release_refuses_anything_but_a_leak() -> None:
    (stale,) = check(_view(record=(_rec("10.9.0.9", "gone"),)))
    refusal = release_refusal(stale, _view(), age_seconds=100, grace_seconds=0)
    assert refusal == "not a leak in the report but stale"


def test_utilization_per_subnet_and_per_node_with_ranges() -> None:
    view = _view(
        record=(*(_rec(f"10.9.0.{i}", "a") for i in (2, 3, 4, 8)), _rec("10.9.0.5", "b")),
        nncs=(_nnc("a", "10.9.0.2", "10.9.0.3", "10.9.0.4", "10.9.0.8"), _nnc("b")),
        pods=(PodHolding("ns/p", "a", "10.9.0.3"),),
    )
    (subnet,), nodes = utilization(view)
    assert (subnet.capacity, subnet.reserved, subnet.granted, subnet.assigned, subnet.free) == (
        253, 5, 4, 1, 248,
    )  # fmt: skip
    a, b = nodes
    assert (a.node, a.reserved, a.granted, a.assigned, a.free) == ("a", 4, 4, 1, 3)
    assert a.ranges == ("10.9.0.2-10.9.0.4", "10.9.0.8")
    assert (b.node, b.reserved, b.granted) == ("b", 1, 0)


def test_address_ranges_keep_families_apart() -> None:
    assert address_ranges(["10.0.0.1", "fd00::1", "10.0.0.2", "fd00::2", "fd00::4"]) == (
        "10.0.0.1-10.0.0.2",
        "fd00::1-fd00::2",
        "fd00::4",
    )


def test_a_report_reads_back_as_the_findings_it_was_written_from() -> None:
    view = _view(
        record=(_rec("10.9.0.5", "a"), _rec("10.9.0.9", "gone")),
        nncs=(_nnc("a"), _nnc("b", "10.9.0.7")),
        pods=(PodHolding("ns/p", "b", "10.9.0.7"),),
    )
    findings = check(view)
    data = json.loads(json.dumps(report(findings, checked_at="t", checked_at_epoch=1000.5)))
    assert data["exitStatus"] == exit_status(findings) == 8 + 16 + 32
    assert parse_report(data) == (1000.5, findings)


def _valid_report() -> dict[str, Any]:
    findings = check(_view(record=(_rec("10.9.0.5", "a"),)))
    data: dict[str, Any] = json.loads(
        json.dumps(report(findings, checked_at="t", checked_at_epoch=5.0))
    )
    return data


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.update(kind="other"), "kind: 'other'"),
        (lambda d: d.update(version=7), "version: 7"),
        (lambda d: d.update(checkedAtEpoch="soon"), "checkedAtEpoch: 'soon'"),
        (lambda d: d.update(findings={}), "findings: not a list"),
        (lambda d: d["findings"].append(3), "findings[1]: not an object"),
        (lambda d: d["findings"][0].update(problem="bad"), "findings[0].problem: 'bad'"),
        (lambda d: d["findings"][0].update(address="10.9.0.300"), "findings[0].address"),
        (lambda d: d["findings"][0].update(address="10.09.0.5"), "findings[0].address"),
        (lambda d: d["findings"][0].pop("record"), "findings[0].record: missing"),
        (lambda d: d["findings"][0]["record"].update(node="a b"), "findings[0].record.node"),
        (lambda d: d["findings"][0]["record"].update(id=5), "findings[0].record.id: 5"),
        (lambda d: d["findings"][0]["record"].update(releasing="no"),
         "findings[0].record.releasing"),
        (lambda d: d["findings"][0].update(pods=[1]), "findings[0].pods: not a list of strings"),
    ],
)  # fmt: skip
def test_a_malformed_report_is_refused_naming_the_field(change: Any, named: str) -> None:
    data = _valid_report()
    parse_report(data)
    change(data)
    with pytest.raises(ReportInvalid, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_report(data)


# Properties over random small clusters.

ADDRESSES = [f"10.9.0.{i}" for i in range(2, 8)]
NODES = ["a", "b", "c"]  # "c" has no Node object: its entries are stale


@st.composite
def clusters(draw: st.DrawFn) -> ClusterView:
    record = tuple(
        _rec(a, draw(st.sampled_from(NODES)), releasing=draw(st.booleans()))
        for a in draw(st.lists(st.sampled_from(ADDRESSES), unique=True))
    )
    nncs = tuple(
        _nnc(node, *draw(st.lists(st.sampled_from(ADDRESSES), unique=True))) for node in NODES[:2]
    )
    pods = tuple(
        PodHolding(f"ns/p{i}", draw(st.sampled_from(NODES)), a, draw(st.booleans()))
        for i, a in enumerate(draw(st.lists(st.sampled_from(ADDRESSES), max_size=6)))
    )
    return _view(record=record, nncs=nncs, pods=pods)


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_no_address_a_pod_holds_or_an_nnc_lists_is_ever_called_leaked(view: ClusterView) -> None:
    held = {h.address for h in view.pods}
    listed = {a for c in view.configs.values() for a in c.mentioned}
    leaked = {f.address for f in check(view) if f.problem is Problem.LEAKED}
    assert not leaked & (held | listed)


@settings(max_examples=400, deadline=None)
@given(clusters(), clusters())
def test_release_never_frees_an_address_a_pod_holds_or_an_nnc_lists_at_release_time(
    at_check: ClusterView, at_release: ClusterView
) -> None:
    """Whatever happened between the check and the release (the second view is any cluster)."""
    held = {h.address for h in at_release.pods}
    listed = {a for c in at_release.configs.values() for a in c.mentioned}
    for finding in check(at_check):
        if release_refusal(finding, at_release, age_seconds=100, grace_seconds=0) is None:
            assert finding.address not in held | listed
            assert finding.problem is Problem.LEAKED


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_every_address_two_live_pods_hold_is_reported_a_duplicate(view: ClusterView) -> None:
    live: dict[str, set[str]] = {}
    for h in view.pods:
        if h.live:
            live.setdefault(h.address, set()).add(h.pod)
    shared = {a for a, pods in live.items() if len(pods) > 1}
    duplicates = {f.address for f in check(view) if f.problem is Problem.DUPLICATE}
    assert shared <= duplicates
