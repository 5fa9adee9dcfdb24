"""What the control plane says of the node's subnets, applied to the lanes.

Each update names the network containers, exhaustion, scaler, pod demand and last request of
the primary subnet and of each further one. A subnet is the node's while the control plane lists
a network container of it; one no longer listed is removed (its pods keep their IPs until their
DEL). Addresses the containers re-home, and cooldowns they move, are recorded in the state file
in the same step. Runs on the event loop, synchronously.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from cns.core.pool import Pool
from cns.core.types import NetworkContainer
from cns.node.commits import Commits
from cns.node.control_plane import FurtherSubnetState, SourceState
from cns.node.errors import IPAMError, Unavailable
from cns.node.lanes import Lanes, NodeLane, assignment
from cns.node.notes import NodeEvents
from cns.node.publisher import Publisher
from cns.node.waiters import WaitQueue
from cns.state.store import Forget, Save

log = structlog.get_logger("cns.node")


class LaneUpdates:
    """Applies control-plane updates to the lanes; counts what contradicts the pool."""

    def __init__(
        self,
        lanes: Lanes,
        waiters: WaitQueue,
        commits: Commits,
        publisher: Publisher,
        *,
        events: NodeEvents,
    ) -> None:
        self.lanes = lanes
        self.events = events
        self.waiters = waiters
        self.commits = commits
        self.store = commits.store
        self.publisher = publisher
        self.inconsistencies_total = 0
        self._release_requested: set[str] = set()

    def apply(self, state: SourceState) -> None:
        """The lanes' part of a control-plane update: each subnet's state to its lane, lanes
        made and removed, and the IPs the control plane asks back."""
        primary = FurtherSubnetState(
            state.containers,
            state.exhausted,
            state.scaler,
            state.request,
            state.pod_demand,
            state.draining,
        )
        if state.gone:  # the control plane heard nothing of the node: its record is to be made
            for lane in self.lanes.values():
                lane.sent = None
            self.publisher.published_subnets = frozenset()
        self.lanes.primary.name = next(
            (nc.subnet_name for nc in state.containers if nc.subnet_name), self.lanes.primary.name
        )
        self._apply_lane(self.lanes.primary, primary, state.from_snapshot)
        self._overflow_changed(state)
        for key, lane in self.lanes.further():
            if key not in state.subnets:
                lane.pod_demand = 0  # no pod here chooses its subnet any more
        for name, subnet in state.subnets.items():
            if not self.lanes.key(name):
                continue  # the primary subnet's, which the top level holds
            lane = self.lanes.lane(name)
            # A subnet listed for its pods' demand alone is asked for while they want it.
            lane.listed = lane.listed or bool(subnet.containers)
            if lane.removed and subnet.containers:
                lane.removed = False
                log.warning("subnet_listed_again", subnet=name)
            self._apply_lane(lane, subnet, state.from_snapshot)
        # A subnet is the node's while the control plane lists a network container of it. When
        # the control plane lost the node's record whole (`gone`), its containers are withdrawn
        # but its subnets stay: the node asks for what its pods hold there.
        listed = {self.lanes.key(n) for n, subnet in state.subnets.items() if subnet.containers}
        for key, lane in self.lanes.further():
            if key in listed:
                continue
            if state.gone:
                self._withdraw_unlisted(lane, ())
            elif lane.listed or lane.pool.records:
                self._remove_lane(key, lane)
        self.publisher.from_snapshot = state.from_snapshot
        if not state.from_snapshot:  # after a restart: what the control plane has heard
            self.publisher.published_subnets |= {
                k for k in listed if self.lanes[k].sent is not None
            }
        self._honour_release_requests(state.release_requests)

    def _remove_lane(self, key: str, lane: NodeLane) -> None:
        """The control plane (standalone: the configuration) no longer lists subnet `key`.
        Nothing of its pods is dropped: each keeps its IPs until its DEL (GC, leak reclaim and
        the release queue free them as ever). Its free IPs are dropped, so no ADD gets one, and
        an ADD naming it fails at once (`_add`), as do those waiting for it."""
        lane.listed = False
        if lane.removed:
            return
        lane.removed = True
        dropped = lane.pool.withdraw_free()
        log.warning(
            "subnet_removed",
            subnet=key,
            assigned=lane.pool.assigned_count(),
            free_ips_dropped=len(dropped),
            meaning="its pods keep their IPs until their DEL; ADDs naming it fail",
        )
        naming = [w for w in self.waiters if key in map(self.lanes.key, w.subnets)]
        self.waiters.fail(naming, refusal(key, lane))

    def _draining_changed(self, lane: NodeLane, *, draining: bool) -> None:
        """The lane's subnet starts (or stops) draining: from now on its next plan asks only
        for what its pods hold, and the ADDs waiting for one of its IPs fail at once, as any
        new one will (`refusal`)."""
        lane.draining = draining
        key = self.lanes.key(lane.name)
        log.warning(
            "subnet_draining_changed",
            subnet=self.lanes.label(key) or None,
            draining=draining,
            assigned=lane.pool.assigned_count(),
            meaning="its pods keep their IPs; no ADD gets a new one, the free ones go back"
            if draining
            else "its IPs are handed out again",
        )
        if draining:
            naming = [w for w in self.waiters if key in map(self.lanes.key, w.subnets)]
            self.waiters.fail(naming, refusal(self.lanes.label(key), lane))

    def _overflow_changed(self, state: SourceState) -> None:
        """The primary subnet's overflow subnets (and the pods drawing from it), said when the
        list or a subnet's room changes."""
        lanes = self.lanes
        lanes.primary_pods = state.primary_pods
        if state.overflow != lanes.overflow:
            log.info(
                "overflow_subnets_changed",
                subnet=lanes.primary.name or None,
                overflow=[c.name for c in state.overflow],
                with_room=[c.name for c in state.overflow if c.has_room],
            )
            lanes.overflow = state.overflow

    def _withdraw_unlisted(self, lane: NodeLane, containers: Iterable[NetworkContainer]) -> None:
        """Withdraw the lane's network containers that are not among `containers` (what the
        control plane lists now): their free IPs leave at once, held ones stay with their pods
        until DEL and are then dropped (`Pool.withdraw`)."""
        listed = {nc.id for nc in containers}
        for nc_id in [i for i in lane.pool.containers if i not in listed]:
            dropped = lane.pool.withdraw(nc_id)
            held = [r for r in lane.pool.unlisted() if r.nc_id == nc_id]
            log.warning(
                "network_container_withdrawn",
                nc=nc_id,
                subnet=lane.name or None,
                free_ips_dropped=len(dropped),
                assigned_kept=len(held),
                meaning="no ADD gets its IPs; pods keep theirs until DEL, which drops them",
            )

    def _persist_rehomed(self, pool: Pool, rehomed: Iterable[tuple[str, str]]) -> None:
        """Record each IP re-homed to another IP id (and container): the old row goes, the new
        one comes, in one batch of its holder."""
        for old_id, new_id in rehomed:
            record = pool.records[new_id]
            assert record.owner is not None
            self.commits.record(
                record.owner.key, [Forget(old_id), Save(assignment(record, pool.subnet))]
            )
            log.warning(
                "ip_rehomed",
                ip=record.address,
                old_ip_id=old_id,
                ip_id=new_id,
                nc=record.nc_id,
                pod=record.owner.pod or None,
                meaning="an address a pod holds, listed again by another container",
            )

    def _apply_lane(self, lane: NodeLane, state: FurtherSubnetState, from_snapshot: bool) -> None:
        pool = lane.pool
        self._withdraw_unlisted(lane, state.containers)
        for nc in state.containers:
            change = pool.apply_nc(nc)
            self._persist_rehomed(pool, change.rehomed)
            if change.cooldowns_moved:  # the cooldown rows of the ids the addresses came back as
                self.store.enqueue(
                    [
                        Forget(ip_id, cool_until=end, pod=pod)
                        for ip_id, end, pod in change.cooldowns_moved
                    ]
                )
            if change.stale:
                applied = pool.network_container(nc.id)
                log.warning(
                    "network_container_stale_ignored",
                    nc=nc.id,
                    version=nc.version,
                    applied_version=applied.version if applied else None,
                )
            for problem in change.inconsistencies:
                self.inconsistencies_total += 1
                log.error("pool_inconsistency", nc=nc.id, problem=problem)
            if change.added or change.removed or change.programmed or change.rehomed:
                log.info(
                    "network_container_applied",
                    nc=nc.id,
                    version=nc.version,
                    added=len(change.added),
                    removed=len(change.removed),
                    programmed=len(change.programmed),
                    rehomed=len(change.rehomed),
                    ips=len(pool.records),
                    subnet=lane.name or None,
                )
        if state.request is not None:
            for ip_id in pool.honour_release(state.request.ips_not_in_use):
                self.inconsistencies_total += 1
                log.error("pool_inconsistency", problem=f"assigned IP {ip_id} is in ipsNotInUse")
        if state.exhausted != lane.exhausted:
            log.warning(
                "subnet_exhaustion_changed", exhausted=state.exhausted, subnet=lane.name or None
            )
            self.events.exhaustion_changed(lane.name, exhausted=state.exhausted)
        before, after = lane.source_scaler, state.scaler
        if before is not None and after is not None and before.batch_size != after.batch_size:
            self.events.batch_changed(lane.name, before=before.batch_size, after=after.batch_size)
        if state.draining != lane.draining:
            self._draining_changed(lane, draining=state.draining)
        lane.exhausted = state.exhausted
        lane.source_scaler = state.scaler
        lane.pod_demand = state.pod_demand
        if lane.sent is None or lane.sent_unconfirmed:
            # Until the control plane's own view arrives, the snapshot's request stands in for
            # what was published; then the control plane's spec is what it heard, and the next
            # plan is compared with that (a request written ahead of a crash is sent again).
            lane.sent = state.request
            lane.sent_unconfirmed = from_snapshot

    def _honour_release_requests(self, ip_ids: tuple[str, ...]) -> None:
        """Give up what the control plane asks for, except an IP a pod here uses: that one is
        kept and reported once, and given up when its pod releases it (`Pool.ask_back`)."""
        pools = [lane.pool for lane in self.lanes.values()]
        kept = {ip_id for pool in pools for ip_id in pool.ask_back(ip_ids)}
        for ip_id in ip_ids:
            if ip_id in self._release_requested:
                continue
            record = next((p.records[ip_id] for p in pools if ip_id in p.records), None)
            address = record.address if record else None
            if ip_id in kept:
                self.inconsistencies_total += 1
                log.error("ip_release_refused", ip_id=ip_id, ip=address, reason="a pod uses it")
                self.events.release_refused(address=address or ip_id)
            else:
                log.warning("ip_release_requested", ip_id=ip_id, ip=address)
        self._release_requested = set(ip_ids)


def refusal(name: str, lane: NodeLane) -> IPAMError:
    """Code 11 (try again later): an ADD needs a new IP of subnet `name`, whose lane hands none
    out, as it was removed from the node or its subnet is draining; its pods keep theirs."""
    if lane.removed:
        why = (
            f"subnet {name} was removed from this node (the control plane or the configuration "
            "no longer lists it): no ADD gets an IP of it"
        )
    else:
        why = (
            f"subnet {name} is draining (its ClusterSubnet's spec.draining): no new IP of it; "
            "pods that hold one keep it"
        )
    return Unavailable(
        11, why, f"subnet={name} assigned={lane.pool.assigned_count()} (kept until their DEL)"
    )
