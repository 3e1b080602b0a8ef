"""The cache facade the scheduler sees: blocks per request, recurrent-state slots, prefix lookups, usage.

For models with linear-attention layers every running request also holds a state slot: admission needs
both a slot and the blocks, and preemption gives both back. Their prefix hits also need the recurrent state
at the hit's end, so a hit is trimmed back to the deepest block with a state snapshot (state_snapshots.py),
and the manager picks the block boundaries worth snapshotting:

- the last block boundary before the last known token (the deepest a later identical prefix can hit);
- the end of the KV blocks a request found in the cache, when no snapshot reaches that far: a branch point
  (a shared system prompt) that the next request with the same prefix will hit;
- while decoding, each boundary the request reaches, one snapshot per request that moves forward with it:
  the next turn of a conversation extends this turn's prompt and output.

The scheduler ends a prefill chunk at the request's next snapshot point (`chunk_tokens`) and books the copy
for after the step (`plan_snapshot`). The manager keeps books only: what the step must do to state slots
(zero a new slot, restore a snapshot into it, save a slot into a snapshot) is collected as `StateOps` for the
step plan, and the model runner, which owns every tensor, performs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.engine.cache.block_pool import Block, BlockPool
from hybridserve.engine.cache.events import CachedSet, KVEventLog
from hybridserve.engine.cache.prefix_hash import ROOT_HASH, BlockHash, hash_block
from hybridserve.engine.cache.state_pool import StatePool
from hybridserve.engine.cache.state_snapshots import StateSnapshots
from hybridserve.engine.request import Request


@dataclass
class StateOps:
    """What the planned step must do to recurrent-state slots, in the step plan's terms."""

    zero: list[int] = field(default_factory=list)  # slots, before the step
    restore: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, slot), before the step
    save: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot), after the step


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        events: KVEventLog | None = None,
    ) -> None:
        """`num_state_slots` > 0 for models with linear-attention layers; `num_state_snapshots` > 0 lets their
        prefix hits resume from snapshots (without, they get none). `events` hears of what the prefix cache
        gains and loses (for a router's index)."""
        if num_state_snapshots and not num_state_slots:
            raise ValueError("state snapshots need a state pool: num_state_slots must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events)
        self.states = StatePool(num_state_slots) if num_state_slots else None
        with_snapshots = num_state_snapshots and enable_prefix_caching
        self.snapshots = StateSnapshots(num_state_snapshots, events) if with_snapshots else None
        self.ops = StateOps()  # of the step being planned; the scheduler takes them into the plan
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._snapshot_points: dict[str, list[int]] = {}  # token counts to snapshot at, ascending
        self._rolling: dict[str, BlockHash] = {}  # each request's latest snapshot taken while decoding
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_blocks[request_id])

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from block `start` on."""
        return [b.block_id for b in self.req_blocks[request_id][start:]]

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
        logits are needed), so at most (num_tokens - 1) // block_size blocks can hit. With recurrent state
        the hit ends at the deepest block that has a state snapshot; the request's snapshot points are
        chosen here too. A request that wants prompt logprobs hits nothing: cached tokens have no logits."""
        if not self.enable_prefix_caching or (self.states is not None and self.snapshots is None):
            return []
        if request.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs
        hits = []
        usable = 0
        for block_hash in self._hashes(request, limit * bs):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
            if self.snapshots is None or block_hash in self.snapshots:
                usable = len(hits)
        if self.snapshots is not None:
            points = {len(hits) * bs, limit * bs}
            self._snapshot_points[request.request_id] = sorted(p for p in points if p > usable * bs)
        return hits[:usable]

    def chunk_tokens(self, request: Request, start: int, num_tokens: int) -> int:
        """A prefill chunk of `num_tokens` from `start`, shortened to end at the request's next snapshot
        point when it would cross one."""
        for point in self._snapshot_points.get(request.request_id, ()):
            if start < point < start + num_tokens:
                return point - start
        return num_tokens

    def plan_snapshot(self, request: Request, computed: int) -> None:
        """For a step that leaves `computed` tokens of the request in the cache: if that is a block boundary,
        book a snapshot of its recurrent state for after the step (at a snapshot point, kept; elsewhere,
        replacing the request's previous such snapshot). Findable once `commit_step` says the step ran."""
        if self.snapshots is None or computed == 0 or computed % self.block_size:
            return
        block_hash = self._hashes(request, computed)[-1]
        points = self._snapshot_points.get(request.request_id, [])
        if computed in points:
            points.remove(computed)
            snapshot = self.snapshots.reserve(block_hash)
        else:
            snapshot = self.snapshots.reserve(block_hash, replace=self._rolling.get(request.request_id))
            if snapshot is not None:
                self._rolling[request.request_id] = block_hash
        if snapshot is not None:
            self.ops.save.append((self.state_slot(request.request_id), snapshot))

    def take_ops(self) -> StateOps:
        """The state operations booked for the step being planned; the books start afresh for the next."""
        ops, self.ops = self.ops, StateOps()
        return ops

    def commit_step(self) -> None:
        """The planned step ran: the snapshots it saved are findable."""
        if self.snapshots is not None:
            self.snapshots.commit()

    def abandon_step(self) -> None:
        """The planned step failed: its KV and states may be half written. The prefix cache is forgotten
        (its blocks were findable before their KV was written) and the snapshots it was to save given back."""
        self.pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.abandon()

    def allocate(
        self, request: Request, num_new_tokens: int, cached: list[Block] | None = None, pulled: bool = False
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after `cached` on first allocation).
        `pulled`: a read from a prefill worker fills the blocks and the state slot, so the slot is not zeroed
        and the blocks become findable only once the read landed (`make_findable`).

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
            # Zeroed, unless a snapshot gives the state at the end of the prefix hit.
            slot = states.allocate(request.request_id)
            if cached:
                self.ops.restore.append((self._snapshot_of(cached[-1]), slot))
            elif not pulled:
                self.ops.zero.append(slot)
        self.pool.touch(cached)
        if not pulled and (cached or not blocks):
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(cached) * self.block_size
        blocks = blocks + cached + self.pool.allocate(max(num_needed, 0))
        self.req_blocks[request.request_id] = blocks
        if not pulled:
            # Blocks whose tokens are all known once this step runs become findable now; the model
            # writes every layer's KV before any sequence reads it, so a same-step hit is safe.
            self.make_findable(request, min(num_tokens, request.num_tokens))
        return True

    def make_findable(self, request: Request, num_tokens: int) -> None:
        """The request's full blocks among its first `num_tokens` tokens hold their KV (or will once this step
        runs): later prompts with the same prefix may hit them."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(request, num_tokens)
        for i, (block, block_hash) in enumerate(zip(self.req_blocks[request.request_id], hashes, strict=False)):
            self.pool.cache(block, block_hash, hashes[i - 1] if i else None)

    def _snapshot_of(self, block: Block) -> int:
        if self.snapshots is None or block.block_hash is None:
            raise RuntimeError(f"a prefix hit ending at block {block.block_id} has no state snapshot")
        return self.snapshots.restore(block.block_hash)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its shared prefix."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.release(list(reversed(blocks)))
        self._req_hashes.pop(request.request_id, None)
        self._snapshot_points.pop(request.request_id, None)
        self._rolling.pop(request.request_id, None)
        if self.states is not None:
            self.states.free(request.request_id)

    def cached_set(self, seq: int) -> CachedSet:
        """Everything findable now (`seq`: the number of the last event batch published before it)."""
        snapshots = self.snapshots.findable() if self.snapshots is not None else []
        return CachedSet(seq, self.pool.cached_hashes(), snapshots)

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
        if self.snapshots is not None:
            self.snapshots.check_integrity()
            if not set(self._rolling) <= set(self.req_blocks):
                raise AssertionError(f"requests {sorted(set(self._rolling) - set(self.req_blocks))} left snapshots")
