"""KV events: what a worker's prefix cache gained and lost, so a router's index mirrors it exactly.

The block pool reports a block becoming findable under its hash (stored, with its parent's hash) and a cached
block being handed out again (removed); forgetting the whole prefix cache is one `AllBlocksCleared`. For hybrid
models a prefix hit also needs the recurrent state at its end, so the snapshot books report snapshots
becoming findable and being evicted. The worker drains the log after each step and publishes it as one
numbered batch (engine/worker.py); a consumer that sees a gap in the numbers asks for the whole current set
(`CachedSet`) instead of guessing.
"""

from __future__ import annotations

import msgspec

from hybridserve.engine.cache.prefix_hash import BlockHash


class BlockStored(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Blocks made findable, each chained on the one before it; the first on `parent` (None: the root)."""

    block_hashes: list[BlockHash]
    parent: BlockHash | None


class BlockRemoved(msgspec.Struct, frozen=True, array_like=True, tag=True):
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


class SnapshotStored(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Recurrent-state snapshots findable at the end of these blocks (hybrid models)."""

    block_hashes: list[BlockHash]


class SnapshotRemoved(msgspec.Struct, frozen=True, array_like=True, tag=True):
    block_hashes: list[BlockHash]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | SnapshotStored | SnapshotRemoved


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True):
    """One step's events; `seq` counts the worker's batches from 1, so a consumer can see one go missing."""

    seq: int
    events: list[KVEvent]


class CachedSet(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A worker's whole prefix cache as of its batch `seq`: every findable block and snapshot."""

    seq: int
    blocks: list[BlockHash]
    snapshots: list[BlockHash]


class KVEventLog:
    """Collects events between drains. Consecutive stores along one chain (a request's blocks, cached in
    order) coalesce into one event, and so do consecutive removals and snapshot stores."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockStored([block_hash], parent))

    def removed(self, block_hash: BlockHash) -> None:
        self._append(BlockRemoved, block_hash)

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def snapshot_stored(self, block_hash: BlockHash) -> None:
        self._append(SnapshotStored, block_hash)

    def snapshot_removed(self, block_hash: BlockHash) -> None:
        self._append(SnapshotRemoved, block_hash)

    def _append(self, kind: type[BlockRemoved | SnapshotStored | SnapshotRemoved], block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, kind):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(kind([block_hash]))

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
