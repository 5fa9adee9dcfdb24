"""The client-side rate limit of the Kubernetes client (client-go's token bucket), and the
fencing check that follows it."""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from cns.controller.lease import LostLeadership
from cns.kube.client import KubeClient, TokenBucket
from cns.kube.objects import IP_BLOCK


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_goes_at_once_then_requests_are_spaced_by_one_over_qps() -> None:
    clock = Clock()
    bucket = TokenBucket(10, 3, clock=clock)
    assert [bucket.reserve() for _ in range(3)] == [0, 0, 0]
    waits = [bucket.reserve() for _ in range(3)]
    assert waits == pytest.approx([0.1, 0.2, 0.3])  # each caller waits for its own token


def test_tokens_come_back_at_qps_and_never_beyond_the_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(10, 2, clock=clock)
    bucket.reserve(), bucket.reserve()
    clock.now += 0.1
    assert bucket.reserve() == pytest.approx(0)  # one token came back
    assert bucket.reserve() == pytest.approx(0.1)
    clock.now += 60  # a long quiet spell saves only `burst` tokens
    assert [bucket.reserve() for _ in range(2)] == [0, 0]
    assert bucket.reserve() == pytest.approx(0.1)


def test_zero_qps_is_no_limit_and_a_bad_burst_is_refused() -> None:
    bucket = TokenBucket(0, 1)
    assert all(bucket.reserve() == 0 for _ in range(1000))
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(5, 0)


async def test_a_write_proves_the_lease_after_its_wait_for_a_token() -> None:
    """The controller's fencing check (`before_write`) runs once the rate limit has admitted
    the write: a check made before a long wait for a token would prove nothing at send time."""
    order: list[str] = []

    class Bucket(TokenBucket):
        async def acquire(self) -> None:
            order.append("token")

    def fence() -> None:
        order.append("fence")
        raise LostLeadership("not renewed in time")

    api = client.ApiClient()
    try:
        kube = KubeClient(api, limit=Bucket(1, 1))
        kube.before_write = fence
        body = {"metadata": {"name": "b"}}
        for write in (
            kube.create(IP_BLOCK, body),
            kube.replace(IP_BLOCK, "b", body),
            kube.merge_patch(IP_BLOCK, "b", body),
        ):
            with pytest.raises(LostLeadership):
                await write
        assert order == ["token", "fence"] * 3
    finally:
        await api.close()
