"""The node's pool changes that are Kubernetes Events on its NodeNetworkConfig (cns/node/notes.py),
seen through a recorder that keeps every note: the control plane's batch changing, an address it
asks back that a pod uses, and a leaked address reclaimed. (The Events the pods get, and their
writing to a real API server: tests/integration/test_events.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cns.core.events import Note, ObjectRef
from cns.core.pool import Pool
from cns.core.types import Owner, Scaler
from cns.node.control_plane import MemorySource, SourceState
from cns.node.leak_reclaim import LeakReclaimer
from cns.node.notes import NodeEvents
from cns.node.service import NodeIPAM
from cns.state.store import Store
from tests.integration.test_state_safety import network
from tests.unit.node.test_leaks import GRACE, Clock, ListedSandboxes

NNC = ObjectRef("NodeNetworkConfig", "node-1", "kube-system")


class Kept:
    def __init__(self) -> None:
        self.notes: list[Note] = []

    def record(self, note: Note) -> None:
        self.notes.append(note)

    def reasons(self) -> list[str]:
        return [n.reason for n in self.notes if n.about == NNC]


def node_with_events(tmp_path: Path, kept: Kept) -> NodeIPAM:
    store = Store(tmp_path / "state.db")
    store.open()
    return NodeIPAM(
        Pool(), store, MemorySource(), Scaler(batch_size=16), 1.0, events=NodeEvents(kept, NNC)
    )


def test_a_batch_change_and_a_refused_release_are_events_on_the_nnc(tmp_path: Path) -> None:
    kept = Kept()
    node = node_with_events(tmp_path, kept)
    state = SourceState((network(8),), scaler=Scaler(batch_size=16))
    node.on_state(state)
    assert kept.reasons() == []
    node.on_state(dataclasses.replace(state, scaler=Scaler(batch_size=4)))
    assert kept.reasons() == ["BatchChanged"]
    assert "is now 4 addresses (was 16)" in kept.notes[-1].message


async def test_an_address_asked_back_that_a_pod_uses_is_a_refused_release_event(
    tmp_path: Path,
) -> None:
    kept = Kept()
    node = node_with_events(tmp_path, kept)
    state = SourceState((network(8),))
    node.on_state(state)
    taken = await node.add(Owner("c1", "eth0", "web", "shop"))
    ip_id, address = taken.record.id, taken.record.address
    node.on_state(dataclasses.replace(state, release_requests=(ip_id,)))
    assert kept.reasons() == ["IPReleaseRefused"]
    assert address in kept.notes[-1].message
    node.on_state(dataclasses.replace(state, release_requests=(ip_id,)))  # asked again: once
    assert kept.reasons() == ["IPReleaseRefused"]


async def test_a_reclaimed_leak_is_an_event_on_the_nnc(tmp_path: Path) -> None:
    kept = Kept()
    node = node_with_events(tmp_path, kept)
    node.on_state(SourceState((network(8),)))
    for container in ("old", "new"):
        await node.add(Owner(container, "eth0", "web", "shop"))
    runtime = ListedSandboxes()
    runtime.ids = {"new"}
    clock = Clock()
    reclaimer = LeakReclaimer(
        node, runtime, lambda: {"shop/web": True}, grace_seconds=GRACE, clock=clock
    )
    assert await reclaimer.check_once() == []
    clock.now = GRACE * 2
    (released,) = await reclaimer.check_once()
    assert kept.reasons() == ["LeakedIPReclaimed"]
    assert released.address in kept.notes[-1].message
