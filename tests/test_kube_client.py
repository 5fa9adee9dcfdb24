"""cns's Kubernetes client without an API server: credential errors, and the rules by which a
watch cache takes in what its owner learnt itself. (Its calls against a real kube-apiserver are in
tests/test_kube_crds.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cns.kube.client import CredentialsError, connect
from cns.kube.watch import WatchedCollection


def block(resource_version: str) -> dict[str, Any]:
    return {"metadata": {"name": "pods-b0", "resourceVersion": resource_version}}


async def never_listed(**_: Any) -> Any:
    raise AssertionError("the cache tests never list")


def collection() -> WatchedCollection:
    return WatchedCollection("ipblocks", never_listed, lambda: None)


async def test_a_missing_kubeconfig_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "kubeconfig"
    with pytest.raises(
        CredentialsError, match=f"cannot load Kubernetes credentials from {missing}"
    ):
        await connect(str(missing))


async def test_outside_a_pod_the_service_account_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CredentialsError, match="from the in-cluster service account"):
        await connect("")


def test_our_write_replaces_the_version_it_was_made_from() -> None:
    cache = collection()
    read = block("1")
    cache.put(read)
    cache.put_written(block("2"), read=read)
    assert cache.first()["metadata"]["resourceVersion"] == "2"


def test_our_write_does_not_replace_what_the_watch_delivered_meanwhile() -> None:
    cache = collection()
    read = block("1")
    cache.put(read)
    cache.put(block("3"))  # the watch, while our write of version 2 was on its way
    cache.put_written(block("2"), read=read)
    assert cache.first()["metadata"]["resourceVersion"] == "3"


def test_a_created_object_goes_in_unless_the_watch_has_it_already() -> None:
    cache = collection()
    cache.put_written(block("1"), read=None)
    assert cache.first()["metadata"]["resourceVersion"] == "1"
    cache.put(block("2"))
    cache.put_written(block("1"), read=None)
    assert cache.first()["metadata"]["resourceVersion"] == "2"


def test_the_cache_is_read_only_from_outside() -> None:
    cache = collection()
    cache.put(block("1"))
    with pytest.raises(TypeError):
        cache.objects["/pods-b0"] = block("2")  # type: ignore[index]
    cache.discard(WatchedCollection.key_for("pods-b0"))
    assert cache.first() == {} and dict(cache.objects) == {}
