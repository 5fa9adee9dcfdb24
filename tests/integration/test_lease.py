"""Leader election on a real kube-apiserver: expiry by the candidate's clock, fencing, hand-over."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes_asyncio.client import V1LeaseSpec

from cns.controller import lease as lease_module
from cns.controller.lease import LeaderElector, LostLeadership
from cns.kube import NAMESPACE
from cns.kube.client import KubeClient, connect
from tests.harness.kube_api import CONTROLLER_USER
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture

kube = pytest.fixture(scope="module")(kube_cluster_fixture)


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> Iterator[KubeCluster]:
    kube.apply("config/rbac.yaml")
    yield kube


@pytest.fixture
async def api(cluster: KubeCluster) -> AsyncIterator[KubeClient]:
    async with await connect(str(cluster.kubeconfig_for(CONTROLLER_USER))) as api:
        yield api


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(api: KubeClient, name: str, identity: str, **extra: Any) -> LeaderElector:
    return LeaderElector(
        api,
        name=name,
        namespace=NAMESPACE,
        identity=identity,
        lease_seconds=3,
        renew_deadline_seconds=2,
        retry_seconds=0.2,
        **extra,
    )


async def test_a_holder_whose_wall_clock_is_behind_is_not_taken_over(
    api: KubeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder's renewTime is an hour old by the candidate's clock (clock skew), but it keeps
    renewing: the lease record keeps changing, so the candidate never sees it expire."""
    name = f"skew-{uuid.uuid4().hex[:6]}"
    clock = Clock()
    holder = elector(api, name, "holder")
    candidate = elector(api, name, "candidate", clock=clock)
    real_now = lease_module._now

    async def renew_with_skew() -> bool:
        monkeypatch.setattr(lease_module, "_now", lambda: real_now() - dt.timedelta(hours=1))
        try:
            return await holder._try()
        finally:
            monkeypatch.setattr(lease_module, "_now", real_now)

    assert await renew_with_skew()
    for _ in range(3):
        assert not await candidate._try()
        clock.now += 2.5  # less than the lease between two renewals
        assert await renew_with_skew()
    # The holder stops renewing: a whole lease later by the candidate's clock, it takes over.
    assert not await candidate._try()
    clock.now += 3.1
    assert await candidate._try()


async def test_the_leader_stops_writing_once_it_cannot_prove_its_lease(
    api: KubeClient,
) -> None:
    clock = Clock()
    leader = elector(api, f"fence-{uuid.uuid4().hex[:6]}", "leader", clock=clock)
    await leader.acquire()
    leader.fence()
    assert leader.can_write()
    clock.now += 1.9  # within the renew deadline of the last renewal
    assert leader.can_write()
    clock.now += 0.2  # past it: another replica may take the lease a second later
    assert not leader.can_write()
    with pytest.raises(LostLeadership):
        leader.fence()
    assert await leader._try()  # a renewal that lands proves the lease again
    leader.leading = True
    assert leader.can_write()


async def test_a_released_lease_is_taken_at_once(api: KubeClient) -> None:
    name = f"release-{uuid.uuid4().hex[:6]}"
    first = elector(api, name, "first")
    second = elector(api, name, "second")
    await first.acquire()
    assert not await second._try()
    await first.release()
    assert not first.can_write()
    assert await second._try()


async def test_a_standby_never_leads_while_a_frozen_leader_may_still_write(
    cluster: KubeCluster,
) -> None:
    """Hostile timing on purpose: the leader's event loop is held (a long synchronous step, as a
    whole-subnet planning round once was) for longer than the lease, while a standby in another
    thread campaigns with its own client and loop. The standby takes over; by then the leader's
    last proof of the lease has run out, and once its loop runs again it refuses to write."""
    name = f"frozen-{uuid.uuid4().hex[:6]}"
    kubeconfig = str(cluster.kubeconfig_for(CONTROLLER_USER))
    took_over: list[float] = []  # time.monotonic(), as the loop clocks read it

    async def campaign() -> None:
        async with await connect(kubeconfig) as standby_api:
            standby = elector(standby_api, name, "standby")
            await standby.acquire()
            took_over.append(time.monotonic())

    async with await connect(kubeconfig) as leader_api:
        leader = elector(leader_api, name, "leader")
        await leader.acquire()
        holding = asyncio.create_task(leader.hold())
        await asyncio.sleep(0.5)  # a renewal or two land
        standby_thread = threading.Thread(target=lambda: asyncio.run(campaign()))
        standby_thread.start()
        deadline = time.monotonic() + 60
        while not took_over and time.monotonic() < deadline:
            time.sleep(0.05)  # holds the leader's loop: no renewal, no fencing check runs
        standby_thread.join(timeout=30)
        assert took_over, "the standby never took the lease over"
        # The leader could prove its lease until its last renewal plus the renew deadline;
        # the standby led only after that.
        last_proof = leader._renewed_at + leader.renew_deadline_seconds
        assert took_over[0] > last_proof, (took_over[0], last_proof)
        assert not leader.can_write()
        with pytest.raises(LostLeadership):
            leader.fence()
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError, LostLeadership):
            await holding


def test_a_candidate_looks_again_when_the_lease_it_saw_would_expire() -> None:
    """Half a retry period between looks, and a look exactly at the expiry of the record last
    seen: a fail-over takes the lease duration plus at most half a retry period."""
    clock = Clock()
    candidate = LeaderElector(
        SimpleNamespace(coordination=None),  # type: ignore[arg-type]  # no call is made
        name="timing",
        namespace=NAMESPACE,
        identity="candidate",
        lease_seconds=15,
        renew_deadline_seconds=10,
        retry_seconds=2,
        clock=clock,
    )
    assert candidate._next_attempt_in() == 1.0  # nothing seen yet
    held = V1LeaseSpec(
        holder_identity="leader", lease_duration_seconds=15, renew_time=dt.datetime.now(dt.UTC)
    )
    candidate._observe(held, clock.now)
    assert candidate._next_attempt_in() == 1.0
    clock.now += 14.6
    assert candidate._next_attempt_in() == pytest.approx(0.4)
    candidate._observe(held, clock.now)  # the same record again: the expiry stays where it was
    assert candidate._next_attempt_in() == pytest.approx(0.4)
    clock.now += 1
    assert candidate._next_attempt_in() == 0.01  # expired: look now (never a busy loop)


async def test_a_candidate_that_cannot_reach_the_api_server_waits_a_retry_period() -> None:
    """A failing read is retried after a whole retry period, even when the record last seen has
    expired (where a look is otherwise due at once)."""
    reads: list[float] = []

    class Unreachable:
        async def read_namespaced_lease(self, name: str, namespace: str) -> None:
            reads.append(time.monotonic())
            raise OSError("connection refused")

    unreachable = SimpleNamespace(coordination=Unreachable())
    candidate = elector(unreachable, "unreachable", "candidate")  # type: ignore[arg-type]
    expired = V1LeaseSpec(
        holder_identity="leader", lease_duration_seconds=3, renew_time=dt.datetime.now(dt.UTC)
    )
    candidate._observe(expired, asyncio.get_running_loop().time() - 10)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(candidate.acquire(), 1.0)
    assert 2 <= len(reads) <= 6, reads  # about one a retry period, not one every 10 ms
