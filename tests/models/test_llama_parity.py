"""Logits parity with Hugging Face transformers on the same weights, through every attention path."""

from __future__ import annotations

import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.engine.llm import LLM
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.parity import chunked_logits
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "Les étoiles brillent — 星がきれい 🌟",
]
BLOCK = 4


@pytest.fixture(scope="module", params=[True, False], ids=["native-kernels", "pytorch-ops"])
def runner(smollm2_dir, request) -> ModelRunner:
    """Both ways the engine computes a layer on CPU; the PyTorch-ops one is also what CUDA runs."""
    config = EngineConfig.of(
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=256,
        native_kernels=request.param,
        kv_cache_prefault=False,
    )
    runner = ModelRunner(config, smollm2_dir)
    assert (runner.backend.attention is not None) == request.param
    # native: the default model's projections and head sum their weights from its GGUF blocks
    assert _block_matmuls(runner) == ({"Q4_1": 30 * 4, "Q8_0": 1} if request.param else {})
    return runner


def _block_matmuls(runner: ModelRunner) -> dict[str, int]:
    kinds = [m.blocks for m in runner.model.modules() if isinstance(m, NativeLinear) and m.blocks is not None]
    return {kind: kinds.count(kind) for kind in sorted(set(kinds))}


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(
        str(smollm2_dir), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=512, kv_cache_prefault=False
    )


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers_at_every_position(runner, hf_model, llm, prompt):
    ids = _chat_ids(llm.tokenizer, prompt)
    n = len(ids)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0]
    cuts = [n // 3, n - 3, n - 2, n - 1, n]  # fresh prefill, prefill on context, then three decodes
    ours = chunked_logits(runner, ids, cuts)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_gguf_blocks_give_the_float32_weights_logits_bitwise(runner, smollm2_dir, llm):
    """Summing the matmuls from their GGUF blocks changes where the weights come from, not one bit of the logits
    (the head's full logits included): prefill and decode against the same engine reading float32 copies."""
    if runner.backend.attention is None:
        pytest.skip("GGUF blocks are read by the native kernels only")
    config = EngineConfig.of(
        dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256, gguf_blocks=False, kv_cache_prefault=False
    )
    floats = ModelRunner(config, smollm2_dir)
    assert _block_matmuls(floats) == {}
    ids = _chat_ids(llm.tokenizer, PROMPTS[2])
    cuts = [len(ids) // 2, len(ids) - 2, len(ids) - 1, len(ids)]
    assert torch.equal(chunked_logits(runner, ids, cuts), chunked_logits(floats, ids, cuts))


def test_greedy_tokens_match_transformers_for_64_steps(hf_model, llm):
    """Every token the engine picks is transformers' argmax given the same prefix. (transformers' own
    cached `generate` is not the yardstick: on two of these prompts it drifts from its full forward.)"""
    prompts = [_chat_ids(llm.tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ours = llm.generate(prompts, params)
    for ids, out in zip(prompts, ours, strict=True):
        generated = out.outputs[0].token_ids
        assert len(generated) == 64
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
        assert generated == logits.argmax(-1).tolist()


def test_capital_of_france_is_paris(llm):
    out = llm.generate(
        [_chat_ids(llm.tokenizer, "What is the capital of France?")],
        SamplingParams(temperature=0.0, max_tokens=20),
    )
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
