"""The CNI verbs on a node, as the daemon serves them over its lanes' real `Pool`s: an ADD takes
an IP of the lane the overflow rule picks (the primary's, unless the primary subnet sends its pods
on and the node has none of its IPs free: cns/core/overflow.py) or waits there (bounded by
`addTimeoutSeconds`, then the kubelet retries and the rule picks again), a DEL releases the IP
into its lane's reuse cooldown, and waiting ADDs are served as IPs arrive or leave the cooldown,
or go on to the overflow subnet once the gate opens."""

from __future__ import annotations

from functools import partial
from typing import Protocol

from cns.core.types import IPState
from cns.sim.clock import Clock, Touched
from cns.sim.cluster import BACKOFF, RUNNING, WAITING, Lane, Node, Pod, SimulatedSubnet
from cns.sim.recording import Recorder
from cns.sim.scenario import Timing


class Starts(Protocol):
    """The workload side, told when a pod that got its IP has started."""

    def ready(self, pod: Pod) -> None:
        """The pod is ready."""


class OverflowLanes(Protocol):
    """The fleet side, which joins a node to an overflow subnet's control plane."""

    def overflow_lane(self, node: Node, subnet: SimulatedSubnet) -> Lane:
        """The node's lane of `subnet`, made when first needed."""


class Cni:
    """ADD, DEL and the waiting ADDs of every node. `workload` and `lanes` (the fleet) are
    connected once they exist, since both are built over this object: the workload deletes pods
    through `release`, the fleet serves waiting ADDs through `serve_waiters`."""

    workload: Starts
    lanes: OverflowLanes

    def __init__(self, clock: Clock, touched: Touched, record: Recorder, timing: Timing) -> None:
        self.clock = clock
        self.touched = touched
        self.record = record
        self.timing = timing

    def _lane_for(self, node: Node) -> Lane:
        target = node.add_target()
        return node.primary if target is None else self.lanes.overflow_lane(node, target)

    def add(self, pod: Pod) -> None:
        """The CNI ADD: an IP now, or wait (bounded) for the lane's pool to grow."""
        node = pod.node
        assert node is not None
        now = self.clock.now
        pod.attempt += 1
        lane = pod.lane = self._lane_for(node)
        if lane.has_network and lane.ipam.assign(pod.owner)[0] is not None:
            self.got_ip(pod)
            return
        pod.state = WAITING
        if not pod.delayed_by_cooldown and lane.has_network and lane.ipam.cooling_count():
            pod.delayed_by_cooldown = True
            self.record.pods_delayed_by_cooldown += 1
        if pod.wait_started is None:
            pod.wait_started = now
            self.record.waiting_for_ip += 1
            subnet = lane.subnet
            if subnet.first_wait_at is None:
                subnet.first_wait_at = now
                subnet.first_wait_utilization = subnet.utilization
        lane.waiting.append((pod, pod.attempt))
        self.clock.at(
            now + self.timing.add_timeout_seconds, partial(self._timeout, pod, pod.attempt)
        )

    def release(self, node: Node, pod: Pod) -> None:
        """The CNI DEL, as the daemon's: with `ipCooldownSeconds`, the IP cools down (counted
        in its lane's demand by `Pool.plan`) and is handed out again only once it has ended."""
        lane = pod.lane
        assert lane is not None and lane.node is node
        cooldown = self.timing.ip_cooldown_seconds
        cool_until = self.clock.now + cooldown if cooldown else 0.0
        record = lane.ipam.release(pod.owner.key, cool_until=cool_until)
        lane.subnet.assigned -= 1
        self.record.unused_changed(lane.subnet, 1)
        if lane is not node.primary:
            self.record.pods_on_overflow -= 1
        if cool_until:
            self.clock.at(cool_until, partial(self._end_cooldowns, lane))
        if record is not None and record.state is IPState.COOLDOWN:
            self.record.cooling_changed(lane.subnet, 1)

    def _end_cooldowns(self, lane: Lane) -> None:
        """The daemon's `end_cooldowns`: IPs whose cooldown is due become Available, waiting
        ADDs get them, and the node recomputes its request (its demand fell)."""
        if lane.node.removed:
            return
        ended = lane.ipam.expire_cooldowns(
            now=self.clock.now, longest=self.timing.ip_cooldown_seconds
        )
        if ended:
            self.record.cooling_changed(lane.subnet, -len(ended))
            self.serve_waiters(lane)
            self.touched.node(lane.node)

    def serve_waiters(self, lane: Lane) -> None:
        while lane.waiting and lane.ipam.available_count():
            pod, attempt = lane.waiting.popleft()
            if pod.state != WAITING or pod.attempt != attempt:
                continue
            lane.ipam.assign(pod.owner)
            self.got_ip(pod)

    def send_waiters_on(self, node: Node) -> None:
        """ADDs that queued for the primary before its subnet sent pods on (the gate opened, or
        an overflow subnet got room, after them) wait for the overflow subnet that takes them
        now, as the daemon's `_send_waiters_on` does; the primary's own free IPs first."""
        primary = node.primary
        self.serve_waiters(primary)
        target = node.add_target()
        if target is None or not primary.waiting:
            return
        lane = self.lanes.overflow_lane(node, target)
        while primary.waiting:
            pod, attempt = primary.waiting.popleft()
            if pod.state == WAITING and pod.attempt == attempt:
                pod.lane = lane
                lane.waiting.append((pod, attempt))
        self.serve_waiters(lane)

    def got_ip(self, pod: Pod) -> None:
        node, lane = pod.node, pod.lane
        assert node is not None and lane is not None
        now = self.clock.now
        pod.state = RUNNING
        subnet = lane.subnet
        subnet.assigned += 1
        subnet.pods_assigned += 1
        self.record.unused_changed(subnet, -1)
        if lane is not node.primary:
            subnet.overflowed_in += 1
            node.subnet.overflowed_out += 1
            self.record.pods_on_overflow += 1
        if pod.wait_started is not None:
            self.record.waited(subnet, now - pod.wait_started)
            pod.wait_started = None
            self.record.waiting_for_ip -= 1
        self.clock.at(now + self.timing.pod_start_seconds, partial(self.workload.ready, pod))

    def _timeout(self, pod: Pod, attempt: int) -> None:
        if pod.state != WAITING or pod.attempt != attempt:
            return
        pod.state = BACKOFF
        pod.failed_adds += 1
        self.record.failed_adds += 1
        if pod.failed_adds == 1:
            self.record.failed_pods += 1
        self.clock.at(
            self.clock.now + self.timing.add_retry_seconds, partial(self._retry, pod, attempt)
        )

    def _retry(self, pod: Pod, attempt: int) -> None:
        if pod.state == BACKOFF and pod.attempt == attempt:
            self.add(pod)
