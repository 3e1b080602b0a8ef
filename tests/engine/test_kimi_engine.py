"""Kimi Linear (hybrid KDA + MLA) in the engine: greedy output matches transformers, and a request's
greedy output does not depend on batching, chunking, preemption or state budgets."""

from __future__ import annotations

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(llm: LLM) -> list[list[int]]:
    """12 chat prompts of mixed lengths (7 to ~150 tokens), sharing the chat template's prefix."""
    out = []
    for i in range(12):
        text = f"Request {i}: tell me something." + " More words, please." * (i * 2 % 7)
        out.append(llm.chat_prompt([{"role": "user", "content": text}]))
    return out


def _llm(hf_dir, **kwargs) -> LLM:
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(str(hf_dir), dtype="float32", device="cpu", **kwargs)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    llm.core.check_integrity()
    states = llm.core.runner.state_pool
    assert states is not None and states.num_free == states.num_slots, "finished requests still hold state"
    assert llm.core.kv.usage == 0.0, "finished requests still hold blocks"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(kimi_linear_dir) -> tuple[list[list[int]], list[list[int]]]:
    llm = _llm(kimi_linear_dir)
    prompts = _prompts(llm)
    return prompts, [_run(llm, [p])[0] for p in prompts]


def test_greedy_tokens_match_transformers(kimi_linear_dir, reference):
    """32 greedy steps: every token is transformers' argmax given the same prefix."""
    from transformers import KimiLinearForCausalLM

    hf = KimiLinearForCausalLM.from_pretrained(kimi_linear_dir, dtype=torch.float32).eval()
    prompts = reference[0][:4]
    llm = _llm(kimi_linear_dir)
    outs = _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for ids, generated in zip(prompts, outs, strict=True):
        assert len(generated) == 32
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
        assert generated == logits.argmax(-1).tolist()


def test_batch_of_mixed_lengths(kimi_linear_dir, reference):
    prompts, alone = reference
    assert _run(_llm(kimi_linear_dir), prompts) == alone


def test_tiny_prefill_chunks_mixed_with_decodes(kimi_linear_dir, reference):
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, long_prefill_token_threshold=5, max_num_batched_tokens=24)
    assert _run(llm, prompts) == alone


def test_tiny_state_budget_limits_admission(kimi_linear_dir, reference):
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, num_state_slots=3)
    assert _run(llm, prompts) == alone


def test_preemption_under_tiny_budgets(kimi_linear_dir, reference):
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, block_size=4, num_kv_blocks=60, num_state_slots=6)
    assert _run(llm, prompts) == alone
    assert llm.core.scheduler.num_preemptions > 0


def test_k3_batch_invariance(kimi_k3_dir):
    llm = _llm(kimi_k3_dir, long_prefill_token_threshold=7, max_num_batched_tokens=32, num_state_slots=5)
    prompts = _prompts(llm)[:8]
    alone = [_run(llm, [p])[0] for p in prompts]
    assert _run(llm, prompts) == alone
