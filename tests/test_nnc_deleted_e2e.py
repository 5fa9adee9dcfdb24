"""Issue 25, case 1, end to end: `kubectl delete nnc <node>` while the node's pods hold addresses,
with a real kube-apiserver, the real `cns controller` and two real `cns run` daemons (two node
names, two state directories), every pod's ADD through the real `cns-ipam` plugin and the
daemon's socket. Before: the node went on handing out the deleted container's free addresses,
and the controller freed the deleted NNC's addresses and granted them to the other node, whose
pods then used addresses the first node's pods held (6 of them in the issue's run). Now the
node withdraws what its pods do not hold and re-creates its NNC asking for what they do
(branch nncinput), and the controller keeps a live node's addresses its own and moves them into
the new NNC under the same names (docs/design/controller-safety.md, "A deleted
NodeNetworkConfig").
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO
from tests.harness.daemon import Daemon
from tests.harness.fleet import addresses
from tests.harness.kube_api import KUBE_SYSTEM, NNC_API
from tests.harness.kube_cluster import KubeCluster, kube_cluster_fixture
from tests.harness.kube_scenario import Scenario, object_ref

kube = pytest.fixture(scope="module")(kube_cluster_fixture)
pytestmark = pytest.mark.slow

N1, N2 = "nncgone-e2e-n1", "nncgone-e2e-n2"


@pytest.fixture(scope="module")
def cluster(kube: KubeCluster) -> KubeCluster:
    kube.apply(REPO / "config" / "crd")
    kube.apply(REPO / "config" / "rbac.yaml")
    return kube


@pytest.fixture
def scenario(cluster: KubeCluster, tmp_path: Path) -> Iterator[Scenario]:
    scenario = Scenario(cluster, tmp_path, "nncgone-e2e", "10.63.0.0/26")
    yield scenario
    scenario.cleanup()


def plugin_add(plugin_dir: Path, daemon: Daemon, container: str) -> tuple[int, dict[str, Any]]:
    """A pod's ADD as a runtime makes it: the real `cns-ipam` executable, its network
    configuration on stdin, the CNI variables in its environment (a namespace path of its own:
    cns-ipam does not open it). Returns its exit code and the JSON it printed."""
    config = {
        "cniVersion": "1.0.0",
        "name": "nncgone",
        "type": "cns-cni",
        "ipam": {
            "type": "cns-ipam",
            "socket": str(daemon.socket),
            "releaseQueueDir": str(daemon.state_dir / "release-queue"),
            "timeoutSeconds": 30,
        },
    }
    env = {
        "PATH": os.environ["PATH"],
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": container,
        "CNI_NETNS": f"/var/run/netns/{container}",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": str(plugin_dir),
    }
    done = subprocess.run(
        [str(plugin_dir / "cns-ipam")],
        input=json.dumps(config),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout or "{}")


def pods(plugin_dir: Path, daemon: Daemon, prefix: str, count: int) -> dict[str, str]:
    """`count` pods' ADDs that must succeed: container -> its address."""
    held = {}
    for i in range(count):
        container = f"{prefix}{i}"
        code, result = plugin_add(plugin_dir, daemon, container)
        assert code == 0, result
        held[container] = result["ips"][0]["address"].split("/")[0]
    return held


def names(nnc: dict[str, Any]) -> dict[str, str]:
    """Address -> the name the NNC lists it under (the container id for its primary IP)."""
    found = {}
    for nc in (nnc.get("status") or {}).get("networkContainers") or []:
        found[nc["primaryIP"]] = nc["id"]
        found.update({a["ip"]: a["name"] for a in nc.get("ipAssignments") or []})
    return found


def test_a_deleted_nnc_puts_no_address_on_pods_of_two_nodes(
    cluster: KubeCluster, scenario: Scenario, plugin_dir: Path
) -> None:
    for node in (N1, N2):
        scenario.add_node(node)
    scenario.start_controller()
    d1, d2 = scenario.start_daemon(N1), scenario.start_daemon(N2)
    on_n1 = pods(plugin_dir, d1, "n1-a", 4)
    on_n2 = pods(plugin_dir, d2, "n2-a", 4)
    before = scenario.nnc(N1)
    before_names = names(before)
    assert set(on_n1.values()) <= set(before_names)

    cluster.delete([object_ref(NNC_API, "NodeNetworkConfig", N1, KUBE_SYSTEM)])
    # Both nodes' pods come and go on: n2 asks for more (the addresses a controller that let
    # n1's go would grant it first: the lowest free), n1 gets its NNC back.
    on_n2.update(pods(plugin_dir, d2, "n2-b", 12))
    back = scenario.wait(
        lambda: (
            cluster.exists(NNC_API, "NodeNetworkConfig", N1, KUBE_SYSTEM)
            and set(on_n1.values()) <= set(addresses(nnc := scenario.nnc(N1)))
            and nnc
        ),
        "n1's held addresses listed in its re-created NNC",
        timeout=90,
    )
    assert back["metadata"]["uid"] != before["metadata"]["uid"]
    # The same container and the same names: a move, not a new grant.
    assert {a: names(back)[a] for a in on_n1.values()} == {
        a: before_names[a] for a in on_n1.values()
    }
    assert (
        back["status"]["networkContainers"][0]["id"]
        == before["status"]["networkContainers"][0]["id"]
    )
    on_n1.update(pods(plugin_dir, d1, "n1-b", 4))
    on_n2.update(pods(plugin_dir, d2, "n2-c", 2))

    both = set(on_n1.values()) & set(on_n2.values())
    assert not both, f"addresses held by pods of both nodes: {sorted(both)}"
    assert len(set(on_n1.values())) == len(on_n1) and len(set(on_n2.values())) == len(on_n2)
    listed = [*addresses(scenario.nnc(N1)), *addresses(scenario.nnc(N2))]
    assert len(listed) == len(set(listed)), "an address is in both NNCs"
    assert set(on_n1.values()) <= set(addresses(scenario.nnc(N1)))
    assert set(on_n2.values()) <= set(addresses(scenario.nnc(N2)))
    assert '"nnc_replaced_addresses_kept"' in scenario.controller_log(0)
