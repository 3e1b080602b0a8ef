"""A decode-only step through decoder_stack.c gives bitwise the hidden states of the layer-by-layer path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.plan import NewRequest, ScheduledRequest, SchedulerOutput
from hybridserve.models.layers import native
from hybridserve.sampling_params import SamplingParams
from tests.models.test_llama_family import save_random

TINY = dict(
    vocab_size=256,
    hidden_size=192,  # head_dim 32: the bf16 kernels' dot-product paths
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory) -> Path:
    """Biases on all four matmuls, three query heads per KV head."""
    config = LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)
    return save_random(config, tmp_path_factory.mktemp("stack") / "llama-bias")


def _runner(path: Path, dtype: str, block_size: int) -> ModelRunner:
    runner = ModelRunner(
        EngineConfig.of(dtype=dtype, device="cpu", block_size=block_size, num_kv_blocks=64, kv_cache_prefault=False),
        path,
    )
    if runner.model.decoder_stack is None:
        pytest.skip(f"no native {dtype} decoder stack on this CPU")
    return runner


def _decode_steps(runner: ModelRunner, lengths: list[int], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill one request per length, then decode them all together `steps` times, each step run through the
    stack and through the layers (the second rewrites the same keys and values). Returns both hidden states of
    every decode step."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    blocks = -(-(max(lengths) + steps) // runner.block_size)
    tables = {f"r{i}": list(range(i * blocks, (i + 1) * blocks)) for i in range(len(lengths))}
    first = [ScheduledRequest(rid, 0, p, tables[rid], True, True) for rid, p in zip(tables, prompts, strict=True)]
    new = [NewRequest(rid, p, SamplingParams(), []) for rid, p in zip(tables, prompts, strict=True)]
    stack = runner.model.decoder_stack
    tokens = [p[-1] for p in prompts]
    results = []
    with torch.inference_mode():
        runner.forward(SchedulerOutput(first, new))
        for k in range(steps):
            plan = SchedulerOutput(
                [
                    ScheduledRequest(rid, n + k, [(t * 7 + k) % 256], [], False, True)
                    for rid, n, t in zip(tables, lengths, tokens, strict=True)
                ]
            )
            stacked = runner.forward(plan)
            runner.model.decoder_stack = None
            try:
                layered = runner.forward(plan)
            finally:
                runner.model.decoder_stack = stack
            results.append((stacked, layered))
    return results


@pytest.mark.parametrize("dtype, block_size", [("float32", 4), ("bfloat16", 16)])
def test_stack_equals_the_layers_bit_for_bit(biased_llama: Path, dtype: str, block_size: int) -> None:
    runner = _runner(biased_llama, dtype, block_size)
    # Lengths on both sides of block boundaries, and one request far longer than the others.
    for stacked, layered in _decode_steps(runner, [1, block_size - 1, block_size, 3 * block_size + 2], steps=6):
        assert stacked.shape == (4, TINY["hidden_size"])
        assert torch.equal(stacked, layered)


def test_stack_serves_a_batch_of_one(biased_llama: Path) -> None:
    runner = _runner(biased_llama, "float32", 4)
    for stacked, layered in _decode_steps(runner, [9], steps=3):
        assert torch.equal(stacked, layered)


def test_stack_matches_transformers_greedy(biased_llama: Path) -> None:
    """Greedy decoding through the stack picks transformers' tokens (float32, the same random weights)."""
    runner = _runner(biased_llama, "float32", 4)
    ref = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 11:].tolist()
        ids = list(prompt)
        table = list(range(8))
        hidden = runner.forward(
            SchedulerOutput(
                [ScheduledRequest("g", 0, ids, table, True, True)], [NewRequest("g", ids, SamplingParams(), [])]
            )
        )
        for _ in range(8):
            ids.append(int(runner.model.compute_logits(hidden[-1:]).argmax()))
            step = ScheduledRequest("g", len(ids) - 1, ids[-1:], [], False, True)
            hidden = runner.forward(SchedulerOutput([step]))
    assert ids[11:] == expected


def test_models_the_stack_cannot_run_go_layer_by_layer(tmp_path: Path, caplog) -> None:
    path = save_random(Qwen3Config(**TINY, head_dim=16), tmp_path / "qwen3")
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        runner = ModelRunner(
            EngineConfig.of(dtype="float32", device="cpu", block_size=4, num_kv_blocks=8, kv_cache_prefault=False), path
        )
    assert runner.model.decoder_stack is None
    assert "decode-only steps go layer by layer: the stack has no per-head QK norm (Qwen3)" in caplog.text
    config = EngineConfig.of(
        dtype="float32", device="cpu", block_size=4, num_kv_blocks=8, native_kernels=False, kv_cache_prefault=False
    )
    assert ModelRunner(config, path).model.decoder_stack is None


def test_stack_refuses_caches_of_another_shape(biased_llama: Path) -> None:
    runner = _runner(biased_llama, "float32", 4)
    stack = runner.model.decoder_stack
    assert isinstance(stack, native.DecoderStack)
    cache = runner.kv_caches[0]
    wrong = torch.zeros((2, 3, 8, 4, cache.shape[-1]))
    x = torch.zeros((1, TINY["hidden_size"]))
    cos_sin = (torch.zeros((1, 1, cache.shape[-1])),) * 2
    lens, tables = torch.ones(1, dtype=torch.int64), torch.zeros((1, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"got 6 query heads and cache \(2, 3, 8, 4, 32\)"):
        stack(x, cos_sin, [wrong] * len(runner.kv_caches), lens, tables, lens)
    with pytest.raises(ValueError, match=r"^1 caches for a stack of 3 layers$"):
        stack(x, cos_sin, [cache], lens, tables, lens)
