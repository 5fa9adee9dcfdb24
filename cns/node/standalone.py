"""The embedded control plane for one node: allocates IPs from configured subnets.

It plays the part the subnet controller plays in a cluster, behind the same `NCSource` protocol,
and answers only after `allocationLatencyMs`, so the daemon always takes the asynchronous path it
takes in production. Its state (the network container it handed out) lives in its own file, as a
remote control plane's would, written atomically on every change, and always before the node
hears of the change: if it cannot be written, nothing is granted and the request is retried.
Each further subnet (`standalone.subnets`, dual-stack: an IPv6 one) has an allocator and a file
of its own; `StandaloneSource` puts them behind one NCSource.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from cns.config.daemon_config import StandaloneConfig, StandaloneSubnet
from cns.core.scaling import exhaustion_after, reserved_once_cleared
from cns.core.subnet import Subnet
from cns.core.types import IPConfig, NetworkContainer, PoolRequest, Scaler
from cns.node.control_plane import NO_SUBNETS, FurtherSubnetState, SourceState, StateListener
from cns.state.fsutil import atomic_write, describe_os_error
from cns.state.store import StateError

FORMAT_VERSION = 1
SAVE_RETRY_SECONDS = 1.0

log = structlog.get_logger("cns.standalone")


@dataclass(frozen=True, slots=True)
class Grant:
    """What the allocator has given the node; on disk before the node hears of it."""

    nc: NetworkContainer
    request: PoolRequest
    exhausted: bool


class StandaloneAllocator:
    """Hands one node secondary IPs from `subnet` (default: the primary, `config.subnet`),
    honouring `ipsNotInUse`.

    `scaler` is the node's own: what it takes back once the exhaustion clears decides whether
    the exhaustion may clear (`exhaustion_after`)."""

    def __init__(
        self,
        config: StandaloneConfig,
        path: Path,
        *,
        scaler: Scaler,
        subnet: StandaloneSubnet | None = None,
    ) -> None:
        self.config = config
        self.spec = subnet or config.primary
        self.scaler = scaler
        self.path = path
        self.subnet = Subnet(
            self.spec.name,
            self.spec.subnet,
            self.spec.gateway,
            reserved_ips=frozenset(self.spec.reserved_ips),
        )
        self.network = self.subnet.network
        self.gateway = self.subnet.gateway_address
        self.grant = Grant(
            NetworkContainer(id="", primary_ips=(), subnet="", gateway=""), PoolRequest(0), False
        )
        self._pending: PoolRequest | None = None
        self._wake = asyncio.Event()

    # -- persistence ---------------------------------------------------------------------------

    def load(self) -> None:
        """Read the allocator's file, or create a fresh network container if there is none."""
        try:
            if not self.path.exists():
                nc = NetworkContainer(
                    id=str(uuid.uuid4()),
                    primary_ips=tuple(self._free_addresses((), self.spec.primary_ip_count, set())),
                    subnet=str(self.network),
                    gateway=self.gateway,
                    subnet_name=self.spec.name,
                )
                request = PoolRequest(0)
                grant = Grant(nc, request, self._exhausted_after(nc, request, False))
                self._save(grant)
                self.grant = grant
                return
            text = self.path.read_text()
        except OSError as exc:
            raise StateError(
                f"standalone allocator state {self.path} cannot be read or written: "
                f"{describe_os_error(exc)}; make the file system writable or fix the "
                "permissions, and start again"
            ) from exc
        try:
            self.grant = self._restore(json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(
                f"standalone allocator state {self.path} is unreadable ({exc}); refusing to "
                "start: restore it or move it away"
            ) from exc

    def _restore(self, data: dict[str, Any]) -> Grant:
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
        request = data["request"]
        return Grant(
            NetworkContainer(
                id=nc["id"],
                primary_ips=tuple(nc["primaryIPs"]),
                subnet=nc["subnet"],
                gateway=nc["gateway"],
                ip_configs=tuple(
                    IPConfig(c["id"], c["address"], int(c["version"])) for c in nc["ipConfigs"]
                ),
                version=int(nc["version"]),
                programmed_version=int(nc["version"]),
                subnet_name=self.spec.name,
            ),
            PoolRequest(int(request["requestedIPCount"]), tuple(request["ipsNotInUse"])),
            bool(data["exhausted"]),
        )

    def _save(self, grant: Grant) -> None:
        nc = grant.nc
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
                "requestedIPCount": grant.request.requested_ip_count,
                "ipsNotInUse": list(grant.request.ips_not_in_use),
            },
            "exhausted": grant.exhausted,
        }
        atomic_write(self.path, json.dumps(data, indent=1).encode())

    # -- allocation ----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Addresses a node could ever get: the subnet's hosts minus the gateway."""
        return self.subnet.capacity

    def _free_addresses(
        self, primary_ips: Iterable[str], count: int, used: set[str]
    ) -> Iterator[str]:
        taken = used | set(primary_ips)
        free = (address for address in self.subnet.usable() if address not in taken)
        return itertools.islice(free, count)

    def _exhausted_after(self, nc: NetworkContainer, request: PoolRequest, exhausted: bool) -> bool:
        thresholds = self.config.exhaustion
        primaries = len(nc.primary_ips)
        return exhaustion_after(
            exhausted,
            reserved=_reserved(nc),
            once_cleared=reserved_once_cleared(self.scaler, request.requested_ip_count, primaries),
            capacity=self.capacity,
            upper_percent=thresholds.upper_percent,
            lower_percent=thresholds.lower_percent,
        )

    def fulfil(self, request: PoolRequest) -> Grant:
        """The grant after a request: released IPs dropped, new ones added up to the count.

        Pure: the caller persists the grant before anyone hears of it. Never removes an IP that
        is not in `ipsNotInUse`: only the node knows which are in use.
        """
        nc = self.grant.nc
        released = set(request.ips_not_in_use)
        kept = [c for c in nc.ip_configs if c.id not in released]
        missing = max(0, request.requested_ip_count - len(kept))
        version = nc.version + 1
        added = [
            IPConfig(str(uuid.uuid4()), address, version)
            for address in self._free_addresses(nc.primary_ips, missing, {c.address for c in kept})
        ]
        if added or len(kept) < len(nc.ip_configs):
            nc = replace(
                nc, ip_configs=tuple(kept + added), version=version, programmed_version=version
            )
        return Grant(nc, request, self._exhausted_after(nc, request, self.grant.exhausted))

    def snapshot(self) -> SourceState:
        grant = self.grant
        return SourceState((grant.nc,), grant.exhausted, None, grant.request)

    def reserve(self, reserved_ips: tuple[str, ...]) -> bool:
        """Reserve `reserved_ips` from now on (already checked by the configuration's parser);
        whether the reservations changed. Nothing granted is taken: what they now cover is
        asked back (`reserved_held`)."""
        if reserved_ips == self.spec.reserved_ips:
            return False
        self.spec = replace(self.spec, reserved_ips=reserved_ips)
        self.subnet = replace(self.subnet, reserved_ips=frozenset(reserved_ips))
        return True

    def reserved_held(self) -> tuple[IPConfig, ...]:
        """The granted IPs a reservation now covers (`reservedIPs` changed over a restart):
        kept while a pod uses them, asked back (`release_requests`) and never granted again."""
        reservations = self.subnet.reservations
        return tuple(
            config
            for config in self.grant.nc.ip_configs
            if ipaddress.ip_address(config.address) in reservations
        )

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
            if not await self._apply(self.fulfil(request), on_state):
                self._pending = self._pending or request  # a newer request replaces it
                await asyncio.sleep(SAVE_RETRY_SECONDS)
                self._wake.set()

    async def _apply(self, grant: Grant, on_state: StateListener) -> bool:
        """Persist the grant, then apply and announce it; False (nothing applied) if it could
        not be written: an IP the file does not list is never handed out."""
        previous = self.grant
        if grant == previous:
            return True
        try:
            await asyncio.to_thread(self._save, grant)
        except OSError as exc:
            log.error(
                "allocator_save_failed",
                file=str(self.path),
                error=describe_os_error(exc),
                retry_in=SAVE_RETRY_SECONDS,
            )
            return False
        self.grant = grant
        if grant.nc == previous.nc and grant.exhausted == previous.exhausted:
            return True
        before = {c.id for c in previous.nc.ip_configs}
        after = {c.id for c in grant.nc.ip_configs}
        log.info(
            "allocator_applied",
            requested=grant.request.requested_ip_count,
            released=len(before - after),
            added=len(after - before),
            version=grant.nc.version,
            reserved=_reserved(grant.nc),
            capacity=self.capacity,
            exhausted=grant.exhausted,
        )
        on_state(self.snapshot())
        return True

    async def publish(
        self, request: PoolRequest, subnets: Mapping[str, PoolRequest] = NO_SUBNETS
    ) -> None:
        self._pending = request
        self._wake.set()


def _reserved(nc: NetworkContainer) -> int:
    return len(nc.primary_ips) + len(nc.ip_configs)


class StandaloneSource:
    """The allocators of the primary subnet and of each further one, as one NCSource: every
    change of any of them is delivered as one snapshot of all, and one publish hands each its
    subnet's request."""

    def __init__(self, config: StandaloneConfig, state_dir: Path, *, scaler: Scaler) -> None:
        # The primary's file has no subnet in its name (the name nodes already have on disk).
        self.primary = StandaloneAllocator(
            config, state_dir / "standalone-allocator.json", scaler=scaler
        )
        self.further = {
            subnet.name: StandaloneAllocator(
                config,
                state_dir / f"standalone-allocator-{subnet.name}.json",
                scaler=scaler,
                subnet=subnet,
            )
            for subnet in config.subnets
        }
        self._listener: StateListener | None = None  # while `run` runs

    def load(self) -> None:
        for allocator in (self.primary, *self.further.values()):
            allocator.load()
            self._say_reserved_held(allocator)

    @staticmethod
    def _say_reserved_held(allocator: StandaloneAllocator) -> None:
        for config in allocator.reserved_held():
            log.warning(
                "reserved_address_held",
                subnet=allocator.spec.name,
                address=config.address,
                ip_id=config.id,
                action="asked back: released once no pod uses it, then never granted again",
            )

    def reserve_again(self, config: StandaloneConfig) -> None:
        """The reservations of each subnet as `config` says now (SIGHUP), delivered to the node
        at once: addresses they newly cover that pods hold are reported and asked back. A
        subnet removed, or with another field changed, needs a restart: said, and its
        reservations left as they were (they were checked against the subnet as it is now)."""
        allocators = {"": self.primary, **self.further}
        specs = {"": config.primary, **{s.name: s for s in config.subnets}}
        changed = False
        for name, allocator in allocators.items():
            spec = specs.get(name)
            if spec is None or replace(spec, reserved_ips=allocator.spec.reserved_ips) != (
                allocator.spec
            ):
                log.warning(
                    "config_change_needs_restart",
                    subnet=allocator.spec.name,
                    meaning="only reservedIPs are read again on SIGHUP; this subnet's are kept",
                )
                continue
            if allocator.reserve(spec.reserved_ips):
                changed = True
                log.info(
                    "reserved_ips_changed",
                    subnet=allocator.spec.name,
                    reserved_ips=list(spec.reserved_ips),
                )
                self._say_reserved_held(allocator)
        for name in specs.keys() - allocators.keys():
            log.warning("config_change_needs_restart", subnet=name, meaning="a subnet added")
        if changed and self._listener is not None:
            self._listener(self.snapshot())

    def snapshot(self) -> SourceState:
        state = self.primary.snapshot()
        subnets = {}
        asked = []
        for allocator in (self.primary, *self.further.values()):
            asked += [config.id for config in allocator.reserved_held()]
        for name, allocator in self.further.items():
            grant = allocator.grant
            subnets[name] = FurtherSubnetState((grant.nc,), grant.exhausted, None, grant.request)
        return replace(state, subnets=subnets, release_requests=tuple(asked))

    async def run(self, on_state: StateListener) -> None:
        self._listener = on_state

        def changed(_: SourceState) -> None:
            on_state(self.snapshot())

        async with asyncio.TaskGroup() as group:
            for allocator in (self.primary, *self.further.values()):
                group.create_task(allocator.run(changed))

    async def publish(
        self, request: PoolRequest, subnets: Mapping[str, PoolRequest] = NO_SUBNETS
    ) -> None:
        await self.primary.publish(request)
        for name, asked in subnets.items():
            allocator = self.further.get(name)
            if allocator is not None:  # a subnet not configured here is never granted
                await allocator.publish(asked)
