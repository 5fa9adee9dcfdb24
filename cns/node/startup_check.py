"""The world checks the state file, once after each start (cns/core/worldcheck.py decides).

The daemon closes the node's gate before its socket opens: from then on an ADD gets no IP it
does not hold already, and waits (wait reason `world-check`). This step asks the world which
addresses live pods hold: the runtime (CRI, the leak check's socket: each ready sandbox's
addresses) and, in a cluster, the pod watch (each live pod's `status.podIPs`, once it has listed
the node's pods). It applies what the decision says (adoptions durable in the state file before
the gate opens) and opens the gate.

It waits for the world at most `wait_seconds` (less than an ADD's own timeout, so the ADDs
waiting for it are answered). A source that has not answered by then is left out: the gate
opens with what the state file and the other source say (nothing is guessed, nothing freed), the
start is logged `world_check_incomplete` naming it and why, and the source is asked again every
few seconds; its addresses are checked when it answers (an address handed out meanwhile shows
as a conflict, logged as an error). A state file that cannot take the adoptions keeps the gate
closed and is tried again: no ADD can commit while it fails anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog

from cns.core.types import Owner
from cns.core.worldcheck import API_OWNER_PREFIX, Outcome, Sighting, Source, canonical
from cns.host.cri import LiveSandbox, RuntimeUnavailable
from cns.node.errors import IPAMError
from cns.node.service import NodeIPAM

log = structlog.get_logger("cns.worldcheck")

# The interface the runtime names in its CNI ADD for the pod network (kubelet: always eth0); an
# adopted address is held by (sandbox id, this).
POD_INTERFACE = "eth0"
RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)


def _backoff(failures: int) -> float:
    """How long to wait before asking again after `failures` failed tries in a row."""
    return RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)]


class SandboxAddresses(Protocol):
    async def live_sandboxes(self) -> list[LiveSandbox]:
        """Every ready sandbox with its addresses; RuntimeUnavailable when it cannot say."""


# (namespace/name, uid, addresses) of each live pod on the node; None until they are known.
PodAddresses = Callable[[], list[tuple[str, str, tuple[str, ...]]] | None]


def _pod_owner(container_id: str, pod: str) -> Owner:
    namespace, _, name = pod.partition("/")
    return Owner(container_id, POD_INTERFACE, pod_name=name, pod_namespace=namespace)


def runtime_sightings(live: Sequence[LiveSandbox]) -> list[Sighting]:
    """What the runtime says: each ready sandbox holds its addresses."""
    found = []
    for one in live:
        sandbox = one.sandbox
        pod = f"{sandbox.pod_namespace}/{sandbox.pod_name}" if sandbox.pod_name else ""
        owner = _pod_owner(sandbox.id, pod)
        for address in one.addresses:
            if (text := canonical(address)) is not None:
                found.append(Sighting(Source.CRI, text, owner))
    return found


def api_sightings(
    pods: Sequence[tuple[str, str, tuple[str, ...]]], live: Sequence[LiveSandbox] | None
) -> list[Sighting]:
    """What the API says: each live pod holds its podIPs. Where the runtime answered (`live`), it
    alone says which sandboxes exist (as for the leak check): a pod is taken at its word only
    with one ready sandbox, under that sandbox's id (its status lags: a pod whose sandbox is gone
    or being re-created may still list the old address). Without the runtime's answer, under
    `api:<pod uid>` (the DEL, naming the sandbox, does not free that one: the leak check does
    once the pod is gone, or an operator)."""
    sandboxes_of: dict[str, list[str]] = {}
    for one in live or ():
        pod = f"{one.sandbox.pod_namespace}/{one.sandbox.pod_name}"
        sandboxes_of.setdefault(pod, []).append(one.sandbox.id)
    found = []
    for pod, uid, addresses in pods:
        ids = sandboxes_of.get(pod, [])
        if live is not None and len(ids) != 1:
            continue
        owner = _pod_owner(ids[0] if ids else f"{API_OWNER_PREFIX}{uid}", pod)
        for address in addresses:
            if (text := canonical(address)) is not None:
                found.append(Sighting(Source.API, text, owner))
    return found


class WorldCheck:
    """The start-up check: gather the world, apply the decision, open the gate."""

    def __init__(
        self,
        node: NodeIPAM,
        runtime: SandboxAddresses | None,
        pods: PodAddresses | None,
        *,
        wait_seconds: float,
    ) -> None:
        self.node = node
        self.runtime = runtime
        self.pods = pods
        self.wait_seconds = wait_seconds
        self._live: list[LiveSandbox] | None = None
        self._pods: list[tuple[str, str, tuple[str, ...]]] | None = None
        self._runtime_error = ""

    def close_gate(self) -> None:
        """Before the socket opens: ADDs wait for `run` (only if there is a world to ask)."""
        node = self.node
        node.world_wait_seconds = self.wait_seconds
        if self.runtime is None and self.pods is None:
            node.world.state = "off"
            return
        node.world.state = "pending"
        node.world_gate_open = False
        for source, asked in (("cri", self.runtime), ("api", self.pods)):
            if asked is not None:
                node.world.sources[source] = "waiting"

    async def _ask(self, *, timeout: float) -> None:
        """Ask each source that has not answered yet, once."""
        if self.runtime is not None and self._live is None:
            try:
                self._live = await asyncio.wait_for(self.runtime.live_sandboxes(), timeout)
            except RuntimeUnavailable as exc:
                self._runtime_error = str(exc)
            except TimeoutError:
                self._runtime_error = f"no answer within {timeout:.1f} s"
        if self.pods is not None and self._pods is None:
            self._pods = self.pods()

    def _missing(self) -> dict[str, str]:
        """The sources that have not answered, and why."""
        missing = {}
        if self.runtime is not None and self._live is None:
            missing["cri"] = self._runtime_error or "not asked yet"
        if self.pods is not None and self._pods is None:
            missing["api"] = "the pod watch has not listed the pods (API server unreachable?)"
        return missing

    def _sightings(self, sources: set[str]) -> list[Sighting]:
        found = []
        if "cri" in sources and self._live is not None:
            found += runtime_sightings(self._live)
        if "api" in sources and self._pods is not None:
            found += api_sightings(self._pods, self._live)
        return found

    async def _apply(self, sources: set[str]) -> None:
        """Decide and apply; returns once the adoptions are durable (retried until they are)."""
        failures = 0
        while True:
            findings, batch = self.node.apply_world(self._sightings(sources))
            try:
                await self.node.durable(batch)
            except IPAMError as exc:  # undone in memory (`_follow_disk`): decided again
                delay = _backoff(failures)
                failures += 1
                log.error("world_check_adoption_failed", error=exc.msg, retry_in=delay)
                await asyncio.sleep(delay)
                continue
            counts = {o.value: sum(f.outcome is o for f in findings) for o in Outcome}
            for source in sources:
                self.node.world.sources[source] = "checked"
            log.info("world_check_applied", sources=sorted(sources), addresses=counts)
            return

    async def run(self) -> None:
        """Once after the start: wait (bounded) for the world, apply, open the gate; then ask a
        source that did not answer in time until it does, and check its addresses then."""
        node = self.node
        if node.world.state == "off":
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.wait_seconds
        failures = 0
        while True:
            await self._ask(timeout=max(0.1, deadline - loop.time()))
            if not self._missing() or loop.time() >= deadline:
                break
            await asyncio.sleep(max(0.0, min(_backoff(failures), deadline - loop.time())))
            failures += 1
        missing = self._missing()
        answered = set(node.world.sources) - missing.keys()
        await self._apply(answered)
        node.world.seconds = round(loop.time() - started, 3)
        node.world.state = "partial" if missing else "done"
        for source, why in missing.items():
            node.world.sources[source] = why
        if missing:
            log.error(
                "world_check_incomplete",
                missing=missing,
                waited_seconds=node.world.seconds,
                outcome="ADDs get addresses again; the state file and the sources that answered "
                "decided; the missing ones are asked again and checked when they answer",
            )
        node.open_world_gate()
        log.info(
            "world_check_done" if not missing else "world_check_gate_opened",
            seconds=node.world.seconds,
            outcomes=dict(node.world.outcomes),
            remembered=len(node.world.remembered),
        )
        failures = 0
        while missing := self._missing():
            await asyncio.sleep(_backoff(failures))
            failures += 1
            before = missing.keys()
            await self._ask(timeout=10.0)
            came = set(before) - self._missing().keys()
            if came:
                log.info("world_check_source_answered", sources=sorted(came))
                await self._apply(came)
                if not self._missing():
                    node.world.state = "done"
