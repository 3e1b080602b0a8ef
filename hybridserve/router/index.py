"""The router's index of every worker's prefix cache, kept exact by the workers' KV events.

Per worker: the set of findable block hashes and, for hybrid models, the blocks at whose end a recurrent-state
snapshot is findable. Block hashes chain, so one hash stands for its whole prefix and a set is enough to
answer "how many leading blocks of this prompt does worker w hold" the way the worker's own lookup does: walk
the prompt's hashes until the first miss. For a hybrid model a hit is only usable up to the deepest block that
also has a snapshot, so that is where the match ends.

Event batches are numbered per worker. A batch that does not follow the last one applied (one was lost, or the
router just subscribed) makes that worker's part stale: it is rebuilt from the worker's whole current set
(`CachedSet`), and batches that arrive meanwhile are kept and applied on top of it if they are newer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.engine.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedSet,
    KVEventBatch,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.engine.cache.prefix_hash import BlockHash


@dataclass
class WorkerCache:
    recurrent_state: bool
    blocks: set[BlockHash] = field(default_factory=set)
    snapshots: set[BlockHash] = field(default_factory=set)
    seq: int = 0  # the last batch applied
    synced: bool = False  # False until a CachedSet arrived, and again after a gap
    held_back: list[KVEventBatch] = field(default_factory=list)  # batches seen while not synced

    def match(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of `hashes` this worker can serve from its cache."""
        usable = 0
        for i, block_hash in enumerate(hashes):
            if block_hash not in self.blocks:
                break
            if not self.recurrent_state or block_hash in self.snapshots:
                usable = i + 1
        return usable

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, SnapshotStored):
                self.snapshots.update(event.block_hashes)
            elif isinstance(event, SnapshotRemoved):
                self.snapshots.difference_update(event.block_hashes)
        self.seq = batch.seq


class KVIndex:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerCache] = {}

    def add_worker(self, worker: str, recurrent_state: bool) -> None:
        """A worker (re)joined: its part starts empty and stale until its CachedSet arrives."""
        self.workers[worker] = WorkerCache(recurrent_state)

    def drop_worker(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def apply(self, worker: str, batch: KVEventBatch) -> bool:
        """Applies one event batch; False when the worker's part is stale and needs its CachedSet."""
        cache = self.workers.get(worker)
        if cache is None:
            return True
        if not cache.synced:
            cache.held_back.append(batch)
            return False
        if batch.seq <= cache.seq:
            return True  # seen already
        if batch.seq != cache.seq + 1:
            cache.synced = False
            cache.held_back.append(batch)
            return False
        cache.apply(batch)
        return True

    def load(self, worker: str, cached: CachedSet) -> bool:
        """Rebuilds the worker's part from its whole set, then applies the batches held back that are newer.
        False when a batch is still missing after it (the worker must be asked again)."""
        cache = self.workers.get(worker)
        if cache is None:
            return True
        cache.blocks, cache.snapshots, cache.seq = set(cached.blocks), set(cached.snapshots), cached.seq
        held, cache.held_back = sorted(cache.held_back, key=lambda b: b.seq), []
        for batch in held:
            if batch.seq <= cache.seq:
                continue
            if batch.seq != cache.seq + 1:
                cache.held_back = [b for b in held if b.seq > cache.seq]
                cache.synced = False
                return False
            cache.apply(batch)
        cache.synced = True
        return True

    def match(self, hashes: list[BlockHash]) -> dict[str, int]:
        """Matched leading blocks per worker (a stale part still answers: it is at most one gap behind)."""
        return {worker: cache.match(hashes) for worker, cache in self.workers.items()}
