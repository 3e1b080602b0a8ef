"""Fixed pool of KV blocks: reference counts, a hash → block map for prefix reuse, LRU eviction.

A block with ref_cnt 0 sits in the free queue (oldest first). If it still carries a hash it stays
findable until it is handed out again, which evicts it: free cached blocks are reused, not wiped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hybridserve.engine.cache.events import KVEventLog
from hybridserve.engine.cache.prefix_hash import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        """`events`, if given, hears of every block made findable and every cached block evicted."""
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.events = events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        """Hand out `n` blocks from the front of the free queue (evicting their cached contents), in ascending id
        order: a request's blocks are freed tail first, so the front of the queue is often an earlier request's
        run of adjacent blocks in descending order. Handed out ascending, its keys and values lie in memory in
        the order decode attention reads them (on CPU ~20% faster than the same blocks descending or scattered:
        benchmarks/decode_attention.py, `runs`)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=lambda b: b.block_id)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks found by `lookup` (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the order given."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """Make a full block findable by its hash (a block already cached under that hash wins); `parent`: the
        hash of the block before it (None for a first block)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != len(self.blocks):
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def check_integrity(self) -> None:
        """free + used == total, and the free queue and hash map agree with the blocks."""
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if used + len(self._free) != len(self.blocks):
            raise AssertionError(f"block pool: {used} used + {len(self._free)} free != {len(self.blocks)} total")
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id} ref_cnt {block.ref_cnt} disagrees with free queue")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"block {block.block_id} cached under a hash it does not carry")
        carried = sum(1 for b in self.blocks if b.block_hash is not None)
        if carried != len(self._cached):
            raise AssertionError(f"{carried} blocks carry hashes but {len(self._cached)} are in the hash map")
