"""The world checks the state file: what to do with each address a live pod holds.

The state file is the node's memory of who holds which address, and the only one cns keeps. If
it lost a row (a damaged WAL, a file replaced, a restore from an old copy) that the file-level
checks cannot see, the address would look free and be handed to a second pod. After every start
the node therefore asks the world, the two parties that know which addresses pods really use:
the runtime (CRI: each ready sandbox's addresses, with its id) and, in a cluster, the API server
(each live pod's `status.podIPs`). Each address they name is decided here:

- free in the pool: **adopted** by the pod that holds it (the sandbox's own id when the runtime
  named it), so that no ADD can be given it;
- assigned to the same owner (same sandbox; for the API's word alone, the same pod): **fine**;
- assigned to another owner, or claimed by two owners in the world itself, or the adopter already
  holds another address of that lane: a **conflict**, refused: nothing changes, a human looks;
- not in the pool at all: **unknown**, remembered so that it is adopted, not handed out, if a
  network container brings it later.

Pure: no clock, no I/O. The node applies what this decides (cns/node/startup_check.py).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from cns.core.types import Owner, OwnerKey

# The container id an address adopted on the API's word alone is held under: `api:<pod uid>`.
API_OWNER_PREFIX = "api:"


class Source(StrEnum):
    """Who said that a pod holds an address."""

    CRI = "cri"  # the runtime: a ready sandbox's network status
    API = "api"  # the API server: a live pod's status.podIPs


class Outcome(StrEnum):
    FINE = "fine"
    ADOPTED = "adopted"
    CONFLICT = "conflict"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Sighting:
    """The world says `owner` (its pod, and the sandbox when the runtime named it) holds
    `address` (canonical text, as `canonical` makes it)."""

    source: Source
    address: str
    owner: Owner


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """An address of the pool: its lane, its IP id, and its holder (None: no pod holds it)."""

    lane: str
    ip_id: str
    holder: Owner | None


@dataclass(frozen=True, slots=True)
class Finding:
    """What to do about one address the world names (all its sightings, the runtime's first)."""

    outcome: Outcome
    address: str
    sightings: tuple[Sighting, ...]
    entry: PoolEntry | None
    why: str

    @property
    def owner(self) -> Owner:
        """The owner the world names (the one to adopt under)."""
        return self.sightings[0].owner


def canonical(address: str) -> str | None:
    """The address as the pool writes it (`10.0.0.5`, compressed IPv6), or None if it is not
    one (a prefix length is dropped: the runtime reports `10.0.0.5/24` as well as `10.0.0.5`)."""
    try:
        return str(ipaddress.ip_address(address.partition("/")[0].strip()))
    except ValueError:
        return None


def _same_holder(sighting: Sighting, holder: Owner) -> bool:
    """The runtime names the sandbox: the same container (or the same pod, held on the API's
    word alone). The API names only the pod: the same pod, or a holder whose runtime named no
    pod (nothing tells them apart)."""
    if sighting.source is Source.CRI:
        if holder.container_id.startswith(API_OWNER_PREFIX):
            return holder.pod == sighting.owner.pod
        return sighting.owner.container_id == holder.container_id
    return not holder.pod or holder.pod == sighting.owner.pod


def _who(owner: Owner) -> str:
    if owner.pod:
        return f"pod {owner.pod} (container {owner.container_id})"
    return f"container {owner.container_id}"


def check_world(pool: Mapping[str, PoolEntry], sightings: Iterable[Sighting]) -> list[Finding]:
    """One finding per address the world names, in the order first named.

    `pool`: every address of every lane (canonical text) -> its entry. Nothing is decided from
    the pool alone: an address no sighting names is not looked at (the leak check's business).
    """
    by_address: dict[str, list[Sighting]] = {}
    for sighting in sightings:
        by_address.setdefault(sighting.address, []).append(sighting)
    # (lane, owner key) -> address: held now, or adopted by an earlier finding of this check
    held: dict[tuple[str, OwnerKey], str] = {
        (e.lane, e.holder.key): a for a, e in pool.items() if e.holder is not None
    }
    findings = []
    for address, seen in by_address.items():
        seen.sort(key=lambda s: s.source is not Source.CRI)  # the runtime's first: it has the id
        found = tuple(seen)
        entry = pool.get(address)
        cri_sandboxes = {s.owner.container_id for s in found if s.source is Source.CRI}
        pods = {s.owner.pod for s in found if s.owner.pod}
        if len(cri_sandboxes) > 1 or len(pods) > 1:
            claimants = sorted({f"{s.source.value}: {_who(s.owner)}" for s in found})
            why = f"the world names more than one holder: {'; '.join(claimants)}"
            findings.append(Finding(Outcome.CONFLICT, address, found, entry, why))
            continue
        owner = found[0].owner
        if entry is None:
            why = f"{_who(owner)} holds it and no network container of the node has it"
            findings.append(Finding(Outcome.UNKNOWN, address, found, None, why))
        elif entry.holder is not None:
            if all(_same_holder(s, entry.holder) for s in found):
                findings.append(Finding(Outcome.FINE, address, found, entry, "held by its pod"))
            else:
                why = f"the state file gives it to {_who(entry.holder)}; {_who(owner)} holds it"
                findings.append(Finding(Outcome.CONFLICT, address, found, entry, why))
        elif (other := held.get((entry.lane, owner.key))) is not None:
            why = f"{_who(owner)} holds it, and {other} of the same subnet in the state file"
            findings.append(Finding(Outcome.CONFLICT, address, found, entry, why))
        else:
            held[(entry.lane, owner.key)] = address
            why = f"free in the state file; {_who(owner)} holds it"
            findings.append(Finding(Outcome.ADOPTED, address, found, entry, why))
    return findings


@dataclass(slots=True)
class WorldLedger:
    """What the start-up check found, for /debug and the metrics.

    `state`: off (nothing to ask: no CRI socket, not in a cluster), pending (ADDs wait for it),
    done (every source answered), partial (the gate opened without a source that did not answer
    in time; it is asked again and checked when it answers). `remembered`: unknown addresses,
    adopted instead of handed out if the pool gets them.
    """

    state: str = "off"
    sources: dict[str, str] = field(default_factory=dict)  # source -> "checked" or why not
    outcomes: Counter[str] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)  # every non-fine one, the newest last
    remembered: dict[str, Finding] = field(default_factory=dict)
    seconds: float | None = None  # how long the check took, from the start of the wait

    KEEP_FINDINGS: ClassVar[int] = 1024

    def record(self, finding: Finding) -> None:
        self.outcomes[finding.outcome.value] += 1
        if finding.outcome is not Outcome.FINE:
            self.findings.append(finding)
            del self.findings[: -self.KEEP_FINDINGS]
