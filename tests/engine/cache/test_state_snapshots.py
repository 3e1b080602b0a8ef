"""Recurrent-state snapshots: the books (reserve, commit, LRU eviction), the runner's copies, integrity, and
the manager's snapshot points and the state operations it books for a step plan."""

from __future__ import annotations

import pytest
import torch

from hybridserve.engine.cache.manager import KVCacheManager, StateOps
from hybridserve.engine.cache.prefix_hash import hash_blocks
from hybridserve.engine.cache.state_snapshots import StateSnapshots
from hybridserve.engine.cache.state_tensors import StateTensors
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.engine.request import Request
from hybridserve.models.cache_specs import LinearStateSpec
from hybridserve.sampling_params import SamplingParams

BS = 4
P = list(range(100, 114))  # 14 tokens: 3 full blocks, the last token in a 4th
SPECS = (LinearStateSpec(2, 2, 3, 3, torch.float32), LinearStateSpec(2, 2, 3, 3, torch.float32))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _tensors(num_slots: int = 2, num_snapshots: int = 4) -> StateTensors:
    return StateTensors(SPECS, num_slots, num_snapshots, torch.device("cpu"), _zeros)


def _fill(tensors: StateTensors, slot: int, value: float) -> None:
    for conv, state in tensors.slots:
        conv[slot].fill_(value)
        state[slot].fill_(value)


def _values(tensors: StateTensors, slot: int) -> set[float]:
    return {v for layer in tensors.slots for tensor in layer for v in tensor[slot].flatten().tolist()}


def _make(rid: str, prompt: list[int]) -> Request:
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(), [0], 0.0), 1024)


# the runner's copies


def test_save_and_restore_copy_every_layer() -> None:
    tensors = _tensors()
    _fill(tensors, 0, 3.0)
    tensors.save(0, 2)
    _fill(tensors, 0, 5.0)  # the snapshot is a copy, not a view
    tensors.restore(2, 1)
    assert _values(tensors, 1) == {3.0}
    tensors.zero(0)
    assert _values(tensors, 0) == {0.0}
    tensors.check_integrity()


def test_integrity_catches_reallocated_tensors() -> None:
    tensors = _tensors()
    tensors.snapshots[0] = (tensors.snapshots[0][0].clone(), tensors.snapshots[0][1])
    with pytest.raises(AssertionError, match="reallocated"):
        tensors.check_integrity()


# the books


def test_least_recently_used_is_evicted() -> None:
    snaps = StateSnapshots(2)
    assert snaps.reserve(b"a") == 0
    assert snaps.reserve(b"b") == 1
    snaps.commit()
    assert snaps.reserve(b"a") is None  # exists: only marked used, so b is now the oldest
    assert snaps.reserve(b"c") == 1
    snaps.commit()
    assert b"a" in snaps and b"c" in snaps and b"b" not in snaps
    assert len(snaps) == 2
    with pytest.raises(RuntimeError, match="no state snapshot"):
        snaps.restore(b"b")
    assert snaps.restore(b"a") == 0 and snaps.num_restored == 1
    snaps.check_integrity()


def test_a_reserved_snapshot_is_findable_only_once_its_step_ran() -> None:
    snaps = StateSnapshots(2)
    snaps.reserve(b"a")
    assert b"a" not in snaps  # a request planned in the same step must not restore an unwritten copy
    with pytest.raises(RuntimeError, match="no state snapshot"):
        snaps.restore(b"a")
    snaps.commit()
    assert b"a" in snaps
    snaps.check_integrity()


def test_a_failed_step_gives_its_reservations_back() -> None:
    snaps = StateSnapshots(2)
    snaps.reserve(b"a")
    snaps.commit()
    snaps.reserve(b"b")
    snaps.abandon()
    assert b"a" in snaps and len(snaps) == 1
    assert snaps.reserve(b"c") is not None and snaps.reserve(b"d") is not None  # both free places usable
    snaps.check_integrity()


def test_replace_reuses_the_superseded_snapshot() -> None:
    snaps = StateSnapshots(3)
    snaps.reserve(b"a")
    snaps.reserve(b"b")
    assert snaps.reserve(b"c", replace=b"b") == 1
    assert b"b" not in snaps and len(snaps) == 2
    snaps.reserve(b"d", replace=b"gone")  # a replaced snapshot already evicted: a plain save
    assert len(snaps) == 3
    snaps.check_integrity()


# the manager: snapshot points, and the operations each step plan carries


def _manager(num_snapshots: int = 4) -> KVCacheManager:
    return KVCacheManager(16, BS, True, num_state_slots=2, num_state_snapshots=num_snapshots)


def _run(kv: KVCacheManager, tensors: StateTensors, model_writes: dict[int, float] | None = None) -> StateOps:
    """Execute the booked operations the way the runner executes a plan; in between, the "model" fills the
    slots of `model_writes` with their values."""
    ops = kv.take_ops()
    for slot in ops.zero:
        tensors.zero(slot)
    for snapshot, slot in ops.restore:
        tensors.restore(snapshot, slot)
    for slot, value in (model_writes or {}).items():
        _fill(tensors, slot, value)
    for slot, snapshot in ops.save:
        tensors.save(slot, snapshot)
    kv.commit_step()
    return ops


def _step(kv: KVCacheManager, tensors: StateTensors, req: Request, n: int) -> StateOps:
    """Plan and run `n` tokens of `req` (already admitted) the way the scheduler and runner do."""
    n = kv.chunk_tokens(req, req.num_computed_tokens, n)
    assert kv.allocate(req, n)
    kv.plan_snapshot(req, req.num_computed_tokens + n)
    req.num_computed_tokens += n
    return _run(kv, tensors)


def test_first_chunk_ends_at_the_last_boundary_and_a_hit_restores_it() -> None:
    kv, tensors = _manager(), _tensors()
    a = _make("a", P)
    assert kv.find_cached_prefix(a) == []
    assert kv.chunk_tokens(a, 0, len(P)) == 12  # (14 - 1) // 4 * 4
    assert kv.allocate(a, 12)
    slot_a = kv.state_slot("a")
    kv.plan_snapshot(a, 12)
    a.num_computed_tokens = 12
    ops = _run(kv, tensors, {slot_a: 7.0})
    assert ops == StateOps(zero=[slot_a], save=[(slot_a, 0)])
    assert _step(kv, tensors, a, 2) == StateOps()
    kv.free(a)
    b = _make("b", P)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 3
    assert kv.allocate(b, 2, hit)
    slot_b = kv.state_slot("b")
    assert _run(kv, tensors) == StateOps(restore=[(0, slot_b)])  # restored, not zeroed
    assert _values(tensors, slot_b) == {7.0}
    kv.check_integrity()


def test_moving_snapshot_while_decoding() -> None:
    """Boundaries that are no snapshot point keep one snapshot per request, which moves forward."""
    kv, tensors = _manager(), _tensors()
    a = _make("a", P[:5])  # its only point is 4
    kv.find_cached_prefix(a)
    _step(kv, tensors, a, 5)  # cut at 4
    assert a.num_computed_tokens == 4
    assert kv.chunk_tokens(a, 0, 5) == 5  # that point is taken: no more cuts
    _step(kv, tensors, a, 1)
    saves = []
    for token in range(8):  # decode: boundaries at 8 and 12
        a.output_token_ids.append(token)
        saves.extend(_step(kv, tensors, a, 1).save)
    slot = kv.state_slot("a")
    assert saves == [(slot, 1), (slot, 1)]  # the moving snapshot reuses its place
    hashes = hash_blocks(a.all_token_ids, BS)
    assert kv.snapshots is not None
    assert [h in kv.snapshots for h in hashes] == [True, False, True]
    kv.free(a)
    kv.check_integrity()


def test_hit_is_trimmed_to_the_deepest_snapshot_and_the_branch_point_is_snapshotted() -> None:
    kv, tensors = _manager(), _tensors()
    a = _make("a", P)
    kv.find_cached_prefix(a)
    _step(kv, tensors, a, len(P))  # snapshot at 12 only
    _step(kv, tensors, a, len(P))
    kv.free(a)
    b = _make("b", [*P[:10], 1, 2, 3, 4])  # shares 2 full blocks with a, and no snapshot there
    assert kv.find_cached_prefix(b) == []
    assert kv.chunk_tokens(b, 0, 14) == 8  # first to the end of the cached blocks, a branch point
    assert _step(kv, tensors, b, 14).save == [(kv.state_slot("b"), 1)]
    assert kv.chunk_tokens(b, 8, 6) == 4  # then to its last boundary
    c = _make("c", [*P[:9], 5, 5, 5, 5])
    assert len(kv.find_cached_prefix(c)) == 2  # resumes at the branch point
    kv.free(b)
    kv.free(c)
    kv.check_integrity()


def test_snapshots_are_keyed_by_the_chained_block_hash() -> None:
    kv, tensors = _manager(), _tensors()
    a = _make("a", P)
    kv.find_cached_prefix(a)
    _step(kv, tensors, a, len(P))
    assert kv.snapshots is not None and hash_blocks(P, BS)[2] in kv.snapshots
    kv.free(a)
    kv.check_integrity()


def test_without_snapshots_a_hybrid_model_gets_no_hits() -> None:
    kv = KVCacheManager(16, BS, True, num_state_slots=2)
    a = _make("a", P)
    assert kv.allocate(a, len(P), kv.find_cached_prefix(a))
    kv.free(a)
    assert kv.find_cached_prefix(_make("b", P)) == []
    assert kv.chunk_tokens(a, 0, len(P)) == len(P)


def test_snapshots_need_a_state_pool() -> None:
    with pytest.raises(ValueError, match="num_state_slots must be positive"):
        KVCacheManager(16, BS, True, num_state_snapshots=2)
