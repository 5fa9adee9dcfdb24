"""The end-to-end tests' expensive shared parts: the cns image (`make image`), and the real
three-node cluster (tests/harness/multinode.py) that every multi-node test runs on.

One cluster at a time exists (they share the bridge and its addresses): `clusters` starts the one
a test asks for, and stops the other first. There are two kinds (`KINDS`): `ptp` + `cns-ipam`
(installed as an operator would) on an IPv4 LAN, then `dual-stack`, the `cns-cni` set-up with
IPv4 and IPv6 (every IPv4 property checked there as an IPv4 cluster would). A test takes `cluster`
(the `cns-cni` one, or the kinds it parametrizes it with indirectly:
`@pytest.mark.parametrize("cluster", KINDS, indirect=True)`) or `cluster_of_each_setup`
(parametrized over `PLUGIN_SETUPS`, each run on its kind, `KIND_OF_SETUP`). The collection puts
every multi-node test at the end of the session, grouped by kind in that order, so that each kind
starts once and nothing else runs beside a cluster. Each stop checks that the host is as it was
found.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.host import short_tempdir
from tests.harness.install_node import build_image
from tests.harness.kube_node import host_state
from tests.harness.multinode import (
    DUAL_STACK,
    KIND_OF_SETUP,
    KINDS,
    PLUGIN_SETUPS,
    MultiNodeCluster,
)
from tests.harness.pressure_scenario import CLUSTER_IP_PRESSURE
from tests.harness.requirements import require

NODES = 3
CLUSTER_FIXTURES = ("cluster", "cluster_of_each_setup")


@pytest.fixture(scope="session")
def cns_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(tag, archive) of the image `make image` builds (scripts/build-image.sh)."""
    from tests.e2e.test_node_e2e import require_node

    require_node()
    require([tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None], "")
    archive = tmp_path_factory.mktemp("image") / "cns.tar"
    return build_image(archive), archive


# A released address waits this long before another pod gets it (30 s by default): short, so
# that the tests moving addresses between nodes (exhaustion, a drained node) do not wait out
# the default; the cooldown itself is tested on one node (tests/integration/test_daemon.py).
CLUSTER_IP_COOLDOWN_SECONDS = 3


def cluster_daemon_settings(*, dual_stack: bool) -> dict[str, object]:
    """The daemons' config file's top-level keys set from the start: the short cooldown, and on
    the dual-stack cluster IP pressure for its test (test_ip_pressure_cluster.py), which then
    needs no restart of the daemons."""
    settings: dict[str, object] = {"ipCooldownSeconds": CLUSTER_IP_COOLDOWN_SECONDS}
    if dual_stack:
        settings["ipPressure"] = CLUSTER_IP_PRESSURE
    return settings


class Clusters:
    """The one multi-node cluster of the moment (of `kind`), in the flat-network mode."""

    def __init__(self, image: tuple[str, Path]) -> None:
        self.image = image
        self.current: MultiNodeCluster | None = None
        self.kind = ""
        self.workdir: Path | None = None
        self.before = host_state()

    def get(self, kind: str) -> MultiNodeCluster:
        """The cluster of `kind` (one of KINDS, or a plugin set-up: its kind's)."""
        kind = KIND_OF_SETUP.get(kind, kind)
        if self.current is not None and self.kind != kind:
            self.stop()
        if self.current is None:
            self.workdir = short_tempdir("cns-mn-")  # the nodes' containerd sockets live below
            dual_stack = kind == DUAL_STACK
            try:
                self.current = MultiNodeCluster.start(
                    self.workdir,
                    nodes=NODES,
                    image=self.image,
                    plugin="cns-cni" if dual_stack else kind,
                    flat_network=True,
                    dual_stack=dual_stack,
                    daemon_settings=cluster_daemon_settings(dual_stack=dual_stack),
                )
            except BaseException:
                self.stop()  # a start that failed stopped its parts; its directory goes too
                raise
            self.kind = kind
            print(f"cluster ({kind}) up: {self.current.timings}")
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None
            self.kind = ""
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        assert host_state() == self.before, "the cluster's teardown left the host changed"


@pytest.fixture(scope="session")
def clusters(cns_image: tuple[str, Path]) -> Iterator[Clusters]:
    held = Clusters(cns_image)
    try:
        yield held
    finally:
        held.stop()


@pytest.fixture
def cluster(request: pytest.FixtureRequest, clusters: Clusters) -> MultiNodeCluster:
    """The `cns-cni` cluster, or the kind a test parametrizes it with (indirect)."""
    return clusters.get(getattr(request, "param", "cns-cni"))


@pytest.fixture(params=PLUGIN_SETUPS)
def cluster_of_each_setup(request: pytest.FixtureRequest, clusters: Clusters) -> MultiNodeCluster:
    return clusters.get(request.param)


def _cluster_order(item: pytest.Item) -> int:
    """0: no multi-node cluster; then 1 + the index of its kind in KINDS. Only the tests below
    this directory take these fixtures: elsewhere `cluster` is another fixture (the integration
    tests' API server), whose tests must not run beside a multi-node cluster."""
    names = getattr(item, "fixturenames", ())
    if not Path(item.path).is_relative_to(Path(__file__).parent):
        return 0
    if not any(name in names for name in CLUSTER_FIXTURES):
        return 0
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    kind = next((params[name] for name in CLUSTER_FIXTURES if name in params), "cns-cni")
    return 1 + KINDS.index(KIND_OF_SETUP.get(kind, kind))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_cluster_order)  # stable: the order within each group stays
