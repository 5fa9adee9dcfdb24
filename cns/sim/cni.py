"""The CNI verbs on a node, as the daemon serves them over its real `Pool`: an ADD assigns an IP
or waits (bounded by `addTimeoutSeconds`, then the kubelet retries), a DEL releases it into the
reuse cooldown, and waiting ADDs are served as IPs arrive or leave the cooldown."""

from __future__ import annotations

from functools import partial
from typing import Protocol

from cns.core.types import IPState
from cns.sim.clock import Clock, Touched
from cns.sim.cluster import BACKOFF, RUNNING, WAITING, Node, Pod
from cns.sim.recording import Recorder
from cns.sim.scenario import Timing


class Starts(Protocol):
    """The workload side, told when a pod that got its IP has started."""

    def ready(self, pod: Pod) -> None:
        """The pod is ready."""


class Cni:
    """ADD, DEL and the waiting ADDs of every node. `workload` is connected once it exists,
    since the workload in turn deletes pods through `release`."""

    workload: Starts

    def __init__(self, clock: Clock, touched: Touched, record: Recorder, timing: Timing) -> None:
        self.clock = clock
        self.touched = touched
        self.record = record
        self.timing = timing

    def add(self, pod: Pod) -> None:
        """The CNI ADD: an IP now, or wait (bounded) for the pool to grow."""
        node = pod.node
        assert node is not None
        now = self.clock.now
        pod.attempt += 1
        if node.has_network and node.ipam.assign(pod.owner)[0] is not None:
            self.got_ip(pod)
            return
        pod.state = WAITING
        if not pod.delayed_by_cooldown and node.has_network and node.ipam.cooling_count():
            pod.delayed_by_cooldown = True
            self.record.pods_delayed_by_cooldown += 1
        if pod.wait_started is None:
            pod.wait_started = now
            self.record.waiting_for_ip += 1
            subnet = node.subnet
            if subnet.first_wait_at is None:
                subnet.first_wait_at = now
                subnet.first_wait_utilization = subnet.utilization
        node.waiting.append((pod, pod.attempt))
        self.clock.at(
            now + self.timing.add_timeout_seconds, partial(self._timeout, pod, pod.attempt)
        )

    def release(self, node: Node, pod: Pod) -> None:
        """The CNI DEL, as the daemon's: with `ipCooldownSeconds`, the IP cools down (counted
        in the node's demand by `Pool.plan`) and is handed out again only once it has ended."""
        cooldown = self.timing.ip_cooldown_seconds
        cool_until = self.clock.now + cooldown if cooldown else 0.0
        record = node.ipam.release(pod.owner.key, cool_until=cool_until)
        node.subnet.assigned -= 1
        self.record.unused_changed(node.subnet, 1)
        if cool_until:
            self.clock.at(cool_until, partial(self._end_cooldowns, node))
        if record is not None and record.state is IPState.COOLDOWN:
            self.record.cooling_changed(node.subnet, 1)

    def _end_cooldowns(self, node: Node) -> None:
        """The daemon's `end_cooldowns`: IPs whose cooldown is due become Available, waiting
        ADDs get them, and the node recomputes its request (its demand fell)."""
        if node.removed:
            return
        ended = node.ipam.expire_cooldowns(
            now=self.clock.now, longest=self.timing.ip_cooldown_seconds
        )
        if ended:
            self.record.cooling_changed(node.subnet, -len(ended))
            self.serve_waiters(node)
            self.touched.node(node)

    def serve_waiters(self, node: Node) -> None:
        while node.waiting and node.ipam.available_count():
            pod, attempt = node.waiting.popleft()
            if pod.state != WAITING or pod.attempt != attempt:
                continue
            node.ipam.assign(pod.owner)
            self.got_ip(pod)

    def got_ip(self, pod: Pod) -> None:
        node = pod.node
        assert node is not None
        now = self.clock.now
        pod.state = RUNNING
        node.subnet.assigned += 1
        self.record.unused_changed(node.subnet, -1)
        if pod.wait_started is not None:
            self.record.waits.append(now - pod.wait_started)
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
