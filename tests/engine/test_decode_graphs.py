"""Decode steps replayed from CUDA graphs: padded batches and block tables over static buffers.

Capture itself needs a GPU (benchmarks/device_check.py checks it there); here the same graphs' steps run eagerly
on CPU over the same static buffers, padding rows and scratch block, so what padding does is tested everywhere:
the tokens and the cache's real blocks must be those of plain eager steps."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from hybridserve.engine import decode_graphs
from hybridserve.engine.decode_graphs import batch_sizes, table_widths
from hybridserve.engine.llm import LLM
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.sampling_params import SamplingParams

BS = 4
BLOCKS = 200
_IDS = itertools.count()


def test_padded_sizes() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(5) == [1, 2, 4, 5]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]
    assert batch_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert table_widths(1) == [1]
    assert table_widths(16) == [1, 2, 4, 8, 16]
    assert table_widths(20) == [1, 2, 4, 8, 16, 20]


def test_a_step_larger_than_every_graph_runs_eagerly(graphed) -> None:
    graphs = graphed.core.runner.decode_graphs
    assert graphs is not None
    too_many = graphs.run([0] * 17, [0] * 17, [0] * 17, [[0]] * 17, [1] * 17)  # max_num_seqs is 16
    too_long = graphs.run([0], [0], [0], [[0] * (graphs.widths[-1] + 1)], [1])  # past max_model_len
    assert too_many is None and too_long is None and graphs.graphs == {} and graphs.disabled is None


def _llm(smollm2_dir, **kwargs) -> LLM:
    return LLM(
        str(smollm2_dir),
        dtype="float32",
        device="cpu",
        native_kernels=False,
        block_size=BS,
        num_kv_blocks=BLOCKS,
        max_num_seqs=16,
        **kwargs,
        kv_cache_prefault=False,
    )


def _prompts(llm: LLM) -> list[list[int]]:
    """Five prompts (a batch padded to 8, then to 4, 2 and 1 as they finish at different lengths)."""
    texts = ["Hi.", "Name a colour.", "Tell me about trains, please.", "Why is the sky blue? Be brief.", "2+2?"]
    return [llm.chat_prompt([{"role": "user", "content": t}]) for t in texts]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt, batched; request i stops after 20 - 3i tokens, so the batch shrinks."""
    core = llm.core
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=20 - 3 * i, ignore_eos=True)
        rid = f"r{next(_IDS)}"
        tokens[rid] = []
        core.add_request(EngineCoreRequest(rid, prompt, params, [], 0.0))
    while core.has_work():
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    core.check_integrity()
    return list(tokens.values())


@pytest.fixture(scope="module")
def eager(smollm2_dir) -> tuple[LLM, list[list[int]], list[list[int]]]:
    llm = _llm(smollm2_dir, enable_prefix_caching=False)
    assert llm.core.runner.decode_graphs is None, "no graphs on CPU"
    prompts = _prompts(llm)
    return llm, prompts, _generate(llm, prompts)


@pytest.fixture
def graphed(smollm2_dir, monkeypatch) -> LLM:
    monkeypatch.setattr(decode_graphs, "available", lambda device: True)
    return _llm(smollm2_dir, enable_prefix_caching=False)


def test_padded_steps_give_the_eager_tokens_and_cache(graphed, eager) -> None:
    llm, prompts, tokens = eager
    graphs = graphed.core.runner.decode_graphs
    assert graphs is not None
    assert _generate(graphed, prompts) == tokens
    # Every batch size the five requests passed through, padded; contexts of 9-17 blocks of 4 tokens.
    assert {b for b, _ in graphs.graphs} == {8, 4, 2, 1}
    assert {w for _, w in graphs.graphs} <= {16, 32}
    # The padding rows wrote the scratch block past the pool's blocks and nothing else: every real block holds
    # what the eager steps wrote.
    for ours, theirs in zip(graphed.core.runner.kv_caches, llm.core.runner.kv_caches, strict=True):
        assert ours.shape[2] == theirs.shape[2] + 1 == BLOCKS + 1
        assert torch.equal(ours[:, :, :BLOCKS], theirs)
        assert ours[:, :, BLOCKS].abs().sum() > 0


def test_prefix_hits_after_padded_steps(smollm2_dir, eager, monkeypatch) -> None:
    _, prompts, tokens = eager
    monkeypatch.setattr(decode_graphs, "available", lambda device: True)
    llm = _llm(smollm2_dir)
    assert _generate(llm, prompts) == tokens
    assert _generate(llm, prompts) == tokens, "blocks cached after graph steps hold the right keys"


def test_a_failed_capture_falls_back_to_eager_steps(graphed, eager, monkeypatch, caplog) -> None:
    _, prompts, tokens = eager

    def fail(step, device, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs, "_record", fail)
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine"):
        assert _generate(graphed, prompts) == tokens
    graphs = graphed.core.runner.decode_graphs
    assert graphs is not None and graphs.graphs == {}
    assert graphs.disabled == (
        "capturing the decode step for batch 8, 16 blocks failed: operation not permitted when stream is capturing"
    )
    assert "decode steps run eagerly from now on" in caplog.text
