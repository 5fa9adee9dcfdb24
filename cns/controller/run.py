"""`cns controller`: fulfils every node's NodeNetworkConfig from the ClusterSubnets it serves.

One controller serves every ClusterSubnet of the cluster (or, sharded, the one it is given).
Each node takes its addresses from one primary subnet, chosen once by the subnets' node
selectors (cns/core/placement.py) and kept on its NNC, and from each further subnet its NNC
asks for by name (`spec.subnets`), with one network container per subnet. A round goes through
the subnets one after the other; each has its own planning state and its own records, in which
a node is a member under its name (the member is the pair NNC, subnet), so a subnet that fails
its round holds up no other, and one subnet's grants never depend on another's
(docs/design/controller-safety.md, "Nodes in several subnets").

The API server is the only source of truth, read through watches; only the leader (a Lease)
writes. This module is the controller's term: it watches, stands by with its planning state
warm, leads while it holds the lease and runs the rounds. Its collaborators:

- `survey.Surveyor`: which subnets are served, new nodes placed, the caches' snapshot;
- `subnet_round.SubnetRounds`: one subnet's round, planned (`plan.plan_round`, in a worker
  thread so that the event loop keeps renewing the lease) and written in order;
- `recheck`: the planning state kept in step with the caches, and the periodic re-check;
- `writes.Writer`: the writes, and the one way a refused write (404, 409) is handled;
- `lease.LeaderElector`: the lease, and the fencing every write goes through.

Before every write the leader checks that it can still prove it holds the lease (fencing). A
conflict means a cache was stale: the object is read again and the round runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from cns.controller import recheck
from cns.controller.lease import LeaderElector, LostLeadership
from cns.controller.notes import ControllerEvents
from cns.controller.served import Counters, ServedSubnet
from cns.controller.subnet_round import SubnetRounds
from cns.controller.survey import Survey, Surveyor
from cns.controller.writes import Writer, refusal_reason
from cns.core.events import NO_RECORDER, ObjectRef, Recorder
from cns.core.subnet import Subnet
from cns.core.types import Scaler
from cns.kube import NAMESPACE
from cns.kube.client import KubeClient
from cns.kube.ipblock import slim_block
from cns.kube.nnc import slim_nnc
from cns.kube.objects import CLUSTER_SUBNET, CLUSTER_SUBNET_STATE, IP_BLOCK, NNC, SUBNET_LABEL

log = structlog.get_logger("cns.controller")

ROUND_RETRY_SECONDS = 1.0
# How often a standby follows the caches into its planning state, at most.
WARM_SECONDS = 1.0


class Controller:
    """The control plane of the cluster's ClusterSubnets (`subnet_name`: only that one)."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        subnet_name: str = "",
        namespace: str = NAMESPACE,
        identity: str = "",
        default_scaler: Scaler | None = None,
        seed: int | None = None,
        lease_seconds: int = 15,
        events: Recorder = NO_RECORDER,
    ) -> None:
        """`events` gets what operators see as Kubernetes Events (cns/controller/notes.py)."""
        self.kube = kube
        self.subnet_name = subnet_name
        self.namespace = namespace
        self.identity = identity or f"cns-controller-{uuid.uuid4().hex[:8]}"
        self.default_scaler = default_scaler or Scaler()
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.elector = LeaderElector(
            kube,
            name=f"cns-controller-{subnet_name}" if subnet_name else "cns-controller",
            namespace=namespace,
            identity=self.identity,
            lease_seconds=lease_seconds,
            renew_deadline_seconds=lease_seconds * 2 / 3,
            retry_seconds=max(0.2, lease_seconds / 7.5),
        )
        kube.before_write = self._fence  # every write proves the lease, after any wait
        self._dirty = asyncio.Event()
        self.served: dict[str, ServedSubnet] = {}
        self.nodes = kube.watch_nodes(self.kick)
        # The NNCs and IPBlocks hold every address: their caches keep only what a round reads.
        self.nncs = kube.watch(NNC, self.kick, namespace=namespace, slim=slim_nnc)
        # Every ClusterSubnet and state, even sharded: placement and the overlap check need
        # all of them (a handful of small objects).
        self.subnets = kube.watch(CLUSTER_SUBNET, self.kick)
        self.states = kube.watch(CLUSTER_SUBNET_STATE, self.kick)
        self.blocks = kube.watch(
            IP_BLOCK,
            self.kick,
            labels=f"{SUBNET_LABEL}={subnet_name}" if subnet_name else "",
            slim=slim_block,
        )
        self._collections = (self.nodes, self.nncs, self.subnets, self.states, self.blocks)
        self.events = ControllerEvents(events, namespace)
        self.writer = Writer(
            kube,
            namespace=namespace,
            counters=self.counters,
            kick=self.kick,
            nncs=self.nncs,
            blocks=self.blocks,
            subnets=self.subnets,
            states=self.states,
            events=self.events,
        )
        self.surveyor = Surveyor(
            kube,
            self.writer,
            subnet_name=subnet_name,
            namespace=namespace,
            default_scaler=self.default_scaler,
            nodes=self.nodes,
            nncs=self.nncs,
            subnets=self.subnets,
            blocks=self.blocks,
        )
        self.rounds = SubnetRounds(
            kube,
            self.writer,
            namespace=namespace,
            default_scaler=self.default_scaler,
            counters=self.counters,
            served=self.served,
            kick=self.kick,
            events=self.events,
        )

    def uid_of(self, ref: ObjectRef) -> str:
        """The UID of a ClusterSubnet or NodeNetworkConfig an Event is about, as watched."""
        if ref.kind == "ClusterSubnet":
            subnet = self.subnets.objects.get(self.subnets.key_for(ref.name))
            return str(((subnet or {}).get("metadata") or {}).get("uid") or "")
        if ref.kind == "NodeNetworkConfig":
            nnc = self.nncs.objects.get(self.nncs.key_for(ref.name, namespace=ref.namespace))
            return str(((nnc or {}).get("metadata") or {}).get("uid") or "")
        return ""

    def _served_subnet(self, name: str) -> ServedSubnet:
        served = self.served.get(name)
        if served is None:
            served = ServedSubnet(name, random.Random(self.rng.getrandbits(64)))
            self.served[name] = served
        return served

    def kick(self) -> None:
        self._dirty.set()

    def _fence(self) -> None:
        self.elector.fence()

    async def run(self) -> None:
        """Watch for as long as the process lives; campaign, lead until the lease is lost, step
        down, campaign again.

        A standby keeps its caches and planning state warm (`_keep_warm`), so a new term starts
        from them rather than from a fresh list: a fail-over costs the lease's expiry and one
        round. That is safe because nothing is trusted beyond what the API server answered:
        every write is conditional on the resourceVersion it was planned from, so a cache that
        lags makes a write fail and be planned again, never land on a stale basis.
        """
        async with asyncio.TaskGroup() as watches:
            for collection in self._collections:
                watches.create_task(collection.run(), name=f"watch-{collection.name}")
            while True:
                await self._stand_by()
                for served in self.served.values():  # a new term writes every NNC status once
                    served.written_scaler, served.asked = None, set()
                self.kick()  # the term's first round runs at once
                try:
                    async with asyncio.TaskGroup() as term:
                        term.create_task(self.elector.hold(), name="lease")
                        term.create_task(self._reconcile_forever(), name="reconcile")
                except* LostLeadership as lost:
                    log.warning("leadership_lost", reason=str(lost.exceptions[0]))

    async def _stand_by(self) -> None:
        """Keep the planning state warm until this replica leads."""
        warm = asyncio.create_task(self._keep_warm(), name="keep-warm")
        try:
            await self.elector.acquire()
        finally:
            warm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warm

    async def _keep_warm(self) -> None:
        """Standing by: bring the planning state up to date with the caches (no planning, no
        writes) after changes, at most every WARM_SECONDS, so that a new term's first round has
        only the last changes to catch up with."""
        for collection in self._collections:
            await collection.synced.wait()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._warm_once()
            except Exception as exc:  # the term's first round tries again, and says why
                log.error("standby_sync_failed", error=repr(exc), retry="at the next change")
            await asyncio.sleep(WARM_SECONDS)

    async def _warm_once(self) -> None:
        index = self.surveyor.nnc_index()
        survey = self.surveyor.survey(index)
        nncs, blocks = self.surveyor.snapshot(survey, index)
        for name, (_, subnet) in sorted(survey.served.items()):
            served = self._served_subnet(name)
            state = await self.rounds.synced_state(
                served, subnet, nncs=nncs[name], blocks=blocks[name]
            )
            # Only the nodes a round would act on stay for the term's first round (a model just
            # built counts every node as changed; most need nothing).
            state.model.settle(state.model.take_changed())

    async def _reconcile_forever(self) -> None:
        for collection in self._collections:
            await collection.synced.wait()
        while True:
            # Idle, a round still runs every RECHECK_SECONDS: it re-checks the planning state.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), recheck.RECHECK_SECONDS)
            self._dirty.clear()
            started = time.perf_counter()
            try:
                failures = await self.reconcile()
            except LostLeadership:
                self.counters.fenced += 1
                raise
            except Exception as exc:
                failures = [("", exc)]
            for subnet, error in failures:
                _round_failed(error, **({"subnet": subnet} if subnet else {}))
            if failures:
                await asyncio.sleep(ROUND_RETRY_SECONDS)
                self.kick()
            self.counters.rounds += 1
            self.counters.round_seconds = time.perf_counter() - started
            self.counters.round_seconds_total += self.counters.round_seconds

    async def reconcile(self) -> list[tuple[str, Exception]]:
        """One round: place new nodes and create their NNCs, then for each subnet served bring
        its planning state up to date with the caches, plan the nodes that changed, and write
        the plan in order. Returns the subnets whose round failed, with why: the others ran
        all the same."""
        surveyor = self.surveyor
        index = surveyor.nnc_index()
        survey = surveyor.survey(index)
        if self.subnet_name and self.subnet_name not in survey.served:
            log.info("waiting_for_clustersubnet", subnet=self.subnet_name)
        await surveyor.place_nodes(survey, index)
        surveyor.report_subnet_requests(survey, index)
        failures: list[tuple[str, Exception]] = []
        for name, (cs, subnet) in sorted(survey.served.items()):
            served = self._served_subnet(name)
            # Each subnet's snapshot is taken when its round starts: an NNC that is a member of
            # several subnets (`spec.subnets`) was maybe just written by an earlier one's round,
            # and a write planned from the version before would be refused (409).
            index = surveyor.nnc_index()
            nncs, blocks = surveyor.snapshot(survey, index, only=name)
            try:
                await self.rounds.run(served, cs, subnet, nncs=nncs[name], blocks=blocks[name])
                await self._follow_writes(served, survey, subnet)
            except LostLeadership:
                raise
            except Exception as exc:
                failures.append((name, exc))
        for name in self.served.keys() - survey.served.keys():  # deleted, or no longer valid
            del self.served[name]
        self.counters.forget_subnets(self.served)
        return failures

    async def _follow_writes(self, served: ServedSubnet, survey: Survey, subnet: Subnet) -> None:
        """The subnet's planning state synced with the caches right after its round: the
        round's writes are in them already (`put_written`), so the metrics read the subnet as
        it is now rather than as the round found it, which could stay so for RECHECK_SECONDS
        when nothing changes. The next round would sync the same objects; it syncs whatever
        changes meanwhile, and plans the nodes this sync marked changed."""
        index = self.surveyor.nnc_index()
        nncs, blocks = self.surveyor.snapshot(survey, index, only=served.name)
        await self.rounds.synced_state(
            served, subnet, nncs=nncs[served.name], blocks=blocks[served.name]
        )


def _round_failed(exc: Exception, **names: str) -> None:
    """Log a failed round (of one subnet, when `names` says which); the next starts after
    ROUND_RETRY_SECONDS."""
    if isinstance(exc, ApiException):
        log.warning(
            "round_failed",
            status=exc.status,
            reason=refusal_reason(exc),
            retry_in=ROUND_RETRY_SECONDS,
            **names,
        )
    else:
        log.error("round_failed", error=repr(exc), retry_in=ROUND_RETRY_SECONDS, **names)
