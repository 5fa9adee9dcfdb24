"""The scaler's wire form (`WireScaler`) and the merge of the layers that set it."""

from __future__ import annotations

from typing import cast

from cns.core.types import Scaler
from cns.kube.wire import WireScaler

_SCALER_FIELDS = {
    "batchSize": "batch_size",
    "requestThresholdPercent": "request_threshold_percent",
    "releaseThresholdPercent": "release_threshold_percent",
    "maxIPCount": "max_ip_count",
    "minIPCount": "min_ip_count",
}


def scaler_to_wire(scaler: Scaler) -> WireScaler:
    return cast(WireScaler, {wire: getattr(scaler, attr) for wire, attr in _SCALER_FIELDS.items()})


def merge_scalers(fallback: Scaler, *layers: WireScaler | None) -> Scaler:
    """Field by field, the first layer that sets a field wins; `fallback` fills the rest.

    Layers in order of priority: ClusterSubnet `spec.scaler` (operator overrides), ClusterSubnet
    `status.scaler` (what the control plane computed), NNC `status.scaler`.
    """
    values = {attr: getattr(fallback, attr) for attr in _SCALER_FIELDS.values()}
    for wire, attr in _SCALER_FIELDS.items():
        for layer in layers:
            value = layer.get(wire) if layer else None
            if isinstance(value, int) and value > 0:
                values[attr] = int(value)
                break
    merged = Scaler(**values)
    return merged if not merged.problems() else fallback
