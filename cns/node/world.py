"""The start-up check's findings applied to the lanes: the world (the runtime's sandboxes, the
API's pods) names addresses pods hold; cns/core/worldcheck.py decides what each means, and here
an adopted address is assigned to its pod and recorded in the same synchronous step. Unknown
addresses are remembered and decided again when the control plane brings more of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import structlog

from cns.core.types import IPState
from cns.core.worldcheck import (
    Finding,
    Outcome,
    PoolEntry,
    Sighting,
    WorldLedger,
    canonical,
    check_world,
)
from cns.node.commits import Commits
from cns.node.lanes import Lanes, assignment
from cns.state.store import Batch, Save

log = structlog.get_logger("cns.node")


class WorldFindings:
    """What the world said of the node's addresses, and what was done about it (`ledger`)."""

    def __init__(self, lanes: Lanes, commits: Commits, *, kick: Callable[[], None]) -> None:
        self.lanes = lanes
        self.commits = commits
        self._kick = kick
        self.ledger = WorldLedger()

    def remembered(self) -> list[Sighting]:
        """The sightings of the addresses not decided yet."""
        return [s for f in self.ledger.remembered.values() for s in f.sightings]

    def pool(self) -> dict[str, PoolEntry]:
        """Every address of every lane (canonical text) -> its lane, IP id and holder: what the
        start-up check compares the world with."""
        return {
            canonical(record.address) or record.address: PoolEntry(
                key, record.id, record.owner if record.state is IPState.ASSIGNED else None
            )
            for key, lane in self.lanes.items()
            for record in lane.pool.records.values()
        }

    def apply(
        self, sightings: Iterable[Sighting], *, again: bool = False
    ) -> tuple[list[Finding], Batch | None]:
        """Decide what the world's addresses mean (cns/core/worldcheck.py) and apply it in the
        same synchronous step: each adopted IP is assigned to the pod that holds it and queued
        for the state file (one batch, returned: durable once it settles), so nothing can take
        it meanwhile; every other outcome changes nothing. Each finding is logged and counted;
        with `again` (the remembered unknown addresses, after a control-plane update), only
        those decided now."""
        findings = check_world(self.pool(), sightings)
        ops: list[Save] = []
        for finding in findings:
            if finding.outcome is Outcome.UNKNOWN:
                if again:
                    continue
                self.ledger.remembered[finding.address] = finding
            else:
                self.ledger.remembered.pop(finding.address, None)
            if finding.outcome is Outcome.ADOPTED:
                assert finding.entry is not None
                pool = self.lanes[finding.entry.lane].pool
                record = pool.adopt(finding.entry.ip_id, finding.owner)
                ops.append(Save(assignment(record, pool.subnet)))
            self.ledger.record(finding)
            _log_finding(finding)
        if not ops:
            return findings, None
        batch = self.commits.record_saves(ops)
        self._kick()
        return findings, batch


def _log_finding(finding: Finding) -> None:
    """One line per address the world named that the state file did not have as it says."""
    owner = finding.owner
    fields: dict[str, object] = {
        "address": finding.address,
        "source": ",".join(dict.fromkeys(s.source.value for s in finding.sightings)),
        "pod": owner.pod or None,
        "container_id": owner.container_id,
        "reason": finding.why,
    }
    entry = finding.entry
    if entry is not None:
        fields |= {"ip_id": entry.ip_id, "subnet": entry.lane or None}
    if finding.outcome is Outcome.ADOPTED:
        log.warning("state_adopted", ifname=owner.ifname, **fields)
    elif finding.outcome is Outcome.CONFLICT:
        holder = entry.holder if entry is not None else None
        log.error(
            "state_conflict",
            **fields,
            held_by_pod=holder.pod or None if holder else None,
            held_by_container=holder.container_id if holder else None,
            outcome="refused: nothing changes, no pod loses the address; a human must look",
        )
    elif finding.outcome is Outcome.UNKNOWN:
        log.warning(
            "state_address_unknown",
            **fields,
            outcome="remembered: adopted, not handed out, if the pool gets it",
        )
