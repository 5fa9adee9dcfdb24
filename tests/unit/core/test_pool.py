"""The pool state machine: examples, then a hypothesis state machine over every transition."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cns.core.pool import Assignment, OwnerConflict, Pool
from cns.core.types import IPConfig, IPState, NetworkContainer, Owner, OwnerKey, PoolRequest, Scaler


def nc(
    count: int, version: int = 1, programmed: int | None = None, start: int = 10
) -> NetworkContainer:
    configs = tuple(
        IPConfig(f"ip-{i}", f"10.0.0.{i}", version) for i in range(start, start + count)
    )
    return NetworkContainer(
        "nc1",
        ("10.0.0.2",),
        "10.0.0.0/24",
        "10.0.0.1",
        configs,
        version,
        version if programmed is None else programmed,
    )


def owner(n: int, pod: str = "") -> Owner:
    return Owner(f"c{n}", "eth0", pod, "default" if pod else "")


def test_assign_is_idempotent_per_owner() -> None:
    pool = Pool()
    pool.apply_nc(nc(3))
    first, changed = pool.assign(owner(1))
    again, changed_again = pool.assign(owner(1))
    assert first is not None and again is first
    assert changed and not changed_again
    other, _ = pool.assign(owner(2))
    assert other is not None and other.address != first.address


def test_assign_records_pod_name_learnt_later() -> None:
    pool = Pool()
    pool.apply_nc(nc(1))
    pool.assign(owner(1))
    record, changed = pool.assign(owner(1, pod="web"))
    assert changed and record is not None and record.owner == owner(1, pod="web")


def test_assign_refuses_an_attachment_held_by_another_pod() -> None:
    pool = Pool()
    pool.apply_nc(nc(2))
    record, _ = pool.assign(owner(1, pod="web"))
    with pytest.raises(OwnerConflict) as conflict:
        pool.assign(owner(1, pod="db"))
    assert conflict.value.holder == owner(1, pod="web")
    assert record is not None and record.owner == owner(1, pod="web")  # not relabelled
    assert pool.assign(owner(1)) == (record, False)  # no pod named: the same IP, no change
    assert pool.assign(owner(1, pod="web")) == (record, False)


def test_no_free_ip_returns_none() -> None:
    pool = Pool()
    pool.apply_nc(nc(1))
    pool.assign(owner(1))
    assert pool.assign(owner(2)) == (None, False)


def test_release_is_idempotent_and_ip_reuse_is_fifo() -> None:
    pool = Pool()
    pool.apply_nc(nc(3))
    a, _ = pool.assign(owner(1))
    assert a is not None
    released = pool.release(owner(1).key)
    assert released is a and a.state is IPState.AVAILABLE
    assert pool.release(owner(1).key) is None
    assert pool.release(owner(99).key) is None
    b, _ = pool.assign(owner(2))
    assert b is not None and b.address != a.address  # freed longest ago comes first


def test_pending_programming_until_version_is_programmed() -> None:
    pool = Pool()
    pool.apply_nc(nc(2, version=3, programmed=2))
    assert pool.counts()[IPState.PENDING_PROGRAMMING] == 2
    assert pool.assign(owner(1)) == (None, False)
    change = pool.apply_nc(nc(2, version=3, programmed=3))
    assert len(change.programmed) == 2
    assert pool.counts()[IPState.AVAILABLE] == 2


def test_apply_nc_adds_and_drops_but_never_an_assigned_ip() -> None:
    pool = Pool()
    pool.apply_nc(nc(3))
    held, _ = pool.assign(owner(1))
    assert held is not None
    change = pool.apply_nc(nc(0, version=2))
    assert set(change.removed) == {"ip-11", "ip-12"}
    assert len(change.inconsistencies) == 1 and held.address in change.inconsistencies[0]
    assert pool.records == {held.id: held} and held.state is IPState.ASSIGNED


def test_an_older_nc_version_arriving_late_is_ignored() -> None:
    """Seen on a real node: the reply to the daemon's own NNC patch carried status version 2
    after the watch had delivered version 3; applying it dropped 47 IPs, some about to be used."""
    pool = Pool()
    pool.apply_nc(nc(15, version=2))
    pool.apply_nc(nc(63, version=3))
    held, _ = pool.assign(owner(1))
    stale = pool.apply_nc(nc(15, version=2))
    assert stale.stale and not stale.removed and not stale.inconsistencies
    assert len(pool.records) == 63 and pool.network_container("nc1") == nc(63, version=3)
    assert held is not None and held.state is IPState.ASSIGNED
    assert not pool.apply_nc(nc(63, version=3)).stale  # the same version again is no news


def test_apply_nc_readdressing_an_assigned_ip_is_reported_and_ignored() -> None:
    pool = Pool()
    pool.apply_nc(nc(1))
    held, _ = pool.assign(owner(1))
    assert held is not None
    moved = NetworkContainer(
        "nc1", ("10.0.0.2",), "10.0.0.0/24", "10.0.0.1", (IPConfig("ip-10", "10.0.0.99"),), 2, 2
    )
    change = pool.apply_nc(moved)
    assert change.inconsistencies and held.address == "10.0.0.10"


def test_duplicate_address_in_nc_is_reported() -> None:
    pool = Pool()
    dup = NetworkContainer(
        "nc1",
        ("10.0.0.2",),
        "10.0.0.0/24",
        "10.0.0.1",
        (IPConfig("a", "10.0.0.5"), IPConfig("b", "10.0.0.5")),
        1,
        1,
    )
    change = pool.apply_nc(dup)
    assert change.inconsistencies and len(pool.records) == 1


def test_mark_pending_release_order_is_pending_programming_then_highest_available() -> None:
    pool = Pool()
    pool.apply_nc(nc(4, version=1))
    newer = nc(4, version=1)
    extra = (IPConfig("ip-new", "10.0.0.50", 2),)
    pool.apply_nc(
        NetworkContainer(
            "nc1", newer.primary_ips, newer.subnet, newer.gateway, newer.ip_configs + extra, 2, 1
        )
    )
    pool.assign(owner(1))  # takes 10.0.0.10
    chosen = pool.mark_pending_release(3)
    assert chosen == ("ip-new", "ip-13", "ip-12")
    assert pool.ips_not_in_use() == tuple(sorted(chosen))
    assert pool.mark_pending_release(10) == ("ip-11",)  # never the assigned one


def test_plan_grows_in_one_step_and_shrinks_through_pending_release() -> None:
    scaler = Scaler()
    pool = Pool()
    pool.apply_nc(nc(15))
    request = pool.plan(scaler, False, demand=40, current=PoolRequest(15))
    assert request.requested_ip_count == 16 * 3 - 1  # 16 * ceil(0.5 + 40/16) - 1 primary
    request = pool.plan(scaler, True, demand=0, current=request)
    assert request.requested_ip_count == 1
    assert len(request.ips_not_in_use) == 14
    # the control plane drops them: the pool forgets them and the list empties
    pool.apply_nc(nc(1, version=2))
    assert pool.ips_not_in_use() == ()


def test_releases_in_flight_stay_pending_release_after_a_restart() -> None:
    pool = Pool()  # a restarted daemon: the NC still lists IPs whose release is in flight
    pool.apply_nc(nc(4))
    pool.assign(owner(1))  # 10.0.0.10
    assert pool.honour_release(["ip-12", "ip-13", "ip-unknown"]) == ()
    assert pool.ips_not_in_use() == ("ip-12", "ip-13")
    second, _ = pool.assign(owner(2))
    assert second is not None and second.id == "ip-11"
    assert pool.assign(owner(3)) == (None, False)
    assert pool.honour_release(["ip-10"]) == ("ip-10",)  # assigned: reported, kept
    assert pool.lookup(owner(1).key) is not None


def test_an_ip_asked_back_while_a_pod_holds_it_is_released_when_the_pod_is_done() -> None:
    """The control plane asks back an address (on two nodes, a node's own, reserved) that a pod
    here holds: kept while the pod lives; released by its pod, it is given up, never handed
    to the next pod here (which the other node holding it, or the reservation, forbids)."""
    pool = Pool()
    pool.apply_nc(nc(2))
    held, _ = pool.assign(owner(1))
    assert held is not None and held.id == "ip-10"
    assert pool.ask_back(["ip-10"]) == ("ip-10",)
    pool.release(owner(1).key, cool_until=99.0)
    assert pool.records["ip-10"].state is IPState.PENDING_RELEASE
    assert pool.ips_not_in_use() == ("ip-10",)
    other, _ = pool.assign(owner(2))
    assert other is not None and other.id == "ip-11"
    # An ask the control plane no longer makes is forgotten: that pod's IP is free again.
    assert pool.ask_back(["ip-11"]) == ("ip-11",)
    assert pool.ask_back([]) == ()
    pool.release(owner(2).key)
    assert pool.records["ip-11"].state is IPState.AVAILABLE


def test_restore_then_confirm() -> None:
    pool = Pool()
    pool.restore(Assignment("ip-10", "10.0.0.10", "nc1", owner(7, "db")))
    change = pool.apply_nc(nc(2))
    assert not change.inconsistencies
    record = pool.lookup(owner(7).key)
    assert record is not None and record.owner == owner(7, "db")
    assert pool.counts()[IPState.AVAILABLE] == 1


# -- the state machine --------------------------------------------------------------------------


COOLDOWN = 30.0


class PoolMachine(RuleBasedStateMachine):
    """Random interleavings of pod verbs, planning and a model control plane, which may also
    change its container's id (and its IPs' ids), or delete and re-create the node's record,
    granting back the addresses the node asks for (`requested_ips`)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.scaler = Scaler(batch_size=4, max_ip_count=40)
        self.exhausted = False
        self.version = 1
        self.configs: dict[str, IPConfig] = {}
        self.next_ip = 10
        self.request: PoolRequest | None = None
        self.replied: dict[str, str] = {}  # owner container -> address the pod was told
        self.now = 1000.0
        self.cool_ends: dict[str, float] = {}  # address -> end of its last cooldown
        # ip id -> (end, pod that gave it back), as the store keeps it
        self.durable_cooling: dict[str, tuple[float, str]] = {}
        self.nc_id = "nc1"
        self.listed = True  # the control plane lists the container (its record exists)
        self.serial = 0
        self.pool.apply_nc(self._nc())

    def _nc(self, programmed: int | None = None) -> NetworkContainer:
        return NetworkContainer(
            self.nc_id,
            ("10.1.0.1",),
            "10.1.0.0/16",
            "10.1.0.254",
            tuple(self.configs.values()),
            self.version,
            self.version if programmed is None else programmed,
        )

    @rule(n=st.integers(0, 30), pod=st.booleans())
    def add(self, n: int, pod: bool) -> None:
        who = owner(n, "p" if pod else "")
        record, _ = self.pool.assign(who)
        if record is not None:
            previous = self.replied.get(who.container_id)
            assert previous is None or previous == record.address
            if previous is None:  # newly handed out: never before its cooldown ended
                assert self.now >= self.cool_ends.get(record.address, 0), record
                # ... and only an address the control plane lists now, under this id
                listed = self.configs.get(record.id)
                assert self.listed and listed is not None and listed.address == record.address
            self.replied[who.container_id] = record.address
            self.durable_cooling.pop(record.id, None)

    @rule(n=st.integers(0, 30), cool=st.booleans())
    def delete(self, n: int, cool: bool) -> None:
        end = self.now + COOLDOWN if cool else 0.0
        record = self.pool.release(owner(n).key, cool_until=end)
        self.replied.pop(f"c{n}", None)
        if record is not None and cool:
            self.cool_ends[record.address] = end
            self.durable_cooling[record.id] = (end, "")

    @rule(seconds=st.sampled_from([1.0, 10.0, 29.0, 31.0, 100.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        for ip_id in self.pool.expire_cooldowns(now=self.now, longest=COOLDOWN):
            assert self.pool.records[ip_id].state is IPState.AVAILABLE

    @rule(waiting=st.integers(0, 10))
    def plan(self, waiting: int) -> None:
        demand = self.pool.assigned_count() + waiting
        self.request = self.pool.plan(self.scaler, self.exhausted, demand, self.request)

    @rule()
    def toggle_exhaustion(self) -> None:
        self.exhausted = not self.exhausted

    @precondition(lambda self: self.request is not None and self.listed)
    @rule(programmed_late=st.booleans(), drop_extra=st.booleans())
    def control_plane_fulfils(self, programmed_late: bool, drop_extra: bool) -> None:
        assert self.request is not None
        for ip_id in self.request.ips_not_in_use:
            self.configs.pop(ip_id, None)
        self.version += 1
        self._grant_requested()
        while len(self.configs) < self.request.requested_ip_count:
            address = str(ipaddress.ip_address("10.1.0.0") + self.next_ip)
            self.next_ip += 1
            ip_id = f"ip-{self.next_ip}"
            self.configs[ip_id] = IPConfig(ip_id, address, self.version)
        if drop_extra and self.configs:
            # A misbehaving control plane drops an IP it was not asked to release.
            self.configs.pop(next(iter(self.configs)))
        change = self.pool.apply_nc(self._nc(self.version - 1 if programmed_late else None))
        for problem in change.inconsistencies:
            assert "kept" in problem or "skipped" in problem

    def _grant_requested(self) -> None:
        """The addresses the node asks for by name, granted under new IP ids."""
        assert self.request is not None
        granted = {c.address for c in self.configs.values()}
        for address in self.request.requested_ips:
            if address not in granted:
                self.serial += 1
                ip_id = f"ip-g{self.serial}"
                self.configs[ip_id] = IPConfig(ip_id, address, self.version)

    def _renamed(self) -> None:
        """Every IP listed again under a new id."""
        self.serial += 1
        self.configs = {
            f"{c.id}-r{self.serial}": IPConfig(f"{c.id}-r{self.serial}", c.address, c.version)
            for c in self.configs.values()
        }

    def _withdraw(self) -> None:
        """What the node does when its container leaves the listing."""
        self.pool.withdraw(self.nc_id)
        assert all(r.state is IPState.ASSIGNED for r in self.pool.records.values())

    @precondition(lambda self: self.listed)
    @rule(rename_ips=st.booleans())
    def container_id_changes(self, rename_ips: bool) -> None:
        """The same addresses under a new container id (their IP ids new too, or not)."""
        self._withdraw()
        self.serial += 1
        self.nc_id = f"nc-{self.serial}"
        if rename_ips:
            self._renamed()
        self._apply()

    def _apply(self) -> None:
        """The container applied as the node applies it: the cooldowns carried over to new IP
        ids are recorded, the releases its spec still asks for (`ipsNotInUse`) are honoured
        again."""
        change = self.pool.apply_nc(self._nc())
        for ip_id, end, pod in change.cooldowns_moved:
            self.durable_cooling[ip_id] = (end, pod)
        if self.request is not None:
            self.pool.honour_release(self.request.ips_not_in_use)

    @precondition(lambda self: self.listed)
    @rule()
    def record_deleted(self) -> None:
        """The node's record (NNC) is deleted: nothing is listed."""
        self._withdraw()
        self.listed = False

    @precondition(lambda self: not self.listed)
    @rule(same_ids=st.booleans(), waiting=st.integers(0, 3))
    def record_recreated(self, same_ids: bool, waiting: int) -> None:
        """The record is created again and granted what the node asks for: the addresses its
        pods hold, under their old ids (the controller re-grants the gone record's entries)
        or new ones; the free addresses of the gone record are not listed again. The node
        asks in the spec it creates the record with (its plan after the deletion)."""
        self.plan(waiting)
        assert self.request is not None
        asked = set(self.request.requested_ips)
        assert asked >= {r.address for r in self.pool.unlisted()}
        self.configs = {i: c for i, c in self.configs.items() if c.address in asked}
        if not same_ids:
            self._renamed()
            self.serial += 1
            self.nc_id = f"nc-{self.serial}"
        self.version += 1
        self._grant_requested()
        self.listed = True
        self._apply()

    @rule()
    def restart(self) -> None:
        """The daemon restarts: assignments from disk, the NC and the spec from the control
        plane (which may hold a release in flight)."""
        restarted = Pool()
        restarted.restore_cooldowns(self.durable_cooling, now=self.now, longest=COOLDOWN)
        for assignment in self.pool.assignments():
            restarted.restore(assignment)
        if self.listed:
            restarted.apply_nc(self._nc())
        if self.request is not None:
            restarted.honour_release(self.request.ips_not_in_use)
        self.pool = restarted

    @invariant()
    def a_release_in_flight_is_never_assignable(self) -> None:
        if self.request is None:
            return
        for ip_id in self.request.ips_not_in_use:
            record = self.pool.records.get(ip_id)
            assert record is None or record.state is not IPState.AVAILABLE

    @invariant()
    def one_owner_per_ip_and_assigned_ips_stay(self) -> None:
        owners = [r.owner.key for r in self.pool.records.values() if r.owner is not None]
        assert len(owners) == len(set(owners))
        addresses = [r.address for r in self.pool.records.values()]
        assert len(addresses) == len(set(addresses))
        for container, address in self.replied.items():
            record = self.pool.lookup(owner(int(container[1:])).key)
            assert record is not None and record.address == address
            assert record.state is IPState.ASSIGNED

    @invariant()
    def states_are_consistent(self) -> None:
        for record in self.pool.records.values():
            assert (record.state is IPState.ASSIGNED) == (record.owner is not None)
        available = {r.id for r in self.pool.records.values() if r.state is IPState.AVAILABLE}
        assert available == set(self.pool._available)
        releasing = {r.id for r in self.pool.records.values() if r.state is IPState.PENDING_RELEASE}
        assert releasing == self.pool._pending_release
        held = {r.owner.key: r.id for r in self.pool.records.values() if r.owner is not None}
        by_container = {
            (OwnerKey(c, ifname), ip_id)
            for c, interfaces in self.pool._by_container.items()
            for ifname, ip_id in interfaces.items()
        }
        assert by_container == set(held.items())
        assert all(self.pool._by_container.values())  # no container is left with no interface

    @invariant()
    def cooling_ips_are_neither_assignable_nor_released(self) -> None:
        cooling = {r.id for r in self.pool.records.values() if r.state is IPState.COOLDOWN}
        assert not cooling & set(self.pool._available)
        for ip_id in cooling:
            end = self.pool.cooldown_end(ip_id)
            assert end is not None and self.now < end <= self.now + COOLDOWN
        assert self.pool.cooling_count() == len(cooling)
        if self.request is not None:
            assert not cooling & set(self.request.ips_not_in_use)

    @invariant()
    def only_what_is_listed_is_free(self) -> None:
        """An IP no pod holds is one the control plane lists now (same id and address), and
        an assigned one no container lists is unlisted: its release drops it."""
        unlisted = {r.id for r in self.pool.unlisted()}
        addresses = {c.address for c in self.configs.values()} if self.listed else set()
        for record in self.pool.records.values():
            listed = self.configs.get(record.id) if self.listed else None
            is_listed = (
                listed is not None
                and listed.address == record.address
                and record.nc_id == self.nc_id
            )
            if record.state is not IPState.ASSIGNED:
                assert is_listed, record
            else:  # a held address listed again is re-homed to its listing
                assert is_listed == (record.address in addresses), record
                assert (record.id in unlisted) == (not is_listed), record

    @invariant()
    def pending_release_is_never_assigned(self) -> None:
        for ip_id in self.pool.ips_not_in_use():
            assert self.pool.records[ip_id].owner is None


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPoolMachine = PoolMachine.TestCase
