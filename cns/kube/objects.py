"""What every kind of object shares: the API group and the kinds of custom objects, the subnet
label, annotations, conditional writes, and the interned copies the caches keep.

Pure functions, so the daemon's source, the controller and the tests share one reading of the
wire format (field names match Azure CNS's NodeNetworkConfig / ClusterSubnetState). Every
object and patch cns writes is built in cns/kube (this module and one per kind: `nnc`,
`nnc_containers`, `ipblock`, `cluster_subnet`, `pods`, `scalers`); `cns.kube.client` only
sends them.
"""

from __future__ import annotations

from dataclasses import dataclass
from sys import intern
from typing import Any, Generic, cast

from cns.kube.wire import (
    ClusterSubnet,
    ClusterSubnetState,
    IPBlock,
    KubeObject,
    NodeNetworkConfig,
    ObjectMeta,
    ObjectT,
)

GROUP = "acn.azure.com"


@dataclass(frozen=True, slots=True)
class Kind(Generic[ObjectT]):
    """A kind of custom object, typed by the objects it holds (`cns.kube.wire`)."""

    version: str
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{GROUP}/{self.version}"


NNC: Kind[NodeNetworkConfig] = Kind("v1alpha", "nodenetworkconfigs", namespaced=True)
CLUSTER_SUBNET_STATE: Kind[ClusterSubnetState] = Kind(
    "v1alpha1", "clustersubnetstates", namespaced=False
)
CLUSTER_SUBNET: Kind[ClusterSubnet] = Kind("v1alpha1", "clustersubnets", namespaced=False)
IP_BLOCK: Kind[IPBlock] = Kind("v1alpha1", "ipblocks", namespaced=False)
SUBNET_LABEL = f"{GROUP}/subnet"


def annotations_of(obj: KubeObject) -> dict[str, str]:
    """An object's annotations ({} without any, or when they are not a mapping)."""
    annotations = (obj.get("metadata") or {}).get("annotations")
    return annotations if isinstance(annotations, dict) else {}


def conditional(body: ObjectT, *, read: KubeObject) -> ObjectT:
    """`body` (a replacement or a merge patch) made conditional on the resourceVersion `read`
    was read at: the API server refuses it (409) if the object changed since."""
    version = read["metadata"]["resourceVersion"]
    written: KubeObject = body
    meta: ObjectMeta = {**(written.get("metadata") or {}), "resourceVersion": version}
    return cast(ObjectT, {**body, "metadata": meta})


def interned(value: Any) -> Any:
    """A string interned (one copy for every object that holds it); anything else as it is."""
    return intern(value) if type(value) is str else value


def kept(obj: object, fields: tuple[str, ...]) -> dict[str, Any]:
    """The `fields` a dict has, string values interned; {} for anything but a dict."""
    if not isinstance(obj, dict):
        return {}
    return {name: interned(obj[name]) for name in fields if name in obj}


def interned_list(values: Any) -> Any:
    """A list of strings with each interned; anything else as it is."""
    return [interned(v) for v in values] if isinstance(values, list) else values
