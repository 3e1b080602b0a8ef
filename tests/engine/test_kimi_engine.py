"""Kimi Linear (hybrid KDA + MLA) in the engine: greedy output matches transformers, and a request's
greedy output does not depend on batching, chunking, preemption or state budgets."""

from __future__ import annotations

import os

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
    return LLM(str(hf_dir), dtype="float32", device="cpu", **kwargs, kv_cache_prefault=False)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    llm.core.check_integrity()
    states = llm.core.kv.states
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


def _hits(llm: LLM) -> int:
    return llm.core.scheduler.stats().state_snapshot_hits


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole-prompts", "tiny-chunks"])
def test_prefix_hits_restore_state_snapshots(kimi_linear_dir, reference, chunk):
    """A repeated prompt resumes from the snapshot at its last block boundary, batched with the others, and
    generates exactly what a cold run does."""
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, enable_prefix_caching=True, block_size=8, long_prefill_token_threshold=chunk)
    assert _run(llm, prompts) == alone
    before = _hits(llm)
    again = llm.generate(prompts, PARAMS)
    llm.core.check_integrity()
    assert [o.outputs[0].token_ids for o in again] == alone
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 8 * 8 for p in prompts]
    assert _hits(llm) - before == len(prompts)


def test_tiny_snapshot_budget_evicts_and_stays_exact(kimi_linear_dir, reference):
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, enable_prefix_caching=True, block_size=8, num_state_snapshots=2)
    assert _run(llm, prompts) == alone
    assert llm.core.scheduler.stats().num_state_snapshots == 2
    again = llm.generate(prompts, PARAMS)
    llm.core.check_integrity()
    assert [o.outputs[0].token_ids for o in again] == alone
    cached = [o.num_cached_tokens for o in again]
    assert sum(cached) < sum((len(p) - 1) // 8 * 8 for p in prompts), "2 snapshots cannot serve 12 prompts"


def test_no_snapshots_means_no_hybrid_prefix_hits(kimi_linear_dir, reference):
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, enable_prefix_caching=True, num_state_snapshots=0)
    assert _run(llm, prompts[:3]) == alone[:3]
    assert [o.num_cached_tokens for o in llm.generate(prompts[:3], PARAMS)] == [0, 0, 0]


def test_next_turn_hits_the_snapshot_taken_while_decoding(kimi_linear_dir, reference):
    """Turn 2 = turn 1's prompt + output + a new user message: it resumes past turn 1's prompt, from the
    snapshot turn 1 kept at the last block boundary it reached while decoding."""
    prompts, alone = reference[0][:4], reference[1][:4]
    llm = _llm(kimi_linear_dir, enable_prefix_caching=True, block_size=8)
    assert _run(llm, prompts) == alone
    follow_up = llm.chat_prompt([{"role": "user", "content": "And then?"}])
    turn2 = [p + out + follow_up for p, out in zip(prompts, alone, strict=True)]
    cold = _run(_llm(kimi_linear_dir), turn2)
    outs = llm.generate(turn2, PARAMS)
    llm.core.check_integrity()
    assert [o.outputs[0].token_ids for o in outs] == cold
    # Turn 1 computed all but its last sampled token; its state at the last boundary before that was kept.
    turn1 = [len(p) + len(out) for p, out in zip(prompts, alone, strict=True)]
    assert [o.num_cached_tokens for o in outs] == [(n - 1) // 8 * 8 for n in turn1]


def test_shared_prefix_is_snapshotted_where_requests_branch(kimi_linear_dir):
    """Two requests sharing a system prompt leave a snapshot at the end of their common blocks; a third
    request with that system prompt resumes there."""
    system = {"role": "system", "content": "You are a terse assistant who answers in one line. " * 3}
    llm = _llm(kimi_linear_dir, enable_prefix_caching=True, block_size=8)
    prompts = [llm.chat_prompt([system, {"role": "user", "content": q}]) for q in ("Hi.", "Why?", "Ok?")]
    common = len(os.path.commonprefix(prompts))
    cold = _run(_llm(kimi_linear_dir), prompts)
    outs = [llm.generate([p], PARAMS)[0] for p in prompts]
    llm.core.check_integrity()
    assert [o.outputs[0].token_ids for o in outs] == cold
    assert [o.num_cached_tokens for o in outs] == [0, 0, common // 8 * 8]
    assert common // 8 * 8 > 0


def test_preemption_with_prefix_hits(kimi_linear_dir, reference):
    prompts, alone = reference
    llm = _llm(kimi_linear_dir, enable_prefix_caching=True, block_size=4, num_kv_blocks=60, num_state_slots=6)
    assert _run(llm, prompts) == alone
    assert _run(llm, prompts) == alone
    assert llm.core.scheduler.num_preemptions > 0
    assert _hits(llm) > 0


def test_k3_prefix_hits(kimi_k3_dir):
    cold = _llm(kimi_k3_dir)
    prompts = _prompts(cold)[:6]
    alone = _run(cold, prompts)
    llm = _llm(kimi_k3_dir, enable_prefix_caching=True, block_size=8, long_prefill_token_threshold=7)
    assert _run(llm, prompts) == alone
    assert _run(llm, prompts) == alone
    assert _hits(llm) == len(prompts)


def test_a_request_that_outgrows_the_whole_cache_fails_naming_its_size(kimi_linear_dir):
    """Alone in a 4-block cache (64 tokens), a request decoding past it preempts itself and then cannot fit
    even in the empty cache: it fails with what it needs, after the tokens it got, and nothing leaks."""
    llm = _llm(kimi_linear_dir, num_kv_blocks=4)
    out = llm.generate([list(range(10, 30))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.error) == (
        "error",
        "request needs 5 KV blocks for its 65 tokens; the cache holds 4",
    )
    assert len(completion.token_ids) == 45  # with the 20 prompt tokens, 65: the KV of the last needs a 5th block
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0.0
