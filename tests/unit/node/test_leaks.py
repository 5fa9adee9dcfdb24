"""Leak reclamation: the pure decision (cns/core/leaks.py), the CRI reply codec (cns/host/cri.py)
and the check's loop against a node service (cns/node/leak_reclaim.py). Real runtimes:
tests/e2e/test_runtimes.py (containerd) and tests/e2e/test_node_e2e.py (kubelet)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cns.core.leaks import Held, LeakReason, Suspect, find_leaks
from cns.core.types import OwnerKey
from cns.host.cri import SERVICES, CriSandboxes, RuntimeUnavailable, WireError, fields, sandbox_ids

GRACE = 60.0


def held(container: str, pod: str = "", ifname: str = "eth0", ip: str = "") -> Held:
    ip = ip or f"ip-{container}"
    return Held(OwnerKey(container, ifname), ip, f"10.0.0.{len(container)}", pod)


def check(
    items: list[Held],
    *,
    sandboxes: set[str] | None,
    pods: dict[str, bool] | None = None,
    waiting: tuple[tuple[str, OwnerKey], ...] = (),
    suspects: dict[OwnerKey, Suspect] | None = None,
    now: float = 0.0,
) -> tuple[dict[OwnerKey, Suspect], list[Suspect]]:
    verdict = find_leaks(
        items,
        sandboxes=frozenset(sandboxes) if sandboxes is not None else None,
        pods=pods,
        waiting=waiting,
        suspects=suspects or {},
        now=now,
        now_wall=1_000_000 + now,
        grace_seconds=GRACE,
    )
    return verdict.suspects, verdict.leaks


def reasons(suspects: dict[OwnerKey, Suspect]) -> dict[str, LeakReason]:
    return {key.container_id: s.reason for key, s in suspects.items()}


def test_a_sandbox_the_runtime_lists_is_never_suspected() -> None:
    items = [held("a", "ns/gone"), held("b")]
    suspects, leaks = check(items, sandboxes={"a", "b"}, pods={})
    assert suspects == {} and leaks == []


def test_standalone_a_missing_sandbox_is_a_leak_after_the_grace_only() -> None:
    items = [held("a"), held("b")]
    suspects, leaks = check(items, sandboxes={"b"}, pods=None, now=0)
    assert reasons(suspects) == {"a": LeakReason.SANDBOX_GONE} and leaks == []
    suspects, leaks = check(items, sandboxes={"b"}, suspects=suspects, now=GRACE - 1)
    assert leaks == [] and suspects[items[0].key].since == 0
    suspects, leaks = check(items, sandboxes={"b"}, suspects=suspects, now=GRACE)
    assert [s.held for s in leaks] == [items[0]]


def test_a_sandbox_that_comes_back_clears_the_suspicion_and_restarts_the_clock() -> None:
    items = [held("a")]
    suspects, _ = check(items, sandboxes=set(), now=0)
    suspects, _ = check(items, sandboxes={"a"}, suspects=suspects, now=10)  # listed again
    assert suspects == {}
    suspects, leaks = check(items, sandboxes=set(), suspects=suspects, now=GRACE + 1)
    assert leaks == [] and suspects[items[0].key].since == GRACE + 1


def test_no_answer_from_the_runtime_decides_nothing_and_keeps_the_suspects_age() -> None:
    items = [held("a"), held("b")]
    suspects, _ = check(items, sandboxes=set(), now=0)
    kept, leaks = check(items[1:], sandboxes=None, suspects=suspects, now=GRACE * 10)
    assert leaks == []
    assert list(kept) == [items[1].key] and kept[items[1].key].since == 0  # a is no longer held
    _, leaks = check(items[1:], sandboxes=set(), suspects=kept, now=GRACE * 10)
    assert [s.held for s in leaks] == [items[1]]


def test_the_same_attachment_with_another_ip_is_a_new_suspect() -> None:
    suspects, _ = check([held("a", ip="ip-1")], sandboxes=set(), now=0)
    suspects, leaks = check([held("a", ip="ip-2")], sandboxes=set(), suspects=suspects, now=GRACE)
    assert leaks == [] and next(iter(suspects.values())).since == GRACE


def test_kubernetes_reasons() -> None:
    items = [
        held("gone", "ns/deleted"),
        held("ended", "ns/job"),
        held("old", "ns/web"),  # re-created in "new" without a DEL
        held("new", "ns/web"),
        held("restarting", "ns/db"),  # the pod is there and has no other sandbox yet
        held("unnamed"),  # the runtime named no pod: the runtime alone decides
    ]
    pods = {"ns/job": False, "ns/web": True, "ns/db": True}
    suspects, _ = check(items, sandboxes={"new"}, pods=pods)
    assert reasons(suspects) == {
        "gone": LeakReason.POD_GONE,
        "ended": LeakReason.POD_ENDED,
        "old": LeakReason.SANDBOX_REPLACED,
        "unnamed": LeakReason.SANDBOX_GONE,
    }


def test_a_pod_whose_new_sandbox_waits_for_an_ip_frees_its_old_one() -> None:
    """A full node: the re-created sandbox's ADD waits, and only the leaked IP can serve it."""
    old = held("old", "ns/web")
    pods = {"ns/web": True}
    suspects, _ = check([old], sandboxes=set(), pods=pods)
    assert suspects == {}
    waiting = (("ns/web", OwnerKey("new", "eth0")),)
    suspects, _ = check([old], sandboxes=set(), pods=pods, waiting=waiting)
    assert reasons(suspects) == {"old": LeakReason.SANDBOX_REPLACED}
    other_interface = (("ns/web", OwnerKey("new", "net1")),)
    assert check([old], sandboxes=set(), pods=pods, waiting=other_interface)[0] == {}


# A history: each step the runtime lists some sandboxes (or cannot answer), time moves on.
steps = st.lists(
    st.tuples(
        st.one_of(st.none(), st.frozensets(st.sampled_from("abcdef"))),
        st.floats(0, GRACE / 2),
    ),
    min_size=1,
    max_size=20,
)


@given(steps, st.dictionaries(st.sampled_from(["ns/p", "ns/q"]), st.booleans()) | st.none())
def test_only_an_ip_whose_sandbox_stayed_unlisted_for_the_whole_grace_is_reclaimed(
    history: list[tuple[frozenset[str] | None, float]], pods: dict[str, bool] | None
) -> None:
    owners = ["ns/p", "ns/p", "ns/q", "", "ns/r", ""]
    items = [held(c, pod) for c, pod in zip("abcdef", owners, strict=True)]
    suspects: dict[OwnerKey, Suspect] = {}
    now = 0.0
    unlisted_since: dict[str, float] = {}  # container -> first answer not listing it, in a row
    for listed, elapsed in history:
        now += elapsed
        if listed is not None:
            for item in items:
                c = item.key.container_id
                if c in listed:
                    unlisted_since.pop(c, None)
                else:
                    unlisted_since.setdefault(c, now)
        suspects, leaks = check(items, sandboxes=listed, pods=pods, suspects=suspects, now=now)
        for leak in leaks:
            c = leak.held.key.container_id
            assert listed is not None and c not in listed
            assert now - unlisted_since[c] >= GRACE
        if listed is not None and pods is None:  # the runtime alone: every such IP comes back
            due = {c for c, since in unlisted_since.items() if now - since >= GRACE}
            assert {leak.held.key.container_id for leak in leaks} == due


# --- the CRI reply codec ----------------------------------------------------------------------


def sandbox_list_reply(count: int) -> bytes:
    """A ListPodSandboxResponse encoded by the CRI API's own generated code: sandbox n has id
    n in hex, pod ns/p<n>, and is ready when n is even."""
    from tests.harness.cri import cri_stubs

    pb2, _ = cri_stubs()
    data: bytes = pb2.ListPodSandboxResponse(
        items=[
            pb2.PodSandbox(
                id=f"{n:064x}",
                metadata=pb2.PodSandboxMetadata(name=f"p{n}", uid="u", namespace="ns", attempt=n),
                state=pb2.SANDBOX_NOTREADY if n % 2 else pb2.SANDBOX_READY,
                created_at=1_700_000_000_000_000_000 + n,
                labels={"app": "web"},
                annotations={"a": "b" * 300},
                runtime_handler="runc",
            )
            for n in range(count)
        ]
    ).SerializeToString()
    return data


def test_sandbox_ids_read_a_reply_encoded_by_the_cri_api_itself() -> None:
    reply = sandbox_list_reply(50)
    assert sandbox_ids(reply) == {f"{n:064x}" for n in range(50)}
    assert sandbox_ids(b"") == frozenset()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x0a\x05abc", "runs past the end"),
        (b"\x0a", "truncated varint"),
        (b"\x0b", "wire type 3"),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x02\x00", "field number 0"),
    ],
)
def test_a_malformed_reply_is_an_error_not_a_guess(data: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        fields(data)


@given(st.binary(max_size=64))
def test_any_bytes_either_decode_or_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError, UnicodeDecodeError):
        sandbox_ids(data)


async def serve_sandboxes(socket: Path, service: str, ids: list[str]) -> Any:
    """A gRPC server on `socket` answering ListPodSandbox of `service` only (the real runtime's
    answers are in tests/e2e/test_runtimes.py; this one shows the older API version is asked)."""
    import grpc

    from tests.harness.cri import cri_stubs

    pb2, _ = cri_stubs()

    async def list_pod_sandbox(request: bytes, context: Any) -> bytes:
        reply = pb2.ListPodSandboxResponse(items=[pb2.PodSandbox(id=i) for i in ids])
        data: bytes = reply.SerializeToString()
        return data

    handler = grpc.method_handlers_generic_handler(
        service, {"ListPodSandbox": grpc.unary_unary_rpc_method_handler(list_pod_sandbox)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    return server


@pytest.mark.parametrize("service", SERVICES)
async def test_the_client_asks_whichever_cri_version_the_runtime_serves(
    tmp_path: Path, service: str
) -> None:
    server = await serve_sandboxes(tmp_path / "cri.sock", service, ["s1", "s2"])
    client = CriSandboxes(str(tmp_path / "cri.sock"), timeout_seconds=5)
    try:
        assert await client.list_sandbox_ids() == {"s1", "s2"}
        assert await client.list_sandbox_ids() == {"s1", "s2"}  # the version found is kept
    finally:
        await client.close()
        await server.stop(None)


async def test_a_runtime_that_is_not_there_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    client = CriSandboxes(str(tmp_path / "missing.sock"), timeout_seconds=2)
    try:
        with pytest.raises(RuntimeUnavailable, match=r"missing\.sock: UNAVAILABLE"):
            await asyncio.wait_for(client.list_sandbox_ids(), 10)
    finally:
        await client.close()


# --- the check against the node service (a real Store; the runtime's list given by the test) --


class ListedSandboxes:
    """What a runtime lists, set by the test; `None` as if its socket did not answer."""

    def __init__(self) -> None:
        self.ids: set[str] | None = set()

    async def list_sandbox_ids(self) -> frozenset[str]:
        if self.ids is None:
            raise RuntimeUnavailable("CRI /run/test.sock: UNAVAILABLE: connection refused")
        return frozenset(self.ids)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_check_reclaims_durably_and_shows_it(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cns.core.pool import Pool
    from cns.core.types import Owner, Scaler
    from cns.node.control_plane import MemorySource, SourceState
    from cns.node.leak_reclaim import LeakReclaimer
    from cns.node.service import NodeIPAM
    from cns.state.store import Store
    from cns.web.node_metrics import Metrics
    from cns.web.views import ips_view, pool_view
    from tests.integration.test_state_safety import network, on_disk

    store = Store(tmp_path / "state.db")
    store.open()
    node = NodeIPAM(Pool(), store, MemorySource(), Scaler(batch_size=16), 1.0)
    node.on_state(SourceState((network(8),)))
    pods = {"shop/web": True, "shop/db": True}
    for container, pod in (("old", "web"), ("new", "web"), ("db1", "db")):
        await node.add(Owner(container, "eth0", pod, "shop"))
    runtime = ListedSandboxes()
    runtime.ids = {"new", "db1"}
    clock = Clock()
    reclaimer = LeakReclaimer(node, runtime, lambda: pods, grace_seconds=GRACE, clock=clock)
    metrics = Metrics()
    metrics.watch(node)

    assert await reclaimer.check_once() == []
    owned = [ip for ip in ips_view(node.pool) if ip["owner"] is not None]
    (old_ip,) = [ip for ip in owned if ip["owner"]["containerID"] == "old"]
    (row,) = [ip for ip in ips_view(node.pool, leaks=node.leaks) if ip["id"] == old_ip["id"]]
    assert row["leakSuspect"]["reason"] == "sandbox-replaced"

    runtime.ids = None  # the runtime stops answering: nothing is reclaimed, however late
    clock.now = GRACE * 3
    assert await reclaimer.check_once() == []
    assert pool_view(node)["leakCheck"] == {
        "enabled": True,
        "checks": 2,
        "runtimeError": "CRI /run/test.sock: UNAVAILABLE: connection refused",
        "suspects": 1,
        "reclaimed": {},
    }

    runtime.ids = {"new", "db1"}
    released = await reclaimer.check_once()
    assert [r.id for r in released] == [old_ip["id"]]
    assert {cid for cid, _, _ in on_disk(tmp_path / "state.db").values()} == {"new", "db1"}
    (row,) = [ip for ip in ips_view(node.pool, leaks=node.leaks) if ip["id"] == old_ip["id"]]
    assert row["owner"] is None and "leakSuspect" not in row
    assert row["reclaimed"]["reason"] == "sandbox-replaced"
    assert row["reclaimed"]["containerID"] == "old" and row["reclaimed"]["pod"] == "shop/web"
    text = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        s.labels["reason"]: s.value
        for s in families["cns_ip_leaks_reclaimed"].samples
        if s.name.endswith("_total")
    }
    assert samples["sandbox-replaced"] == 1 and sum(samples.values()) == 1
    assert families["cns_ip_leak_suspects"].samples[0].value == 0
    assert families["cns_leak_check_runtime_ok"].samples[0].value == 1
    assert node.releases["leak"] == 1

    del pods["shop/db"]  # a pod deleted while its sandbox still exists: left alone
    clock.now += GRACE * 2
    assert await reclaimer.check_once() == []
    assert node.pool.lookup(OwnerKey("db1", "eth0")) is not None
    store.close()


def test_cns_status_says_what_the_leak_check_found() -> None:
    from cns.commands.status import leak_check_text

    assert leak_check_text(None) == "off"  # an older daemon
    assert leak_check_text({"enabled": False}) == "off"
    check = {"enabled": True, "suspects": 2, "reclaimed": {"pod-gone": 3}, "runtimeError": None}
    assert leak_check_text(check) == "2 suspects, reclaimed pod-gone 3"
    check.update(reclaimed={}, runtimeError="CRI /run/x.sock: UNAVAILABLE: gone")
    assert leak_check_text(check) == (
        "2 suspects, reclaimed none; runtime unavailable: CRI /run/x.sock: UNAVAILABLE: gone"
    )


async def test_in_a_cluster_nothing_is_decided_until_the_pods_are_known(tmp_path: Path) -> None:
    """The runtime alone decides only standalone: with the pod list not (yet) known, a
    missing sandbox is not even a suspect."""
    from cns.core.pool import Pool
    from cns.core.types import Owner, Scaler
    from cns.node.control_plane import MemorySource, SourceState
    from cns.node.leak_reclaim import LeakReclaimer
    from cns.node.service import NodeIPAM
    from cns.state.store import Store
    from tests.integration.test_state_safety import network

    store = Store(tmp_path / "state.db")
    store.open()
    node = NodeIPAM(Pool(), store, MemorySource(), Scaler(batch_size=16), 1.0)
    node.on_state(SourceState((network(4),)))
    await node.add(Owner("gone", "eth0", "web", "shop"))
    pods: dict[str, bool] | None = None
    clock = Clock()
    reclaimer = LeakReclaimer(
        node, ListedSandboxes(), lambda: pods, grace_seconds=GRACE, clock=clock
    )
    for step in range(3):
        clock.now = step * GRACE
        assert await reclaimer.check_once() == []
    assert node.leaks.suspects == {}
    pods = {}  # the pod list arrives: the pod is gone
    assert await reclaimer.check_once() == []
    clock.now += GRACE
    assert [r.address for r in await reclaimer.check_once()] == ["10.1.0.10"]
    store.close()
