"""`kill -9` during a stream of ADDs and DELs: nothing lost, nothing assigned twice."""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Ledger:
    """What the clients were told; only replies count, in-flight calls prove nothing."""

    added: dict[str, str] = field(default_factory=dict)  # container -> address replied
    del_attempted: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


def client(daemon: Any, worker: int, cycle: int, ledger: Ledger, stop: threading.Event) -> None:
    rng = random.Random(worker * 1000 + cycle)
    mine: list[str] = []
    n = 0
    while not stop.is_set():
        try:
            if mine and rng.random() < 0.45:
                container = mine.pop(rng.randrange(len(mine)))
                with ledger.lock:
                    ledger.del_attempted.add(container)
                status, _ = daemon.call(
                    "POST", "/v1/cni/del", {"containerID": container, "ifName": "eth0"}
                )
                if status == 200:
                    with ledger.lock:
                        ledger.deleted.add(container)
            else:
                container = f"w{worker}-k{cycle}-{n}"
                n += 1
                status, body = daemon.call(
                    "POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"}
                )
                if status == 200:
                    with ledger.lock:
                        ledger.added[container] = body["ips"][0]["address"].split("/")[0]
                    mine.append(container)
        except OSError:
            return  # the daemon is gone


def check_consistent(daemon: Any, ledger: Ledger) -> None:
    ips = daemon.ips()
    assigned = {ip["owner"]["containerID"]: ip["address"] for ip in ips if ip["owner"]}
    addresses = [ip["address"] for ip in ips]
    assert len(addresses) == len(set(addresses)), "an address appears twice in the pool"
    owners = [ip["owner"]["containerID"] for ip in ips if ip["owner"]]
    assert len(owners) == len(set(owners)), "an owner holds two IPs"
    for container, address in ledger.added.items():
        if container not in ledger.del_attempted:
            assert assigned.get(container) == address, f"{container} lost {address}"
    for container in ledger.deleted:
        assert container not in assigned, f"{container} still holds an IP after its DEL"


@pytest.mark.slow
def test_kill_9_during_adds_and_dels(make_daemon: Any) -> None:
    daemon = make_daemon(
        {
            "addTimeoutSeconds": 5,
            "scaler": {"maxIPCount": 2000},
            "standalone": {"allocationLatencyMs": 5, "subnet": "10.77.0.0/20"},
        }
    )
    ledger = Ledger()
    for cycle in range(3):
        stop = threading.Event()
        workers = [
            threading.Thread(target=client, args=(daemon, w, cycle, ledger, stop)) for w in range(8)
        ]
        for worker in workers:
            worker.start()
        time.sleep(1.0 + cycle * 0.37)
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        daemon.proc = None
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
        daemon.start()
        check_consistent(daemon, ledger)

    survivors = [c for c in ledger.added if c not in ledger.del_attempted]
    assert len(survivors) > 20 and len(ledger.deleted) > 20  # the stream really ran
    for container in survivors[:50]:
        status, body = daemon.call(
            "POST", "/v1/cni/add", {"containerID": container, "ifName": "eth0"}
        )
        assert status == 200
        assert body["ips"][0]["address"].split("/")[0] == ledger.added[container]
