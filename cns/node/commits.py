"""Which changes of the node are durable yet: a reply waits for the commit of its owner's state.

Every change to the pool queues its durable record in the same synchronous step (one batch per
request, so all of its rows commit or none). Per owner, the newest batch recording a change to
its assignments is kept until it settles: a request that changed nothing itself still answers
only once its owner's state is durable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cns.core.types import OwnerKey
from cns.node.errors import store_error
from cns.state.store import Batch, Forget, Save, Store, StoreError

# Settled batches are dropped from the table once it has doubled since the last sweep (at least
# this many): a request pays for none of them, and the table stays within twice what is unsettled.
SWEEP_AT_LEAST = 256


class Commits:
    """The unsettled batch of each owner, and waiting for them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._unsettled: dict[OwnerKey, Batch] = {}
        self._sweep_at = SWEEP_AT_LEAST

    def record(self, key: OwnerKey, ops: Sequence[Save | Forget]) -> Batch:
        """Queue the durable record of a change to `key`'s assignments made in this same step:
        one batch, so all of them commit or none."""
        batch = self.store.enqueue(ops)
        self._unsettled[key] = batch
        self._sweep()
        return batch

    def record_saves(self, saves: Sequence[Save]) -> Batch:
        """Queue assignments of several owners as one batch, each owner's until it settles."""
        batch = self.store.enqueue(saves)
        for op in saves:
            self._unsettled[op.assignment.owner.key] = batch
        self._sweep()
        return batch

    def _sweep(self) -> None:
        if len(self._unsettled) >= self._sweep_at:
            self._unsettled = {k: b for k, b in self._unsettled.items() if not b.settled}
            self._sweep_at = max(SWEEP_AT_LEAST, 2 * len(self._unsettled))

    def pending(self, key: OwnerKey) -> Batch | None:
        """The owner's last change, if not yet settled; a settled one is what memory shows
        (committed, or failed and undone)."""
        batch = self._unsettled.get(key)
        return batch if batch is not None and not batch.settled else None

    async def durable(self, *batches: Batch | None) -> None:
        """Return once these batches are committed; else raise the caller's IPAMError.

        A failed batch has already been undone in memory (the node follows the disk), so
        nothing the caller did not get acknowledged stays in the pool.
        """
        error: StoreError | None = None
        for batch in batches:
            if batch is not None:
                await batch.wait()
                error = error or batch.error
        if error is not None:
            raise store_error(error) from error

    async def durable_for(self, keys: Iterable[OwnerKey]) -> None:
        """Wait for what was queued for these owners."""
        await self.durable(*(self.pending(key) for key in keys))

    async def durable_all(self) -> None:
        """Wait for everything queued so far."""
        await self.durable(*(b for b in self._unsettled.values() if not b.settled))
