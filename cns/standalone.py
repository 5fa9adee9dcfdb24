"""The embedded control plane for one node: allocates IPs from a configured subnet.

It plays the part the subnet controller plays in a cluster, behind the same `NCSource` protocol,
and answers only after `allocationLatencyMs`, so the daemon always takes the asynchronous path it
takes in production. Its state (the network container it handed out) lives in its own file, as a
remote control plane's would, written atomically on every change.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from cns.config import StandaloneConfig
from cns.core.scaling import next_exhausted
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest
from cns.fsutil import atomic_write
from cns.source import SourceState, StateListener
from cns.store import StateError

FORMAT_VERSION = 1

log = structlog.get_logger("cns.standalone")


class StandaloneAllocator:
    """Hands one node secondary IPs from `config.subnet`, honouring `ipsNotInUse`."""

    def __init__(self, config: StandaloneConfig, path: Path) -> None:
        self.config = config
        self.path = path
        self.subnet = Subnet("standalone", config.subnet, config.gateway)
        self.network = self.subnet.network
        self.gateway = self.subnet.gateway_address
        self.nc = NetworkContainer(id="", primary_ips=(), subnet="", gateway="")
        self.request = PoolRequest(0)
        self.exhausted = False
        self._pending: PoolRequest | None = None
        self._wake = asyncio.Event()

    # -- persistence ---------------------------------------------------------------------------

    def load(self) -> None:
        """Read the allocator's file, or create a fresh network container if there is none."""
        if not self.path.exists():
            self.nc = NetworkContainer(
                id=str(uuid.uuid4()),
                primary_ips=tuple(self._free_addresses(self.config.primary_ip_count, set())),
                subnet=str(self.network),
                gateway=self.gateway,
            )
            self._evaluate_exhaustion()
            self._save()
            return
        try:
            data = json.loads(self.path.read_text())
            self._restore(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateError(
                f"standalone allocator state {self.path} is unreadable ({exc}); refusing to "
                "start: restore it or move it away"
            ) from exc

    def _restore(self, data: dict[str, Any]) -> None:
        if data["formatVersion"] != FORMAT_VERSION:
            raise ValueError(f"format version {data['formatVersion']}")
        nc = data["networkContainer"]
        if nc["subnet"] != str(self.network) or nc["gateway"] != self.gateway:
            raise StateError(
                f"standalone allocator state {self.path} was created for subnet {nc['subnet']} "
                f"gateway {nc['gateway']}, but the config says subnet {self.network} gateway "
                f"{self.gateway}; changing the subnet under running pods is unsafe: move the "
                "state directory away to start over"
            )
        self.nc = NetworkContainer(
            id=nc["id"],
            primary_ips=tuple(nc["primaryIPs"]),
            subnet=nc["subnet"],
            gateway=nc["gateway"],
            ip_configs=tuple(
                IPConfig(c["id"], c["address"], int(c["version"])) for c in nc["ipConfigs"]
            ),
            version=int(nc["version"]),
            programmed_version=int(nc["version"]),
        )
        request = data["request"]
        self.request = PoolRequest(int(request["requestedIPCount"]), tuple(request["ipsNotInUse"]))
        self.exhausted = bool(data["exhausted"])

    def _save(self) -> None:
        nc = self.nc
        data = {
            "formatVersion": FORMAT_VERSION,
            "networkContainer": {
                "id": nc.id,
                "primaryIPs": list(nc.primary_ips),
                "subnet": nc.subnet,
                "gateway": nc.gateway,
                "version": nc.version,
                "ipConfigs": [
                    {"id": c.id, "address": c.address, "version": c.version} for c in nc.ip_configs
                ],
            },
            "request": {
                "requestedIPCount": self.request.requested_ip_count,
                "ipsNotInUse": list(self.request.ips_not_in_use),
            },
            "exhausted": self.exhausted,
        }
        atomic_write(self.path, json.dumps(data, indent=1).encode())

    # -- allocation ----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Addresses a node could ever get: the subnet's hosts minus the gateway."""
        return self.subnet.capacity

    def reserved(self) -> int:
        return len(self.nc.primary_ips) + len(self.nc.ip_configs)

    def _free_addresses(self, count: int, used: set[str]) -> Iterator[str]:
        taken = used | set(self.nc.primary_ips)
        free = (address for address in self.subnet.usable() if address not in taken)
        return itertools.islice(free, count)

    def fulfil(self, request: PoolRequest) -> bool:
        """Apply a request: drop released IPs, add new ones up to the count. True if changed.

        Never removes an IP that is not in `ipsNotInUse`: only the node knows which are in use.
        """
        self.request = request
        released = set(request.ips_not_in_use)
        kept = [c for c in self.nc.ip_configs if c.id not in released]
        released_count = len(self.nc.ip_configs) - len(kept)
        missing = max(0, request.requested_ip_count - len(kept))
        version = self.nc.version + 1
        added = [
            IPConfig(str(uuid.uuid4()), address, version)
            for address in self._free_addresses(missing, {c.address for c in kept})
        ]
        changed = bool(added) or released_count > 0
        if changed:
            self.nc = replace(
                self.nc,
                ip_configs=tuple(kept + added),
                version=version,
                programmed_version=version,
            )
        was_exhausted = self.exhausted
        self._evaluate_exhaustion()
        if changed or was_exhausted != self.exhausted:
            log.info(
                "allocator_applied",
                requested=request.requested_ip_count,
                released=released_count,
                added=len(added),
                version=self.nc.version,
                reserved=self.reserved(),
                capacity=self.capacity,
                exhausted=self.exhausted,
            )
        return changed or was_exhausted != self.exhausted

    def _evaluate_exhaustion(self) -> None:
        thresholds = self.config.exhaustion
        self.exhausted = next_exhausted(
            self.exhausted,
            self.reserved(),
            self.capacity,
            thresholds.upper_percent,
            thresholds.lower_percent,
        )

    def snapshot(self) -> SourceState:
        return SourceState((self.nc,), self.exhausted, None, self.request)

    # -- NCSource ------------------------------------------------------------------------------

    async def run(self, on_state: StateListener) -> None:
        on_state(self.snapshot())
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.config.allocation_latency_ms:
                await asyncio.sleep(self.config.allocation_latency_ms / 1000)
            request, self._pending = self._pending, None
            if request is None:
                continue
            previous = self.request
            if self.fulfil(request):
                await asyncio.to_thread(self._save)
                on_state(self.snapshot())
            elif request != previous:
                await asyncio.to_thread(self._save)

    async def publish(self, request: PoolRequest) -> None:
        self._pending = request
        self._wake.set()
