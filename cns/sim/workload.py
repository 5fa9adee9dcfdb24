"""The workload: deployments whose replicas are divided over node pools (`cns.core.division`,
with remainder inertia), the Deployment and ReplicaSet controllers that create and delete pods,
rollouts with a surge, and crash-looping pods replaced at once."""

from __future__ import annotations

import itertools
import math
import random
from functools import partial

from cns.core.division import divide
from cns.core.types import Owner
from cns.sim.clock import Clock, Touched
from cns.sim.cluster import GONE, RUNNING, DeploymentState, Pod, PodSet, PoolState
from cns.sim.cni import Cni
from cns.sim.fleet import Fleet
from cns.sim.recording import Recorder
from cns.sim.scenario import DeploymentSpec


class Workload:
    """Every deployment (`deployments`, keyed by name) and its pods."""

    def __init__(
        self,
        deployments: dict[str, DeploymentState],
        *,
        clock: Clock,
        touched: Touched,
        record: Recorder,
        fleet: Fleet,
        cni: Cni,
        rng: random.Random,
        ids: itertools.count[int],
    ) -> None:
        self.deployments = deployments
        self.clock = clock
        self.touched = touched
        self.record = record
        self.fleet = fleet
        self.cni = cni
        self.rng = rng
        self.ids = ids

    def start(self) -> None:
        """Set each deployment's start, replica and weight changes, rollouts and crashes."""
        at = self.clock.at
        for deployment in self.deployments.values():
            spec = deployment.spec
            at(spec.start_seconds, partial(self._scale, deployment, None, None))
            for change in spec.changes:
                action = partial(self._scale, deployment, change.replicas, change.weights)
                at(max(change.at_seconds, spec.start_seconds), action)
            for when in spec.rollouts_at_seconds:
                at(max(when, spec.start_seconds), partial(self._rollout, deployment))
            if spec.crash_loops_per_minute > 0:
                at(spec.start_seconds + self._crash_gap(spec), partial(self._crash, deployment))

    # -- pods ------------------------------------------------------------------------------------

    def _create_pod(self, deployment: DeploymentState, pool: PoolState) -> None:
        pod_id = next(self.ids)
        name = f"{deployment.spec.name}-{pod_id}"
        owner = Owner(
            container_id=f"sandbox-{pod_id}", ifname="eth0", pod_name=name, pod_namespace="default"
        )
        pod = Pod(pod_id, deployment, pool, deployment.generation, owner)
        pod.slot = len(deployment.pods)
        deployment.pods.append(pod)
        deployment.by_pool[pool.spec.name].new[pod_id] = pod
        pool.arrivals.append(pod)
        pool.pending += 1
        self.record.unscheduled += 1
        pool.requested = pool.requested + deployment.spec.pod
        self.record.pods_created += 1
        self.touched.pool(pool)

    def delete_pod(self, pod: Pod) -> None:
        state, pod.state = pod.state, GONE
        deployment, pool = pod.deployment, pod.pool
        pods = deployment.by_pool[pool.spec.name]
        if pods.new.pop(pod.id, None) is not None:
            pods.new_ready -= pod.ready
        else:
            del pods.old[pod.id]
            pods.old_ready -= pod.ready
        last = deployment.pods.pop()
        if last is not pod:
            deployment.pods[pod.slot] = last
            last.slot = pod.slot
        pool.requested = pool.requested - deployment.spec.pod
        if pod.wait_started is not None:
            assert pod.lane is not None  # it waits in the lane its ADD chose
            self.record.waited(pod.lane.subnet, self.clock.now - pod.wait_started)
            self.record.waiting_for_ip -= 1
        node = pod.node
        if node is None:
            pool.pending -= 1
            self.record.unscheduled -= 1
            return
        node.subnet.pod_events += 1
        if state == RUNNING:
            self.cni.release(node, pod)
        del node.pods[pod.id]
        request = deployment.spec.pod
        node.cpu_used -= request.cpu_milli
        node.memory_used -= request.memory_bytes
        self.fleet.push(node)
        self.touched.node(node)
        pool.capacity_freed = True
        self.touched.pool(pool)

    def ready(self, pod: Pod) -> None:
        if pod.state != RUNNING:
            return
        pod.ready = True
        pods = pod.deployment.by_pool[pod.pool.spec.name]
        if pod.id in pods.new:
            pods.new_ready += 1
        else:
            pods.old_ready += 1
        if pods.old:
            self.reconcile(pod.deployment, pod.pool.spec.name)

    # -- the controllers -------------------------------------------------------------------------

    def _scale(
        self, deployment: DeploymentState, replicas: int | None, weights: dict[str, int] | None
    ) -> None:
        """Replicas or weights changed (or the deployment starts): divide with inertia."""
        if replicas is not None:
            deployment.replicas = replicas
        if weights is not None:
            deployment.weights = dict(weights)
        previous = deployment.targets
        deployment.targets = divide(
            deployment.replicas, weights=deployment.weights, current=previous, rng=self.rng
        )
        for name in deployment.targets:
            deployment.by_pool.setdefault(name, PodSet())
        for name in list(deployment.by_pool):
            self.reconcile(deployment, name)

    def _rollout(self, deployment: DeploymentState) -> None:
        """A new pod template: every pod is replaced, `maxSurgePercent` at a time."""
        deployment.generation += 1
        for name, pods in deployment.by_pool.items():
            unready = [pod for pod in pods.new.values() if not pod.ready]
            pods.old.update(pods.new)
            pods.old_ready += pods.new_ready
            pods.new, pods.new_ready = {}, 0
            for pod in unready:  # they serve nothing: replaced at once, so `old` is all ready
                self.delete_pod(pod)
            self.reconcile(deployment, name)

    def reconcile(self, deployment: DeploymentState, pool_name: str) -> None:
        """The Deployment and ReplicaSet controllers for one pool (maxUnavailable 0).

        Without a rollout: create or delete (newest first) to the pool's share. During one: new
        pods up to the share plus the surge, and old (ready) ones deleted as new ones become
        ready, so that ready pods never drop below the share.
        """
        target = deployment.targets.get(pool_name, 0)
        pods = deployment.by_pool[pool_name]
        pool = self.fleet.pools[pool_name]
        removable = pods.old_ready + pods.new_ready - target
        for pod in list(itertools.islice(pods.old.values(), max(0, removable))):
            self.delete_pod(pod)
        wanted = target - len(pods.new)
        if pods.old:
            surge = math.ceil(target * deployment.spec.max_surge_percent / 100)
            wanted = min(wanted, target + surge - len(pods.new) - len(pods.old))
        for _ in range(wanted):
            self._create_pod(deployment, pool)
        while len(pods.new) > target:
            self.delete_pod(pods.new[next(reversed(pods.new))])

    def _crash_gap(self, spec: DeploymentSpec) -> float:
        return self.rng.expovariate(spec.crash_loops_per_minute / 60)

    def _crash(self, deployment: DeploymentState) -> None:
        """A crash-looping pod is deleted and its ReplicaSet creates a replacement."""
        gap = self._crash_gap(deployment.spec)
        self.clock.at(self.clock.now + gap, partial(self._crash, deployment))
        if not deployment.pods:
            return
        pod = deployment.pods[self.rng.randrange(len(deployment.pods))]
        if pod.state == RUNNING:
            self.delete_pod(pod)
            self.reconcile(deployment, pod.pool.spec.name)
