"""NodeIPAM on its own: the control plane is played in memory
(cns.node.control_plane.MemorySource), the store is a real SQLite file, and the reconcile loop
is driven step by step.

Where the daemon's loop would reconcile, a test calls `reconcile_once()`; it awaits ADDs and
events, never the wall clock (an ADD's wait bound is an hour, or zero to see it run out).
With B = 16, mf = 50 %, Mf = 150 % and one primary IP, the target for a demand U is
16 * ceil(0.5 + U / 16) - 1, and the pool shrinks only when more than 24 IPs are free.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from cns.core.pool import Pool
from cns.core.types import IPConfig, IPState, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler
from cns.node import errors as node_module
from cns.node import publisher
from cns.node.control_plane import MemorySource, SourceState
from cns.node.errors import IPAMError, PublishFailed
from cns.node.service import AddResult, NodeIPAM
from cns.state.store import Store
from cns.web.api import BodyTimeout, http_status

HOUR = 3600.0


def network(numbers: Iterable[int], version: int = 1) -> NetworkContainer:
    """The node's network container listing the IPs 10.1.0.<n> (ids ip-<n>), all programmed."""
    configs = tuple(IPConfig(f"ip-{n}", f"10.1.0.{n}", version) for n in numbers)
    return NetworkContainer(
        "nc1", ("10.1.0.2",), "10.1.0.0/24", "10.1.0.1", configs, version, version
    )


def answer(source: MemorySource, nc: NetworkContainer, release: tuple[str, ...] = ()) -> None:
    """The control plane's next state: `nc`, with the node's last request as what it heard."""
    heard = source.published[-1] if source.published else source.state.request
    source.tell(SourceState((nc,), request=heard, release_requests=release))


async def turns_until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run (the loop turns, no time is waited for) until `condition` holds."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def all_served(*adds: asyncio.Task[AddResult]) -> list[AddResult]:
    """The results of ADDs that must be served now: a bug fails the test instead of leaving it
    waiting out the hour."""
    await turns_until(lambda: all(add.done() for add in adds))
    return [add.result() for add in adds]


class Node:
    """A NodeIPAM and the control plane it follows, with the `run` task of that source."""

    def __init__(self, path: Path, add_timeout_seconds: float, state: SourceState) -> None:
        self.store = Store(path)
        self.store.open()
        self.source = MemorySource(state)
        self.ipam = NodeIPAM(Pool(), self.store, self.source, Scaler(), add_timeout_seconds)
        self.tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self.tasks.append(asyncio.create_task(self.source.run(self.ipam.on_state)))
        await self.ipam.has_network.wait()

    def add(self, name: str) -> asyncio.Task[AddResult]:
        task = asyncio.create_task(self.ipam.add(Owner(name, "eth0", name, "shop")))
        self.tasks.append(task)
        return task

    def addresses(self, state: IPState) -> set[str]:
        return {r.id for r in self.ipam.pool.records.values() if r.state is state}

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, IPAMError):
                await task
        self.store.close()


@pytest.fixture
async def make_node(tmp_path: Path) -> AsyncIterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(
        *, add_timeout_seconds: float = HOUR, state: SourceState | None = None, name: str = "a"
    ) -> Node:
        # At first the control plane has given the node its network container, no IP yet.
        node = Node(
            tmp_path / f"{name}.db", add_timeout_seconds, state or SourceState((network(()),))
        )
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        await node.stop()


async def test_an_add_waits_for_ips_and_is_served_when_the_control_plane_grants_them(
    make_node: Callable[..., Node],
) -> None:
    node = make_node()
    await node.start()
    add = node.add("web-1")
    await turns_until(lambda: node.ipam.waiting_count() == 1)
    assert await node.ipam.reconcile_once() == PoolRequest(15)
    assert node.source.published == [PoolRequest(15)]
    assert not add.done()  # nothing granted yet: still waiting
    answer(node.source, network(range(10, 25)))
    (served,) = await all_served(add)
    assert served.record.address == "10.1.0.10" and served.network.gateway == "10.1.0.1"
    assert node.store.assignments[served.record.id].owner == Owner("web-1", "eth0", "web-1", "shop")
    assert node.ipam.waiting_count() == 0
    assert await node.ipam.reconcile_once() is None  # the target for U = 1 is what was sent


async def test_an_add_that_waits_in_vain_says_why(make_node: Callable[..., Node]) -> None:
    node = make_node(add_timeout_seconds=0.0)
    await node.start()
    with pytest.raises(node_module.Unavailable) as pending:
        await node.add("web-1")
    assert pending.value.code == 11
    assert "allocation still pending" in pending.value.msg
    assert node.ipam.waiting_count() == 0  # the ADD that gave up is no longer demand
    node.source.tell(SourceState((network(()),), exhausted=True))
    with pytest.raises(node_module.Unavailable, match="subnet exhausted"):
        await node.add("web-2")


async def test_a_burst_of_adds_becomes_one_request_and_grows_once_more_while_it_is_out(
    make_node: Callable[..., Node],
) -> None:
    node = make_node()
    await node.start()
    burst = [node.add(f"web-{n}") for n in range(20)]
    await turns_until(lambda: node.ipam.waiting_count() == 20)
    assert await node.ipam.reconcile_once() == PoolRequest(31)  # 16 * ceil(0.5 + 20/16) - 1
    assert await node.ipam.reconcile_once() is None  # the burst is in that one request
    later = [node.add(f"db-{n}") for n in range(10)]
    await turns_until(lambda: node.ipam.waiting_count() == 30)
    assert await node.ipam.reconcile_once() == PoolRequest(47)  # grows once for all ten
    assert node.source.published == [PoolRequest(31), PoolRequest(47)]
    answer(node.source, network(range(10, 57)))
    results = await all_served(*burst, *later)
    assert len({result.record.address for result in results}) == 30
    assert len(node.store.assignments) == 30
    assert await node.ipam.reconcile_once() is None


async def test_unused_ips_go_back_through_the_ips_not_in_use_handshake(
    make_node: Callable[..., Node],
) -> None:
    node = make_node(state=SourceState((network(range(10, 41)),), request=PoolRequest(31)))
    await node.start()
    pods = await all_served(*(node.add(f"web-{n}") for n in range(20)))
    assert {result.record.id for result in pods} == {f"ip-{n}" for n in range(10, 30)}
    for n in range(2, 20):
        await node.ipam.delete(OwnerKey(f"web-{n}", "eth0"))
    # U = 2: 29 free is above the release threshold (24), so the request shrinks to 15.
    shrunk = await node.ipam.reconcile_once()
    assert shrunk is not None and shrunk.requested_ip_count == 15
    released = set(shrunk.ips_not_in_use)
    assert len(released) == 16
    assert released == {f"ip-{n}" for n in range(25, 41)}  # highest addresses first
    assert node.addresses(IPState.PENDING_RELEASE) == released
    # Until the control plane drops them, they stay out of reach, even when it repeats them.
    answer(node.source, network(range(10, 41)))
    assert node.addresses(IPState.PENDING_RELEASE) == released
    more = await all_served(*(node.add(f"db-{n}") for n in range(13)))
    assert not {result.record.id for result in more} & released
    assert node.ipam.pool.available_count() == 0
    # The control plane's next version no longer lists them: they leave, and the list empties.
    answer(node.source, network(range(10, 25), version=2))
    assert not node.addresses(IPState.PENDING_RELEASE)
    assert len(node.ipam.pool.records) == 15
    assert await node.ipam.reconcile_once() == PoolRequest(31)  # U = 15 now wants 31, none out
    assert await node.ipam.reconcile_once() is None


async def test_a_restarted_node_keeps_the_ips_its_last_request_gave_back(
    make_node: Callable[..., Node],
) -> None:
    # The snapshot says the node had asked to give back ip-24 and ip-23; the control plane has
    # not dropped them yet and may hand them to another node at any moment.
    given_back = PoolRequest(15, ("ip-23", "ip-24"))
    state = SourceState((network(range(10, 25)),), request=given_back, from_snapshot=True)
    node = make_node(state=state)
    await node.start()
    results = await all_served(*(node.add(f"web-{n}") for n in range(13)))
    assert not {result.record.id for result in results} & {"ip-23", "ip-24"}
    assert node.addresses(IPState.PENDING_RELEASE) == {"ip-23", "ip-24"}


async def test_ips_the_control_plane_asks_back_are_given_up_unless_a_pod_uses_them(
    make_node: Callable[..., Node],
) -> None:
    node = make_node(state=SourceState((network(range(10, 25)),), request=PoolRequest(15)))
    await node.start()
    (used,) = await all_served(node.add("web-1"))
    assert used.record.id == "ip-10"
    answer(node.source, network(range(10, 25)), release=("ip-20", "ip-10"))
    assert node.addresses(IPState.PENDING_RELEASE) == {"ip-20"}
    assert node.ipam.pool.records["ip-10"].owner == Owner("web-1", "eth0", "web-1", "shop")
    assert node.ipam.inconsistencies_total == 1  # the refusal is reported once...
    answer(node.source, network(range(10, 25)), release=("ip-20", "ip-10"))
    assert node.ipam.inconsistencies_total == 1  # ...not again while the ask stands
    assert await node.ipam.reconcile_once() == PoolRequest(15, ("ip-20",))
    # The control plane takes ip-20 back and hands out another: the node is whole again.
    answer(node.source, network([*range(10, 20), *range(21, 26)], version=2))
    assert not node.addresses(IPState.PENDING_RELEASE)
    assert len(node.ipam.pool.records) == 15
    assert await node.ipam.reconcile_once() == PoolRequest(15)


async def test_a_request_the_control_plane_did_not_receive_is_sent_again(
    make_node: Callable[..., Node],
) -> None:
    node = make_node()
    await node.start()
    node.add("web-1")
    await turns_until(lambda: node.ipam.waiting_count() == 1)
    node.source.reachable = False
    with pytest.raises(PublishFailed, match="control plane unreachable") as failed:
        await node.ipam.reconcile_once()
    assert isinstance(failed.value.__cause__, ConnectionError)
    assert node.ipam.primary.sent is None and node.ipam.publishes_total == 0
    node.source.reachable = True
    assert await node.ipam.reconcile_once() == PoolRequest(15)
    assert node.ipam.publishes_total == 1


async def test_the_reconcile_loop_serves_a_waiting_add_and_retries_a_failed_publish(
    make_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    # An ADD waiting for an IP ends the coalescing pause at once, so with no retry delay the
    # loop runs without waiting for any time to pass.
    monkeypatch.setattr(publisher, "PUBLISH_RETRY_SECONDS", (0.0,))
    node = make_node()
    await node.start()
    node.source.reachable = False
    node.tasks.append(asyncio.create_task(node.ipam.reconcile_forever()))
    add = node.add("web-1")
    await turns_until(lambda: node.ipam.waiting_count() == 1)
    await turns_until(lambda: len(node.source.unheard) >= 3)  # tried, failed, tried again...
    assert node.source.published == []
    node.source.reachable = True
    await turns_until(lambda: node.source.published == [PoolRequest(15)])
    answer(node.source, network(range(10, 25)))
    assert (await all_served(add))[0].record.address == "10.1.0.10"


def test_each_kind_of_failure_has_the_http_status_docs_api_md_gives() -> None:
    assert [
        http_status(error)
        for error in (
            node_module.InvalidRequest(4, "podName: too long"),
            BodyTimeout(6, "request body not received within 5 s"),
            node_module.NotFound(3, "no IP allocated"),
            node_module.Conflict(4, "belongs to another pod"),
            node_module.Conflict(11, "conflicts with the state file"),
            node_module.InternalError(105, "cannot set up eth0"),
            node_module.Unavailable(11, "no free IP"),
            node_module.Unavailable(5, "cannot commit state"),
        )
    ] == [400, 408, 404, 409, 409, 500, 503, 503]
    assert http_status(IPAMError(102, "a kind nobody listed")) == 500


async def test_a_restart_publishes_nothing_until_the_control_planes_own_state_arrives(
    make_node: Callable[..., Node],
) -> None:
    """Restarted with 40 pods scheduled here and none started yet: the control plane holds the
    47 IPs the node asked for. The snapshot file has no pods, so planned from it the demand is
    0: before, the node asked to shrink to 15 and gave 32 IPs back, then, once the pods were
    listed, asked for 47 again (two writes, 32 IPs released and granted anew). It waits for
    the control plane's own state, which says the same as it would: it publishes nothing."""
    nc = network(range(10, 57))
    node = make_node(state=SourceState((nc,), request=PoolRequest(47), from_snapshot=True))
    await node.start()
    assert await node.ipam.reconcile_once() is None
    assert not node.addresses(IPState.PENDING_RELEASE)
    node.source.tell(SourceState((nc,), request=PoolRequest(47), pod_demand=40))
    assert await node.ipam.reconcile_once() is None
    assert node.source.published == [] and node.ipam.publishes_total == 0
    assert len(node.addresses(IPState.AVAILABLE)) == 47
