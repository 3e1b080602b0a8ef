"""The cache facade the scheduler sees: blocks per request, recurrent-state slots, prefix lookups, usage.

For models with linear-attention layers every running request also holds a state slot: admission needs
both a slot and the blocks, and preemption gives both back.
"""

from __future__ import annotations

from hybridserve.engine.cache.block_pool import Block, BlockPool
from hybridserve.engine.cache.prefix_hash import ROOT_HASH, BlockHash, hash_block
from hybridserve.engine.cache.state_pool import StatePool
from hybridserve.engine.request import Request


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, states: StatePool | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.states = states
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks[request_id]]

    def state_slot(self, request_id: str) -> int:
        if self.states is None:
            raise RuntimeError("this model keeps no recurrent state")
        return self.states.slot(request_id)

    def _hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Chained hashes of the request's full blocks among its first `num_tokens` tokens, memoised."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, request.token_ids_range(start, start + bs)))
        return hashes[: num_tokens // bs]

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Blocks already holding a prefix of the request. The last token is always recomputed (its
        logits are needed), so at most (num_tokens - 1) // block_size blocks can hit."""
        if not self.enable_prefix_caching or self.states is not None:
            # A hit must also restore the recurrent state at the hit's end, which needs a state snapshot.
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._hashes(request, limit * self.block_size):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached: list[Block] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after `cached` on first allocation).

        Returns False, changing nothing, when the pool cannot cover it.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        cached = cached or []
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(blocks) - len(cached)
        num_evictable_hits = sum(1 for b in cached if b.ref_cnt == 0)
        if num_needed > self.pool.num_free - num_evictable_hits:
            return False
        states = self.states
        if states is not None and request.request_id not in states.owner:
            if states.num_free == 0:
                return False
            states.allocate(request.request_id)  # zeroed: a fresh or resumed request starts from no state
        self.pool.touch(cached)
        if cached or not blocks:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(cached) * self.block_size
        blocks = blocks + cached + self.pool.allocate(max(num_needed, 0))
        self.req_blocks[request.request_id] = blocks
        if self.enable_prefix_caching:
            # Blocks whose tokens are all known once this step runs become findable now; the model
            # writes every layer's KV before any sequence reads it, so a same-step hit is safe.
            hashes = self._hashes(request, min(num_tokens, request.num_tokens))
            for block, block_hash in zip(blocks, hashes, strict=False):
                self.pool.cache(block, block_hash)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its shared prefix."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.release(list(reversed(blocks)))
        self._req_hashes.pop(request.request_id, None)
        if self.states is not None:
            self.states.free(request.request_id)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held = sum(len(blocks) for blocks in self.req_blocks.values())
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        if held != refs:
            raise AssertionError(f"requests hold {held} block references but ref counts sum to {refs}")
        if self.states is not None:
            self.states.check_integrity()
            if set(self.states.owner) != set(self.req_blocks):
                raise AssertionError(
                    f"state slots held by {sorted(self.states.owner)} != blocks held by {sorted(self.req_blocks)}"
                )
