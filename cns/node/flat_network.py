"""The flat-network mode (config `flatNetwork`): the node answers ARP and neighbour solicitations
on its uplink for exactly the pod addresses it holds, so that pods take addresses of the nodes'
own LAN and every machine on it reaches them (docs/networking.md, "Flat network").

It follows the node's pool, whichever plugin the addresses went to (cns-cni's attachments and
cns-ipam's IPAM-only assignments alike): `NodeIPAM` calls `assigned` before it answers an ADD
(an entry that cannot be set fails the ADD: the pod would be unreachable) and `pool_changed`
after every release (DEL, GC, leak reclaim, the release queue, an undone commit) and adoption,
which wakes the task that makes the entries match the pool (`reconcile`, also at start and every
interval). The decision is cns/core/flat_network.py's; the entries and frames are cns/host's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable, Sequence

import structlog

from cns.core.flat_network import (
    UPLINK_KEY,
    ProxyChanges,
    UplinkError,
    choose_uplink,
    proxy_changes,
)
from cns.core.requested import IPNetwork
from cns.host import announce, datapath, proxy_neighbours, rtnl
from cns.host.proxy_neighbours import Uplink
from cns.node.errors import InternalError
from cns.node.service import NodeIPAM

log = structlog.get_logger("cns.flat_network")


class FlatNetwork:
    """The uplink's proxy entries of one node, kept equal to the addresses its pool holds."""

    def __init__(
        self,
        node: NodeIPAM,
        *,
        uplink: str,
        on_announce_failed: Callable[[], None] = lambda: None,
    ) -> None:
        """`uplink`: the configured link; "" finds it (`choose_uplink`) at `start`."""
        self.node = node
        self.configured = uplink
        self.on_announce_failed = on_announce_failed
        self.uplink: Uplink | None = None
        self.announcer: announce.Announcer | None = None
        self._lock = asyncio.Lock()  # one change of the entries at a time, decided inside it
        self._changed = asyncio.Event()
        self._sysctls_on: set[tuple[str, ...]] = set()
        # Every pod subnet seen since start: an entry left in a subnet the node has since lost
        # is still ours to remove.
        self._subnets: set[IPNetwork] = set()

    async def start(self) -> ProxyChanges:
        """Find the uplink and make its entries match the pool (once the pod subnets are
        known: the daemon calls this after the first network container). UplinkError naming
        `flatNetwork.uplink` when there is no such link or no single one to choose."""
        name = self.configured
        if not name:
            links = await proxy_neighbours.link_addresses()
            name = choose_uplink(links, self.node.pod_subnets())
        try:
            self.uplink = await proxy_neighbours.uplink(name)
        except proxy_neighbours.UplinkMissing:
            raise UplinkError(f"{UPLINK_KEY}: no interface {name!r} on this node") from None
        self.announcer = announce.Announcer(name)
        log.info("flat_network_uplink", uplink=name, configured=bool(self.configured))
        return await self.reconcile()

    def _up(self) -> Uplink:
        assert self.uplink is not None, "FlatNetwork.start comes first"
        return self.uplink

    async def reconcile(self) -> ProxyChanges:
        """Add the entries the pool's addresses lack and remove those of addresses it no
        longer holds (inside the pod subnets only)."""
        uplink = self._up()
        async with self._lock:
            present = await asyncio.to_thread(proxy_neighbours.proxied, uplink.index)
            self._subnets.update(self.node.pod_subnets())
            changes = proxy_changes(
                held=self.node.held_addresses(), present=present, pod_subnets=self._subnets
            )
            if changes.add:
                await asyncio.to_thread(proxy_neighbours.add, uplink.index, changes.add)
            if changes.remove:
                await asyncio.to_thread(proxy_neighbours.remove, uplink.index, changes.remove)
        if changes.add or changes.remove:
            log.info(
                "flat_network_reconciled",
                uplink=uplink.name,
                added=list(changes.add),
                removed=list(changes.remove),
            )
        return changes

    async def assigned(self, addresses: Sequence[str]) -> None:
        """Before an ADD is answered: the addresses' proxy entries (InternalError 105 naming
        the sysctl or the failure when one cannot be set), then their announcement (a failure
        is logged and counted, never fails the ADD: the entry already answers)."""
        uplink = self._up()
        try:
            for address in addresses:
                self._needs(ipaddress.ip_address(address).version, uplink.name)
            async with self._lock:
                await asyncio.to_thread(proxy_neighbours.add, uplink.index, addresses)
        except (datapath.AttachError, OSError) as exc:
            raise InternalError(
                105, f"cannot answer for {', '.join(addresses)} on {uplink.name}", str(exc)
            ) from exc
        assert self.announcer is not None
        try:
            self.announcer.send(announce.announcement(uplink.mac, a) for a in addresses)
        except OSError as exc:
            self.on_announce_failed()
            log.warning(
                "flat_network_announce_failed",
                uplink=uplink.name,
                ips=list(addresses),
                error=str(exc),
            )

    def _needs(self, version: int, uplink: str) -> None:
        """What the kernel needs to answer for an address of IP `version` on `uplink`:
        forwarding, and for IPv6 proxy_ndp on the uplink (each checked once)."""
        wanted = [tuple(datapath.FORWARDING[version].split("."))]
        if version == 6:
            wanted.append(("net", "ipv6", "conf", uplink, "proxy_ndp"))
        for keys in wanted:
            if keys not in self._sysctls_on:
                datapath.ensure_sysctl(*keys, absent=f"IPv{version} is off on {uplink}")
                self._sysctls_on.add(keys)

    def pool_changed(self) -> None:
        """Addresses went back (or were adopted): the follow task makes the entries match."""
        self._changed.set()

    async def follow_forever(self, interval: float) -> None:
        """Reconcile after every change of the pool but an ADD, after every change of the uplink
        (taking it down flushes its entries), and every `interval` seconds."""
        loop = asyncio.get_running_loop()
        events = proxy_neighbours.link_events()
        loop.add_reader(events.fileno(), self._on_link_events, events)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), interval)
                self._changed.clear()
                try:
                    await self.reconcile()
                except OSError as exc:  # retried at the next change or interval
                    log.error("flat_network_reconcile_failed", error=str(exc))
        finally:
            loop.remove_reader(events.fileno())
            events.close()

    def _on_link_events(self, events: socket.socket) -> None:
        """Wake the reconcile when a notification names the uplink (or some were lost)."""
        try:
            while data := events.recv(1 << 16):
                if self._up().index in rtnl.changed_links(data):
                    self._changed.set()
        except BlockingIOError:
            pass
        except OSError:  # ENOBUFS: notifications were dropped, the uplink's among them maybe
            self._changed.set()
