"""The router's KV index against the engine's real cache: KV events keep it exact, block for block, under
randomised workloads with evictions, and a lost batch is repaired from the worker's whole set."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.events import BlockStored, KVEventBatch, KVEventLog
from hybridserve.engine.core import EngineCore
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.router.index import KVIndex
from hybridserve.sampling_params import SamplingParams


def _workload(seed: int, vocab: int) -> list[list[int]]:
    """Prompts that share system prompts and grow turn by turn, plus unrelated ones."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    prompts = []
    for _ in range(40):
        base = rng.choice(systems) if rng.random() < 0.8 else []
        prompts.append(base + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))])
    return prompts


def _check(index: KVIndex, core: EngineCore, seq: int) -> None:
    actual = core.kv.cached_set(seq)
    mirror = index.workers["w"]
    assert mirror.blocks == set(actual.blocks)
    assert mirror.snapshots == set(actual.snapshots)


@pytest.mark.parametrize("model", ["smollm2", "kimi_linear"])
def test_events_keep_the_index_equal_to_the_cache(model, smollm2_dir: Path, request) -> None:
    hf_dir = smollm2_dir if model == "smollm2" else request.getfixturevalue("kimi_linear_dir")
    events = KVEventLog()
    # A small pool, so admissions evict cached blocks (and snapshots) all the time.
    config = EngineConfig.of(
        dtype="float32", device="cpu", num_kv_blocks=40, max_num_seqs=4, num_state_snapshots=6, kv_cache_prefault=False
    )
    core = EngineCore(config, hf_dir, events)
    index = KVIndex()
    index.add_worker("w", core.runner.num_state_slots > 0)
    assert index.load("w", core.kv.cached_set(0))
    rng = random.Random(1)
    seq = 0
    removed = 0
    prompts = _workload(7, core.runner.vocab_size)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=rng.randrange(1, 6), temperature=0)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, [], 0.0))
        for _ in range(rng.randrange(1, 4)):
            core.step()
            batch = events.drain()
            removed += sum(len(e.block_hashes) for e in batch if type(e).__name__ == "BlockRemoved")
            if batch:
                seq += 1
                assert index.apply("w", KVEventBatch(seq, batch))
            _check(index, core, seq)
    while core.has_work():
        core.step()
        if batch := events.drain():
            seq += 1
            assert index.apply("w", KVEventBatch(seq, batch))
        _check(index, core, seq)
    core.check_integrity()
    assert removed > 0, "the workload was meant to evict"
    assert index.workers["w"].blocks


def test_a_missing_batch_makes_the_part_stale_until_the_whole_set_arrives() -> None:
    index = KVIndex()
    index.add_worker("w", recurrent_state=False)
    assert index.load("w", _cached(0, []))
    assert index.apply("w", KVEventBatch(1, [BlockStored([b"a"], None)]))
    assert not index.apply("w", KVEventBatch(3, [BlockStored([b"c"], b"b")]))  # batch 2 was lost
    assert not index.apply("w", KVEventBatch(4, [BlockStored([b"d"], b"c")]))  # held back too
    assert index.load("w", _cached(3, [b"a", b"b", b"c"]))  # the whole set as of batch 3, then batch 4 on top
    assert index.workers["w"].blocks == {b"a", b"b", b"c", b"d"}
    assert index.apply("w", KVEventBatch(4, []))  # already applied: ignored
    assert index.apply("w", KVEventBatch(5, []))


def test_a_hybrid_match_ends_at_the_deepest_snapshot() -> None:
    index = KVIndex()
    index.add_worker("plain", recurrent_state=False)
    index.add_worker("hybrid", recurrent_state=True)
    for worker in ("plain", "hybrid"):
        index.load(worker, _cached(0, [b"1", b"2", b"3"], snapshots=[b"2"]))
    assert index.match([b"1", b"2", b"3", b"4"]) == {"plain": 3, "hybrid": 2}
    assert index.match([b"9", b"2"]) == {"plain": 0, "hybrid": 0}  # hashes chain: no hit past a miss


def _cached(seq: int, blocks: list[bytes], snapshots: list[bytes] | None = None):
    from hybridserve.engine.cache.events import CachedSet

    return CachedSet(seq, blocks, snapshots or [])
