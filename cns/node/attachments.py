"""Pod interfaces for the main plugin (`cns-cni`): an IP from the pool plus a veth in the pod.

Each attachment is recorded durably (netns path, host veth) so that it can be found after a
restart. Leaks are reaped two ways: an attachment whose IP was released by any path (DEL, GC,
queued DEL) loses its host veth; an attachment whose netns and host veth are both gone (the
runtime recreated the sandbox and never told us) gets its IP released, reason `leak-check`.

Building and removing veths runs in worker threads. The kernel does that work inside the netlink
send() under the RTNL lock, which others hold for tens of milliseconds in a burst (namespace
teardown; a veth deletion alone takes 15-50 ms), and the loop keeps serving other pods meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

from cns.core.types import Owner, OwnerKey
from cns.host import datapath
from cns.node.errors import Conflict, InternalError, InvalidRequest, IPAMError
from cns.node.service import NodeIPAM
from cns.state.store import ForgetAttachment, SaveAttachment, Store

log = structlog.get_logger("cns.attachments")


def cni_result(
    attached: datapath.Attachment, addresses: Sequence[str], netns: str, ifname: str
) -> dict[str, Any]:
    """The CNI 1.x result of an attach: the host veth, then the pod's interface; each address as
    /32 or /128 on the pod's interface (index 1) with its family's gateway; a default route per
    family present, in the order the addresses came."""
    ips = [ipaddress.ip_address(a) for a in addresses]
    versions = list(dict.fromkeys(ip.version for ip in ips))
    return {
        "interfaces": [
            {"name": attached.host_ifname, "mac": attached.host_mac, "mtu": attached.mtu},
            {"name": ifname, "mac": attached.sandbox_mac, "mtu": attached.mtu, "sandbox": netns},
        ],
        "ips": [
            {
                "address": f"{ip}/{ip.max_prefixlen}",
                "gateway": datapath.GATEWAYS[ip.version],
                "interface": 1,
            }
            for ip in ips
        ],
        "routes": [
            {"dst": datapath.DEFAULT_ROUTES[v], "gw": datapath.GATEWAYS[v]} for v in versions
        ],
    }


def refuse_host_namespace(netns: str) -> None:
    """Code 4 naming CNI_NETNS when `netns` is the daemon's (the host's) own network namespace:
    a pod's interface, routes and neighbours built there would replace the host's."""
    try:
        datapath.refuse_host_namespace(netns)
    except datapath.HostNamespace as exc:
        raise _host_refused(exc) from None


def _host_refused(exc: datapath.HostNamespace) -> InvalidRequest:
    return InvalidRequest(4, f"CNI_NETNS: {exc}", "a pod needs a network namespace of its own")


async def _remove_interface(key: OwnerKey) -> None:
    """Delete the pod's veth pair (its peer and host route go with it), in a worker thread."""
    await asyncio.to_thread(datapath.detach, key.container_id, key.ifname)


class Attachments:
    def __init__(self, node: NodeIPAM, store: Store) -> None:
        self.node = node
        self.store = store
        self.rows: dict[OwnerKey, tuple[str, str]] = dict(store.attachments)
        self._forwarding_checked: set[int] = set()  # the IP versions found forwarding
        self._in_progress: set[OwnerKey] = set()
        store.resync_listeners.append(self._follow_disk)

    async def add(
        self,
        owner: Owner,
        netns: str,
        mtu: int,
        requested: str = "",
        subnets: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Assign an IP (waiting for one if need be; `requested`: those addresses; `subnets`: one
        of each, all or none, see `NodeIPAM.add`), then wire the pod with all of them; the
        result is CNI 1.x.

        The attachment is recorded before the IP is assigned (in the same commit or an earlier
        one): a crash at any point leaves a record the reaper can act on, never an IP nobody
        will release. If the record is refused, the IP is released again.
        """
        if not netns:
            raise InvalidRequest(4, "netns is required for ADD (CNI_NETNS)")
        refuse_host_namespace(netns)  # before anything is recorded or assigned
        self.node.refuse_conflict(owner)  # before the attachment's record is touched
        moved = self._refuse_another_namespace(owner.key, netns)
        self._in_progress.add(owner.key)
        try:
            return await self._add(
                owner, netns, mtu, moved=moved, requested=requested, subnets=subnets
            )
        finally:
            self._in_progress.discard(owner.key)

    def _refuse_another_namespace(self, key: OwnerKey, netns: str) -> bool:
        """A repeated ADD must name the network namespace the attachment is in (by any path).

        In another one (a runtime's mistake, a typo) the interface cannot be built, and undoing
        that failed ADD would take the running pod's interface and IP away: refused before
        anything is touched (a Conflict, code 4), like an ADD for another pod. An attachment whose
        namespace is gone may be built anew (its sandbox died without a DEL): True then.
        """
        row = self.rows.get(key)
        if row is None or row[0] == netns:
            return False
        try:
            current = os.stat(row[0])
        except OSError:
            return True
        try:
            named = os.stat(netns)
        except OSError:
            named = None
        if named is None or (named.st_dev, named.st_ino) != (current.st_dev, current.st_ino):
            raise Conflict(
                4,
                f"container {key.container_id} interface {key.ifname} is attached in network "
                f"namespace {row[0]}, not {netns}",
            )
        return False

    async def _add(
        self,
        owner: Owner,
        netns: str,
        mtu: int,
        *,
        moved: bool,
        requested: str,
        subnets: Sequence[str],
    ) -> dict[str, Any]:
        try:  # before the IP is assigned: nothing to undo
            self._enable_forwarding([4])
        except datapath.AttachError as exc:
            raise InternalError(105, f"cannot set up {owner.ifname} in {netns}", str(exc)) from exc
        host = datapath.host_ifname(owner.container_id, owner.ifname)
        # What an earlier request made, which a failure of this one must leave as it was.
        held = bool(self.node.held_by(owner.key))
        previous = self.rows.get(owner.key)
        self.rows[owner.key] = (netns, host)
        recorded = self.store.enqueue([SaveAttachment(owner.key, netns, host)])
        try:
            result = await self.node.add(owner, requested, subnets)
            await self.node.durable(recorded)  # settled already: same commit or an earlier one
        except IPAMError:
            if held:
                await self._restore(owner.key, previous)
            else:
                await self._forget(owner.key)
                with contextlib.suppress(IPAMError):  # the reaper releases it if this fails too
                    await self.node.delete(owner.key, reason="attach-not-recorded")
            raise
        addresses = [record.address for record, _ in result.ips]
        if moved:
            # The old namespace is unmounted, but the kernel tears it down later: its veth may
            # still hold the host-side name the new pair needs.
            await _remove_interface(owner.key)
        try:
            # IPv6 forwarding only once a pod has an IPv6 address (docs/networking.md: it changes
            # how the node treats router advertisements).
            self._enable_forwarding(ip.version for ip in datapath.pod_addresses(addresses))
            attached = await asyncio.to_thread(
                datapath.attach, netns, owner.ifname, owner.container_id, addresses, mtu
            )
        except (datapath.AttachError, OSError) as exc:
            if previous is None:  # a veth half made by this request goes
                await _remove_interface(owner.key)
            if held:
                await self._restore(owner.key, previous)
            else:
                self._forget_queued(owner.key)
                await self.node.delete(owner.key, reason="attach-failed")
            if isinstance(exc, datapath.HostNamespace):  # the path changed since the check
                raise _host_refused(exc) from exc
            raise InternalError(105, f"cannot set up {owner.ifname} in {netns}", str(exc)) from exc
        return cni_result(attached, addresses, netns, owner.ifname)

    def _enable_forwarding(self, versions: Iterable[int]) -> None:
        """Forwarding on for each IP version, checked once per version (datapath.AttachError)."""
        for version in versions:
            if version not in self._forwarding_checked:
                datapath.enable_forwarding(version)
                self._forwarding_checked.add(version)

    async def delete(self, key: OwnerKey) -> str | None:
        """Remove the pod's interface and release its IP; fine when either is already gone."""
        await _remove_interface(key)
        self._forget_queued(key)  # one commit with the release
        record = await self.node.delete(key, reason="cni-del")
        return None if record is None else record.address

    async def check(self, key: OwnerKey, netns: str, addresses: list[str]) -> None:
        records = self.node.check(key, addresses)
        problems = await datapath.check(
            netns, key.ifname, key.container_id, [r.address for r in records]
        )
        if problems:
            raise Conflict(106, "; ".join(problems))

    def _forget_queued(self, key: OwnerKey) -> None:
        """Drop the attachment's record in the next commit (the caller's)."""
        if self.rows.pop(key, None) is not None:
            self.store.enqueue([ForgetAttachment(key)])

    async def _restore(self, key: OwnerKey, previous: tuple[str, str] | None) -> None:
        """After a failed attach for an owner that already held its IP (a cns-ipam ADD, or an
        earlier attach its runtime will DEL): the IP stays, and so does the earlier record."""
        if previous is None:
            await self._forget(key)
            return
        self.rows[key] = previous
        await self.store.enqueue([SaveAttachment(key, *previous)]).wait()

    async def _forget(self, key: OwnerKey) -> None:
        """Drop the attachment's record now; if that commit fails, the row comes back
        (`_follow_disk`) and the reaper tries again later."""
        if self.rows.pop(key, None) is not None:
            await self.store.enqueue([ForgetAttachment(key)]).wait()

    def _follow_disk(self) -> None:
        """After a failed or refused commit, the rows are what the state file records."""
        self.rows = dict(self.store.attachments)

    async def reap(self) -> int:
        """Release what leaked; returns how many attachments were cleaned up."""
        cleaned = 0
        for key, (netns, _host) in list(self.rows.items()):
            if key in self._in_progress:
                continue  # its ADD is still waiting for an IP or building the interface
            if not self.node.held_by(key):
                # Released by GC or a queued DEL: the interface must go too.
                await _remove_interface(key)
                await self._forget(key)
                cleaned += 1
                continue
            gone = not datapath.host_link_exists(key.container_id, key.ifname)
            if gone and not os.path.exists(netns):
                self._forget_queued(key)
                await self.node.delete(key, reason="leak-check: netns and host veth gone")
                cleaned += 1
        return cleaned

    async def reap_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                cleaned = await self.reap()
            except Exception as exc:  # never kill the daemon over a check
                log.error("attachment_reap_failed", error=repr(exc))
                continue
            if cleaned:
                log.info("attachments_reaped", count=cleaned)
