"""`kill -9` during a stream of ADDs and DELs: nothing lost, nothing assigned twice."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest

from tests.harness.ledger import ADD, Ledger, client, resolve_in_flight, violations


@pytest.mark.slow
def test_kill_9_during_adds_and_dels(make_daemon: Any) -> None:
    daemon = make_daemon(
        {
            "addTimeoutSeconds": 5,
            # Cooldowns are written with the releases they follow, so kill -9 meets them too;
            # short, so that thousands of DELs a second do not fill maxIPCount with them.
            "ipCooldownSeconds": 0.2,
            "scaler": {"maxIPCount": 2000},
            "standalone": {"allocationLatencyMs": 5, "subnet": "10.77.0.0/20"},
        }
    )
    ledger = Ledger()
    for cycle in range(3):
        stop = threading.Event()
        workers = [
            threading.Thread(
                target=client,
                args=(daemon.call, f"w{w}-k{cycle}", ledger, stop),
                kwargs={"seed": w * 1000 + cycle},
            )
            for w in range(8)
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
        ips = daemon.ips()
        assert violations(ips, ledger) == {
            "duplicate address": [],
            "duplicate owner": [],
            "lost": [],
            "resurrected": [],
        }
        outcome = resolve_in_flight(daemon.call, ips, ledger)
        assert outcome["add retried to another address"] == 0, outcome

    survivors = [c for c in ledger.added if c not in ledger.del_attempted]
    assert len(survivors) > 20 and len(ledger.deleted) > 20  # the stream really ran
    for container in survivors[:50]:
        status, body = daemon.call("POST", ADD, {"containerID": container, "ifName": "eth0"})
        assert status == 200
        assert body["ips"][0]["address"].split("/")[0] == ledger.added[container]
