"""KV cache manager: blocks per request, prefix hits, eviction order, stats, integrity."""

from __future__ import annotations

import pytest

from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.cache.prefix_hash import hash_blocks
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.engine.request import Request
from hybridserve.sampling_params import SamplingParams

BS = 4


def make(rid: str, prompt: list[int]) -> Request:
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(), [0], 0.0), 1024)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """What the scheduler does on admission: look up the prefix, allocate, mark the hit computed."""
    cached = kv.find_cached_prefix(req)
    num_cached = len(cached) * kv.block_size
    n = req.num_tokens - num_cached if num_new is None else num_new
    assert kv.allocate(req, n, cached)
    req.num_computed_tokens = num_cached + n
    kv.check_integrity()
    return num_cached


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


P = list(range(100, 112))  # three full blocks


def test_allocation_rounds_up_to_blocks() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    r = make("a", P[:5])
    assert kv.allocate(r, 3)  # a first chunk of 3 tokens
    assert kv.block_ids("a") == [0]
    r.num_computed_tokens = 3
    assert kv.allocate(r, 2)  # 5 tokens → 2 blocks
    assert kv.block_ids("a") == [0, 1]
    r.num_computed_tokens = 5
    for n_out in range(1, 4):  # decodes up to 8 tokens fit in the two blocks
        r.output_token_ids.append(7)
        assert kv.allocate(r, 1)
        r.num_computed_tokens += 1
        assert kv.block_ids("a") == [0, 1], n_out
    r.output_token_ids.append(7)
    assert kv.allocate(r, 1)  # the 9th token opens a third block
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free == 13
    kv.check_integrity()


def test_allocate_returns_false_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make("a", P[:8])
    admit(kv, a)  # 2 blocks
    queries, hits = kv.prefix_queries, kv.prefix_hits
    b = make("b", [1] * 9)  # needs 3 blocks, 1 free
    assert kv.allocate(b, 9) is False
    assert "b" not in kv.req_blocks
    assert kv.pool.num_free == 1
    assert refs(kv) == [1, 1, 0]
    assert (kv.prefix_queries, kv.prefix_hits) == (queries, hits)
    kv.check_integrity()
    # A running request that cannot grow keeps what it has.
    a.output_token_ids.extend([5, 5])
    a.num_computed_tokens = 9
    assert kv.allocate(a, 1)  # 10 tokens: a third block
    a.output_token_ids.extend([5, 5, 5])
    a.num_computed_tokens = 12
    assert kv.allocate(a, 1) is False  # 13 tokens: a fourth block that does not exist
    assert kv.block_ids("a") == [0, 1, 2]
    assert refs(kv) == [1, 1, 1]
    kv.check_integrity()


def test_evictable_prefix_hits_do_not_count_as_free_space() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make("a", P[:9])
    admit(kv, a)  # blocks 0, 1 hashed; block 2 holds the 9th token
    kv.free(a)
    kv.check_integrity()
    b = make("b", [*P[:8], 1, 2, 3, 4, 5])  # hits 2 free blocks, needs 2 more: only 1 left besides the hits
    cached = kv.find_cached_prefix(b)
    assert [c.block_id for c in cached] == [0, 1]
    assert kv.allocate(b, 5, cached) is False
    assert "b" not in kv.req_blocks
    assert refs(kv) == [0, 0, 0]
    assert kv.pool.num_free == 3
    assert [kv.pool.lookup(h) for h in hash_blocks(P[:8], BS)] == cached  # hits not touched or evicted
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    kv.check_integrity()
    c = make("c", [*P[:8], 1])  # hits 2 free blocks, needs 1 more: fits exactly
    assert admit(kv, c) == 8
    assert kv.block_ids("c") == [0, 1, 2]
    assert kv.pool.num_free == 0


def test_prefix_never_covers_the_last_token() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    admit(kv, make("a", P))  # 12 tokens, all three blocks cached
    assert [kv.pool.lookup(h) is not None for h in hash_blocks(P, BS)] == [True, True, True]
    assert len(kv.find_cached_prefix(make("two", P[:8]))) == 1  # exactly 2 blocks → 1 hit
    assert len(kv.find_cached_prefix(make("nine", P[:9]))) == 2
    assert len(kv.find_cached_prefix(make("all", P))) == 2
    assert len(kv.find_cached_prefix(make("more", [*P, 1]))) == 3
    assert kv.find_cached_prefix(make("one", P[:4])) == []
    assert kv.find_cached_prefix(make("tiny", P[:1])) == []
    kv.check_integrity()


def test_prefix_lookup_stops_at_the_first_miss() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    admit(kv, make("a", P))
    other = [*P[:4], 0, 0, 0, 0, *P[8:], 1]  # same first and third block tokens; the chain breaks at 2
    assert [b.block_id for b in kv.find_cached_prefix(make("b", other))] == [0]


def test_second_request_shares_the_first_ones_blocks_while_it_runs() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", P[:9])
    assert admit(kv, a) == 0
    assert kv.block_ids("a") == [0, 1, 2]
    b = make("b", P[:9])
    assert admit(kv, b) == 8
    assert kv.block_ids("b") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]
    assert kv.pool.num_free == 4
    kv.free(a)
    assert refs(kv)[:4] == [1, 1, 0, 1]
    kv.check_integrity()
    kv.free(b)
    assert refs(kv) == [0] * 8
    kv.check_integrity()


def test_freed_blocks_stay_findable_after_the_request_finished() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", P)
    admit(kv, a)
    kv.free(a)
    assert kv.pool.num_free == 8
    assert "a" not in kv.req_blocks
    b = make("b", [*P, 9])
    assert admit(kv, b) == 12
    assert kv.block_ids("b") == [0, 1, 2, 3]
    assert refs(kv)[:4] == [1, 1, 1, 1]
    kv.check_integrity()


def test_router_hashes_find_the_worker_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", P[:10])
    admit(kv, a)
    found = [kv.pool.lookup(h) for h in hash_blocks(P[:10], BS)]
    assert [b.block_id for b in found] == kv.block_ids("a")[:2]


def test_output_tokens_fill_cached_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", P[:7])
    admit(kv, a)
    assert kv.pool.lookup(hash_blocks(P[:8], BS)[1]) is None
    a.output_token_ids.append(P[7])  # the sampled token completes the second block
    assert kv.allocate(a, 1)
    a.num_computed_tokens += 1
    assert kv.pool.lookup(hash_blocks(P[:8], BS)[1]).block_id == 1
    kv.check_integrity()


def test_freed_cached_blocks_are_evicted_when_new_blocks_are_needed() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make("a", P)
    admit(kv, a)  # blocks 0, 1, 2, all cached
    kv.free(a)
    h = hash_blocks(P, BS)
    b = make("b", list(range(500, 516)))  # 4 new blocks: every free block (handed out in ascending id order)
    admit(kv, b)
    assert kv.block_ids("b") == [0, 1, 2, 3]
    assert [kv.pool.lookup(x) for x in h] == [None, None, None]
    assert kv.pool.num_free == 0
    kv.check_integrity()


def test_free_releases_the_tail_first() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make("a", P)
    admit(kv, a)
    kv.free(a)
    h = hash_blocks(P, BS)
    admit(kv, make("b", [1]))  # one new block: a's tail goes first
    assert kv.block_ids("b") == [2]
    assert [kv.pool.lookup(x) is not None for x in h] == [True, True, False]
    admit(kv, make("c", [2]))
    assert kv.block_ids("c") == [1]
    assert [kv.pool.lookup(x) is not None for x in h] == [True, False, False]
    assert len(kv.find_cached_prefix(make("d", P))) == 1  # the shared prefix outlived the tail
    kv.check_integrity()


def test_a_freed_run_is_reused_in_ascending_order() -> None:
    """A request's blocks go back tail first, yet the next request that takes them gets them in ascending order,
    so its keys lie in memory in the order attention reads them."""
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    admit(kv, make("x", [7]))  # block 0, held throughout
    a = make("a", P + [1])  # blocks 1 .. 4
    admit(kv, a)
    assert kv.block_ids("a") == [1, 2, 3, 4]
    kv.free(a)  # free queue: 5 (never used), then 4, 3, 2, 1
    admit(kv, make("b", list(range(600, 616))))
    assert kv.block_ids("b") == [2, 3, 4, 5]  # the queue's first four, ascending; block 1 (a's first) is still cached
    assert kv.pool.lookup(hash_blocks(P, BS)[0]) is not None
    kv.check_integrity()


def test_prefix_stats_count_once_per_admission() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make("a", P[:9])
    admit(kv, a)
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    a.output_token_ids.append(3)
    assert kv.allocate(a, 1)  # a decode is no admission
    a.num_computed_tokens += 1
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    b = make("b", [*P[:8], 1, 2, 3, 4, 5, 6])  # 14 tokens: hits 2 blocks, needs 2 new with 1 free
    for _ in range(3):  # failed attempts count nothing
        cached = kv.find_cached_prefix(b)
        assert len(cached) == 2
        assert kv.allocate(b, 6, cached) is False
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    kv.free(a)
    assert admit(kv, b) == 8
    assert (kv.prefix_queries, kv.prefix_hits) == (9 + 14, 8)
    b.output_token_ids.append(1)
    assert kv.allocate(b, 1)
    assert (kv.prefix_queries, kv.prefix_hits) == (23, 8)
    kv.check_integrity()


def test_no_prefix_caching() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = make("a", P)
    admit(kv, a)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.find_cached_prefix(make("b", [*P, 1])) == []
    assert (kv.prefix_queries, kv.prefix_hits) == (12, 0)
    kv.free(a)
    assert kv.pool.num_free == 8
    kv.check_integrity()


def test_usage() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    assert kv.usage == 0.0
    a = make("a", P[:9])
    admit(kv, a)
    assert kv.usage == pytest.approx(3 / 8)
    b = make("b", P[:9])
    admit(kv, b)  # shares two blocks: one more used
    assert kv.usage == pytest.approx(4 / 8)
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0  # free cached blocks count as free
    kv.check_integrity()


def test_free_of_a_request_without_blocks_is_a_no_op() -> None:
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    r = make("a", P)
    kv.find_cached_prefix(r)
    kv.free(r)
    assert kv.pool.num_free == 2
    kv.check_integrity()


def test_integrity_catches_references_no_request_holds() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    admit(kv, make("a", P[:5]))
    kv.pool.touch(kv.req_blocks["a"][:1])  # a reference nobody will give back
    with pytest.raises(AssertionError, match="requests hold 2 block references but ref counts sum to 3"):
        kv.check_integrity()


def test_a_partial_first_chunk_caches_no_block_it_has_not_filled() -> None:
    """Regression: the prefix lookup memoises hashes of the whole prompt; allocating a first chunk
    shorter than a block must not make the prompt's first block findable before it is computed."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    first = make("a", P)
    admit(kv, first, num_new=2)
    second = make("b", P)
    assert kv.find_cached_prefix(second) == []
    admit(kv, first.__class__(EngineCoreRequest("c", P[:3], SamplingParams(), [0], 0.0), 1024))
    assert kv.find_cached_prefix(second) == []
