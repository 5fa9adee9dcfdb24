"""The world checks the state file: the pure decision (cns/core/worldcheck.py), the CRI codec of
sandboxes and their addresses (cns/host/cri.py), the inputs built from the runtime and the API
(cns/node/startup_check.py), and the decision applied to a node's pools. Real runtimes and a
real API server: tests/e2e/test_runtimes.py and tests/integration/test_kube_mode.py
(`..._state_file_lost_...`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.core.pool import Pool
from cns.core.types import IPConfig, NetworkContainer, Owner, Scaler
from cns.core.worldcheck import (
    Outcome,
    PoolEntry,
    Sighting,
    Source,
    canonical,
    check_world,
)
from cns.host.cri import (
    LiveSandbox,
    RuntimeUnavailable,
    Sandbox,
    WireError,
    sandbox_addresses,
    sandboxes,
)
from cns.kube.pods import pod_network_addresses
from cns.node.control_plane import MemorySource, SourceState
from cns.node.service import NodeIPAM
from cns.node.startup_check import WorldCheck, api_sightings, runtime_sightings
from cns.state.store import Store
from cns.web.views import pool_view
from tests.integration.test_state_safety import network, on_disk
from tests.unit.node.test_leaks import sandbox_list_reply


def owner(container: str, pod: str = "", ifname: str = "eth0") -> Owner:
    namespace, _, name = pod.partition("/")
    return Owner(container, ifname, pod_name=name, pod_namespace=namespace)


def cri(address: str, container: str, pod: str = "") -> Sighting:
    return Sighting(Source.CRI, address, owner(container, pod))


def api(address: str, pod: str, container: str = "api:uid") -> Sighting:
    return Sighting(Source.API, address, owner(container, pod))


def entry(ip_id: str, holder: Owner | None = None, lane: str = "") -> PoolEntry:
    return PoolEntry(lane, ip_id, holder)


def outcomes(findings: list) -> dict[str, Outcome]:  # type: ignore[type-arg]
    return {f.address: f.outcome for f in findings}


# --- the decision ---------------------------------------------------------------------------


def test_each_outcome() -> None:
    pool = {
        "10.0.0.1": entry("ip-1"),  # free: adopted
        "10.0.0.2": entry("ip-2", owner("s2", "ns/b")),  # the same sandbox: fine
        "10.0.0.3": entry("ip-3", owner("other", "ns/x")),  # another owner: conflict
    }
    findings = check_world(
        pool,
        [
            cri("10.0.0.1", "s1", "ns/a"),
            cri("10.0.0.2", "s2", "ns/b"),
            cri("10.0.0.3", "s3", "ns/c"),
            cri("10.0.0.4", "s4", "ns/d"),  # in no network container: unknown
        ],
    )
    assert outcomes(findings) == {
        "10.0.0.1": Outcome.ADOPTED,
        "10.0.0.2": Outcome.FINE,
        "10.0.0.3": Outcome.CONFLICT,
        "10.0.0.4": Outcome.UNKNOWN,
    }
    adopted = findings[0]
    assert adopted.owner == owner("s1", "ns/a") and adopted.entry == pool["10.0.0.1"]
    assert "pod ns/x (container other)" in findings[2].why
    assert "ns/c" in findings[2].why


def test_the_api_names_the_pod_only() -> None:
    pool = {
        "10.0.0.1": entry("ip-1", owner("sandbox", "ns/a")),
        "10.0.0.2": entry("ip-2", owner("sandbox-b", "ns/b")),
        "10.0.0.3": entry("ip-3", owner("anon")),  # the runtime named no pod: cannot tell
    }
    findings = check_world(
        pool, [api("10.0.0.1", "ns/a"), api("10.0.0.2", "ns/other"), api("10.0.0.3", "ns/c")]
    )
    assert outcomes(findings) == {
        "10.0.0.1": Outcome.FINE,
        "10.0.0.2": Outcome.CONFLICT,
        "10.0.0.3": Outcome.FINE,
    }


def test_the_runtime_and_the_api_agreeing_adopt_under_the_sandbox_id() -> None:
    (finding,) = check_world(
        {"10.0.0.1": entry("ip-1")}, [api("10.0.0.1", "ns/a"), cri("10.0.0.1", "s1", "ns/a")]
    )
    assert finding.outcome is Outcome.ADOPTED and finding.owner.container_id == "s1"
    assert [s.source for s in finding.sightings] == [Source.CRI, Source.API]


def test_an_address_adopted_on_the_api_s_word_is_fine_when_the_runtime_names_its_pod() -> None:
    pool = {"10.0.0.1": entry("ip-1", owner("api:uid-a", "ns/a"))}
    assert outcomes(check_world(pool, [cri("10.0.0.1", "s1", "ns/a")])) == {
        "10.0.0.1": Outcome.FINE
    }
    assert outcomes(check_world(pool, [cri("10.0.0.1", "s1", "ns/b")])) == {
        "10.0.0.1": Outcome.CONFLICT
    }


@pytest.mark.parametrize(
    "sightings",
    [
        [cri("10.0.0.1", "s1", "ns/a"), cri("10.0.0.1", "s2", "ns/b")],  # two sandboxes
        [cri("10.0.0.1", "s1", "ns/a"), api("10.0.0.1", "ns/b")],  # the runtime and the API
        [api("10.0.0.1", "ns/a"), api("10.0.0.1", "ns/b")],  # two pods
    ],
)
def test_a_world_that_names_two_holders_adopts_nothing(sightings: list[Sighting]) -> None:
    for pool in ({"10.0.0.1": entry("ip-1")}, {}):
        (finding,) = check_world(pool, sightings)
        assert finding.outcome is Outcome.CONFLICT and "more than one holder" in finding.why


def test_an_owner_holds_one_address_per_lane() -> None:
    pool = {
        "10.0.0.1": entry("ip-1"),
        "10.0.0.2": entry("ip-2"),
        "10.0.0.3": entry("ip-3", owner("s2", "ns/b")),
        "10.0.0.4": entry("ip-4"),
        "fd00::1": entry("ip-6", lane="v6"),
    }
    findings = check_world(
        pool,
        [
            cri("10.0.0.1", "s1", "ns/a"),
            cri("10.0.0.2", "s1", "ns/a"),  # a second one of the same lane: refused
            cri("10.0.0.4", "s2", "ns/b"),  # holds 10.0.0.3 there already
            cri("fd00::1", "s1", "ns/a"),  # another lane: adopted too
        ],
    )
    assert outcomes(findings) == {
        "10.0.0.1": Outcome.ADOPTED,
        "10.0.0.2": Outcome.CONFLICT,
        "10.0.0.4": Outcome.CONFLICT,
        "fd00::1": Outcome.ADOPTED,
    }


def test_addresses_are_compared_in_canonical_form() -> None:
    assert canonical("10.0.0.5/24") == canonical(" 10.0.0.5") == "10.0.0.5"
    assert canonical("FD00:0::0001") == "fd00::1"
    assert canonical("garbage") is None and canonical("10.0.0.999") is None


ADDRESSES = [f"10.0.0.{n}" for n in range(1, 9)]
CONTAINERS = ["s1", "s2", "s3", "s4"]
PODS = ["", "ns/a", "ns/b"]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[dict[str, PoolEntry], list[Sighting]]:
    pool: dict[str, PoolEntry] = {}
    taken: set[tuple[str, str]] = set()  # (lane, container): one address per lane
    for n, address in enumerate(ADDRESSES[:6]):  # 10.0.0.7 and .8 are in no container
        lane = draw(st.sampled_from(["", "x"]))
        holder = draw(st.none() | st.tuples(st.sampled_from(CONTAINERS), st.sampled_from(PODS)))
        if holder is not None and (lane, holder[0]) in taken:
            holder = None
        if holder is not None:
            taken.add((lane, holder[0]))
        pool[address] = entry(f"ip-{n}", owner(*holder) if holder else None, lane)
    sightings = draw(
        st.lists(
            st.builds(
                Sighting,
                st.sampled_from(Source),
                st.sampled_from(ADDRESSES),
                st.builds(owner, st.sampled_from(CONTAINERS), st.sampled_from(PODS)),
            ),
            max_size=12,
        )
    )
    return pool, sightings


@given(worlds())
def test_property_never_two_holders_and_each_named_address_decided_once(
    world: tuple[dict[str, PoolEntry], list[Sighting]],
) -> None:
    pool, sightings = world
    findings = check_world(pool, sightings)
    assert sorted(f.address for f in findings) == sorted({s.address for s in sightings})
    held = {(e.lane, e.holder.key): a for a, e in pool.items() if e.holder is not None}
    for finding in findings:
        found = pool.get(finding.address)
        assert finding.entry == found
        if finding.outcome is Outcome.UNKNOWN:
            assert found is None
        if finding.outcome is Outcome.ADOPTED:
            # only a free address, to the one holder the world names, never a second per lane
            assert found is not None and found.holder is None
            assert len({s.owner.container_id for s in finding.sightings
                        if s.source is Source.CRI}) <= 1  # fmt: skip
            assert len({s.owner.pod for s in finding.sightings if s.owner.pod}) <= 1
            key = (found.lane, finding.owner.key)
            assert key not in held, (key, held)
            held[key] = finding.address
        if finding.outcome is Outcome.FINE:
            assert found is not None and found.holder is not None
        if found is not None and found.holder is not None:
            assert finding.outcome in (Outcome.FINE, Outcome.CONFLICT)
    # the order the world names them in changes only which of two addresses of one owner in one
    # lane is adopted (the other is refused)
    stable = {Outcome.FINE, Outcome.UNKNOWN}
    again = outcomes(check_world(pool, list(reversed(sightings))))
    assert {a: o for a, o in again.items() if o in stable} == {
        a: o for a, o in outcomes(findings).items() if o in stable
    }


# --- the decision applied to a pool -----------------------------------------------------------


def test_pool_adopt_takes_an_address_out_of_any_free_state() -> None:
    nc = NetworkContainer(
        "nc", ("10.0.0.2",), "10.0.0.0/24", "10.0.0.1",
        tuple(IPConfig(f"ip-{n}", f"10.0.0.{n}", 1) for n in range(10, 14)), 1, 1,
    )  # fmt: skip
    pool = Pool()
    pool.apply_nc(nc)
    pool.assign(owner("gone", "ns/gone"))
    pool.release(owner("gone").key, cool_until=2e9)  # ip-10 cools down
    pool.mark_pending_release(1)  # ip-13 is being given back
    for n, ip_id in enumerate(("ip-10", "ip-11", "ip-13")):
        record = pool.adopt(ip_id, owner(f"s{n}", "ns/a"))
        assert record.owner == owner(f"s{n}", "ns/a")
    assert pool.ips_not_in_use() == () and pool.cooling_count() == 0
    assert pool.available_count() == 1
    assert pool.assign(owner("new"))[0].id == "ip-12"  # type: ignore[union-attr]


# --- the inputs: CRI replies, the API's pods --------------------------------------------------


def test_sandboxes_and_addresses_read_replies_encoded_by_the_cri_api_itself() -> None:
    from tests.harness.cri import cri_stubs

    pb2, _ = cri_stubs()
    listed = sandbox_list_reply(4)
    assert sandboxes(listed) == [Sandbox(f"{n:064x}", n % 2 == 0, "ns", f"p{n}") for n in range(4)]
    status = pb2.PodSandboxStatusResponse(
        status=pb2.PodSandboxStatus(
            id="s",
            state=pb2.SANDBOX_READY,
            network=pb2.PodSandboxNetworkStatus(
                ip="10.0.0.5", additional_ips=[pb2.PodIP(ip="fd00::5")]
            ),
        ),
        info={"info": "{}"},
    ).SerializeToString()
    assert sandbox_addresses(status) == (True, ("10.0.0.5", "fd00::5"))
    stopped = pb2.PodSandboxStatusResponse(
        status=pb2.PodSandboxStatus(id="s", state=pb2.SANDBOX_NOTREADY)
    ).SerializeToString()
    assert sandbox_addresses(stopped) == (False, ())
    from cns.host.cri import _status_request

    asked = pb2.PodSandboxStatusRequest.FromString(_status_request("x" * 300))
    assert asked.pod_sandbox_id == "x" * 300 and not asked.verbose


@given(st.binary(max_size=64))
def test_any_bytes_either_decode_or_raise(data: bytes) -> None:
    with contextlib.suppress(WireError, UnicodeDecodeError):
        sandboxes(data)
    with contextlib.suppress(WireError, UnicodeDecodeError):
        sandbox_addresses(data)


def test_the_runtime_and_the_api_as_sightings() -> None:
    live = [
        LiveSandbox(Sandbox("s1", True, "ns", "a"), ("10.0.0.1", "fd00::0001")),
        LiveSandbox(Sandbox("s2", True, "", ""), ("not-an-address",)),
    ]
    assert runtime_sightings(live) == [
        cri("10.0.0.1", "s1", "ns/a"),
        cri("fd00::1", "s1", "ns/a"),
    ]
    pods = [("ns/a", "uid-a", ("10.0.0.1",)), ("ns/b", "uid-b", ("10.0.0.2",))]
    assert api_sightings(pods, live) == [
        api("10.0.0.1", "ns/a", "s1"),  # the runtime's sandbox of the pod
    ]  # ns/b: the runtime has no sandbox of it, whatever its status still says
    assert api_sightings(pods, None) == [  # no answer from the runtime: the API's word
        api("10.0.0.1", "ns/a", "api:uid-a"),
        api("10.0.0.2", "ns/b", "api:uid-b"),
    ]


def test_the_api_s_addresses_of_a_pod() -> None:
    def pod(spec: dict, status: dict) -> dict:  # type: ignore[type-arg]
        return {"spec": spec, "status": status}

    running = {"phase": "Running", "podIP": "10.0.0.1",
               "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}  # fmt: skip
    assert pod_network_addresses(pod({}, running)) == ("10.0.0.1", "fd00::1")
    assert pod_network_addresses(pod({}, {"podIP": "10.0.0.1"})) == ("10.0.0.1",)
    assert pod_network_addresses(pod({"hostNetwork": True}, running)) == ()
    assert pod_network_addresses(pod({}, {**running, "phase": "Succeeded"})) == ()
    deleted = {**pod({}, running), "metadata": {"deletionTimestamp": "2026-11-28T00:00:00Z"}}
    assert pod_network_addresses(deleted) == ()
    assert pod_network_addresses(pod({}, {"podIPs": ["junk", {"ip": 5}]})) == ()
    assert pod_network_addresses({}) == ()


# --- the check against the node service (a real Store; the world given by the test) ----------


class World:
    """What the runtime and the API say, set by the test; `None`: no answer yet."""

    def __init__(self) -> None:
        self.live: list[LiveSandbox] | None = None
        self.pods: list[tuple[str, str, tuple[str, ...]]] | None = None

    async def live_sandboxes(self) -> list[LiveSandbox]:
        if self.live is None:
            raise RuntimeUnavailable("CRI /run/test.sock: UNAVAILABLE: connection refused")
        return self.live

    def pod_addresses(self) -> list[tuple[str, str, tuple[str, ...]]] | None:
        return self.pods


async def until(condition: Callable[[], object], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_adds_wait_for_the_check_and_never_get_what_the_world_says_is_held(
    tmp_path: Path,
) -> None:
    """The runtime answers at once, the API only after the wait: ADDs wait (wait reason
    `world-check`) until the gate opens, the runtime's address is adopted before that and
    durably, the API's is adopted when it answers; an address in no network container is
    remembered and adopted when the control plane brings it."""
    store = Store(tmp_path / "state.db")
    store.open()
    node = NodeIPAM(Pool(), store, MemorySource(), Scaler(batch_size=16), 5.0)
    node.on_state(SourceState((network(4),)))  # 10.1.0.10 .. 10.1.0.13
    world = World()
    world.live = [
        LiveSandbox(Sandbox("s1", True, "ns", "a"), ("10.1.0.10",)),
        LiveSandbox(Sandbox("s9", True, "ns", "z"), ("10.1.0.99",)),  # in no container yet
        LiveSandbox(Sandbox("s2", True, "ns", "b"), ()),  # the runtime names no address
        LiveSandbox(Sandbox("s3", True, "ns", "c"), ()),
    ]
    check = WorldCheck(node, world, world.pod_addresses, wait_seconds=0.5)
    check.close_gate()
    assert node.wait_reason().code == "world-check" and not node.world_gate_open
    waiting = asyncio.create_task(node.add(owner("new", "ns/new")))
    running = asyncio.create_task(check.run())
    try:
        await asyncio.sleep(0.1)
        assert not waiting.done() and "has not finished" in node.wait_reason().message
        got = await waiting  # served once the gate opened, without the API
        assert got.record.address == "10.1.0.11"  # not the sandbox's 10.1.0.10
        assert node.world.state == "partial" and node.world.sources["cri"] == "checked"
        assert on_disk(tmp_path / "state.db")["ip-10"] == ("s1", "eth0", "a")
        assert sorted(node.world.remembered) == ["10.1.0.99"]

        world.pods = [
            ("ns/b", "uid-b", (got.record.address,)),
            ("ns/c", "uid-c", ("10.1.0.12",)),
            ("ns/gone", "uid-g", ("10.1.0.13",)),  # no sandbox in the runtime: not taken
        ]
        await until(lambda: node.world.state == "done", "the API's pods checked")
        assert node.world.outcomes == Counter(adopted=2, unknown=1, conflict=1)
        held = {r.address: r.owner for r in node.pool.records.values()}
        assert held["10.1.0.12"] == owner("s3", "ns/c")  # the API's, under the runtime's id
        assert held["10.1.0.13"] is None
        assert held[got.record.address] == owner("new", "ns/new")  # refused: nobody loses it
        conflict = next(f for f in node.world.findings if f.outcome is Outcome.CONFLICT)
        assert conflict.address == got.record.address

        bigger = dataclasses.replace(network(4), ip_configs=(
            *network(4).ip_configs, IPConfig("ip-99", "10.1.0.99", 1)), version=2)  # fmt: skip
        node.on_state(SourceState((bigger,)))
        assert node.pool.records["ip-99"].owner == owner("s9", "ns/z")
        assert node.world.remembered == {}
        await node.durable(node.commits.pending(owner("s9").key))
        assert on_disk(tmp_path / "state.db")["ip-99"] == ("s9", "eth0", "z")
        view = pool_view(node)["worldCheck"]
        assert view["outcomes"] == {"adopted": 3, "conflict": 1, "unknown": 1}
        assert view["addsWaiting"] is False and view["remembered"] == []
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        store.close()
