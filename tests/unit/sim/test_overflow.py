"""`cns simulate` with overflow subnets and draining (cns/core/overflow.py on the simulated
nodes): the scenario fields, the gate (a pod goes on only while its primary subnet is exhausted
or draining and its node has none of its addresses free), pods counted once, draining, the
report, determinism. The rule itself is tested in tests/unit/core; here, the simulator applies
it to a cluster."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cns.config.daemon_config import ConfigError
from cns.core.types import IPState
from cns.sim.cluster import RUNNING, Lane, Node, Pod, SimulatedSubnet
from cns.sim.engine import Simulation, simulate
from cns.sim.escalator import Resources
from cns.sim.report import has_overflow, summary, summary_rows, to_json
from cns.sim.scenario import (
    DeploymentSpec,
    NodePoolSpec,
    NodeShape,
    Scenario,
    SubnetSpec,
    Timing,
    load,
    parse,
)
from cns.sim.strategies import STRATEGIES
from tests.harness import REPO

SCENARIOS = REPO / "bench" / "scenarios"
FILLS = SCENARIOS / "overflow-fills.yaml"
FILLS_ALONE = SCENARIOS / "overflow-fills-alone.yaml"
HYSTERESIS = SCENARIOS / "overflow-hysteresis.yaml"
HYSTERESIS_NARROW = SCENARIOS / "overflow-hysteresis-narrow.yaml"
DRAIN = SCENARIOS / "overflow-drain.yaml"
# The keys the overflow work added to the JSON summary: absent from a run before it.
OVERFLOW_KEYS = ("podsOverflowed", "overflowGateOpenings", "peakPodsOnOverflow")
OVERFLOW_SUBNET_KEYS = (
    "overflow",
    "drainAtSeconds",
    "podsAssigned",
    "podsWaited",
    "waitSeconds",
    "podsOverflowedOut",
    "podsOverflowedIn",
    "overflowGateOpenings",
)


def fills_data() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(FILLS.read_text())
    return data


# -- the scenario fields ---------------------------------------------------------------------------


def test_shipped_overflow_scenarios_say_overflow_and_drain() -> None:
    fills = load(FILLS)
    assert fills.subnets[0].overflow == ("spill",)
    assert load(FILLS_ALONE).subnets[0].overflow == ()
    assert load(DRAIN).subnets[0].drain_at_seconds == 600.0


def _ipv6(data: dict[str, Any]) -> dict[str, Any]:
    data["subnets"][1]["cidr"] = "fd00::/120"
    return data


def _five(data: dict[str, Any]) -> dict[str, Any]:
    data["subnets"] += [{"name": f"s{i}", "cidr": f"10.9.{i}.0/24"} for i in range(5)]
    data["subnets"][0]["overflow"] = [f"s{i}" for i in range(5)]
    return data


@pytest.mark.parametrize(
    ("change", "named", "why"),
    [
        (lambda d: d["subnets"][0].update(overflow=["nowhere"]), "overflow[0]", "no subnet named"),
        (lambda d: d["subnets"][0].update(overflow=["primary"]), "overflow[0]", "itself"),
        (
            lambda d: d["subnets"][0].update(overflow=["spill", "spill"]),
            "overflow[1]",
            "listed twice",
        ),
        (lambda d: d["subnets"][0].update(overflow="spill"), "overflow", "list of names"),
        (lambda d: d["subnets"][0].update(overflow=[3]), "overflow", "list of names"),
        (_ipv6, "overflow[0]", "not IPv4"),
        (_five, "overflow", "at most 4"),
        (lambda d: d["subnets"][1].update(drainAtSeconds=-1), "drainAtSeconds", "0..2400"),
        (lambda d: d["subnets"][1].update(drainAtSeconds=9999), "drainAtSeconds", "0..2400"),
        (lambda d: d["subnets"][1].update(drainAtSeconds="soon"), "drainAtSeconds", "number"),
        (lambda d: d["subnets"][1].update(drain=True), "subnets[1].drain", ""),
    ],
)
def test_bad_overflow_and_drain_fields_are_named(change: Any, named: str, why: str) -> None:
    data = copy.deepcopy(fills_data())
    change(data)
    with pytest.raises(ConfigError) as error:
        parse(data, "test.yaml")
    message = str(error.value)
    assert message.startswith("test.yaml: ") and "subnets[" in message
    assert named in message and why in message


def test_a_subnet_may_overflow_into_one_that_overflows_back() -> None:
    """Each node follows only its own primary's list, so two subnets naming each other is no
    loop: a pod goes on at most once."""
    data = fills_data()
    data["subnets"][1]["overflow"] = ["primary"]
    scenario = parse(data, "test.yaml")
    assert scenario.subnets[1].overflow == ("primary",)


# -- the engine ------------------------------------------------------------------------------------


class OverflowCheckedSimulation(Simulation):
    """Checks, as the run goes: an ADD goes on to an overflow subnet only while the node sees
    the gate open and holds none of its primary's addresses free; an address is held once in
    its subnet and listed in its lane's container; a pod holding an overflow address is counted
    there and not in the primary's demand."""

    def __init__(self, scenario: Scenario, strategy: str, seed: int = 1) -> None:
        super().__init__(scenario, STRATEGIES[strategy], seed)
        self.sent_on = 0
        self.planned = 0
        add, send_on, plan, round_ = (
            self.cni.add,
            self.cni.send_waiters_on,
            self.fleet.plan,
            self.control.round,
        )

        def checked_add(pod: Pod) -> None:
            node = pod.node
            assert node is not None
            gate = self._gate(node)
            add(pod)
            self._check_choice(pod, gate)

        def checked_send_on(node: Node) -> None:
            gate = self._gate(node)
            waiting = [pod for pod, _ in node.primary.waiting]
            send_on(node)
            for pod in waiting:
                self._check_choice(pod, gate)

        def checked_plan(node: Node) -> None:
            plan(node)
            self._check_demand(node)

        def checked_round(subnet: SimulatedSubnet) -> None:
            round_(subnet)
            self._check_addresses(subnet)

        self.cni.add = checked_add  # type: ignore[method-assign]
        self.cni.send_waiters_on = checked_send_on  # type: ignore[method-assign]
        self.fleet.plan = checked_plan  # type: ignore[method-assign]
        self.control.round = checked_round  # type: ignore[method-assign]

    @staticmethod
    def _gate(node: Node) -> tuple[bool, int]:
        return node.overflow_gate_open(), node.primary.ipam.available_count()

    def _check_choice(self, pod: Pod, gate: tuple[bool, int]) -> None:
        node = pod.node
        assert node is not None and pod.lane is not None
        if pod.lane is not node.primary:
            gate_open, primary_free = gate
            assert gate_open and primary_free == 0, (pod.id, gate)
            assert pod.lane.subnet in node.subnet.overflow
            self.sent_on += 1

    def _check_demand(self, node: Node) -> None:
        if node.removed:
            return
        self.planned += 1
        overflowed = node.overflowed()
        assert node.demand(node.primary) == len(node.pods) - overflowed
        for lane in node.overflow.values():
            assert node.demand(lane) >= lane.ipam.assigned_count()
        running = sum(1 for pod in node.pods.values() if pod.state == RUNNING)
        assert running == sum(lane.ipam.assigned_count() for lane in node.lanes())

    @staticmethod
    def _check_addresses(subnet: SimulatedSubnet) -> None:
        owners: dict[str, str] = {}
        for lane in subnet.lanes.values():
            nc = subnet.ncs.get(lane.name)
            listed = set() if nc is None else {c.address for c in nc.ip_configs}
            for record in lane.ipam.records.values():
                if record.state is IPState.ASSIGNED:
                    assert record.address not in owners, (record.address, lane.name)
                    owners[record.address] = lane.name
                    assert record.address in listed
        assert subnet.assigned == sum(lane.ipam.assigned_count() for lane in subnet.lanes.values())


def _pods_on_overflow(sim: Simulation) -> int:
    return sum(
        lane.ipam.assigned_count()
        for pool in sim.pools.values()
        for node in pool.nodes.values()
        for lane in node.overflow.values()
    )


@pytest.mark.parametrize("strategy", ["fixed", "toggle", "phase4+toggle"])
@pytest.mark.parametrize("path", [FILLS, HYSTERESIS, DRAIN], ids=lambda p: p.stem)
def test_pods_go_on_only_through_the_open_gate(path: Path, strategy: str) -> None:
    sim = OverflowCheckedSimulation(load(path), strategy)
    result = sim.run()
    assert sim.planned > 100
    overflowed = sum(s.overflowed_out for s in result.subnets.values())
    assert overflowed > 0 and sim.sent_on >= overflowed
    # each pod counted once: in the subnet whose address it took, or waited for
    assert sum(s.overflowed_in for s in result.subnets.values()) == overflowed
    assert sum(s.pods_assigned for s in result.subnets.values()) <= result.pods_created
    assert sorted(w for s in result.subnets.values() for w in s.waits) == sorted(result.waits)
    assert sim.record.pods_on_overflow == _pods_on_overflow(sim)
    assert result.series.overflow_pods[-1] == _pods_on_overflow(sim)


def _one_pool(
    *, primary: str, nodes: int, replicas: int, crashes: float, overflow: bool
) -> Scenario:
    return Scenario(
        name="overflow-property",
        duration_seconds=300.0,
        sample_seconds=5.0,
        subnets=(
            SubnetSpec(name="p", cidr=primary, overflow=("o",) if overflow else ()),
            SubnetSpec(name="o", cidr="10.9.0.0/24"),
        ),
        node_pools=(
            NodePoolSpec(
                name="pool",
                subnet="p",
                node=NodeShape(Resources(cpu_milli=16000, memory_bytes=64 << 30), 60),
                initial_nodes=nodes,
                autoscaler=None,
            ),
        ),
        deployments=(
            DeploymentSpec(
                name="d",
                pod=Resources(cpu_milli=100, memory_bytes=1 << 27),
                replicas=replicas,
                weights={"pool": 1},
                start_seconds=5.0,
                crash_loops_per_minute=crashes,
            ),
        ),
        timing=Timing(ip_cooldown_seconds=10.0),
    )


def _without_overflow_keys(figures: dict[str, Any]) -> dict[str, Any]:
    figures = {k: v for k, v in figures.items() if k not in OVERFLOW_KEYS}
    figures["subnets"] = {
        name: {k: v for k, v in subnet.items() if k not in OVERFLOW_SUBNET_KEYS}
        for name, subnet in figures["subnets"].items()
    }
    return figures


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.integers(1, 4),
    replicas=st.integers(0, 80),
    crashes=st.sampled_from([0.0, 30.0]),
    strategy=st.sampled_from(sorted(STRATEGIES)),
    seed=st.integers(0, 1000),
)
def test_a_primary_never_exhausted_runs_as_without_overflow(
    nodes: int, replicas: int, crashes: float, strategy: str, seed: int
) -> None:
    """A /22 these pods never exhaust: the gate never opens, no node joins the overflow subnet,
    and the run is the one without the overflow line, figure for figure."""
    runs = [
        simulate(
            _one_pool(
                primary="10.8.0.0/22",
                nodes=nodes,
                replicas=replicas,
                crashes=crashes,
                overflow=overflow,
            ),
            STRATEGIES[strategy],
            seed,
        )
        for overflow in (True, False)
    ]
    with_overflow, alone = (summary(run) for run in runs)
    assert with_overflow["podsOverflowed"] == 0 == with_overflow["overflowGateOpenings"]
    assert with_overflow["subnets"]["o"]["controllerRounds"] == 0
    assert _without_overflow_keys(with_overflow) == _without_overflow_keys(alone)
    assert runs[0].series == runs[1].series


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.integers(2, 4),
    replicas=st.integers(60, 110),
    crashes=st.sampled_from([0.0, 20.0]),
    strategy=st.sampled_from(sorted(STRATEGIES)),
    seed=st.integers(0, 1000),
)
def test_a_full_primary_sends_pods_on_through_the_gate_only(
    nodes: int, replicas: int, crashes: float, strategy: str, seed: int
) -> None:
    """A /26 (61 addresses) that cannot hold the pods: they go on, each through the open gate
    with no primary address free on its node, and none is left waiting at the end (the /24
    holds them all); the primary's addresses are used first."""
    scenario = _one_pool(
        primary="10.8.0.0/26", nodes=nodes, replicas=replicas, crashes=crashes, overflow=True
    )
    sim = OverflowCheckedSimulation(scenario, strategy, seed)
    result = sim.run()
    primary = result.subnets["p"]
    assert primary.overflowed_out == sim.sent_on >= replicas - 61
    assert primary.gate_openings >= 1
    assert result.still_waiting == 0
    assert result.subnets["o"].overflowed_in == primary.overflowed_out


def test_the_gate_is_shut_while_the_primary_has_room() -> None:
    """Pods that fit the primary never go on, even with the overflow subnet configured."""
    result = simulate(
        _one_pool(primary="10.8.0.0/24", nodes=2, replicas=40, crashes=0.0, overflow=True),
        STRATEGIES["phase4+toggle"],
    )
    assert result.subnets["p"].overflowed_out == 0
    assert result.subnets["p"].gate_openings == 0
    assert result.subnets["o"].rounds == 0  # no node ever joined it


# -- draining --------------------------------------------------------------------------------------


def test_draining_stops_grants_and_returns_the_free_addresses() -> None:
    """Ten seconds after `old` starts draining its nodes hold only what their pods hold (the
    free addresses went back) and the controller granted nothing more; every pod created after
    the drain has an address of `new`; after the rollout `old` holds only the nodes' primary
    addresses."""
    scenario = load(DRAIN)
    drain_at = scenario.subnets[0].drain_at_seconds
    assert drain_at is not None
    sim = Simulation(replace(scenario, duration_seconds=drain_at + 10), STRATEGIES["phase4"], 1)
    sim.run()
    old = sim.subnets["old"]
    assert old.draining and old.subnet.draining and old.model.subnet.draining
    for lane in old.lanes.values():
        assert lane.ipam.available_count() == 0
        assert lane.ipam.held_count() == lane.ipam.held_for_pods()
        assert lane.sent is not None
        assert lane.sent.requested_ip_count == lane.ipam.held_for_pods()
    assert old.reserved == len(old.ncs) + sum(
        lane.ipam.held_for_pods() for lane in old.lanes.values()
    )

    sim = Simulation(scenario, STRATEGIES["phase4"], 1)
    granted: list[int] = []
    round_ = sim.control.round

    def watched_round(subnet: SimulatedSubnet) -> None:
        before = subnet.reserved
        round_(subnet)
        if subnet is old_subnet and sim.clock.now > drain_at:
            granted.append(subnet.reserved - before)

    old_subnet = sim.subnets["old"]
    sim.control.round = watched_round  # type: ignore[method-assign]
    result = sim.run()
    assert granted and max(granted) <= 0  # nothing granted, only given back
    assert result.subnets["old"].final_utilization * result.subnets["old"].capacity == 5
    assert result.subnets["old"].gate_openings == 1
    for deployment in sim.deployments.values():
        for pod in deployment.pods:
            assert pod.lane is not None and pod.lane.subnet.spec.name == "new"
    assert result.still_waiting == 0


def test_a_drained_primary_without_overflow_serves_no_new_pod() -> None:
    """Without an overflow subnet, the pods created after the drain wait: nothing is granted."""
    data: dict[str, Any] = yaml.safe_load(DRAIN.read_text())
    del data["subnets"][0]["overflow"]
    result = simulate(parse(data, "drain.yaml"), STRATEGIES["phase4"])
    assert result.subnets["old"].overflowed_out == 0
    assert result.still_waiting > 0
    assert result.subnets["new"].rounds == 0


# -- hysteresis ------------------------------------------------------------------------------------


def test_the_gate_follows_the_exhaustion_hysteresis() -> None:
    """Churn around the primary's 90 % line: with exhaustion cleared at 50 % the gate opens
    twice in the hour (the two climbs over 90 %), the pods do not flap between the subnets;
    cleared at 85 %, it opens several times more."""
    wide = simulate(load(HYSTERESIS), STRATEGIES["phase4+toggle"])
    narrow = simulate(load(HYSTERESIS_NARROW), STRATEGIES["phase4+toggle"])
    assert wide.subnets["primary"].gate_openings == 2
    assert narrow.subnets["primary"].gate_openings >= 3 * wide.subnets["primary"].gate_openings
    assert wide.subnets["primary"].exhaustion_flips <= 4


# -- the report and determinism --------------------------------------------------------------------


def test_overflow_beats_waiting_in_the_full_subnet() -> None:
    """The fills-up scenario with and without its overflow line: without it pods wait to the
    end and ADDs fail; with it nobody is left waiting."""
    for strategy in ("phase4", "phase4+toggle"):
        with_overflow = simulate(load(FILLS), STRATEGIES[strategy])
        alone = simulate(load(FILLS_ALONE), STRATEGIES[strategy])
        assert with_overflow.still_waiting == 0 < alone.still_waiting
        assert len(with_overflow.waits) < len(alone.waits)
        assert with_overflow.failed_pods == 0 < alone.failed_pods
        assert sum(s.overflowed_out for s in alone.subnets.values()) == 0
        assert has_overflow(with_overflow) and not has_overflow(alone)


def test_the_table_shows_overflow_rows_only_for_overflow_scenarios() -> None:
    with_overflow = simulate(load(FILLS), STRATEGIES["phase4"])
    alone = simulate(load(FILLS_ALONE), STRATEGIES["phase4"])
    labels = [row[0] for row in summary_rows([with_overflow])]
    assert "pods that overflowed" in labels and "  spill" in labels
    assert "pods that overflowed" not in [row[0] for row in summary_rows([alone])]
    figures = summary(with_overflow)
    assert figures["subnets"]["primary"]["overflow"] == ["spill"]
    assert figures["subnets"]["spill"]["podsOverflowedIn"] == figures["podsOverflowed"]


def test_same_seed_same_overflow_run() -> None:
    scenario = load(FILLS)
    runs = [
        to_json(scenario, 5, [simulate(scenario, STRATEGIES["phase4+toggle"], 5)]) for _ in (0, 1)
    ]
    assert runs[0] == runs[1]
    other = to_json(scenario, 6, [simulate(scenario, STRATEGIES["phase4+toggle"], 6)])
    assert other["strategies"] != runs[0]["strategies"]


def test_a_lane_is_its_node_in_the_subnet() -> None:
    sim = Simulation(load(FILLS), STRATEGIES["phase4"], 1)
    sim.run()
    spill = sim.subnets["spill"]
    assert spill.lanes
    for name, lane in spill.lanes.items():
        assert isinstance(lane, Lane) and lane.name == name
        assert lane.node.overflow["spill"] is lane and lane is not lane.node.primary


def test_a_drained_primary_whose_overflow_subnet_is_exhausted_still_sends_its_pods_there() -> None:
    """`overflow-drain.yaml` with a /24 for `new`: the fixed batch's spare and the rollout's
    surge exhaust it. The drained `old` grants nothing, so the pods go to `new` all the same (an
    exhausted subnet grants, one address at a time): none is left waiting at the end. Before,
    no subnet had room, and 40 pods waited to the end with 834 failed ADDs."""
    scenario = load(DRAIN)
    old, new = scenario.subnets
    smaller = replace(scenario, subnets=(old, replace(new, cidr="10.241.0.0/24")))
    figures = summary(simulate(smaller, STRATEGIES["fixed"], scenario.seed))
    assert figures["subnets"]["new"]["exhaustionFlips"] > 0  # `new` was exhausted
    assert figures["stillWaitingAtEnd"] == 0 and figures["failedPods"] == 0
