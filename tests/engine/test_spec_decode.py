"""Speculative decoding (n-gram drafts) is lossless: the same tokens as without it, exact ids, on every path."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hybridserve.config import EngineConfig, SchedulerConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.drafting import NgramProposer, draft_lengths
from hybridserve.engine.fanout import expand
from hybridserve.engine.llm import LLM
from hybridserve.engine.protocol import EngineCoreRequest, FinishReason, SchedulerStats, WorkerStatus
from hybridserve.engine.request import Request
from hybridserve.engine.sampler import Sampler, SampleResult, SamplingState
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.structured_output import TokenMask
from hybridserve.engine.throughput_log import ThroughputLog
from hybridserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutput
from hybridserve.serving.cli import parse_args
from hybridserve.serving.flags import model_configs
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.speculative import SpeculativeConfig, parse_speculative_config

NGRAM = SpeculativeConfig("ngram", 4)
# The engine tests check verification on every path with drafts as deep as the proposer offers; how deep a step
# lets them go is tested on its own below.
DEEP = SpeculativeConfig("ngram", 4, weight_read_tokens=float("inf"))
TEXT = "The quick brown fox jumps over the lazy dog while the farmer sleeps under the old oak tree."
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


# --- configuration ---------------------------------------------------------------------------------------------


def test_config_parses_vllm_json():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=5, prompt_lookup_min=2)
    as_mapping = EngineConfig.of(
        speculative_config={"method": "ngram", "num_speculative_tokens": 2}, kv_cache_prefault=False
    )
    assert as_mapping.scheduler.speculative_config == SpeculativeConfig("ngram", 2)
    text = '{"method": "suffix", "num_speculative_tokens": 8, "weight_read_tokens": 12.5}'
    assert parse_speculative_config(text) == SpeculativeConfig("suffix", 8, weight_read_tokens=12.5)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "lookahead"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "'eagle'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}', "prompt_lookup_min"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "weight_read_tokens": -1}', "weight_read_tokens.*-1"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "weight_read_tokens": "8"}', "weight_read_tokens.*'8'"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "weight_read_tokens": NaN}', "weight_read_tokens.*nan"),
        ("[4]", "JSON object"),
        ("{method: ngram}", "not valid JSON"),
    ],
)
def test_config_errors_name_the_key_and_value(text, named):
    with pytest.raises(InvalidParameter, match=named) as info:
        parse_speculative_config(text)
    assert info.value.param == "speculative_config"


def test_serve_flag(capsys):
    args, parser = parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert model_configs(args, parser)[0].scheduler.speculative_config == SpeculativeConfig("ngram", 2)
    with pytest.raises(SystemExit):
        parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "num_speculative_tokens must be a positive integer" in err


# --- drafting --------------------------------------------------------------------------------------------------


def _propose(proposer: NgramProposer, tokens: list[int], max_tokens: int) -> list[int]:
    """A fresh request's draft after `tokens`; the proposer forgets it again."""
    draft = proposer.propose("r", tokens, [], max_tokens)
    proposer.finish("r", [])
    return draft


def test_proposer_takes_the_longest_suffix_at_its_most_recent_occurrence():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    # "7 8 9" occurs at 0 (followed by 1 2 3) and at 5 (followed by 4 5 6): the most recent one wins.
    tokens = [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]
    assert _propose(proposer, tokens, 3) == [4, 5, 6]
    assert _propose(proposer, tokens, 2) == [4, 5]
    # Only "9" is found again (n = 1): what followed its last earlier occurrence.
    assert _propose(proposer, [9, 3, 5, 1, 9], 3) == [3, 5, 1]
    assert _propose(proposer, [1, 2, 3, 4], 3) == []  # nothing repeats
    assert _propose(proposer, [1, 2, 1], 0) == []
    assert _propose(proposer, [5, 5], 4) == [5]  # what follows is cut at the end of the tokens


def test_proposer_matches_only_on_token_boundaries():
    proposer = NgramProposer(SpeculativeConfig("ngram", 2, prompt_lookup_max=1, prompt_lookup_min=1))
    # Packed as 32-bit little-endian, 0x02010000 then 0 hold the bytes of 0x0201 across their boundary.
    assert _propose(proposer, [0x02010000, 0, 0x0201], 2) == []
    assert _propose(proposer, [0x0201, 0x02010000, 0, 0x0201], 2) == [0x02010000, 0]


def test_proposer_appends_a_request_s_new_tokens_and_forgets_it_when_it_ends():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=2))
    prompt = [1, 2, 3, 4]
    assert proposer.propose("a", prompt, [9], 3) == []
    assert proposer.propose("b", [7, 7], [], 3) == [7]  # requests apart
    assert proposer.propose("a", prompt, [9, 1, 2], 3) == [3, 4, 9]  # the prompt was not packed again
    assert len(proposer._packed["a"]) == 7 * 4
    proposer.finish("a", [9, 1, 2])
    assert list(proposer._packed) == ["b"]


# --- the scheduler: drafts in the plan, rejections rolled back ---------------------------------------------------

REPEATING = [5, 6, 7, 8, 5, 6, 7]  # with the first sampled token 8, "5 6 7 8" is found again at 0


def _scheduler(num_blocks: int = 64, **config) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, 4, True)
    return Scheduler(SchedulerConfig(speculative_config=NGRAM, **config), kv, "cpu"), kv


def _decoding(sched: Scheduler, **params) -> Request:
    """A request prefilled and sampled once (token 8): it decodes from the next plan on."""
    req = Request(EngineCoreRequest("a", list(REPEATING), SamplingParams(**params), [0], 0.0), 1024)
    sched.add(req)
    while not req.output_token_ids:  # the prompt may take several chunks
        plan = sched.schedule()
        assert [s.num_draft for s in plan.scheduled] == [0]  # no drafts while prefilling
        sched.update(plan, {"a": SampleResult(8, None)})
    return req


def _result(token: int, *accepted: int) -> SampleResult:
    return SampleResult(token, None, accepted=tuple(SampleResult(t, None) for t in accepted))


def test_scheduler_drafts_and_rolls_rejections_back():
    sched, kv = _scheduler()
    req = _decoding(sched, max_tokens=20)
    plan = sched.schedule()
    [s] = plan.scheduled
    assert (s.start, s.token_ids, s.num_draft, s.samples) == (7, [8, 5, 6, 7, 8], 4, True)
    assert len(kv.pool.cached_hashes()) == 2  # the blocks of known tokens only; the drafts' block is not findable
    [out] = sched.update(plan, {"a": _result(9, 5, 6)})  # two drafts accepted, then 9 where 7 was proposed
    assert out.new_token_ids == [5, 6, 9]
    assert req.output_token_ids == [8, 5, 6, 9]
    assert req.num_computed_tokens == 10 == req.num_tokens - 1  # the rejected positions are computed again
    stats = sched.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 4)
    assert stats.spec_decode_num_accepted_tokens == 2
    plan = sched.schedule()
    assert plan.scheduled[0].start == 10
    assert len(kv.pool.cached_hashes()) == 2  # block 2 (tokens 8..11) is not full of known tokens yet


def test_scheduler_stops_inside_an_accepted_run():
    sched, _ = _scheduler()
    req = _decoding(sched, max_tokens=20, stop_token_ids=[6])
    plan = sched.schedule()
    [out] = sched.update(plan, {"a": _result(9, 5, 6, 7)})
    assert (out.new_token_ids, out.finish_reason, out.stop_reason) == ([5, 6], FinishReason.STOP, 6)
    assert req.output_token_ids == [8, 5, 6] and not sched.running


@pytest.mark.parametrize(
    ("config", "params", "drafted"),
    [
        ({"max_num_batched_tokens": 3}, {"max_tokens": 20}, 2),  # the step budget: the last token and two drafts
        ({}, {"max_tokens": 3}, 1),  # one token sampled, one drafted, one sampled after it: max_tokens
        ({"num_blocks": 2}, {"max_tokens": 20}, 0),  # no room for the drafts' block: no draft, no preemption
    ],
)
def test_scheduler_bounds_drafts(config, params, drafted):
    sched, _ = _scheduler(**config)
    _decoding(sched, **params)
    plan = sched.schedule()
    assert [s.num_draft for s in plan.scheduled] == [drafted]
    assert sched.num_preemptions == 0


def test_scheduler_gives_grammar_requests_no_drafts():
    class Grammar:
        terminated = False

        def accept(self, token_id: int) -> bool:
            return True

    sched, _ = _scheduler()
    req = Request(EngineCoreRequest("a", list(REPEATING), SamplingParams(), [0], 0.0), 1024)
    req.grammar = Grammar()  # type: ignore[assignment]
    sched.add(req)
    sched.update(sched.schedule(), {"a": SampleResult(8, None)})
    assert [s.num_draft for s in sched.schedule().scheduled] == [0]


def _decoding_batch(size: int, reads: float, accepted: int, rejections: int) -> Scheduler:
    """`size` requests decoding side by side, each with drafts judged `accepted` + `rejections` times so far,
    under a step cost of `reads` tokens for the weight read."""
    config = SchedulerConfig(speculative_config=SpeculativeConfig("ngram", 4))
    sched = Scheduler(config, KVCacheManager(512, 4, True), "cpu", reads)
    reqs = [Request(EngineCoreRequest(f"r{i}", list(REPEATING), GREEDY, [0], 0.0), 1024) for i in range(size)]
    for req in reqs:
        sched.add(req)
    while any(not r.output_token_ids for r in reqs):
        plan = sched.schedule()
        sched.update(plan, {s.request_id: SampleResult(8, None) for s in plan.scheduled if s.samples})
    for req in reqs:
        req.draft_accepted, req.draft_rejections = accepted, rejections
    return sched


@pytest.mark.parametrize(
    ("size", "reads", "accepted", "rejections", "drafted"),
    [
        # Alone, a step costs about the weight read whatever it holds: 3 of a new request's 4 (each kept with
        # probability 1/2, 1/4, 1/8, 1/16) raise the tokens a step is expected to yield per cost, 1 / (12 + 1).
        (1, 12.0, 0, 0, [3]),
        (1, 12.0, 40, 0, [4]),  # drafts that were always kept: all four
        (1, float("inf"), 0, 0, [4]),  # a weight read that costs everything: as deep as the proposer offers
        # 32 side by side cost 12 + 32 tokens' compute: a token kept with probability 1/2 is not worth its cost,
        # but a new request still tries one (its acceptance is unknown); at 39 of 40 kept, the fourth token
        # (kept with probability 0.82) is the first not worth it.
        (32, 12.0, 0, 0, [1] * 32),
        (32, 12.0, 2, 2, [0] * 32),
        (32, 12.0, 39, 1, [3] * 32),
        (32, 0.0, 39, 1, [0] * 32),  # priced by its tokens alone, a step gains from no draft
    ],
)
def test_draft_lengths_follow_the_step_cost_and_the_acceptance(size, reads, accepted, rejections, drafted):
    sched = _decoding_batch(size, reads, accepted, rejections)
    assert [s.num_draft for s in sched.schedule().scheduled] == drafted


def test_draft_lengths_alone_weigh_each_request_by_its_own_acceptance():
    """drafting.draft_lengths without a scheduler: beside a request whose drafts were always kept, one whose drafts
    failed gets none once its acceptance is known, and a new one tries one."""
    assert draft_lengths([(40, 0), (0, 4), (0, 0)], 4, 12.0) == [4, 0, 1]
    assert draft_lengths([], 4, 12.0) == []


def test_a_request_s_acceptance_is_counted_per_judged_token():
    sched, _ = _scheduler()
    req = _decoding(sched, max_tokens=40)
    sched.update(sched.schedule(), {"a": _result(9, 5, 6)})  # two kept, the third rejected
    assert (req.draft_accepted, req.draft_rejections) == (2, 1)
    plan = sched.schedule()
    sched.update(plan, {"a": _result(1, *plan.scheduled[0].token_ids[1:])})  # every draft kept: none rejected
    assert (req.draft_accepted, req.draft_rejections) == (2 + plan.scheduled[0].num_draft, 1)


# --- the sampler: verification ---------------------------------------------------------------------------------


def _state(params: SamplingParams, outputs: list[int] | None = None) -> SamplingState:
    return SamplingState.create(params, [1, 2, 3], outputs or [], [], torch.device("cpu"))


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    sampler = Sampler(6)
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 5.0
    state = _state(SamplingParams(temperature=0.0))
    [all_kept] = sampler.verify(logits, [state], [[2, 4, 1]])
    assert ([a.token_id for a in all_kept.accepted], all_kept.token_id) == ([2, 4, 1], 3)  # and the bonus token
    [cut] = sampler.verify(logits, [state], [[2, 0, 1]])
    assert ([a.token_id for a in cut.accepted], cut.token_id) == ([2], 4)  # the argmax where the draft failed


def test_rejection_sampling_keeps_the_target_distribution():
    """Sampled with top-k and temperature: the first token is distributed as the processed target p, a draft
    token d is accepted with probability p(d), and a rejection yields p without d, renormalised."""
    generator = torch.Generator().manual_seed(0)
    vocab, draws = 8, 6000
    logits = torch.randn(2, vocab, generator=generator)
    params = SamplingParams(temperature=0.7, top_k=5, seed=1234)
    target = torch.softmax(logits[0] / 0.7, dim=-1)
    target[target < target.topk(5).values[-1]] = 0.0
    target /= target.sum()
    draft = int(target.argsort()[-2])  # the second most likely token: accepted sometimes
    sampler, state = Sampler(vocab), _state(params)
    first = torch.zeros(vocab)
    rejected = torch.zeros(vocab)
    accepted = 0
    for _ in range(draws):
        [result] = sampler.verify(logits, [state], [[draft]])
        token = result.accepted[0].token_id if result.accepted else result.token_id
        first[token] += 1
        if result.accepted:
            accepted += 1
        else:
            rejected[token] += 1
    assert (first / draws - target).abs().sum() / 2 < 0.03  # total variation distance
    assert abs(accepted / draws - target[draft]) < 0.03
    residual = target.clone()
    residual[draft] = 0.0
    assert (rejected / rejected.sum() - residual / residual.sum()).abs().sum() / 2 < 0.04
    assert rejected[draft] == 0


def test_a_seeded_request_samples_the_tokens_it_samples_without_drafts():
    """Verification draws one noise row per token it keeps: after a rejection the generator is where plain
    decoding leaves it, so later tokens agree too."""
    sampler = Sampler(50)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=99, frequency_penalty=0.5)
    plain = _state(params)
    expected = []
    for row in range(3):
        [result] = sampler(logits[row : row + 1], [plain])
        plain.output_token_ids.append(result.token_id)
        expected.append(result.token_id)
    spec = _state(params)
    wrong = next(t for t in range(50) if t != expected[1])
    [result] = sampler.verify(logits, [spec], [[expected[0], wrong]])
    assert ([a.token_id for a in result.accepted], result.token_id) == (expected[:1], expected[1])
    spec.output_token_ids.extend(expected[:2])
    [last] = sampler(logits[2:], [spec])
    assert last.token_id == expected[2]


def test_drafts_see_the_tokens_before_them_as_output():
    """min_tokens and penalties at a draft position count the drafts before it."""
    sampler = Sampler(4)
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0], [0.0, 3.0, 2.0, 0.0]])
    state = _state(SamplingParams(temperature=0.0, presence_penalty=2.0))
    [result] = sampler.verify(logits, [state], [[1]])
    assert ([a.token_id for a in result.accepted], result.token_id) == ([1], 2)  # 1 is penalised once it is output


def test_grammar_mask_rows_follow_their_requests():
    """A constrained request (no draft) next to one with a draft: its mask row lands on its own logits row."""
    sampler = Sampler(64)
    logits = torch.zeros(3, 64)
    logits[:, 9] = 5.0  # the unconstrained favourite everywhere
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # request 0 may only say 3
    mask = TokenMask(bitmask, [0])
    constrained, drafted = sampler.verify(logits, [_state(GREEDY), _state(GREEDY)], [[], [9]], mask)
    assert (constrained.token_id, constrained.accepted) == (3, ())
    assert ([a.token_id for a in drafted.accepted], drafted.token_id) == ([9], 9)
    with pytest.raises(ValueError, match="grammar-constrained"):
        sampler.verify(logits, [_state(GREEDY), _state(GREEDY)], [[9], []], mask)


# --- the engine: exact token ids against runs without speculative decoding --------------------------------------


def _llm(smollm2_dir, **config) -> LLM:
    return LLM(str(smollm2_dir), dtype="float32", device="cpu", **config, kv_cache_prefault=False)


@pytest.fixture(scope="module")
def base(smollm2_dir) -> LLM:
    return _llm(smollm2_dir)


@pytest.fixture(scope="module")
def spec(smollm2_dir) -> LLM:
    return _llm(smollm2_dir, speculative_config=DEEP)


def _prompts(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": f"Repeat this exactly: {t}"}]) for t in texts]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate(prompts, params)
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0.0, "finished requests still hold blocks"
    return outs


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _accepted(llm: LLM) -> int:
    return llm.core.stats().spec_decode_num_accepted_tokens


def test_greedy_batch_is_identical_and_drafts_are_accepted(base, spec):
    texts = [TEXT, "one two three four five six seven eight nine ten", "Roses are red, violets are blue."]
    prompts = _prompts(base, texts)
    before = _accepted(spec)
    expected = _ids(_run(base, prompts))
    assert _ids(_run(spec, prompts)) == expected
    assert _accepted(spec) > before
    stats = spec.core.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    # The same prompts again hit the prefix cache the first run filled: no rejected draft's KV was findable.
    assert _ids(_run(spec, prompts)) == expected


def test_the_engine_measures_what_a_step_costs_and_stays_lossless(base, smollm2_dir, caplog):
    """Without weight_read_tokens in the config, the engine measures the device (roofline.py) and sizes the
    drafts against it: the tokens are still plain decoding's."""
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        measured = _llm(smollm2_dir, speculative_config=NGRAM)
    assert 0 < measured.core.scheduler.weight_read_tokens < float("inf")
    assert any("a step's weight read costs" in r.getMessage() for r in caplog.records)
    prompts = _prompts(base, [TEXT, "one two three four five six seven eight nine ten"])
    assert _ids(_run(measured, prompts)) == _ids(_run(base, prompts))
    assert _accepted(measured) > 0


def test_logprobs_and_prompt_logprobs_match(base, spec):
    params = dataclasses.replace(GREEDY, logprobs=3, prompt_logprobs=2, max_tokens=24)
    prompts = _prompts(base, [TEXT])
    [want_final], [got_final] = _run(base, prompts, params), _run(spec, prompts, params)
    assert want_final.prompt_logprobs is not None and got_final.prompt_logprobs is not None
    for a, b in zip(got_final.prompt_logprobs[1:], want_final.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    [want], [got] = want_final.outputs, got_final.outputs
    assert got.token_ids == want.token_ids
    assert want.logprobs is not None and got.logprobs is not None and len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert (a.token_id, a.rank, [t.token_id for t in a.top]) == (b.token_id, b.rank, [t.token_id for t in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)


def test_stops_inside_an_accepted_run(base, spec):
    """A stop string, a stop token id and max_tokens that fall inside a run of accepted drafts end it there."""
    prompts = _prompts(base, [TEXT])
    stop_word = dataclasses.replace(GREEDY, stop=("lazy",))
    want = _run(base, prompts, stop_word)[0].outputs[0]
    got = _run(spec, prompts, stop_word)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    free = _run(base, prompts)[0].outputs[0].token_ids
    stop_id = dataclasses.replace(GREEDY, stop_token_ids=[free[12]])
    assert _ids(_run(spec, prompts, stop_id)) == _ids(_run(base, prompts, stop_id))
    short = dataclasses.replace(GREEDY, max_tokens=13)
    assert _ids(_run(spec, prompts, short)) == [[free[:13]]]


def test_seeded_sampling_with_penalties_and_n(base, spec):
    """Seeded choices (seed + i for choice i) sample the same tokens with drafts: the race couples them."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, n=2, max_tokens=24, repetition_penalty=1.1)
    prompts = _prompts(base, [TEXT])
    assert _ids(_run(spec, prompts, params)) == _ids(_run(base, prompts, params))


def _core_ids(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Requests of different parameters in one batch, straight through the engine core: ids per request."""
    ids: dict[str, list[int]] = {}
    for i, (prompt, params) in enumerate(requests):
        for child in expand(f"mixed-{i}", prompt, params, llm.eos_token_ids, llm.core.max_model_len):
            llm.core.add_request(child)
            ids[child.request_id] = []
    while llm.core.has_work():
        for out in llm.core.step().outputs:
            if out.request_id in ids:  # not an earlier test's abort, confirmed late
                assert out.error is None, out.error
                ids[out.request_id].extend(out.new_token_ids)
    llm.core.check_integrity()
    return ids


def test_structured_output_beside_drafts(base, spec):
    """A grammar-constrained request takes no drafts; batched with one that does, both keep their tokens."""
    json_params = SamplingParams(temperature=0.0, max_tokens=24, structured_output=StructuredOutput(json_object=True))
    [copy, ask] = _prompts(base, [TEXT, "a JSON object about a fox"])
    requests = [(copy, GREEDY), (ask, json_params)]
    before = _accepted(spec)
    assert _core_ids(spec, requests) == _core_ids(base, requests)
    assert _accepted(spec) > before


@pytest.fixture(scope="module")
def tight(smollm2_dir) -> LLM:
    """A step budget under one prompt's length and a KV cache too small for the batch."""
    return _llm(smollm2_dir, speculative_config=DEEP, max_num_batched_tokens=40, num_kv_blocks=12)


def test_chunked_prefill_then_drafts(base, tight):
    prompts = _prompts(base, [TEXT + " " + TEXT])
    assert len(prompts[0]) > 40
    before = _accepted(tight)
    assert _ids(_run(tight, prompts)) == _ids(_run(base, prompts))
    assert _accepted(tight) > before


def test_preemption(base, tight):
    texts = [TEXT, "one two three four five six seven eight nine ten", "Roses are red, violets are blue.", TEXT[:40]]
    prompts = _prompts(base, texts)
    before = tight.core.stats().num_preemptions
    assert _ids(_run(tight, prompts)) == _ids(_run(base, prompts))
    assert tight.core.stats().num_preemptions > before


# --- hybrid models and metrics --------------------------------------------------------------------------------------


# kimi-linear-tiny's random output seldom repeats, so its drafts are all rejected; kimi-k3-tiny's are kept in part.
@pytest.mark.parametrize(("checkpoint", "accepts"), [("kimi_linear_dir", False), ("kimi_k3_dir", True)])
def test_hybrid_models_roll_rejected_drafts_out_of_the_recurrent_state(checkpoint, accepts, request):
    """KDA state went through the whole draft: after a rejection it is restored and the kept tokens rerun, so
    greedy tokens stay those of plain decoding (with prefix caching and its snapshots on)."""
    hf_dir = request.getfixturevalue(checkpoint)
    base, spec = _llm(hf_dir), _llm(hf_dir, speculative_config=DEEP)
    prompts = _prompts(base, [TEXT, "abc abc abc abc abc", "1 2 3 1 2 3 1 2"])
    assert _ids(_run(spec, prompts)) == _ids(_run(base, prompts))
    stats = spec.core.stats()
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # rolled back
    assert (stats.spec_decode_num_accepted_tokens > 0) == accepts


def test_prometheus_counts_drafted_and_accepted_tokens():
    stats = SchedulerStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7)
    metrics = ServingMetrics("m", lambda: [WorkerStatus("w0", "up", None, stats)])
    text = metrics.render()[0].decode()
    for name, value in [("num_drafts", 3), ("num_draft_tokens", 12), ("num_accepted_tokens", 7)]:
        assert f'hybridserve:spec_decode_{name}_total{{model_name="m",worker="w0"}} {value}.0' in text


def test_acceptance_log_line(caplog):
    log = ThroughputLog(interval_s=0.0)
    log.record(5, 3, 0.01)
    stats = SchedulerStats(spec_decode_num_drafts=1, spec_decode_num_draft_tokens=4, spec_decode_num_accepted_tokens=2)
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        log.maybe_log(stats)
        log.record(1, 1, 0.01)
        log.maybe_log(stats)  # nothing drafted since the last line: no acceptance line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculative decoding")]
    assert lines == [
        "speculative decoding: acceptance 50.0% (2 of 4 draft tokens), 3.00 tokens per verification (1 verifications)"
    ]
