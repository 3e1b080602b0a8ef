"""A request's greedy output does not depend on what it is batched with or how it is scheduled."""

from __future__ import annotations

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.models.layers.native import KernelUnavailable, load_linear_kernels, load_paged_attention
from hybridserve.sampling_params import SamplingParams

TOPICS = [
    "the sea",
    "a robot",
    "Paris",
    "mountains",
    "a cat",
    "coffee",
    "winter",
    "the moon",
    "a library",
    "trains",
    "a garden",
    "music",
    "rain",
    "a dragon",
    "bread",
    "stars",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(llm: LLM) -> list[list[int]]:
    """16 chat prompts of mixed lengths (some share the template prefix, as real traffic does)."""
    out = []
    for i, topic in enumerate(TOPICS):
        text = f"Tell me about {topic}." + " Please be detailed and vivid." * (i % 5)
        out.append(llm.chat_prompt([{"role": "user", "content": text}]))
    return out


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS)
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0.0, "finished requests still hold blocks"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(smollm2_dir) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", enable_prefix_caching=False, kv_cache_prefault=False)
    prompts = _prompts(llm)
    return prompts, [_run(llm, [p])[0] for p in prompts]


def test_batch_of_16_mixed_lengths(smollm2_dir, reference):
    prompts, alone = reference
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", enable_prefix_caching=False, kv_cache_prefault=False)
    assert _run(llm, prompts) == alone


def test_tiny_prefill_chunks(smollm2_dir, reference):
    prompts, alone = reference
    llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        device="cpu",
        long_prefill_token_threshold=5,
        max_num_batched_tokens=24,
        kv_cache_prefault=False,
    )
    assert _run(llm, prompts) == alone


def test_preemption_under_tiny_kv_budget(smollm2_dir, reference):
    prompts, alone = reference
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40, kv_cache_prefault=False)
    assert _run(llm, prompts) == alone
    assert llm.core.scheduler.num_preemptions > 0


def test_prefix_cache_hit(smollm2_dir, reference):
    prompts, alone = reference
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", block_size=8, kv_cache_prefault=False)
    first = llm.generate(prompts[:4], PARAMS)
    again = llm.generate(prompts[:4], PARAMS)
    llm.core.check_integrity()
    assert [o.outputs[0].token_ids for o in first] == alone[:4]
    assert [o.outputs[0].token_ids for o in again] == alone[:4]
    # Every full block but the one holding the last prompt token comes from the cache.
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 8 * 8 for p in prompts[:4]]


def test_n_choices_share_the_prompt_and_seeds_reproduce(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", kv_cache_prefault=False)
    prompt = llm.chat_prompt([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7, ignore_eos=True)
    a = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    b = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert a == b
    assert len({tuple(x) for x in a}) == 3, "choices with seeds seed+i should differ"
    llm.core.check_integrity()


def test_pytorch_ops_give_the_same_tokens(smollm2_dir, reference):
    """PyTorch ops only (as on CUDA, or with no C compiler) give the tokens the native kernels gave above."""
    prompts, alone = reference
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", native_kernels=False, kv_cache_prefault=False)
    assert llm.core.runner.backend.attention is None
    assert _run(llm, prompts) == alone


def test_bfloat16_batch_of_16_equals_each_alone(smollm2_dir):
    """bfloat16 on a CPU with native bf16 matmuls (the default dtype there): every kernel of the step sums a
    row on its own, so a batch of 16 gives each request the tokens it gets alone."""
    try:
        if torch.bfloat16 not in load_linear_kernels().dtypes:
            pytest.skip("no native bfloat16 matmul on this CPU (needs AVX512-BF16)")
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    llm = LLM(str(smollm2_dir), dtype="bfloat16", device="cpu", enable_prefix_caching=False, kv_cache_prefault=False)
    prompts = _prompts(llm)
    alone = [_run(llm, [p])[0] for p in prompts]
    assert _run(llm, prompts) == alone


def test_bfloat16_prefill_in_chunks_or_after_a_prefix_hit_gives_the_same_tokens(smollm2_dir):
    """bfloat16 with the native prefill attention: every query walks its keys in the same blocks and order
    whether its prompt is prefilled whole, in 7-token chunks (a last chunk of one token included: it is not a
    decode), or after a prefix hit, so the tokens agree (PyTorch's SDPA takes a different path for a chunk after
    cached context and need not)."""
    try:
        if not load_paged_attention(torch.bfloat16, 64, 16, 3).prefills:
            pytest.skip("native prefill attention needs AVX512-BF16")
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    llm = LLM(str(smollm2_dir), dtype="bfloat16", device="cpu", enable_prefix_caching=False, kv_cache_prefault=False)
    assert llm.core.runner.backend.attention is not None and llm.core.runner.backend.attention.prefills
    prompts = _prompts(llm)
    whole = _run(llm, prompts)
    chunked = LLM(
        str(smollm2_dir),
        dtype="bfloat16",
        device="cpu",
        enable_prefix_caching=False,
        long_prefill_token_threshold=7,
        kv_cache_prefault=False,
    )
    assert _run(chunked, prompts) == whole
    cached = LLM(str(smollm2_dir), dtype="bfloat16", device="cpu", kv_cache_prefault=False)
    _run(cached, prompts[:1])  # the chat template's prefix and the first prompt are cached now
    assert _run(cached, prompts) == whole
    assert cached.core.kv.prefix_hits > 0
