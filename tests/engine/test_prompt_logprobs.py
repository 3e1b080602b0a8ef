"""Prompt logprobs: each prompt token's logprob given the ones before it, against transformers, through chunked
prefill, prefix-cache hits (turned off for them), preemption's recompute and max_tokens=0."""

from __future__ import annotations

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.engine.prompt_logprobs import PromptLogprobs
from hybridserve.sampling_params import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."
K = 3


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    """Prompt chunks of 5 tokens: a prompt's logprobs come from several steps."""
    return LLM(
        str(smollm2_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=5,
        kv_cache_prefault=False,
    )


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token at every position of `ids`."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_against(reference: torch.Tensor, ids: list[int], prompt_logprobs) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p, lp in enumerate(prompt_logprobs[1:], start=1):
        row = reference[p - 1]
        assert lp.token_id == ids[p]
        assert lp.logprob == pytest.approx(row[ids[p]].item(), abs=2e-3)
        assert lp.rank == int((row >= row[ids[p]]).sum())
        assert [t.token_id for t in lp.top] == row.topk(K).indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(row.topk(K).values.tolist(), abs=2e-3)


def test_prompt_logprobs_match_transformers_over_chunked_prefill(llm, hf_model):
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > 3 * 5
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K))[0]
    _check_against(_reference(hf_model, ids), ids, out.prompt_logprobs)
    assert len(out.outputs[0].token_ids) == 2


def test_no_prefix_hit_for_prompt_logprobs_and_max_tokens_zero(llm, hf_model):
    """The second run of the same prompt would hit the cache; one that wants prompt logprobs recomputes it.
    max_tokens=0 returns the prompt's logprobs and no token."""
    ids = llm.tokenizer.encode(TEXT + " Again.")
    warm = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert warm.prompt_logprobs is None
    again = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert again.num_cached_tokens > 0
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=K))[0]
    assert out.num_cached_tokens == 0
    _check_against(_reference(hf_model, ids), ids, out.prompt_logprobs)
    completion = out.outputs[0]
    assert (completion.token_ids, completion.text, completion.finish_reason) == ([], "", "length")
    llm.core.check_integrity()


def test_one_token_prompt_has_only_the_null_entry(llm):
    out = llm.generate([[504]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]


def test_recompute_after_preemption_computes_nothing_twice():
    """A preempted request is prefilled again from position 0: rows already computed are not picked again,
    and the logprobs are handed out once, complete."""
    prompt = [3, 1, 4, 1, 5, 2]
    acc = PromptLogprobs(prompt, 1)
    eye = torch.eye(8)

    def add(start: int, n: int) -> None:
        rows = acc.rows(start, n)
        if rows:
            acc.add(eye[[prompt[start + r] for r in rows]], start + rows.start, lambda h: h * 10, 8)

    add(0, 3)  # rows 0..2 predict tokens 1..3
    assert acc.take() is None
    assert acc.rows(0, 6) == range(3, 5)  # recomputed from 0 after preemption: only what is left
    add(0, 6)
    assert not acc.rows(0, 6)  # the last prompt token's row predicts the output, sampled elsewhere
    taken = acc.take()
    assert [lp.token_id for lp in taken] == prompt[1:]
    assert acc.take() is None and acc.rows(0, 7) == range(0)
