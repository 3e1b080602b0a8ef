"""Recurrent-state snapshots: copies, LRU eviction, integrity, and the manager's snapshot points."""

from __future__ import annotations

import pytest
import torch

from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.cache.prefix_hash import hash_blocks
from hybridserve.engine.cache.state_pool import StatePool
from hybridserve.engine.cache.state_snapshots import StateSnapshots
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.engine.request import Request
from hybridserve.models.cache_specs import LinearStateSpec
from hybridserve.sampling_params import SamplingParams

BS = 4
P = list(range(100, 114))  # 14 tokens: 3 full blocks, the last token in a 4th
SPECS = (LinearStateSpec(2, 2, 3, 3, torch.float32), LinearStateSpec(2, 2, 3, 3, torch.float32))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _pools(num_slots: int = 2, num_snapshots: int = 2) -> tuple[StatePool, StateSnapshots]:
    states = StatePool(SPECS, num_slots, torch.device("cpu"), _zeros)
    return states, StateSnapshots(states, num_snapshots, torch.device("cpu"), _zeros)


def _fill(states: StatePool, slot: int, value: float) -> None:
    for conv, state in states.layers:
        conv[slot].fill_(value)
        state[slot].fill_(value)


def _values(states: StatePool, slot: int) -> set[float]:
    return {v for layer in states.layers for tensor in layer for v in tensor[slot].flatten().tolist()}


def _make(rid: str, prompt: list[int]) -> Request:
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(), [0], 0.0), 1024)


def test_save_and_restore_copy_every_layer() -> None:
    states, snaps = _pools()
    _fill(states, 0, 3.0)
    assert snaps.save(b"h", 0)
    _fill(states, 0, 5.0)  # the snapshot is a copy, not a view
    snaps.restore(b"h", 1)
    assert _values(states, 1) == {3.0}
    assert snaps.num_restored == 1
    snaps.check_integrity()


def test_least_recently_used_is_evicted() -> None:
    states, snaps = _pools()
    snaps.save(b"a", 0)
    snaps.save(b"b", 0)
    assert not snaps.save(b"a", 1)  # exists: only marked used, so b is now the oldest
    snaps.save(b"c", 0)
    assert b"a" in snaps and b"c" in snaps and b"b" not in snaps
    assert len(snaps) == 2
    with pytest.raises(RuntimeError, match="no state snapshot"):
        snaps.restore(b"b", 0)
    snaps.check_integrity()


def test_replace_reuses_the_superseded_snapshot() -> None:
    states, snaps = _pools(num_snapshots=3)
    snaps.save(b"a", 0)
    snaps.save(b"b", 0)
    snaps.save(b"c", 0, replace=b"b")
    assert b"b" not in snaps and len(snaps) == 2
    snaps.save(b"d", 0, replace=b"gone")  # a replaced snapshot already evicted: a plain save
    assert len(snaps) == 3
    snaps.check_integrity()


def test_integrity_catches_reallocated_tensors() -> None:
    states, snaps = _pools()
    snaps.layers[0] = (snaps.layers[0][0].clone(), snaps.layers[0][1])
    with pytest.raises(AssertionError, match="reallocated"):
        snaps.check_integrity()


def _manager(num_snapshots: int = 4) -> tuple[KVCacheManager, StatePool]:
    states, snaps = _pools(num_slots=2, num_snapshots=num_snapshots)
    return KVCacheManager(16, BS, True, states, snaps), states


def _step(kv: KVCacheManager, req: Request, n: int) -> None:
    """Schedule and run `n` tokens of `req` (already admitted) the way the scheduler and core do."""
    n = kv.chunk_tokens(req, req.num_computed_tokens, n)
    assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.snapshot(req)


def test_first_chunk_ends_at_the_last_boundary_and_a_hit_restores_it() -> None:
    kv, states = _manager()
    a = _make("a", P)
    assert kv.find_cached_prefix(a) == []
    assert kv.chunk_tokens(a, 0, len(P)) == 12  # (14 - 1) // 4 * 4
    assert kv.allocate(a, 12)
    a.num_computed_tokens = 12
    _fill(states, kv.state_slot("a"), 7.0)  # what the model left in the slot
    kv.snapshot(a)
    _step(kv, a, 2)
    kv.free(a)
    b = _make("b", P)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 3
    assert kv.allocate(b, 2, hit)
    assert _values(states, kv.state_slot("b")) == {7.0}
    kv.check_integrity()


def test_moving_snapshot_while_decoding() -> None:
    """Boundaries that are no snapshot point keep one snapshot per request, which moves forward."""
    kv, _ = _manager()
    a = _make("a", P[:5])  # its only point is 4
    kv.find_cached_prefix(a)
    _step(kv, a, 5)  # cut at 4
    assert a.num_computed_tokens == 4
    assert kv.chunk_tokens(a, 0, 5) == 5  # that point is taken: no more cuts
    _step(kv, a, 1)
    for token in range(8):  # decode: boundaries at 8 and 12
        a.output_token_ids.append(token)
        _step(kv, a, 1)
    hashes = hash_blocks(a.all_token_ids, BS)
    assert kv.snapshots is not None
    assert [h in kv.snapshots for h in hashes] == [True, False, True]
    kv.free(a)
    kv.check_integrity()


def test_hit_is_trimmed_to_the_deepest_snapshot_and_the_branch_point_is_snapshotted() -> None:
    kv, _ = _manager()
    a = _make("a", P)
    kv.find_cached_prefix(a)
    _step(kv, a, len(P))  # snapshot at 12 only
    _step(kv, a, len(P))
    kv.free(a)
    b = _make("b", [*P[:10], 1, 2, 3, 4])  # shares 2 full blocks with a, and no snapshot there
    assert kv.find_cached_prefix(b) == []
    assert kv.chunk_tokens(b, 0, 14) == 8  # first to the end of the cached blocks, a branch point
    assert kv.allocate(b, 8)
    b.num_computed_tokens = 8
    kv.snapshot(b)
    assert kv.chunk_tokens(b, 8, 6) == 4  # then to its last boundary
    c = _make("c", [*P[:9], 5, 5, 5, 5])
    assert len(kv.find_cached_prefix(c)) == 2  # resumes at the branch point
    kv.free(b)
    kv.free(c)
    kv.check_integrity()


def test_snapshots_are_keyed_by_the_chained_block_hash() -> None:
    kv, states = _manager()
    a = _make("a", P)
    kv.find_cached_prefix(a)
    _step(kv, a, len(P))
    assert kv.snapshots is not None and hash_blocks(P, BS)[2] in kv.snapshots
    kv.free(a)
    kv.check_integrity()


def test_without_snapshots_a_hybrid_model_gets_no_hits() -> None:
    states = StatePool(SPECS, 2, torch.device("cpu"), _zeros)
    kv = KVCacheManager(16, BS, True, states)
    a = _make("a", P)
    assert kv.allocate(a, len(P), kv.find_cached_prefix(a))
    kv.free(a)
    assert kv.find_cached_prefix(_make("b", P)) == []
    assert kv.chunk_tokens(a, 0, len(P)) == len(P)


def test_snapshots_must_copy_the_managers_state_pool() -> None:
    _, snaps = _pools()
    with pytest.raises(ValueError, match="own state pool"):
        KVCacheManager(16, BS, True, StatePool(SPECS, 2, torch.device("cpu"), _zeros), snaps)
