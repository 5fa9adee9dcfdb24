"""The end-to-end tests' shared, expensive parts: the cns image (`make image`) and one real
three-node cluster (tests/harness/multinode.py) that every multi-node test of the session uses,
in the flat-network mode with `cns-cni`; its teardown checks the host is as it was found."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.host import short_tempdir
from tests.harness.install_node import build_image
from tests.harness.kube_node import host_state
from tests.harness.multinode import MultiNodeCluster
from tests.harness.requirements import require

NODES = 3


@pytest.fixture(scope="session")
def cns_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(tag, archive) of the image `make image` builds (scripts/build-image.sh)."""
    require([tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None], "")
    archive = tmp_path_factory.mktemp("image") / "cns.tar"
    return build_image(archive), archive


@pytest.fixture(scope="session")
def cluster(cns_image: tuple[str, Path]) -> Iterator[MultiNodeCluster]:
    from tests.e2e.test_node_e2e import require_node

    require_node()
    before = host_state()
    workdir = short_tempdir("cns-mn-")  # the nodes' containerd sockets live below it
    try:
        with MultiNodeCluster.start(
            workdir, nodes=NODES, image=cns_image, flat_network=True
        ) as started:
            print(f"cluster up: {started.timings}")
            yield started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert host_state() == before, "the cluster's teardown left the host changed"
