"""Exact sampler behaviour on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.engine.sampler import Sampler, SamplingState, apply_penalties
from hybridserve.sampling_params import InvalidParameter, SamplingParams

CPU = torch.device("cpu")
EOS = 0


def state(output: list[int] | None = None, prompt: list[int] | None = None, **kwargs: object) -> SamplingState:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    return SamplingState.create(params, prompt or [], [] if output is None else output, [EOS], CPU)


def tokens(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    return [r.token_id for r in sampler(logits, states)]


def processed(logits: list[float], s: SamplingState) -> list[float]:
    x = torch.tensor([logits])
    apply_penalties(x, [s])
    return x[0].tolist()


def run_steps(s: SamplingState, logits: torch.Tensor, steps: int, others: list[SamplingState]) -> list[int]:
    """Sample `steps` tokens for `s` placed in the middle of a batch with `others`, appending each."""
    sampler = Sampler(logits.shape[-1])
    half = len(others) // 2
    batch = [*others[:half], s, *others[half:]]
    rows = logits.expand(len(batch), -1)
    for _ in range(steps):
        s.output_token_ids.append(sampler(rows, batch)[half].token_id)
    return list(s.output_token_ids)


# greedy


def test_greedy_is_argmax_and_ties_take_lowest_id() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 1.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    assert tokens(Sampler(4), logits, [state(temperature=0.0)] * 3) == [1, 0, 0]


def test_greedy_on_half_precision_and_padded_vocab() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]], dtype=torch.bfloat16)  # column 3 is LM-head padding
    assert tokens(Sampler(3), logits, [state(temperature=0.0)]) == [2]


def test_empty_batch() -> None:
    assert Sampler(4)(torch.zeros(0, 4), []) == []


def test_wrong_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(8)(torch.zeros(1, 4), [state()])
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(4)(torch.zeros(2, 4), [state()])


# random sampling


def test_temperature_sampling_matches_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    draws = 4000
    batch = [state(temperature=0.5, seed=1234)] * draws  # one generator shared by all rows
    counts = torch.bincount(torch.tensor(tokens(Sampler(4), logits.expand(draws, -1), batch)), minlength=4)
    expected = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(counts / draws, expected, atol=0.03)


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7}
    alone = run_steps(state(**params), logits, 20, [])
    others = [
        state(temperature=0.8, seed=99),
        state(temperature=1.3),
        state(temperature=0.0),
        state(temperature=1.0, top_k=3),
    ]
    batched = run_steps(state(**params), logits, 20, others)
    assert alone == batched
    assert len(set(alone)) > 1


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    assert run_steps(state(seed=1), logits, 10, []) != run_steps(state(seed=2), logits, 10, [])


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 50)
    batch = [state(temperature=2.0, top_k=1) for _ in range(16)]
    assert tokens(Sampler(50), logits, batch) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_best() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 50)
    batch = [state(temperature=2.0, top_p=1e-6) for _ in range(16)]
    assert tokens(Sampler(50), logits, batch) == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(500, -1)
    batch = [state(top_p=0.7, seed=i) for i in range(500)]  # nucleus {0, 1}: 0.5 < 0.7 <= 0.8
    seen = set(tokens(Sampler(4), logits, batch))
    assert seen == {0, 1}


def test_top_p_nucleus_larger_than_the_candidate_window() -> None:
    logits = torch.linspace(0.0, -2.0, 3000)
    ordered = torch.softmax(logits.double(), dim=-1)  # already best first
    nucleus = int(((ordered.cumsum(0) - ordered) < 0.6).sum())
    assert 1024 < nucleus < 3000
    drawn = tokens(Sampler(3000), logits.expand(500, -1), [state(top_p=0.6, seed=5)] * 500)
    assert 1024 <= max(drawn) < nucleus


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(500, -1)
    batch = [state(min_p=0.5, seed=i) for i in range(500)]  # keep p >= 0.25
    assert set(tokens(Sampler(4), logits, batch)) == {0, 1}


def test_mixed_greedy_and_random_rows_keep_their_order() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [9.0, 0.0, 0.0]])
    batch = [state(temperature=0.0), state(top_k=1, seed=3), state(temperature=0.0)]
    assert tokens(Sampler(3), logits, batch) == [1, 2, 0]


# logit processing


def test_logit_bias_forbids_and_forces() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 2)
    forbid = state(temperature=0.0, logit_bias={1: -100.0})
    force = state(temperature=0.0, logit_bias={2: 100.0})
    assert tokens(Sampler(4), logits, [forbid, force]) == [3, 2]
    assert processed([0.0, 5.0, 1.0, 2.0], force) == [0.0, 5.0, 101.0, 2.0]


def test_logit_bias_outside_vocab_names_the_id() -> None:
    with pytest.raises(ValueError, match="logit_bias token id 9 "):
        Sampler(4)(torch.zeros(1, 4), [state(logit_bias={9: 1.0})])


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    s = state(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert s.blocked_until_min_tokens == [EOS, 3]
    logits = torch.tensor([[9.0, 1.0, 2.0, 8.0]])
    sampler = Sampler(4)
    assert processed([9.0, 1.0, 2.0, 8.0], s) == [-math.inf, 1.0, 2.0, -math.inf]
    s.output_token_ids.append(tokens(sampler, logits, [s])[0])
    s.output_token_ids.append(tokens(sampler, logits, [s])[0])
    assert s.output_token_ids == [2, 2]
    assert tokens(sampler, logits, [s]) == [EOS]


def test_stop_token_outside_vocab_names_the_id() -> None:
    with pytest.raises(ValueError, match="stop or EOS token id 7 "):
        Sampler(4)(torch.zeros(1, 4), [state(min_tokens=1, stop_token_ids=(7,))])


def test_ignore_eos_does_not_block_eos() -> None:
    assert state(min_tokens=2, stop_token_ids=(3,), ignore_eos=True).blocked_until_min_tokens == [3]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    s = state(prompt=[0, 1, 0], output=[2, 0], repetition_penalty=2.0)  # repeats penalised once
    assert processed([4.0, -4.0, 3.0, 5.0, -1.0], s) == [2.0, -8.0, 1.5, 5.0, -1.0]


def test_frequency_and_presence_penalties_use_output_counts() -> None:
    s = state(prompt=[3], output=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    assert processed([1.0, 1.0, 1.0, 1.0], s) == [1.0, -0.25, 0.25, 1.0]


def test_penalties_only_touch_their_rows_and_keep_caller_lists() -> None:
    prompt, output = [0, 1], [2]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={3: 1.0})
    s = SamplingState.create(params, prompt, output, [EOS], CPU)
    x = torch.ones(2, 4)
    apply_penalties(x, [state(), s])
    assert x.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, -0.5, 2.0]]
    assert (prompt, output, params.stop_token_ids) == ([0, 1], [2], ())


def test_caller_logits_are_not_modified() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    Sampler(3)(logits, [state(temperature=0.7, logit_bias={0: 5.0}, logprobs=1)])
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


# logprobs


def test_logprobs_are_raw_log_softmax_with_rank_and_top() -> None:
    raw = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 1.0, 2.0, 3.0]])
    expected = torch.log_softmax(raw, dim=-1)
    forced = state(temperature=0.0, logprobs=2, logit_bias={0: 100.0}, repetition_penalty=1.5, prompt=[1])
    plain = state(temperature=0.0)
    results = Sampler(4)(raw, [forced, plain])
    lp = results[0].logprobs
    assert lp is not None and results[0].token_id == 0
    assert lp.token_id == 0 and lp.logprob == pytest.approx(expected[0, 0].item(), abs=1e-6)
    assert lp.rank == 3
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([expected[0, 1].item(), expected[0, 2].item()], abs=1e-6)
    assert results[1].logprobs is None and results[1].token_id == 3


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    raw = torch.tensor([[1.0, 3.0, 2.0]])
    (result,) = Sampler(3)(raw, [state(temperature=0.0, logprobs=0)])
    assert result.logprobs is not None
    assert (result.token_id, result.logprobs.rank, result.logprobs.top) == (1, 1, [])
    assert result.logprobs.logprob == pytest.approx(torch.log_softmax(raw, -1)[0, 1].item(), abs=1e-6)


def test_logprobs_with_different_k_in_one_batch() -> None:
    raw = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    results = Sampler(4)(raw, [state(temperature=0.0, logprobs=3), state(temperature=0.0, logprobs=1)])
    assert [[t for t, _ in r.logprobs.top] for r in results if r.logprobs] == [[0, 1, 2], [0]]


def test_seed_outside_int64_is_rejected_before_the_engine() -> None:
    with pytest.raises(InvalidParameter, match="seed must fit in a signed 64-bit integer, got 18446744073709551616"):
        SamplingParams(seed=2**64)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
