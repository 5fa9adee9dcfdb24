"""The IP strategies the simulator compares: which batch, and whether exhaustion applies.

Every strategy runs the same controller (`plan_round` computes both the exhaustion state and the
phase-4 batch every round); they differ only in what the nodes are told to use, which is where
the phases of docs/design/subnet-scarcity.md differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cns.core.types import Scaler, SubnetStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    name: str
    summary: str
    utilization_batch: bool  # nodes scale with the controller's phase-4 batch
    exhaustion_toggle: bool  # nodes drop to batch 1 while the subnet is exhausted

    def node_settings(self, scaler: Scaler, status: SubnetStatus) -> tuple[Scaler, bool]:
        """The scaler and exhaustion flag a node of this subnet is given."""
        batch = scaler.batch_size
        if self.utilization_batch and status.batch > 0:
            batch = status.batch
        return replace(scaler, batch_size=batch), self.exhaustion_toggle and status.exhausted


STRATEGIES = {
    strategy.name: strategy
    for strategy in (
        Strategy(
            name="fixed",
            summary="batch B0 always, exhaustion ignored",
            utilization_batch=False,
            exhaustion_toggle=False,
        ),
        Strategy(
            name="toggle",
            summary="phase 1: batch B0, batch 1 while the subnet is exhausted",
            utilization_batch=False,
            exhaustion_toggle=True,
        ),
        Strategy(
            name="phase4",
            summary="utilization-aware batch from the controller, no toggle",
            utilization_batch=True,
            exhaustion_toggle=False,
        ),
        Strategy(
            name="phase4+toggle",
            summary="both, as `cns controller` and the daemon do in Kubernetes mode",
            utilization_batch=True,
            exhaustion_toggle=True,
        ),
    )
}
DEFAULT_STRATEGIES = ("fixed", "toggle", "phase4")
