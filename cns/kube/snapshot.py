"""Reading `<stateDir>/kube-snapshot.json`: the last NodeNetworkConfig and subnet objects the
daemon saw, so that a restart during an API server outage can serve from them.

The file is input like any other: a restore from backup, a disk error or a hand edit can leave
anything there. `read_snapshot` is the one reader: it turns the file into a `KubeSnapshot` whose
objects every reader of `KubeSource` accepts, or raises SnapshotInvalid naming the problem. The
daemon then ignores the file and serves once the watches sync: the API server is the source of
truth, the snapshot only a stand-in while it is away. (The file's presence still counts as
evidence that this node handed out addresses, whatever it holds: cns/state/statedir.py.)
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from cns.core.types import Scaler
from cns.kube.cluster_subnet import subnet_scalers, subnet_state_exhausted
from cns.kube.nnc import nnc_subnet, pool_request, release_requests, subnet_names, subnet_requests
from cns.kube.nnc_containers import read_containers
from cns.kube.scalers import merge_scalers
from cns.kube.wire import ClusterSubnet, ClusterSubnetState, KubeObject, NodeNetworkConfig, ObjectT
from cns.state.fsutil import file_kind

# An NNC of 30,000 assignments is ~2 MB; a file far beyond what the daemon writes is not read.
MAX_SNAPSHOT_BYTES = 64 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# What a reader raises on an object of the wrong shape.
_SHAPE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, IndexError)


class SnapshotInvalid(Exception):
    """The snapshot file cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class SubnetObjects:
    """The ClusterSubnet and ClusterSubnetState of one subnet, as saved ({}: none)."""

    subnet: ClusterSubnet
    state: ClusterSubnetState


@dataclass(frozen=True, slots=True)
class KubeSnapshot:
    nnc: NodeNetworkConfig
    primary: SubnetObjects  # of the subnet the daemon watched when it wrote the file
    further: dict[str, SubnetObjects]  # subnet name -> its objects


def read_snapshot(
    path: Path, *, node_name: str, namespace: str, fallback_scaler: Scaler
) -> KubeSnapshot | None:
    """The snapshot in `path` (None: there is none), written for NNC `namespace/node_name`;
    SnapshotInvalid if it is not a regular file of at most MAX_SNAPSHOT_BYTES holding JSON of
    the shape `KubeSource._save_snapshot` writes, with objects its readers accept."""
    try:
        data = _read_bounded(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW
            raise SnapshotInvalid("a symlink, not a regular file (not followed)") from None
        raise SnapshotInvalid(f"cannot be read: {exc.strerror or exc}") from None
    try:
        content = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise SnapshotInvalid(f"not JSON: {exc}") from None
    if not isinstance(content, dict):
        raise SnapshotInvalid(f"not a JSON object but {_kind(content)}")
    nnc = cast(NodeNetworkConfig, _object(content.get("nodenetworkconfig"), "nodenetworkconfig"))
    if not nnc:
        raise SnapshotInvalid("nodenetworkconfig: missing")
    meta = nnc["metadata"]
    if (meta.get("name"), meta.get("namespace")) != (node_name, namespace):
        raise SnapshotInvalid(
            f"written for NodeNetworkConfig {meta.get('namespace')}/{meta.get('name')}, "
            f"not {namespace}/{node_name}"
        )

    def scaler(nnc: NodeNetworkConfig) -> Scaler:
        return merge_scalers(fallback_scaler, (nnc.get("status") or {}).get("scaler"))

    _readable(
        nnc,
        "nodenetworkconfig",
        (read_containers, nnc_subnet, pool_request, release_requests,
         subnet_requests, subnet_names, scaler),
    )  # fmt: skip
    further = content.get("subnets")  # absent from files written before further subnets
    if further is None:
        further = {}
    if not isinstance(further, dict):
        raise SnapshotInvalid(f"subnets: not an object but {_kind(further)}")
    objects = {}
    for name, saved in further.items():
        if not isinstance(saved, dict):
            raise SnapshotInvalid(f"subnets.{name}: not an object but {_kind(saved)}")
        objects[name] = _subnet_objects(saved, f"subnets.{name}.", fallback_scaler)
    return KubeSnapshot(nnc, _subnet_objects(content, "", fallback_scaler), objects)


def _read_bounded(path: Path) -> bytes:
    """The file's bytes; never through a symlink, never blocking on a FIFO, never unbounded."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotInvalid(f"{file_kind(info.st_mode)}, not a regular file")
        if info.st_size > MAX_SNAPSHOT_BYTES:
            raise SnapshotInvalid(f"larger than {MAX_SNAPSHOT_BYTES} bytes ({info.st_size})")
        chunks = []
        size = 0
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > MAX_SNAPSHOT_BYTES:
                raise SnapshotInvalid(f"larger than {MAX_SNAPSHOT_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _subnet_objects(saved: dict[str, Any], where: str, fallback: Scaler) -> SubnetObjects:
    """The ClusterSubnet and ClusterSubnetState `saved` (the file's JSON, unchecked) holds."""
    subnet = cast(ClusterSubnet, _object(saved.get("clustersubnet"), f"{where}clustersubnet"))
    state = cast(
        ClusterSubnetState, _object(saved.get("clustersubnetstate"), f"{where}clustersubnetstate")
    )

    def scaler(subnet: ClusterSubnet) -> Scaler:
        return merge_scalers(fallback, *subnet_scalers(subnet))

    _readable(subnet, f"{where}clustersubnet", (scaler,))
    _readable(state, f"{where}clustersubnetstate", (subnet_state_exhausted,))
    return SubnetObjects(subnet, state)


def _object(value: Any, where: str) -> KubeObject:
    """A saved Kubernetes object ({} for none: null or {}), with a name in its metadata."""
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict):
        raise SnapshotInvalid(f"{where}: not an object but {_kind(value)}")
    meta = value.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise SnapshotInvalid(f"{where}: metadata.name is not a string")
    if not isinstance(meta.get("namespace", ""), str):
        raise SnapshotInvalid(f"{where}: metadata.namespace is not a string")
    return cast(KubeObject, value)


def _readable(obj: ObjectT, where: str, readers: tuple[Callable[[ObjectT], object], ...]) -> None:
    """SnapshotInvalid unless every reader the source applies to `obj` accepts it."""
    if not obj:
        return
    for reader in readers:
        try:
            reader(obj)
        except _SHAPE_ERRORS as exc:
            raise SnapshotInvalid(
                f"{where}: cannot be read ({type(exc).__name__}: {exc})"
            ) from None


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return kinds.get(type(value), "null" if value is None else "a number")
