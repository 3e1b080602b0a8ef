"""Block pool: reference counts, LRU free queue, hash → block map, integrity check."""

from __future__ import annotations

import pytest

from hybridserve.engine.cache.block_pool import BlockPool
from hybridserve.engine.cache.prefix_hash import hash_blocks

H = hash_blocks(list(range(40)), 4)  # ten distinct chained hashes


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_fresh_pool() -> None:
    pool = BlockPool(4)
    assert pool.num_blocks == 4 and pool.num_free == 4
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    assert all(pool.lookup(h) is None for h in H)
    pool.check_integrity()


def test_allocate_and_release_count_references() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert ids(a) == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free == 1
    pool.check_integrity()
    pool.touch(a[:2])  # a second user of the first two
    assert [b.ref_cnt for b in a] == [2, 2, 1]
    assert pool.num_free == 1
    pool.check_integrity()
    pool.release(a)
    assert [b.ref_cnt for b in a] == [1, 1, 0]
    assert pool.num_free == 2
    pool.check_integrity()
    pool.release(a[:2])
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    assert pool.num_free == 4
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()
    assert pool.allocate(0) == []
    assert ids(pool.allocate(1)) == [2]
    pool.check_integrity()


def test_freed_first_is_handed_out_first() -> None:
    pool = BlockPool(5)
    a = pool.allocate(5)
    pool.release([a[3], a[1], a[4]])  # free queue: 3, 1, 4
    assert ids(pool.allocate(1)) == [3]
    pool.release([a[0]])  # free queue: 1, 4, 0
    assert ids(pool.allocate(2)) == [1, 4]  # the queue's first two (in ascending id order)
    assert ids(pool.allocate(1)) == [0]
    assert pool.num_free == 0
    pool.check_integrity()


def test_one_call_hands_out_ascending_ids() -> None:
    pool = BlockPool(6)
    a = pool.allocate(6)
    pool.release(list(reversed(a[1:5])))  # free queue: 4, 3, 2, 1 (a request's run, freed tail first)
    assert ids(pool.allocate(3)) == [2, 3, 4]  # the first three freed, in the order attention reads best
    assert ids(pool.allocate(1)) == [1]
    pool.check_integrity()


def test_lru_eviction_of_cached_blocks() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    for block, h in zip(a, H, strict=False):
        pool.cache(block, h, None)
    pool.release([a[2], a[0], a[3], a[1]])  # freed in this order, all still cached
    assert pool.num_free == 4
    assert [pool.lookup(h) for h in H[:4]] == a
    pool.check_integrity()
    assert ids(pool.allocate(1)) == [2]  # freed first → evicted first
    assert pool.lookup(H[2]) is None
    assert pool.lookup(H[0]) is a[0] and pool.lookup(H[3]) is a[3] and pool.lookup(H[1]) is a[1]
    assert ids(pool.allocate(2)) == [0, 3]
    assert pool.lookup(H[0]) is None and pool.lookup(H[3]) is None
    assert pool.lookup(H[1]) is a[1]
    pool.check_integrity()


def test_cached_block_is_findable_until_reallocated() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, H[0], None)
    assert block.block_hash == H[0]
    assert pool.lookup(H[0]) is block
    pool.release([block])
    assert block.ref_cnt == 0
    assert pool.lookup(H[0]) is block  # free but still findable
    pool.check_integrity()
    pool.allocate(1)  # block 1, never cached: block 0 keeps its content
    assert pool.lookup(H[0]) is block
    (again,) = pool.allocate(1)
    assert again is block
    assert block.block_hash is None
    assert pool.lookup(H[0]) is None
    pool.check_integrity()


def test_touch_of_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    a = pool.allocate(3)
    pool.cache(a[0], H[0], None)
    pool.release(a)  # free queue: 0, 1, 2
    hit = pool.lookup(H[0])
    assert hit is a[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free == 2
    pool.check_integrity()
    assert ids(pool.allocate(2)) == [1, 2]  # the touched block is not handed out
    assert pool.lookup(H[0]) is hit
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.release([hit])
    assert pool.num_free == 1
    assert pool.lookup(H[0]) is hit
    pool.check_integrity()


def test_touch_of_a_used_block_only_adds_a_reference() -> None:
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.touch(a)
    pool.touch(a)
    assert a[0].ref_cnt == 3
    assert pool.num_free == 1
    pool.release(a)
    pool.release(a)
    assert pool.num_free == 1
    pool.release(a)
    assert pool.num_free == 2
    pool.check_integrity()


def test_releasing_more_than_taken_raises() -> None:
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.release(a)
    with pytest.raises(RuntimeError, match="block 0 released more often than taken"):
        pool.release(a)


def test_cache_first_block_under_a_hash_wins() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, H[0], None)
    pool.cache(b, H[0], None)  # same content computed twice: the first stays the one found
    assert pool.lookup(H[0]) is a
    assert b.block_hash is None
    pool.cache(a, H[1], None)  # a block keeps the hash it has
    assert a.block_hash == H[0]
    assert pool.lookup(H[1]) is None
    pool.cache(c, H[1], None)
    assert pool.lookup(H[1]) is c
    pool.check_integrity()


def test_reset_prefix_cache_only_when_nothing_is_used() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache(a[0], H[0], None)
    pool.cache(a[1], H[1], None)
    pool.release(a[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(H[0]) is a[0] and pool.lookup(H[1]) is a[1]
    pool.check_integrity()
    pool.release(a[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(H[0]) is None and pool.lookup(H[1]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free == 3
    pool.check_integrity()


def test_integrity_catches_a_ref_count_changed_by_hand() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.check_integrity()
    a[0].ref_cnt = 0  # used block with no references, but not in the free queue
    with pytest.raises(AssertionError, match="free"):
        pool.check_integrity()


def test_integrity_catches_a_free_block_with_references() -> None:
    pool = BlockPool(3)
    pool.blocks[2].ref_cnt = 1  # counted used while still in the free queue
    with pytest.raises(AssertionError, match=r"1 used \+ 3 free != 3 total"):
        pool.check_integrity()


def test_integrity_catches_a_negative_ref_count() -> None:
    pool = BlockPool(2)
    pool.blocks[0].ref_cnt = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_a_hash_map_out_of_step() -> None:
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.cache(a[0], H[0], None)
    pool.check_integrity()
    a[0].block_hash = H[5]  # the map still says H[0]
    with pytest.raises(AssertionError, match="cached under a hash it does not carry"):
        pool.check_integrity()
    a[0].block_hash = H[0]
    a[1].block_hash = H[1]  # carries a hash the map does not know
    with pytest.raises(AssertionError, match="1 are in the hash map"):
        pool.check_integrity()
